"""The fair comparison (experiments/results/README.md, "The fair comparison: protocol"): what its
selection runs chose, the run_grid commands it still needs, and its tables.

    git worktree add --detach ../fair1 5eb4784     # once: the code every run executes (fair-1)
    python experiments/fair.py plan                # choices so far, then the commands to run
    python experiments/fair.py run --checkout ../fair1
    python experiments/fair.py tables              # fair_single_exit.{md,jsonl}, fair_multi_exit.{md,jsonl},
                                                   # fair_multi_exit_<task>.png, fair_pilot_<task>.{json,png}

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
The results notebook's generated blocks (experiments/notebook_blocks.py, fair_*) call this
module's progress, selection_table, single_exit_table, multi_exit_table, answers and summary:
an answer is written only once every cell it needs has its report seeds, and a difference counts
when Welch's p < SIGNIFICANCE and the bootstrap interval excludes zero.

A choice is the grid point with the best final-step dev main metric on seed 0, ties going to the
point listed first; it is made only once every point of its grid has a record. The commands are
run_grid's, so a point already in the records is never trained again; `run` plans again after
each one, so the stages a finished grid unlocks run in the same invocation, and a command whose
runs failed does not hold up the others (it exits 1 at the end, naming them).
"""

import argparse
import collections
import itertools
import json
import pathlib
import statistics
import subprocess
import sys

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "experiments"))

import summarize  # noqa: E402  (experiments/ on the path first)
from acl_jax.preemption import EXIT_CODE as PREEMPTED  # noqa: E402  (run_grid's exit on SIGTERM)

# The commit every run of the comparison executes (tagged fair-1 where tags travel; the hash is
# what counts, since a clone may not carry tags).
TAG = "fair-1"
PINNED_COMMIT = "5eb4784f7ffe500d60c3ffae6116b8c6cd24b1e7"
RECORDS = REPO_ROOT / "experiments" / "results" / "records"
SINGLE_RECORDS, MULTI_RECORDS = RECORDS / "fair_1", RECORDS / "fair_1_multi_exit"
PILOT_RECORDS = RECORDS / "fair_1_pilot"
RESULTS = REPO_ROOT / "experiments" / "results"
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
LABELS = {"ce": "CE", "scl": "CE+SCL", "acl_embed": "ACL-Embed", "acl": "ACL", "kd": "KD",
          "deebert": "DeeBERT", "acl_cl": "ACL-CL"}
TASK_NAMES = {"rte": "RTE", "mrpc": "MRPC", "cola": "CoLA"}
# Every run pinned to one core with XLA's thread pool to match (run_grid --parallel 2 on the
# 2-core machines): one execution setup for every run, since a thread count can change the
# order of XLA's reductions.
PARALLEL = 2
GRID = ("learning_rate", "aux_weight", "temperature")  # a contrastive selection point
SPEEDUPS = (1.5, 2.0)  # counted speed-ups at which the multi-exit runs are compared
BOOTSTRAP_SAMPLES = 10_000
SIGNIFICANCE = 0.05  # Welch's p below which a difference (with its interval off 0) counts


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("stage", choices=("plan", "run", "tables"))
  parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path("runs") / "fair_1",
                      help="where the run directories and the studies go (single exit in "
                      "<root>, multi-exit in <root>_multi_exit)")
  parser.add_argument("--checkout", type=pathlib.Path, default=None,
                      help=f"run: a checkout of {TAG} (git worktree add --detach ../fair1 "
                      f"{PINNED_COMMIT[:7]})")
  args = parser.parse_args(argv)
  single, multi = read_records(SINGLE_RECORDS), read_records(MULTI_RECORDS)
  if args.stage == "tables":
    check_one_commit_and_machine(single + multi)
    for name, text, rows in (("fair_single_exit", *single_exit_table(single)),
                             ("fair_multi_exit", *multi_exit_table(multi, single))):
      (RESULTS / f"{name}.md").write_text(text)
      (RESULTS / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
      print(f"wrote {RESULTS / name}.md and .jsonl ({len(rows)} runs)")
    draw_tradeoffs(multi, single)
    draw_pilots(read_records(PILOT_RECORDS), single)
    return
  print(describe_choices(single))
  checkout = (args.checkout or REPO_ROOT).resolve()
  commands = next_commands(single, args.root.resolve())
  if args.stage == "plan":
    print(f"{len(commands)} run_grid commands (points already recorded are skipped):")
    for command in commands:
      print("  " + " ".join(command))
    return
  if args.checkout is None:
    raise SystemExit(f"run needs --checkout: a checkout of {TAG} ({PINNED_COMMIT[:7]}), whose "
                     "code the runs execute")
  check_pinned_commit(checkout)
  check_one_commit_and_machine(single + multi)
  # One command at a time, each the first of a fresh plan not yet run: the records a command
  # adds can make choices, and with them the next stages' commands (a grid finished at noon
  # starts its report runs the same afternoon).
  done, failed = set(), []
  while todo := [c for c in commands if tuple(c) not in done]:
    command = todo[0]
    done.add(tuple(command))
    print("$ " + " ".join(command), flush=True)
    returncode = subprocess.run([sys.executable, *command], cwd=checkout).returncode
    if returncode == PREEMPTED or returncode < 0:  # stopped by a signal: stop here too
      raise SystemExit(f"run_grid stopped (exit {returncode}); rerun `fair.py run` to continue")
    if returncode:  # a failed run: its cell waits, the other cells' runs go on
      failed.append(command)
    single = read_records(SINGLE_RECORDS)
    commands = next_commands(single, args.root.resolve())
  if failed:
    raise SystemExit(f"{len(failed)} run_grid commands had failed runs (their logs above); "
                     "rerun `fair.py run` to retry them:\n" + "\n".join(map(" ".join, failed)))


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
                 early_exit: bool = False) -> list[str]:
  command = ["experiments/run_grid.py", "--root", str(root), "--records",
             str(records), "--tasks", task, "--objectives", ",".join(objectives), "--seeds",
             ",".join(map(str, seeds)), "--preset", preset, "--parallel", str(parallel)]
  for field, values in grid.items():
    command += ["--grid", f"{field}=" + ",".join(map(str, values))]
  return command + (["--early_exit"] if early_exit else [])


def next_commands(single: list[dict], root: pathlib.Path) -> list[list[str]]:
  """The run_grid commands whose inputs are chosen: selection (root), report, multi-exit and
  pilot (<root>_report, <root>_multi_exit, <root>_pilot: their own studies, since their grids
  differ)."""
  select, report = root, root.with_name(root.name + "_report")
  multi, pilot = (root.with_name(root.name + suffix) for suffix in ("_multi_exit", "_pilot"))
  stage1, later = [], []
  for task, chosen in choices(single).items():
    cmd = lambda *a, **k: grid_command(*a, parallel=PARALLEL, **k)
    stage1.append(cmd(select, SINGLE_RECORDS, task, ["ce"], [SELECTION_SEED],
                      {"learning_rate": LEARNING_RATES}))
    if chosen["ce"] is None:
      continue
    lr = {"learning_rate": (chosen["ce"]["learning_rate"],)}
    later.append(cmd(select, SINGLE_RECORDS, task, ["scl", "acl"], [SELECTION_SEED],
                     {**lr, "aux_weight": AUX_WEIGHTS, "temperature": TEMPERATURES}))
    me = dict(preset=MULTI_EXIT_PRESET, early_exit=True)
    later.append(cmd(multi, MULTI_RECORDS, task, ["ce", "kd"], REPORT_SEEDS, lr, **me))
    later.append(cmd(multi, MULTI_RECORDS, task, ["deebert"], REPORT_SEEDS, lr,
                     preset=MULTI_EXIT_PRESET + ",pooler_weights=per_exit", early_exit=True))
    if chosen["scl"] is None or chosen["acl"] is None:
      continue
    single_values = lambda point: {k: (v,) for k, v in point.items()}
    later.append(cmd(report, SINGLE_RECORDS, task, ["ce"], REPORT_SEEDS, lr))
    later.append(cmd(report, SINGLE_RECORDS, task, ["scl"], REPORT_SEEDS,
                     single_values(chosen["scl"])))
    acl = single_values(chosen["acl"])
    later.append(cmd(report, SINGLE_RECORDS, task, ["acl", "acl_embed"], REPORT_SEEDS, acl))
    later.append(cmd(multi, MULTI_RECORDS, task, ["acl", "acl_cl"], REPORT_SEEDS, acl, **me))
    later.append(cmd(pilot, PILOT_RECORDS, task, ["scl"], [SELECTION_SEED],
                     single_values(chosen["scl"]), preset=PILOT_PRESET))
    later.append(cmd(pilot, PILOT_RECORDS, task, ["acl_embed"], [SELECTION_SEED], acl,
                     preset=PILOT_PRESET))
    if task == ABLATION_TASK:
      later.append(cmd(multi, MULTI_RECORDS, task, ["acl_cl"], REPORT_SEEDS,
                       {**acl, "gate_granularity": ("global",)}, **me))
  return stage1 + later


def check_pinned_commit(checkout: pathlib.Path, pinned: str = PINNED_COMMIT) -> None:
  """The runs must execute the pinned code: refuse a checkout at any other commit, or with
  changes to its files."""
  git = lambda *a: subprocess.run(["git", "-C", str(checkout), *a], capture_output=True,
                                  text=True).stdout.strip()
  head = git("rev-parse", "HEAD")
  if head != pinned:
    raise SystemExit(f"the fair comparison's runs execute {TAG} ({pinned[:12]}); {checkout} "
                     f"is at {head[:12] or 'no commit'}: git worktree add --detach ../fair1 "
                     f"{pinned[:12]}, and pass --checkout ../fair1")
  if git("status", "--porcelain", "--untracked-files=no"):
    raise SystemExit(f"{checkout} has changes to {TAG}'s files; the runs must execute it as "
                     "committed")


def check_one_commit_and_machine(runs: list[dict]) -> None:
  """Every record of the comparison from one commit on one machine type."""
  for key in ("commit", "machine"):
    values = collections.Counter(str(run[key]) for run in runs)
    if len(values) > 1:
      raise SystemExit(f"the fair records mix {key}s: {dict(values)}; a comparison keeps one")


def welch_p(a, b) -> float:
  """Welch's two-sided t-test p-value (nan when either group has fewer than 2 runs or both
  have no spread)."""
  from scipy import stats
  if len(a) < 2 or len(b) < 2 or (np.var(a) == 0 and np.var(b) == 0):
    return float("nan")
  return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def bootstrap_interval(a, b, *, seed: int = 0) -> tuple[float, float]:
  """95% percentile interval of mean(a) - mean(b), resampling each group's runs with
  replacement (BOOTSTRAP_SAMPLES times)."""
  rng = np.random.default_rng(seed)
  a, b = np.asarray(a, float), np.asarray(b, float)
  means = lambda x: x[rng.integers(0, len(x), (BOOTSTRAP_SAMPLES, len(x)))].mean(axis=1)
  low, high = np.percentile(means(a) - means(b), [2.5, 97.5])
  return float(low), float(high)


def hyper_parameters(run: dict) -> dict:
  return {field: value_of(run, field)
          for field in ("learning_rate", "aux_weight", "temperature", "cl_weight")
          if field == "learning_rate" or run["objective"] in summarize.TUNED[field][2]}


def record_row(run: dict) -> dict:
  return {"task": run["task"], "objective": run["objective"], "seed": run["seed"],
          "multi_exit": run["multi_exit"], "hyper_parameters": hyper_parameters(run),
          "gate_granularity": run["gate_granularity"] if run["multi_exit"] else None,
          "commit": run["commit"], "machine": run["machine"], "record": run["workdir"],
          "main_metric": run["main_metric"], "metrics": run["metrics"]}


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


def compare(values, baseline) -> dict | None:
  """An objective's runs against a baseline's: the difference of means, Welch's p, the bootstrap
  95% interval and the verdict they support (None with fewer than 2 runs on either side).
  "higher" or "lower" needs both p < 0.05 and an interval that excludes 0."""
  if len(values) < 2 or len(baseline) < 2:
    return None
  low, high = bootstrap_interval(values, baseline)
  p = welch_p(values, baseline)
  difference = statistics.fmean(values) - statistics.fmean(baseline)
  significant = p < SIGNIFICANCE and (low > 0 or high < 0)  # a nan p is never significant
  verdict = ("higher" if difference > 0 else "lower") if significant else "no significant difference"
  return {"difference": difference, "p": p, "interval": (low, high), "verdict": verdict}


def comparison_cells(values, baseline) -> str:
  """mean ± std | difference to the baseline | Welch p | bootstrap 95% interval."""
  if not values:
    return "missing | | |"
  mean, std = summarize.mean_std(values)
  cells = f"{mean:.4f} ± {std:.4f}"
  c = compare(values, baseline) if baseline is not None else None
  if c is None:
    return cells + " | | |"
  low, high = c["interval"]
  return f"{cells} | {c['difference']:+.4f} | {c['p']:.3f} | [{low:+.4f}, {high:+.4f}]"


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


def single_exit_table(single: list[dict]) -> tuple[str, list[dict]]:
  lines = ["| task | objective | lr, λ, τ (chosen on seed 0) | seeds | dev metric (mean ± std) "
           "| Δ vs CE | Welch p | 95% bootstrap Δ |", "|---|---|---|---|---|---|---|---|"]
  rows = []
  by_cell = single_exit_runs(single)
  for (task, objective), (point, runs) in by_cell.items():
    rows += [record_row(r) for r in runs]
    ce_values = [score(r) for r in by_cell[task, "ce"][1]]
    label = ", ".join(f"{v:g}" for v in point.values()) if point else "not chosen yet"
    lines.append(f"| {task} | {objective} | {label} | {summarize.seeds_of(runs) or '-'} | "
                 + comparison_cells([score(r) for r in runs],
                                    ce_values if objective != "ce" else None) + " |")
  return "\n".join(lines) + "\n", rows


def best_at_speedup(early_exit: dict, metric: str, ratio: float) -> float | None:
  """The best dev metric over every policy and threshold whose counted speed-up ratio is at
  least `ratio` (None: no such operating point)."""
  values = [point["metrics"][metric] for points in early_exit["policies"].values()
            for point in points if point["speedup_ratio"] >= ratio]
  return max(values) if values else None


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


def speedup_scores(runs: list[dict], ratio: float) -> list[float]:
  """Each run's best dev metric at a counted speed-up of at least `ratio` (runs without such
  an operating point left out)."""
  bests = [best_at_speedup(read_early_exit(r), r["main_metric"].split("/")[-1], ratio)
           for r in runs]
  return [b for b in bests if b is not None]


def multi_exit_table(multi: list[dict], single: list[dict]) -> tuple[str, list[dict]]:
  """Per task and objective: the best dev metric at each counted speed-up of SPEEDUPS (over
  every policy and threshold of each run's sweep) and the exits' average, mean ± std."""
  lines = ["| task | objective | seeds | " + " | ".join(f"best at ≥ {r:g}x" for r in SPEEDUPS)
           + " | exits' average |", "|---|---|---|" + "---|" * (len(SPEEDUPS) + 1)]
  rows = []
  for task, objective, gate, runs in multi_exit_runs(multi, single):
    rows += [record_row(r) for r in runs]
    name = objective + (" (global gate)" if gate == "global" else "")
    if not runs:
      lines.append(f"| {task} | {name} | - |" + " |" * len(SPEEDUPS) + " missing |")
      continue
    cells = [pm(speedup_scores(runs, ratio), 4) or "-" for ratio in SPEEDUPS]
    cells.append(pm([score(r) for r in runs], 4))
    lines.append(f"| {task} | {name} | {summarize.seeds_of(runs)} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n", rows


def draw_tradeoffs(multi: list[dict], single: list[dict]) -> dict[str, list[str]]:
  """fair_multi_exit_<task>.png: per policy, each objective's Pareto front over its report
  seeds (averaged threshold by threshold), from every cell whose runs are all swept. Returns
  the labels drawn per task."""
  from acl_jax import early_exit
  drawn = {}
  for task in TASKS:
    results, labels = [], []
    for t, objective, gate, runs in multi_exit_runs(multi, single):
      swept = [read_early_exit(r) for r in runs]
      if t == task and swept and all(s["policies"] for s in swept):
        results += swept
        labels += [LABELS[objective] + (" (global gate)" if gate == "global" else "")] * len(runs)
    if results:
      path = RESULTS / f"fair_multi_exit_{task}.png"
      early_exit.plot(results, path, labels=labels,
                      title=f"{TASK_NAMES[task]}, MiniLM, mean-pooled exits, seeds 1-3 ({TAG})")
      print(f"wrote {path}")
      drawn[task] = list(dict.fromkeys(labels))
  return drawn


def draw_pilots(pilot: list[dict], single: list[dict]) -> None:
  """fair_pilot_<task>.{json,png} (pilot_gradient_angle.py) for each task whose two pilot runs,
  CE+SCL and ACL-Embed at the chosen λ and τ, are recorded."""
  import pilot_gradient_angle  # experiments/, beside this script; imports JAX
  for task, chosen in choices(single).items():
    runs = [next((r for r in pilot if r["task"] == task and r["objective"] == o
                  and chosen[c] and all(value_of(r, k) == v for k, v in chosen[c].items())),
                 None) for o, c in (("scl", "scl"), ("acl_embed", "acl"))]
    if all(runs):
      pilot_gradient_angle.main(["--runs", *(r["workdir"] for r in runs),
                                 "--out", str(RESULTS / f"fair_pilot_{task}")])


def read_early_exit(run: dict) -> dict:
  path = pathlib.Path(run["workdir"]) / "early_exit.json"
  return json.loads(path.read_text()) if path.exists() else {"policies": {}}


def pm(values, digits: int = 3) -> str:
  """"0.612 ± 0.013", the mean ± sample std ("" for no values)."""
  values = list(values)
  return "{:.{d}f} ± {:.{d}f}".format(*summarize.mean_std(values), d=digits) if values else ""


# ---- what the records say so far, and the answers they give ----------------------------------

def progress(single: list[dict], multi: list[dict], pilot: list[dict]) -> str:
  """How many runs of each stage are recorded, out of how many the protocol needs."""
  selection = [r for r in single if r["seed"] == SELECTION_SEED]
  grid_size = len(LEARNING_RATES) + 2 * len(AUX_WEIGHTS) * len(TEMPERATURES)
  report = sum(len(runs) for _, runs in single_exit_runs(single).values())
  cells = multi_exit_runs(multi, single)
  counts = [
      f"selection (seed {SELECTION_SEED}) {len(selection)} of {len(TASKS) * grid_size}",
      f"single-exit report {report} of {len(TASKS) * len(SINGLE_EXIT) * len(REPORT_SEEDS)}",
      f"multi-exit report {sum(len(runs) for *_, runs in cells)} of "
      f"{(len(TASKS) * len(MULTI_EXIT) + 1) * len(REPORT_SEEDS)}",
      f"pilot {len(pilot)} of {len(TASKS) * 2}"]
  machines = sorted({str(r["machine"]) for r in single + multi + pilot})
  commits = sorted({str(r["commit"])[:7] for r in single + multi + pilot})
  return ("Runs recorded: " + "; ".join(counts) + ". Commit " + (", ".join(commits) or "-")
          + "; machine " + (", ".join(machines) or "-") + ".")


def selection_table(single: list[dict]) -> str:
  """Seed 0's selection scores: CE per learning rate, CE+SCL and ACL over λ x τ at CE's chosen
  learning rate; the chosen point in bold, a point not yet run as ·."""
  lines = ["| task | objective | λ | " + " | ".join(f"τ = {t:g}" for t in TEMPERATURES) + " |",
           "|---|---|---|" + "---|" * len(TEMPERATURES)]
  for task, chosen in choices(single).items():
    seed0 = [r for r in single if r["task"] == task and r["seed"] == SELECTION_SEED]
    ce = {value_of(r, "learning_rate"): score(r) for r in seed0 if r["objective"] == "ce"}
    cells = [f"{lr:g}: " + (f"{ce[lr]:.4f}" if lr in ce else "·") for lr in LEARNING_RATES]
    cells = [f"**{c}**" if chosen["ce"] == {"learning_rate": lr} else c
             for lr, c in zip(LEARNING_RATES, cells)]
    lines.append(f"| {task} | ce | learning rate | " + " | ".join(cells) + " |"
                 + " |" * (len(TEMPERATURES) - len(LEARNING_RATES)))
    if chosen["ce"] is None:
      continue
    lr = chosen["ce"]["learning_rate"]
    for objective in ("scl", "acl"):
      best = chosen[objective]
      for aux in AUX_WEIGHTS:
        cells = []
        for t in TEMPERATURES:
          value = next((score(r) for r in seed0 if r["objective"] == objective and
                        [value_of(r, f) for f in GRID] == [lr, aux, t]), None)
          cell = "·" if value is None else f"{value:.4f}"
          is_best = best == {"learning_rate": lr, "aux_weight": aux, "temperature": t}
          cells.append(f"**{cell}**" if is_best else cell)
        lines.append(f"| {task} | {objective} | {aux:g} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def describe(c: dict | None) -> str:
  if c is None:
    return "not comparable yet"
  low, high = c["interval"]
  return (f"{c['difference']:+.4f} (Welch p = {c['p']:.3f}, bootstrap 95% [{low:+.4f}, "
          f"{high:+.4f}]): {c['verdict']}")


def tally(verdicts: dict[str, str]) -> str:
  """"significantly higher on RTE, significantly lower on no task, and not significantly
  different on MRPC and CoLA", from {place: verdict}."""
  def places(verdict):
    names = [p for p, v in verdicts.items() if v == verdict]
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names
                        ) or "none"
  return (f"significantly higher on {places('higher')}, significantly lower on "
          f"{places('lower')}, and not significantly different on "
          f"{places('no significant difference')}")


def unanswered(cells: list[list[dict]]) -> str | None:
  """Why an answer cannot be given yet (None: every cell has all its report seeds)."""
  complete = sum(len(runs) >= len(REPORT_SEEDS) for runs in cells)
  if complete == len(cells):
    return None
  recorded = sum(min(len(runs), len(REPORT_SEEDS)) for runs in cells)
  return (f"Not answered yet: {complete} of {len(cells)} cells have their {len(REPORT_SEEDS)} "
          f"report seeds ({recorded} of {len(cells) * len(REPORT_SEEDS)} runs recorded; the "
          "tables in the results notebook show which).")


def answer_single_exit(single: list[dict]) -> tuple[str, list[str]]:
  """(the verdict, its evidence per task) for ACL against CE and CE+SCL."""
  by_cell = single_exit_runs(single)
  if why := unanswered([runs for _, runs in by_cell.values()]):
    return why, []
  lines, verdicts = [], {"ce": {}, "scl": {}}
  for task in TASKS:
    values = {o: [score(r) for r in by_cell[task, o][1]] for o in SINGLE_EXIT}
    metric = by_cell[task, "ce"][1][0]["main_metric"].split("/")[-1]
    against = {o: compare(values["acl"], values[o]) for o in ("ce", "scl")}
    for o, c in against.items():
      verdicts[o][TASK_NAMES[task]] = c["verdict"] if c else "no significant difference"
    lines.append(f"{TASK_NAMES[task]} {metric}: ACL {pm(values['acl'], 4)}, CE "
                 f"{pm(values['ce'], 4)}, CE+SCL {pm(values['scl'], 4)}; ACL − CE "
                 f"{describe(against['ce'])}; ACL − CE+SCL {describe(against['scl'])}.")
  return (f"Against CE, ACL is {tally(verdicts['ce'])}. Against CE+SCL it is "
          f"{tally(verdicts['scl'])}."), lines


def gate_drop_rate(run: dict) -> float | None:
  """The share of training steps whose gate dropped the auxiliary gradient (a negative dot
  product), from each logging window's conflict_rate weighted by the steps it covers."""
  path = pathlib.Path(run["workdir"]) / "metrics.jsonl"
  if not path.exists():
    return None
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  rows = [r for r in rows if "conflict_rate" in r]
  if not rows:
    return None
  steps = np.diff([0] + [r["step"] for r in rows])
  return float(np.average([np.mean(r["conflict_rate"]) for r in rows], weights=steps))


def read_pilot(task: str) -> dict | None:
  path = RESULTS / f"fair_pilot_{task}.json"
  return json.loads(path.read_text()) if path.exists() else None


def answer_gate(single: list[dict]) -> tuple[str, list[str]]:
  """(the verdict, its evidence) for ACL-Grad's contribution: ACL against ACL-Embed at the same
  λ and τ, how often the gate acted, and the pilot's gradient angles."""
  by_cell = single_exit_runs(single)
  if why := unanswered([by_cell[t, o][1] for t in TASKS for o in ("acl_embed", "acl")]):
    return why, []
  lines, verdicts = [], {}
  for task in TASKS:
    acl, embed = (by_cell[task, o][1] for o in ("acl", "acl_embed"))
    c = compare([score(r) for r in acl], [score(r) for r in embed])
    verdicts[TASK_NAMES[task]] = c["verdict"] if c else "no significant difference"
    drops = [d for r in acl if (d := gate_drop_rate(r)) is not None]
    line = f"{TASK_NAMES[task]}: ACL − ACL-Embed {describe(c)}"
    if drops:
      line += (f"; the gate dropped the auxiliary gradient in {100 * min(drops):.1f}-"
               f"{100 * max(drops):.1f}% of ACL's training steps (seeds 1-3)")
    angles = read_pilot(task)
    if angles and all(o in angles for o in ("scl", "acl_embed")):
      line += ("; in the pilot (seed 0, every batch) the CE gradient was more than 90° from "
               + " and ".join(f"the {name} gradient in {100 * angles[o]['fraction_above_90']:.1f}%"
                              for o, name in (("scl", "SCL"), ("acl_embed", "ACL-Embed")))
               + f" of {angles['scl']['batches']} batches")
    else:
      line += "; the pilot has not run on this task yet"
    lines.append(line + ".")
  return f"ACL against ACL-Embed (the gate's contribution) is {tally(verdicts)}.", lines


def answer_multi_exit(multi: list[dict], single: list[dict]) -> tuple[str, list[str]]:
  """(the verdict, its evidence) for ACL-CL: its best dev metric at each counted speed-up of
  SPEEDUPS against the best of the other objectives there, and the gate ablation."""
  cells = multi_exit_runs(multi, single)
  if why := unanswered([runs for *_, runs in cells]):
    return why, []
  lines, verdicts = [], {}
  for task in TASKS:
    runs = {o: r for t, o, g, r in cells if t == task and g != "global"}
    for ratio in SPEEDUPS:
      values = {o: speedup_scores(r, ratio) for o, r in runs.items()}
      rivals = [o for o in MULTI_EXIT if o != "acl_cl" and values[o]]
      place = f"{TASK_NAMES[task]} ≥ {ratio:g}x"
      if not values["acl_cl"] or not rivals:
        verdicts[place] = "no significant difference"
        lines.append(f"{place}: no operating point of ACL-CL or of its rivals reaches it.")
        continue
      best = max(rivals, key=lambda o: statistics.fmean(values[o]))
      c = compare(values["acl_cl"], values[best])
      verdicts[place] = c["verdict"] if c else "no significant difference"
      lines.append(f"{place}: " + ", ".join(f"{LABELS[o]} {pm(values[o], 4)}" for o in
                                           MULTI_EXIT if values[o])
                   + f"; ACL-CL − {LABELS[best]} (the best other) {describe(c)}.")
  ablation = {g: r for t, o, g, r in cells if t == ABLATION_TASK and o == "acl_cl"}
  c = compare([score(r) for r in ablation["per_exit"]], [score(r) for r in ablation["global"]])
  lines.append(f"Gate ablation, {TASK_NAMES[ABLATION_TASK]} ACL-CL exits' average: per-exit "
               f"{pm([score(r) for r in ablation['per_exit']], 4)}, global "
               f"{pm([score(r) for r in ablation['global']], 4)}; per-exit − global "
               f"{describe(c)}.")
  return (f"Against the best other objective at equal counted speed-up, ACL-CL is "
          f"{tally(verdicts)}."), lines


CLAIMS = (("ACL against CE and CE+SCL", lambda s, m: answer_single_exit(s)),
          ("ACL-Grad's contribution over ACL-Embed", lambda s, m: answer_gate(s)),
          ("ACL-CL, the shallow exits and the quality-speed trade-off", answer_multi_exit))


def answers(single: list[dict], multi: list[dict]) -> str:
  """One paragraph per claim: the verdict (p < SIGNIFICANCE with a bootstrap interval off 0
  counts as a difference), then the numbers behind it."""
  return "\n\n".join(f"**{title}.** {verdict}" + "".join(f"\n- {line}" for line in evidence)
                     for title, claim in CLAIMS for verdict, evidence in [claim(single, multi)])


def summary(single: list[dict], multi: list[dict]) -> str:
  """The verdicts alone, one bullet per claim (the top-level README's summary)."""
  return "\n".join(f"- **{title}.** {claim(single, multi)[0]}" for title, claim in CLAIMS)


if __name__ == "__main__":
  main()
