"""Exact micro-batching's memory and time: the ACL step (single-exit, gated) on one random
batch, whole and in micro-batches, in one process.

Prints JSON lines (also appended to --out):
  "kind": "memory": XLA's buffers for one compiled step (state, batch, outputs and
    temporaries: xla_peak_mib), per (global batch, micro-batch size), compiled only;
  "kind": "step": median step times, timed interleaved (one step of each in turn);
  "kind": "ratio": peak memory of batch 128 in micro-batches of 32 / batch 32 whole
    (target <= 1.5), and step-time ratios measured side by side;
  "kind": "largest_batch": the largest global batch (doubling from --batch_size) whose
    compiled step fits --budget_gib, whole and in micro-batches of --microbatch_size.

  python experiments/benchmark_microbatch.py --out experiments/results/benchmark_microbatch.jsonl
  python experiments/benchmark_microbatch.py --quick     # tiny model, seconds
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import host
from acl_jax import objectives
from acl_jax import optim
from acl_jax.models import bert
from benchmark_step import (AUX_WEIGHT, SHAPES, TEMPERATURE, VOCAB_SIZE, bert_config,
                            make_batch, xla_memory_mib)


def compile_step(shape: str, objective: str, batch_size: int, microbatch_size: int,
                 seq_len: int):
  """(compiled train step, its jitted function, abstract state) for one configuration, traced
  from shapes only, so nothing of the batch size is allocated before it is known to fit."""
  model = bert.BertForSequenceClassification(config=bert_config(shape), num_labels=2)
  config = config_lib.get_config("rte")
  config.update(objective=objective, aux_weight=AUX_WEIGHT, temperature=TEMPERATURE,
                batch_size=batch_size, microbatch_size=microbatch_size)
  tx, schedule = optim.create_optimizer(config, total_steps=1000)
  dummy = jnp.zeros((1, 8), jnp.int32)

  def init():
    params = model.init(jax.random.key(0), dummy, dummy, dummy)["params"]
    return optim.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=tx.init(params))

  abstract_state = jax.eval_shape(init)
  batch = jax.eval_shape(lambda: jax.tree.map(
      jnp.asarray, make_batch(np.random.default_rng(0), batch_size, seq_len)))
  step = jax.jit(objectives.make_train_step(model, tx, schedule, data.get_task("rte"), config),
                 donate_argnums=0)
  compiled = step.lower(abstract_state, batch, jax.random.key(1)).compile()
  return compiled, jax.jit(init)


def memory_row(shape, objective, batch_size, microbatch_size, seq_len) -> dict:
  start = time.perf_counter()
  compiled, _ = compile_step(shape, objective, batch_size, microbatch_size, seq_len)
  return {"kind": "memory", "shape": shape, "objective": objective, "batch": batch_size,
          "microbatch_size": microbatch_size, "seq_len": seq_len,
          "compile_s": time.perf_counter() - start, **xla_memory_mib(compiled)}


def largest_batch(shape, objective, microbatch_size, seq_len, start: int, budget_mib: float,
                  limit: int, emit) -> dict:
  """Doubles the global batch from `start` until the compiled step needs more than the budget
  (or `limit` is reached); every probe is emitted as a memory row."""
  fits, batch_size, probes = None, start, []
  while batch_size <= limit:
    row = memory_row(shape, objective, batch_size, microbatch_size if microbatch_size
                     and microbatch_size < batch_size else 0, seq_len)
    emit(row)
    probes.append({"batch": batch_size, "xla_peak_mib": row["xla_peak_mib"]})
    if row["xla_peak_mib"] > budget_mib:
      break
    fits, batch_size = batch_size, 2 * batch_size
  return {"kind": "largest_batch", "shape": shape, "objective": objective,
          "microbatch_size": microbatch_size, "seq_len": seq_len, "budget_mib": budget_mib,
          "largest_fitting_batch": fits, "first_over_budget": (
              batch_size if probes and probes[-1]["xla_peak_mib"] > budget_mib else None),
          "limit_reached": batch_size > limit, "probes": probes}


def timed_steps(shape, objective, configs, seq_len, steps, warmup):
  """Median step time per (batch, micro-batch size), one step of each in turn."""
  runs = []
  for batch_size, microbatch_size in configs:
    compiled, init = compile_step(shape, objective, batch_size, microbatch_size, seq_len)
    batch = jax.device_put(make_batch(np.random.default_rng(0), batch_size, seq_len))
    live = {"state": init()}

    def step(compiled=compiled, batch=batch, live=live):
      live["state"], _ = compiled(live["state"], batch, jax.random.key(1))
      jax.block_until_ready(live["state"])

    for _ in range(1 + warmup):
      step()
    runs.append((batch_size, microbatch_size, step, []))
  for _ in range(steps):
    for _, _, step, times in runs:
      start = time.perf_counter()
      step()
      times.append(time.perf_counter() - start)
  return [{"kind": "step", "shape": shape, "objective": objective, "batch": b,
           "microbatch_size": m, "seq_len": seq_len, "interleaved": True,
           "median_step_s": statistics.median(t), "step_times_s": t,
           "examples_per_s": b / statistics.median(t)} for b, m, _, t in runs]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", default="minilm", choices=list(SHAPES))
  p.add_argument("--objective", default="acl")
  p.add_argument("--batch_size", type=int, default=32, help="the micro-batch's own batch")
  p.add_argument("--global_batch", type=int, default=128)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--budget_gib", type=float, default=24.0)
  p.add_argument("--search_limit", type=int, default=65536,
                 help="largest global batch the search tries")
  p.add_argument("--quick", action="store_true", help="tiny model, batch 8 of 4, seq 32")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.quick:
    args.shape, args.batch_size, args.global_batch, args.seq_len = "tiny", 4, 8, 32
    args.steps, args.warmup, args.budget_gib, args.search_limit = 2, 0, 0.06, 64
  meta = host.run_metadata()
  common = {"host_cpu": host.cpu_model(), "cpus_usable": host.cpus_usable(),
            "git_commit": meta["git_commit"], "jax": meta["versions"]["jax"],
            "vocab_size": VOCAB_SIZE, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
  out = open(args.out, "a") if args.out else None
  rows = []

  def emit(row):
    row = {**row, **common}
    rows.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    if out:
      out.write(line + "\n")
      out.flush()

  small, big, micro = args.batch_size, args.global_batch, args.batch_size
  memory = {(b, m): memory_row(args.shape, args.objective, b, m, args.seq_len)
            for b, m in ((small, 0), (big, micro), (big, 0))}
  for row in memory.values():
    emit(row)
  steps = timed_steps(args.shape, args.objective, [(small, 0), (big, micro), (big, 0)],
                      args.seq_len, args.steps, args.warmup)
  for row in steps:
    emit(row)
  time_of = {(r["batch"], r["microbatch_size"]): r["median_step_s"] for r in steps}
  for name, value, target in (
      (f"peak memory: batch {big} in micro-batches of {micro} / batch {small}",
       memory[big, micro]["xla_peak_mib"] / memory[small, 0]["xla_peak_mib"], 1.5),
      (f"peak memory: batch {big} whole / batch {small}",
       memory[big, 0]["xla_peak_mib"] / memory[small, 0]["xla_peak_mib"], None),
      (f"step time: batch {big} in micro-batches of {micro} / batch {big} whole",
       time_of[big, micro] / time_of[big, 0], None),
      (f"step time: batch {big} in micro-batches of {micro} / {big // small} steps of "
       f"batch {small}", time_of[big, micro] / (big // small * time_of[small, 0]), None)):
    emit({"kind": "ratio", "shape": args.shape, "objective": args.objective, "name": name,
          "ratio": value, "target": None if target is None else f"<= {target}",
          "meets_target": None if target is None else value <= target,
          "seq_len": args.seq_len})
  budget_mib = args.budget_gib * 1024
  for microbatch_size in (0, micro):
    emit(largest_batch(args.shape, args.objective, microbatch_size, args.seq_len, small,
                       budget_mib, args.search_limit, emit))
  if out:
    out.close()
  return rows


if __name__ == "__main__":
  main()
