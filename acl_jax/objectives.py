"""The paper's method as training objectives: the registry, the task loss, the train step.

Each objective is a total loss over the exits of a single- or multi-exit model (a single-exit
classifier is the one-exit case), optionally gated by ACL-Grad (acl_jax.gradients). The maths,
with every default and switch, is in docs/method.md; this module is its one implementation.
DeeBERT's two stages are `stages_of`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acl_jax import data
from acl_jax import exit_gate
from acl_jax import gradients
from acl_jax import losses
from acl_jax import models
from acl_jax import optim
from acl_jax.models import multi_exit


@dataclasses.dataclass(frozen=True)
class Objective:
  """What a training objective adds to the task loss, and how its gradient is gated.

  aux: the auxiliary loss (None: the task loss alone); gate_mode: gradients.combine's mode;
  convex: the SCL baseline's convex mix (1 - aux_weight) CE + aux_weight SCL, else
  CE + aux_weight aux; multi_exit_only: needs exits to distil or contrast between.
  """
  aux: str | None = None
  gate_mode: str = "none"
  convex: bool = False
  multi_exit_only: bool = False


OBJECTIVES = {
    "ce": Objective(),
    "scl": Objective(aux="scl", convex=True),  # Gunel et al.'s CE+SCL baseline
    "acl_embed": Objective(aux="acl_embed"),  # ACL-Embed without gating
    "acl": Objective(aux="acl_embed", gate_mode="drop"),  # ACL-BERT: ACL-Embed + ACL-Grad
    "acl_project": Objective(aux="acl_embed", gate_mode="project"),  # PCGrad-style ablation
    # Multi-exit: self-distillation from the last exit (baseline); ACL-Embed + ACL-CL, gated,
    # and its two gate ablations; DeeBERT's two stages (final exit, then the other exits'
    # off-ramps on a frozen backbone).
    "kd": Objective(aux="kd", multi_exit_only=True),
    "acl_cl": Objective(aux="acl_cl", gate_mode="drop", multi_exit_only=True),
    "acl_cl_ungated": Objective(aux="acl_cl", multi_exit_only=True),
    "acl_cl_project": Objective(aux="acl_cl", gate_mode="project", multi_exit_only=True),
    "deebert": Objective(multi_exit_only=True),
}
GATE_GRANULARITIES = ("per_exit", "global")
TEACHERS = ("last", "deeper")


@dataclasses.dataclass(frozen=True)
class Stage:
  """One optimization phase: its objective, exit weights, and what it keeps frozen."""
  name: str
  objective: str
  exit_weights: np.ndarray | None
  frozen: optim.Frozen | None = None


def stages_of(config, model) -> list[Stage]:
  """One stage, except DeeBERT: the final exit with the whole model, then every other exit's
  off-ramp (its own pooler and classifier: config.validate requires pooler_weights=per_exit)
  with the backbone and the final exit frozen, as many steps again. As DeeBERT does, the
  second stage sums the off-ramps' losses (config.exit_weights does not apply)."""
  if not config.multi_exit:
    return [Stage("train", config.objective, None)]
  layers = model.resolved_exit_layers()
  if config.objective != "deebert":
    return [Stage("train", config.objective,
                  multi_exit.exit_weights(config.exit_weights, layers))]
  final = np.zeros(len(layers), np.float32)
  final[-1] = 1.0
  frozen_roots = ("bert", f"exit_{layers[-1]}")
  return [Stage("final_exit", "ce", final),
          Stage("other_exits", "ce", 1.0 - final, frozen=lambda names: names[0] in frozen_roots)]


def task_loss(task: data.TaskSpec, logits, labels, mask) -> jax.Array:
  if task.is_regression:
    return losses.mse(logits[:, 0], labels, mask=mask)
  return losses.cross_entropy(logits, labels, mask=mask)


def exit_outputs(model, out) -> tuple[jax.Array, jax.Array]:
  """(logits [E, B, K], pooled [E, B, H]) for either model: a single-exit classifier is the
  one-exit case, so every objective has one implementation."""
  if isinstance(model, multi_exit.MultiExitBert):
    return out["logits"], out["pooled"]
  return out["logits"][None], out["pooled"][None]


def label_embeddings(model, params) -> jax.Array:
  """Each exit's label embeddings [E, K, H]: its classifier's kernel, transposed."""
  if isinstance(model, multi_exit.MultiExitBert):
    return multi_exit.label_embeddings(params, model.resolved_exit_layers())
  return params["classifier"]["kernel"].T[None]


def num_exits(model) -> int:
  if isinstance(model, multi_exit.MultiExitBert):
    return len(model.resolved_exit_layers())
  return 1


def make_train_step(model, tx, schedule, task: data.TaskSpec, config,
                    stage: Stage | None = None):
  """Returns the pure step (state, batch, rng) -> (state, metrics), to be jitted once.

  config: the run's config (acl_jax.config), read for the objective's knobs (aux_weight,
  temperature, anchors, cl_anchors, normalize_label_embeddings, cl_weight, teacher,
  kd_temperature, gate_granularity, gate_chunk, measure_conflict); stage: its objective, exit weights and frozen parameters (None: the
  config's first stage, `stages_of(config, model)[0]`).

  The loss terms are, for every exit e, w_e * CE_e and w_e * aux_e (aux_e already carries
  lambda, and mu for ACL-CL). With a gate (or measure_conflict, for the pilot experiment) the
  step takes one forward pass and makes one gate decision for all exits
  (gate_granularity="global", or a single exit: gradients.gated_value_and_grad, one vjp) or
  one per exit ("per_exit": exit_gate.per_exit_gated_grads, each exit's backward passes through
  its own layers only, gate_chunk exits at a time). Without a gate the summed loss has one
  ordinary backward pass.
  stage.exit_weights: [E] weights (multi_exit.exit_weights); None = 1 for the single exit.
  stage.frozen: the parameters `tx` leaves untouched (optim.create_optimizer's partition); the
  logged grad_norm covers the others only, the norm that clipping sees, so nothing reads the
  frozen parameters' gradients and XLA drops their backward pass (DeeBERT's second stage then
  costs a forward pass and the exit heads' backward, not a full backward through the
  backbone).
  """
  stage = stage or stages_of(config, model)[0]
  spec = OBJECTIVES[stage.objective]
  aux_weight, temperature, cl_weight = config.aux_weight, config.temperature, config.cl_weight
  exit_weights, frozen, gate_chunk = stage.exit_weights, stage.frozen, config.gate_chunk
  two_gradients = spec.aux is not None and (spec.gate_mode != "none" or config.measure_conflict)
  ce_weight = 1.0 - aux_weight if spec.convex else 1.0
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
      distil = jax.vmap(lambda z: losses.kd(z, logits[-1], temperature=config.kd_temperature,
                                            mask=mask))(logits)
      return aux_weight * jnp.where(shallow, distil, 0.0)
    embed = jax.vmap(lambda h, l: losses.acl_embed(
        h, labels, l, temperature=temperature, mask=mask, anchors=config.anchors,
        normalize_labels=config.normalize_label_embeddings))(pooled, label_emb)
    if spec.aux == "acl_embed":
      return aux_weight * embed
    # ACL-CL: student e against teacher t; [E, E] pairs, kept where t is e's teacher.
    pair = lambda hs, ls, ht, lt: losses.acl_cl(
        hs, ls, ht, lt, labels, temperature=temperature, mask=mask,
        label_anchors=config.cl_anchors == "all",
        normalize_labels=config.normalize_label_embeddings)
    if config.teacher == "last":
      contrast = jax.vmap(pair, in_axes=(0, 0, None, None))(pooled, label_emb, pooled[-1],
                                                            label_emb[-1])
    else:
      grid = jax.vmap(jax.vmap(pair, in_axes=(None, None, 0, 0)),
                      in_axes=(0, 0, None, None))(pooled, label_emb, pooled, label_emb)
      deeper = jnp.triu(jnp.ones((n_exits, n_exits), bool), k=1)
      contrast = (jnp.where(deeper, grid, 0.0).sum(1)
                  / jnp.maximum(deeper.sum(1), 1).astype(jnp.float32))
    return aux_weight * embed + cl_weight * jnp.where(shallow, contrast, 0.0)

  def terms_of(logits, pooled, label_emb, batch):
    """((w_e CE_e [E], w_e aux_e [E] or None), logged terms) from the exits' outputs."""
    main = jax.vmap(lambda z: task_loss(task, z, batch["labels"], batch["mask"]))(logits)
    terms = {main_name: main}
    if spec.aux is None:
      return (weights * ce_weight * main, None), terms
    aux = auxiliary(logits, pooled, label_emb, batch)
    terms["aux"] = aux
    return (weights * ce_weight * main, weights * aux), terms

  def features(params, examples):
    """Every exit's logits [B, E, K] and pooled vector [B, E, H], example by example (dropout
    keyed per example: models.per_example)."""
    def one(key, *inputs):
      out = model.apply({"params": params}, *inputs, deterministic=False,
                        rngs={"dropout": key})
      return exit_outputs(model, out)
    logits, pooled = models.per_example(one, batch_axis=1)(
        examples["dropout_key"], *(examples[k] for k in data.MODEL_INPUTS))
    return {"logits": logits.swapaxes(0, 1), "pooled": pooled.swapaxes(0, 1)}

  def terms(params, features, batch):
    """The loss terms over the whole batch, from every example's features."""
    return terms_of(features["logits"].swapaxes(0, 1), features["pooled"].swapaxes(0, 1),
                    label_embeddings(model, params), batch)

  def whole_batch(params, examples, batch):
    return terms(params, features(params, examples), batch)

  per_exit = n_exits > 1 and config.gate_granularity == "per_exit"
  microbatch_size = config.microbatch_size

  def loss_and_grads(params, examples, batch):
    """((loss, logged terms), grads, gate info or {})."""
    size = batch["labels"].shape[0]
    loss_fn = whole_batch
    if microbatch_size and microbatch_size < size:
      if size % microbatch_size:
        raise ValueError(f"a batch of {size} examples does not split into micro-batches of "
                         f"microbatch_size={microbatch_size}")
      loss_fn = gradients.Microbatched(features, terms, size // microbatch_size)
    if not two_gradients:
      out, grads = gradients.value_and_grad(loss_fn, has_aux=True)(params, examples, batch)
      return out, grads, {}
    if per_exit and loss_fn is whole_batch:
      # Each exit's gradients through its own layers only (exit_gate: the cost floor).
      return exit_gate.per_exit_gated_grads(
          model, params, examples,
          lambda logits, pooled, label_emb: terms_of(logits, pooled, label_emb, batch),
          mode=spec.gate_mode, chunk=gate_chunk)
    return gradients.gated_value_and_grad(
        loss_fn, mode=spec.gate_mode, granularity="per_term" if per_exit else "global",
        chunk=gate_chunk, has_aux=True)(params, examples, batch)

  def train_step(state: optim.TrainState, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state.step)
    examples = {**{k: batch[k] for k in data.MODEL_INPUTS},
                "dropout_key": models.example_keys(dropout_rng, batch["labels"].shape[0])}
    (loss, terms), grads, gate = loss_and_grads(state.params, examples, batch)
    terms.update(gate)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if n_exits == 1:  # one exit logs scalars, as a single-exit model should
      terms = jax.tree.map(lambda v: v.reshape(()) if v.size == 1 else v, terms)
    step_metrics = {"loss": loss, **terms,
                    "grad_norm": optax.tree.norm(optim.trained_leaves(grads, frozen)),
                    "lr": schedule(state.step)}
    return (optim.TrainState(step=state.step + 1, params=params, opt_state=opt_state),
            step_metrics)

  return train_step
