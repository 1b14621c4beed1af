"""Multi-exit BERT: a classifier exit after every encoder layer (or after chosen layers).

Parameter tree (exit layers are 1-based, as in docs/method.md: exit e reads layer e's output):

    bert/...                      exactly BertModel's, so `params["bert"] =
                                  hf_weights.load_bert_params(...)` loads the backbone
                                  (`bert/pooler` is the shared pooler)
    exit_<e>/classifier/{kernel,bias}   kernel [H, K]; its transpose holds exit e's label
                                  embeddings (`label_embeddings`)
    exit_<e>/pooler/dense/{kernel,bias} only with pooler_weights="per_exit"; start them
                                  from the pretrained pooler with `init_per_exit_poolers`

What an exit's pooler reads (`pooler_input`): "cls", the layer's [CLS] state (the method's
default, docs/method.md), or "mean", the mean of the layer's real tokens. The mean is our addition: it is
for checkpoints whose [CLS] state only gathers the sentence in the last layers (mean-pooling
sentence encoders such as all-MiniLM-L6-v2), where [CLS]-pooled shallow exits cannot learn.

The full forward serves training; `embed`, `layer` and `exit_head` (via
`model.apply(variables, ..., method=...)`) run the same parameters one stage at a time for
early-exit inference.
"""

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from acl_jax.models.bert import (Array, BertConfig, BertLayer, BertModel, BertPooler, Dropout,
                                 Dtype, classifier_dense)

POOLER_WEIGHTS = ("shared", "per_exit")
POOLER_INPUTS = ("cls", "mean")
EXIT_WEIGHTS = ("asc", "uniform", "desc")


def pooled_tokens(hidden: Array, attention_mask: Array | None, pooler_input: str) -> Array:
  """What an exit's pooler (dense + tanh on position 0) reads from a layer's output [B, T, H].

  cls: the output itself, so the pooler takes [CLS]. mean: the mean over the tokens that
  attention_mask marks as real (None: every token), as a one-position sequence [B, 1, H], so
  that one pooler module (the shared pretrained one, or an exit's own) serves both. Summed in
  float32; a row without a real token (batch padding) pools to zeros, not NaN.
  """
  if pooler_input == "cls":
    return hidden
  if pooler_input != "mean":
    raise ValueError(f"pooler_input={pooler_input!r}; use one of {list(POOLER_INPUTS)}")
  if attention_mask is None:
    attention_mask = jnp.ones(hidden.shape[:2], jnp.float32)
  weights = attention_mask.astype(jnp.float32)[:, :, None]
  total = jnp.sum(hidden.astype(jnp.float32) * weights, axis=1, keepdims=True)
  count = jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1.0)
  return (total / count).astype(hidden.dtype)


def resolve_exit_layers(num_layers: int, exit_layers: tuple[int, ...] | None) -> tuple[int, ...]:
  """The exit layers sorted; None means every layer 1..num_layers."""
  if exit_layers is None:
    return tuple(range(1, num_layers + 1))
  layers = tuple(exit_layers)
  if not layers:
    raise ValueError("exit_layers is empty; give at least one layer, or None for every layer")
  bad = [layer for layer in layers
         if isinstance(layer, bool) or not isinstance(layer, (int, np.integer))
         or not 1 <= layer <= num_layers]
  if bad:
    raise ValueError(f"exit_layers={layers}: {bad} not layer numbers; each must be an int in "
                     f"1..{num_layers} (1-based: layer e's output feeds exit e)")
  duplicates = sorted({layer for layer in layers if layers.count(layer) > 1})
  if duplicates:
    raise ValueError(f"exit_layers={layers} repeats {duplicates}")
  return tuple(sorted(int(layer) for layer in layers))


def exit_weights(kind: str, exit_layers: tuple[int, ...]) -> np.ndarray:
  """Per-exit loss weights [E], in exit order, summing to 1.

  asc: proportional to the layer number (PABEE's default); uniform; desc: asc's weights in
  reverse exit order (with every layer as exit, proportional to L+1-e).
  """
  layers = np.asarray(sorted(exit_layers), np.float64)
  if layers.size == 0:
    raise ValueError("exit_layers is empty")
  if kind == "asc":
    raw = layers
  elif kind == "uniform":
    raw = np.ones_like(layers)
  elif kind == "desc":
    raw = layers[::-1]
  else:
    raise ValueError(f"Unknown exit weighting {kind!r}; use one of {list(EXIT_WEIGHTS)}")
  return (raw / raw.sum()).astype(np.float32)


def label_embeddings(params: Mapping[str, Any], exit_layers: tuple[int, ...]) -> Array:
  """[E, K, H]: each exit's classifier rows (class k's vector is kernel[:, k]), in exit order.

  Differentiable in params: ACL trains them through both CE and the contrastive term.
  """
  return jnp.stack([jnp.asarray(params[f"exit_{layer}"]["classifier"]["kernel"]).T
                    for layer in exit_layers])


def init_per_exit_poolers(params: Mapping[str, Any]) -> dict[str, Any]:
  """A copy of `params` in which every exit's own pooler starts as `bert/pooler`.

  Call it after loading the pretrained backbone into params["bert"]. The arrays are copied,
  not shared: a donated train state must not hold one buffer twice.
  """
  exits = [name for name, sub in params.items()
           if name.startswith("exit_") and "pooler" in sub]
  if not exits:
    raise ValueError("No exit has its own pooler: these are the params of a "
                     "pooler_weights='shared' model")
  pretrained = params["bert"]["pooler"]
  out = dict(params)
  for name in exits:
    out[name] = {**params[name], "pooler": jax.tree.map(lambda x: x.copy(), pretrained)}
  return out


class ExitHead(nn.Module):
  """One exit: its own pooler (pooler_weights="per_exit" only), dropout, its own classifier."""
  config: BertConfig
  num_labels: int
  own_pooler: bool
  dtype: Dtype = jnp.float32
  precision: jax.lax.PrecisionLike = None
  classifier_dropout: float | None = None

  def setup(self):
    if self.own_pooler:
      self.pooler = BertPooler(self.config, self.dtype, self.precision)
    rate = (self.config.hidden_dropout_prob if self.classifier_dropout is None
            else self.classifier_dropout)
    self.dropout = Dropout(rate)
    self.classifier = classifier_dense(self.config, self.num_labels, self.precision)

  def pool(self, hidden: Array) -> Array:
    return self.pooler(hidden)

  def classify(self, pooled: Array, *, deterministic: bool = True) -> Array:
    """Float32 logits [B, K] from a pooled vector [B, H]."""
    dropped = self.dropout(pooled.astype(jnp.float32), deterministic=deterministic)
    return self.classifier(dropped)


class MultiExitBert(nn.Module):
  """BertModel with an exit after each layer in `exit_layers` (None: every layer).

  Returns a dict of named intermediates, exits stacked in (sorted) exit order:
    logits: float32 [E, B, K]; pooled: float32 [E, B, H], before dropout (contrastive losses
    use it); hidden_states: the encoder's L+1 arrays [B, T, H].
  num_labels=1 regresses. pooler_weights: shared | per_exit; pooler_input: cls | mean (see the
  module docstring).
  """
  config: BertConfig
  num_labels: int
  exit_layers: tuple[int, ...] | None = None
  pooler_weights: str = "shared"
  pooler_input: str = "cls"
  dtype: Dtype = jnp.float32
  precision: jax.lax.PrecisionLike = None
  classifier_dropout: float | None = None

  def __post_init__(self):
    # Fail at construction, not at the first init/apply deep inside a jit trace.
    if self.pooler_weights not in POOLER_WEIGHTS:
      raise ValueError(f"pooler_weights={self.pooler_weights!r}; "
                       f"use one of {list(POOLER_WEIGHTS)}")
    if self.pooler_input not in POOLER_INPUTS:
      raise ValueError(f"pooler_input={self.pooler_input!r}; use one of {list(POOLER_INPUTS)}")
    resolve_exit_layers(self.config.num_hidden_layers, self.exit_layers)
    super().__post_init__()

  def resolved_exit_layers(self) -> tuple[int, ...]:
    """The 1-based layers that have an exit, sorted: the order of the E axis."""
    return resolve_exit_layers(self.config.num_hidden_layers, self.exit_layers)

  def setup(self):
    self.bert = BertModel(self.config, self.dtype, self.precision)
    own_pooler = self.pooler_weights == "per_exit"
    self.heads = {layer: ExitHead(self.config, self.num_labels, own_pooler, self.dtype,
                                  self.precision, self.classifier_dropout, name=f"exit_{layer}")
                  for layer in self.resolved_exit_layers()}

  def _pool(self, hidden: Array, layer: int, attention_mask: Array | None) -> Array:
    tokens = pooled_tokens(hidden, attention_mask, self.pooler_input)
    if self.pooler_weights == "shared":
      return self.bert.pool(tokens)
    return self.heads[layer].pool(tokens)

  def __call__(self, input_ids: Array, attention_mask: Array | None = None,
               token_type_ids: Array | None = None, *,
               deterministic: bool = True) -> dict[str, Any]:
    encoded = self.bert(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
    hidden_states = encoded["hidden_states"]
    outputs = self.exits({layer: hidden_states[layer] for layer in self.resolved_exit_layers()},
                         attention_mask, deterministic=deterministic)
    return {**outputs, "hidden_states": hidden_states}

  def exits(self, exit_hidden: Mapping[int, Array], attention_mask: Array | None = None, *,
            deterministic: bool = True) -> dict[str, Array]:
    """Every exit's float32 logits [E, B, K] and pooled vector [E, B, H] (before dropout)
    from {exit layer: that layer's output [B, T, H]}."""
    logits, pooled = [], []
    for layer in self.resolved_exit_layers():
      vector = self._pool(exit_hidden[layer], layer, attention_mask)
      pooled.append(vector.astype(jnp.float32))
      logits.append(self.heads[layer].classify(vector, deterministic=deterministic))
    return {"logits": jnp.stack(logits), "pooled": jnp.stack(pooled)}

  def encoder_layer(self, hidden: Array, bias: Array, layer: int, *,
                    deterministic: bool = True) -> Array:
    """hidden_states[layer - 1] -> hidden_states[layer] through the model's own encoder, so
    with the parameters and dropout keys of the full forward: training one layer at a time
    (acl_jax.exit_gate) is the same computation as training the whole model."""
    return self.bert.encoder(hidden, bias, deterministic=deterministic,
                             layers=(layer - 1, layer))[-1]

  # One stage at a time, for early exit (inference: no dropout). Each is called as
  # model.apply(variables, ..., method=MultiExitBert.<stage>).

  def embed(self, input_ids: Array, attention_mask: Array | None = None,
            token_type_ids: Array | None = None, *,
            deterministic: bool = True) -> tuple[Array, Array]:
    """hidden_states[0] [B, T, H] and the attention bias [B, 1, 1, T] each layer takes."""
    return self.bert.embed(input_ids, attention_mask, token_type_ids,
                           deterministic=deterministic)

  def layer(self, hidden: Array, bias: Array, layer: int) -> Array:
    """hidden_states[layer - 1] -> hidden_states[layer] (layer is 1-based)."""
    if not 1 <= layer <= self.config.num_hidden_layers:
      raise ValueError(f"layer={layer} is not in 1..{self.config.num_hidden_layers}")
    # The encoder builds its layers inline, so apply a detached (parent=None) BertLayer to
    # that layer's own parameters.
    params = self.variables["params"]["bert"]["encoder"]["layer"][str(layer - 1)]
    return BertLayer(self.config, self.dtype, self.precision, parent=None).apply(
        {"params": params}, hidden, bias)

  def exit_head(self, hidden: Array, layer: int,
                attention_mask: Array | None = None) -> dict[str, Array]:
    """Exit `layer`'s float32 logits [B, K] and pooled [B, H] from hidden_states[layer]
    (attention_mask: the input's, which pooler_input="mean" needs)."""
    if layer not in self.heads:
      raise ValueError(f"layer {layer} has no exit; exits: {self.resolved_exit_layers()}")
    pooled = self._pool(hidden, layer, attention_mask)
    return {"logits": self.heads[layer].classify(pooled),
            "pooled": pooled.astype(jnp.float32)}
