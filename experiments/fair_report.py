"""The fair comparison's report (experiments/fair.py has the protocol and runs it): the tables,
the trade-off figures, the pilot's angles and the answers, all computed from the records.

    python experiments/fair.py tables    # writes the files below, through write_tables

- fair_single_exit.{md,jsonl}: per task and objective, seeds 1-3 at the chosen values, mean ±
  sample std, the difference to CE with Welch's p and a bootstrap 95% interval;
- fair_multi_exit.{md,jsonl}: per task and objective, the best dev metric at each counted
  speed-up of SPEEDUPS and the exits' average (each .jsonl line one run, every exit's metric);
- fair_multi_exit_<task>.png: each objective's Pareto front per early-exit policy;
- fair_pilot_<task>.{json,png}: the pilot's per-batch gradient angles (pilot_gradient_angle.py).

The results notebook's generated blocks (experiments/notebook_blocks.py, fair_*) call progress,
selection_table, single_exit_table, multi_exit_table, answers and summary. An answer is written
only once every cell it needs has its report seeds, and a difference counts when Welch's p is
below SIGNIFICANCE and the bootstrap interval excludes zero.
"""

import json
import pathlib
import statistics

import numpy as np

import summarize
from summarize import pm
from fair import (ABLATION_TASK, AUX_WEIGHTS, GRID, LEARNING_RATES, MULTI_EXIT, REPORT_SEEDS,
                  SELECTION_SEED, SINGLE_EXIT, TASKS, TEMPERATURES, Comparison,
                  check_one_commit_and_machine, choices, multi_exit_runs, score,
                  single_exit_runs, value_of)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SPEEDUPS = (1.5, 2.0)  # counted speed-ups at which the multi-exit runs are compared
BOOTSTRAP_SAMPLES = 10_000
SIGNIFICANCE = 0.05  # Welch's p below which a difference (with its interval off 0) counts
LABELS = {"ce": "CE", "scl": "CE+SCL", "acl_embed": "ACL-Embed", "acl": "ACL", "kd": "KD",
          "deebert": "DeeBERT", "acl_cl": "ACL-CL"}
TASK_NAMES = {"rte": "RTE", "mrpc": "MRPC", "cola": "CoLA"}


def write_tables(comparison: Comparison) -> None:
  """The `tables` stage: the comparison's two tables' .md and .jsonl, its figures and pilots."""
  single, multi, pilot = comparison.read()
  check_one_commit_and_machine(single + multi + pilot)
  # Each comparison writes the same files: the .md says whose they are (each .jsonl line
  # names its commit and machine).
  whose = (f"{comparison.tag}: commit {comparison.commit[:7]}, "
           f"{machines(single + multi) or 'no runs recorded yet'}.\n\n")
  for name, text, rows in (("fair_single_exit", *single_exit_table(single)),
                           ("fair_multi_exit", *multi_exit_table(multi, single))):
    (RESULTS / f"{name}.md").write_text(whose + text)
    (RESULTS / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {RESULTS / name}.md and .jsonl ({len(rows)} runs)")
  draw_tradeoffs(multi, single, comparison.tag)
  draw_pilots(pilot, single)


# ---- statistics ------------------------------------------------------------------------------

def welch_p(a, b) -> float:
  """Welch's two-sided t-test p-value (nan when either group has fewer than 2 runs or neither
  has any spread). Written out rather than scipy.stats.ttest_ind, which warns of precision loss
  when one group's runs are equal (three seeds can reach the same best operating point)."""
  from scipy import stats
  a, b = np.asarray(a, float), np.asarray(b, float)
  if len(a) < 2 or len(b) < 2:
    return float("nan")
  va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)  # each mean's squared std error
  if va + vb == 0:
    return float("nan")
  t = (a.mean() - b.mean()) / np.sqrt(va + vb)
  df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
  return float(2 * stats.t.sf(abs(t), df))


def bootstrap_interval(a, b, *, seed: int = 0) -> tuple[float, float]:
  """95% percentile interval of mean(a) - mean(b), resampling each group's runs with
  replacement (BOOTSTRAP_SAMPLES times)."""
  rng = np.random.default_rng(seed)
  a, b = np.asarray(a, float), np.asarray(b, float)
  means = lambda x: x[rng.integers(0, len(x), (BOOTSTRAP_SAMPLES, len(x)))].mean(axis=1)
  low, high = np.percentile(means(a) - means(b), [2.5, 97.5])
  return float(low), float(high)


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
  cells = pm(values, ".4f")
  c = compare(values, baseline) if baseline is not None else None
  if c is None:
    return cells + " | | |"
  low, high = c["interval"]
  return f"{cells} | {c['difference']:+.4f} | {c['p']:.3f} | [{low:+.4f}, {high:+.4f}]"


def hyper_parameters(run: dict) -> dict:
  return {field: value_of(run, field)
          for field in ("learning_rate", "aux_weight", "temperature", "cl_weight")
          if field == "learning_rate" or run["objective"] in summarize.TUNED[field][2]}


def record_row(run: dict) -> dict:
  return {"task": run["task"], "objective": run["objective"], "seed": run["seed"],
          "multi_exit": run["multi_exit"], "hyper_parameters": hyper_parameters(run),
          "gate_granularity": run["gate_granularity"] if run["multi_exit"] else None,
          "commit": run["commit"], "machine": run["machine"], "cpu": run["cpu"],
          "record": run["workdir"],
          "main_metric": run["main_metric"], "metrics": run["metrics"]}


# ---- tables and figures --------------------------------------------------------------------

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


def read_early_exit(run: dict) -> dict:
  path = pathlib.Path(run["workdir"]) / "early_exit.json"
  return json.loads(path.read_text()) if path.exists() else {"policies": {}}


def speedup_scores(runs: list[dict], ratio: float) -> list[float]:
  """Each run's best dev metric at a counted speed-up of at least `ratio` (runs without such
  an operating point left out)."""
  bests = [best_at_speedup(read_early_exit(r), summarize.metric_name(r), ratio)
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
    cells = [pm(speedup_scores(runs, ratio), ".4f") or "-" for ratio in SPEEDUPS]
    cells.append(pm([score(r) for r in runs], ".4f"))
    lines.append(f"| {task} | {name} | {summarize.seeds_of(runs)} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n", rows


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
  commits = sorted({str(r["commit"])[:7] for r in single + multi + pilot})
  return ("Runs recorded: " + "; ".join(counts) + ". Commit " + (", ".join(commits) or "-")
          + "; machine " + (machines(single + multi + pilot) or "-") + ".")


def machines(runs: list[dict]) -> str:
  """The machine types the runs name: "AMD EPYC, 2 cores (CPU fingerprint 4202...)"."""
  return ", ".join(sorted({f"{r['machine']} (CPU fingerprint {r['cpu']})" for r in runs}))


def same_runs_agreement(first: list[dict], second: list[dict]) -> dict:
  """The runs that two comparisons at one commit both recorded (one run directory name, both
  single-exit or both multi-exit), and how many of them logged the same dev evaluations: how
  much the machine type alone moves what a comparison reports."""
  def by_run(runs):
    return {(r["multi_exit"], pathlib.Path(r["workdir"]).name): r for r in runs}
  a, b = by_run(first), by_run(second)
  both = sorted(a.keys() & b.keys())
  differences = [abs(score(a[k]) - score(b[k])) for k in both]
  return {"runs": len(both),
          "evaluations_equal": sum(evaluations(a[k]) == evaluations(b[k]) for k in both),
          "final_equal": sum(d == 0 for d in differences),
          "largest_final_difference": max(differences, default=None)}


def evaluations(run: dict) -> list[dict]:
  """Every dev evaluation a run recorded (during training, then the final one)."""
  results = json.loads((pathlib.Path(run["workdir"]) / "eval_results.json").read_text())
  return [*results.get("history", []), results["final"]]


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
    metric = summarize.metric_name(by_cell[task, "ce"][1][0])
    against = {o: compare(values["acl"], values[o]) for o in ("ce", "scl")}
    for o, c in against.items():
      verdicts[o][TASK_NAMES[task]] = c["verdict"] if c else "no significant difference"
    lines.append(f"{TASK_NAMES[task]} {metric}: ACL {pm(values['acl'], '.4f')}, CE "
                 f"{pm(values['ce'], '.4f')}, CE+SCL {pm(values['scl'], '.4f')}; ACL − CE "
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
  SPEEDUPS against the best of the other objectives there, each exit's metric against CE's,
  and the gate ablation."""
  cells = multi_exit_runs(multi, single)
  if why := unanswered([runs for *_, runs in cells]):
    return why, []
  lines, verdicts, exit_verdicts = [], {}, []
  for task in TASKS:
    runs = {o: r for t, o, g, r in cells if t == task and g != "global"}
    # Exit by exit (the last column of exit_scores is the average: left out).
    per_exit = [compare(list(cl), list(ce)) for cl, ce in
                zip(*(list(zip(*map(summarize.exit_scores, runs[o])))[:-1]
                      for o in ("acl_cl", "ce")))]
    exit_verdicts += [c["verdict"] if c else "no significant difference" for c in per_exit]
    lines.append(f"{TASK_NAMES[task]}, exit by exit, ACL-CL − CE: " + ", ".join(
        f"exit {k} {c['difference']:+.4f} (p = {c['p']:.3f})" if c else f"exit {k} -"
        for k, c in enumerate(per_exit, 1)) + ".")
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
      lines.append(f"{place}: " + ", ".join(f"{LABELS[o]} {pm(values[o], '.4f')}" for o in
                                           MULTI_EXIT if values[o])
                   + f"; ACL-CL − {LABELS[best]} (the best other) {describe(c)}.")
  ablation = {g: r for t, o, g, r in cells if t == ABLATION_TASK and o == "acl_cl"}
  c = compare([score(r) for r in ablation["per_exit"]], [score(r) for r in ablation["global"]])
  lines.append(f"Gate ablation, {TASK_NAMES[ABLATION_TASK]} ACL-CL exits' average: per-exit "
               f"{pm([score(r) for r in ablation['per_exit']], '.4f')}, global "
               f"{pm([score(r) for r in ablation['global']], '.4f')}; per-exit − global "
               f"{describe(c)}.")
  return (f"Against the best other objective at equal counted speed-up, ACL-CL is "
          f"{tally(verdicts)}. Exit by exit against CE, it is significantly higher at "
          f"{exit_verdicts.count('higher')} and significantly lower at "
          f"{exit_verdicts.count('lower')} of the {len(exit_verdicts)} exits of the "
          f"{len(TASKS)} tasks."), lines


CLAIMS = (("ACL against CE and CE+SCL", lambda s, m: answer_single_exit(s)),
          ("ACL-Grad's contribution over ACL-Embed", lambda s, m: answer_gate(s)),
          ("ACL-CL, the shallow exits and the quality-speed trade-off",
           lambda s, m: answer_multi_exit(m, s)))


def answers(single: list[dict], multi: list[dict]) -> str:
  """One paragraph per claim: the verdict (p < SIGNIFICANCE with a bootstrap interval off 0
  counts as a difference), then the numbers behind it."""
  return "\n\n".join(f"**{title}.** {verdict}" + "".join(f"\n- {line}" for line in evidence)
                     for title, claim in CLAIMS for verdict, evidence in [claim(single, multi)])


def summary(single: list[dict], multi: list[dict]) -> str:
  """The verdicts alone, one bullet per claim (the top-level README's summary)."""
  return "\n".join(f"- **{title}.** {claim(single, multi)[0]}" for title, claim in CLAIMS)


def draw_tradeoffs(multi: list[dict], single: list[dict], tag: str) -> dict[str, list[str]]:
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
                      title=f"{TASK_NAMES[task]}, MiniLM, mean-pooled exits, seeds 1-3 ({tag})")
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
