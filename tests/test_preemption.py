"""Pre-emption: a real SIGTERM to a real run saves at the step it was at, exits with
preemption.EXIT_CODE, and the same command resumes it to an uninterrupted run's bits; two
processes of one job stop at the same step."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from acl_jax import preemption
from acl_jax import run_dir
from acl_jax import train
from conftest import REPO_ROOT, tiny_run_config, xla_flags

# 100 steps take a few seconds: time for the signal to land mid-run. No save is due before
# the end (checkpoint_every, eval_every), so a checkpoint mid-run can only be the stop's.
STEPS = 100
PRESET = f"objective=acl,max_steps={STEPS},checkpoint_every=1000,batch_size=8,max_length=32"


def _command(model_dir, workdir):
  return [sys.executable, "-m", "acl_jax.main",
          f"--config=configs/glue.py:rte,model={model_dir},{PRESET}",
          "--config.log_every=1", f"--workdir={workdir}"]


def _env(glue_dir, cache_dir, **extra):
  return {**os.environ, "GLUE_DIR": str(glue_dir), "ACL_JAX_CACHE": str(cache_dir),
          "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu", **extra}


def _logged_steps(workdir) -> list[int]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
  return [row["step"] for row in rows if "loss" in row]


def _signal_once_logged(procs, workdir, target, signum, *, at_least: int,
                        timeout: float = 600) -> int:
  """Sends `signum` to procs[target] once metrics.jsonl has a train row at or past step
  `at_least`; returns the last logged step seen then."""
  deadline = time.time() + timeout
  while time.time() < deadline and all(proc.poll() is None for proc in procs):
    steps = _logged_steps(workdir)
    if steps and steps[-1] >= at_least:
      procs[target].send_signal(signum)
      return steps[-1]
    time.sleep(0.005)
  raise AssertionError(f"the run ended ({[p.poll() for p in procs]}) before it was signalled")


def _checkpoint_steps(workdir) -> list[int]:
  latest = workdir / "checkpoints" / "latest"
  return sorted(int(p.name) for p in latest.glob("*") if p.name.isdigit())


def test_sigterm_saves_the_current_step_and_the_rerun_matches_an_uninterrupted_run(
    tiny_bert_dir, glue_dir, tmp_path):
  env = _env(glue_dir, tmp_path / "cache")
  reference, preempted = tmp_path / "reference", tmp_path / "preempted"
  subprocess.run(_command(tiny_bert_dir, reference), cwd=REPO_ROOT, env=env, check=True,
                 capture_output=True)

  proc = subprocess.Popen(_command(tiny_bert_dir, preempted), cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  seen = _signal_once_logged([proc], preempted, 0, signal.SIGTERM, at_least=5)
  output, _ = proc.communicate(timeout=300)
  assert proc.returncode == preemption.EXIT_CODE, output[-3000:]
  stopped_at = int(re.search(rf"SIGTERM at step (\d+)/{STEPS}", output).group(1))
  # It finished the step it was in (and perhaps one more already queued), then saved there:
  # that checkpoint is the only one, and metrics.jsonl ends at it.
  assert seen <= stopped_at <= seen + 3 < STEPS, (seen, stopped_at)
  assert _checkpoint_steps(preempted) == [stopped_at]
  assert _logged_steps(preempted)[-1] == stopped_at
  assert "rerun the same command to resume" in output
  assert not (preempted / "eval_results.json").exists()

  rerun = subprocess.run(_command(tiny_bert_dir, preempted), cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Resuming from the checkpoint at step {stopped_at}" in rerun.stdout
  ref_params, ref_step = run_dir.load_params(reference)
  res_params, res_step = run_dir.load_params(preempted)
  assert ref_step == res_step == STEPS
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref_params),
                          jax.tree.leaves(res_params)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), f"{jax.tree_util.keystr(path)} differs"
  assert _logged_steps(preempted) == list(range(1, STEPS + 1))
  ref_rows = (reference / "metrics.jsonl").read_text().splitlines()
  res_rows = (preempted / "metrics.jsonl").read_text().splitlines()
  values = lambda rows: [(r["step"], r["loss"], r["grad_norm"])
                         for r in map(json.loads, rows) if "loss" in r]
  assert values(res_rows) == values(ref_rows)


def test_sigterm_stops_an_early_exit_sweep_with_the_retry_code_and_writes_nothing(
    tiny_bert_dir, glue_dir, tmp_path):
  """A sweep saves nothing on the way: a SIGTERM stops it at once, with exit 75 (run_grid's
  "stopped, rerun"), not as a run killed by a signal (-15, which run_grid counts as failed)."""
  workdir = tmp_path / "run"
  train.train_and_evaluate(tiny_run_config(tiny_bert_dir, glue_dir,
                                           "rte,multi_exit,objective=ce,max_steps=2"), workdir)
  proc = subprocess.Popen([sys.executable, "-m", "acl_jax.main", "--mode=early_exit",
                           f"--workdir={workdir}"], cwd=REPO_ROOT,
                          env=_env(glue_dir, tmp_path / "cache"), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  # Timing every dev example at every threshold takes far longer than the test waits.
  for line in proc.stdout:
    if line.startswith("measuring batch-1 latency"):
      proc.send_signal(signal.SIGTERM)
      break
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == preemption.EXIT_CODE, stderr[-3000:]
  assert "SIGTERM: stopped --mode=early_exit; rerun the same command to do it again" in stderr
  assert not (workdir / run_dir.EARLY_EXIT_FILE).exists()
  assert not (workdir / run_dir.EARLY_EXIT_PLOT).exists()


def test_ctrl_c_requests_a_stop_and_a_second_one_stops_at_once():
  """In process: the first SIGINT is a request the loop sees at its next step; the second
  raises KeyboardInterrupt; leaving the block puts the previous handlers back."""
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  requests = preemption.StopRequests()
  with requests.installed():
    assert not requests.reached(1)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs the handler at the next bytecode of the main thread
    assert requests.reached(2) and requests.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_timed_save_is_due_after_its_interval():
  now = time.monotonic()
  assert not train.timed_save_due(now, 0.0)  # off
  assert not train.timed_save_due(now, 1.0)
  assert train.timed_save_due(now - 61, 1.0)


def test_checkpoint_every_minutes_saves_between_step_saves(tiny_bert_dir, glue_dir, tmp_path,
                                                           monkeypatch):
  """With no step-based save due, a tiny interval saves at every log point; a run resumed
  with another interval is accepted."""
  config = tiny_run_config(tiny_bert_dir, glue_dir, objective="ce", max_steps=6, batch_size=8,
                           max_length=32, log_every=2, checkpoint_every=0, eval_every=6)
  config.checkpoint_every_minutes = 1e-9
  saved = []
  save = run_dir.RunCheckpoints.save
  monkeypatch.setattr(run_dir.RunCheckpoints, "save",
                      lambda self, step, *args: (saved.append(step), save(self, step, *args)))
  train.train_and_evaluate(config, tmp_path / "run")
  assert saved == [2, 4, 6]
  config.checkpoint_every_minutes = 0.0
  run_dir.prepare_workdir(tmp_path / "run", config)  # not refused as another config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tiny_bert_dir, glue_dir,
                                                                     tmp_path):
  """Two processes of one job (2 CPU devices each); SIGTERM reaches process 1 only. JAX's
  pre-emption service tells both, they agree on a step, both save it and exit with
  EXIT_CODE. (The single-process test resumes; resuming is the same code on any number of
  processes.)"""
  workdir = tmp_path / "two_hosts"
  port = _free_port()
  procs = []
  for process_id in range(2):
    env = _env(glue_dir, tmp_path / "cache",
               XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(process_id))
    procs.append(subprocess.Popen(_command(tiny_bert_dir, workdir), cwd=REPO_ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  _signal_once_logged(procs, workdir, 1, signal.SIGTERM, at_least=3)  # process 0 logs
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for proc, output in zip(procs, outputs):
    assert proc.returncode == preemption.EXIT_CODE, output[-3000:]
  # Process 1 got the signal, process 0 did not; both stopped after the same step.
  steps = [int(re.search(r"at step (\d+): Pre-empted", output).group(1)) for output in outputs]
  assert steps[0] == steps[1] < STEPS, outputs[0][-2000:]
  assert _checkpoint_steps(workdir) == [steps[0]]
  assert _logged_steps(workdir)[-1] == steps[0]

