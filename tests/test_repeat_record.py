"""experiments/repeat_record.py: a record's own command run again, and where it differs."""

import json
import os
import subprocess
import sys

import pytest

from acl_jax import host
from conftest import REPO_ROOT

import repeat_record


def test_a_repeat_on_this_machine_matches_and_a_changed_record_is_caught(
    tiny_bert_dir, glue_dir, tmp_path, monkeypatch):
  for name, value in (("GLUE_DIR", str(glue_dir)), ("ACL_JAX_CACHE", str(tmp_path / "cache")),
                      ("HF_HUB_OFFLINE", "1")):
    monkeypatch.setenv(name, value)
  record = tmp_path / "records" / "rte_ce_s0"
  subprocess.run([sys.executable, "-m", "acl_jax.main",
                  f"--config=configs/glue.py:rte,model={tiny_bert_dir},max_steps=6,"
                  "batch_size=8,max_length=32", "--config.log_every=2", f"--workdir={record}"],
                 cwd=REPO_ROOT, check=True, capture_output=True)
  out, root = tmp_path / "repeats.jsonl", tmp_path / "repeats"
  core = str(min(os.sched_getaffinity(0)))
  flags = ["--checkout", str(REPO_ROOT), "--root", str(root), "--cores", core, "--out", str(out)]

  repeat_record.main([str(record), *flags])
  (line,) = map(json.loads, out.read_text().splitlines())
  assert line["cpu"] == line["record_cpu"] == host.cpu_fingerprint()
  assert line["compared_steps"] == 3 and line["first_loss_difference_step"] is None
  assert line["max_relative_loss_difference"] == 0.0 and line["evaluations_equal"]
  (evaluation,) = line["evaluations"]
  assert evaluation["step"] == 6 and evaluation["record"] == evaluation["repeat"]
  assert "eval/validation/accuracy" in evaluation["record"]
  assert line["main_metric"] == "eval/validation/accuracy"
  assert line["command"].startswith("python -m acl_jax.main --config=configs/glue.py:rte,")
  assert line["command"].endswith(f"--workdir={root / 'rte_ce_s0'}")

  # A record whose step-4 loss and dev accuracy differ: compared again without training.
  rows = [json.loads(row) for row in (record / "metrics.jsonl").read_text().splitlines()]
  for row in rows:
    if row["step"] == 4 and "loss" in row:
      row["loss"] *= 1 + 1e-6
    if "eval/validation/accuracy" in row:
      row["eval/validation/accuracy"] += 0.01
  (record / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
  log = (root / "rte_ce_s0" / "log.txt").read_text()
  repeat_record.main([str(record), *flags])
  assert (root / "rte_ce_s0" / "log.txt").read_text() == log  # no second training
  changed = json.loads(out.read_text().splitlines()[1])
  assert changed["first_loss_difference_step"] == 4 and not changed["evaluations_equal"]
  assert changed["max_relative_loss_difference"] == pytest.approx(1e-6, rel=1e-3)

  saved = json.loads((record / "config.json").read_text())
  saved["meta"]["git_commit"] = "0" * 40
  (record / "config.json").write_text(json.dumps(saved))
  with pytest.raises(SystemExit, match=f"{record} was recorded at 0000000000000000000000000000"
                     f"000000000000; {REPO_ROOT} is at "):
    repeat_record.main([str(record), *flags])


@pytest.mark.parametrize("stopped", ["record", "repeat"])
def test_a_run_stopped_and_resumed_is_compared_over_the_same_windows(tmp_path, stopped):
  """A stop logs a row at its step (3), and the next row (4) is the mean of fewer steps: that
  row is not compared, the rows before and after are, whichever of the two was stopped."""
  rows = {"record": [(2, 0.9), (4, 0.8), (6, 0.7)], "repeat": [(2, 0.9), (4, 0.8), (6, 0.7)]}
  rows[stopped] = [(2, 0.9), (3, 0.85), (4, 0.75), (6, 0.7)]
  for name, losses in rows.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": loss}) + "\n" for step, loss in losses)
        + json.dumps({"step": 6, "eval/validation/accuracy": 0.5}) + "\n")
  result = repeat_record.compare(tmp_path / "record", tmp_path / "repeat")
  assert result["compared_steps"] == 2 and result["first_loss_difference_step"] is None
  assert result["evaluations_equal"]
  (tmp_path / "repeat" / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 0.9}))
  with pytest.raises(SystemExit, match="logged its last loss at step 2, .* at 6: not the same"):
    repeat_record.compare(tmp_path / "record", tmp_path / "repeat")
