"""experiments/run_grid.py: grids of real (tiny) runs as Optuna studies, shared by worker
processes, each run pinned to its cores."""

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest

from conftest import REPO_ROOT

import run_grid


def test_core_groups_split_the_usable_cores(monkeypatch):
  cores = sorted(os.sched_getaffinity(0))
  assert run_grid.core_groups(1) == [None]
  if len(cores) > 1:  # with one usable core, --parallel 1 is the only (unpinned) choice
    groups = run_grid.core_groups(len(cores))
    assert sorted(c for g in groups for c in g) == cores and all(len(g) == 1 for g in groups)
  with pytest.raises(SystemExit, match="exceeds"):
    run_grid.core_groups(len(cores) + 1)
  assert run_grid.xla_thread_flags(1) == "--xla_cpu_multi_thread_eigen=false"
  assert run_grid.xla_thread_flags(2) == "--xla_cpu_multi_thread_eigen=true"
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  assert run_grid.pinned_env(1)["XLA_FLAGS"] == (
      "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false")
  monkeypatch.delenv("XLA_FLAGS")
  assert run_grid.pinned_env(2)["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true"


def grid_args(**flags) -> argparse.Namespace:
  defaults = dict(tasks="rte", objectives="ce", seeds="0", preset="model=minilm", grid=[],
                  study=None)
  return argparse.Namespace(**{**defaults, **flags})


def test_grid_points_names_and_bad_flags(tmp_path):
  # Without --grid, today's names (so existing records count); with it, fields in name order,
  # each value read as its field's type (5e-5 and 0.00005 are one point).
  (cell,) = run_grid.make_cells(grid_args(seeds="0,1"), tmp_path)
  assert [p.workdir.name for p in cell.points] == ["rte_ce_s0", "rte_ce_s1"]
  assert cell.study_name == f"{tmp_path.name}/rte/ce"
  (cell,) = run_grid.make_cells(grid_args(objectives="acl", study="s", grid=[
      "temperature=0.5", "lambda=0.3,0.9", "learning_rate=5e-5,0.00005"]), tmp_path)
  assert cell.study_name == "s/rte/acl"
  assert [p.workdir.name for p in cell.points] == [
      "rte_acl_s0_aux_weight=0.3_learning_rate=5e-05_temperature=0.5",
      "rte_acl_s0_aux_weight=0.9_learning_rate=5e-05_temperature=0.5"]
  assert cell.points[0].params == {"seed": 0, "aux_weight": 0.3, "learning_rate": 5e-5,
                                   "temperature": 0.5}
  assert cell.points[0].preset == ("rte,model=minilm,objective=acl,seed=0,aux_weight=0.3,"
                                   "learning_rate=5e-05,temperature=0.5")
  # Numbers get ranges, so later commands may run other seeds or values in the same study.
  assert isinstance(cell.distributions["aux_weight"], optuna.distributions.FloatDistribution)
  assert isinstance(cell.distributions["seed"], optuna.distributions.IntDistribution)
  for flags, message in [
      (dict(grid=["aux_wieght=0.1"]), "did you mean 'aux_weight'"),
      (dict(grid=["aux_weight=big"]), "--grid aux_weight=big: .*expected float"),
      (dict(grid=["aux_weight"]), "expected FIELD=V1,V2"),
      (dict(grid=["seed=1,2"]), "--seeds"),
      (dict(grid=["lr=1e-4", "learning_rate=2e-4"]), "already an axis"),
      (dict(grid=["lr=1e-4"], preset="model=minilm,lr=2e-4"), "also set by --preset"),
      (dict(seeds="0,x"), "--seeds '0,x'"),
      (dict(objectives="acl_cl"), "grid point 'rte,model=minilm,objective=acl_cl.*multi_exit"),
  ]:
    with pytest.raises(SystemExit, match=message):
      run_grid.make_cells(grid_args(**flags), tmp_path)


def tiny_grid(tiny_bert_dir, root, *extra, preset="", steps=2):
  return [sys.executable, "experiments/run_grid.py", "--root", str(root), "--tasks", "rte",
          "--objectives", "ce", "--preset",
          f"model={tiny_bert_dir},max_steps={steps},batch_size=8,max_length=32{preset}", *extra]


@pytest.fixture
def grid_env(glue_dir, tmp_path):
  # One compilation cache for the runs of a test: later runs load what the first compiled.
  return {**os.environ, "GLUE_DIR": str(glue_dir), "ACL_JAX_CACHE": str(tmp_path / "cache"),
          "HF_HUB_OFFLINE": "1"}


def run(command, env, **kwargs):
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, **kwargs)
  return proc, proc.stdout + proc.stderr


def trainings(workdir: pathlib.Path) -> int:
  """How many times a run started training in this workdir (its log's start lines)."""
  return (workdir / "log.txt").read_text().count(" train examples, ")


POP_QUEUED_TRIALS = """
import json, sys
import optuna
import run_grid
optuna.logging.set_verbosity(optuna.logging.ERROR)
url, queued = sys.argv[1], int(sys.argv[2])
study = optuna.load_study(study_name="queue", storage=run_grid.open_storage(url, heartbeat=60))
popped = []
while (trial := study.ask()).number < queued:  # past the queue, ask() makes a new trial
  popped.append(trial.number)
print(json.dumps(popped))
"""


def test_each_queued_trial_goes_to_one_process(tmp_path):
  """Processes taking queued trials from one SQLite study at once never take the same one.
  (Optuna's WAITING -> RUNNING check-and-set is not atomic on SQLite by itself: without
  run_grid's BEGIN IMMEDIATE, 4 processes took 236 trials from a queue of 200.)"""
  url, queued = f"sqlite:///{tmp_path / 'queue.db'}", 120
  study = optuna.create_study(study_name="queue", storage=run_grid.open_storage(url, 60))
  for _ in range(queued):
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING))
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "experiments"), "PYTHONWARNINGS": "ignore"}
  workers = [subprocess.Popen([sys.executable, "-c", POP_QUEUED_TRIALS, url, str(queued)],
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(4)]
  popped = [json.loads(worker.communicate(timeout=300)[0]) for worker in workers]
  assert [worker.returncode for worker in workers] == [0] * 4
  taken = sorted(n for numbers in popped for n in numbers)
  twice = sorted({n for n in taken if taken.count(n) > 1})
  assert taken == list(range(queued)), f"trials taken twice: {twice}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_two_worker_processes_share_one_study(tiny_bert_dir, grid_env, tmp_path):
  """Two processes at once (one with two pinned workers) on one SQLite study: every point of
  a 2 seeds x 2 learning rates grid completes once, trains once and leaves its record."""
  records, storage = tmp_path / "records", f"sqlite:///{tmp_path / 'shared.db'}"
  grid = ["--seeds", "0,1", "--grid", "learning_rate=1e-4,2e-4", "--records", str(records),
          "--storage", storage]
  command = tiny_grid(tiny_bert_dir, tmp_path / "grid", *grid)
  workers = [subprocess.Popen(command + parallel, cwd=REPO_ROOT, env=grid_env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for parallel in (["--parallel", "2"], [])]
  outputs = [worker.communicate(timeout=600)[0] for worker in workers]
  assert [worker.returncode for worker in workers] == [0, 0], outputs
  assert sum(out.count("ok in") for out in outputs) == 4, outputs
  assert "(cores [" in outputs[0]

  study = optuna.load_study(study_name="grid/rte/ce", storage=storage)
  complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
  points = sorted((t.params["seed"], t.params["learning_rate"]) for t in complete)
  assert points == [(0, 1e-4), (0, 2e-4), (1, 1e-4), (1, 2e-4)], outputs
  others = [t for t in study.trials if t.state != optuna.trial.TrialState.COMPLETE]
  # Workers that start together may queue a point twice; the later copy never runs.
  assert all(t.state == optuna.trial.TrialState.PRUNED and "duplicate_of" in t.user_attrs
             for t in others), [(t.number, t.state, t.params) for t in others]
  for trial in complete:
    name = f"rte_ce_s{trial.params['seed']}_learning_rate={trial.params['learning_rate']}"
    workdir, record = tmp_path / "grid" / name, records / name
    assert trainings(workdir) == 1
    assert sorted(p.name for p in record.iterdir()) == [
        "config.json", "eval_results.json", "log.txt", "metrics.jsonl"]
    results = json.loads((record / "eval_results.json").read_text())
    assert trial.value == results["final"]["validation"]["accuracy"]
    assert trial.user_attrs["workdir"] == str(workdir)
    assert trial.user_attrs["record"] == str(record)
    assert trial.user_attrs["command"].endswith(f"--workdir={workdir}")
    assert trial.user_attrs["metric"] == "validation/accuracy (final)"

  proc, out = run(command, grid_env)  # a rerun finds every point done
  assert proc.returncode == 0 and "0 runs to do" in out, out
  assert len(optuna.load_study(study_name="grid/rte/ce", storage=storage).trials) == len(
      study.trials)
  # On a machine whose run directories and study are gone, the records alone finish the grid.
  fresh = tiny_grid(tiny_bert_dir, tmp_path / "fresh", *grid[:-2])
  proc, out = run(fresh, grid_env)
  assert proc.returncode == 0 and "0 runs to do" in out and "ok in" not in out, out
  again = optuna.load_study(study_name="fresh/rte/ce",
                            storage=f"sqlite:///{tmp_path / 'fresh' / 'study.db'}")
  assert sorted(t.value for t in again.trials) == sorted(t.value for t in complete)
  assert not [p for p in (tmp_path / "fresh").iterdir() if p.name != "study.db"]
  proc, out = run(fresh + ["--report"], grid_env)
  assert proc.returncode == 0, out
  assert "fresh/rte/ce: validation/accuracy (final); best on seed 0: learning_rate=" in out
  assert "| learning_rate | s0 | s1 | mean |" in out and out.count("<- best") == 1, out


def test_a_killed_workers_trial_is_run_again(tiny_bert_dir, grid_env, tmp_path):
  """A worker killed mid-run (with its run) stops beating; the next worker fails its trial,
  queues it again and finishes the point in the same workdir."""
  command = tiny_grid(tiny_bert_dir, tmp_path / "grid", "--seeds", "0", "--heartbeat", "1")
  worker = subprocess.Popen(command, cwd=REPO_ROOT, env=grid_env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  workdir = tmp_path / "grid" / "rte_ce_s0"
  deadline = time.time() + 300
  while not (workdir / "config.json").exists():  # written as the run starts training
    assert worker.poll() is None and time.time() < deadline, "the run never started"
    time.sleep(0.2)
  os.killpg(worker.pid, signal.SIGKILL)
  worker.wait()
  time.sleep(2.5)  # the grace period: two heartbeats
  proc, out = run(command, grid_env)
  # The dead worker's trial, queued again, counts among this command's runs.
  assert proc.returncode == 0 and "1 runs to do" in out and "[1/1]" in out and "ok in" in out, out
  study = optuna.load_study(study_name="grid/rte/ce",
                            storage=f"sqlite:///{tmp_path / 'grid' / 'study.db'}")
  states = [(t.number, t.state) for t in study.trials]
  assert states == [(0, optuna.trial.TrialState.FAIL), (1, optuna.trial.TrialState.COMPLETE)]
  assert study.trials[1].system_attrs["failed_trial"] == 0
  assert (workdir / "eval_results.json").exists()


def test_a_stopped_command_exits_75_and_queues_its_point_again(tiny_bert_dir, grid_env,
                                                               tmp_path):
  """SIGTERM to run_grid goes on to its run, which saves and exits 75; the command exits 75 and
  closes the trial as PRUNED, not FAIL (Optuna logs no failure or traceback), and the same
  command run again queues the point again (the run resumes its checkpoint: test_preemption)."""
  # 200 steps take a few seconds, and no save is due before the end: time for the signal.
  command = tiny_grid(tiny_bert_dir, tmp_path / "grid", "--seeds", "0", steps=200,
                      preset=",checkpoint_every=1000")
  worker = subprocess.Popen(command, cwd=REPO_ROOT, env=grid_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  workdir = tmp_path / "grid" / "rte_ce_s0"
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while not (metrics.exists() and '"loss"' in metrics.read_text()):  # training, past step 20
    assert worker.poll() is None and time.time() < deadline, "the run never logged a step"
    time.sleep(0.005)
  worker.send_signal(signal.SIGTERM)  # to run_grid only: it must pass the signal on
  out, _ = worker.communicate(timeout=300)
  assert worker.returncode == 75, out
  assert "[1] stopped (exit 75; rerun to resume)" in out, out
  assert "failed" not in out and "Traceback" not in out, out
  stopped_at = int(re.search(r"SIGTERM at step (\d+)/200",
                             (workdir / "log.txt").read_text()).group(1))
  assert stopped_at < 200 and not (workdir / "eval_results.json").exists()
  assert (workdir / "checkpoints" / "latest" / str(stopped_at)).is_dir()
  storage = f"sqlite:///{tmp_path / 'grid' / 'study.db'}"
  (trial,) = optuna.load_study(study_name="grid/rte/ce", storage=storage).trials
  assert trial.state == optuna.trial.TrialState.PRUNED and "duplicate_of" not in trial.user_attrs

  # Run again, the command queues the point again (its checkpoint is there to resume).
  proc, out = run(command + ["--dry_run"], grid_env)
  assert proc.returncode == 0 and "1 runs to do" in out, out
  assert "[1/1] -m acl_jax.main --config=" in out and "--mode=early_exit" not in out, out


def test_a_run_stopped_while_it_starts_up_is_a_stop_not_a_failure(tiny_bert_dir, grid_env,
                                                                  tmp_path):
  """A SIGTERM that reaches a run before the run has installed its handler (still importing)
  kills it by the signal; run_grid, which passed the signal on, reports a stop (exit 75, the
  point queued again), not a failed run."""
  command = tiny_grid(tiny_bert_dir, tmp_path / "grid", "--seeds", "0")
  worker = subprocess.Popen(command, cwd=REPO_ROOT, env=grid_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  log_file = tmp_path / "grid" / "rte_ce_s0" / "log.txt"  # opened just before the run starts
  deadline = time.time() + 300
  while not (log_file.exists() and children(worker.pid)):  # started: a Python still importing
    assert worker.poll() is None and time.time() < deadline, "the run never started"
    time.sleep(0.001)
  worker.send_signal(signal.SIGTERM)
  out, _ = worker.communicate(timeout=300)
  log = log_file.read_text()
  assert "SIGTERM at step" not in log and " train examples, " not in log, log  # died starting
  assert worker.returncode == 75, out
  assert "[1] stopped (exit 75; rerun to resume)" in out and "FAILED" not in out, out
  (trial,) = optuna.load_study(study_name="grid/rte/ce",
                               storage=f"sqlite:///{tmp_path / 'grid' / 'study.db'}").trials
  assert trial.state == optuna.trial.TrialState.PRUNED


def children(pid: int) -> list[int]:
  """The processes whose parent is `pid`, from /proc."""
  found = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
      continue
    if int(fields[1]) == pid:
      found.append(int(stat.parent.name))
  return found


def test_early_exit_sweeps_a_multi_exit_run_before_recording_it(tiny_bert_dir, grid_env,
                                                                 tmp_path):
  records = tmp_path / "records"
  command = tiny_grid(tiny_bert_dir, tmp_path / "grid", "--records", str(records), "--seeds", "0",
                      "--early_exit", "--early_exit_examples", "3", preset=",multi_exit")
  proc, out = run(command, grid_env)
  assert proc.returncode == 0, out
  assert "--mode=early_exit" in out and "ok in" in out, out
  record = records / "rte_ce_s0"
  assert {"early_exit.json", "early_exit.png", "eval_results.json"} <= {
      p.name for p in record.iterdir()}
  study = optuna.load_study(study_name="grid/rte/ce",
                            storage=f"sqlite:///{tmp_path / 'grid' / 'study.db'}")
  (trial,) = study.trials
  assert trial.user_attrs["swept"] and trial.user_attrs["metric"].startswith(
      "validation/avg/accuracy")
  # A trained run that lost its sweep gets the sweep only, from its checkpoints (a new study,
  # since this one knows the point was swept) ...
  (record / "early_exit.json").unlink()
  (tmp_path / "grid" / "rte_ce_s0" / "early_exit.json").unlink()
  proc, out = run(command + ["--study", "again", "--dry_run"], grid_env)
  assert "1 runs to do" in out, out
  assert "--mode=early_exit" in out and "--config=" not in out, out
  # ... and one trained elsewhere, whose checkpoints are gone, is reported, not retrained.
  fresh = [arg if arg != str(tmp_path / "grid") else str(tmp_path / "fresh") for arg in command]
  proc, out = run(fresh + ["--dry_run"], grid_env)
  assert "0 runs to do" in out and "cannot sweep rte_ce_s0" in out, out
  assert not (tmp_path / "fresh").exists()  # a dry run writes nothing


def test_a_study_is_one_search_space(tmp_path):
  """A command over other --grid axes than its study's trials is refused, and a trial queued by
  such a command (both looked before either queued) is closed unrun: run by the other command,
  it would train at that command's value of an axis it was queued without."""
  storage = run_grid.open_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat=60)
  common = dict(objectives="acl_cl", preset="model=minilm,multi_exit", records=None,
                early_exit=False)
  per_exit_args = grid_args(grid=["lambda=0.5"], **common)
  global_args = grid_args(grid=["lambda=0.5", "gate_granularity=global"], **common)
  (per_exit,) = run_grid.make_cells(per_exit_args, tmp_path)
  (global_gate,) = run_grid.make_cells(global_args, tmp_path)
  assert per_exit.study_name == global_gate.study_name  # the same root and no --study
  run_grid.queue_points(storage, per_exit, per_exit_args, dry_run=False)
  for dry_run in (True, False):
    with pytest.raises(SystemExit, match=(
        rf"study '{tmp_path.name}/rte/acl_cl' holds trials over aux_weight, seed, but this "
        "command's grid is over aux_weight, gate_granularity, seed: give one of the two "
        "commands its own --study")):
      run_grid.queue_points(storage, global_gate, global_args, dry_run=dry_run)

  grid = run_grid.Grid(global_args, storage, [global_gate], total=0)
  grid.take_trials(cores=None)
  (trial,) = optuna.load_study(study_name=per_exit.study_name, storage=storage).trials
  assert trial.state == optuna.trial.TrialState.PRUNED and grid.started == 0
  assert not global_gate.points[0].workdir.exists()
  assert trial.system_attrs["fixed_params"] == per_exit.points[0].params

  # With its own --study, the other command queues its point beside the first study.
  own_args = argparse.Namespace(**{**vars(global_args), "study": "global_gate"})
  (own,) = run_grid.make_cells(own_args, tmp_path)
  ((point, commands),) = run_grid.queue_points(storage, own, own_args, dry_run=False)
  assert own.study_name == "global_gate/rte/acl_cl"
  assert point.params == {"seed": 0, "aux_weight": 0.5, "gate_granularity": "global"}
  assert commands and "gate_granularity=global" in commands[0][3]
