"""experiments/pilot_gradient_angle.py --runs: the angle statistics of finished runs' per-batch
cosines, without training."""

import json

import numpy as np
import pytest

import pilot_gradient_angle


def write_run(path, objective, cosines, **config):
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps({
      "config": {"task": "mrpc", "model": "minilm", "objective": objective, "seed": 0,
                 "learning_rate": 1e-4, "temperature": 0.3, "aux_weight": 0.5, "log_every": 1,
                 **config},
      "meta": {"git_commit": "abc", "machine": "m"}}))
  rows = [{"step": i + 1, "loss": 1.0, "cosine": c} for i, c in enumerate(cosines)]
  rows.insert(2, {"step": 3, "eval/validation/f1": 0.8})  # eval lines carry no cosine
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (path / "eval_results.json").write_text(json.dumps({"final": {"validation": {"f1": 0.8}}}))
  return path


def test_finished_runs_are_drawn_without_training(tmp_path):
  cosines = [0.5, -0.1, 0.0, 0.2, -0.5, 0.9]
  scl = write_run(tmp_path / "scl", "scl", cosines, measure_conflict=True)
  acl = write_run(tmp_path / "acl", "acl", [0.1] * 6)  # gated: cosines without the switch
  out = tmp_path / "pilot"
  pilot_gradient_angle.main(["--runs", str(scl), str(acl), "--out", str(out)])
  summary = json.loads(out.with_suffix(".json").read_text())
  angles = np.degrees(np.arccos(cosines))
  assert summary["scl"]["batches"] == 6
  assert summary["scl"]["fraction_above_90"] == pytest.approx(np.mean(angles > 90))  # 2 of 6
  assert summary["scl"]["mean"] == pytest.approx(angles.mean())
  assert summary["acl"]["fraction_above_90"] == 0.0 and summary["scl"]["aux_weight"] == 0.5
  assert out.with_suffix(".png").stat().st_size > 1000


def test_a_run_without_per_batch_cosines_is_refused(tmp_path):
  windowed = write_run(tmp_path / "a", "scl", [0.1], measure_conflict=True, log_every=20)
  with pytest.raises(SystemExit, match="log_every=1"):
    pilot_gradient_angle.main(["--runs", str(windowed), "--out", str(tmp_path / "p")])
  ungated = write_run(tmp_path / "b", "scl", [0.1])
  with pytest.raises(SystemExit, match="measure_conflict"):
    pilot_gradient_angle.main(["--runs", str(ungated), "--out", str(tmp_path / "p")])
