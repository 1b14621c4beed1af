"""The command line, run as users run it: a subprocess with --config and --workdir."""

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT


def run_main(*args, glue_dir, **env_overrides):
  env = dict(os.environ, GLUE_DIR=str(glue_dir), **env_overrides)
  return subprocess.run([sys.executable, "-m", "acl_jax.main", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_cli_trains_and_writes_the_run_directory(tiny_bert_dir, glue_dir, tmp_path):
  """Also: the persistent compilation cache. A second run of the same program into another
  workdir adds no cache entry (every compile was loaded) and lands on the same results.

  JAX writes an entry only for a compile that took over a threshold (1 s); set to 0 here, as
  otherwise a program that compiles in 0.9 s under one run's load and 1.1 s under the next's
  makes the second run add an entry (CI failed that way once).
  """
  xla_cache = tmp_path / "xla"
  results = {}
  for name in ("run", "again"):
    workdir = tmp_path / name
    proc = run_main(
        f"--config=configs/glue.py:rte,model={tiny_bert_dir},objective=ce,max_steps=3",
        "--config.batch_size=8", "--config.max_length=64",
        f"--config.data.cache_dir={tmp_path / 'cache'}", f"--workdir={workdir}",
        f"--compilation_cache={xla_cache}", glue_dir=glue_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation accuracy=" in proc.stdout + proc.stderr
    assert f"compilation cache: {xla_cache}" in proc.stderr
    results[name] = json.loads((workdir / "eval_results.json").read_text())
    entries = sorted(p.name for p in xla_cache.iterdir())
    if name == "run":
      first_entries = entries
      assert any(e.startswith("jit_train_step-") for e in first_entries), first_entries
      assert any(e.startswith("jit_eval_step-") for e in first_entries), first_entries
      saved = json.loads((workdir / "config.json").read_text())
      assert saved["config"]["batch_size"] == 8
      assert saved["meta"]["argv"][1].startswith("--config=configs/glue.py:rte")
  assert entries == first_entries  # the second run compiled nothing new
  assert results["run"]["final"]["step"] == 3
  assert results["again"]["final"] == results["run"]["final"]


def test_cli_rejects_an_unknown_config_field(glue_dir, tmp_path):
  proc = run_main("--config=configs/glue.py:rte", "--config.learning_rat=1e-4",
                  f"--workdir={tmp_path}", glue_dir=glue_dir)
  assert proc.returncode != 0
  assert "learning_rat" in proc.stderr


def test_cli_rejects_an_unknown_task_listing_valid_ones(glue_dir, tmp_path):
  proc = run_main("--config=configs/glue.py:rtx", f"--workdir={tmp_path}", glue_dir=glue_dir)
  assert proc.returncode != 0
  assert "rtx" in proc.stderr and "mrpc" in proc.stderr
