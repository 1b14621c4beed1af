"""Our Linen BERT against HF's PyTorch BertModel, plus dtypes, dropout and per-layer use."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from acl_jax import hf_weights
from acl_jax.models import bert
from conftest import write_tiny_bert

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def batch(minilm_dir) -> dict[str, np.ndarray]:
  """Two sentence pairs and two single sentences, padded to the longest (so padding varies)."""
  tokenizer = hf_weights.load_tokenizer(minilm_dir)
  pairs = tokenizer(["A man is playing a guitar.", "Hi"],
                    ["Someone plays music on a stage tonight.",
                     "Hello there, how are you doing on this fine day?"])
  singles = tokenizer(["The quick brown fox jumps over the lazy dog.",
                       "Is it?"])
  rows = [{k: encoded[k][i] for k in encoded} for encoded in (pairs, singles) for i in range(2)]
  padded = {k: np.asarray(v) for k, v in tokenizer.pad(rows, return_tensors="np").items()}
  lengths = padded["attention_mask"].sum(1)
  assert len(set(lengths.tolist())) == 4 and padded["token_type_ids"].any()
  return padded


@pytest.fixture(scope="module")
def minilm(minilm_dir):
  return hf_weights.load_config(minilm_dir), hf_weights.load_bert_params(minilm_dir)


@pytest.fixture(scope="module")
def minilm_outputs(minilm, batch):
  config, params = minilm
  return bert.BertModel(config).apply({"params": params}, batch["input_ids"],
                                      batch["attention_mask"], batch["token_type_ids"])


def _torch_forward(model, batch):
  with torch.no_grad():
    return model(**{k: torch.from_numpy(v) for k, v in batch.items()}, output_hidden_states=True)


def _max_diff_at_tokens(ours, theirs, attention_mask) -> float:
  valid = attention_mask.astype(bool)
  return float(np.abs(np.asarray(ours, np.float32) - np.asarray(theirs))[valid].max())


def test_minilm_matches_hf_at_every_layer(minilm_dir, minilm_outputs, batch):
  reference = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager")
  expected = _torch_forward(reference.eval(), batch)

  ours = minilm_outputs["hidden_states"]
  assert len(ours) == len(expected.hidden_states) == 7
  for layer, (got, want) in enumerate(zip(ours, expected.hidden_states)):
    diff = _max_diff_at_tokens(got, want.numpy(), batch["attention_mask"])
    assert diff <= PARITY_ATOL, f"hidden state {layer} differs by {diff}"
  assert minilm_outputs["last_hidden_state"] is ours[-1]
  np.testing.assert_allclose(minilm_outputs["pooled"], expected.pooler_output.numpy(),
                             rtol=0, atol=PARITY_ATOL)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_tiny_prefixed_classifier_matches_hf(tmp_path, minilm_dir, batch, hidden_act):
  ckpt = write_tiny_bert(tmp_path, minilm_dir, prefix=True, num_labels=3, hidden_act=hidden_act)
  tensors, _ = hf_weights.read_tensors(ckpt)
  config = hf_weights.load_config(ckpt)
  params = {"bert": hf_weights.hf_to_flax(tensors, config),
            "classifier": {"kernel": tensors["classifier.weight"].T,
                           "bias": tensors["classifier.bias"]}}
  # The naming contract: our tree is HF's BertForSequenceClassification, tensor for tensor.
  assert hf_weights.flax_to_hf(params).keys() == tensors.keys()

  model = bert.BertForSequenceClassification(config, num_labels=3)
  ours = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                     batch["token_type_ids"])
  reference = transformers.BertForSequenceClassification.from_pretrained(
      ckpt, attn_implementation="eager").eval()
  expected = _torch_forward(reference, batch)

  assert ours["logits"].shape == (4, 3) and ours["logits"].dtype == jnp.float32
  np.testing.assert_allclose(ours["logits"], expected.logits.numpy(), rtol=0, atol=PARITY_ATOL)
  for got, want in zip(ours["hidden_states"], expected.hidden_states, strict=True):
    assert _max_diff_at_tokens(got, want.numpy(), batch["attention_mask"]) <= PARITY_ATOL


def test_init_tree_is_the_hf_tree():
  config = bert.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=32,
                           max_position_embeddings=20)
  model = bert.BertForSequenceClassification(config, num_labels=1)
  params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  hf_config = transformers.BertConfig(**dataclasses.asdict(config), num_labels=1)
  hf_shapes = {k: tuple(v.shape) for k, v in
               transformers.BertForSequenceClassification(hf_config).state_dict().items()}
  ours = {k: v.shape for k, v in hf_weights.flax_to_hf(params).items()}
  assert ours == {k: v for k, v in hf_shapes.items() if not k.endswith("position_ids")}


def test_bfloat16_compute_keeps_float32_params(minilm, minilm_outputs, batch):
  config, params = minilm
  model = bert.BertModel(config, dtype=jnp.bfloat16)
  init_params = jax.eval_shape(
      lambda: model.init(jax.random.key(0), batch["input_ids"]))["params"]
  assert {leaf.dtype for leaf in jax.tree.leaves(init_params)} == {jnp.dtype(jnp.float32)}

  out = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                    batch["token_type_ids"])
  assert out["last_hidden_state"].dtype == jnp.bfloat16
  # bfloat16 keeps ~3 significant digits: MiniLM drifts by ~0.05 on values up to ~10.
  for got, want in zip(out["hidden_states"], minilm_outputs["hidden_states"], strict=True):
    assert _max_diff_at_tokens(got, want, batch["attention_mask"]) < 0.1
  np.testing.assert_allclose(np.asarray(out["pooled"], np.float32), minilm_outputs["pooled"],
                             atol=0.01)


def test_classifier_outputs_are_float32_under_bfloat16(tiny_bert_dir, batch):
  config = hf_weights.load_config(tiny_bert_dir)
  model = bert.BertForSequenceClassification(config, num_labels=1, dtype=jnp.bfloat16)
  variables = model.init(jax.random.key(0), batch["input_ids"])
  out = jax.jit(model.apply)(variables, batch["input_ids"], batch["attention_mask"])
  assert out["logits"].shape == (4, 1)  # regression (STS-B)
  assert out["logits"].dtype == out["pooled"].dtype == jnp.float32
  assert out["hidden_states"][-1].dtype == jnp.bfloat16


def test_dropout_only_when_not_deterministic(tiny_bert_dir, batch):
  config = hf_weights.load_config(tiny_bert_dir)
  model = bert.BertForSequenceClassification(config, num_labels=2)
  params = {"bert": hf_weights.load_bert_params(tiny_bert_dir),
            "classifier": {"kernel": np.ones((32, 2), np.float32), "bias": np.zeros(2, np.float32)}}
  args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])

  def logits(key=None):
    rngs = None if key is None else {"dropout": jax.random.key(key)}
    return model.apply({"params": params}, *args, deterministic=key is None, rngs=rngs)["logits"]

  clean = logits()  # no rng needed
  np.testing.assert_array_equal(clean, logits())
  np.testing.assert_array_equal(logits(1), logits(1))
  assert not np.allclose(logits(1), clean)
  assert not np.allclose(logits(1), logits(2))


def test_layers_applied_one_at_a_time_reproduce_the_model(minilm, minilm_outputs, batch):
  config, params = minilm
  bias = bert.attention_bias(batch["attention_mask"])
  hidden = minilm_outputs["hidden_states"][0]
  for i in range(config.num_hidden_layers):
    hidden = bert.BertLayer(config, jnp.float32, None).apply(
        {"params": params["encoder"]["layer"][str(i)]}, hidden, bias, deterministic=True)
    np.testing.assert_allclose(hidden, minilm_outputs["hidden_states"][i + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_bias_and_all_padding_rows(tiny_bert_dir, dtype):
  bias = bert.attention_bias(np.array([[1, 1, 0], [0, 0, 0]]), dtype)
  assert bias.shape == (2, 1, 1, 3) and bias.dtype == dtype
  assert bias[0, 0, 0, 0] == 0 and np.isfinite(np.asarray(bias, np.float32)).all()
  assert float(bias[0, 0, 0, 2]) < -1e30

  # Padded eval batches contain rows with no valid token: they must stay finite.
  config = hf_weights.load_config(tiny_bert_dir)
  ids = np.array([[101, 2023, 102], [0, 0, 0]])
  params = hf_weights.load_bert_params(tiny_bert_dir)
  out = bert.BertModel(config, dtype=dtype).apply({"params": params}, ids,
                                                  np.array([[1, 1, 1], [0, 0, 0]]))
  assert all(np.isfinite(np.asarray(h, np.float32)).all() for h in out["hidden_states"])


def test_config_from_dict(minilm_dir):
  import json
  raw = json.loads((minilm_dir / "config.json").read_text())
  config = bert.BertConfig.from_dict(raw)
  assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (384, 6, 30522)
  hash(config)  # a Linen attribute must be hashable
  with pytest.raises(ValueError, match="model_type='roberta'"):
    bert.BertConfig.from_dict({**raw, "model_type": "roberta"})
  with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
    bert.BertConfig.from_dict({**raw, "position_embedding_type": "relative_key"})
  with pytest.raises(ValueError, match="hidden_act='swish'"):
    bert.BertConfig.from_dict({**raw, "hidden_act": "swish"})


def test_sequences_longer_than_the_position_table_are_refused(tiny_bert_dir):
  config = hf_weights.load_config(tiny_bert_dir)
  params = hf_weights.load_bert_params(tiny_bert_dir)
  ids = np.zeros((1, config.max_position_embeddings + 1), np.int32)
  with pytest.raises(ValueError, match="exceeds max_position_embeddings=128"):
    bert.BertModel(config).apply({"params": params}, ids)


def _dropout(rate, x, seed=0, deterministic=False):
  return bert.Dropout(rate).apply({}, x, deterministic=deterministic,
                                  rngs={"dropout": jax.random.key(seed)})


def test_dropout_keeps_each_element_independently_with_the_right_probability():
  x = jnp.full((256, 64, 63), 2.0)  # an odd last axis and size: the tail word is half used
  y = np.asarray(_dropout(0.1, x))
  threshold = round(0.9 * 65536)
  keep_prob = threshold / 65536
  kept = y != 0
  n = kept.size
  # Kept values are scaled so the expectation is exact; dropped ones are exactly zero.
  np.testing.assert_allclose(y[kept], 2.0 * 65536 / threshold, rtol=1e-6)
  sigma = np.sqrt(keep_prob * (1 - keep_prob) / n)
  assert abs(kept.mean() - keep_prob) < 5 * sigma
  # Two elements share a 32-bit word and four share a hash: their decisions must not
  # correlate. Neighbours at distances 1..4 in the flat order, and a far one, as a control.
  flat = kept.reshape(-1).astype(np.float64)
  for lag in (1, 2, 3, 4, 1001):
    corr = np.corrcoef(flat[:-lag], flat[lag:])[0, 1]
    assert abs(corr) < 5 / np.sqrt(n), (lag, corr)


def test_dropout_masks_follow_the_key():
  x = jnp.ones((8, 128))
  np.testing.assert_array_equal(_dropout(0.1, x, seed=3), _dropout(0.1, x, seed=3))
  assert not np.array_equal(_dropout(0.1, x, seed=3), _dropout(0.1, x, seed=4))
  np.testing.assert_array_equal(_dropout(0.1, x, deterministic=True), x)
  np.testing.assert_array_equal(_dropout(0.0, x), x)
  np.testing.assert_array_equal(_dropout(1.0, x), np.zeros_like(x))
  half = np.asarray(_dropout(0.5, jnp.ones((1000, 100)))) != 0
  assert abs(half.mean() - 0.5) < 5 * np.sqrt(0.25 / half.size)
