"""The command line, run as users run it: a subprocess with --config and --workdir."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

from acl_jax import host
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
    results[name] = json.loads((workdir / "eval_results.json").read_text())
    meta = json.loads((workdir / "config.json").read_text())["meta"]
    assert meta["compilation_cache"] == str(xla_cache)
    assert meta["cpu"] == host.cpu_fingerprint() and host.recorded_cpu(meta) == meta["cpu"]
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


def test_compilation_cache_none_is_off_even_when_the_environment_names_a_directory(
    monkeypatch, tmp_path):
  """JAX takes $JAX_COMPILATION_CACHE_DIR as its cache directory when imported (a user's shell
  may set it), so `--compilation_cache=none` must turn the cache off, not only leave it alone."""
  import jax
  before = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "from_the_environment"))
    assert host.enable_compilation_cache("none") is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "named"))
    assert host.enable_compilation_cache("auto") == str(tmp_path / "named")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "named")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


def test_cli_rejects_an_unknown_config_field(glue_dir, tmp_path):
  proc = run_main("--config=configs/glue.py:rte", "--config.learning_rat=1e-4",
                  f"--workdir={tmp_path}", glue_dir=glue_dir)
  assert proc.returncode != 0
  # One line naming the flag, the close field and the valid ones: no traceback.
  assert "--config.learning_rat: config has no field 'learning_rat'" in proc.stderr
  assert "did you mean 'learning_rate'?" in proc.stderr and "aux_weight" in proc.stderr
  assert "Traceback" not in proc.stderr
  proc = run_main("--config=configs/glue.py:rte", "--config.data.glue_dri=/x",
                  f"--workdir={tmp_path}", glue_dir=glue_dir)
  assert proc.returncode != 0 and "config.data has no field 'glue_dri'" in proc.stderr
  assert "did you mean 'glue_dir'?" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_rejects_an_unknown_task_listing_valid_ones(glue_dir, tmp_path):
  proc = run_main("--config=configs/glue.py:rtx", f"--workdir={tmp_path}", glue_dir=glue_dir)
  assert proc.returncode != 0
  assert "rtx" in proc.stderr and "mrpc" in proc.stderr


def run_main_on_a_terminal(*args, glue_dir) -> tuple[int, str]:
  """The CLI with a pseudo-terminal for stdout and stderr, as a user at a shell sees it."""
  leader, follower = pty.openpty()
  # A terminal 30 rows by 120 columns (a fresh pty is 0 by 0, where tqdm draws no bar).
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
  env = dict(os.environ, GLUE_DIR=str(glue_dir))
  proc = subprocess.Popen([sys.executable, "-m", "acl_jax.main", *args], cwd=REPO_ROOT, env=env,
                          stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
  os.close(follower)
  output = b""
  while True:
    try:
      chunk = os.read(leader, 1 << 16)
    except OSError:  # EIO: the child closed the terminal
      break
    if not chunk:
      break
    output += chunk
  os.close(leader)
  return proc.wait(timeout=600), output.decode(errors="replace")


def test_console_shows_progress_evaluations_and_results_not_library_chatter(tiny_bert_dir,
                                                                            glue_dir, tmp_path):
  workdir = tmp_path / "run"
  code, console = run_main_on_a_terminal(
      f"--config=configs/glue.py:rte,model={tiny_bert_dir},objective=acl,max_steps=40",
      "--config.batch_size=8", "--config.max_length=64", "--config.eval_every=20",
      f"--config.data.cache_dir={tmp_path / 'cache'}", f"--workdir={workdir}",
      "--compilation_cache=none", glue_dir=glue_dir)
  assert code == 0, console[-3000:]
  assert "rte train:" in console and "40/40" in console  # the progress bar, at its end
  assert "step 20: validation accuracy=" in console and "step 40: validation accuracy=" in console
  assert "Done: validation/accuracy" in console and str(workdir / "eval_results.json") in console
  # orbax dumps its options at INFO for every checkpoint manager: into run.log, not the console.
  assert "CheckpointManagerOptions" not in console
  assert "CheckpointManagerOptions" in (workdir / "run.log").read_text()
  lines = [line for line in console.replace("\r", "\n").splitlines() if line.strip()]
  assert not any(line.startswith(("I1", "I0")) for line in lines), lines  # no INFO lines
