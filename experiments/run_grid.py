"""Runs a grid of fine-tunes as Optuna studies, on one machine or on several sharing a storage.

    python experiments/run_grid.py --root runs/acl_minilm --tasks rte,mrpc,cola \
        --objectives ce,scl,acl_embed,acl --seeds 0,1,2 --preset model=minilm
    python experiments/run_grid.py --root runs/acl_rte --tasks rte --objectives acl --seeds 0 \
        --preset model=minilm --grid aux_weight=0.1,0.3,0.5,0.9 --grid temperature=0.1,0.3,0.5,0.7
    python experiments/run_grid.py --root runs/acl_rte --tasks rte --objectives acl --seeds 0 \
        --grid aux_weight=0.1,0.3,0.5,0.9 --grid temperature=0.1,0.3,0.5,0.7 --report

A grid point is a task, an objective, a seed and one value of each `--grid FIELD=V1,V2,...` axis
(any scalar config field). Each point is one Optuna trial, one run directory
<root>/<task>_<objective>_s<seed>[_<field>=<value>...] (the fields in name order; without
--grid, today's names) and one `python -m acl_jax.main --config=configs/glue.py:<task>,<preset>,
objective=<o>,seed=<s>[,<field>=<value>...] --workdir=<that directory>` subprocess, so a crash
or a kill loses at most the run in flight, and a point run again resumes its checkpoint (its
log.txt gets the new output appended).

Each (task, objective) is one study, `<study>/<task>/<objective>` (--study, default the root's
name), because its trials share one dev metric: the trial's value is the run's main dev metric
(eval_results.json's main_metric, the exits' average for a multi-exit model; --value final or
best), maximized. The seed and the --grid fields are the study's parameters, over Optuna's
GridSampler; the workdir, command, record and metric are user attributes. A study is one
search space: later commands may add seeds or values, but one over other --grid axes (say, one
more fixed axis such as gate_granularity=global) is refused until given its own --study. The
studies live in `--storage` (default sqlite:///<root>/study.db); any Optuna storage URL
(postgresql://, mysql://, sqlite:///shared/path.db) or a journal file path lets workers on
several machines share them: run the same command with the same --storage on each.

A worker first queues every point that no trial has done or holds (Optuna's WAITING trials), then
takes queued trials one at a time (the storage hands each WAITING trial to one worker only; on
SQLite because every transaction begins with BEGIN IMMEDIATE). Workers that start together may queue
a point twice; a trial whose point an earlier trial already holds or has done is closed as PRUNED
(user attribute duplicate_of) without running, so no point trains twice. Each running trial beats a
heartbeat into an SQL storage (--heartbeat seconds); a trial whose worker died stops beating and,
two beats later, the next worker to look fails it and queues it again (Optuna's
RetryHeartbeatStaleTrialCallback), and its run resumes from its checkpoint. A journal file has no
heartbeat: there a killed worker's trial stays RUNNING. A trial whose run fails (a non-zero exit) is
FAIL, and one whose run was stopped (exit 75) is PRUNED; either is queued again only when the
command is run again. A point counts as done without training when its eval_results.json exists, in
its workdir or in its record: the trial then reads its value.

With `--records DIR` every run that finishes is also copied to DIR/<name>/ (its config.json,
eval_results.json, metrics.jsonl, log.txt, early_exit.json/.png; no checkpoints), and a run with
a record there counts as trained, so a grid continues on a machine whose run directories are
gone. `--parallel N` runs N workers in this process, each pinned to its own share of the cores.
With `--early_exit` (multi-exit grids) each run that trains is then swept by `--mode=early_exit`
on the same cores while its checkpoints are still there, and its early_exit.json and .png join
its record; a point done without the sweep is queued again for the sweep only.

`--dry_run` prints what would run; `--report` prints each (task, objective)'s table of values
and its best point on the first of --seeds. SIGTERM is passed on to the runs (which save a
checkpoint and exit 75; a sweep stops and exits 75, to be redone), and the workers then stop;
the command exits 75. Ctrl-C stops them the same way (the terminal signals the runs itself).
A failed run makes the command exit 1.
Summarize with experiments/summarize.py.
"""

import argparse
import ctypes
import dataclasses
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import optuna
import sqlalchemy

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # acl_jax, when run as a script from anywhere

from acl_jax import config as config_lib  # noqa: E402  (after the path it needs)
from acl_jax.preemption import EXIT_CODE as PREEMPTED  # noqa: E402  (a run saved on a signal)

RECORD_FILES = ("config.json", "eval_results.json", "metrics.jsonl", "log.txt",
                "early_exit.json", "early_exit.png")
ACTIVE = (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)
# The trial number up to which a queued trial's point had no live trial (system attribute):
# a trial numbered between it and the queued one holds or has done the same point.
QUEUED_AFTER = "grid_queued_after"


@dataclasses.dataclass(frozen=True)
class Point:
  """One grid point: a run directory and its trial's parameters."""
  task: str
  objective: str
  params: dict[str, Any]  # seed and each --grid field, as the study records them
  preset: str  # the config string after configs/glue.py:
  workdir: pathlib.Path


@dataclasses.dataclass
class Cell:
  """The points of one (task, objective): one study."""
  task: str
  objective: str
  study_name: str
  distributions: dict[str, optuna.distributions.BaseDistribution]
  points: list[Point]


def main():
  args = parse_args()
  if args.heartbeat < 1:
    raise SystemExit(f"--heartbeat {args.heartbeat}: must be a positive number of seconds")

  optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own progress lines say the rest
  # The heartbeat and its retry callback are marked experimental; they are what we rely on.
  warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
  root = args.root.resolve()
  cells = make_cells(args, root)
  if args.storage is None and not (root / "study.db").exists() and (args.dry_run or args.report):
    storage = None  # nothing recorded yet, and reading creates no database
  else:
    root.mkdir(parents=True, exist_ok=True)
    storage = open_storage(args.storage or f"sqlite:///{root / 'study.db'}", args.heartbeat)
  if args.report:
    report(storage, cells, int(args.seeds.split(",")[0]))
    return
  # A dry run only reads the studies; otherwise every point that needs a trial is queued.
  plans = [queue_points(storage, cell, args, dry_run=args.dry_run) for cell in cells]
  todo = [(point, commands) for plan in plans for point, commands in plan if commands]
  print(f"{len(todo)} runs to do under {root}", flush=True)
  if args.dry_run:
    for i, (_, commands) in enumerate(todo, 1):
      print(f"[{i}/{len(todo)}] {describe(commands)}", flush=True)
    return
  grid = Grid(args, storage, cells, len(todo))
  signal.signal(signal.SIGTERM, grid.stop_on_signal)
  signal.signal(signal.SIGINT, grid.stop_on_signal)
  threads = [threading.Thread(target=grid.work, args=(cores,))
             for cores in core_groups(args.parallel)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  if grid.stopping.is_set():
    sys.exit(PREEMPTED)
  if grid.failed:
    sys.exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line (sys.argv when argv is None); experiments/fair.py reads its commands
  with it."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", type=pathlib.Path, required=True)
  parser.add_argument("--tasks", default="rte")
  parser.add_argument("--objectives", default="ce")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--preset", default="model=minilm",
                      help="extra comma-separated presets, e.g. model=minilm,epochs=1")
  parser.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2,...",
                      help="one more grid axis: a scalar config field and its values (repeat "
                      "for more axes), e.g. --grid aux_weight=0.1,0.3 --grid temperature=0.1,0.5")
  parser.add_argument("--study", default=None,
                      help="study name prefix (default: the root's name); the studies are "
                      "<study>/<task>/<objective>")
  parser.add_argument("--storage", default=None,
                      help="Optuna storage URL shared by every worker (default: "
                      "sqlite:///<root>/study.db); a path without :// is a journal file")
  parser.add_argument("--heartbeat", type=int, default=60,
                      help="seconds between a running trial's heartbeats (SQL storages); a "
                      "trial silent for twice as long is failed and queued again")
  parser.add_argument("--value", choices=("final", "best"), default="final",
                      help="the trial's value: the main dev metric at the final step or at the "
                      "best evaluation")
  parser.add_argument("--records", type=pathlib.Path, default=None,
                      help="run records kept as evidence (e.g. experiments/results/records/"
                      "acl_minilm): finished runs are copied there, and runs found there skipped")
  parser.add_argument("--early_exit", action="store_true",
                      help="multi-exit grids: after a run trains, sweep its exit policies "
                      "(--mode=early_exit, which needs the run's checkpoints) before keeping its "
                      "record; a trained run whose early_exit.json is missing gets the sweep only")
  parser.add_argument("--early_exit_examples", type=int, default=None,
                      help="dev examples timed at batch size 1 by each sweep (default: all)")
  parser.add_argument("--dry_run", action="store_true", help="print the commands only")
  parser.add_argument("--report", action="store_true",
                      help="print each (task, objective)'s values and best point, run nothing")
  parser.add_argument("--parallel", type=int, default=1,
                      help="runs at once, each pinned to its share of the cores with XLA's "
                      "threads to match (2 on a 2-core CPU: about 1.2x the throughput of one "
                      "run on both cores, and compiles overlap)")
  return parser.parse_args(argv)


def make_cells(args, root: pathlib.Path) -> list[Cell]:
  """The grid's points by (task, objective), each config string checked by acl_jax.config."""
  axes = {}
  for flag in args.grid:
    field, sep, values = flag.partition("=")
    field = config_lib.ALIASES.get(field.strip(), field.strip())
    if not sep or not field or not values.strip(","):
      raise SystemExit(f"--grid {flag!r}: expected FIELD=V1,V2,... (e.g. aux_weight=0.1,0.3)")
    if field in ("task", "objective", "seed"):
      raise SystemExit(f"--grid {flag!r}: {field} has its own flag, --{field}s")
    if field in axes:
      raise SystemExit(f"--grid {flag!r}: {field} is already an axis")
    if field in config_lib.parse_presets(args.preset)[1]:
      raise SystemExit(f"--grid {flag!r}: {field} is also set by --preset {args.preset!r}; "
                       "drop one")
    axes[field] = [v.strip() for v in values.split(",") if v.strip()]
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    raise SystemExit(f"--seeds {args.seeds!r}: expected integers, e.g. 0,1,2") from None
  prefix = args.study or root.name
  cells = []
  for task, objective in itertools.product(args.tasks.split(","), args.objectives.split(",")):
    base = ",".join(filter(None, [task, args.preset, f"objective={objective}"]))
    # Each value read as its field's type (so 5e-5 and 0.00005 are one point), by the config.
    values = {field: list(dict.fromkeys(parse_value(base, field, raw) for raw in raws))
              for field, raws in axes.items()}
    points = []
    for seed in seeds:
      for combo in itertools.product(*(values[field] for field in sorted(values))):
        extra = dict(zip(sorted(values), combo))
        preset = ",".join([base, f"seed={seed}"] + [f"{k}={v}" for k, v in extra.items()])
        check_preset(preset)
        name = "_".join([f"{task}_{objective}_s{seed}"]
                        + [f"{k}={v}".replace("/", "-") for k, v in extra.items()])
        points.append(Point(task, objective, {"seed": seed, **extra}, preset, root / name))
    cells.append(Cell(task, objective, f"{prefix}/{task}/{objective}",
                      {"seed": distribution(seeds), **{f: distribution(v)
                                                       for f, v in values.items()}},
                      points))
  return cells


def parse_value(base: str, field: str, raw: str):
  try:
    return config_lib.get_config(f"{base},{field}={raw}")[field]
  except ValueError as e:
    raise SystemExit(f"--grid {field}={raw}: {e}") from None


def check_preset(preset: str) -> None:
  try:
    config_lib.get_config(preset)
  except ValueError as e:
    raise SystemExit(f"grid point {preset!r}: {e}") from None


def distribution(values: list) -> optuna.distributions.BaseDistribution:
  """A parameter's distribution. Numbers get a range: a study refuses a categorical parameter
  whose choices change, and later commands may run other seeds or values in the same study."""
  if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    return optuna.distributions.IntDistribution(min(values), max(values))
  if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
    return optuna.distributions.FloatDistribution(min(values), max(values))
  return optuna.distributions.CategoricalDistribution(sorted(set(values), key=str))


def open_storage(url: str, heartbeat: int) -> optuna.storages.BaseStorage:
  """An SQL storage with heartbeats and retries of stale trials, or a journal file."""
  if "://" not in url:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))
  # Several workers write one SQLite file: wait for its lock instead of failing after 5 s.
  engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
  for attempt in range(3):
    try:
      storage = optuna.storages.RDBStorage(
          url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat,
          heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback())
      if url.startswith("sqlite"):
        lock_sqlite_transactions(storage.engine)
      return storage
    except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
      # Workers that start together on a new database both create its tables and version row
      # (Optuna checks, then writes); the one that loses finds them there when it tries again.
      if attempt == 2:
        raise
      time.sleep(1)


def lock_sqlite_transactions(engine: sqlalchemy.Engine) -> None:
  """Makes every transaction on `engine` take SQLite's write lock when it begins.

  A worker takes a queued trial by reading that it is WAITING and then setting it RUNNING in
  one transaction; Optuna locks the row with SELECT ... FOR UPDATE, which SQLite ignores, and
  Python's sqlite3 opens the transaction only at the UPDATE. So two processes could both read
  WAITING and both run the trial (4 processes popping 200 queued trials popped 236). BEGIN
  IMMEDIATE makes the read and the write one step; the SQLAlchemy recipe for pysqlite.
  """
  @sqlalchemy.event.listens_for(engine, "connect")
  def _no_implicit_transactions(dbapi_connection, connection_record):
    del connection_record
    dbapi_connection.isolation_level = None  # sqlite3 leaves BEGIN to SQLAlchemy

  @sqlalchemy.event.listens_for(engine, "begin")
  def _begin_immediate(connection):
    connection.exec_driver_sql("BEGIN IMMEDIATE")

  engine.dispose()  # the pooled connections that opened the storage predate the listeners


def load_study(storage, cell: Cell, *, create: bool = True) -> optuna.Study | None:
  """The cell's study over a GridSampler of its points (None: not created yet, or no storage).

  Queued trials carry their parameters; the sampler places any trial a worker opens when the
  queue has just emptied (workers of two processes race for the last one) on a grid point,
  which earlier_holder() then checks like any other.
  """
  if storage is None:
    return None
  sampler = optuna.samplers.GridSampler(
      {name: point_values(cell, name) for name in cell.distributions}, seed=0)
  if not create:
    try:
      return optuna.load_study(study_name=cell.study_name, storage=storage, sampler=sampler)
    except KeyError:
      return None
  return optuna.create_study(study_name=cell.study_name, storage=storage, sampler=sampler,
                             direction="maximize", load_if_exists=True)


def point_values(cell: Cell, name: str) -> list:
  return sorted({point.params[name] for point in cell.points}, key=str)


def trial_point(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
  """A trial's grid point: its parameters, or before it runs, the ones it was queued with."""
  return {**trial.system_attrs.get("fixed_params", {}), **trial.params}


def pending(point: Point, args) -> list[list[str]]:
  """What a point still needs, from its files: train (no eval_results.json in its workdir or
  record), then sweep (--early_exit and no early_exit.json)."""
  commands = []
  if not has_output(point.workdir, args.records, "eval_results.json"):
    commands.append(train_command(point))
  if args.early_exit and not has_output(point.workdir, args.records, "early_exit.json"):
    if commands or (point.workdir / "checkpoints").is_dir():
      commands.append(sweep_command(point.workdir, args.early_exit_examples))
  return commands


def train_command(point: Point) -> list[str]:
  return [sys.executable, "-m", "acl_jax.main", f"--config=configs/glue.py:{point.preset}",
          f"--workdir={point.workdir}"]


def queue_points(storage, cell: Cell, args, *, dry_run: bool
                 ) -> list[tuple[Point, list[list[str]]]]:
  """Queues (WAITING) each point of `cell` that no trial holds or has done, and returns those
  points and the ones queued earlier and still waiting (an earlier command's, or a dead
  worker's trial queued again), each with the commands it needs. With dry_run, queues
  nothing."""
  study = load_study(storage, cell, create=not dry_run)
  trials = []
  if study is not None:
    if not dry_run:
      optuna.storages.fail_stale_trials(study)  # a dead worker's trial is queued again first
    trials = study.get_trials(deepcopy=False)
  check_search_space(cell, trials)
  plan = []
  for point in cell.points:
    same = [t for t in trials if trial_point(t) == point.params]
    if any(t.state == optuna.trial.TrialState.WAITING for t in same):
      plan.append((point, pending(point, args)))  # in the queue already: this command's too
      continue
    if any(t.state in ACTIVE or (t.state == optuna.trial.TrialState.COMPLETE
                                 and (t.user_attrs.get("swept") or not args.early_exit))
           for t in same):
      continue
    commands = pending(point, args)
    if args.early_exit and not commands and not has_output(point.workdir, args.records,
                                                           "early_exit.json"):
      print(f"cannot sweep {point.workdir.name}: trained elsewhere and its checkpoints are not "
            f"under {point.workdir}", flush=True)
    plan.append((point, commands))
    if not dry_run:
      study.add_trial(optuna.trial.create_trial(
          state=optuna.trial.TrialState.WAITING,
          system_attrs={"fixed_params": point.params,
                        QUEUED_AFTER: max((t.number for t in same), default=-1)}))
  return plan


def check_search_space(cell: Cell, trials: list[optuna.trial.FrozenTrial]) -> None:
  """One study is one search space: refuse a command whose grid axes differ from those of the
  trials in its study. A worker takes any queued trial of its study, and one queued without an
  axis of its grid would run at this command's value of that axis (e.g. a default-gate point
  trained with --grid gate_granularity=global)."""
  axes = set(cell.distributions)
  others = sorted({tuple(sorted(point)) for point in map(trial_point, trials)
                   if point and set(point) != axes})
  if others:
    raise SystemExit(
        f"study {cell.study_name!r} holds trials over {' and '.join(map(', '.join, others))}, "
        f"but this command's grid is over {', '.join(sorted(axes))}: give one of the two "
        "commands its own --study (or --storage)")


class RunFailed(Exception):
  """A run's command exited non-zero: its trial fails, and the worker takes the next one."""


class Grid:
  """The workers of one command: each takes queued trials until none is left."""

  def __init__(self, args, storage, cells: list[Cell], total: int):
    self.args, self.storage, self.cells, self.total = args, storage, cells, total
    self.lock = threading.Lock()
    self.started = 0  # runs started by this command, for the [i/total] lines
    self.failed = False
    self.stopping = threading.Event()
    # Held from a worker's look at the queue until its trial is popped, so that this process's
    # workers never race each other for the last queued trial.
    self.popping = threading.Lock()
    self.children: set[subprocess.Popen] = set()

  def stop_on_signal(self, signum, frame):
    """Takes no new trial; a SIGTERM goes on to the runs, which save and exit 75 (a Ctrl-C in
    a terminal reached them already). A second Ctrl-C interrupts at once."""
    del frame
    self.stopping.set()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if signum == signal.SIGTERM:
      with self.lock:
        for child in self.children:
          child.send_signal(signal.SIGTERM)

  def work(self, cores: set[int] | None) -> None:
    try:
      self.take_trials(cores)
    except BaseException:
      self.failed = True  # the thread prints the traceback; the command must not exit 0
      raise

  def take_trials(self, cores: set[int] | None) -> None:
    for cell in self.cells:
      # One Study object per worker: a study's stop flag is shared by its optimize() calls.
      study = load_study(self.storage, cell)
      while not self.stopping.is_set():
        held = [self.popping.acquire()]
        try:
          optuna.storages.fail_stale_trials(study)
          if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            break
          # optimize(), not ask() and tell(): it beats the trial's heartbeat while the run goes.
          study.optimize(lambda trial: self.run_trial(cell, trial, cores, held), n_trials=1,
                         catch=(RunFailed,))
        finally:
          if held[0]:
            self.popping.release()

  def run_trial(self, cell: Cell, trial: optuna.Trial, cores: set[int] | None,
                held: list[bool]) -> float:
    held[0] = False  # popped: the next worker may look at the queue
    self.popping.release()
    queued = trial.study.get_trials(deepcopy=False)[trial.number]
    if trial_point(queued) and set(trial_point(queued)) != set(cell.distributions):
      # Queued by a command over other axes that started with this one (each checked the
      # study before the other queued): running it here would fill in or drop an axis.
      raise optuna.TrialPruned(f"trial {trial.number} was queued with {trial_point(queued)} by "
                               "a command with other --grid axes; run that command again")
    params = {name: suggest(trial, name, dist) for name, dist in cell.distributions.items()}
    point = next((p for p in cell.points if p.params == params), None)
    if point is None:  # queued by a command with other values
      raise optuna.TrialPruned(f"grid point {params} is not in this command's grid; run the "
                               "command that queued it again")
    holder = earlier_holder(trial, queued.system_attrs.get(QUEUED_AFTER, -1), params)
    if holder is not None:
      trial.set_user_attr("duplicate_of", holder)
      print(f"    {point.workdir.name}: trial {holder} has it; trial {trial.number} skipped",
            flush=True)
      raise optuna.TrialPruned(f"trial {holder} holds or has done this grid point")
    commands = pending(point, self.args)
    trial.set_user_attr("workdir", str(point.workdir))
    trial.set_user_attr("command", describe([train_command(point)]))
    if commands:
      self.run_commands(point, commands, cores)
    if self.args.early_exit:
      trial.set_user_attr("swept", has_output(point.workdir, self.args.records,
                                              "early_exit.json"))
    record, metric, value = read_value(point.workdir, self.args.records, self.args.value)
    trial.set_user_attr("record", str(record))
    trial.set_user_attr("metric", f"{metric} ({self.args.value})")
    return value

  def run_commands(self, point: Point, commands: list[list[str]], cores) -> None:
    with self.lock:
      self.started += 1
      i = self.started
      print(f"[{i}/{self.total}] {describe(commands)}"
            + (f" (cores {sorted(cores)})" if cores else ""), flush=True)
    point.workdir.mkdir(parents=True, exist_ok=True)  # an unfinished run resumes its checkpoint
    env = pinned_env(len(cores)) if cores else dict(os.environ)
    start = time.time()
    returncode = 0
    with open(point.workdir / "log.txt", "a") as log:
      for command in commands:  # train, then sweep; a failed step stops the rest
        with self.lock:
          if self.stopping.is_set():
            returncode = PREEMPTED
            break
          child = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, preexec_fn=child_setup(cores))
          self.children.add(child)
        returncode = child.wait()
        with self.lock:
          self.children.discard(child)
        if self.stopping.is_set() and -returncode in (signal.SIGTERM, signal.SIGINT):
          # The signal reached the run before it installed its handler (it was still starting
          # up): it had nothing to save, so this is a stop like any other, not a failure.
          returncode = PREEMPTED
        if returncode:
          break
    status = {0: "ok", PREEMPTED: f"stopped (exit {PREEMPTED}; rerun to resume)"}.get(
        returncode, f"FAILED (exit {returncode})")
    kept = (f"; record: {keep_record(point.workdir, self.args.records)}"
            if returncode == 0 and self.args.records else "")
    with self.lock:
      print(f"    [{i}] {status} in {time.time() - start:.0f} s; log: "
            f"{point.workdir / 'log.txt'}" + kept, flush=True)
      self.failed |= returncode not in (0, PREEMPTED)
    if returncode == PREEMPTED:
      # PRUNED, not FAIL: a stop is not a failure (Optuna would log one, with a traceback), and
      # a pruned point, held by no trial, is queued again when the command runs again.
      raise optuna.TrialPruned(f"{point.workdir.name} stopped (exit {PREEMPTED}); run the "
                               "command again to resume it from its checkpoint")
    if returncode:
      raise RunFailed(f"{describe(commands)} exited {returncode}")


def suggest(trial: optuna.Trial, name: str, dist) -> Any:
  if isinstance(dist, optuna.distributions.IntDistribution):
    return trial.suggest_int(name, dist.low, dist.high)
  if isinstance(dist, optuna.distributions.FloatDistribution):
    return trial.suggest_float(name, dist.low, dist.high)
  return trial.suggest_categorical(name, dist.choices)


def earlier_holder(trial: optuna.Trial, after: int, params: dict[str, Any]) -> int | None:
  """The number of a trial queued after this one's point was last free, and before this one,
  that waits for, runs or has done the same point (its worker got there first); None if none.

  Trials are numbered in order of creation, so of two trials queued for one point by workers
  that started together, every worker agrees the earlier one runs it.
  """
  for other in trial.study.get_trials(deepcopy=False):
    if (after < other.number < trial.number and trial_point(other) == params
        and (other.state in ACTIVE or other.state == optuna.trial.TrialState.COMPLETE)):
      return other.number
  return None


def read_value(workdir: pathlib.Path, records: pathlib.Path | None, which: str
               ) -> tuple[pathlib.Path, str, float]:
  """(the record read: records/<name> if there, else the workdir; its main metric; that
  metric's dev value at the final or best evaluation) from eval_results.json."""
  record = records.resolve() / workdir.name if records else workdir
  if not (record / "eval_results.json").exists():
    record = workdir
  results = json.loads((record / "eval_results.json").read_text())
  split, _, metric = results["main_metric"].partition("/")  # e.g. validation/avg/accuracy
  return record, results["main_metric"], float(results[which][split][metric])


def report(storage, cells: list[Cell], select_seed: int) -> None:
  """Prints, per (task, objective), each point's value by seed and the best point on
  `select_seed` (the hyper-parameters to keep)."""
  for cell in cells:
    study = load_study(storage, cell, create=False)
    done = {}  # the latest complete trial of each point
    for trial in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)) if study else ():
      done[json.dumps(trial.params, sort_keys=True)] = trial
    if not done:
      print(f"{cell.study_name}: no complete trial\n")
      continue
    axes = sorted({k for t in done.values() for k in t.params if k != "seed"})
    seeds = sorted({t.params["seed"] for t in done.values()})
    rows = {}
    for trial in done.values():
      rows.setdefault(tuple(trial.params.get(a) for a in axes), {})[trial.params["seed"]] = (
          trial.value)
    best = max((row for row in rows if select_seed in rows[row]),
               key=lambda row: rows[row][select_seed], default=None)
    metric = next(iter(done.values())).user_attrs.get("metric", "value")
    chosen = (" ".join(f"{a}={v}" for a, v in zip(axes, best)) or "(no axes)"
              if best is not None else "none")
    print(f"{cell.study_name}: {metric}; best on seed {select_seed}: {chosen}")
    print("| " + " | ".join(axes + [f"s{s}" for s in seeds] + ["mean"]) + " |")
    print("|" + "---|" * (len(axes) + len(seeds) + 1))
    for row in sorted(rows, key=str):
      values = [rows[row].get(s) for s in seeds]
      known = [v for v in values if v is not None]
      print("| " + " | ".join([str(v) for v in row]
                              + [f"{v:.4f}" if v is not None else "" for v in values]
                              + [f"{sum(known) / len(known):.4f}"])
            + (" |  <- best" if row == best else " |"))
    print()


def has_output(workdir: pathlib.Path, records: pathlib.Path | None, name: str) -> bool:
  """Whether a run wrote `name` (eval_results.json: trained; early_exit.json: swept), in its
  workdir or in its record."""
  places = [workdir] + ([records / workdir.name] if records else [])
  return any((d / name).exists() for d in places)


def describe(commands: list[list[str]]) -> str:
  """A run's steps as one line, without the interpreter's path."""
  return " && ".join(" ".join(command[1:]) for command in commands)


def sweep_command(workdir: pathlib.Path, max_examples: int | None) -> list[str]:
  return [sys.executable, "-m", "acl_jax.main", "--mode=early_exit", f"--workdir={workdir}"] + (
      [f"--max_examples={max_examples}"] if max_examples else [])


def keep_record(workdir: pathlib.Path, records: pathlib.Path) -> pathlib.Path:
  """Copies a finished run's small files (never its checkpoints) to records/<name>/."""
  record = records / workdir.name
  record.mkdir(parents=True, exist_ok=True)
  for name in RECORD_FILES:
    if (workdir / name).exists():
      shutil.copy2(workdir / name, record / name)
  return record


def child_setup(cores: set[int] | None):
  """What a run's process does before it starts: pin itself to `cores`, and ask Linux for a
  SIGTERM when its worker dies, since a worker that stops beating has its trial run again
  elsewhere, and two processes must never train in one workdir (the SIGTERM makes the run save
  and exit)."""

  def setup():
    if cores:
      os.sched_setaffinity(0, cores)
    if sys.platform == "linux":
      ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG

  return setup


def core_groups(parallel: int) -> list[set[int] | None]:
  """One CPU set per concurrent run: the usable cores split evenly (None: one run, unpinned)."""
  if parallel <= 1:
    return [None]
  cores = sorted(os.sched_getaffinity(0))
  if parallel > len(cores):
    raise SystemExit(f"--parallel {parallel} exceeds the {len(cores)} usable cores")
  return [set(cores[i::parallel]) for i in range(parallel)]


def xla_thread_flags(num_cores: int) -> str:
  """XLA:CPU sizes its thread pool to the machine, not to the affinity mask: a run pinned to
  one core gets no Eigen thread pool at all, so its threads do not fight over that core."""
  return f"--xla_cpu_multi_thread_eigen={'true' if num_cores > 1 else 'false'}"


def pinned_env(num_cores: int) -> dict[str, str]:
  """This process's environment for a run pinned to `num_cores` cores: $XLA_FLAGS (kept)
  plus xla_thread_flags."""
  flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), xla_thread_flags(num_cores)]))
  return {**os.environ, "XLA_FLAGS": flags}


if __name__ == "__main__":
  main()
