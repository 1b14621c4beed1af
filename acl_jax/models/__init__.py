"""Linen BERT (bert.py) and multi-exit BERT (multi_exit.py), and the model a config asks for."""

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
