"""Linen BERT (bert.py) and multi-exit BERT (multi_exit.py), the model a config asks for, and
dropout keyed per example."""

from typing import Callable

import jax
import jax.numpy as jnp

from acl_jax.models import bert
from acl_jax.models import multi_exit

# Compute dtypes (parameters stay float32) and matmul precisions a config may name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PRECISIONS = {"default": None, "high": jax.lax.Precision.HIGH,
              "highest": jax.lax.Precision.HIGHEST}


def from_config(config, bert_config: bert.BertConfig, num_labels: int):
  """The classifier config asks for: BertForSequenceClassification, or MultiExitBert with the
  `multi_exit` preset."""
  common = dict(config=bert_config, num_labels=num_labels, dtype=DTYPES[config.dtype],
                precision=PRECISIONS[config.matmul_precision])
  if config.multi_exit:
    return multi_exit.MultiExitBert(exit_layers=tuple(config.exit_layers) or None,
                                    pooler_weights=config.pooler_weights,
                                    pooler_input=config.pooler_input, **common)
  return bert.BertForSequenceClassification(**common)


def example_keys(rng: jax.Array, size: int) -> jax.Array:
  """Dropout keys [size] for the examples of a batch: example i's is fold_in(rng, i), so it
  depends on the step's key and the example's row, not on the batch size or any split."""
  return jax.vmap(lambda row: jax.random.fold_in(rng, row))(jnp.arange(size))


def per_example(fn: Callable, *, batch_axis: int = 0) -> Callable:
  """fn(key, *inputs) applied example by example: returns (keys [B], *inputs) -> outputs.

  fn sees one example at a time, as a batch of one (every input leaf [1, ...]), with that
  example's dropout key (`example_keys`); the outputs' batch axis (of size one inside fn) is
  `batch_axis` of every leaf, where the batch then is. An example's dropout masks so depend on
  its key alone, never on which other examples share its batch: a batch split into
  micro-batches (acl_jax.gradients.Microbatched), a second forward pass and a single-layer
  forward (acl_jax.exit_gate) all see the same masks. It is jax.vmap, so XLA runs the batch as
  one program; without dropout (deterministic) it is the batched forward.
  """
  def one(key, *inputs):
    out = fn(key, *jax.tree.map(lambda x: x[None], inputs))
    return jax.tree.map(lambda y: jnp.squeeze(y, batch_axis), out)
  return jax.vmap(one, out_axes=batch_axis)
