"""Summarizes finished run directories into a results table (mean and std over seeds).

    python experiments/summarize.py runs/ce_minilm/* --out experiments/results/ce_minilm
    python experiments/summarize.py experiments/results/ce_minilm.jsonl runs/acl_minilm/* \
        --tasks rte,mrpc,cola --out experiments/results/acl_minilm

Reads each run's config.json and eval_results.json (or the runs of an earlier summary's
.jsonl), groups runs that differ only in the seed,
and writes <out>.jsonl (one line per run, with its command and commit) and <out>.md (the
table). Final-step dev metrics are reported, never the best seed or the best step.
"""

import argparse
import collections
import json
import pathlib
import statistics

from acl_jax import train


# Objectives whose multi-exit runs have a gate granularity worth naming.
GATED = tuple(name for name, spec in train.OBJECTIVES.items() if spec.gate != "none")
# Loss weights a grid may vary: config field -> (default in configs/glue.py, label, the
# objectives it acts on, from the auxiliary losses that read it). A run off the default is
# labelled and grouped apart, so a sweep never averages two settings as if they were seeds.
# Records older than a field get its default.
def _reading(*aux_losses):
  return tuple(name for name, spec in train.OBJECTIVES.items() if spec.aux in aux_losses)


TUNED = {"lambda": (0.5, "λ", _reading("scl", "kd", "acl_embed", "acl_cl")),
         "temperature": (0.3, "τ", _reading("scl", "acl_embed", "acl_cl")),
         "cl_weight": (0.5, "μ", _reading("acl_cl"))}


def tuned_label(run: dict) -> str:
  """", λ 0.9, μ 0.1": the loss weights of `run` that differ from their defaults."""
  return "".join(f", {label} {run.get(key, default):g}"
                 for key, (default, label, objectives) in TUNED.items()
                 if run["objective"] in objectives and run.get(key, default) != default)


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
      "multi_exit": config.get("multi_exit", False), "gate": config.get("gate"),
      "exit_pooling": config.get("exit_pooling", "cls"),
      **{key: config.get(key, default) for key, (default, _, _) in TUNED.items()},
      "lr": config["learning_rate"], "epochs": config["num_epochs"],
      "max_steps": config["max_steps"], "batch_size": config["batch_size"],
      "seed": config["seed"], "metrics": metrics, "main_metric": results["main_metric"],
      "train_seconds": results["train"]["seconds"],
      "examples_per_s": results["train"]["examples_per_s"],
      "steps": results["train"]["steps"],
      "command": command_line(meta["argv"]), "commit": meta["git_commit"],
      "machine": meta["machine"], "backend": meta["backend"], "versions": meta["versions"],
  }


def command_line(argv: list[str]) -> str:
  # `python -m acl_jax.main` records its own path as argv[0].
  program = "python -m acl_jax.main" if argv[0].endswith("acl_jax/main.py") else argv[0]
  return " ".join([program, *argv[1:]])


def mean_std(values):
  values = list(values)
  std = statistics.stdev(values) if len(values) > 1 else float("nan")
  return statistics.fmean(values), std


def per_exit_row(task: str, objective: str, group: list[dict]) -> tuple[list[str], str]:
  """A multi-exit group's main metric at every exit and on average: (exit names, row)."""
  split, _, metric = group[0]["main_metric"].partition("/")
  metric = metric.split("/")[-1]
  exits = sorted({name.split("/")[1] for name in group[0]["metrics"] if "/exit" in name},
                 key=lambda e: int(e[len("exit"):]))
  cells = []
  for exit_name in [*exits, "avg"]:
    m, s = mean_std(r["metrics"][f"{split}/{exit_name}/{metric}"] for r in group)
    cells.append(f"{m:.4f} ± {s:.4f}" if len(group) > 1 else f"{m:.4f}")
  seeds = ",".join(str(r["seed"]) for r in sorted(group, key=lambda r: r["seed"]))
  return exits, f"| {task} | {objective} | {seeds} | {metric} | " + " | ".join(cells) + " |"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", type=pathlib.Path)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--tasks", default=None, help="comma-separated: keep only these tasks")
  args = parser.parse_args()

  runs = []
  for path in args.workdirs:
    if path.suffix == ".jsonl":  # an earlier summary's runs, e.g. whose directories are gone
      runs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif (run := load_run(path)) is not None:
      runs.append(run)
  if args.tasks:
    runs = [r for r in runs if r["task"] in args.tasks.split(",")]
  if not runs:
    raise SystemExit("No finished runs (eval_results.json) among the given directories.")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  with open(args.out.with_suffix(".jsonl"), "w") as f:
    for run in runs:
      f.write(json.dumps(run) + "\n")

  groups = collections.defaultdict(list)
  for run in runs:
    objective = run["objective"]
    if run.get("multi_exit"):
      objective = f"multi-exit {objective}" + (f" ({run['gate']} gate)"
                                               if objective in GATED else "")
      if run.get("exit_pooling", "cls") != "cls":
        objective += f", {run['exit_pooling']}-pooled exits"
    objective += tuned_label(run)
    groups[(run["task"], run["model"], objective, run["lr"], run["epochs"],
            run["max_steps"])].append(run)
  lines = ["| task | model | objective | lr | epochs | seeds | dev metrics (mean ± std) "
           "| train s/run | train ex/s | commit |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  per_exit_lines = []
  for (task, model, objective, lr, epochs, _), group in sorted(groups.items()):
    names = sorted(group[0]["metrics"])
    if group[0].get("multi_exit"):
      per_exit_lines.append(per_exit_row(task, objective, group))
      # The main table keeps the average over exits and the last exit.
      last = max(n.split("/")[1] for n in names if "/exit" in n)
      names = [n for n in names if "/avg/" in n or f"/{last}/" in n]
    cells = []
    for name in names:
      m, s = mean_std(r["metrics"][name] for r in group)
      cells.append(f"{name} {m:.4f} ± {s:.4f}" if len(group) > 1 else f"{name} {m:.4f}")
    secs, _ = mean_std(r["train_seconds"] for r in group)
    rate, _ = mean_std(r["examples_per_s"] for r in group)
    commits = ", ".join(sorted({str(r["commit"])[:12] for r in group}))
    seeds = ",".join(str(r["seed"]) for r in sorted(group, key=lambda r: r["seed"]))
    lines.append(f"| {task} | {model} | {objective} | {lr:g} | {epochs} | {seeds} | "
                 f"{'; '.join(cells)} | {secs:.0f} | {rate:.1f} | {commits} |")
  if per_exit_lines:
    exits = per_exit_lines[0][0]
    lines += ["", "Per exit (dev, mean ± std over seeds):", "",
              "| task | objective | seeds | metric | " + " | ".join(exits) + " | avg |",
              "|---|---|---|---|" + "---|" * (len(exits) + 1)]
    lines += [row for _, row in per_exit_lines]
  args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
