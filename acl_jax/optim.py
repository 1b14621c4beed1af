"""The optimizer: AdamW with warm-up and linear decay, its weight-decay mask, frozen parameters,
and the train state it updates."""

import math
from typing import Any, Callable

import flax
import jax
import optax

# frozen(names) -> bool, over a parameter's path names, e.g. ("bert", "encoder", ...).
Frozen = Callable[[tuple[str, ...]], bool]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def path_names(path) -> tuple[str, ...]:
  """The names of a tree path from jax.tree_util.tree_map_with_path."""
  return tuple(getattr(k, "key", str(k)) for k in path)


def decay_mask(params) -> Any:
  """True where AdamW applies weight decay: not on biases and not on LayerNorm parameters."""
  def decays(path, _):
    names = path_names(path)
    return names[-1] != "bias" and "LayerNorm" not in names
  return jax.tree_util.tree_map_with_path(decays, params)


def create_optimizer(config, total_steps: int, *, frozen: Frozen | None = None
                     ) -> tuple[optax.GradientTransformation, Callable]:
  """AdamW with linear warm-up then linear decay to 0, after global-norm clipping.

  frozen marks parameters the optimizer must leave untouched (DeeBERT's second stage): an
  optax partition sends them to set_to_zero, so neither their update nor their weight decay
  nor their share of the clipping norm exists.
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
        lambda path, _: "frozen" if frozen(path_names(path)) else "trained", params)
    tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule


def trained_leaves(tree, frozen: Frozen | None) -> list[Any]:
  """The leaves of a params-shaped tree that the optimizer updates."""
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
          if frozen is None or not frozen(path_names(path))]
