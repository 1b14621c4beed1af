"""Fine-tuning: the train state, the compiled train step, evaluation, train_and_evaluate."""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Callable

from absl import logging
import flax
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import optax
import tqdm

from acl_jax import checkpointing
from acl_jax import checkpoints
from acl_jax import data
from acl_jax import gradients
from acl_jax import losses
from acl_jax import metrics as metrics_lib
from acl_jax import parallel
from acl_jax.models import bert
from acl_jax.models import multi_exit

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRECISIONS = {"default": None, "high": jax.lax.Precision.HIGH,
              "highest": jax.lax.Precision.HIGHEST}
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def decay_mask(params) -> Any:
  """True where AdamW applies weight decay: not on biases and not on LayerNorm parameters."""
  def decays(path, _):
    names = _path_names(path)
    return names[-1] != "bias" and "LayerNorm" not in names
  return jax.tree_util.tree_map_with_path(decays, params)


def create_optimizer(config, total_steps: int, *, frozen: Callable | None = None
                     ) -> tuple[optax.GradientTransformation, Callable]:
  """AdamW with linear warm-up then linear decay to 0, after global-norm clipping.

  frozen(path) -> bool marks parameters the optimizer must leave untouched (DeeBERT's second
  stage): an optax partition sends them to set_to_zero, so neither their update nor their
  weight decay nor their share of the clipping norm exists.
  """
  warmup = int(math.ceil(config.warmup_ratio * total_steps))
  schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, config.learning_rate, warmup),
       optax.linear_schedule(config.learning_rate, 0.0, max(total_steps - warmup, 1))],
      [warmup])
  tx = optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                  weight_decay=config.weight_decay, mask=decay_mask))
  if frozen is not None:
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if frozen(_path_names(path)) else "trained", params)
    tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule


def _path_names(path) -> tuple[str, ...]:
  return tuple(getattr(k, "key", str(k)) for k in path)


@dataclasses.dataclass(frozen=True)
class Objective:
  """What a training objective adds to the task loss, and how its gradient is gated.

  aux: the auxiliary loss (None: the task loss alone); gate: gradients.combine mode;
  ce_weight: "1-lambda" for the SCL baseline's convex mix (1-l) CE + l SCL, else CE + l aux;
  multi_exit_only: needs exits to distil or contrast between.
  """
  aux: str | None = None
  gate: str = "none"
  ce_weight: str = "1"
  multi_exit_only: bool = False


OBJECTIVES = {
    "ce": Objective(),
    "scl": Objective(aux="scl", ce_weight="1-lambda"),   # Gunel et al.'s CE+SCL baseline
    "acl_embed": Objective(aux="acl_embed"),               # ACL-Embed without gating
    "acl": Objective(aux="acl_embed", gate="drop"),        # ACL-BERT: ACL-Embed + ACL-Grad
    "acl_project": Objective(aux="acl_embed", gate="project"),  # PCGrad-style ablation
    # Multi-exit: self-distillation from the last exit (baseline); ACL-Embed + ACL-CL, gated;
    # DeeBERT's two stages (final exit, then the other exits on a frozen backbone).
    "kd": Objective(aux="kd", multi_exit_only=True),
    "acl_cl": Objective(aux="acl_cl", gate="drop", multi_exit_only=True),
    "deebert": Objective(multi_exit_only=True),
}
GATE_GRANULARITIES = ("per_exit", "global")
TEACHERS = ("last", "deeper")


def task_loss(task: data.TaskSpec, logits, labels, mask) -> jax.Array:
  if task.is_regression:
    return losses.mse(logits[:, 0], labels, mask=mask)
  return losses.cross_entropy(logits, labels, mask=mask)


def exit_outputs(model, out, params) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logits [E, B, K], pooled [E, B, H], label embeddings [E, K, H]) for either model.

  A single-exit classifier is the one-exit case, so every objective has one implementation.
  """
  if isinstance(model, multi_exit.MultiExitBert):
    return (out["logits"], out["pooled"],
            multi_exit.label_embeddings(params, model.resolved_exit_layers()))
  return out["logits"][None], out["pooled"][None], params["classifier"]["kernel"].T[None]


def num_exits(model) -> int:
  if isinstance(model, multi_exit.MultiExitBert):
    return len(model.resolved_exit_layers())
  return 1


def make_train_step(model, tx, schedule, task: data.TaskSpec, *, objective: str = "ce",
                    aux_weight: float = 0.5, temperature: float = 0.3, anchors: str = "all",
                    measure_conflict: bool = False, exit_weights=None,
                    gate_granularity: str = "per_exit", cl_weight: float = 0.5,
                    teacher: str = "last", kd_temperature: float = 2.0, gate_chunk: int = 1,
                    frozen: Callable[[tuple[str, ...]], bool] | None = None):
  """Returns the pure step (state, batch, rng) -> (state, metrics), to be jitted once.

  The loss is a vector: for every exit e, w_e * CE_e and w_e * aux_e (aux_e already carries
  lambda, and mu for ACL-CL). With a gate (or measure_conflict, for the pilot experiment) the
  step takes one forward pass and one jax.vjp of that vector and pulls unit cotangents back
  through the single vjp, so every gradient sees the same dropout masks:
    - one exit, or gate_granularity="global": 2 cotangents (all CE rows, all aux rows), one
      gate decision;
    - "per_exit": exit by exit, gate_chunk exits (2 * gate_chunk gradient pytrees) at a time
      inside a lax.scan that accumulates the gated sum, so memory stays bounded however many
      exits there are.
  Without a gate the summed loss has one ordinary backward pass.
  exit_weights: [E] weights (multi_exit.exit_weights); None = 1 for the single exit.
  frozen: the parameters `tx` leaves untouched (create_optimizer's partition); the logged
  grad_norm covers the others only, the norm that clipping sees, so nothing reads the frozen
  parameters' gradients and XLA drops their backward pass (DeeBERT's second stage then costs
  a forward pass and the exit heads' backward, not a full backward through the backbone).
  """
  spec = OBJECTIVES[objective]
  two_gradients = spec.aux is not None and (spec.gate != "none" or measure_conflict)
  ce_weight = 1.0 - aux_weight if spec.ce_weight == "1-lambda" else 1.0
  main_name = "mse" if task.is_regression else "ce"
  n_exits = num_exits(model)
  weights = jnp.asarray(np.ones(1) if exit_weights is None else exit_weights, jnp.float32)
  if weights.shape != (n_exits,):
    raise ValueError(f"exit_weights has shape {weights.shape}; the model has {n_exits} exits")
  shallow = jnp.arange(n_exits) < n_exits - 1  # exits that have a deeper teacher

  def auxiliary(logits, pooled, label_emb, batch) -> jax.Array:
    """[E] auxiliary terms, weights lambda (and mu) included."""
    labels, mask = batch["labels"], batch["mask"]
    if spec.aux == "scl":
      return aux_weight * jax.vmap(
          lambda h: losses.scl(h, labels, temperature=temperature, mask=mask))(pooled)
    if spec.aux == "kd":
      distil = jax.vmap(lambda z: losses.kd(z, logits[-1], temperature=kd_temperature,
                                            mask=mask))(logits)
      return aux_weight * jnp.where(shallow, distil, 0.0)
    embed = jax.vmap(lambda h, l: losses.acl_embed(
        h, labels, l, temperature=temperature, mask=mask, anchors=anchors))(pooled, label_emb)
    if spec.aux == "acl_embed":
      return aux_weight * embed
    # ACL-CL: student e against teacher t; [E, E] pairs, kept where t is e's teacher.
    pair = lambda hs, ls, ht, lt: losses.acl_cl(hs, ls, ht, lt, labels,
                                                temperature=temperature, mask=mask)
    if teacher == "last":
      contrast = jax.vmap(pair, in_axes=(0, 0, None, None))(pooled, label_emb, pooled[-1],
                                                            label_emb[-1])
    else:
      grid = jax.vmap(jax.vmap(pair, in_axes=(None, None, 0, 0)),
                      in_axes=(0, 0, None, None))(pooled, label_emb, pooled, label_emb)
      deeper = jnp.triu(jnp.ones((n_exits, n_exits), bool), k=1)
      contrast = (jnp.where(deeper, grid, 0.0).sum(1)
                  / jnp.maximum(deeper.sum(1), 1).astype(jnp.float32))
    return aux_weight * embed + cl_weight * jnp.where(shallow, contrast, 0.0)

  def loss_vector(params, batch, dropout_rng):
    out = model.apply({"params": params}, *(batch[k] for k in MODEL_INPUTS),
                      deterministic=False, rngs={"dropout": dropout_rng})
    logits, pooled, label_emb = exit_outputs(model, out, params)
    main = jax.vmap(lambda z: task_loss(task, z, batch["labels"], batch["mask"]))(logits)
    terms = {main_name: main}
    if spec.aux is None:
      return weights * ce_weight * main, terms
    aux = auxiliary(logits, pooled, label_emb, batch)
    terms["aux"] = aux
    return jnp.concatenate([weights * ce_weight * main, weights * aux]), terms

  def gated_grads(loss_vec, pull_back, params):
    """The gated gradient and per-decision info (dot, cosine, kept), from one vjp."""
    if n_exits == 1 or gate_granularity == "global":
      rows = jnp.repeat(jnp.eye(2, dtype=loss_vec.dtype), n_exits, axis=1)
      (stacked,) = jax.vmap(pull_back)(rows)  # a batched backward pass for both cotangents
      g_main, g_aux = (jax.tree.map(lambda g, i=i: g[i], stacked) for i in range(2))
      return gradients.combine(g_main, g_aux, mode=spec.gate)
    chunks = -(-n_exits // gate_chunk)
    # Exit e's cotangents are rows e (CE) and E + e (aux) of the identity; padding exits get
    # zero rows, whose zero gradients add nothing.
    eye = jnp.eye(2 * n_exits, dtype=loss_vec.dtype)
    pad = jnp.zeros((chunks * gate_chunk - n_exits, 2 * n_exits), loss_vec.dtype)
    main_rows = jnp.concatenate([eye[:n_exits], pad]).reshape(chunks, gate_chunk, -1)
    aux_rows = jnp.concatenate([eye[n_exits:], pad]).reshape(chunks, gate_chunk, -1)

    def chunk(total, rows):
      (stacked,) = jax.vmap(pull_back)(jnp.concatenate(rows))
      pick = lambda i: jax.tree.map(lambda g: g[i], stacked)
      gated, infos = zip(*(gradients.combine(pick(i), pick(gate_chunk + i), mode=spec.gate)
                           for i in range(gate_chunk)))
      total = jax.tree.map(lambda t, *g: t + sum(g), total, *gated)
      return total, jax.tree.map(lambda *v: jnp.stack(v), *infos)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, info = jax.lax.scan(chunk, zeros, (main_rows, aux_rows))
    return grads, jax.tree.map(lambda v: v.reshape(-1)[:n_exits], info)

  def train_step(state: TrainState, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state.step)
    if two_gradients:
      loss_vec, pull_back, terms = jax.vjp(
          lambda p: loss_vector(p, batch, dropout_rng), state.params, has_aux=True)
      grads, gate = gated_grads(loss_vec, pull_back, state.params)
      kept = gate["kept"] if spec.gate == "drop" else 1.0
      loss = loss_vec[:n_exits].sum() + (kept * loss_vec[n_exits:]).sum()
      terms.update(gate)
    else:
      (loss, terms), grads = jax.value_and_grad(
          lambda p: (lambda v, t: (v.sum(), t))(*loss_vector(p, batch, dropout_rng)),
          has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if n_exits == 1:  # one exit logs scalars, as a single-exit model should
      terms = jax.tree.map(lambda v: v.reshape(()) if v.size == 1 else v, terms)
    trained = [g for path, g in jax.tree_util.tree_leaves_with_path(grads)
               if frozen is None or not frozen(_path_names(path))]
    step_metrics = {"loss": loss, **terms, "grad_norm": optax.tree.norm(trained),
                    "lr": schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), step_metrics

  return train_step


def build_model(config, bert_config: bert.BertConfig, task: data.TaskSpec):
  common = dict(config=bert_config, num_labels=task.num_labels, dtype=DTYPES[config.dtype],
                precision=PRECISIONS[config.matmul_precision])
  if config.multi_exit:
    return multi_exit.MultiExitBert(exit_layers=tuple(config.exit_layers) or None,
                                    pooler=config.pooler, exit_pooling=config.exit_pooling,
                                    **common)
  return bert.BertForSequenceClassification(**common)


@dataclasses.dataclass(frozen=True)
class Stage:
  """One optimization phase: its objective, exit weights, and what it keeps frozen."""
  name: str
  objective: str
  exit_weights: np.ndarray | None
  frozen: Callable[[tuple[str, ...]], bool] | None = None


def stages_of(config, model) -> list[Stage]:
  """One stage, except DeeBERT: the final exit with the whole model, then every other exit
  with the backbone and the final exit frozen (as many steps again)."""
  if not config.multi_exit:
    return [Stage("train", config.objective, None)]
  layers = model.resolved_exit_layers()
  if config.objective != "deebert":
    return [Stage("train", config.objective,
                  multi_exit.exit_weights(config.exit_weights, layers))]
  final = np.zeros(len(layers), np.float32)
  final[-1] = 1.0
  others = multi_exit.exit_weights(config.exit_weights, layers[:-1])
  frozen_roots = ("bert", f"exit_{layers[-1]}")
  return [Stage("final_exit", "ce", final),
          Stage("other_exits", "ce", np.append(others, 0.0).astype(np.float32),
                frozen=lambda names: names[0] in frozen_roots)]


def main_metric_name(model, task: data.TaskSpec) -> str:
  """The metric that picks the best step: the exits' average for a multi-exit model."""
  if isinstance(model, multi_exit.MultiExitBert):
    return f"avg/{task.main_metric}"
  return task.main_metric


def make_eval_step(model, task: data.TaskSpec):
  """Predictions [B], or [E, B] with one row per exit for a multi-exit model."""
  def eval_step(params, batch):
    logits = model.apply({"params": params}, *(batch[k] for k in MODEL_INPUTS),
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
    inputs = {k: batch[k] for k in MODEL_INPUTS}
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


def _git_commit() -> str | None:
  repo = pathlib.Path(__file__).resolve().parents[1]
  try:
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return commit + ("-dirty" if dirty else "")


def _machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"{cpu}, {os.cpu_count()} cores"


def enable_compilation_cache(setting: str = "auto") -> str | None:
  """Turns on JAX's persistent compilation cache; returns its directory (None: off).

  With it, the seeds of a grid, a resumed run and an early-exit sweep load the programs an
  earlier process compiled instead of compiling them again (on a 2-core CPU each train step
  shape takes about two minutes to compile). setting: a directory; "none" (off); or "auto":
  $JAX_COMPILATION_CACHE_DIR if set, else <cache_root>/xla/<CPU fingerprint>. XLA:CPU entries
  are native code for the CPU that compiled them and JAX's cache key does not name the CPU, so
  the automatic directory is per CPU model and feature set: a home directory shared by
  different machines never hands one of them another's code. Call before the first compile.
  """
  if setting == "none":
    return None
  if setting == "auto":
    setting = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if not setting:
    flags = ""
    try:
      with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
      pass
    fingerprint = hashlib.sha256(f"{_machine()}|{platform.machine()}|{flags}".encode())
    setting = str(data.cache_root() / "xla" / fingerprint.hexdigest()[:16])
  jax.config.update("jax_compilation_cache_dir", setting)
  return setting


def run_metadata() -> dict[str, Any]:
  import importlib.metadata as md
  versions = {}
  for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "datasets",
              "numpy", "acl_jax"):
    try:
      versions[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      versions[pkg] = None
  return {
      "argv": sys.argv,
      "git_commit": _git_commit(),
      "python": platform.python_version(),
      "host": platform.node(),
      "machine": _machine(),
      "versions": versions,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }


def validate_config(config) -> None:
  """Fails fast, before any loading, on values that would otherwise fail deep inside."""
  if config.objective not in OBJECTIVES:
    raise ValueError(f"config.objective={config.objective!r}; valid: {', '.join(OBJECTIVES)}.")
  if OBJECTIVES[config.objective].multi_exit_only and not config.multi_exit:
    raise ValueError(f"config.objective={config.objective!r} needs a multi-exit model: add the "
                     f"`multi_exit` preset (configs/glue.py:<task>,multi_exit,objective=...).")
  if config.gate not in GATE_GRANULARITIES:
    raise ValueError(f"config.gate={config.gate!r}; valid: {', '.join(GATE_GRANULARITIES)}.")
  if config.teacher not in TEACHERS:
    raise ValueError(f"config.teacher={config.teacher!r}; valid: {', '.join(TEACHERS)}.")
  if config.exit_weights not in multi_exit.EXIT_WEIGHTS:
    raise ValueError(f"config.exit_weights={config.exit_weights!r}; valid: "
                     f"{', '.join(multi_exit.EXIT_WEIGHTS)}.")
  if config.pooler not in multi_exit.POOLERS:
    raise ValueError(f"config.pooler={config.pooler!r}; valid: {', '.join(multi_exit.POOLERS)}.")
  if config.exit_pooling not in multi_exit.EXIT_POOLINGS:
    raise ValueError(f"config.exit_pooling={config.exit_pooling!r}; valid: "
                     f"{', '.join(multi_exit.EXIT_POOLINGS)}.")
  if config.exit_pooling != "cls" and not config.multi_exit:
    raise ValueError(f"config.exit_pooling={config.exit_pooling!r} sets what multi-exit exits "
                     "pool; a single-exit model pools [CLS] as BertForSequenceClassification "
                     "does: add the `multi_exit` preset or drop exit_pooling.")
  if config.gate_chunk < 1:
    raise ValueError(f"config.gate_chunk={config.gate_chunk} must be >= 1 (exits per chunk).")
  if OBJECTIVES[config.objective].aux and data.get_task(config.task).is_regression:
    raise ValueError(f"config.objective={config.objective!r} is contrastive and needs class "
                     f"labels; {config.task} is a regression task: use objective=ce (MSE).")
  if config.temperature <= 0:
    raise ValueError(f"config.temperature={config.temperature} must be positive.")
  if config.anchors not in ("all", "samples"):
    raise ValueError(f"config.anchors={config.anchors!r}; valid: all, samples.")
  if config.dtype not in DTYPES:
    raise ValueError(f"config.dtype={config.dtype!r}; valid: {', '.join(DTYPES)}.")
  if config.matmul_precision not in PRECISIONS:
    raise ValueError(f"config.matmul_precision={config.matmul_precision!r}; "
                     f"valid: {', '.join(PRECISIONS)}.")
  for key in ("batch_size", "eval_batch_size", "num_epochs"):
    if config[key] <= 0:
      raise ValueError(f"config.{key}={config[key]} must be positive.")


def load_backbone_config(config) -> tuple[pathlib.Path, bert.BertConfig, Any]:
  """The checkpoint directory of config.model, its architecture (with config.dropout), and
  its tokenizer."""
  ckpt_dir = checkpoints.resolve(config.model, allow_pickle=config.allow_pickle)
  bert_config = checkpoints.load_config(ckpt_dir)
  if config.max_length > bert_config.max_position_embeddings:
    raise ValueError(f"config.max_length={config.max_length} exceeds the position table of "
                     f"{ckpt_dir} (max_position_embeddings={bert_config.max_position_embeddings}).")
  bert_config = dataclasses.replace(bert_config, hidden_dropout_prob=config.dropout,
                                    attention_probs_dropout_prob=config.dropout)
  return ckpt_dir, bert_config, checkpoints.load_tokenizer(ckpt_dir)


# Config fields added after runs were recorded, with the value those runs had: a config.json
# without one reads as holding it, so older runs still resume and reload.
ADDED_FIELDS = {"exit_pooling": "cls"}


@dataclasses.dataclass
class TrainedRun:
  """A run directory's model and trained parameters, rebuilt from config.json and
  checkpoints/ (for early exit and export)."""
  workdir: pathlib.Path
  config: ml_collections.ConfigDict
  task: data.TaskSpec
  model: Any
  params: Any
  step: int
  ckpt_dir: pathlib.Path
  tokenizer: Any
  boundaries: tuple[int, ...]

  def load_split(self, split: str) -> data.Encoded:
    return data.load_encoded(self.task, split, tokenizer=self.tokenizer,
                             max_length=self.config.max_length,
                             glue_dir=data.resolve_glue_dir(self.config.data.glue_dir),
                             cache_dir=self.config.data.cache_dir)


def load_trained_run(workdir, *, which: str = "latest") -> TrainedRun:
  """Rebuilds a trained run: its config, model and `which` params (latest | best)."""
  workdir = pathlib.Path(workdir).expanduser().resolve()
  path = workdir / "config.json"
  try:
    config = ml_collections.ConfigDict({**ADDED_FIELDS,
                                        **json.loads(path.read_text())["config"]})
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} not found: {workdir} is not a run directory (train "
                            "into it first with --mode=train)") from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path}: unreadable run directory ({type(e).__name__}: {e})") from e
  task = data.get_task(config.task)
  ckpt_dir, bert_config, tokenizer = load_backbone_config(config)
  model = build_model(config, bert_config, task)
  dummy = jnp.zeros((1, 8), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), dummy, dummy, dummy)["params"]
  params, step = checkpointing.load_params(workdir, abstract, which=which)
  boundaries = data.bucket_boundaries(config.max_length, tuple(config.data.buckets))
  return TrainedRun(workdir, config, task, model, params, step, ckpt_dir, tokenizer, boundaries)


class MetricsWriter:
  """Writes one JSON object per line to <workdir>/metrics.jsonl.

  A fresh run starts the file anew; a resumed run keeps the lines up to its checkpoint's step
  (later ones came from the interrupted process and will be logged again) and appends.
  """

  def __init__(self, path: pathlib.Path, *, keep_through: int | None = None,
               active: bool = True):
    self._file = None  # processes other than 0 write nothing
    if not active:
      return
    if keep_through is not None and path.exists():
      kept = [line for line in path.read_text().splitlines()
              if line.strip() and json.loads(line)["step"] <= keep_through]
      path.write_text("".join(line + "\n" for line in kept))
      self._file = open(path, "a")
    else:
      self._file = open(path, "w")

  def write(self, step: int, values: dict[str, Any]) -> None:
    if self._file is None:
      return
    row = {"step": int(step), **{k: _to_python(v) for k, v in values.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


def _to_python(value):
  value = np.asarray(value)
  return value.item() if value.ndim == 0 else value.tolist()


# Written by the run, not by the user: removed when a workdir is overwritten.
RUN_OUTPUTS = ("config.json", "metrics.jsonl", "eval_results.json", "early_exit.json",
               checkpointing.CHECKPOINT_DIR)
# Config fields that may differ between a run and its resumption.
# A run may resume on another number of devices (bitwise equality then no longer holds).
RESUMABLE_CHANGES = ("overwrite", "num_devices", "shard_params")


def prepare_workdir(workdir: pathlib.Path, config, *, delete: bool = True) -> None:
  """Refuses a workdir that holds a run with another config, unless config.overwrite.

  The same config resumes (or, with no checkpoint yet, starts over); config.overwrite deletes
  the earlier run's outputs first (only where `delete`: one process of a multi-host job).
  """
  if workdir.exists() and not workdir.is_dir():
    raise NotADirectoryError(f"--workdir={workdir} exists and is not a directory")
  workdir.mkdir(parents=True, exist_ok=True)
  if config.overwrite:
    for name in RUN_OUTPUTS if delete else ():
      path = workdir / name
      if path.is_dir():
        shutil.rmtree(path)
      elif path.exists():
        path.unlink()
    return
  path = workdir / "config.json"
  if not path.exists():
    if (workdir / checkpointing.CHECKPOINT_DIR).exists():
      raise ValueError(f"{workdir} holds checkpoints but no config.json, so it cannot tell "
                       "whether they belong to this config; add `overwrite` to the config "
                       "string (or --config.overwrite=True) to start over")
    return
  try:
    saved = {**ADDED_FIELDS, **json.loads(path.read_text())["config"]}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path}: unreadable run directory ({type(e).__name__}: {e}); add "
                     "`overwrite` to the config string (or --config.overwrite=True) to start "
                     "over in it") from e
  current = _json_config(config)
  differ = sorted(key for key in set(_flatten(saved)) | set(_flatten(current))
                  if key not in RESUMABLE_CHANGES
                  and _flatten(saved).get(key) != _flatten(current).get(key))
  if differ:
    changes = "; ".join(f"{key}: {_flatten(saved).get(key)!r} -> {_flatten(current).get(key)!r}"
                        for key in differ)
    raise ValueError(f"{workdir} holds a run with another config ({changes}). Use another "
                     "--workdir, or add `overwrite` to the config string (or "
                     "--config.overwrite=True) to delete that run and start over")


def _json_config(config) -> dict[str, Any]:
  return json.loads(json.dumps(config.to_dict(), default=str))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


# Per-step terms checked for NaN and inf at every log point.
CHECKED_TERMS = ("loss", "ce", "mse", "aux", "grad_norm")


def check_finite(window: list[dict[str, Any]], first_step: int) -> None:
  """Raises FloatingPointError naming the first step and term in `window` that is not finite."""
  for offset, values in enumerate(window):
    for name in CHECKED_TERMS:
      if name in values and not np.all(np.isfinite(values[name])):
        raise FloatingPointError(
            f"step {first_step + offset}: the {name} term is {_to_python(values[name])}; "
            "training stopped before saving this state (lower the learning rate, use float32, "
            "or check the data)")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Fine-tunes config.model on config.task; writes the run directory; returns eval results.

  Rerunning with the same config and workdir resumes from the last checkpoint.
  """
  workdir = pathlib.Path(workdir).expanduser().resolve()
  task = data.get_task(config.task)
  validate_config(config)
  mesh = parallel.make_mesh(config.num_devices)
  parallel.check_batch_size(config.batch_size, mesh)
  parallel.check_batch_size(config.eval_batch_size, mesh, name="eval_batch_size")
  is_main = parallel.is_main_process()
  prepare_workdir(workdir, config, delete=is_main)
  if jax.process_count() > 1:  # nobody reads the workdir before process 0 has cleared it
    multihost_utils.sync_global_devices("prepare_workdir")

  ckpt_dir, bert_config, tokenizer = load_backbone_config(config)
  pretrained = checkpoints.load_bert_params(ckpt_dir, bert_config,
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

  run_checkpoints = checkpointing.RunCheckpoints(workdir)
  saved = run_checkpoints.latest_progress()  # None: a fresh run
  meta = run_metadata()
  meta.update(checkpoint_dir=str(ckpt_dir), glue_dir=str(glue_dir) if glue_dir else "hub",
              train_examples=len(train_data.lengths), steps_per_epoch=steps_per_epoch,
              total_steps=total_steps, bucket_boundaries=list(boundaries),
              resumed_from_step=saved["step"] if saved else None,
              mesh={"devices": mesh.devices.size, "processes": jax.process_count(),
                    "shard_params": config.shard_params})
  if is_main:
    (workdir / "config.json").write_text(
        json.dumps({"config": config.to_dict(), "meta": meta}, indent=2, default=str) + "\n")
  logging.info("Task %s: %d train examples, %d steps/epoch, %d steps; %d-device mesh of %s",
               task.name, len(train_data.lengths), steps_per_epoch, total_steps,
               mesh.devices.size, meta["devices"])
  if saved:
    logging.info("Resuming from the checkpoint at step %d (stage %s, epoch %d, batch %d)",
                 saved["step"], saved["stage"], saved["epoch"], saved["position"])

  model = build_model(config, bert_config, task)
  init_rng, dropout_rng = jax.random.split(jax.random.key(config.seed))
  dummy = jnp.zeros((1, 8), jnp.int32)
  params = jax.jit(model.init)(init_rng, dummy, dummy, dummy)["params"]
  params["bert"] = jax.tree.map(jnp.asarray, pretrained)
  if config.multi_exit and config.pooler == "per_exit":
    params = multi_exit.init_per_exit_poolers(params)
  param_sharding = parallel.state_sharding(params, mesh, shard_params=config.shard_params)
  compiled_eval = jax.jit(make_eval_step(model, task), in_shardings=(
      param_sharding, parallel.batch_sharding(mesh)), out_shardings=parallel.replicated(mesh))
  eval_step = lambda params, batch: compiled_eval(params, parallel.global_batch(batch, mesh))
  main_split = next(iter(task.eval_splits))
  main_metric = main_metric_name(model, task)
  exit_layers = model.resolved_exit_layers() if config.multi_exit else None
  stages = stages_of(config, model)

  # Where the loop stands: the next batch is batch `position` of `epoch` (each epoch's order
  # derives from (seed, epoch)); the step's dropout key derives from (seed, stage, step).
  resume = saved or {"step": 0, "stage_index": 0, "epoch": 0, "position": 0,
                     "train_seconds": 0.0, "train_examples": 0.0, "compilations": 0,
                     "history": [], "best": None}
  step, epoch, position = resume["step"], resume["epoch"], resume["position"]
  train_seconds, train_examples = resume["train_seconds"], resume["train_examples"]
  compilations, history, best = resume["compilations"], resume["history"], resume["best"]
  writer = MetricsWriter(workdir / "metrics.jsonl", keep_through=step if saved else None,
                         active=is_main)
  progress = tqdm.tqdm(total=total_steps * len(stages), initial=step,
                       desc=f"{task.name} train", unit="step", dynamic_ncols=True,
                       disable=None if is_main else True)
  for stage_index, stage in enumerate(stages):
    if stage_index < resume["stage_index"]:
      continue  # finished before the restart; its params are in the restored state
    tx, schedule = create_optimizer(config, total_steps, frozen=stage.frozen)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    state_sharding = parallel.state_sharding(state, mesh, shard_params=config.shard_params)
    state = parallel.put(state, state_sharding)
    if saved and stage_index == saved["stage_index"]:
      state = run_checkpoints.restore_state(state)
    replicated = parallel.replicated(mesh)
    train_step = jax.jit(make_train_step(
        model, tx, schedule, task, objective=stage.objective, aux_weight=config["lambda"],
        temperature=config.temperature, anchors=config.anchors,
        measure_conflict=config.measure_conflict, exit_weights=stage.exit_weights,
        gate_granularity=config.gate, cl_weight=config.cl_weight, teacher=config.teacher,
        kd_temperature=config.kd_temperature, gate_chunk=config.gate_chunk,
        frozen=stage.frozen),
        in_shardings=(state_sharding, parallel.batch_sharding(mesh), replicated),
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
        inputs = parallel.global_batch({k: batch[k] for k in (*MODEL_INPUTS, "labels", "mask")},
                                       mesh)
        state, step_metrics = train_step(state, inputs, stage_rng)
        step += 1
        position += 1
        window.append(step_metrics)
        window_examples += valid
        progress.update(1)

        last = step == stage_end
        if position == steps_per_epoch or last:  # the next batch opens the next epoch
          epoch, position = epoch + 1, 0
        evaluate_now = step % eval_every == 0 or last
        save_now = (config.checkpoint_every > 0 and step % config.checkpoint_every == 0
                    or evaluate_now)
        if step % config.log_every == 0 or evaluate_now or save_now:
          window = jax.device_get(window)  # the only host sync between evaluations
          check_finite(window, step - len(window) + 1)
          elapsed = time.perf_counter() - window_start
          train_seconds += elapsed
          train_examples += window_examples
          # Means over the window, per exit where a term has one value per exit.
          logged = {k: np.mean([m[k] for m in window], axis=0) for k in window[0]}
          logged["lr"] = window[-1]["lr"]
          logged.update(epoch=batch_epoch, stage=stage.name,
                        examples_per_s=window_examples / elapsed,
                        compilations=compilations + train_step._cache_size())
          writer.write(step, logged)
          loss = float(logged["loss"])
          progress.set_postfix(loss=f"{loss:.4f}", ex_s=f"{logged['examples_per_s']:.0f}")
          if progress.disable:  # no terminal (batch jobs, nohup): progress goes to the log
            logging.info("step %d/%d epoch %d: loss %.4f, %.1f examples/s", step,
                         progress.total, batch_epoch, loss, logged["examples_per_s"])
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
            progress.write(f"step {step}: " + ", ".join(
                f"{split} {name}={value:.4f}" for split, values in results.items()
                for name, value in values.items()))
          if save_now:
            run_checkpoints.save(step, state, {
                "step": step, "stage_index": stage_index, "stage": stage.name, "epoch": epoch,
                "position": position, "train_seconds": train_seconds,
                "train_examples": train_examples,
                "compilations": compilations + train_step._cache_size(),
                "history": history, "best": best})
          window_start = time.perf_counter()
        if position == 0:
          break  # the epoch (or the stage) is done
    params = state.params
    compilations += train_step._cache_size()
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
    (workdir / "eval_results.json").write_text(json.dumps(eval_results, indent=2) + "\n")
  logging.info("Final %s; best %s at step %d", history[-1], best[main_split][main_metric],
               best["step"])
  return eval_results
