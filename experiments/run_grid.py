"""Runs a grid of fine-tunes one after another, skipping those already finished.

    python experiments/run_grid.py --root runs/acl_minilm --tasks rte,mrpc,cola \
        --objectives ce,scl,acl_embed,acl --seeds 0,1,2 --preset model=minilm

Each run is `python -m acl_jax.main --config=configs/glue.py:<task>,<preset>,objective=<o>,
seed=<s> --workdir=<root>/<task>_<objective>_s<seed>`, a separate process, so a crash or a
kill loses at most the run in flight; rerunning the same command continues the grid (a run
counts as finished when its eval_results.json exists). An unfinished run resumes from its last
checkpoint (its log gets the new output appended). Long grids may span several sessions:
with `--records DIR` every run that finishes is also copied to DIR/<name>/ (its config.json,
eval_results.json, metrics.jsonl, log.txt, early_exit.json/.png; no checkpoints), and a run with
a record there counts as finished, so a grid continues on a machine whose run directories are
gone. `--parallel N` runs N at once, each pinned to its own share of the cores. With
`--early_exit` (multi-exit grids) each run that trains is then swept by `--mode=early_exit` on
the same cores while its checkpoints are still there, and its early_exit.json and .png join its
record.
Summarize with experiments/summarize.py.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import threading
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
  parser.add_argument("--records", type=pathlib.Path, default=None,
                      help="run records kept as evidence (e.g. experiments/results/records/"
                      "acl_minilm): finished runs are copied there, and runs found there skipped")
  parser.add_argument("--early_exit", action="store_true",
                      help="multi-exit grids: after a run trains, sweep its exit policies "
                      "(--mode=early_exit, which needs the run's checkpoints) before keeping its "
                      "record; a trained run whose early_exit.json is missing gets the sweep only")
  parser.add_argument("--early_exit_examples", type=int, default=None,
                      help="dev examples timed at batch size 1 by each sweep (default: all)")
  parser.add_argument("--dry_run", action="store_true", help="print the commands only")
  parser.add_argument("--parallel", type=int, default=1,
                      help="runs at once, each pinned to its share of the cores with XLA's "
                      "threads to match (2 on a 2-core CPU: about 1.2x the throughput of one "
                      "run on both cores, and compiles overlap)")
  args = parser.parse_args()

  args.root.mkdir(parents=True, exist_ok=True)
  todo = []
  for task in args.tasks.split(","):
    for objective in args.objectives.split(","):
      for seed in args.seeds.split(","):
        workdir = (args.root / f"{task}_{objective}_s{seed}").resolve()
        preset = ",".join(filter(None, [task, args.preset, f"objective={objective}",
                                        f"seed={seed}"]))
        commands = []
        if not has_output(workdir, args.records, "eval_results.json"):
          commands.append([sys.executable, "-m", "acl_jax.main",
                           f"--config=configs/glue.py:{preset}", f"--workdir={workdir}"])
        if args.early_exit and not has_output(workdir, args.records, "early_exit.json"):
          if commands or (workdir / "checkpoints").is_dir():
            commands.append(sweep_command(workdir, args.early_exit_examples))
          else:
            print(f"cannot sweep {workdir.name}: trained elsewhere and its checkpoints are not "
                  f"under {workdir}", flush=True)
        if commands:
          todo.append((workdir, commands))
  print(f"{len(todo)} runs to do under {args.root}", flush=True)
  if args.dry_run:
    for i, (_, commands) in enumerate(todo, 1):
      print(f"[{i}/{len(todo)}] {describe(commands)}", flush=True)
    return
  slots = core_groups(args.parallel)
  queue = list(enumerate(todo, 1))
  lock = threading.Lock()

  def worker(cores):
    while True:
      with lock:
        if not queue:
          return
        i, (workdir, commands) = queue.pop(0)
        print(f"[{i}/{len(todo)}] {describe(commands)}"
              + (f" (cores {sorted(cores)})" if cores else ""), flush=True)
      workdir.mkdir(parents=True, exist_ok=True)  # an unfinished run resumes from its checkpoint
      env = dict(os.environ)
      if cores:
        env["XLA_FLAGS"] = " ".join(
            filter(None, [env.get("XLA_FLAGS"), xla_thread_flags(len(cores))]))
      start = time.time()
      returncode = 0
      with open(workdir / "log.txt", "a") as log:
        for command in commands:  # train, then sweep; a failed step stops the rest
          returncode = subprocess.run(
              command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
              preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None).returncode
          if returncode:
            break
      status = "ok" if returncode == 0 else f"FAILED (exit {returncode})"
      kept = (f"; record: {keep_record(workdir, args.records)}"
              if returncode == 0 and args.records else "")
      with lock:
        print(f"    [{i}] {status} in {time.time() - start:.0f} s; log: {workdir / 'log.txt'}"
              + kept, flush=True)

  threads = [threading.Thread(target=worker, args=(cores,)) for cores in slots]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()


RECORD_FILES = ("config.json", "eval_results.json", "metrics.jsonl", "log.txt",
                "early_exit.json", "early_exit.png")


def has_output(workdir: pathlib.Path, records: pathlib.Path | None, name: str) -> bool:
  """Whether a run wrote `name` (eval_results.json: trained; early_exit.json: swept), in its
  workdir or in its record."""
  places = [workdir] + ([records / workdir.name] if records else [])
  return any((d / name).exists() for d in places)


def describe(commands: list[list[str]]) -> str:
  """A run's steps as one line, without the interpreter's path."""
  return " && ".join(" ".join(command[1:]) for command in commands)


def sweep_command(workdir: pathlib.Path, max_examples: int | None) -> list[str]:
  return [sys.executable, "-m", "acl_jax.main", "--mode=early_exit", f"--workdir={workdir}"] + (
      [f"--max_examples={max_examples}"] if max_examples else [])


def keep_record(workdir: pathlib.Path, records: pathlib.Path) -> pathlib.Path:
  """Copies a finished run's small files (never its checkpoints) to records/<name>/."""
  record = records / workdir.name
  record.mkdir(parents=True, exist_ok=True)
  for name in RECORD_FILES:
    if (workdir / name).exists():
      shutil.copy2(workdir / name, record / name)
  return record


def core_groups(parallel: int) -> list[set[int] | None]:
  """One CPU set per concurrent run: the usable cores split evenly (None: one run, unpinned)."""
  if parallel <= 1:
    return [None]
  cores = sorted(os.sched_getaffinity(0))
  if parallel > len(cores):
    raise SystemExit(f"--parallel {parallel} exceeds the {len(cores)} usable cores")
  return [set(cores[i::parallel]) for i in range(parallel)]


def xla_thread_flags(num_cores: int) -> str:
  """XLA:CPU sizes its thread pool to the machine, not to the affinity mask: a run pinned to
  one core gets no Eigen thread pool at all, so its threads do not fight over that core."""
  return f"--xla_cpu_multi_thread_eigen={'true' if num_cores > 1 else 'false'}"


if __name__ == "__main__":
  main()
