"""BERT in Linen: the numerics of HF's PyTorch BertModel, under HF's parameter names.

Every submodule is named after its HF counterpart, so a checkpoint converts by a mechanical
rename (acl_jax.checkpoints): Dense `kernel` is Linear `weight` transposed, LayerNorm `scale`
is `weight`, Embed `embedding` is Embedding `weight`.

Parameters are always float32; `dtype` sets the compute dtype (float32 or bfloat16) while
softmax and LayerNorm statistics stay float32. `precision` reaches every matmul so TPUs can
run float32 parity checks at HIGHEST.
"""

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp

Array = jax.Array
Dtype = Any

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
  "gelu": functools.partial(nn.gelu, approximate=False),  # BERT's GELU is the exact erf form
  "gelu_new": functools.partial(nn.gelu, approximate=True),
  "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
  "relu": nn.relu,
}
# Other model types (roberta: offset positions, electra, ...) would load but compute wrongly.
BERT_MODEL_TYPES = ("bert",)


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """The architecture fields of an HF BertConfig; the defaults are bert-base-uncased's."""
  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  pad_token_id: int | None = 0
  initializer_range: float = 0.02

  def __post_init__(self):
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use one of "
                       f"{sorted(ACTIVATIONS)}")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                       f"num_attention_heads={self.num_attention_heads}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "BertConfig":
    """From an HF config.json dict; keys that do not shape the encoder are ignored."""
    model_type = d.get("model_type", "bert")
    if model_type not in BERT_MODEL_TYPES:
      raise ValueError(f"model_type={model_type!r} is not a BERT checkpoint; supported: "
                       f"{list(BERT_MODEL_TYPES)}")
    position_type = d.get("position_embedding_type", "absolute")
    if position_type != "absolute":
      raise ValueError(f"position_embedding_type={position_type!r} is not supported; only "
                       "'absolute' position embeddings are implemented")
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def attention_bias(attention_mask: Array, dtype: Dtype = jnp.float32) -> Array:
  """Maps a [B, T] 0/1 mask to an additive [B, 1, 1, T] bias: 0 to attend, very negative not.

  HF adds finfo(dtype).min; half of it is as good after the softmax, and adding a score to it
  can never overflow to -inf, so a row that is all padding (padded eval batches) gets uniform
  weights instead of NaN, in bfloat16 as in float32.
  """
  big_negative = float(jnp.finfo(dtype).min) / 2
  mask = jnp.asarray(attention_mask)[:, None, None, :]
  return jnp.where(mask > 0, 0.0, big_negative).astype(dtype)


class _BertModule(nn.Module):
  """The attributes every BERT part shares, and the Dense/LayerNorm they are built from."""
  config: BertConfig
  dtype: Dtype = jnp.float32
  precision: jax.lax.PrecisionLike = None

  def _child(self, cls: type["_BertModule"], name: str | None = None) -> "_BertModule":
    # name=None inside setup(): the attribute the child is assigned to names it.
    return cls(self.config, self.dtype, self.precision, name=name)

  def _dense(self, features: int, name: str = "dense") -> nn.Dense:
    return nn.Dense(features, dtype=self.dtype, param_dtype=jnp.float32,
                    precision=self.precision,
                    kernel_init=nn.initializers.normal(self.config.initializer_range),
                    name=name)

  def _layer_norm(self) -> nn.LayerNorm:
    # Two-pass variance, as HF computes it: Flax's default one-pass E[x^2] - E[x]^2
    # cancels catastrophically when the mean is large against the spread.
    return nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype,
                        param_dtype=jnp.float32, use_fast_variance=False, name="LayerNorm")


class Dropout(nn.Module):
  """Inverted dropout that spends a quarter of the random-number work of nn.Dropout.

  flax's nn.Dropout takes one threefry hash per element and keeps 32 of its 64 output bits;
  on CPU those hashes cost about a fifth of a BERT train step (the attention-probability masks
  alone are batch * heads * T * T per layer). Here every hash's 64 bits give four elements 16
  bits each. The keep probability is rounded to a multiple of 1/65536 (0.9 -> 0.899994) and
  the scale uses the rounded value, so the expectation stays exact.
  """
  rate: float

  @nn.compact
  def __call__(self, inputs: Array, *, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return inputs
    if self.rate >= 1.0:
      return jnp.zeros_like(inputs)
    threshold = round((1.0 - self.rate) * 65536)
    size = inputs.size
    keypair = jax.random.bits(self.make_rng("dropout"), (2,), jnp.uint32)
    words = jax.extend.random.threefry_2x32(keypair, jax.lax.iota(jnp.uint32, (size + 1) // 2))
    bits = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:size]
    keep = bits.reshape(inputs.shape) < threshold
    return jnp.where(keep, inputs * jnp.asarray(65536 / threshold, inputs.dtype),
                     jnp.zeros_like(inputs))


class BertEmbeddings(_BertModule):
  """Word + position + token-type embeddings, LayerNorm, dropout."""

  @nn.compact
  def __call__(self, input_ids: Array, token_type_ids: Array, *,
               deterministic: bool = True) -> Array:
    config = self.config
    if input_ids.shape[-1] > config.max_position_embeddings:
      # JAX clamps out-of-range gathers, so this would silently reuse the last position.
      raise ValueError(f"Sequence length {input_ids.shape[-1]} exceeds "
                       f"max_position_embeddings={config.max_position_embeddings}")
    embed = functools.partial(
        nn.Embed, features=config.hidden_size, param_dtype=jnp.float32,
        embedding_init=nn.initializers.normal(config.initializer_range))
    positions = jnp.arange(input_ids.shape[-1])[None, :]
    # Gathered and summed in float32: bfloat16 would round each term before the sum.
    summed = (embed(config.vocab_size, name="word_embeddings")(input_ids)
              + embed(config.max_position_embeddings, name="position_embeddings")(positions)
              + embed(config.type_vocab_size, name="token_type_embeddings")(token_type_ids))
    embedded = self._layer_norm()(summed)
    return Dropout(config.hidden_dropout_prob)(embedded, deterministic=deterministic)


class BertSelfAttention(_BertModule):
  """Multi-head scaled dot-product attention (HF `attention.self`)."""

  @nn.compact
  def __call__(self, hidden: Array, bias: Array, *, deterministic: bool = True) -> Array:
    config = self.config

    def heads(name):
      projected = self._dense(config.hidden_size, name)(hidden)
      return projected.reshape(*hidden.shape[:-1], config.num_attention_heads, -1)

    query, key, value = heads("query"), heads("key"), heads("value")
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=self.precision,
                        preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(query.shape[-1]) + bias.astype(jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = Dropout(config.attention_probs_dropout_prob)(probs, deterministic=deterministic)
    context = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(self.dtype), value,
                         precision=self.precision)
    return context.reshape(hidden.shape)


class BertOutput(_BertModule):
  """Dense, dropout, LayerNorm(x + residual): HF's `attention.output` and `output` alike."""

  @nn.compact
  def __call__(self, hidden: Array, residual: Array, *, deterministic: bool = True) -> Array:
    projected = self._dense(residual.shape[-1])(hidden)
    projected = Dropout(self.config.hidden_dropout_prob)(projected,
                                                            deterministic=deterministic)
    return self._layer_norm()(projected + residual)


class BertAttention(_BertModule):
  """Self-attention and its residual output block (HF `attention`)."""

  @nn.compact
  def __call__(self, hidden: Array, bias: Array, *, deterministic: bool = True) -> Array:
    attended = self._child(BertSelfAttention, "self")(hidden, bias, deterministic=deterministic)
    return self._child(BertOutput, "output")(attended, hidden, deterministic=deterministic)


class BertIntermediate(_BertModule):
  """The feed-forward expansion and its activation (HF `intermediate`)."""

  @nn.compact
  def __call__(self, hidden: Array) -> Array:
    return ACTIVATIONS[self.config.hidden_act](self._dense(self.config.intermediate_size)(hidden))


class BertLayer(_BertModule):
  """One post-LN transformer layer. Usable on its own (early exit runs one layer at a time):

    BertLayer(config, dtype, precision).apply(
        {"params": params["encoder"]["layer"]["3"]}, hidden, attention_bias(mask))
  """

  @nn.compact
  def __call__(self, hidden: Array, bias: Array, *, deterministic: bool = True) -> Array:
    """hidden: [B, T, H]; bias: [B, 1, 1, T] from `attention_bias`."""
    attended = self._child(BertAttention, "attention")(hidden, bias, deterministic=deterministic)
    expanded = self._child(BertIntermediate, "intermediate")(attended)
    return self._child(BertOutput, "output")(expanded, attended, deterministic=deterministic)


class BertLayerStack(_BertModule):
  """The layers, named "0", "1", ... like the entries of HF's ModuleList `encoder.layer`."""

  @nn.compact
  def __call__(self, hidden: Array, bias: Array, *, deterministic: bool = True,
               layers: tuple[int, int] | None = None) -> tuple[Array, ...]:
    """The input and each layer's output; `layers` = (start, stop), 0-based, runs only those
    (under the same names, so with the same parameters and dropout keys)."""
    start, stop = layers or (0, self.config.num_hidden_layers)
    states = [hidden]
    for i in range(start, stop):
      states.append(self._child(BertLayer, str(i))(states[-1], bias, deterministic=deterministic))
    return tuple(states)


class BertEncoder(_BertModule):
  """HF's `encoder`; it only adds the `layer` naming level. Returns the input and every
  layer's output."""

  @nn.compact
  def __call__(self, hidden: Array, bias: Array, *, deterministic: bool = True,
               layers: tuple[int, int] | None = None) -> tuple[Array, ...]:
    return self._child(BertLayerStack, "layer")(hidden, bias, deterministic=deterministic,
                                                layers=layers)


class BertPooler(_BertModule):
  """Dense + tanh on the [CLS] position."""

  @nn.compact
  def __call__(self, hidden: Array) -> Array:
    return jnp.tanh(self._dense(self.config.hidden_size)(hidden[:, 0]))


class BertModel(_BertModule):
  """The BERT encoder. Returns a dict of named intermediates:

    hidden_states: L+1 arrays [B, T, H], the embedding output then each layer's output
      (HF's output_hidden_states); last_hidden_state: the final one;
    pooled: [B, H], only when add_pooler.

  `embed` and `pool` expose the first and last stages on their own: multi-exit BERT pools
  every exit's hidden state with this one pooler, and early exit starts from `embed`.
  """
  add_pooler: bool = True

  def setup(self):
    self.embeddings = self._child(BertEmbeddings)
    self.encoder = self._child(BertEncoder)
    if self.add_pooler:
      self.pooler = self._child(BertPooler)

  def embed(self, input_ids: Array, attention_mask: Array | None = None,
            token_type_ids: Array | None = None, *,
            deterministic: bool = True) -> tuple[Array, Array]:
    """The embedding output [B, T, H] and the attention bias [B, 1, 1, T] every layer takes."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    embedded = self.embeddings(input_ids, token_type_ids, deterministic=deterministic)
    return embedded, attention_bias(attention_mask)

  def pool(self, hidden: Array) -> Array:
    """The pooler (dense + tanh on [CLS]) of any layer's output [B, T, H] -> [B, H]."""
    if not self.add_pooler:
      raise ValueError("pool() needs a BertModel built with add_pooler=True")
    return self.pooler(hidden)

  def __call__(self, input_ids: Array, attention_mask: Array | None = None,
               token_type_ids: Array | None = None, *,
               deterministic: bool = True) -> dict[str, Any]:
    embedded, bias = self.embed(input_ids, attention_mask, token_type_ids,
                                deterministic=deterministic)
    hidden_states = self.encoder(embedded, bias, deterministic=deterministic)
    outputs = {"hidden_states": hidden_states, "last_hidden_state": hidden_states[-1]}
    if self.add_pooler:
      outputs["pooled"] = self.pool(hidden_states[-1])
    return outputs


def classifier_dense(config: BertConfig, num_labels: int,
                     precision: jax.lax.PrecisionLike = None) -> nn.Dense:
  """The task head's Dense (HF `classifier`): float32, kernel ~ normal(initializer_range).

  Its kernel is [H, K]: the transpose's rows are the per-class vectors ACL uses as label
  embeddings.
  """
  return nn.Dense(num_labels, dtype=jnp.float32, param_dtype=jnp.float32, precision=precision,
                  kernel_init=nn.initializers.normal(config.initializer_range), name="classifier")


class BertForSequenceClassification(nn.Module):
  """BertModel + dropout + Dense(num_labels) on the pooled vector; num_labels=1 regresses.

  Returns logits [B, K] and pooled [B, H] (before dropout; contrastive losses use it), both
  float32, and the encoder's hidden_states.
  """
  config: BertConfig
  num_labels: int
  dtype: Dtype = jnp.float32
  precision: jax.lax.PrecisionLike = None
  classifier_dropout: float | None = None

  @nn.compact
  def __call__(self, input_ids: Array, attention_mask: Array | None = None,
               token_type_ids: Array | None = None, *,
               deterministic: bool = True) -> dict[str, Any]:
    encoded = BertModel(self.config, self.dtype, self.precision, name="bert")(
        input_ids, attention_mask, token_type_ids, deterministic=deterministic)
    pooled = encoded["pooled"].astype(jnp.float32)
    rate = (self.config.hidden_dropout_prob if self.classifier_dropout is None
            else self.classifier_dropout)
    dropped = Dropout(rate)(pooled, deterministic=deterministic)
    logits = classifier_dense(self.config, self.num_labels, self.precision)(dropped)
    return {"logits": logits, "pooled": pooled, "hidden_states": encoded["hidden_states"]}
