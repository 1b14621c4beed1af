"""experiments/summarize.py: seeds grouped, mean and std, earlier summaries' runs merged."""

import json
import pathlib
import statistics
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
import summarize

from acl_jax import config as config_lib


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


@pytest.mark.parametrize("meta, cpu", [
    ({"cpu": "e51468c5bac4503e", "compilation_cache": "/c/xla/4202c509659cc6d0"},
     "e51468c5bac4503e"),  # recorded since the field exists
    ({"compilation_cache": "/work/fair_runs/cache/xla/4202c509659cc6d0"}, "4202c509659cc6d0"),
    ({"compilation_cache": "/home/me/jax_cache"}, None),  # a cache directory of one's own
    ({"compilation_cache": None}, None),  # --compilation_cache=none
])
def test_a_run_names_its_cpu_by_the_field_or_by_its_automatic_cache_directory(tmp_path, meta,
                                                                                cpu):
  workdir = _run_dir(tmp_path, "rte", 0, 0.5)
  saved = json.loads((workdir / "config.json").read_text())
  saved["meta"].update(meta)
  (workdir / "config.json").write_text(json.dumps(saved))
  assert summarize.load_run(workdir)["cpu"] == cpu


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


def test_mean_and_sample_std_cells():
  assert summarize.pm([0.5, 0.6], ".4f") == (
      f"{statistics.fmean([0.5, 0.6]):.4f} ± {statistics.stdev([0.5, 0.6]):.4f}")
  assert summarize.pm([0.5704], ".4f") == "0.5704"  # one run has no sample std: not "± nan"
  assert summarize.pm([]) == ""


def test_a_loss_weight_off_its_default_is_its_own_labelled_group(tmp_path):
  """Two ACL-CL runs with different mu are never averaged as if they were seeds; older records
  without the field count as the default. The defaults are acl_jax.config's."""
  config = config_lib.get_config("rte")
  assert {key: default for key, (default, _, _) in summarize.TUNED.items()} == {
      key: summarize.config_value(config, key) for key in summarize.TUNED}
  runs = [_run_dir(tmp_path, "rte", 0, 0.5, name="a", objective="acl_cl", cl_weight=0.5),
          _run_dir(tmp_path, "rte", 1, 0.6, name="b", objective="acl_cl"),  # no field: 0.5
          _run_dir(tmp_path, "rte", 0, 0.7, name="c", objective="acl_cl", cl_weight=0.1),
          _run_dir(tmp_path, "rte", 0, 0.8, name="d", objective="ce", cl_weight=0.1),
          _run_dir(tmp_path, "rte", 0, 0.6, name="e", objective="acl_cl",
                   normalize_label_embeddings=False, cl_anchors="samples")]
  out = tmp_path / "table"
  subprocess.run([sys.executable, "experiments/summarize.py", *map(str, runs), "--out", str(out)],
                 cwd=REPO_ROOT, check=True, capture_output=True)
  table = out.with_suffix(".md").read_text()
  mean, std = statistics.fmean([0.5, 0.6]), statistics.stdev([0.5, 0.6])
  assert f"| acl_cl | 0.0001 | 3 | 0,1 | validation/accuracy {mean:.4f} ± {std:.4f}" in table
  assert "| acl_cl, μ 0.1 | 0.0001 | 3 | 0 | validation/accuracy 0.7000" in table
  assert "| ce | 0.0001 | 3 | 0 | validation/accuracy 0.8000" in table  # mu does not act on CE
  assert ("| acl_cl, ACL-CL anchors samples, normalized label embeddings False | 0.0001 | 3 | 0 "
          "| validation/accuracy 0.6000") in table


def _summarize(*args):
  return subprocess.run([sys.executable, "experiments/summarize.py", *map(str, args)],
                        cwd=REPO_ROOT, capture_output=True, text=True)


def test_a_run_given_twice_counts_once_and_two_runs_of_one_seed_are_refused(tmp_path):
  """An earlier summary's .jsonl plus the run directories it came from (the old documented
  acl_minilm command) must not count a run twice; a different run with the same config and
  seed must not be averaged in as if it were another seed."""
  runs = [_run_dir(tmp_path, "cola", 0, 0.2), _run_dir(tmp_path, "cola", 1, 0.3)]
  earlier = tmp_path / "earlier"
  assert _summarize(*runs, "--out", earlier).returncode == 0
  out = tmp_path / "table"
  result = _summarize(f"{earlier}.jsonl", *runs, "--out", out)
  assert result.returncode == 0, result.stderr
  assert "counted once" in result.stderr
  rows = out.with_suffix(".jsonl").read_text().splitlines()
  assert sorted(json.loads(line)["seed"] for line in rows) == [0, 1]
  mean, std = statistics.fmean([0.2, 0.3]), statistics.stdev([0.2, 0.3])
  assert f"| 0,1 | validation/accuracy {mean:.4f} ± {std:.4f} |" in out.with_suffix(".md").read_text()

  other = _run_dir(tmp_path, "cola", 0, 0.25, name="rerun_s0")  # same config and seed
  result = _summarize(*runs, other, "--out", tmp_path / "refused")
  assert result.returncode != 0
  assert "same configuration and seed" in result.stderr
  assert not (tmp_path / "refused.md").exists()
  # A different configuration with the same seed is its own group, not a duplicate.
  other_lr = _run_dir(tmp_path, "cola", 0, 0.25, name="lr_s0", learning_rate=5e-5)
  assert _summarize(*runs, other_lr, "--out", tmp_path / "lr").returncode == 0


def test_config_fields_are_read_by_their_new_or_old_names(tmp_path):
  """Records keep the field names they were written with (lambda, gate, pooler, exit_pooling);
  newer records use aux_weight, gate_granularity, pooler_weights, pooler_input."""
  old = {"lambda": 0.9, "gate": "global", "pooler": "shared", "exit_pooling": "mean"}
  new = {"aux_weight": 0.9, "gate_granularity": "global", "pooler_weights": "shared",
         "pooler_input": "mean"}
  for name in new:
    assert summarize.config_value(old, name) == summarize.config_value(new, name) == new[name]
  assert summarize.config_value({"aux_weight": 0.1, "lambda": 0.9}, "aux_weight") == 0.1
  assert summarize.config_value({}, "pooler_input", "cls") == "cls"
  runs = [_run_dir(tmp_path, "rte", 0, 0.5, name="old", objective="acl_cl", multi_exit=False,
                   **{"lambda": 0.9}),
          _run_dir(tmp_path, "rte", 1, 0.6, name="new", objective="acl_cl", aux_weight=0.9)]
  out = tmp_path / "table"
  assert _summarize(*runs, "--out", out).returncode == 0
  assert "| acl_cl, λ 0.9 | 0.0001 | 3 | 0,1 |" in out.with_suffix(".md").read_text()


NOTEBOOK = REPO_ROOT / "experiments" / "results" / "README.md"


@pytest.mark.parametrize("notebook", [NOTEBOOK, REPO_ROOT / "README.md"], ids=lambda p: p.parent.name)
def test_the_committed_notebook_matches_the_committed_records(notebook):
  """Every generated block of experiments/results/README.md, and of the top-level README's
  results summary, is what the records give now."""
  result = _summarize("--notebook", notebook, "--check")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def test_notebook_regeneration_is_idempotent_and_check_catches_a_hand_edit(tmp_path):
  committed = NOTEBOOK.read_text()
  notebook = tmp_path / "README.md"
  # A hand-edited number inside a generated block: the single-exit grid's RTE CE mean.
  assert committed.count("| CE | 0.578 ± 0.006 |") == 1
  notebook.write_text(committed.replace("| CE | 0.578 ± 0.006 |", "| CE | 0.598 ± 0.006 |"))
  result = _summarize("--notebook", notebook, "--check")
  assert result.returncode == 1
  assert "-| CE | 0.598 ± 0.006 |" in result.stdout and "+| CE | 0.578 ± 0.006 |" in result.stdout
  assert "0.598" in notebook.read_text()  # --check writes nothing
  assert _summarize("--notebook", notebook).returncode == 0
  assert notebook.read_text() == committed
  assert _summarize("--notebook", notebook).returncode == 0
  assert notebook.read_text() == committed
  # An emptied block is filled again; an unknown block name is an error.
  start, end = "<!-- summarize:acl_grid -->\n", "<!-- /summarize:acl_grid -->"
  head, rest = committed.split(start)
  notebook.write_text(head + start + rest[rest.index(end):])
  assert _summarize("--notebook", notebook, "--check").returncode == 1
  assert _summarize("--notebook", notebook).returncode == 0
  assert notebook.read_text() == committed
  notebook.write_text(committed + "\n<!-- summarize:nonesuch -->\n<!-- /summarize:nonesuch -->\n")
  result = _summarize("--notebook", notebook)
  assert result.returncode != 0 and "nonesuch" in result.stderr


def test_the_notebook_states_what_the_records_give_for_the_corrected_claims():
  """The claims a review found stale, computed here from the records directly."""
  import glob
  sweeps = {path.split("/")[-2]: json.loads(pathlib.Path(path).read_text()) for path in
            glob.glob(str(REPO_ROOT / "experiments/results/records/me_minilm/*_s0/early_exit.json"))}
  text = NOTEBOOK.read_text()
  slower = [c["per_layer_latency_ms"] / c["compiled_latency_ms"] - 1
            for s in sweeps.values() for c in s["runner_comparison"]]
  assert f"is {100 * min(slower):.0f}-{100 * max(slower):.0f}% slower" in text
  mrpc = [b["throughput_gain"] for name, s in sweeps.items() if name.startswith("mrpc")
          for b in s["batched"] if b["policy"] == "patience"]
  assert f"gives {min(mrpc):.2f}-{max(mrpc):.2f}x the full model's throughput" in text
  cola3 = [r["measured_over_counted"] for name, s in sweeps.items() if name.startswith("cola")
           for rows in s["policies"].values() for r in rows if abs(r["speedup_ratio"] - 3) < 0.01]
  assert f"and {min(cola3):.2f}-{max(cola3):.2f} on CoLA" in text
  assert "1.23-1.35x" in text and "5-23% slower" in text and "0.78-0.89 on CoLA" in text
  assert "Measured / counted at these two points: 0.85-0.91." in text
