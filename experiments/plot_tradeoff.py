"""Quality-speed curves of several early-exit sweeps on one figure (the paper's main picture).

    python experiments/plot_tradeoff.py runs/me/rte_ce_s0 runs/me/rte_acl_s0 \
        runs/me/rte_acl_cl_s0 --out experiments/results/early_exit/rte_tradeoff.png

Each argument is a run directory holding early_exit.json (python -m acl_jax.main
--mode=early_exit --workdir=<run>) or such a file itself. Lines: counted speed-up; hollow
circles: measured at batch size 1. Labels default to each run's objective.
"""

import argparse
import json
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from acl_jax import early_exit  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="+", type=pathlib.Path)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--labels", default=None, help="comma-separated, one per run")
  parser.add_argument("--policies", default=None,
                      help="comma-separated subset of the policies to draw (default: all)")
  parser.add_argument("--title", default=None)
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


if __name__ == "__main__":
  main()
