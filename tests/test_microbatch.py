"""Exact micro-batching: a batch run in micro-batches gives the unsplit step's loss, gradients,
gate decisions and update, with every contrastive term over the whole batch."""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import gradients
from acl_jax import hf_weights
from acl_jax import losses
from acl_jax import models
from acl_jax import objectives
from acl_jax import optim
from acl_jax.models import bert
from acl_jax.models import multi_exit
from conftest import keyed_forward, rte_train_batches, step_config

# A plain-JAX model with three exits whose auxiliary terms couple every example of the batch
# (a softmax over all pairs, as a contrastive loss does) and read a parameter directly (label
# embeddings, as ACL-Embed does), so a micro-batch alone could not compute them.


def mlp_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"hidden": [jnp.asarray(rng.normal(size=(4, 4)) * 0.7, jnp.float32) for _ in range(3)],
          "heads": jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32),
          "labels": jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32)}


def mlp_features(params, examples):
  """Per example: each exit's hidden vector [N, 3, 4] and logits [N, 3, 2]."""
  h, hidden, logits = examples["x"], [], []
  for e, kernel in enumerate(params["hidden"]):
    h = jnp.tanh(h @ kernel)
    hidden.append(h)
    logits.append(h @ params["heads"][e])
  return {"hidden": jnp.stack(hidden, 1), "logits": jnp.stack(logits, 1)}


def mlp_terms(params, features, y):
  logits, hidden = features["logits"], features["hidden"]
  main = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None, None], -1), (0, 2))
  aux = []
  for e in range(3):
    z = hidden[:, e] / jnp.linalg.norm(hidden[:, e], axis=-1, keepdims=True)
    pairs = jax.nn.log_softmax(z @ z.T / 0.5 - 1e9 * jnp.eye(len(y)), axis=-1)
    same = (y[:, None] == y[None]) & ~jnp.eye(len(y), dtype=bool)
    contrast = -jnp.sum(jnp.where(same, pairs, 0.0)) / jnp.maximum(same.sum(), 1)
    anchor = -jnp.mean(jax.nn.log_softmax(z @ params["labels"][e].T)[jnp.arange(len(y)), y])
    aux.append(contrast + anchor)
  aux = jnp.stack(aux) * jnp.array([-0.7, 0.3, 0.2])
  return (main, aux), logits


def mlp_batch(size=16, seed=1):
  rng = np.random.default_rng(seed)
  return ({"x": jnp.asarray(rng.normal(size=(size, 4)), jnp.float32)},
          jnp.asarray(rng.integers(0, 2, size=size)))


def flat(tree):
  return np.concatenate([np.asarray(l, np.float64).ravel() for l in jax.tree.leaves(tree)])


@pytest.mark.parametrize("splits", [2, 4, 16])
def test_microbatched_term_gradients_equal_separate_grads(splits):
  params, (examples, y) = mlp_params(), mlp_batch()
  whole = lambda p: jnp.concatenate(mlp_terms(p, mlp_features(p, examples), y)[0])
  fun = gradients.Microbatched(mlp_features, mlp_terms, splits)

  @jax.jit
  def microbatched(params):
    vec, pull_back, (_, logits) = gradients._vjp(fun, params, (examples, y), True)
    return vec, logits, pull_back(jnp.eye(6))  # every term's gradient, main and aux apart

  vec, logits, rows = microbatched(params)
  np.testing.assert_allclose(vec, whole(params), rtol=1e-6)
  np.testing.assert_allclose(logits, mlp_features(params, examples)["logits"], rtol=1e-5,
                             atol=1e-6)
  want = jax.jit(jax.jacrev(whole))(params)  # row t: term t's own gradient
  for t in range(6):
    np.testing.assert_allclose(flat(jax.tree.map(lambda g: g[t], rows)),
                               flat(jax.tree.map(lambda g: g[t], want)),
                               rtol=1e-5, atol=1e-7, err_msg=f"term {t}")


@pytest.mark.parametrize("granularity", ["per_term", "global"])
@pytest.mark.parametrize("mode", ["drop", "project"])
def test_microbatched_gate_equals_the_unsplit_gate(granularity, mode):
  params, (examples, y) = mlp_params(), mlp_batch()
  unsplit = gradients.gated_value_and_grad(
      lambda p, ex, y: mlp_terms(p, mlp_features(p, ex), y), mode=mode,
      granularity=granularity, chunk=2, has_aux=True)
  (want_loss, want_logits), want_grads, want_info = jax.jit(unsplit)(params, examples, y)
  if granularity == "per_term":
    # both branches of the gate
    assert (want_info["dot"] < 0).any() and (want_info["dot"] > 0).any(), want_info["dot"]
  for splits in (2, 8):
    fun = gradients.Microbatched(mlp_features, mlp_terms, splits)
    (loss, logits), grads, info = jax.jit(gradients.gated_value_and_grad(
        fun, mode=mode, granularity=granularity, chunk=2, has_aux=True))(params, examples, y)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(info["kept"] > 0, want_info["kept"] > 0)
    for key in ("dot", "cosine", "kept"):
      np.testing.assert_allclose(info[key], want_info[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(flat(grads), flat(want_grads), rtol=1e-5, atol=1e-7)


def test_microbatched_value_and_grad_is_jax_value_and_grad():
  params, (examples, y) = mlp_params(2), mlp_batch(12, seed=3)
  summed = lambda p: sum(t.sum() for t in mlp_terms(p, mlp_features(p, examples), y)[0])
  want_loss, want = jax.value_and_grad(summed)(params)
  fun = gradients.Microbatched(mlp_features, mlp_terms, 3)
  (loss, _), grads = gradients.value_and_grad(fun, has_aux=True)(params, examples, y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(flat(grads), flat(want), rtol=1e-5, atol=1e-7)


def test_microbatched_refuses_a_batch_it_cannot_split():
  with pytest.raises(ValueError, match="num_microbatches=0"):
    gradients.Microbatched(mlp_features, mlp_terms, 0)
  fun = gradients.Microbatched(mlp_features, mlp_terms, 5)
  examples, y = mlp_batch(16)
  with pytest.raises(ValueError, match="batch of 16 does not split into 5 micro-batches"):
    gradients.value_and_grad(fun, has_aux=True)(mlp_params(), examples, y)


# Dropout keyed per example: an example's masks do not depend on its batch.

def test_an_example_sees_the_same_dropout_in_any_batch(tiny_bert_dir):
  model = bert.BertForSequenceClassification(config=hf_weights.load_config(tiny_bert_dir),
                                             num_labels=2)
  rng = np.random.default_rng(0)
  inputs = [jnp.asarray(rng.integers(1000, 2000, size=(6, 16)), jnp.int32),
            jnp.ones((6, 16), jnp.int32), jnp.zeros((6, 16), jnp.int32)]
  params = model.init(jax.random.key(0), *(x[:1] for x in inputs))["params"]
  keys = models.example_keys(jax.random.key(7), 6)

  @functools.partial(jax.jit, static_argnames="deterministic")
  def forward(keys, *inputs, deterministic=False):
    one = lambda key, *x: model.apply({"params": params}, *x, deterministic=deterministic,
                                      rngs={"dropout": key})["logits"]
    return models.per_example(one)(keys, *inputs)

  whole = forward(keys, *inputs)
  order = np.array([4, 1, 5])
  part = forward(keys[order], *(x[order] for x in inputs))
  np.testing.assert_allclose(part, whole[order], rtol=1e-5, atol=1e-6)
  plain = model.apply({"params": params}, *inputs)["logits"]
  np.testing.assert_allclose(forward(keys, *inputs, deterministic=True), plain, rtol=1e-5,
                             atol=1e-6)
  assert not np.allclose(whole, plain, atol=1e-3)  # dropout did act
  # fold_in(rng, i): example 2's key is the same in a batch of 6 and in a batch of 3.
  np.testing.assert_array_equal(jax.random.key_data(models.example_keys(jax.random.key(7), 3)),
                                jax.random.key_data(keys[:3]))


# The train step on a tiny BERT: micro-batched against unsplit, every logged term, the gate's
# dot products and decisions, and the updated parameters.

@pytest.fixture(scope="module")
def setup(tiny_bert_dir, glue_dir, tmp_path_factory):
  batch = rte_train_batches(tiny_bert_dir, glue_dir, tmp_path_factory.mktemp("cache"), count=1,
                            seed=3, batch_size=16, max_length=32)[0]
  return data.get_task("rte"), hf_weights.load_config(tiny_bert_dir), batch


def one_step(model, task, batch, **fields):
  config = step_config("rte", multi_exit=isinstance(model, multi_exit.MultiExitBert),
                       aux_weight=0.5, temperature=0.3, **fields)
  params = model.init(jax.random.key(0), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"]
  tx, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
  state = optim.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))
  step = jax.jit(objectives.make_train_step(model, tx, schedule, task, config))
  new_state, metrics = step(state, batch, jax.random.key(5))
  return params, new_state.params, jax.device_get(metrics)


@pytest.mark.parametrize("multi, objective, granularity", [
    (False, "acl", "global"), (True, "acl_cl", "per_exit"), (True, "acl_cl", "global")])
def test_microbatched_step_equals_the_unsplit_step(setup, multi, objective, granularity):
  task, bert_config, batch = setup
  model = (multi_exit.MultiExitBert(config=bert_config, num_labels=2) if multi
           else bert.BertForSequenceClassification(config=bert_config, num_labels=2))
  before, want_params, want = one_step(model, task, batch, objective=objective,
                                       gate_granularity=granularity)
  assert set(want) >= {"loss", "ce", "aux", "dot", "cosine", "kept", "grad_norm"}
  # One split here (the MLP tests above take several; tests/test_parallel.py another on 8
  # devices): each costs a compilation of the step.
  for microbatch_size in (4,):
    _, params, got = one_step(model, task, batch, objective=objective,
                              gate_granularity=granularity, microbatch_size=microbatch_size)
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{key}, micro-batches of {microbatch_size}")
    np.testing.assert_array_equal(got["kept"], want["kept"])
    np.testing.assert_allclose(flat(params), flat(want_params), rtol=1e-5, atol=1e-6)
  assert not np.allclose(flat(want_params), flat(before))  # the step moved the parameters


def test_the_unsplit_step_reads_dropout_keyed_per_example(setup):
  # The micro-batched step matches the unsplit one because both key dropout per example; this
  # pins the unsplit step's loss to a forward written out example by example.
  task, bert_config, batch = setup
  model = bert.BertForSequenceClassification(config=bert_config, num_labels=2)
  params, _, metrics = one_step(model, task, batch, objective="ce")
  logits = keyed_forward(model, params, batch, jax.random.fold_in(jax.random.key(5), 0))["logits"]
  np.testing.assert_allclose(metrics["loss"], losses.cross_entropy(
      logits, batch["labels"], mask=batch["mask"]), rtol=1e-6)


def test_microbatch_size_must_divide_the_batch():
  with pytest.raises(ValueError, match=r"microbatch_size=12 must divide batch_size=32"):
    config_lib.get_config("rte,microbatch_size=12")
  with pytest.raises(ValueError, match=r"microbatch_size=-8"):
    config_lib.get_config("rte,microbatch_size=-8")
  assert config_lib.get_config("rte,batch_size=128,microbatch_size=32").microbatch_size == 32


def test_the_readme_examples_run_and_agree():
  # The README's two snippets (the transform on a plain-JAX model, then the same loss
  # micro-batched) run as written, and the micro-batched gate equals the unsplit one.
  readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  section = readme.split("## Using the losses and the gate in your own JAX code")[1]
  section = section.split("\n## Batches larger than memory")[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2
  rng = np.random.default_rng(0)
  namespace = {
      "params": {"encoder": jnp.asarray(rng.normal(size=(5, 6)), jnp.float32),
                 "classifier": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
                 "bias": jnp.zeros(3, jnp.float32)},
      "x": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
      "labels": jnp.asarray(rng.integers(0, 3, size=8)), "mask": jnp.ones(8, jnp.float32)}
  exec(blocks[0], namespace)  # pylint: disable=exec-used
  ns = namespace
  params, opt_state, loss, info = ns["step"](ns["params"], ns["tx"].init(ns["params"]), ns["x"],
                                             ns["labels"], ns["mask"])
  assert np.isfinite(loss) and set(info) == {"dot", "cosine", "kept"}
  want_loss, want_grads, want_info = ns["acl_grad"](ns["params"], ns["x"], ns["labels"],
                                                    ns["mask"])
  exec(blocks[1], namespace)  # pylint: disable=exec-used
  np.testing.assert_allclose(ns["loss"], want_loss, rtol=1e-5)
  np.testing.assert_allclose(ns["info"]["dot"], want_info["dot"], rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(flat(ns["grads"]), flat(want_grads), rtol=1e-5, atol=1e-6)
