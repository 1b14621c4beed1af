"""experiments/fair.py: the fair comparison's choices, next commands and tables, from records
written here as run_grid keeps them (config.json and eval_results.json)."""

import json
import math
import pathlib
import subprocess

import numpy as np
import pytest
from scipy import stats

import fair

COMMIT, MACHINE = "5eb4784f7ffe", {"cpu": "AMD EPYC", "cores": 2}


def write_record(root: pathlib.Path, task, objective, seed, score, *, lr=1e-4, aux=0.5,
                 temperature=0.3, multi_exit=False, gate="per_exit", commit=COMMIT,
                 early_exit=None) -> None:
  name = f"{task}_{objective}_s{seed}_lr{lr}_a{aux}_t{temperature}_{multi_exit}_{gate}"
  path = root / name
  path.mkdir(parents=True)
  metric = {"rte": "accuracy", "mrpc": "f1", "cola": "mcc"}[task]
  config = {"task": task, "model": "minilm", "objective": objective, "multi_exit": multi_exit,
            "learning_rate": lr, "num_epochs": 3, "max_steps": 0, "batch_size": 32,
            "seed": seed, "aux_weight": aux, "temperature": temperature, "cl_weight": 0.5,
            "gate_granularity": gate, "pooler_input": "mean" if multi_exit else "cls"}
  meta = {"argv": ["acl_jax/main.py"], "git_commit": commit, "machine": MACHINE,
          "backend": "cpu", "versions": {}}
  (path / "config.json").write_text(json.dumps({"config": config, "meta": meta}))
  main = f"validation/avg/{metric}" if multi_exit else f"validation/{metric}"
  final = ({"validation": {f"exit1/{metric}": score / 2, f"avg/{metric}": score}}
           if multi_exit else {"validation": {metric: score}})
  (path / "eval_results.json").write_text(json.dumps({
      "final": {"step": 10, **final}, "main_metric": main,
      "train": {"seconds": 1.0, "examples_per_s": 1.0, "steps": 10}}))
  if early_exit is not None:
    (path / "early_exit.json").write_text(json.dumps(early_exit))


def selection(root, task="rte", ce=(0.6, 0.7, 0.7), scl=None, acl=None):
  """Seed-0 records: CE at each learning rate; CE+SCL and ACL over λ x τ at 1e-4 with the
  given {(λ, τ): score} (every other point scoring 0.5)."""
  for lr, score in zip(fair.LEARNING_RATES, ce):
    write_record(root, task, "ce", 0, score, lr=lr)
  for objective, best in (("scl", scl), ("acl", acl)):
    if best is None:
      continue
    for aux in fair.AUX_WEIGHTS:
      for temperature in fair.TEMPERATURES:
        write_record(root, task, objective, 0, best.get((aux, temperature), 0.5), lr=1e-4,
                     aux=aux, temperature=temperature)


def test_a_choice_waits_for_its_whole_grid_and_breaks_ties_by_the_listed_order(tmp_path):
  selection(tmp_path, ce=(0.6, 0.7, 0.7))
  runs = fair.read_records(tmp_path)
  chosen, missing = fair.choose(runs, "rte", "ce", {"learning_rate": fair.LEARNING_RATES})
  assert chosen == {"learning_rate": 1e-4} and missing == []  # 1e-4 and 2e-4 tie: 1e-4 first
  for path in tmp_path.glob("rte_ce_s0_lr0.0002*"):
    (path / "eval_results.json").unlink()
  chosen, missing = fair.choose(fair.read_records(tmp_path), "rte", "ce",
                                {"learning_rate": fair.LEARNING_RATES})
  assert chosen is None and missing == [{"learning_rate": 2e-4}]


def test_each_stage_is_planned_once_the_choices_it_needs_are_made(tmp_path):
  selection(tmp_path, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9, (0.1, 0.1): 0.9})
  runs = fair.read_records(tmp_path)
  chosen = fair.choices(runs)
  assert chosen["rte"] == {"ce": {"learning_rate": 1e-4},
                           "scl": {"learning_rate": 1e-4, "aux_weight": 0.3, "temperature": 0.1},
                           "acl": {"learning_rate": 1e-4, "aux_weight": 0.1, "temperature": 0.1}}
  assert chosen["mrpc"] == {"ce": None, "scl": None, "acl": None}
  commands = [" ".join(c) for c in fair.next_commands(runs, tmp_path / "fair_1")]
  mrpc = [c for c in commands if "--tasks mrpc" in c]
  assert len(mrpc) == 1 and "--grid learning_rate=5e-05,0.0001,0.0002" in mrpc[0]
  rte = [c for c in commands if "--tasks rte" in c]
  grid = next(c for c in rte if "--objectives scl,acl" in c)
  assert ("--seeds 0" in grid and "--grid aux_weight=0.1,0.3,0.5,0.9" in grid
          and "--grid temperature=0.1,0.3,0.5,0.7" in grid and "learning_rate=0.0001 " in grid)
  report = next(c for c in rte if "--objectives acl,acl_embed" in c)
  assert ("--seeds 1,2,3" in report and "fair_1_report" in report
          and "--grid aux_weight=0.1 --grid temperature=0.1" in report)
  deebert = next(c for c in rte if "--objectives deebert" in c)
  assert "pooler_weights=per_exit" in deebert and "--early_exit" in deebert
  ablation = next(c for c in rte if "gate_granularity=global" in c)
  assert "--objectives acl_cl" in ablation and "fair_1_multi_exit" in ablation
  pilot = [c for c in rte if "measure_conflict,log_every=1" in c]
  assert len(pilot) == 2 and all("fair_1_pilot" in c and "--seeds 0 " in c for c in pilot)
  assert "--objectives scl" in pilot[0] and "--grid aux_weight=0.3 --grid temperature=0.1" in pilot[0]


def test_the_single_exit_table_compares_each_objective_with_ce(tmp_path):
  selection(tmp_path, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9})
  ce, acl = [0.60, 0.62, 0.61], [0.66, 0.70, 0.65]
  for seed, (c, a) in enumerate(zip(ce, acl), 1):
    write_record(tmp_path, "rte", "ce", seed, c)
    write_record(tmp_path, "rte", "acl", seed, a, aux=0.9, temperature=0.5)
    write_record(tmp_path, "rte", "acl_embed", seed, a - 0.01, aux=0.9, temperature=0.5)
    write_record(tmp_path, "rte", "acl", seed, 0.99, aux=0.5, temperature=0.3)  # not chosen
  text, rows = fair.single_exit_table(fair.read_records(tmp_path))
  assert sorted((r["objective"], r["seed"]) for r in rows) == sorted(
      (o, s) for o in ("ce", "acl", "acl_embed") for s in (1, 2, 3))
  assert all(r["commit"] == COMMIT for r in rows)
  acl_line = next(line for line in text.splitlines() if "| rte | acl |" in line)
  # Welch's t-test written out: t with the Welch-Satterthwaite degrees of freedom.
  va, vb = np.var(acl, ddof=1) / 3, np.var(ce, ddof=1) / 3
  t = (np.mean(acl) - np.mean(ce)) / math.sqrt(va + vb)
  df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
  assert f"| {2 * stats.t.sf(abs(t), df):.3f} |" in acl_line
  assert f"| {np.mean(acl) - np.mean(ce):+.4f} |" in acl_line
  assert "| 0.0001, 0.9, 0.5 |" in acl_line and "| 1,2,3 |" in acl_line
  assert "| rte | scl | 0.0001, 0.3, 0.1 | - | missing |" in text
  assert "| mrpc | ce | not chosen yet |" in text


def test_the_bootstrap_interval_brackets_the_observed_difference():
  a, b = [0.66, 0.70, 0.65], [0.60, 0.62, 0.61]
  low, high = fair.bootstrap_interval(a, b)
  # Resampled means stay within each group's range: the difference too.
  assert min(a) - max(b) <= low < np.mean(a) - np.mean(b) < high <= max(a) - min(b)
  assert fair.bootstrap_interval(a, b) == (low, high)  # seeded: the table is reproducible


def test_the_multi_exit_table_reads_the_best_metric_at_each_counted_speedup(tmp_path):
  selection(tmp_path / "single", "rte", scl={}, acl={(0.9, 0.5): 0.9})
  sweep = lambda *points: {"policies": {"entropy": [
      {"speedup_ratio": r, "metrics": {"accuracy": m}} for r, m in points]}}
  for seed, best in zip((1, 2, 3), (0.60, 0.62, 0.64)):
    write_record(tmp_path / "multi", "rte", "acl_cl", seed, 0.7, aux=0.9, temperature=0.5,
                 multi_exit=True, early_exit=sweep((1.0, 0.7), (1.6, best), (2.1, 0.55)))
  text, rows = fair.multi_exit_table(fair.read_records(tmp_path / "multi"),
                                     fair.read_records(tmp_path / "single"))
  line = next(line for line in text.splitlines() if "| rte | acl_cl |" in line)
  assert line == "| rte | acl_cl | 1,2,3 | 0.6200 ± 0.0200 | 0.5500 ± 0.0000 | 0.7000 ± 0.0000 |"
  assert len(rows) == 3 and rows[0]["gate_granularity"] == "per_exit"
  assert "| rte | acl_cl (global gate) | - |" in text


def test_one_comparison_keeps_one_commit_and_one_machine(tmp_path):
  write_record(tmp_path, "rte", "ce", 1, 0.6)
  write_record(tmp_path, "rte", "ce", 2, 0.6, commit="0123456789ab")
  with pytest.raises(SystemExit, match="mix commits"):
    fair.check_one_commit_and_machine(fair.read_records(tmp_path))


def test_runs_execute_only_the_tagged_commit(tmp_path):
  git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True,
                                  capture_output=True, text=True)
  git("init", "-q")
  (tmp_path / "f").write_text("a")
  git("add", "f")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
  pinned = git("rev-parse", "HEAD").stdout.strip()
  fair.check_pinned_commit(tmp_path, pinned)
  (tmp_path / "f").write_text("b")
  with pytest.raises(SystemExit, match="has changes"):
    fair.check_pinned_commit(tmp_path, pinned)
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "b")
  with pytest.raises(SystemExit, match=f"execute {fair.TAG}"):
    fair.check_pinned_commit(tmp_path, pinned)
