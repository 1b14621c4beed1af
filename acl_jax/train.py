"""Fine-tuning: build the model, evaluate, and the loop (train_and_evaluate).

The step the loop runs is acl_jax.objectives.make_train_step (the method); the optimizer is
acl_jax.optim; everything written under the workdir goes through acl_jax.run_dir.
"""

import functools
import time
from typing import Any, Callable

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import tqdm

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import hf_weights
from acl_jax import host
from acl_jax import metrics as metrics_lib
from acl_jax import models
from acl_jax import objectives
from acl_jax import optim
from acl_jax import parallel
from acl_jax import preemption
from acl_jax import run_dir
from acl_jax import tracking
from acl_jax.models import multi_exit

# Per-step terms checked for NaN and inf at every log point.
CHECKED_TERMS = ("loss", "ce", "mse", "aux", "grad_norm")
# Without a terminal (batch jobs, nohup) there is no progress bar: a progress line at a log
# point at most this often instead.
PLAIN_PROGRESS_SECONDS = 30.0


def init_params(config, model, pretrained, rng) -> dict[str, Any]:
  """The model's initial params: random heads, the pretrained backbone (and per-exit poolers
  copied from the pretrained pooler)."""
  dummy = jnp.zeros((1, 8), jnp.int32)
  params = jax.jit(model.init)(rng, dummy, dummy, dummy)["params"]
  params["bert"] = jax.tree.map(jnp.asarray, pretrained)
  if config.multi_exit and config.pooler_weights == "per_exit":
    params = multi_exit.init_per_exit_poolers(params)
  return params


def main_metric_name(model, task: data.TaskSpec) -> str:
  """The metric that picks the best step: the exits' average for a multi-exit model."""
  if isinstance(model, multi_exit.MultiExitBert):
    return f"avg/{task.main_metric}"
  return task.main_metric


def make_eval_step(model, task: data.TaskSpec):
  """Predictions [B], or [E, B] with one row per exit for a multi-exit model."""
  def eval_step(params, batch):
    logits = model.apply({"params": params}, *(batch[k] for k in data.MODEL_INPUTS),
                         deterministic=True)["logits"]
    return logits[..., 0] if task.is_regression else jnp.argmax(logits, axis=-1)
  return eval_step


def evaluate(eval_step, params, encoded, task, *, batch_size, boundaries,
             exit_layers: tuple[int, ...] | None = None) -> dict[str, float]:
  """Dev metrics over every example exactly once (padded rows are masked out).

  A multi-exit model gets `exit<e>/<metric>` for every exit and `avg/<metric>`, the mean over
  exits (the multi-exit papers' summary number).
  """
  predictions, labels, mask = [], [], []
  for batch in data.eval_batches(encoded, batch_size=batch_size, boundaries=boundaries):
    inputs = {k: batch[k] for k in data.MODEL_INPUTS}
    predictions.append(eval_step(params, inputs))
    labels.append(batch["labels"])
    mask.append(batch["mask"])
  predictions = np.concatenate(jax.device_get(predictions), axis=-1)
  labels, mask = np.concatenate(labels), np.concatenate(mask)
  if predictions.ndim == 1:
    return metrics_lib.compute(task, predictions, labels, mask)
  layers = exit_layers or tuple(range(1, len(predictions) + 1))
  per_exit = [metrics_lib.compute(task, p, labels, mask) for p in predictions]
  results = {f"exit{layer}/{name}": value
             for layer, values in zip(layers, per_exit) for name, value in values.items()}
  results.update({f"avg/{name}": float(np.mean([values[name] for values in per_exit]))
                  for name in per_exit[0]})
  return results


def check_finite(window: list[dict[str, Any]], first_step: int) -> None:
  """Raises FloatingPointError naming the first step and term in `window` that is not finite."""
  for offset, values in enumerate(window):
    for name in CHECKED_TERMS:
      if name in values and not np.all(np.isfinite(values[name])):
        raise FloatingPointError(
            f"step {first_step + offset}: the {name} term is {run_dir.to_python(values[name])}; "
            "training stopped before saving this state (lower the learning rate, use float32, "
            "or check the data)")


def counting_traces(fn: Callable) -> tuple[Callable, Callable[[], int]]:
  """fn, and a function that says how often JAX has traced it: once per compiled shape, so
  the count of compilations (a persistent-cache hit still traces)."""
  count = [0]

  @functools.wraps(fn)
  def traced(*args):
    count[0] += 1
    return fn(*args)
  return traced, lambda: count[0]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Fine-tunes config.model on config.task; writes the run directory; returns eval results.

  Rerunning with the same config and workdir resumes from the last checkpoint. The console
  gets a progress bar, one line per evaluation and the results; library log lines go to
  <workdir>/run.log.
  """
  config_lib.validate(config)
  tracking.check_installed(config)
  workdir = run_dir.resolve(workdir)
  task = data.get_task(config.task)
  mesh = parallel.make_mesh(config.num_devices)
  parallel.check_batch_size(config.batch_size, mesh)
  parallel.check_batch_size(config.eval_batch_size, mesh, name="eval_batch_size")
  if config.microbatch_size:  # every micro-batch spans every device
    parallel.check_batch_size(config.microbatch_size, mesh, name="microbatch_size")
  is_main = parallel.is_main_process()
  run_dir.prepare_workdir(workdir, config, delete=is_main)
  if jax.process_count() > 1:  # nobody reads the workdir before process 0 has cleared it
    multihost_utils.sync_global_devices("prepare_workdir")
  with (run_dir.logging_to(workdir if is_main else None),
        preemption.StopRequests().installed() as stop_requests):
    return _train(config, workdir, task, mesh, is_main, stop_requests)


def summarize_window(window: list[dict[str, Any]]) -> dict[str, Any]:
  """A log line's numbers from the steps since the last one: each term's mean (per exit where
  it has one value per exit) and the last lr. With the gate's terms, also the share of steps
  whose CE and auxiliary gradients conflicted (dot < 0; `kept` is its complement only under
  gate mode drop) and the cosine's min and max, which the mean hides."""
  logged = {k: np.mean([m[k] for m in window], axis=0) for k in window[0]}
  logged["lr"] = window[-1]["lr"]
  if "dot" in window[0]:
    dot = np.stack([m["dot"] for m in window])
    cosine = np.stack([m["cosine"] for m in window])
    logged.update(conflict_rate=np.mean(dot < 0, axis=0), cosine_min=cosine.min(axis=0),
                  cosine_max=cosine.max(axis=0))
  return logged


def timed_save_due(last_save: float, minutes: float) -> bool:
  """Whether `minutes` have passed since the monotonic time `last_save` (0: never).

  Process 0's clock decides for every host: each must save at the same step.
  """
  if minutes <= 0:
    return False
  due = time.monotonic() - last_save >= 60 * minutes
  if jax.process_count() > 1:
    due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
  return due


def _train(config, workdir: epath.Path, task: data.TaskSpec, mesh, is_main: bool,
           stop_requests: preemption.StopRequests) -> dict[str, Any]:
  ckpt_dir, bert_config, tokenizer = hf_weights.load_backbone(config)
  pretrained = hf_weights.load_bert_params(ckpt_dir, bert_config,
                                           allow_pickle=config.allow_pickle)

  glue_dir = data.resolve_glue_dir(config.data.glue_dir)
  load = dict(tokenizer=tokenizer, max_length=config.max_length, glue_dir=glue_dir,
              cache_dir=config.data.cache_dir)
  train_data = data.load_encoded(task, "train", **load)
  eval_data = {split: data.load_encoded(task, split, **load) for split in task.eval_splits}
  boundaries = data.bucket_boundaries(config.max_length, tuple(config.data.buckets))

  steps_per_epoch = data.num_train_batches(train_data, batch_size=config.batch_size,
                                           boundaries=boundaries)
  total_steps = steps_per_epoch * config.num_epochs
  if config.max_steps > 0:
    total_steps = min(total_steps, config.max_steps)
  eval_every = config.eval_every or steps_per_epoch

  run_checkpoints = run_dir.RunCheckpoints(workdir)
  saved = run_checkpoints.latest_progress()  # None: a fresh run
  meta = host.run_metadata()
  meta["wandb_run_id"] = tracking.wandb_run_id(config, run_dir.read_meta(workdir))
  meta.update(checkpoint_dir=str(ckpt_dir), glue_dir=str(glue_dir) if glue_dir else "hub",
              train_examples=len(train_data.lengths), steps_per_epoch=steps_per_epoch,
              total_steps=total_steps, bucket_boundaries=list(boundaries),
              resumed_from_step=saved["step"] if saved else None,
              mesh={"devices": mesh.devices.size, "processes": jax.process_count(),
                    "shard_params": config.shard_params})
  if is_main:
    run_dir.write_json(workdir / run_dir.CONFIG_FILE, {"config": config.to_dict(), "meta": meta})
  console = tqdm.tqdm.write if is_main else (lambda line: None)
  console(f"{task.name}: {len(train_data.lengths)} train examples, {steps_per_epoch} "
          f"steps/epoch, {total_steps} steps on {mesh.devices.size} device(s) "
          f"({jax.default_backend()}); run directory {workdir}")
  if saved:
    console(f"Resuming from the checkpoint at step {saved['step']} (stage {saved['stage']}, "
            f"epoch {saved['epoch']}, batch {saved['position']})")

  model = models.from_config(config, bert_config, task.num_labels)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  params = init_params(config, model, pretrained, init_rng)
  param_sharding = parallel.state_sharding(params, mesh, shard_params=config.shard_params)
  compiled_eval = jax.jit(make_eval_step(model, task), in_shardings=(
      param_sharding, parallel.batch_sharding(mesh)), out_shardings=parallel.replicated(mesh))
  eval_step = lambda params, batch: compiled_eval(params, parallel.global_batch(batch, mesh))
  main_split = next(iter(task.eval_splits))
  main_metric = main_metric_name(model, task)
  exit_layers = model.resolved_exit_layers() if config.multi_exit else None
  stages = objectives.stages_of(config, model)

  # Where the loop stands: the next batch is batch `position` of `epoch` (each epoch's order
  # derives from (seed, epoch)); the step's dropout key derives from (seed, stage, step).
  resume = saved or {"step": 0, "stage_index": 0, "epoch": 0, "position": 0,
                     "train_seconds": 0.0, "train_examples": 0.0, "compilations": 0,
                     "history": [], "best": None}
  step, epoch, position = resume["step"], resume["epoch"], resume["position"]
  train_seconds, train_examples = resume["train_seconds"], resume["train_examples"]
  compilations, history, best = resume["compilations"], resume["history"], resume["best"]
  writer = run_dir.MetricsWriter(
      workdir / run_dir.METRICS_FILE, keep_through=step if saved else None, active=is_main,
      tracker=tracking.open_trackers(config, workdir, first_step=step + 1,
                                     wandb_run_id=meta["wandb_run_id"],
                                     exit_layers=exit_layers) if is_main else None)
  progress = tqdm.tqdm(total=total_steps * len(stages), initial=step,
                       desc=f"{task.name} train", unit="step", dynamic_ncols=True,
                       disable=None if is_main else True)
  plain_progress_at = time.perf_counter()
  saved_at = time.monotonic()
  for stage_index, stage in enumerate(stages):
    if stage_index < resume["stage_index"]:
      continue  # finished before the restart; its params are in the restored state
    tx, schedule = optim.create_optimizer(config, total_steps, frozen=stage.frozen)
    state = optim.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                             opt_state=tx.init(params))
    state_sharding = parallel.state_sharding(state, mesh, shard_params=config.shard_params)
    state = parallel.put(state, state_sharding)
    if saved and stage_index == saved["stage_index"]:
      state = run_checkpoints.restore_state(state)
    replicated = parallel.replicated(mesh)
    step_fn, traces = counting_traces(
        objectives.make_train_step(model, tx, schedule, task, config, stage))
    train_step = jax.jit(
        step_fn, in_shardings=(state_sharding, parallel.batch_sharding(mesh), replicated),
        out_shardings=(state_sharding, replicated), donate_argnums=0)
    stage_rng = parallel.put(jax.random.fold_in(dropout_rng, stage_index), replicated)
    stage_end = (stage_index + 1) * total_steps
    window, window_examples, window_start = [], 0.0, time.perf_counter()
    while step < stage_end:
      batch_epoch = epoch
      for batch in data.train_batches(train_data, batch_size=config.batch_size,
                                      boundaries=boundaries, seed=config.seed, epoch=epoch,
                                      start=position):
        valid = float(batch["mask"].sum())
        inputs = parallel.global_batch(
            {k: batch[k] for k in (*data.MODEL_INPUTS, "labels", "mask")}, mesh)
        state, step_metrics = train_step(state, inputs, stage_rng)
        step += 1
        position += 1
        window.append(step_metrics)
        window_examples += valid
        progress.update(1)

        last = step == stage_end
        if position == steps_per_epoch or last:  # the next batch opens the next epoch
          epoch, position = epoch + 1, 0
        # A stop request (SIGTERM, Ctrl-C) saves at this step; every host agrees on it.
        stop = stop_requests.reached(step)
        evaluate_now = step % eval_every == 0 or last
        log_now = step % config.log_every == 0 or evaluate_now or stop
        save_now = (evaluate_now or stop
                    or config.checkpoint_every > 0 and step % config.checkpoint_every == 0
                    or log_now and timed_save_due(saved_at, config.checkpoint_every_minutes))
        if log_now or save_now:
          window = jax.device_get(window)  # the only host sync between evaluations
          check_finite(window, step - len(window) + 1)
          elapsed = time.perf_counter() - window_start
          train_seconds += elapsed
          train_examples += window_examples
          logged = summarize_window(window)
          logged.update(epoch=batch_epoch, stage=stage.name,
                        examples_per_s=window_examples / elapsed,
                        compilations=compilations + traces())
          writer.write(step, logged)
          loss = float(logged["loss"])
          progress.set_postfix(loss=f"{loss:.4f}", ex_s=f"{logged['examples_per_s']:.0f}")
          logging.info("step %d/%d epoch %d: loss %.4f, %.1f examples/s", step,
                       progress.total, batch_epoch, loss, logged["examples_per_s"])
          if progress.disable and is_main and (
              time.perf_counter() - plain_progress_at >= PLAIN_PROGRESS_SECONDS or last):
            plain_progress_at = time.perf_counter()
            console(f"step {step}/{progress.total} epoch {batch_epoch}: loss {loss:.4f}, "
                    f"{logged['examples_per_s']:.1f} examples/s")
          window, window_examples = [], 0.0

          if evaluate_now:
            results = {split: evaluate(eval_step, state.params, encoded, task,
                                       batch_size=config.eval_batch_size,
                                       boundaries=boundaries, exit_layers=exit_layers)
                       for split, encoded in eval_data.items()}
            writer.write(step, {f"eval/{split}/{name}": value
                                for split, values in results.items()
                                for name, value in values.items()})
            history.append({"step": step, "stage": stage.name, **results})
            if best is None or results[main_split][main_metric] > best[main_split][main_metric]:
              best = history[-1]
              run_checkpoints.save_best(step, state.params, best)
            console(f"step {step}: " + ", ".join(
                f"{split} {name}={value:.4f}" for split, values in results.items()
                for name, value in values.items()))
          if save_now:
            # An object store's metrics.jsonl as far as this step, before the checkpoint that
            # a rerun resumes after (its later rows are dropped on resume, never missing).
            writer.flush()
            run_checkpoints.save(step, state, {
                "step": step, "stage_index": stage_index, "stage": stage.name, "epoch": epoch,
                "position": position, "train_seconds": train_seconds,
                "train_examples": train_examples, "compilations": compilations + traces(),
                "history": history, "best": best})
            saved_at = time.monotonic()
          window_start = time.perf_counter()
        if stop:
          progress.close()
          writer.close()
          run_checkpoints.close()  # the save is on disk before the process may go
          preempted = preemption.Preempted(
              step, str(run_checkpoints.directory / "latest" / str(step)))
          logging.warning("%s at step %d: %s", stop_requests.signal_name, step, preempted)
          console(f"{stop_requests.signal_name} at step {step}/{progress.total}: {preempted}")
          raise preempted
        if position == 0:
          break  # the epoch (or the stage) is done
    params = state.params
    compilations += traces()
  progress.close()
  writer.close()
  run_checkpoints.close()

  eval_results = {
      "task": task.name,
      "main_metric": f"{main_split}/{main_metric}",
      "final": history[-1],
      "best": best,
      "history": history,
      "train": {"steps": step, "epochs_started": epoch, "seconds": train_seconds,
                "examples": train_examples,
                "examples_per_s": train_examples / train_seconds if train_seconds else None,
                "compilations": compilations},
      "checkpoints": {"latest_step": step, "best_step": best["step"],
                      "resumed_from_step": meta["resumed_from_step"]},
  }
  if is_main:
    run_dir.write_json(workdir / run_dir.EVAL_RESULTS_FILE, eval_results)
  console(f"Done: {main_split}/{main_metric} {history[-1][main_split][main_metric]:.4f} at the "
          f"final step {step}, best {best[main_split][main_metric]:.4f} at step {best['step']}; "
          f"{workdir / run_dir.EVAL_RESULTS_FILE}")
  return eval_results
