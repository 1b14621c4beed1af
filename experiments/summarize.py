"""Summarizes finished run directories into a results table (mean and std over seeds).

    python experiments/summarize.py runs/ce_minilm/* --out experiments/results/ce_minilm
    python experiments/summarize.py experiments/results/records/acl_minilm/* \
        experiments/results/records/pilot/rte_scl_s0 --out experiments/results/acl_minilm
    python experiments/summarize.py --notebook experiments/results/README.md [--check]

Reads each run's config.json and eval_results.json (or the runs of an earlier summary's
.jsonl), groups runs that differ only in the seed,
and writes <out>.jsonl (one line per run, with its command and commit) and <out>.md (the
table). Final-step dev metrics are reported, never the best seed or the best step. A run
given twice (same configuration and seed, same metrics: e.g. an earlier .jsonl and the run
directory it came from) counts once; two different runs with the same configuration and seed
are refused.

--notebook rewrites every generated block (<!-- summarize:NAME --> ... <!-- /summarize:NAME -->)
of the results notebook from the records (experiments/notebook_blocks.py); with --check it
rewrites nothing and exits 1 when the file differs from what would be generated.
"""

import argparse
import collections
import json
import pathlib
import statistics
import sys

from acl_jax import host
from acl_jax import run_dir
from acl_jax.objectives import OBJECTIVES


def config_value(config: dict, name: str, default=None):
  """`config[name]` of a record (or summary row) written with today's field names or older
  ones (run_dir.RENAMED_FIELDS); the new name wins."""
  return run_dir.upgrade_config(config).get(name, default)


# Objectives whose multi-exit runs have a gate granularity worth naming.
GATED = tuple(name for name, spec in OBJECTIVES.items() if spec.gate_mode != "none")


# Loss weights a grid may vary: config field -> (default in acl_jax.config, label, the
# objectives it acts on, from the auxiliary losses that read it). A run off the default is
# labelled and grouped apart, so a sweep never averages two settings as if they were seeds.
# Records older than a field get its default.
def _reading(*aux_losses):
  return tuple(name for name, spec in OBJECTIVES.items() if spec.aux in aux_losses)


TUNED = {"aux_weight": (0.5, "λ", _reading("scl", "kd", "acl_embed", "acl_cl")),
         "temperature": (0.3, "τ", _reading("scl", "acl_embed", "acl_cl")),
         "cl_weight": (0.5, "μ", _reading("acl_cl")),
         # The method's switches (docs/method.md).
         "anchors": ("all", "anchors", _reading("acl_embed", "acl_cl")),
         "cl_anchors": ("all", "ACL-CL anchors", _reading("acl_cl")),
         "normalize_label_embeddings": (True, "normalized label embeddings",
                                        _reading("acl_embed", "acl_cl"))}


def _shown(value) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def tuned_label(run: dict) -> str:
  """", λ 0.9, μ 0.1": the loss weights and switches of `run` that differ from their
  defaults."""
  return "".join(f", {label} {_shown(config_value(run, key, default))}"
                 for key, (default, label, objectives) in TUNED.items()
                 if run["objective"] in objectives and config_value(run, key, default) != default)


def load_run(workdir: pathlib.Path) -> dict | None:
  results_file = workdir / "eval_results.json"
  if not results_file.exists():
    return None
  saved = json.loads((workdir / "config.json").read_text())
  results = json.loads(results_file.read_text())
  config, meta = saved["config"], saved["meta"]
  final = results["final"]
  metrics = {f"{split}/{name}": value for split, values in final.items()
             if isinstance(values, dict) for name, value in values.items()}
  return {
      "workdir": str(workdir),
      "task": config["task"], "model": config["model"], "objective": config["objective"],
      "multi_exit": config.get("multi_exit", False),
      "gate_granularity": config_value(config, "gate_granularity"),
      "pooler_input": config_value(config, "pooler_input", "cls"),
      **{key: config_value(config, key, default) for key, (default, _, _) in TUNED.items()},
      "lr": config["learning_rate"], "epochs": config["num_epochs"],
      "max_steps": config["max_steps"], "batch_size": config["batch_size"],
      "seed": config["seed"], "metrics": metrics, "main_metric": results["main_metric"],
      "train_seconds": results["train"]["seconds"],
      "examples_per_s": results["train"]["examples_per_s"],
      "steps": results["train"]["steps"],
      "command": command_line(meta["argv"]), "commit": meta["git_commit"],
      "machine": meta["machine"], "cpu": host.recorded_cpu(meta), "backend": meta["backend"], "versions": meta["versions"],
  }


def command_line(argv: list[str]) -> str:
  # `python -m acl_jax.main` records its own path as argv[0].
  program = "python -m acl_jax.main" if argv[0].endswith("acl_jax/main.py") else argv[0]
  return " ".join([program, *argv[1:]])


def read_runs(paths) -> list[dict]:
  """The finished runs among run directories and earlier summaries' .jsonl files."""
  runs = []
  for path in map(pathlib.Path, paths):
    if path.suffix == ".jsonl":  # an earlier summary's runs, e.g. whose directories are gone
      runs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif (run := load_run(path)) is not None:
      runs.append(run)
  return runs


def objective_label(run: dict) -> str:
  """"multi-exit acl_cl (global gate), mean-pooled exits, μ 0.1": what the group trained."""
  objective = run["objective"]
  if run.get("multi_exit"):
    gate = config_value(run, "gate_granularity")
    objective = f"multi-exit {objective}" + (f" ({gate} gate)" if objective in GATED else "")
    if (pooling := config_value(run, "pooler_input", "cls")) != "cls":
      objective += f", {pooling}-pooled exits"
  return objective + tuned_label(run)


def group_key(run: dict) -> tuple:
  """Runs with the same key differ only in the seed."""
  return (run["task"], run["model"], objective_label(run), run["lr"], run["epochs"],
          run["max_steps"], run.get("batch_size"))


def dedupe(runs: list[dict]) -> list[dict]:
  """Keeps one of each run given twice; refuses two different runs of one config and seed."""
  kept = {}
  for run in runs:
    key = (*group_key(run), run["seed"])
    if key not in kept:
      kept[key] = run
    elif kept[key]["metrics"] == run["metrics"]:
      print(f"summarize: {run['workdir']} repeats {kept[key]['workdir']}; counted once",
            file=sys.stderr)
    else:
      raise SystemExit(f"{kept[key]['workdir']} and {run['workdir']} have the same "
                       f"configuration and seed but different metrics: two different runs "
                       f"would be averaged as one seed. Summarize them separately.")
  return list(kept.values())


def mean_std(values):
  values = list(values)
  std = statistics.stdev(values) if len(values) > 1 else float("nan")
  return statistics.fmean(values), std


def pm(values, fmt: str = ".3f") -> str:
  """"0.612 ± 0.013": the mean ± sample std; one value alone (a single run has no sample std);
  "" for no values."""
  values = list(values)
  if len(values) == 1:
    return f"{values[0]:{fmt}}"
  return "{:{f}} ± {:{f}}".format(*mean_std(values), f=fmt) if values else ""


def seeds_of(group: list[dict]) -> str:
  return ",".join(str(r["seed"]) for r in sorted(group, key=lambda r: r["seed"]))


def exit_names(run: dict) -> list[str]:
  return sorted({name.split("/")[1] for name in run["metrics"] if "/exit" in name},
                key=lambda e: int(e[len("exit"):]))


def metric_name(run: dict) -> str:
  """The main metric's name without its split and exit ("accuracy")."""
  return run["main_metric"].split("/")[-1]


def exit_scores(run: dict) -> list[float]:
  """A multi-exit run's main metric at every exit, then the average over exits."""
  split, metric = run["main_metric"].split("/")[0], metric_name(run)
  return [run["metrics"][f"{split}/{e}/{metric}"] for e in [*exit_names(run), "avg"]]


def per_exit_row(task: str, objective: str, group: list[dict]) -> tuple[list[str], str]:
  """A multi-exit group's main metric at every exit and on average: (exit names, row)."""
  split, _, metric = group[0]["main_metric"].partition("/")
  metric = metric.split("/")[-1]
  exits = exit_names(group[0])
  cells = []
  for exit_name in [*exits, "avg"]:
    m, s = mean_std(r["metrics"][f"{split}/{exit_name}/{metric}"] for r in group)
    cells.append(f"{m:.4f} ± {s:.4f}" if len(group) > 1 else f"{m:.4f}")
  return exits, f"| {task} | {objective} | {seeds_of(group)} | {metric} | " + " | ".join(cells) + " |"


def group_runs(runs: list[dict]) -> dict:
  groups = collections.defaultdict(list)
  for run in runs:
    groups[group_key(run)].append(run)
  return dict(sorted(groups.items()))


def summary_row(task, model, objective, lr, epochs, group) -> str:
  names = sorted(group[0]["metrics"])
  if group[0].get("multi_exit"):  # the main table keeps the average and the last exit
    last = exit_names(group[0])[-1]
    names = [n for n in names if "/avg/" in n or f"/{last}/" in n]
  cells = []
  for name in names:
    m, s = mean_std(r["metrics"][name] for r in group)
    cells.append(f"{name} {m:.4f} ± {s:.4f}" if len(group) > 1 else f"{name} {m:.4f}")
  secs, _ = mean_std(r["train_seconds"] for r in group)
  rate, _ = mean_std(r["examples_per_s"] for r in group)
  commits = ", ".join(sorted({str(r["commit"])[:12] for r in group}))
  return (f"| {task} | {model} | {objective} | {lr:g} | {epochs} | {seeds_of(group)} | "
          f"{'; '.join(cells)} | {secs:.0f} | {rate:.1f} | {commits} |")


def summary_table(runs: list[dict]) -> str:
  """The markdown table of <out>.md: one row per group, then multi-exit groups per exit."""
  lines = ["| task | model | objective | lr | epochs | seeds | dev metrics (mean ± std) "
           "| train s/run | train ex/s | commit |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  per_exit_lines = []
  for (task, model, objective, lr, epochs, *_), group in group_runs(runs).items():
    lines.append(summary_row(task, model, objective, lr, epochs, group))
    if group[0].get("multi_exit"):
      per_exit_lines.append(per_exit_row(task, objective, group))
  if per_exit_lines:
    exits = per_exit_lines[0][0]
    lines += ["", "Per exit (dev, mean ± std over seeds):", "",
              "| task | objective | seeds | metric | " + " | ".join(exits) + " | avg |",
              "|---|---|---|---|" + "---|" * (len(exits) + 1)]
    lines += [row for _, row in per_exit_lines]
  return "\n".join(lines)


def write_summary(runs: list[dict], out: pathlib.Path) -> str:
  out.parent.mkdir(parents=True, exist_ok=True)
  with open(out.with_suffix(".jsonl"), "w") as f:
    for run in runs:
      f.write(json.dumps(run) + "\n")
  table = summary_table(runs)
  out.with_suffix(".md").write_text(table + "\n")
  return table


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="*", type=pathlib.Path)
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--tasks", default=None, help="comma-separated: keep only these tasks")
  parser.add_argument("--notebook", type=pathlib.Path,
                      help="rewrite this notebook's generated blocks from the records")
  parser.add_argument("--check", action="store_true",
                      help="with --notebook: write nothing, exit 1 if the file is out of date")
  args = parser.parse_args()
  if args.notebook:
    import notebook_blocks  # experiments/notebook_blocks.py, beside this script
    sys.exit(notebook_blocks.update(args.notebook, check=args.check))
  if args.out is None or not args.workdirs:
    parser.error("give run directories (or .jsonl files) and --out, or --notebook")

  runs = dedupe(read_runs(args.workdirs))
  if args.tasks:
    runs = [r for r in runs if r["task"] in args.tasks.split(",")]
  if not runs:
    raise SystemExit("No finished runs (eval_results.json) among the given directories.")
  print(write_summary(runs, args.out))


if __name__ == "__main__":
  main()
