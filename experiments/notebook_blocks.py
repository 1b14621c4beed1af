"""The generated blocks of experiments/results/README.md, the results notebook.

Each block is delimited by `<!-- summarize:NAME -->` and `<!-- /summarize:NAME -->`, and BLOCKS
maps NAME to a function that writes the block's text from the run records and the result
files in experiments/results/. `python experiments/summarize.py --notebook <file>` rewrites
them all; `--check` only compares. Prose between the blocks is hand-written and carries no
numbers of its own.
"""

import collections
import functools
import itertools
import json
import pathlib
import re
import statistics
import sys

import summarize
from summarize import exit_scores, metric_name, pm

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RECORDS = RESULTS / "records"
TASKS = ("rte", "mrpc", "cola")
TASK_NAMES = {"rte": "RTE", "mrpc": "MRPC", "cola": "CoLA"}
MULTI_EXIT = ("ce", "kd", "deebert", "acl", "acl_cl")
LABELS = {"ce": "CE", "kd": "KD", "deebert": "DeeBERT", "acl": "ACL (global gate)",
          "acl_cl": "ACL-CL (global gate)", "scl": "CE+SCL", "acl_embed": "ACL-Embed"}
SINGLE_EXIT = ("ce", "scl", "acl_embed", "acl")
SINGLE_LABELS = {**LABELS, "acl": "ACL (ACL-Embed + ACL-Grad)"}
BLOCK = re.compile(r"(<!-- summarize:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /summarize:(?P=name) -->)",
                   re.S)


# ---- reading -------------------------------------------------------------------------------

@functools.cache
def grid(name: str) -> tuple[dict, ...]:
  """The finished runs recorded under records/<name>/, with their directory names."""
  return tuple(summarize.load_run(d) | {"name": d.name}
               for d in sorted((RECORDS / name).iterdir()) if (d / "eval_results.json").exists())


def run(grid_name: str, task: str, objective: str, seed: int = 0) -> dict:
  return next(r for r in grid(grid_name)
              if (r["task"], r["objective"], r["seed"]) == (task, objective, seed))


def seeds(grid_name: str, task: str, objective: str) -> list[dict]:
  return sorted((r for r in grid(grid_name) if (r["task"], r["objective"]) == (task, objective)),
                key=lambda r: r["seed"])


@functools.cache
def jsonl(name: str) -> tuple[dict, ...]:
  return tuple(json.loads(line) for line in (RESULTS / name).read_text().splitlines()
               if line.strip())


@functools.cache
def early_exit(grid_name: str, task: str, objective: str) -> dict:
  return json.loads((RECORDS / grid_name / f"{task}_{objective}_s0" / "early_exit.json").read_text())


def final_exit_train_ce(run_: dict) -> float:
  """The final exit's training CE at the last logged batch."""
  lines = (pathlib.Path(run_["workdir"]) / "metrics.jsonl").read_text().splitlines()
  logged = [json.loads(line) for line in lines]
  return [m for m in logged if "ce" in m][-1]["ce"][-1]


def majority(task: str) -> float:
  return next(r["dev"] for r in jsonl("layer_probe_minilm.jsonl")
              if r["task"] == task and r["pooling"] == "majority class")


def constant(task: str, score: float) -> bool:
  """Whether a dev score is that of predicting one class for every input."""
  one_class = {majority(task), round(1 - majority(task), 4)} if task == "rte" else {majority(task)}
  return any(abs(score - c) < 1e-4 for c in one_class)


# ---- formatting ----------------------------------------------------------------------------

def span(values, fmt=".2f", sep="-") -> str:
  """"0.85-0.91": the range of `values` as printed (one value if they print alike)."""
  low, high = format(min(values), fmt), format(max(values), fmt)
  return low if low == high else f"{low}{sep}{high}"


def table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def short(commit: str) -> str:
  return commit[:7]


def provenance(runs) -> str:
  """"commit ddade28 on Intel(R) Xeon(R) Processor, 2 cores; ...": who ran these runs, where."""
  pairs = sorted({(short(r["commit"]), r["machine"]) for r in runs})
  return "; ".join(f"{c} ({m})" for c, m in pairs)


# ---- how these numbers were made -----------------------------------------------------------

def block_machines() -> str:
  runs = [r for name in sorted(p.name for p in RECORDS.iterdir() if p.is_dir() and p.name != "speed")
          for r in grid(name)]
  machines = sorted({r["machine"] for r in runs})
  versions = sorted({f"jax {r['versions']['jax']}, flax {r['versions']['flax']}" for r in runs})
  torch = sorted({f"torch {r['torch']}, transformers {r['transformers']}"
                  for r in jsonl("hf_pytorch_glue.jsonl")})
  grids = sorted({pathlib.Path(r["workdir"]).parent.name for r in runs})
  return "\n".join([
      f"- {len(runs)} run records under `records/` ({', '.join(grids)}); machines named in "
      f"them: {'; '.join(machines)}.",
      f"- Versions named in the records: {'; '.join(versions)}; the PyTorch reference: "
      f"{'; '.join(torch)}."])


# ---- CE fine-tuning and the HF PyTorch reference ------------------------------------------

def block_lr_sweep() -> str:
  runs = sorted(jsonl("lr_sweep_ce_minilm_rte.jsonl"), key=lambda r: r["lr"])
  cells = ", ".join(f"lr {r['lr']:g} → {r['metrics']['validation/accuracy']:.3f}" for r in runs)
  return (f"CE on RTE, seed 0, 3 epochs ({provenance(runs)}): {cells} dev accuracy; "
          f"{max(runs, key=lambda r: r['metrics']['validation/accuracy'])['lr']:g} is the `minilm` "
          "default for every objective.")


def block_ce_minilm() -> str:
  return summarize.summary_table(summarize.read_runs([RESULTS / "ce_minilm.jsonl"]))


def _ce_jax(task):
  return sorted((r for r in jsonl("ce_minilm.jsonl") if r["task"] == task and r["lr"] == 1e-4),
                key=lambda r: r["seed"])


def block_hf_pytorch() -> str:
  rows = []
  for task in TASKS:
    torch_runs = sorted((r for r in jsonl("hf_pytorch_glue.jsonl") if r["task"] == task),
                        key=lambda r: r["seed"])
    jax_runs = _ce_jax(task)
    metric = metric_name(jax_runs[0])
    torch_scores = [r[f"dev_{metric}"] for r in torch_runs]
    jax_scores = [r["metrics"][f"validation/{metric}"] for r in jax_runs]
    rows.append([task, metric, ",".join(str(r["seed"]) for r in torch_runs),
                 ", ".join(f"{s:.3f}" for s in torch_scores),
                 pm(torch_scores) if len(torch_scores) > 1 else f"{torch_scores[0]:.3f}",
                 ", ".join(f"{s:.3f}" for s in jax_scores), pm(jax_scores)])
  walls = {t: span([r["wall_seconds"] for r in jsonl("hf_pytorch_glue.jsonl") if r["task"] == t], ".0f")
           for t in TASKS}
  machines = ", ".join(f"{TASK_NAMES[r['task']]} seed {r['seed']} {r['host']['cpu']}"
                       for r in jsonl("hf_pytorch_glue.jsonl"))
  return (table(["task", "metric", "PyTorch seeds", "HF PyTorch dev (per seed)", "PyTorch",
                 "acl_jax dev (seeds 0,1,2)", "acl_jax mean ± std"], rows)
          + "\n\nPyTorch wall seconds, beside other work (not a speed comparison): "
          + ", ".join(f"{TASK_NAMES[t]} {w}" for t, w in walls.items())
          + f". PyTorch machines: {machines}.")


# ---- step benchmarks -----------------------------------------------------------------------

def _bench(name, kind="step"):
  return [r for r in jsonl(name) if r["kind"] == kind]


def _ratio_table(name, extra_header=()) -> str:
  rows = [[r["name"], f"{r['ratio']:.3f}", r["target"] or "-",
           {True: "yes", False: "no", None: "-"}[r["meets_target"]]] for r in _bench(name, "ratio")]
  return table(["ratio of median step times (same run)", "value", "target", "met"], rows)


def _bench_header(name) -> str:
  rows = _bench(name)
  first = rows[0]
  return (f"{first['shape']}, batch {first['batch']} x {first['seq_len']} tokens, warm-up "
          f"{first['warmup']}, {first['steps']} timed steps, commit {short(first['git_commit'])}, "
          f"{first['host_cpu']} ({first['cpus_usable']} cores), "
          f"{'interleaved' if first.get('interleaved') else 'one configuration after another'}")


def block_bench_quiet() -> str:
  name = "benchmark_step_quiet.jsonl"
  rows = [[r["framework"], r["objective"], f"{r['median_step_s']:.2f}", f"{r['p90_step_s']:.2f}",
           f"{r['examples_per_s']:.1f}", f"{r['peak_rss_mib']:.0f}"] for r in _bench(name)]
  return (f"{_bench_header(name)}.\n\n"
          + table(["framework", "objective", "median step s", "p90 s", "examples/s",
                   "peak RSS MiB"], rows) + "\n\n" + _ratio_table(name))


def block_bench_interleaved() -> str:
  name = "benchmark_step_interleaved.jsonl"
  rows = [[r["framework"], r["objective"], f"{r['median_step_s']:.2f}",
           ", ".join(f"{t:.2f}" for t in r["step_times_s"])] for r in _bench(name)]
  return (f"{_bench_header(name)}.\n\n"
          + table(["framework", "objective", "median step s", "the rounds, s"], rows)
          + "\n\n" + _ratio_table(name))


def block_gate_chunk() -> str:
  rows = sorted(_bench("benchmark_gate_chunk.jsonl"), key=lambda r: r["gate_chunk"])
  return (f"Per-exit gate, {rows[0]['exits']} exits, one run each (commit "
          f"{short(rows[0]['git_commit'])}, {rows[0]['host_cpu']}): "
          + "; ".join(f"`gate_chunk={r['gate_chunk']}` {r['median_step_s']:.1f} s per step and "
                      f"{r['peak_rss_mib'] / 1024:.1f} GiB peak RSS" for r in rows) + ".")


def block_bench_bert_base() -> str:
  name = "benchmark_step_bert_base.jsonl"
  rows = [[r["framework"], r["objective"], f"{r['median_step_s']:.2f}",
           ", ".join(f"{t:.1f}" for t in r["step_times_s"]), f"{r['examples_per_s']:.2f}",
           f"{r['xla_peak_mib']:.0f}" if r.get("xla_peak_mib") else "", f"{r['compile_s']:.0f}"]
          for r in _bench(name)]
  peak = max(r["peak_rss_mib"] for r in _bench(name)) / 1024
  steps = {(r["framework"], r["objective"]): r["median_step_s"] for r in _bench(name)}
  return (f"{_bench_header(name)}; the process peaked at {peak:.1f} GiB RSS.\n\n"
          + table(["framework", "objective", "median step s", "the rounds, s", "examples/s",
                   "XLA buffers MiB", "compile s"], rows) + "\n\n" + _ratio_table(name)
          + f"\n\njax acl / jax acl_embed (the same work without the gate): "
          f"{steps['jax', 'acl'] / steps['jax', 'acl_embed']:.2f}.")


def block_bench_bert_base_sequential() -> str:
  name = "benchmark_step_bert_base_sequential.jsonl"
  steps = _bench(name)
  rows = [[f"{r['framework']} {r['objective']}",
           f"{r['median_step_s']:.2f} ({', '.join(f'{t:.1f}' for t in r['step_times_s'])})",
           f"{r['pipelined_step_s']:.2f}", f"{r['peak_rss_mib']:.0f}"] for r in steps]
  jax, torch = steps
  return (f"{_bench_header(name)}.\n\n"
          + table(["framework", "median step s (the steps)", "steps back to back, s/step",
                   "peak RSS MiB"], rows)
          + f"\n\njax ce / pytorch ce: {jax['median_step_s'] / torch['median_step_s']:.2f} "
          f"(synced steps), {jax['pipelined_step_s'] / torch['pipelined_step_s']:.2f} (back to back).")


def _bench_files(prefix: str) -> list[str]:
  return sorted(path.name for path in RESULTS.glob(f"{prefix}*.jsonl"))


def block_bench_exit_gate() -> str:
  """The per-exit gate through each exit's own layers (exit_gate), one block per shape's run:
  measured ratios beside XLA's FLOP ratio and the cost model's prediction."""
  parts = []
  for name in _bench_files("benchmark_exit_gate"):
    steps = _bench(name)
    rows = [[r["objective"], f"{r['median_step_s']:.2f}",
             ", ".join(f"{t:.1f}" for t in r["step_times_s"]), f"{r['compile_s']:.0f}",
             f"{r['xla_gflops']:.0f}", f"{r['xla_peak_mib']:.0f}"] for r in steps]
    ratios = [[r["name"], f"{r['ratio']:.2f}",
               f"{r['xla_flops_ratio']:.2f}" if "xla_flops_ratio" in r else "-",
               f"{r['cost_model_ratio']:.2f}" if "cost_model_ratio" in r else "-",
               r["target"] or "-", {True: "yes", False: "no", None: "-"}[r["meets_target"]]]
              for r in _bench(name, "ratio")]
    parts.append(f"`{name}`: {_bench_header(name)}.\n\n"
                 + table(["objective", "median step s", "the rounds, s", "compile s",
                          "XLA GFLOP", "XLA buffers MiB"], rows) + "\n\n"
                 + table(["ratio (same run)", "measured", "XLA FLOPs", "cost model", "target",
                          "met"], ratios))
  return "\n\n".join(parts)


def block_bench_microbatch() -> str:
  """Exact micro-batching (benchmark_microbatch.py): XLA buffers, interleaved step times, the
  memory target, and the largest global batch within the budget, whole and micro-batched."""
  parts = []
  for name in _bench_files("benchmark_microbatch"):
    rows = jsonl(name)
    first = rows[0]
    memory = [[str(r["batch"]), str(r["microbatch_size"] or "-"), f"{r['xla_temp_mib']:.0f}",
               f"{r['xla_peak_mib']:.0f}", f"{r['compile_s']:.0f}"]
              for r in rows if r["kind"] == "memory"][:3]
    steps = [[str(r["batch"]), str(r["microbatch_size"] or "-"), f"{r['median_step_s']:.2f}",
              ", ".join(f"{t:.1f}" for t in r["step_times_s"]), f"{r['examples_per_s']:.1f}"]
             for r in rows if r["kind"] == "step"]
    ratios = [[r["name"], f"{r['ratio']:.2f}", r["target"] or "-",
               {True: "yes", False: "no", None: "-"}[r["meets_target"]]]
              for r in rows if r["kind"] == "ratio"]
    largest = [[str(r["microbatch_size"] or "whole"), str(r["largest_fitting_batch"]),
                str(r["first_over_budget"] or "-"), "yes" if r["limit_reached"] else "no",
                ", ".join(f"{p['batch']}: {p['xla_peak_mib'] / 1024:.1f}" for p in r["probes"])]
               for r in rows if r["kind"] == "largest_batch"]
    budget = next((r["budget_mib"] / 1024 for r in rows if r["kind"] == "largest_batch"), None)
    parts.append(
        f"`{name}`: {first['shape']}, objective {first['objective']}, {first['seq_len']} tokens, "
        f"commit {short(first['git_commit'])}, {first['host_cpu']} ({first['cpus_usable']} "
        f"cores), step times interleaved.\n\n"
        + table(["global batch", "micro-batch", "XLA temporaries MiB", "XLA buffers MiB",
                 "compile s"], memory) + "\n\n"
        + table(["global batch", "micro-batch", "median step s", "the rounds, s",
                 "examples/s"], steps) + "\n\n"
        + table(["ratio (same run)", "value", "target", "met"], ratios)
        + ("" if not largest else "\n\n" + table(
            ["micro-batch", f"largest batch within {budget:g} GiB (doubling)",
             "first over", "search limit reached", "probes: batch: XLA buffers GiB"], largest)))
  return "\n\n".join(parts)


def _time_v(name) -> dict:
  text = (RECORDS / "speed" / f"{name}.time.txt").read_text()
  clock = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", text).group(1).split(":")
  return {"wall_s": sum(float(x) * 60 ** i for i, x in enumerate(reversed(clock))),
          "rss_mib": int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 1024}


def block_speed_3ep() -> str:
  jax = summarize.load_run(RECORDS / "speed" / "jax_rte_3ep")
  torch = json.loads((RECORDS / "speed" / "hf_pytorch_rte_3ep.jsonl").read_text().splitlines()[0])
  jt, tt = _time_v("jax_rte_3ep"), _time_v("hf_pytorch_rte_3ep")
  rows = [["acl_jax, length buckets, `--compilation_cache=none` (compilations counted in train s)",
           f"{jt['wall_s']:.0f}", f"{jax['train_seconds']:.0f}", f"{jax['examples_per_s']:.1f}",
           f"{jt['rss_mib']:.0f}", f"{jax['metrics']['validation/accuracy']:.3f}"],
          ["HF PyTorch script, dynamic padding", f"{tt['wall_s']:.0f}",
           f"{torch['train_seconds']:.0f}", f"{torch['train_examples_per_s']:.1f}",
           f"{tt['rss_mib']:.0f}", f"{torch['dev_accuracy']:.3f}"]]
  return (f"Commit {short(jax['commit'])}, {jax['machine']}; our epoch {jax['steps'] // 3} batches, "
          f"PyTorch's {torch['steps_per_epoch']}.\n\n"
          + table(["", "wall s (whole command)", "train s", "train examples/s", "peak RSS MiB",
                   "dev accuracy (seed 0)"], rows)
          + f"\n\nacl_jax finished {tt['wall_s'] / jt['wall_s']:.2f}x faster, wall clock, "
          "counting its compilations.")


# ---- multi-exit grid -----------------------------------------------------------------------

def _per_exit_rows(runs) -> list[str]:
  return [summarize.per_exit_row(task, objective, group)[1]
          for (task, _, objective, *_), group in summarize.group_runs(list(runs)).items()]


def _per_exit_header(exits=6) -> str:
  names = [f"exit{i}" for i in range(1, exits + 1)]
  return ("| task | objective | seeds | metric | " + " | ".join(names) + " | avg |\n"
          + "|---|---|---|---|" + "---|" * (exits + 1))


def block_me_per_exit() -> str:
  return "\n".join([_per_exit_header(), *_per_exit_rows(grid("me_minilm"))])


def block_me_provenance() -> str:
  by_task = {t: provenance(r for r in grid("me_minilm") if r["task"] == t) for t in TASKS}
  sweeps = provenance({"commit": e["meta"]["git_commit"], "machine": e["meta"]["machine"]}
                      for e in (early_exit("me_minilm", t, o) for t in TASKS for o in MULTI_EXIT))
  return "\n".join(f"- {TASK_NAMES[t]} training: {p}." for t, p in by_task.items()) + \
      f"\n- Early-exit sweeps (seed 0): {sweeps}."


def _dead(runs, exit_index):
  return sum(constant(r["task"], exit_scores(r)[exit_index]) for r in runs)


def block_me_findings() -> str:
  me = grid("me_minilm")
  rte_mrpc = [r for r in me if r["task"] in ("rte", "mrpc")]
  both12 = sum(_dead([r], 0) and _dead([r], 1) for r in rte_mrpc)
  cola = [r for r in me if r["task"] == "cola"]
  cola_not_cl = [r for r in cola if r["objective"] != "acl_cl"]
  cola_cl = seeds("me_minilm", "cola", "acl_cl")
  cola_ce = seeds("me_minilm", "cola", "ce")
  deebert = [r for r in me if r["objective"] == "deebert" and r["task"] in ("rte", "mrpc")]
  lines = [
      f"- Exits 1-2 predict one class for every input (RTE accuracy {majority('rte'):.3f} or "
      f"{1 - majority('rte'):.3f}, MRPC F1 {majority('mrpc'):.3f}) in {both12} of the "
      f"{len(rte_mrpc)} RTE and MRPC runs; exit 3 in {_dead(rte_mrpc, 2)}.",
      f"- CoLA exits 1-3 score MCC 0 (one class) in "
      f"{sum(all(constant('cola', s) for s in exit_scores(r)[:3]) for r in cola_not_cl)} of the "
      f"{len(cola_not_cl)} runs of CE, KD, DeeBERT and ACL. ACL-CL's exit 3, seeds 0, 1, 2: "
      + ", ".join(f"{exit_scores(r)[2]:.3f}" for r in cola_cl)
      + "; its exit 6: " + ", ".join(f"{exit_scores(r)[5]:.3f}" for r in cola_cl)
      + f" (mean {pm([exit_scores(r)[5] for r in cola_cl])}) against CE's "
      f"{pm([exit_scores(r)[5] for r in cola_ce])}.",
      "- Final exit's training CE at the last logged batch, CoLA seeds 0, 1, 2: "
      + "; ".join(f"{LABELS[o]} " + ", ".join(f"{final_exit_train_ce(r):.2f}"
                                              for r in seeds("me_minilm", "cola", o))
                  for o in ("ce", "acl", "acl_cl")) + ".",
      f"- DeeBERT (exits trained on a frozen backbone), RTE and MRPC: one class through exit 4 "
      f"in {sum(all(constant(r['task'], s) for s in exit_scores(r)[:4]) for r in deebert)} of "
      f"{len(deebert)} runs, through exit 5 in "
      f"{sum(all(constant(r['task'], s) for s in exit_scores(r)[:5]) for r in deebert)}."]
  return "\n".join(lines + [_late_exits_line(task) for task in TASKS])


def _late_exits_line(task) -> str:
  """The best exit 6 and the best average over exits of a task, means over seeds."""
  means = {o: [statistics.fmean(v) for v in zip(*map(exit_scores, seeds("me_minilm", task, o)))]
           for o in MULTI_EXIT}
  best6 = max(means, key=lambda o: means[o][5])
  best_avg = max(means, key=lambda o: means[o][6])
  return (f"- {TASK_NAMES[task]} ({metric_name(seeds('me_minilm', task, 'ce')[0])}, mean over "
          f"seeds): best exit 6 {LABELS[best6]} {means[best6][5]:.3f}, best average over exits "
          f"{LABELS[best_avg]} {means[best_avg][6]:.3f}; exit 6 / average: "
          + ", ".join(f"{LABELS[o]} {means[o][5]:.3f} / {means[o][6]:.3f}" for o in MULTI_EXIT)
          + ".")


def block_mu_sweep() -> str:
  mu = run("me_minilm_mu0.1", "cola", "acl_cl")
  rows = [mu, run("me_minilm", "cola", "acl_cl"), run("me_minilm", "cola", "ce")]
  return (f"Commit {short(mu['commit'])}, {mu['machine']}.\n\n" + _per_exit_header() + "\n"
          + "\n".join(_per_exit_rows(rows)) + "\n\nFinal exit's training CE at the last logged "
          "batch: " + ", ".join(f"{summarize.objective_label(r)} {final_exit_train_ce(r):.2f}"
                                for r in rows) + ".")


# ---- early exit ----------------------------------------------------------------------------

def nearest(rows, target=2.0):
  return min(rows, key=lambda r: abs(r["speedup_ratio"] - target))


def speedup_rows(result, label):
  metric = result["main_metric"]
  return [[label, policy, f"{row['threshold']:g}", f"{metric} {row['metrics'][metric]:.4f}",
           f"{row['speedup_ratio']:.2f}x", f"{row['measured_speedup_ratio']:.2f}x",
           f"{row['measured_over_counted']:.2f}", f"{row['full_latency_ms']:.1f}",
           f"{row['exits_agree_with_counted']:.3f}"]
          for policy, rows in result["policies"].items() for row in [nearest(rows)]]


SPEEDUP_HEADER = ["run", "policy", "threshold", "dev metric", "counted L/mean layers",
                  "measured (batch 1)", "measured / counted", "full model ms", "exits agree"]


def speedup_table(task) -> str:
  return table(SPEEDUP_HEADER, [row for o in MULTI_EXIT
                                for row in speedup_rows(early_exit("me_minilm", task, o), LABELS[o])])


def _sweeps(tasks):
  return [(t, o, early_exit("me_minilm", t, o)) for t in tasks for o in MULTI_EXIT]


def _timed(result):
  return [r for rows in result["policies"].values() for r in rows if r.get("measured_speedup_ratio")]


def _at(sweeps, counted):
  return [r["measured_over_counted"] for *_, e in sweeps for r in _timed(e)
          if abs(r["speedup_ratio"] - counted) < 0.01]


def _patience2(sweeps):
  return {(t, o): next(r for r in e["policies"]["patience"] if r["threshold"] == 2)
          for t, o, e in sweeps}


def block_early_exit_summary() -> str:
  rm, cola = _sweeps(("rte", "mrpc")), _sweeps(("cola",))
  near = [nearest(rows)["measured_over_counted"] for *_, e in rm for rows in e["policies"].values()]
  p2 = _patience2(rm)
  at2 = {k: r for k, r in p2.items() if abs(r["speedup_ratio"] - 2) < 0.01}
  off = [f"{TASK_NAMES[t]} {LABELS[o]} {r['speedup_ratio']:.2f}x"
         for (t, o), r in p2.items() if (t, o) not in at2]
  cola_p2 = _patience2(cola)
  slower = [x["per_layer_latency_ms"] / x["compiled_latency_ms"] - 1
            for *_, e in rm + cola for x in e["runner_comparison"]]
  return "\n".join([
      f"- Batch 1, at each policy's threshold nearest a counted 2x, RTE and MRPC ({len(rm)} runs): "
      f"measured / counted {span(near)}.",
      f"- PABEE patience 2 counts 2.00x in {len(at2)} of those {len(rm)} runs (not: {', '.join(off)}) "
      f"and measured {span([r['measured_speedup_ratio'] for r in at2.values()])}x there. On CoLA "
      f"(short sentences, so each exit's fixed cost weighs more) it measured "
      + ", ".join(f"{LABELS[o]} {r['measured_over_counted']:.2f}" for (_, o), r in cola_p2.items())
      + " of its counted " + span([r["speedup_ratio"] for r in cola_p2.values()]) + "x.",
      f"- At a counted 3x, measured / counted is {span(_at(rm, 3))} on RTE and MRPC and "
      f"{span(_at(cola, 3))} on CoLA.",
      f"- The per-layer runner (one compiled function per layer, one host sync per exit) is "
      f"{span([100 * s for s in slower], '.0f')}% slower than the single compiled program over "
      f"the {len(slower)} comparisons of the {len(rm + cola)} sweeps (each policy near 2x).",
  ] + [_batched_line(task) for task in TASKS])


def _batched_line(task) -> str:
  sweeps = _sweeps((task,))
  b = {(o, x["policy"]): x for _, o, e in sweeps for x in e["batched"]}
  p2 = [(o, x) for (o, p), x in b.items() if p == "patience" and abs(x["counted_speedup_ratio"] - 2) < 0.02]
  best = max(p2, key=lambda ox: ox[1]["throughput_gain"])
  low = [x["throughput_gain"] for x in b.values() if x["counted_speedup_ratio"] < 1.5]
  other2 = [f"{LABELS[o]}'s {p} {x['threshold']:g} {x['throughput_gain']:.2f}x"
            for (o, p), x in b.items() if p != "patience" and abs(x["counted_speedup_ratio"] - 2) < 0.02]
  return (f"- Batched serving, {TASK_NAMES[task]} (batch {sweeps[0][2]['batched'][0]['batch_size']}, "
          f"exited rows leave): patience 2 at a counted 2x gives "
          f"{span([x['throughput_gain'] for _, x in p2])}x the full model's throughput "
          f"({len(p2)} runs; highest {LABELS[best[0]]} {best[1]['throughput_gain']:.2f}x)"
          + (f"; also at a counted 2x: {', '.join(other2)}" if other2 else "")
          + f"; {span(low)}x where the counted speed-up is below 1.5x.")


def block_full_model_ms() -> str:
  rows = [[LABELS[o], *(span([nearest(rows)["full_latency_ms"]
                               for rows in early_exit("me_minilm", t, o)["policies"].values()], ".1f")
                         for t in TASKS)] for o in MULTI_EXIT]
  return table(["run", *(f"{TASK_NAMES[t]} full model ms" for t in TASKS)], rows)


def block_early_exit_rte() -> str:
  return speedup_table("rte")


def block_early_exit_mrpc() -> str:
  return speedup_table("mrpc")


def block_early_exit_cola() -> str:
  return speedup_table("cola")


def block_history_00e0f21() -> str:
  e = early_exit("me_minilm_00e0f21", "rte", "ce")
  p2 = next(r for r in e["policies"]["patience"] if r["threshold"] == 2)
  same = [a == b for a, b in zip(exit_scores(run("me_minilm_00e0f21", "rte", "ce")),
                                 exit_scores(run("me_minilm", "rte", "ce")))]
  return (f"The record's sweep (commit {short(e['meta']['git_commit'])}, {e['meta']['machine']}): "
          f"patience 2 measured {p2['measured_over_counted']:.2f} of its counted "
          f"{p2['speedup_ratio']:.2f}x. The grid's rerun of this run (commit "
          f"{short(run('me_minilm', 'rte', 'ce')['commit'])}) "
          + ("reproduced its per-exit dev accuracies exactly." if all(same)
             else "differs from it per exit."))


# ---- mean-pooled exits ---------------------------------------------------------------------

def _mean_rows(task):
  rows = []
  for o in ("ce", "acl_cl"):
    for grid_name, pool in (("me_minilm_mean", "mean"), ("me_minilm", "[CLS]")):
      rows.append([LABELS[o], pool, *(f"{s:.3f}" for s in exit_scores(run(grid_name, task, o)))])
  return rows


def block_mean_table_rte() -> str:
  return _mean_table("rte")


def block_mean_table_cola() -> str:
  return _mean_table("cola")


def _mean_table(task) -> str:
  runs = [run("me_minilm_mean", task, o) for o in ("ce", "acl_cl")]
  return (f"Mean-pooled runs: {provenance(runs)}. Dev {metric_name(runs[0])} per exit, seed 0.\n\n"
          + table(["objective", "exits pool", *(f"exit{i}" for i in range(1, 7)), "avg"], _mean_rows(task)))


def block_mean_findings() -> str:
  lines = []
  for task in ("rte", "cola"):
    ce, cl = (exit_scores(run("me_minilm_mean", task, o)) for o in ("ce", "acl_cl"))
    ce_cls, cl_cls = (exit_scores(run("me_minilm", task, o)) for o in ("ce", "acl_cl"))
    diffs = ", ".join(f"exit {i + 1} {b - a:+.3f}" for i, (a, b) in enumerate(zip(ce, cl[:6])))
    lines.append(
        f"- {TASK_NAMES[task]}: average over exits, [CLS] → mean: CE {ce_cls[6]:.3f} → {ce[6]:.3f}, "
        f"ACL-CL {cl_cls[6]:.3f} → {cl[6]:.3f}. Exit 3: CE {ce_cls[2]:.3f} → {ce[2]:.3f}, ACL-CL "
        f"{cl_cls[2]:.3f} → {cl[2]:.3f}. Exit 6: CE {ce_cls[5]:.3f} → {ce[5]:.3f}. ACL-CL minus CE "
        f"with mean-pooled exits: {diffs}. Final exit's training CE (last logged batch): CE "
        f"{final_exit_train_ce(run('me_minilm_mean', task, 'ce')):.2f}, ACL-CL "
        f"{final_exit_train_ce(run('me_minilm_mean', task, 'acl_cl')):.2f}.")
  return "\n".join(lines)


def block_mean_early_exit() -> str:
  e = early_exit("me_minilm_mean", "rte", "ce")
  entropy = max(e["policies"]["entropy"], key=lambda r: r["threshold"])
  patience = min(e["policies"]["patience"], key=lambda r: r["threshold"])
  cls = early_exit("me_minilm", "rte", "ce")
  cls_fast = [r["metrics"]["accuracy"] for rows in cls["policies"].values() for r in rows
              if r["speedup_ratio"] >= 1.5]
  rows = [speedup_rows(early_exit(g, "rte", o), f"{LABELS[o]} ({pool})")
          for g, pool in (("me_minilm_mean", "mean-pooled"), ("me_minilm", "[CLS]"))
          for o in ("ce", "acl_cl")]
  return (f"- Mean-pooled CE, entropy {entropy['threshold']:g}: counted {entropy['speedup_ratio']:.2f}x, "
          f"measured {entropy['measured_speedup_ratio']:.2f}x at batch 1, accuracy "
          f"{entropy['metrics']['accuracy']:.3f}; PABEE patience {patience['threshold']:g}: counted "
          f"{patience['speedup_ratio']:.2f}x, measured {patience['measured_speedup_ratio']:.2f}x, accuracy "
          f"{patience['metrics']['accuracy']:.3f}. Measured / counted at these two points: "
          f"{span([entropy['measured_over_counted'], patience['measured_over_counted']])}.\n"
          f"- The [CLS] CE run at any counted 1.5x or more: accuracy {span(cls_fast, '.3f')} "
          f"(one class: {majority('rte'):.3f}).\n\n"
          + table(SPEEDUP_HEADER, [row for r in rows for row in r]))


# ---- single-exit grid ----------------------------------------------------------------------

def _single(task, objective):
  runs = [r for r in grid("acl_minilm") + grid("pilot") if (r["task"], r["objective"]) == (task, objective)]
  return sorted(runs, key=lambda r: r["seed"])


def _scores(task, objective, metric):
  return [r["metrics"][f"validation/{metric}"] for r in _single(task, objective)]


GRID_COLUMNS = (("rte", "accuracy"), ("mrpc", "accuracy"), ("mrpc", "f1"), ("cola", "mcc"))


def block_acl_grid() -> str:
  rows = []
  best = {(t, k): max(SINGLE_EXIT, key=lambda o: statistics.fmean(_scores(t, o, k)))
          for t, k in GRID_COLUMNS}
  for o in SINGLE_EXIT:
    cells = []
    for c in GRID_COLUMNS:
      cell = pm(_scores(c[0], o, c[1]))
      cells.append(f"**{cell}**" if best[c] == o else cell)
    rows.append([SINGLE_LABELS[o], *cells])
  seeds_ = sorted({r["seed"] for t in TASKS for o in SINGLE_EXIT for r in _single(t, o)})
  return (f"Seeds {', '.join(map(str, seeds_))}; mean ± std; the best mean per column in bold.\n\n"
          + table(["objective", "RTE accuracy", "MRPC accuracy", "MRPC F1", "CoLA MCC"], rows))


def block_acl_findings() -> str:
  m = {(t, o, k): summarize.mean_std(_scores(t, o, k)) for t, k in GRID_COLUMNS for o in SINGLE_EXIT}
  ce = m["cola", "ce", "mcc"]
  cola = [f"{SINGLE_LABELS[o]} {m['cola', o, 'mcc'][0] - ce[0]:+.3f} "
          f"({(m['cola', o, 'mcc'][0] - ce[0]) / max(ce[1], m['cola', o, 'mcc'][1]):.1f}x the larger "
          f"of the two seed stds)" for o in ("acl_embed", "acl", "scl")]
  rte = {o: m["rte", o, "accuracy"] for o in SINGLE_EXIT}
  mrpc_acc = [m["mrpc", o, "accuracy"] for o in SINGLE_EXIT]
  mrpc_f1 = [m["mrpc", o, "f1"] for o in SINGLE_EXIT]
  gate = ", ".join(f"{TASK_NAMES[t]} {k} {m[t, 'acl', k][0] - m[t, 'acl_embed', k][0]:+.3f}"
                   for t, k in GRID_COLUMNS)
  kept = [json.loads(line).get("kept") for line in
          (RECORDS / "acl_minilm" / "rte_acl_s0" / "metrics.jsonl").read_text().splitlines()]
  kept = [k for k in kept if k is not None]
  old_ce = [r["metrics"]["validation/mcc"] for r in _ce_jax("cola")]
  rte_dev = early_exit("me_minilm", "rte", "ce")["examples"]
  machines = {o: sorted({r["machine"] for r in _single("cola", o)}) for o in SINGLE_EXIT}
  return "\n".join([
      f"- CoLA MCC against CE ({ce[0]:.3f} ± {ce[1]:.3f}): " + "; ".join(cola) + ".",
      "- RTE accuracy: " + ", ".join(f"{SINGLE_LABELS[o]} {m:.3f} ± {s:.3f}"
                                     for o, (m, s) in rte.items())
      + f"; 1 dev example of {rte_dev} is {1 / rte_dev:.3f}.",
      f"- MRPC: the four means span {span([a for a, _ in mrpc_acc], '.3f')} accuracy and "
      f"{span([a for a, _ in mrpc_f1], '.3f')} F1; the seed stds are "
      f"{span([s for _, s in mrpc_acc], '.3f')} and {span([s for _, s in mrpc_f1], '.3f')}.",
      f"- The gate, ACL minus ACL-Embed: {gate}. In the RTE ACL seed-0 run the gate kept the "
      f"auxiliary term in {100 * statistics.fmean(kept):.1f}% of the {len(kept)} logged windows.",
      f"- CoLA CE with the session-1 dropout sampler (the CE table above, otherwise the same "
      f"recipe): {pm(old_ce)}.",
      "- CoLA machines: "
      + "; ".join(f"{SINGLE_LABELS[o]} {', '.join(v)}" for o, v in machines.items()) + "."])


def block_acl_full() -> str:
  runs = summarize.dedupe(list(grid("acl_minilm") + grid("pilot")))
  return summarize.summary_table(runs) + "\n\nRuns and machines: " + provenance(runs) + "."


# ---- pilot, probes -------------------------------------------------------------------------

def block_pilot() -> str:
  p = json.loads((RESULTS / "pilot_gradient_angle.json").read_text())
  rows = [[f"CE vs {name}, MiniLM on RTE", f"{d['mean']:.1f}°",
           f"{d['p05']:.1f}°-{d['p95']:.1f}°",
           f"{100 * d['fraction_above_90']:.1f}% "
           f"({round(d['fraction_above_90'] * d['batches'])} of {d['batches']})",
           f"{100 * d['fraction_above_90_first_third']:.1f}%",
           f"{100 * d['fraction_above_90_last_third']:.1f}%", short(d["commit"])]
          for name, d in (("SCL", p["scl"]), ("ACL-Embed", p["acl_embed"]))]
  return (table(["", "mean angle", "5th-95th percentile", "batches above 90°", "first third",
                 "last third", "commit"], rows)
          + f"\n\nThe paper's claim (BERT on RTE): {p['paper_claim']}. Machine: {p['scl']['machine']}.")


def block_cls_spread() -> str:
  rows = sorted(jsonl("cls_spread_minilm_mrpc.jsonl"), key=lambda r: r["layer"])[1:]
  return (f"Pretrained all-MiniLM-L6-v2, {rows[0]['examples']} MRPC dev examples: [CLS] spread after "
          "layers 1-6: " + ", ".join(f"{100 * r['cls_spread']:.1f}%" for r in rows)
          + "; the second token's: " + span([100 * r["token1_spread"] for r in rows], ".0f") + "%.")


def block_layer_probe() -> str:
  rows = []
  for task in TASKS:
    lines = [r for r in jsonl("layer_probe_minilm.jsonl") if r["task"] == task and "layer" in r]
    for pooling in ("cls", "mean"):
      by_layer = {r["layer"]: r["dev"] for r in lines if r["pooling"] == pooling}
      rows.append([f"{TASK_NAMES[task]} ({lines[0]['metric']}, majority {majority(task):.3f})",
                   "[CLS]" if pooling == "cls" else "mean",
                   *(f"{by_layer[i]:.3f}" for i in range(1, 7))])
  return table(["task", "pooling", *(f"layer {i}" for i in range(1, 7))], rows)


# ---- the fair comparison (experiments/fair.py) ------------------------------------------------

@functools.cache
def _fair():
  """fair_report.py, and each comparison of fair.COMPARISONS with its records (single exit,
  multi-exit, pilot)."""
  import fair_report  # experiments/, beside this file
  from fair import COMPARISONS
  return fair_report, [(c, *c.read()) for c in COMPARISONS.values()]


def _each_fair(render) -> str:
  """render(report, single, multi, pilot) for each comparison that has records, under its tag
  (a comparison with none yet is only in fair_progress)."""
  report, comparisons = _fair()
  return "\n\n".join(
      f"**{c.tag}** (commit {c.commit[:7]}, CPU fingerprint "
      + fingerprints(single + multi + pilot) + ")\n\n"
      + render(report, single, multi, pilot)
      for c, single, multi, pilot in comparisons if single + multi + pilot)


def fingerprints(runs) -> str:
  """The CPU fingerprints the runs name, "4202c509659cc6d0" (several: comma-separated)."""
  return ", ".join(sorted({str(r["cpu"]) for r in runs}))


def block_fair_progress() -> str:
  report, comparisons = _fair()
  return "\n".join(f"- **{c.tag}** (its runs execute {c.commit[:7]}): "
                   + report.progress(single, multi, pilot)
                   for c, single, multi, pilot in comparisons)


def block_fair_selection() -> str:
  return _each_fair(lambda report, single, multi, pilot: report.selection_table(single))


def block_fair_single_exit() -> str:
  return _each_fair(lambda report, single, multi, pilot: report.single_exit_table(single)[0])


def block_fair_multi_exit() -> str:
  return _each_fair(lambda report, single, multi, pilot:
                    report.multi_exit_table(multi, single)[0])


def block_fair_answers() -> str:
  return _each_fair(lambda report, single, multi, pilot: report.answers(single, multi))


def block_fair_cross_cpu() -> str:
  """Which CPU fair-1's records come from, and those records repeated on a machine of another
  type by experiments/repeat_record.py (results/cross_cpu_repeats_fair_1.jsonl)."""
  _, comparisons = _fair()
  _, single, multi, pilot = comparisons[0]  # fair-1, whose records were repeated
  kinds = collections.Counter((r["machine"], r["cpu"]) for r in single + multi + pilot)
  lines = ["fair-1's records: " + "; ".join(f"{n} on {m} with CPU fingerprint {c}"
                                            for (m, c), n in sorted(kinds.items())) + "."]
  repeats = (jsonl("cross_cpu_repeats_fair_1.jsonl")
             if (RESULTS / "cross_cpu_repeats_fair_1.jsonl").exists() else ())
  if not repeats:
    return "\n".join(lines + ["", "No record has been repeated on another machine type."])
  rows = []
  for r in repeats:
    final, metric = r["evaluations"][-1], r["main_metric"]
    scores = (f"{metric.removeprefix('eval/validation/')} {final['record'][metric]:.4f} / "
              f"{final['repeat'][metric]:.4f}")
    rows.append([f"`{pathlib.Path(r['record']).name}`", f"{r['record_cpu']} → {r['cpu']}",
                 r["compared_steps"], r["first_loss_difference_step"] or "none",
                 f"{r['max_relative_loss_difference']:.1e}",
                 "equal" if r["evaluations_equal"] else "**differ**",
                 f"step {final['step']}: {scores}"])
  commits = ", ".join(sorted({short(r["commit"]) for r in repeats}))
  header = [f"record (commit {commits})", "CPU: record → repeat", "loss rows compared",
            "first differing loss", "largest relative loss difference", "dev evaluations",
            "last evaluation's main metric, record / repeat"]
  lines += ["", table(header, rows), "",
            f"{sum(r['first_loss_difference_step'] is not None for r in repeats)} of "
            f"{len(repeats)} repeats logged another loss somewhere; "
            f"{sum(not r['evaluations_equal'] for r in repeats)} of {len(repeats)} had another "
            "dev evaluation. Command per row in the file."]
  return "\n".join(lines)


def block_fair_same_commit() -> str:
  """The runs that two comparisons at one commit both recorded, and whether their dev
  evaluations agree (fair_report.same_runs_agreement)."""
  report, comparisons = _fair()
  rows = []
  for (c1, single1, multi1, _), (c2, single2, multi2, _) in itertools.combinations(comparisons, 2):
    if c1.commit != c2.commit:
      continue
    agreement = report.same_runs_agreement(single1 + multi1, single2 + multi2)
    if not agreement["runs"]:
      continue
    rows.append([f"{c1.tag} / {c2.tag} ({fingerprints(single1 + multi1)} / "
                 f"{fingerprints(single2 + multi2)})", short(c1.commit),
                 agreement["runs"], agreement["evaluations_equal"], agreement["final_equal"],
                 f"{agreement['largest_final_difference']:.4f}"])
  if not rows:
    return "No two comparisons at one commit have recorded the same run yet."
  pairs, equal = sum(row[2] for row in rows), sum(row[3] for row in rows)
  return (table(["comparisons (CPU fingerprints)", "commit", "runs both recorded",
                 "every dev evaluation equal", "final main metric equal",
                 "largest final main-metric difference"], rows)
          + f"\n\nOf {pairs} pairs of one run recorded on two machine types, {equal} logged the "
          "same dev evaluations on both.")


def block_fair_summary() -> str:
  """The top-level README's summary of the answers."""
  return _each_fair(lambda report, single, multi, pilot: report.summary(single, multi))


BLOCKS = {name[len("block_"):]: fn for name, fn in globals().items() if name.startswith("block_")}


# ---- the notebook file ---------------------------------------------------------------------

def render(text: str) -> str:
  """`text` with every generated block rewritten; an unknown block name is an error."""
  def fill(match):
    name = match["name"]
    if name not in BLOCKS:
      raise SystemExit(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
    return match.group(1) + BLOCKS[name]().rstrip("\n") + "\n" + match.group(4)
  return BLOCK.sub(fill, text)


def update(path: pathlib.Path, check: bool = False) -> int:
  """Rewrites `path`'s generated blocks, or with `check` reports whether it is out of date."""
  text = path.read_text()
  new = render(text)
  if check:
    if new != text:
      import difflib
      sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                 str(path), "generated"))
      print(f"{path} is out of date: python experiments/summarize.py --notebook {path}",
            file=sys.stderr)
      return 1
    return 0
  path.write_text(new)
  return 0
