"""Quality-speed curves of several early-exit sweeps on one figure (the paper's main picture).

    python experiments/plot_tradeoff.py runs/me/rte_ce_s0 runs/me/rte_acl_s0 \
        runs/me/rte_acl_cl_s0 --out experiments/results/early_exit/rte_tradeoff.png \
        --table experiments/results/early_exit/rte_speedups.md

Each argument is a run directory holding early_exit.json (python -m acl_jax.main
--mode=early_exit --workdir=<run>) or such a file itself. One panel per policy; in each, every
label's Pareto front (the best dev metric at each counted speed-up) as a step line, and hollow
circles at the measured batch-1 speed-up of the same thresholds. Labels default to each run's
objective; runs sharing a label are seeds of one configuration, averaged threshold by threshold
(early_exit.tradeoff_curves).
"""

import argparse
import json
import pathlib

from acl_jax import early_exit


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="+", type=pathlib.Path)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--labels", default=None, help="comma-separated, one per run; runs "
                      "sharing a label are averaged threshold by threshold")
  parser.add_argument("--policies", default=None,
                      help="comma-separated subset of the policies to draw (default: all)")
  parser.add_argument("--title", default=None)
  parser.add_argument("--table", type=pathlib.Path, default=None,
                      help="also write a markdown table: per run and policy, the threshold "
                           "nearest a counted 2x with its counted and measured speed-ups")
  args = parser.parse_args(argv)
  results = []
  for run in args.runs:
    path = run / "early_exit.json" if run.is_dir() else run
    if not path.is_file():
      parser.error(f"{path} not found: run python -m acl_jax.main --mode=early_exit "
                   f"--workdir={run} first")
    result = json.loads(path.read_text())
    if args.policies:
      keep = args.policies.split(",")
      result["policies"] = {k: v for k, v in result["policies"].items() if k in keep}
    results.append(result)
  labels = args.labels.split(",") if args.labels else None
  if labels and len(labels) != len(results):
    parser.error(f"--labels has {len(labels)} entries for {len(results)} runs")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  early_exit.plot(results, args.out, labels=labels, title=args.title)
  print(f"wrote {args.out}")
  if args.table:
    args.table.write_text(speedup_table(results, labels) + "\n")
    print(f"wrote {args.table}")


def speedup_table(results, labels=None) -> str:
  """Measured against counted speed-up at each policy's threshold nearest a counted 2x."""
  lines = ["| run | policy | threshold | dev metric | counted L/mean layers | measured "
           "(batch 1) | measured / counted | full model ms | exits agree |",
           "|---|---|---|---|---|---|---|---|---|"]
  for index, result in enumerate(results):
    label = labels[index] if labels else f"{result['task']} {result['objective']}"
    metric = result["main_metric"]
    full_mean = result.get("full_model", {}).get("latency_ms")
    for name, rows in result["policies"].items():
      row = min(rows, key=lambda r: abs(r["speedup_ratio"] - 2))
      measured = row.get("measured_speedup_ratio")
      full = row.get("full_latency_ms", full_mean)  # timed beside this threshold (newer sweeps)
      lines.append(
          f"| {label} | {name} | {row['threshold']:g} | {metric} {row['metrics'][metric]:.4f} "
          f"| {row['speedup_ratio']:.2f}x | "
          + (f"{measured:.2f}x | {row['measured_over_counted']:.2f} | {full:.1f} | "
             f"{row['exits_agree_with_counted']:.3f} |" if measured else "- | - | - | - |"))
  return "\n".join(lines)


if __name__ == "__main__":
  main()
