"""experiments/summarize.py: seeds grouped, mean and std, earlier summaries' runs merged."""

import json
import statistics
import subprocess
import sys

from conftest import REPO_ROOT


def _run_dir(root, task, seed, accuracy, name=None, **config_overrides):
  workdir = root / (name or f"{task}_ce_s{seed}")
  workdir.mkdir(parents=True)
  config = {"task": task, "model": "minilm", "objective": "ce", "learning_rate": 1e-4,
            "num_epochs": 3, "max_steps": 0, "batch_size": 32, "seed": seed, **config_overrides}
  meta = {"argv": ["/x/acl_jax/main.py", f"--config=configs/glue.py:{task},seed={seed}"],
          "git_commit": "abc", "machine": "m", "backend": "cpu", "versions": {}}
  (workdir / "config.json").write_text(json.dumps({"config": config, "meta": meta}))
  (workdir / "eval_results.json").write_text(json.dumps({
      "final": {"step": 10, "validation": {"accuracy": accuracy}},
      "main_metric": "validation/accuracy",
      "train": {"seconds": 1.0, "examples_per_s": 2.0, "steps": 10}}))
  return workdir


def test_seeds_are_grouped_and_earlier_summaries_merged(tmp_path):
  runs = [_run_dir(tmp_path, "rte", 0, 0.5), _run_dir(tmp_path, "rte", 1, 0.6),
          _run_dir(tmp_path, "cola", 0, 0.9)]
  earlier = tmp_path / "earlier"
  subprocess.run([sys.executable, "experiments/summarize.py", str(runs[0]),
                  "--out", str(earlier)], cwd=REPO_ROOT, check=True, capture_output=True)
  # The earlier summary's run (seed 0) stands in for a run directory that is gone.
  runs[0].joinpath("eval_results.json").unlink()
  out = tmp_path / "table"
  subprocess.run([sys.executable, "experiments/summarize.py", str(earlier) + ".jsonl",
                  *map(str, runs), "--tasks", "rte", "--out", str(out)], cwd=REPO_ROOT,
                 check=True, capture_output=True)
  rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
  assert sorted((r["task"], r["seed"]) for r in rows) == [("rte", 0), ("rte", 1)]
  table = out.with_suffix(".md").read_text()
  mean, std = statistics.fmean([0.5, 0.6]), statistics.stdev([0.5, 0.6])
  assert f"| rte | minilm | ce | 0.0001 | 3 | 0,1 | validation/accuracy {mean:.4f} ± {std:.4f}" in table
  assert "cola" not in table
  assert rows[0]["command"].startswith("python -m acl_jax.main --config=configs/glue.py:rte")


def test_a_loss_weight_off_its_default_is_its_own_labelled_group(tmp_path):
  """Two ACL-CL runs with different mu are never averaged as if they were seeds; older records
  without the field count as the default. The defaults are configs/glue.py's."""
  from configs import glue
  sys.path.insert(0, str(REPO_ROOT / "experiments"))
  import summarize
  config = glue.get_config("rte")
  assert {key: default for key, (default, _, _) in summarize.TUNED.items()} == {
      key: config[key] for key in summarize.TUNED}
  runs = [_run_dir(tmp_path, "rte", 0, 0.5, name="a", objective="acl_cl", cl_weight=0.5),
          _run_dir(tmp_path, "rte", 1, 0.6, name="b", objective="acl_cl"),  # no field: 0.5
          _run_dir(tmp_path, "rte", 0, 0.7, name="c", objective="acl_cl", cl_weight=0.1),
          _run_dir(tmp_path, "rte", 0, 0.8, name="d", objective="ce", cl_weight=0.1)]
  out = tmp_path / "table"
  subprocess.run([sys.executable, "experiments/summarize.py", *map(str, runs), "--out", str(out)],
                 cwd=REPO_ROOT, check=True, capture_output=True)
  table = out.with_suffix(".md").read_text()
  mean, std = statistics.fmean([0.5, 0.6]), statistics.stdev([0.5, 0.6])
  assert f"| acl_cl | 0.0001 | 3 | 0,1 | validation/accuracy {mean:.4f} ± {std:.4f}" in table
  assert "| acl_cl, μ 0.1 | 0.0001 | 3 | 0 | validation/accuracy 0.7000" in table
  assert "| ce | 0.0001 | 3 | 0 | validation/accuracy 0.8000" in table  # mu does not act on CE
