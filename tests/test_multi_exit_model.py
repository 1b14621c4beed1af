"""Multi-exit BERT against single-exit BERT, NumPy by hand, and its own per-layer path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acl_jax import hf_weights
from acl_jax.models import bert
from acl_jax.models import multi_exit
from acl_jax.models.multi_exit import MultiExitBert
from conftest import write_tiny_bert

NUM_LABELS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_dir):
  """A random 3-layer, hidden-32 checkpoint: its config and pretrained BertModel params."""
  ckpt = write_tiny_bert(tmp_path_factory.mktemp("tiny3"), minilm_dir, num_hidden_layers=3)
  return hf_weights.load_config(ckpt), hf_weights.load_bert_params(ckpt)


@pytest.fixture(scope="module")
def batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Four rows of different lengths (one all padding), with a second segment in two."""
  rng = np.random.default_rng(0)
  ids = rng.integers(1000, 2000, size=(4, 9)).astype(np.int32)
  mask = (np.arange(9)[None, :] < np.array([9, 6, 3, 0])[:, None]).astype(np.int32)
  types = np.zeros_like(ids)
  types[:2, 4:] = 1
  return ids * mask, mask, types * mask


def _init(model: MultiExitBert, pretrained, seed: int = 0) -> dict:
  """Random exit heads on the pretrained backbone, the way training starts."""
  params = model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
  params["bert"] = pretrained
  return params


def _np_pool(params, hidden) -> np.ndarray:
  dense = params["dense"]
  return np.tanh(np.asarray(hidden, np.float64)[:, 0] @ dense["kernel"] + dense["bias"])


def test_hidden_states_and_last_exit_match_single_exit_bert(tiny, batch):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS)
  params = _init(model, pretrained)
  out = model.apply({"params": params}, *batch)

  encoded = bert.BertModel(config).apply({"params": pretrained}, *batch)
  assert len(out["hidden_states"]) == config.num_hidden_layers + 1 == 4
  for got, want in zip(out["hidden_states"], encoded["hidden_states"], strict=True):
    np.testing.assert_array_equal(got, want)

  single = bert.BertForSequenceClassification(config, NUM_LABELS).apply(
      {"params": {"bert": pretrained, "classifier": params["exit_3"]["classifier"]}}, *batch)
  assert out["logits"].shape == (3, 4, NUM_LABELS) and out["logits"].dtype == jnp.float32
  np.testing.assert_allclose(out["logits"][-1], single["logits"], rtol=0, atol=1e-6)
  np.testing.assert_allclose(out["pooled"][-1], single["pooled"], rtol=0, atol=1e-6)


def test_each_exit_is_the_shared_pooler_and_its_classifier_by_hand(tiny, batch):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS)
  params = _init(model, pretrained)
  out = model.apply({"params": params}, *batch)

  assert model.resolved_exit_layers() == (1, 2, 3)
  assert out["pooled"].shape == (3, 4, config.hidden_size)
  for e, layer in enumerate((1, 2, 3)):
    pooled = _np_pool(pretrained["pooler"], out["hidden_states"][layer])
    head = params[f"exit_{layer}"]["classifier"]
    np.testing.assert_allclose(out["pooled"][e], pooled, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["logits"][e], pooled @ head["kernel"] + head["bias"],
                               rtol=0, atol=1e-5)
  # Distinct heads on distinct layers: a model that reused one exit would fail above, but
  # only if the exits' outputs actually differ.
  assert not np.allclose(out["logits"][0], out["logits"][1], atol=1e-3)

  embeddings = multi_exit.label_embeddings(params, model.resolved_exit_layers())
  assert embeddings.shape == (3, NUM_LABELS, config.hidden_size)
  for e, layer in enumerate((1, 2, 3)):
    np.testing.assert_array_equal(embeddings[e], params[f"exit_{layer}"]["classifier"]["kernel"].T)


def test_per_exit_poolers_start_as_the_pretrained_pooler(tiny, batch):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS, pooler_weights="per_exit")
  params = _init(model, pretrained)
  assert {name for name in params if name.startswith("exit_")} == {"exit_1", "exit_2", "exit_3"}
  assert not np.allclose(params["exit_1"]["pooler"]["dense"]["kernel"],
                         pretrained["pooler"]["dense"]["kernel"])  # random before the copy

  started = multi_exit.init_per_exit_poolers(params)
  for layer in (1, 2, 3):
    for leaf in ("kernel", "bias"):
      own = started[f"exit_{layer}"]["pooler"]["dense"][leaf]
      np.testing.assert_array_equal(own, pretrained["pooler"]["dense"][leaf])
      assert own is not pretrained["pooler"]["dense"][leaf]  # copies: donation-safe
  assert not np.allclose(params["exit_1"]["pooler"]["dense"]["kernel"],
                         pretrained["pooler"]["dense"]["kernel"])  # the input is left alone

  shared = MultiExitBert(config, NUM_LABELS)
  shared_params = {"bert": pretrained, **{f"exit_{layer}": {"classifier": started[
      f"exit_{layer}"]["classifier"]} for layer in (1, 2, 3)}}
  per_exit_logits = model.apply({"params": started}, *batch)["logits"]
  np.testing.assert_array_equal(per_exit_logits,
                                shared.apply({"params": shared_params}, *batch)["logits"])

  # Each exit reads its own pooler: changing exit 1's moves exit 1 only.
  moved = jax.tree.map(lambda x: x, started)
  moved["exit_1"]["pooler"]["dense"]["bias"] = started["exit_1"]["pooler"]["dense"]["bias"] + 1
  moved_logits = model.apply({"params": moved}, *batch)["logits"]
  assert not np.allclose(moved_logits[0], per_exit_logits[0])
  np.testing.assert_array_equal(moved_logits[1:], per_exit_logits[1:])

  with pytest.raises(ValueError, match="no exit has its own pooler|No exit has its own pooler"):
    multi_exit.init_per_exit_poolers(shared_params)


def test_configured_exit_layers(tiny, batch):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS, exit_layers=(3, 1))
  assert model.resolved_exit_layers() == (1, 3)
  params = _init(model, pretrained)
  assert sorted(name for name in params if name != "bert") == ["exit_1", "exit_3"]
  out = model.apply({"params": params}, *batch)
  assert out["logits"].shape == (2, 4, NUM_LABELS) and out["pooled"].shape[0] == 2

  every = MultiExitBert(config, NUM_LABELS)
  every_params = _init(every, pretrained)
  every_params["exit_1"], every_params["exit_3"] = params["exit_1"], params["exit_3"]
  expected = every.apply({"params": every_params}, *batch)["logits"]
  np.testing.assert_array_equal(out["logits"], expected[np.array([0, 2])])


@pytest.mark.parametrize("exit_layers, message", [
    ((), "empty"),
    ((0, 2), r"\[0\] not layer numbers.*1\.\.3"),
    ((1, 4), r"\[4\] not layer numbers"),
    ((2, 1, 2), r"repeats \[2\]"),
    ((1.0,), "not layer numbers"),
])
def test_invalid_exit_layers_are_refused_at_construction(tiny, exit_layers, message):
  config, _ = tiny
  with pytest.raises(ValueError, match=message):
    MultiExitBert(config, NUM_LABELS, exit_layers=exit_layers)


def test_unknown_pooler_is_refused(tiny):
  with pytest.raises(ValueError, match=r"pooler_weights='own'.*'shared', 'per_exit'"):
    MultiExitBert(tiny[0], NUM_LABELS, pooler_weights="own")


@pytest.mark.parametrize("pooler, pooler_input", [("shared", "cls"), ("per_exit", "cls"),
                                                   ("shared", "mean")])
def test_layer_by_layer_equals_the_full_forward(tiny, batch, pooler, pooler_input):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS, exit_layers=(1, 3), pooler_weights=pooler,
                        pooler_input=pooler_input)
  params = _init(model, pretrained)
  if pooler == "per_exit":
    params = multi_exit.init_per_exit_poolers(params)
    dense = params["exit_3"]["pooler"]["dense"]
    dense["bias"] = dense["bias"] + 0.5  # so running the wrong pooler would show
  variables = {"params": params}
  full = model.apply(variables, *batch)

  hidden, bias = model.apply(variables, *batch, method=MultiExitBert.embed)
  np.testing.assert_array_equal(hidden, full["hidden_states"][0])
  exits = {}
  for layer in range(1, config.num_hidden_layers + 1):
    hidden = model.apply(variables, hidden, bias, layer, method=MultiExitBert.layer)
    np.testing.assert_array_equal(hidden, full["hidden_states"][layer])
    if layer in model.resolved_exit_layers():
      exits[layer] = model.apply(variables, hidden, layer, batch[1],
                                 method=MultiExitBert.exit_head)
  for e, layer in enumerate(model.resolved_exit_layers()):
    np.testing.assert_array_equal(exits[layer]["logits"], full["logits"][e])
    np.testing.assert_array_equal(exits[layer]["pooled"], full["pooled"][e])

  with pytest.raises(ValueError, match=r"layer 2 has no exit; exits: \(1, 3\)"):
    model.apply(variables, hidden, 2, method=MultiExitBert.exit_head)


def test_exit_weights():
  np.testing.assert_allclose(multi_exit.exit_weights("asc", (1, 2, 3)), [1 / 6, 2 / 6, 3 / 6])
  np.testing.assert_allclose(multi_exit.exit_weights("uniform", (1, 2, 3)), [1 / 3] * 3)
  np.testing.assert_allclose(multi_exit.exit_weights("desc", (1, 2, 3)), [3 / 6, 2 / 6, 1 / 6])
  np.testing.assert_allclose(multi_exit.exit_weights("asc", (2, 6)), [0.25, 0.75])
  np.testing.assert_allclose(multi_exit.exit_weights("desc", (2, 6)), [0.75, 0.25])
  np.testing.assert_allclose(multi_exit.exit_weights("uniform", (4,)), [1.0])
  with pytest.raises(ValueError, match=r"'linear'.*\['asc', 'uniform', 'desc'\]"):
    multi_exit.exit_weights("linear", (1, 2))


def test_bfloat16_regression_returns_float32(tiny, batch):
  config, pretrained = tiny
  reference = MultiExitBert(config, 1)
  params = _init(reference, pretrained)
  model = MultiExitBert(config, 1, dtype=jnp.bfloat16)
  out = jax.jit(model.apply)({"params": params}, *batch)
  assert out["logits"].shape == (3, 4, 1)  # regression (STS-B): K = 1
  assert out["logits"].dtype == out["pooled"].dtype == jnp.float32
  assert out["hidden_states"][-1].dtype == jnp.bfloat16
  expected = reference.apply({"params": params}, *batch)["logits"]
  np.testing.assert_allclose(out["logits"], expected, atol=0.05)


def test_dropout_only_when_not_deterministic(tiny, batch):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS)
  params = _init(model, pretrained)

  def forward(key=None):
    rngs = None if key is None else {"dropout": jax.random.key(key)}
    return model.apply({"params": params}, *batch, deterministic=key is None, rngs=rngs)

  def logits(key=None):
    return forward(key)["logits"]

  clean = logits()  # no rng needed
  np.testing.assert_array_equal(clean, logits())
  np.testing.assert_array_equal(logits(1), logits(1))
  for e in range(3):
    assert not np.allclose(logits(1)[e], clean[e])
  assert not np.allclose(logits(1), logits(2))

  # `pooled` is taken before each exit's dropout, which then still acts on the logits.
  noisy = forward(1)
  for e, layer in enumerate((1, 2, 3)):
    head = params[f"exit_{layer}"]["classifier"]
    undropped = np.asarray(noisy["pooled"][e]) @ head["kernel"] + head["bias"]
    assert not np.allclose(noisy["logits"][e], undropped, atol=1e-4)


def _np_mean_pool(params, hidden, mask) -> np.ndarray:
  """The pooler's dense + tanh on the mean of each row's real tokens, in float64."""
  hidden, mask = np.asarray(hidden, np.float64), np.asarray(mask, np.float64)
  mean = (hidden * mask[:, :, None]).sum(1) / np.maximum(mask.sum(1), 1)[:, None]
  return np.tanh(mean @ params["dense"]["kernel"] + params["dense"]["bias"])


@pytest.mark.parametrize("pooler", multi_exit.POOLER_WEIGHTS)
def test_mean_pooled_exits_by_hand(tiny, batch, pooler):
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS, pooler_weights=pooler, pooler_input="mean")
  params = _init(model, pretrained)
  if pooler == "per_exit":
    params = multi_exit.init_per_exit_poolers(params)
    params["exit_2"]["pooler"]["dense"]["bias"] += 0.5  # so reading the wrong pooler shows
  out = model.apply({"params": params}, *batch)
  mask = batch[1]
  for e, layer in enumerate((1, 2, 3)):
    pooler_params = params[f"exit_{layer}"]["pooler"] if pooler == "per_exit" else pretrained[
        "pooler"]
    pooled = _np_mean_pool(pooler_params, out["hidden_states"][layer], mask)
    head = params[f"exit_{layer}"]["classifier"]
    np.testing.assert_allclose(out["pooled"][e], pooled, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["logits"][e], pooled @ head["kernel"] + head["bias"],
                               rtol=0, atol=1e-5)
  # The all-padding row pools to tanh(bias), not NaN.
  assert np.all(np.isfinite(out["pooled"]))
  # Not the [CLS] exits: the mean reads other positions.
  cls_out = model.clone(pooler_input="cls").apply({"params": params}, *batch)
  assert not np.allclose(out["pooled"][-1], cls_out["pooled"][-1], atol=1e-3)


def test_mean_pooled_exits_ignore_padding_tokens(tiny, batch):
  """Appending padding to every row leaves the mean-pooled exits unchanged (a mean that
  counted padded positions would move)."""
  config, pretrained = tiny
  model = MultiExitBert(config, NUM_LABELS, pooler_input="mean")
  params = _init(model, pretrained)
  ids, mask, types = batch
  pad = lambda x: np.pad(x, ((0, 0), (0, 5)))
  short = model.apply({"params": params}, ids[:3], mask[:3], types[:3])
  padded = model.apply({"params": params}, pad(ids)[:3], pad(mask)[:3], pad(types)[:3])
  np.testing.assert_allclose(padded["logits"], short["logits"], rtol=0, atol=1e-5)
  np.testing.assert_allclose(padded["pooled"], short["pooled"], rtol=0, atol=1e-5)


def test_pooler_input_in_bfloat16_sums_in_float32():
  hidden = jnp.full((1, 300, 4), 1.01, jnp.bfloat16)
  mask = jnp.ones((1, 300), jnp.int32)
  out = multi_exit.pooled_tokens(hidden, mask, "mean")
  assert out.shape == (1, 1, 4) and out.dtype == jnp.bfloat16
  # Summed in float32 and cast back once: the mean of equal values is that value.
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.float32(jnp.asarray(1.01, jnp.bfloat16)), rtol=0, atol=1e-6)
  assert multi_exit.pooled_tokens(hidden, mask, "cls") is hidden
  with pytest.raises(ValueError, match=r"pooler_input='max'.*\['cls', 'mean'\]"):
    multi_exit.pooled_tokens(hidden, mask, "max")
  with pytest.raises(ValueError, match=r"pooler_input='max'.*\['cls', 'mean'\]"):
    MultiExitBert(bert.BertConfig(), NUM_LABELS, pooler_input="max")
