"""Runs a grid of fine-tunes one after another, skipping those already finished.

    python experiments/run_grid.py --root runs/acl_minilm --tasks rte,mrpc,cola \
        --objectives ce,scl,acl_embed,acl --seeds 0,1,2 --preset model=minilm

Each run is `python -m acl_jax.main --config=configs/glue.py:<task>,<preset>,objective=<o>,
seed=<s> --workdir=<root>/<task>_<objective>_s<seed>`, a separate process, so a crash or a
kill loses at most the run in flight; rerunning the same command continues the grid (a run
counts as finished when its eval_results.json exists). An unfinished run resumes from its last
checkpoint (its log gets the new output appended). Long grids may span several sessions.
Summarize with experiments/summarize.py.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", type=pathlib.Path, required=True)
  parser.add_argument("--tasks", default="rte")
  parser.add_argument("--objectives", default="ce")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--preset", default="model=minilm",
                      help="extra comma-separated presets, e.g. model=minilm,epochs=1")
  parser.add_argument("--dry_run", action="store_true", help="print the commands only")
  args = parser.parse_args()

  args.root.mkdir(parents=True, exist_ok=True)
  todo = []
  for task in args.tasks.split(","):
    for objective in args.objectives.split(","):
      for seed in args.seeds.split(","):
        workdir = (args.root / f"{task}_{objective}_s{seed}").resolve()
        preset = ",".join(filter(None, [task, args.preset, f"objective={objective}",
                                        f"seed={seed}"]))
        command = [sys.executable, "-m", "acl_jax.main", f"--config=configs/glue.py:{preset}",
                   f"--workdir={workdir}"]
        if not (workdir / "eval_results.json").exists():
          todo.append((workdir, command))
  print(f"{len(todo)} runs to do under {args.root}", flush=True)
  for i, (workdir, command) in enumerate(todo, 1):
    print(f"[{i}/{len(todo)}] {' '.join(command[1:])}", flush=True)
    if args.dry_run:
      continue
    workdir.mkdir(parents=True, exist_ok=True)  # an unfinished run resumes from its checkpoint
    start = time.time()
    with open(workdir / "log.txt", "a") as log:
      proc = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ))
    status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    print(f"    {status} in {time.time() - start:.0f} s; log: {workdir / 'log.txt'}", flush=True)


if __name__ == "__main__":
  main()
