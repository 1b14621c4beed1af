"""Repeats recorded runs on this machine and says where the repeat first differs from the record.

    python experiments/repeat_record.py experiments/results/records/fair_1/rte_ce_s1_* \
      --checkout ../fair1 --root runs/repeats --cores 0 --out experiments/results/repeats.jsonl

Each record's own command (config.json's meta.argv) runs again with --workdir=<root>/<record's
name>, in --checkout (which must be at the record's commit), pinned to --cores with XLA's thread
pool sized to match: the fair comparison runs on one core, so `--cores 0` repeats its setup. A
repeat whose workdir already holds eval_results.json is compared without training again; a
stopped one resumes from its checkpoint. For each record one JSON line goes to --out: the
command, the commit, the record's and this machine's type (CPU model name and fingerprint), the
first logged step whose loss differs and the largest relative difference of the loss, and every
dev evaluation of the two side by side. Two runs on one machine type match bitwise (a resumed or
repeated run reproduces its record); this measures what another type changes.
"""

import argparse
import json
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "experiments"))

import run_grid  # noqa: E402  (experiments/ on the path first)
from acl_jax import host  # noqa: E402


def repeat_command(meta: dict, workdir: pathlib.Path) -> list[str]:
  """The record's `python -m acl_jax.main` arguments, writing to `workdir` instead."""
  args = [a for a in meta["argv"][1:] if not a.startswith("--workdir")]
  return [sys.executable, "-m", "acl_jax.main", *args, f"--workdir={workdir}"]


def read_rows(workdir: pathlib.Path) -> tuple[dict[int, float], dict[int, dict]]:
  """metrics.jsonl's losses by step, and its dev evaluations (eval/* fields) by step."""
  losses, evals = {}, {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "loss" in row:
      losses[row["step"]] = row["loss"]
    scores = {k: v for k, v in row.items() if k.startswith("eval/")}
    if scores:
      evals.setdefault(row["step"], {}).update(scores)
  return losses, evals


def windows(losses: dict[int, float]) -> dict[int, tuple[int, int]]:
  """Each logged step's window: a loss row is the mean over the steps since the row before."""
  steps = sorted(losses)
  return {step: (before, step) for before, step in zip([0, *steps], steps)}


def compare(record: pathlib.Path, repeat: pathlib.Path) -> dict:
  """Where `repeat`'s logged losses and dev evaluations first differ from `record`'s. A run
  that was stopped and resumed (the record or the repeat) has a row at its stop, and the row
  after it covers fewer steps: only rows over the same window of steps are compared."""
  (record_losses, record_evals), (losses, evals) = read_rows(record), read_rows(repeat)
  last, record_last = max(losses, default=None), max(record_losses, default=None)
  if last != record_last:
    raise SystemExit(f"{repeat} logged its last loss at step {last}, {record} at {record_last}: "
                     "not the same run, or not finished")
  record_windows, repeat_windows = windows(record_losses), windows(losses)
  steps = [s for s in sorted(set(record_losses) & set(losses))
           if repeat_windows[s] == record_windows[s]]
  differing = [s for s in steps if losses[s] != record_losses[s]]
  relative = [abs(losses[s] - record_losses[s]) / max(abs(record_losses[s]), 1e-30)
              for s in steps]
  both = sorted(set(record_evals) | set(evals))
  return {
      "compared_steps": len(steps),
      "first_loss_difference_step": differing[0] if differing else None,
      "max_relative_loss_difference": max(relative, default=0.0),
      "evaluations_equal": all(record_evals.get(s) == evals.get(s) for s in both),
      "evaluations": [{"step": s, "record": record_evals.get(s), "repeat": evals.get(s)}
                      for s in both],
  }


def repeat(record: pathlib.Path, args) -> dict:
  meta = json.loads((record / "config.json").read_text())["meta"]
  commit = host.git_commit(args.checkout)
  if meta["git_commit"] != commit:
    raise SystemExit(f"{record} was recorded at {meta['git_commit']}; {args.checkout} is at "
                     f"{commit}: git worktree add --detach DIR {meta['git_commit'][:12]}")
  workdir = (args.root / record.name).resolve()
  command = repeat_command(meta, workdir)
  if not (workdir / "eval_results.json").exists():
    workdir.mkdir(parents=True, exist_ok=True)
    env = run_grid.pinned_env(len(args.cores))
    print(f"{record.name}: {' '.join(command[1:])} (cores {sorted(args.cores)})", flush=True)
    with open(workdir / "log.txt", "a") as log:
      returncode = subprocess.run(command, cwd=args.checkout, env=env, stdout=log,
                                  stderr=subprocess.STDOUT,
                                  preexec_fn=run_grid.child_setup(args.cores)).returncode
    if returncode:
      raise SystemExit(f"{record.name}: the repeat exited {returncode}; log: "
                       f"{workdir / 'log.txt'} (run again to resume it)")
  repeated = json.loads((workdir / "config.json").read_text())["meta"]
  main_metric = json.loads((record / "eval_results.json").read_text())["main_metric"]
  return {"record": str(record), "command": " ".join(["python", *command[1:]]),
          "commit": meta["git_commit"], "main_metric": f"eval/{main_metric}",
          "record_machine": meta["machine"], "record_cpu": host.recorded_cpu(meta),
          "machine": repeated["machine"], "cpu": host.recorded_cpu(repeated),
          **compare(record, workdir)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("records", nargs="+", type=pathlib.Path,
                      help="record (or run) directories: config.json and metrics.jsonl")
  parser.add_argument("--checkout", type=pathlib.Path, required=True,
                      help="a checkout at the records' commit, whose code the repeats run")
  parser.add_argument("--root", type=pathlib.Path, required=True,
                      help="where the repeats' run directories go")
  parser.add_argument("--cores", required=True, type=lambda s: {int(c) for c in s.split(",")},
                      help="cores to pin each repeat to, e.g. 0 (the fair runs' setup: one)")
  parser.add_argument("--out", type=pathlib.Path, required=True,
                      help="JSON lines file to append one line per record to")
  args = parser.parse_args(argv)
  args.checkout = args.checkout.resolve()
  for record in args.records:
    line = repeat(record, args)
    with open(args.out, "a") as out:
      out.write(json.dumps(line) + "\n")
    print(f"{record.name}: first loss difference at step {line['first_loss_difference_step']}"
          f" (largest {line['max_relative_loss_difference']:.2g} relative); dev evaluations "
          f"{'equal' if line['evaluations_equal'] else 'DIFFER'}", flush=True)


if __name__ == "__main__":
  main()
