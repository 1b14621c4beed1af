"""experiments/run_grid.py: a grid of real (tiny) runs, two at a time, each pinned to its cores."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

import run_grid


def test_core_groups_split_the_usable_cores():
  cores = sorted(os.sched_getaffinity(0))
  assert run_grid.core_groups(1) == [None]
  if len(cores) > 1:  # with one usable core, --parallel 1 is the only (unpinned) choice
    groups = run_grid.core_groups(len(cores))
    assert sorted(c for g in groups for c in g) == cores and all(len(g) == 1 for g in groups)
  with pytest.raises(SystemExit, match="exceeds"):
    run_grid.core_groups(len(cores) + 1)
  assert run_grid.xla_thread_flags(1) == "--xla_cpu_multi_thread_eigen=false"
  assert run_grid.xla_thread_flags(2) == "--xla_cpu_multi_thread_eigen=true"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_two_runs_at_once_finish_and_a_rerun_skips_them(tiny_bert_dir, glue_dir, tmp_path):
  records = tmp_path / "records"
  command = [sys.executable, "experiments/run_grid.py", "--root", str(tmp_path / "grid"),
             "--records", str(records),
             "--tasks", "rte", "--objectives", "ce", "--seeds", "0,1", "--parallel", "2",
             "--preset", f"model={tiny_bert_dir},max_steps=2,batch_size=8,max_length=32"]
  env = {**os.environ, "GLUE_DIR": str(glue_dir), "ACL_JAX_CACHE": str(tmp_path / "cache"),
         "HF_HUB_OFFLINE": "1"}
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count("ok in") == 2, proc.stdout
  assert "(cores [" in proc.stdout
  for seed in (0, 1):
    assert (tmp_path / "grid" / f"rte_ce_s{seed}" / "eval_results.json").exists()
  again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
  assert "0 runs to do" in again.stdout
  for seed in (0, 1):  # the small files are kept as the run's record; checkpoints are not
    kept = sorted(p.name for p in (records / f"rte_ce_s{seed}").iterdir())
    assert kept == ["config.json", "eval_results.json", "log.txt", "metrics.jsonl"], kept
  # On a machine whose run directories are gone, the records alone finish the grid.
  fresh = [arg if arg != str(tmp_path / "grid") else str(tmp_path / "fresh") for arg in command]
  elsewhere = subprocess.run(fresh + ["--dry_run"], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
  assert "0 runs to do" in elsewhere.stdout, elsewhere.stdout + elsewhere.stderr


def test_early_exit_sweeps_a_multi_exit_run_before_recording_it(tiny_bert_dir, glue_dir,
                                                                 tmp_path):
  records = tmp_path / "records"
  command = [sys.executable, "experiments/run_grid.py", "--root", str(tmp_path / "grid"),
             "--records", str(records), "--tasks", "rte", "--objectives", "ce", "--seeds", "0",
             "--early_exit", "--early_exit_examples", "3",
             "--preset", f"model={tiny_bert_dir},multi_exit,max_steps=2,batch_size=8,"
             "max_length=32"]
  env = {**os.environ, "GLUE_DIR": str(glue_dir), "ACL_JAX_CACHE": str(tmp_path / "cache"),
         "HF_HUB_OFFLINE": "1"}
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "--mode=early_exit" in proc.stdout and "ok in" in proc.stdout, proc.stdout
  record = records / "rte_ce_s0"
  assert {"early_exit.json", "early_exit.png", "eval_results.json"} <= {
      p.name for p in record.iterdir()}
  # A trained run that lost its sweep gets the sweep only, from its checkpoints ...
  (record / "early_exit.json").unlink()
  (tmp_path / "grid" / "rte_ce_s0" / "early_exit.json").unlink()
  again = subprocess.run(command + ["--dry_run"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
  assert "1 runs to do" in again.stdout, again.stdout + again.stderr
  assert "--mode=early_exit" in again.stdout and "--config=" not in again.stdout, again.stdout
  # ... and one trained elsewhere, whose checkpoints are gone, is reported, not retrained.
  fresh = [arg if arg != str(tmp_path / "grid") else str(tmp_path / "fresh") for arg in command]
  elsewhere = subprocess.run(fresh + ["--dry_run"], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
  assert "0 runs to do" in elsewhere.stdout and "cannot sweep rte_ce_s0" in elsewhere.stdout, (
      elsewhere.stdout + elsewhere.stderr)
