"""The fair comparison (experiments/results/README.md, "The fair comparison: protocol"): what its
selection runs chose, the run_grid commands it still needs, and which runs each cell reports.

    git worktree add --detach ../fair1 5eb4784     # once: the code every run executes (fair-1)
    python experiments/fair.py plan                # choices so far, then the commands with
                                                   # runs left, and how many
    python experiments/fair.py run --checkout ../fair1
    python experiments/fair.py tables              # fair_single_exit.{md,jsonl}, fair_multi_exit.{md,jsonl},
                                                   # fair_multi_exit_<task>.png, fair_pilot_<task>.{json,png}

Each comparison (COMPARISONS, chosen by --comparison, fair-1 by default) is one commit on one
machine type with its own records (records/fair_<n>/, fair_<n>_multi_exit/, fair_<n>_pilot/) and
run roots (runs/fair_<n>...); a session adds runs only to the comparison of its machine type:

    git worktree add --detach ../fair2 992fa4a
    python experiments/fair.py run --comparison fair-2 --checkout ../fair2

`run` executes the tag's own experiments/run_grid.py in that checkout (refusing a checkout at any
other commit), so the runs execute the tag's code while this script, the records (under this
checkout's experiments/results/records/) and the tables move on with main.

Stages, per task (each starts once the choices it needs are in the records):
  1. CE on seed 0 at each learning rate of LEARNING_RATES;
  2. CE+SCL and ACL on seed 0 over the paper's λ x τ grid, at CE's chosen learning rate;
  3. the report, seeds 1-3: CE, CE+SCL at its choice, ACL and ACL-Embed at ACL's;
  4. multi-exit, mean-pooled exits, seeds 1-3, each run swept for early exit: CE, KD and DeeBERT
     (its off-ramps with their own poolers) at CE's learning rate, ACL and ACL-CL at ACL's
     λ and τ (per-exit gate); on ABLATION_TASK also ACL-CL with the global gate;
  5. the pilot, seed 0: CE+SCL at its choice and ACL-Embed at ACL's, with every batch's
     CE/aux gradient cosine logged (measure_conflict, log_every=1), drawn by
     `pilot_gradient_angle.py --runs <its records>`.
The tables, figures and answers are computed in experiments/fair_report.py.

A choice is the grid point with the best final-step dev main metric on seed 0, ties going to the
point listed first; it is made only once every point of its grid has a record. The commands are
run_grid's, so a point already in the records is never trained again, and a command is planned
while run_grid would still train or sweep one of its points (read from the records and run
directories as run_grid reads them); `run` plans again after each command ends, so the stages
a finished grid unlocks run in the same invocation, and a command whose runs failed does not
hold up the others (it exits 1 at the end, naming them). A run stopped by a signal stops every
lane, and `run` exits 75 as run_grid does: rerun it to continue. Rerun, its lanes first finish
the runs the stop left part way (resume), since run_grid would start its fresh points before
them. `run` keeps LANES commands going at once, each a single run_grid worker pinned to its own
core (class Lanes).
"""

import argparse
import collections
import dataclasses
import functools
import itertools
import math
import pathlib
import signal
import subprocess
import sys
import threading
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "experiments"))

import run_grid  # noqa: E402  (experiments/ on the path first)
import summarize  # noqa: E402
from acl_jax import host  # noqa: E402
from acl_jax import run_dir  # noqa: E402
from acl_jax.preemption import EXIT_CODE as PREEMPTED  # noqa: E402  (run_grid's exit on SIGTERM)

RECORDS = REPO_ROOT / "experiments" / "results" / "records"


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One comparison: the commit every one of its runs executes (tagged `tag` where tags travel;
  the hash is what counts, since a clone may not carry tags) and where their records go. Its
  machine type is the one its first record names (check_this_machine)."""
  tag: str
  commit: str
  records: pathlib.Path = RECORDS  # holds <name>/, <name>_multi_exit/ and <name>_pilot/

  @property
  def name(self) -> str:  # fair_1: the records' and the run roots' directory name
    return self.tag.replace("-", "_")

  @property
  def single_records(self) -> pathlib.Path:  # selection and single-exit report runs
    return self.records / self.name

  @property
  def multi_records(self) -> pathlib.Path:
    return self.records / f"{self.name}_multi_exit"

  @property
  def pilot_records(self) -> pathlib.Path:
    return self.records / f"{self.name}_pilot"

  def read(self) -> tuple[list[dict], list[dict], list[dict]]:
    """Its records: single exit, multi-exit, pilot."""
    return tuple(read_records(d) for d in (self.single_records, self.multi_records,
                                           self.pilot_records))


# fair-2 runs the same protocol from zero on another machine type: fair-1's type (CPU
# fingerprint 4202c509659cc6d0) was not to be had for four sessions running, and a session adds
# runs only to the comparison of its own type. fair-3 does the same on a third type
# (e9df68b1bfcc9be6, first drawn on 2026-12-05 after nine sessions of fair-2's), at fair-2's
# commit, so the two differ only by the CPU. fair-4 does the same again on an "Intel Xeon" type
# (acdd0ee1ca63d0a7, drawn on 2026-12-06; earlier Intel records predate the CPU fingerprint),
# and fair-5 on a fourth "AMD EPYC" type (11c305853285076d, first drawn on 2026-12-07).
# The first to finish gives the answers.
COMPARISONS = {c.tag: c for c in (
    Comparison("fair-1", "5eb4784f7ffe500d60c3ffae6116b8c6cd24b1e7"),
    Comparison("fair-2", "992fa4ae5a9796830766dc95553b2dc678b0515f"),
    Comparison("fair-3", "992fa4ae5a9796830766dc95553b2dc678b0515f"),
    Comparison("fair-4", "992fa4ae5a9796830766dc95553b2dc678b0515f"),
    Comparison("fair-5", "992fa4ae5a9796830766dc95553b2dc678b0515f"))}
TASKS = ("rte", "mrpc", "cola")
SELECTION_SEED, REPORT_SEEDS = 0, (1, 2, 3)
PRESET = "model=minilm"
MULTI_EXIT_PRESET = "model=minilm,multi_exit,pooler_input=mean"
PILOT_PRESET = "model=minilm,measure_conflict,log_every=1"
ABLATION_TASK = "rte"
# The grids, in the order that breaks ties.
LEARNING_RATES = (5e-5, 1e-4, 2e-4)
AUX_WEIGHTS = (0.1, 0.3, 0.5, 0.9)  # λ
TEMPERATURES = (0.1, 0.3, 0.5, 0.7)  # τ
SINGLE_EXIT = ("ce", "scl", "acl_embed", "acl")
MULTI_EXIT = ("ce", "kd", "deebert", "acl", "acl_cl")
GATED = ("acl", "acl_cl")  # at ACL's λ and τ, with the per-exit gate in the multi-exit runs
# Every run pinned to one core with XLA's thread pool to match: one execution setup for every
# run, since a thread count can change the order of XLA's reductions. `run` gives each of LANES
# run_grid commands its own core and one worker (--parallel 1), the setup run_grid's own
# --parallel 2 gives each of its workers; unlike one --parallel 2 command at a time, a lane
# whose command is down to its last run takes the next command, or joins the other lane's,
# instead of leaving its core idle.
LANES = 2
GRID = ("learning_rate", "aux_weight", "temperature")  # a contrastive selection point
# Dev examples each early-exit sweep times at batch size 1 (its metrics and counted speed-ups
# use every example): timing all of CoLA's 1043 at 28 thresholds would add about 25 minutes to
# each of the 48 multi-exit runs, for the measured points, which no comparison reads.
TIMED_EXAMPLES = 128


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("stage", choices=("plan", "run", "tables"))
  parser.add_argument("--comparison", choices=COMPARISONS, default="fair-1",
                      help="which comparison: " + ", ".join(
                          f"{c.tag} runs {c.commit[:7]}" for c in COMPARISONS.values()))
  parser.add_argument("--root", type=pathlib.Path, default=None,
                      help="where the run directories and the studies go (single exit in "
                      "<root>, multi-exit in <root>_multi_exit; default runs/<comparison>)")
  parser.add_argument("--checkout", type=pathlib.Path, default=None,
                      help="run: a checkout of the comparison's commit (git worktree add "
                      "--detach ../fair1 5eb4784 for fair-1)")
  args = parser.parse_args(argv)
  comparison = COMPARISONS[args.comparison]
  if args.stage == "tables":
    import fair_report  # experiments/, beside this script
    fair_report.write_tables(comparison)
    return
  root = (args.root or pathlib.Path("runs") / comparison.name).resolve()
  single, multi, pilot = comparison.read()
  print(describe_choices(single))
  todo = to_do(next_commands(single, root, comparison))
  if args.stage == "plan":
    print(f"{sum(todo.values())} runs left, in {len(todo)} run_grid commands (`run` keeps "
          f"{LANES} going, each pinned to its own core):")
    for command, left in todo.items():
      print(f"  [{left}] " + " ".join(command))
    return
  if args.checkout is None:
    raise SystemExit(f"run needs --checkout: a checkout of {comparison.tag} "
                     f"({comparison.commit[:7]}), whose code the runs execute")
  checkout = args.checkout.resolve()
  check_pinned_commit(checkout, comparison)
  check_one_commit_and_machine(single + multi + pilot)
  check_this_machine(single + multi + pilot, host.machine(), host.cpu_fingerprint(),
                     comparison.tag)
  check_run_directories(run_roots(root), host.cpu_fingerprint())
  children: set[subprocess.Popen] = set()
  # A SIGTERM here goes on to the workers, which pass it to their runs (they save and exit 75).
  signal.signal(signal.SIGTERM, lambda *_: [c.send_signal(signal.SIGTERM) for c in set(children)])
  replan = lambda: to_do(next_commands(read_records(comparison.single_records), root,
                                       comparison))
  resumes = [(command, functools.partial(resume, *job, checkout=checkout, children=children))
             for command, *job in interrupted_points(list(todo))]
  lanes = Lanes(todo, replan, resumes)
  lanes.run(lambda command, cores: run_pinned(command, cores, checkout, children),
            run_grid.core_groups(LANES))
  if lanes.stopped is not None:  # exit 75 as run_grid does: a stop to retry, not a failure
    print(f"a run stopped (exit {lanes.stopped}); rerun `fair.py run` to continue",
          file=sys.stderr)
    sys.exit(PREEMPTED)
  if lanes.failed:
    raise SystemExit(f"{len(lanes.failed)} run_grid commands had failed runs (their logs "
                     "above); rerun `fair.py run` to retry them:\n"
                     + "\n".join(map(" ".join, lanes.failed)))


def run_pinned(command: list[str], cores: set[int], cwd: pathlib.Path,
               children: set[subprocess.Popen], stdout=None) -> int:
  """Runs `python <command>` in cwd pinned to `cores`, XLA's thread pool sized to match, and
  returns its exit status; the process is in `children` while it runs, and gets a SIGTERM if
  this one dies (run_grid.child_setup: a run saves and exits, never outliving `run`)."""
  # run_grid --parallel 1 pins nothing itself: its worker and runs inherit these cores.
  child = subprocess.Popen([sys.executable, *command], cwd=cwd, stdout=stdout,
                           stderr=subprocess.STDOUT if stdout else None,
                           env=run_grid.pinned_env(len(cores)),
                           preexec_fn=run_grid.child_setup(cores))
  children.add(child)
  try:
    return child.wait()
  finally:
    children.discard(child)


def interrupted_points(commands) -> list[tuple[tuple[str, ...], run_grid.Point,
                                                list[list[str]], pathlib.Path]]:
  """The points of run_grid `commands` whose run was stopped part way: a checkpoint in its run
  directory and a step still pending (train, or the early-exit sweep), each after its command
  and with those steps and its command's --records, as run_grid reads them."""
  found = []
  for command in commands:
    args = run_grid.parse_args(list(command[1:]))
    for cell in run_grid.make_cells(args, args.root.resolve()):
      for point in cell.points:
        steps = run_grid.pending(point, args)
        if steps and (point.workdir / "checkpoints").is_dir():
          found.append((tuple(command), point, steps, args.records))
  return found


def resume(point: run_grid.Point, steps: list[list[str]], records: pathlib.Path | None,
           cores: set[int], *, checkout: pathlib.Path, children: set[subprocess.Popen]) -> int:
  """Finishes a run a stop left part way, as run_grid would: its pending steps (train, then
  sweep; a failed step stops the rest) with the checkout's code pinned to `cores`, output
  appended to its log.txt, and its record kept as run_grid keeps it (keep_record). Returns the
  exit status of the last step run.

  Lanes runs these before run_grid's commands: run_grid queues a stopped point again behind
  every point it queued before and has not started (Optuna hands out the oldest queued trial
  first), so each stop and restart would start fresh runs and leave the stopped ones waiting,
  some a few steps from the end. When run_grid reaches the point it finds it done and reads
  its value; a failed step is left to run_grid, which runs it again and reports it.
  """
  start = time.time()
  say(f"resume {run_grid.describe(steps)} (core {','.join(map(str, sorted(cores)))})")
  for step in steps:
    with open(point.workdir / "log.txt", "a") as log:
      returncode = run_pinned(step[1:], cores, checkout, children, stdout=log)
    if returncode:
      break
  kept = ""
  if returncode == 0 and records is not None:
    kept = f"; record: {run_grid.keep_record(point.workdir, records)}"
  status = {0: "ok"}.get(returncode, f"exit {returncode}")
  say(f"    {status} in {time.time() - start:.0f} s; log: {point.workdir / 'log.txt'}" + kept)
  return returncode


SAY = threading.Lock()  # the lanes' threads print whole lines


def say(line: str) -> None:
  with SAY:
    print(line, flush=True)


class Lanes:
  """Hands run_grid commands to lanes, one core each.

  The plan maps each command with runs left to how many (to_do). A lane first takes the runs a
  stop left part way (resumes: each a command and a function of the cores that finishes one of
  its runs), and a command waits until none of its own are left or running, so that its
  run_grid worker never reaches a point being resumed; the other commands need not wait. Then
  a lane takes the first command of the latest plan that no lane runs and no lane has taken,
  or that has fewer runs left than when a lane last took it (its worker ended early, say
  because another command's worker held its trials, yet it moves on: taken again, it ends,
  since each take needs progress). The records a command adds can make choices, and with them
  the next stages' commands (a grid finished at noon starts its report runs the same
  afternoon). With none to take, a lane joins a command that one other lane runs, as a second
  worker on that command's Optuna study; with none of those, it waits for a lane to finish and
  the plan to be made again. A run stopped by a signal (exit 75, or killed) stops every lane
  from taking more; a failed run does not hold up other commands, and its command is not
  taken again (a failed resume is left to its command's run_grid, which runs it again and
  reports it). A plan that cannot be made (a record that cannot be read, say) stops every lane
  from taking more, and run() raises its error once the commands running then have ended.
  """

  def __init__(self, plan: dict[tuple[str, ...], int], replan, resumes=()):
    self.plan, self.replan = plan, replan  # command -> runs left; replan() makes the next
    self.resumes = collections.deque(resumes)  # (command, resume(cores) -> exit status)
    self.resuming = collections.Counter(command for command, _ in self.resumes)  # not ended
    self.changed = threading.Condition()
    self.taken: dict[tuple[str, ...], int] = {}  # command -> runs left when last taken fresh
    self.joined = set()  # commands a second lane has joined
    self.workers = collections.Counter()  # command -> lanes running it now
    self.failed: list[tuple[str, ...]] = []
    self.stopped: int | None = None  # the exit status that stopped the lanes
    self.error: Exception | None = None  # why the plan could not be made again

  def take(self):
    """The next job: (command, a resume of one of its runs), (command, None) for its run_grid
    worker, or None when there is nothing more to take."""
    with self.changed:
      while self.stopped is None and self.error is None:
        if self.resumes:
          return self.resumes.popleft()
        fresh = [c for c, left in self.plan.items()
                 if not self.workers[c] and not self.resuming[c] and c not in self.failed
                 and left < self.taken.get(c, math.inf)]
        alone = [c for c, n in self.workers.items() if n == 1 and c not in self.joined]
        if fresh:
          command = fresh[0]
          self.taken[command] = self.plan[command]
          self.joined.discard(command)  # a new worker: a second lane may join it again
        elif alone:
          command = alone[0]
          self.joined.add(command)
        if fresh or alone:
          self.workers[command] += 1
          return command, None
        if not self.workers and not self.resuming:  # nothing runs, so nothing can plan more
          return None
        self.changed.wait()
      return None

  def finish(self, command: tuple[str, ...], returncode: int, resumed: bool = False) -> None:
    with self.changed:
      running = self.resuming if resumed else self.workers
      running[command] -= 1
      if not running[command]:
        del running[command]
      if returncode == PREEMPTED or returncode < 0:
        self.stopped = returncode
      elif returncode and not resumed and command not in self.failed:  # its cell waits
        self.failed.append(command)
      try:
        self.plan = self.replan()
      except Exception as error:  # raised by run(): a lane waiting for this plan must not hang
        self.error = error
      self.changed.notify_all()

  def run(self, execute, core_sets: list[set[int]]) -> None:
    """execute(command, cores) -> exit status, called by one thread per core set."""
    def lane(cores):
      while (job := self.take()) is not None:
        command, resumption = job
        if resumption is None:
          say(f"$ {' '.join(command)} (core {','.join(map(str, sorted(cores)))})")
        returncode = 1
        try:
          returncode = resumption(cores) if resumption else execute(command, cores)
        finally:
          self.finish(command, returncode, resumed=resumption is not None)
    threads = [threading.Thread(target=lane, args=(cores,)) for cores in core_sets]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    if self.error is not None:
      raise self.error


def to_do(commands: list[list[str]]) -> dict[tuple[str, ...], int]:
  """The commands that have runs left, each with how many, in the order given."""
  left = {tuple(command): runs_left(command) for command in commands}
  return {command: n for command, n in left.items() if n}


def runs_left(command: list[str]) -> int:
  """The points a run_grid command would still train or sweep, read from their run directories
  and records as run_grid reads them (it skips the rest)."""
  args = run_grid.parse_args(command[1:])
  cells = run_grid.make_cells(args, args.root.resolve())
  return sum(bool(run_grid.pending(point, args)) for cell in cells for point in cell.points)


def read_records(directory: pathlib.Path) -> list[dict]:
  """Every finished run recorded under `directory` (summarize.load_run's rows)."""
  if not directory.is_dir():
    return []
  return [run for path in sorted(directory.iterdir())
          if (run := summarize.load_run(path)) is not None]


def score(run: dict) -> float:
  return run["metrics"][run["main_metric"]]


def value_of(run: dict, field: str):
  return run["lr"] if field == "learning_rate" else summarize.config_value(run, field)


def choose(runs, task: str, objective: str, grid: dict[str, tuple]
           ) -> tuple[dict | None, list[dict]]:
  """(the chosen point, None until every point is recorded; the points still missing)."""
  scores = {}
  for run in runs:
    if (run["task"], run["objective"], run["seed"]) == (task, objective, SELECTION_SEED):
      point = tuple(value_of(run, field) for field in grid)
      scores[point] = score(run)
  points = list(itertools.product(*grid.values()))
  missing = [dict(zip(grid, p)) for p in points if p not in scores]
  if missing:
    return None, missing
  best = max(points, key=lambda p: (scores[p], -points.index(p)))  # ties: listed first
  return dict(zip(grid, best)), []


def choices(single: list[dict]) -> dict[str, dict[str, dict | None]]:
  """Per task: the learning rate (from CE) and the λ, τ of CE+SCL and of ACL."""
  out = {}
  for task in TASKS:
    ce, _ = choose(single, task, "ce", {"learning_rate": LEARNING_RATES})
    chosen = {"ce": ce, "scl": None, "acl": None}
    if ce is not None:
      grid = {"learning_rate": (ce["learning_rate"],), "aux_weight": AUX_WEIGHTS,
              "temperature": TEMPERATURES}
      for objective in ("scl", "acl"):
        chosen[objective] = choose(single, task, objective, grid)[0]
    out[task] = chosen
  return out


def describe_choices(single: list[dict]) -> str:
  lines = [f"Choices from seed {SELECTION_SEED} ({len(single)} single-exit records):"]
  for task, chosen in choices(single).items():
    cells = [f"{name}: " + (", ".join(f"{k}={v:g}" for k, v in point.items())
                             if point else "not yet")
             for name, point in chosen.items()]
    lines.append(f"  {task}: " + "; ".join(cells))
  return "\n".join(lines)


def grid_command(root: pathlib.Path, records: pathlib.Path, task: str, objectives, seeds,
                 grid: dict[str, tuple], parallel: int, preset: str = PRESET,
                 early_exit: bool = False, study: str | None = None) -> list[str]:
  command = ["experiments/run_grid.py", "--root", str(root), "--records",
             str(records), "--tasks", task, "--objectives", ",".join(objectives), "--seeds",
             ",".join(map(str, seeds)), "--preset", preset, "--parallel", str(parallel)]
  if study is not None:
    command += ["--study", study]
  for field, values in grid.items():
    command += ["--grid", f"{field}=" + ",".join(map(str, values))]
  return command + (["--early_exit", "--early_exit_examples", str(TIMED_EXAMPLES)]
                    if early_exit else [])


def run_roots(root: pathlib.Path) -> list[pathlib.Path]:
  """Where the runs go: selection (root), report, multi-exit and pilot (<root>_report,
  <root>_multi_exit, <root>_pilot: their own studies, since their grids differ)."""
  return [root, *(root.with_name(root.name + suffix)
                  for suffix in ("_report", "_multi_exit", "_pilot"))]


def next_commands(single: list[dict], root: pathlib.Path, comparison: Comparison
                  ) -> list[list[str]]:
  """The run_grid commands whose inputs are chosen, each in its run_roots directory, recording
  into the comparison's records."""
  select, report, multi, pilot = run_roots(root)
  single_records, multi_records, pilot_records = (
      comparison.single_records, comparison.multi_records, comparison.pilot_records)
  stage1, later = [], []
  for task, chosen in choices(single).items():
    cmd = lambda *a, **k: grid_command(*a, parallel=1, **k)
    stage1.append(cmd(select, single_records, task, ["ce"], [SELECTION_SEED],
                      {"learning_rate": LEARNING_RATES}))
    if chosen["ce"] is None:
      continue
    lr = {"learning_rate": (chosen["ce"]["learning_rate"],)}
    later.append(cmd(select, single_records, task, ["scl", "acl"], [SELECTION_SEED],
                     {**lr, "aux_weight": AUX_WEIGHTS, "temperature": TEMPERATURES}))
    me = dict(preset=MULTI_EXIT_PRESET, early_exit=True)
    later.append(cmd(multi, multi_records, task, ["ce", "kd"], REPORT_SEEDS, lr, **me))
    later.append(cmd(multi, multi_records, task, ["deebert"], REPORT_SEEDS, lr,
                     preset=MULTI_EXIT_PRESET + ",pooler_weights=per_exit", early_exit=True))
    if chosen["scl"] is None or chosen["acl"] is None:
      continue
    single_values = lambda point: {k: (v,) for k, v in point.items()}
    later.append(cmd(report, single_records, task, ["ce"], REPORT_SEEDS, lr))
    later.append(cmd(report, single_records, task, ["scl"], REPORT_SEEDS,
                     single_values(chosen["scl"])))
    acl = single_values(chosen["acl"])
    later.append(cmd(report, single_records, task, ["acl", "acl_embed"], REPORT_SEEDS, acl))
    later.append(cmd(multi, multi_records, task, ["acl", "acl_cl"], REPORT_SEEDS, acl, **me))
    later.append(cmd(pilot, pilot_records, task, ["scl"], [SELECTION_SEED],
                     single_values(chosen["scl"]), preset=PILOT_PRESET))
    later.append(cmd(pilot, pilot_records, task, ["acl_embed"], [SELECTION_SEED], acl,
                     preset=PILOT_PRESET))
    if task == ABLATION_TASK:
      # Its own study: it has one more axis than the per-exit ACL-CL runs in the same root.
      later.append(cmd(multi, multi_records, task, ["acl_cl"], REPORT_SEEDS,
                       {**acl, "gate_granularity": ("global",)}, **me,
                       study=multi.name + "_global_gate"))
  return stage1 + later


def check_pinned_commit(checkout: pathlib.Path, comparison: Comparison) -> None:
  """The runs must execute the comparison's code: refuse a checkout at any other commit, or
  with changes to its files."""
  tag, pinned = comparison.tag, comparison.commit
  git = lambda *a: subprocess.run(["git", "-C", str(checkout), *a], capture_output=True,
                                  text=True).stdout.strip()
  head = git("rev-parse", "HEAD")
  if head != pinned:
    worktree = f"../{tag.replace('-', '')}"
    raise SystemExit(f"{tag}'s runs execute {pinned[:12]}; {checkout} is at "
                     f"{head[:12] or 'no commit'}: git worktree add --detach {worktree} "
                     f"{pinned[:12]}, and pass --checkout {worktree}")
  if git("status", "--porcelain", "--untracked-files=no"):
    raise SystemExit(f"{checkout} has changes to {tag}'s files; the runs must execute it as "
                     "committed")


def check_this_machine(runs: list[dict], here: str, cpu: str, tag: str) -> None:
  """A session on another machine type adds no runs to the comparison: its dev metrics could
  differ in the last bits, and so could a choice. The type is the CPU's model name and its
  feature flags (the fingerprint): XLA compiles for the flags it finds, and on an "AMD EPYC,
  2 cores" VM with other flags one of fair-1's runs, repeated, had another loss by step 60."""
  kinds = sorted({(str(run["machine"]), str(run["cpu"])) for run in runs})
  if kinds and kinds != [(here, cpu)]:
    raise SystemExit(
        f"this machine is {here!r} with CPU fingerprint {cpu}, and the records of {tag} come "
        f"from {' and '.join(f'{m!r} with CPU fingerprint {c}' for m, c in kinds)} "
        "(host.cpu_fingerprint: the model name and feature flags, for which XLA compiles): "
        f"run on that machine type, or run the comparison of this one (--comparison; "
        f"{', '.join(COMPARISONS)}), or add one for it to fair.COMPARISONS (a new tag, "
        "from zero)")


def check_run_directories(roots: list[pathlib.Path], cpu: str) -> None:
  """run_grid resumes a run directory it finds, and records a finished one: a run that a
  session on another machine type started or finished under these roots would join the
  comparison through them, so `run` refuses them until their root is moved aside. (The root's
  study counts them done too; the records hold every finished run of this type.)"""
  foreign = [f"{workdir} ({theirs})" for root in roots if root.is_dir()
             for workdir in sorted(root.iterdir())
             if (theirs := host.recorded_cpu(run_dir.read_meta(workdir) or {})) not in (None, cpu)]
  if foreign:
    raise SystemExit(
        f"these run directories were written on another machine type than this one (CPU "
        f"fingerprint {cpu}), and run_grid would resume or record them: "
        + ", ".join(foreign) + "; move their roots aside (with the studies there, which count "
        "them done; the records keep this type's finished runs), then rerun")


def check_one_commit_and_machine(runs: list[dict]) -> None:
  """Every record of the comparison from one commit on one machine type (CPU model name and
  fingerprint)."""
  for key in ("commit", "machine", "cpu"):
    values = collections.Counter(str(run[key]) for run in runs)
    if len(values) > 1:
      raise SystemExit(f"the fair records mix {key}s: {dict(values)}; a comparison keeps one")


def reported(runs: list[dict], task: str, objective: str, point: dict | None,
             gate: str | None = None) -> list[dict]:
  """The report runs (seeds 1-3) of `objective` at `point`."""
  if point is None:
    return []
  return sorted((r for r in runs if r["task"] == task and r["objective"] == objective
                 and r["seed"] in REPORT_SEEDS
                 and all(value_of(r, k) == v for k, v in point.items())
                 and (gate is None or r["gate_granularity"] == gate)),
                key=lambda r: r["seed"])


def single_exit_runs(single: list[dict]) -> dict[tuple[str, str], tuple[dict | None, list]]:
  """(task, objective): its chosen point (ACL-Embed at ACL's) and its report runs there."""
  out = {}
  for task, chosen in choices(single).items():
    points = {"ce": chosen["ce"], "scl": chosen["scl"], "acl_embed": chosen["acl"],
              "acl": chosen["acl"]}
    for objective in SINGLE_EXIT:
      out[task, objective] = points[objective], reported(single, task, objective,
                                                         points[objective])
  return out


def multi_exit_runs(multi: list[dict], single: list[dict]
                    ) -> list[tuple[str, str, str | None, list[dict]]]:
  """(task, objective, gate, report runs) of every multi-exit cell: CE, KD and DeeBERT at CE's
  learning rate, ACL and ACL-CL at ACL's λ and τ with the per-exit gate, and on ABLATION_TASK
  ACL-CL with the global gate."""
  cells = []
  for task, chosen in choices(single).items():
    variants = [(o, chosen["acl"] if o in GATED else chosen["ce"],
                 "per_exit" if o in GATED else None) for o in MULTI_EXIT]
    if task == ABLATION_TASK:
      variants.append(("acl_cl", chosen["acl"], "global"))
    cells += [(task, o, gate, reported(multi, task, o, point, gate))
              for o, point, gate in variants]
  return cells


if __name__ == "__main__":
  main()
