"""Pilot experiment: how often do the CE and contrastive gradients conflict?

The paper's claim (docs/method.md, "Claims"): on RTE the angle between the CE gradient and the SCL
gradient ranges about 75-105 degrees and exceeds 90 degrees in roughly 20% of mini-batches.
This trains with each auxiliary objective while logging, every step, the cosine between the
two gradient pytrees (config.measure_conflict: the same single-vjp computation ACL-Grad uses,
without gating the update), then draws the per-batch angle histogram.

    python experiments/pilot_gradient_angle.py --model=minilm --workdir=runs/pilot \
        --out=experiments/results/pilot_gradient_angle

Finished runs are reused: rerunning only redraws. `--runs DIR ...` draws finished runs (or
their records) trained with measure_conflict and log_every=1 elsewhere, e.g. the fair
comparison's pilot runs (experiments/fair.py), instead of training.
"""

import argparse
import json
import pathlib
import sys

import numpy as np

from acl_jax import config as config_lib
from acl_jax import train
from acl_jax.objectives import OBJECTIVES

PAPER_CLAIM = "angles about 75-105 degrees; above 90 degrees in roughly 20% of mini-batches"


def run(objective: str, args) -> pathlib.Path:
  workdir = args.workdir / f"{args.task}_{objective}_s{args.seed}"
  if (workdir / "eval_results.json").exists():
    return workdir
  preset = f"{args.task},model={args.model},objective={objective},seed={args.seed}"
  if args.max_steps:
    preset += f",max_steps={args.max_steps}"
  config = config_lib.get_config(preset)
  config.measure_conflict = True
  config.log_every = 1  # one metrics line per batch: the histogram is per mini-batch
  train.train_and_evaluate(config, str(workdir))
  return workdir


def angles_of(workdir: pathlib.Path) -> np.ndarray:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  cosines = np.array([r["cosine"] for r in rows if "cosine" in r], np.float64)
  return np.degrees(np.arccos(np.clip(cosines, -1.0, 1.0)))


def summarize(angles: np.ndarray) -> dict:
  return {
      "batches": int(len(angles)),
      "fraction_above_90": float(np.mean(angles > 90.0)),
      "mean": float(angles.mean()), "min": float(angles.min()), "max": float(angles.max()),
      "p05": float(np.percentile(angles, 5)), "p95": float(np.percentile(angles, 95)),
      # The first epoch separately: conflicts may concentrate early or late in training.
      "fraction_above_90_first_third": float(np.mean(angles[:len(angles) // 3] > 90.0)),
      "fraction_above_90_last_third": float(np.mean(angles[-(len(angles) // 3):] > 90.0)),
  }


def plot(results: dict, path: pathlib.Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (hist, trace) = plt.subplots(1, 2, figsize=(12, 4.2))
  bins = np.arange(0, 181, 2.5)
  for name, (angles, stats) in results.items():
    hist.hist(angles, bins=bins, alpha=0.55,
              label=f"CE vs {name}: {100 * stats['fraction_above_90']:.1f}% > 90°")
    trace.plot(np.arange(1, len(angles) + 1), angles, lw=0.7, label=f"CE vs {name}")
  for ax in (hist, trace):
    ax.axvspan(75, 105, color="grey", alpha=0.12) if ax is hist else ax.axhspan(
        75, 105, color="grey", alpha=0.12)
  hist.axvline(90, color="k", ls="--", lw=1)
  trace.axhline(90, color="k", ls="--", lw=1)
  lo = min(a.min() for a, _ in results.values())
  hi = max(a.max() for a, _ in results.values())
  hist.set_xlim(max(0, lo - 10), min(180, hi + 10))
  hist.set_xlabel("angle between gradients (degrees)")
  hist.set_ylabel("mini-batches")
  hist.legend(fontsize=8)
  hist.set_title(title + "\n(grey: the paper's 75-105° range)", fontsize=9)
  trace.set_xlabel("train step")
  trace.set_ylabel("angle (degrees)")
  trace.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--task", default="rte")
  parser.add_argument("--model", default="minilm")
  parser.add_argument("--objectives", default="scl,acl_embed")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max_steps", type=int, default=0)
  parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("runs/pilot"))
  parser.add_argument("--runs", type=pathlib.Path, nargs="*", default=None,
                      help="finished run directories to draw (one per objective) instead of "
                      "training; --task, --model, --objectives, --seed are then read from them")
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).parent / "results/pilot_gradient_angle")
  args = parser.parse_args(argv)

  results, summary = {}, {"paper_claim": PAPER_CLAIM, "command": " ".join(sys.argv)}
  workdirs = args.runs or [run(objective, args) for objective in args.objectives.split(",")]
  for workdir in workdirs:
    saved = json.loads((workdir / "config.json").read_text())
    objective = saved["config"]["objective"]
    gated = OBJECTIVES[objective].gate_mode != "none"
    if saved["config"].get("log_every") != 1 or not (
        gated or saved["config"].get("measure_conflict")):
      raise SystemExit(f"{workdir}: its metrics.jsonl has no per-batch gradient cosines (train "
                       "with log_every=1, and measure_conflict unless the objective is gated)")
    args.task, args.seed = saved["config"]["task"], saved["config"]["seed"]
    args.model = pathlib.Path(saved["config"]["model"]).name
    angles = angles_of(workdir)
    stats = summarize(angles)
    stats.update(workdir=str(workdir), commit=saved["meta"]["git_commit"],
                 machine=saved["meta"]["machine"], lr=saved["config"]["learning_rate"],
                 temperature=saved["config"]["temperature"],
                 aux_weight=saved["config"].get("aux_weight", saved["config"].get("lambda")),
                 dev=json.loads((workdir / "eval_results.json").read_text())["final"])
    results[objective] = (angles, stats)
    summary[objective] = stats
    print(json.dumps({"objective": objective, **stats}))

  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
  plot(results, args.out.with_suffix(".png"),
       f"{args.task.upper()}, {args.model}, seed {args.seed}: per-batch gradient angles")


if __name__ == "__main__":
  main()
