"""Pure loss functions of arrays (no model inside).

Every loss takes an optional `mask` of shape [N] (1 = real example, 0 = padding row): padded
rows change nothing. Inputs may be float32 or bfloat16; reductions run in float32.
"""

import jax
import jax.numpy as jnp


def _valid(mask, n: int) -> jax.Array:
  return jnp.ones((n,), jnp.float32) if mask is None else mask.astype(jnp.float32)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  # max(., 1) keeps an all-padding batch at 0 instead of NaN.
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits, labels, *, mask=None) -> jax.Array:
  """Mean over valid rows of -log softmax(logits)[label]. logits [N, K], labels int [N]."""
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  # Padding rows may hold any label id; clip so the gather stays in range, the mask drops them.
  labels = jnp.clip(labels.astype(jnp.int32), 0, logits.shape[-1] - 1)
  nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
  return _masked_mean(nll, _valid(mask, logits.shape[0]))


def mse(predictions, targets, *, mask=None) -> jax.Array:
  """Mean over valid rows of (prediction - target)^2; predictions [N] or [N, 1]."""
  predictions = predictions.astype(jnp.float32).reshape(targets.shape[0])
  err = jnp.square(predictions - targets.astype(jnp.float32))
  return _masked_mean(err, _valid(mask, targets.shape[0]))
