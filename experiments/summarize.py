"""Summarizes finished run directories into a results table (mean and std over seeds).

    python experiments/summarize.py runs/ce_minilm/* --out experiments/results/ce_minilm

Reads each run's config.json and eval_results.json, groups runs that differ only in the seed,
and writes <out>.jsonl (one line per run, with its command and commit) and <out>.md (the
table). Final-step dev metrics are reported, never the best seed or the best step.
"""

import argparse
import collections
import json
import pathlib
import statistics


def load_run(workdir: pathlib.Path) -> dict | None:
  results_file = workdir / "eval_results.json"
  if not results_file.exists():
    return None
  saved = json.loads((workdir / "config.json").read_text())
  results = json.loads(results_file.read_text())
  config, meta = saved["config"], saved["meta"]
  final = results["final"]
  metrics = {f"{split}/{name}": value for split, values in final.items() if split != "step"
             for name, value in values.items()}
  return {
      "workdir": str(workdir),
      "task": config["task"], "model": config["model"], "objective": config["objective"],
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", type=pathlib.Path)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  args = parser.parse_args()

  runs = [r for r in map(load_run, args.workdirs) if r is not None]
  if not runs:
    raise SystemExit("No finished runs (eval_results.json) among the given directories.")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  with open(args.out.with_suffix(".jsonl"), "w") as f:
    for run in runs:
      f.write(json.dumps(run) + "\n")

  groups = collections.defaultdict(list)
  for run in runs:
    groups[(run["task"], run["model"], run["objective"], run["lr"], run["epochs"],
            run["max_steps"])].append(run)
  lines = ["| task | model | objective | lr | epochs | seeds | dev metrics (mean ± std) "
           "| train s/run | train ex/s | commit |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for (task, model, objective, lr, epochs, _), group in sorted(groups.items()):
    names = sorted(group[0]["metrics"])
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
  args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
