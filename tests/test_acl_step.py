"""The ACL train step: one forward, one vjp, the gate, the update, all in one jitted function.

The reference here computes the two gradients with two separate jax.grad calls (the same
per-example dropout keys, hence the same dropout masks), gates them in NumPy, and applies the same optimizer.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from acl_jax import data
from acl_jax import hf_weights
from acl_jax import losses
from acl_jax import objectives
from acl_jax import optim
from acl_jax import train
from acl_jax.models import bert
from conftest import keyed_forward, rte_train_batches, step_config, tiny_run_config

TEMPERATURE, LAMBDA = 0.3, 0.5


@pytest.fixture(scope="module")
def setup(tiny_bert_dir, glue_dir, tmp_path_factory):
  task = data.get_task("rte")
  batches = rte_train_batches(tiny_bert_dir, glue_dir, tmp_path_factory.mktemp("cache"), count=6,
                              seed=0)
  model = bert.BertForSequenceClassification(config=hf_weights.load_config(tiny_bert_dir),
                                             num_labels=2)
  params = model.init(jax.random.key(0), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"]
  # Plain SGD with lr 1: the update is the gradient itself, so the comparison sees its scale
  # (Adam's first step would only see its sign).
  tx, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
  return task, model, params, batches, tx, schedule


def _reference_grads(model, params, batch, dropout_rng):
  """CE's and lambda * ACL-Embed's gradients from two separate jax.grad calls."""
  def forward(p):
    return keyed_forward(model, p, batch, dropout_rng)

  def ce_loss(p):
    return losses.cross_entropy(forward(p)["logits"], batch["labels"], mask=batch["mask"])

  def aux_loss(p):
    return LAMBDA * losses.acl_embed(forward(p)["pooled"], batch["labels"],
                                     p["classifier"]["kernel"].T, temperature=TEMPERATURE,
                                     mask=batch["mask"])

  return jax.grad(ce_loss)(params), jax.grad(aux_loss)(params)


reference_grads = jax.jit(_reference_grads, static_argnums=0)


def reference_update(model, params, batch, dropout_rng, tx, opt_state, *, mode):
  g_ce, g_aux = jax.tree.map(np.float64, reference_grads(model, params, batch, dropout_rng))
  dot = sum(float((a * b).sum()) for a, b in zip(jax.tree.leaves(g_ce), jax.tree.leaves(g_aux)))
  ce_sq = sum(float((a * a).sum()) for a in jax.tree.leaves(g_ce))
  if mode == "drop":
    grads = g_ce if dot < 0 else jax.tree.map(np.add, g_ce, g_aux)
  elif mode == "project":
    scale = dot / ce_sq if dot < 0 else 0.0
    grads = jax.tree.map(lambda c, a: c + a - scale * c, g_ce, g_aux)
  else:
    grads = jax.tree.map(np.add, g_ce, g_aux)
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
  updates, _ = tx.update(grads, opt_state, params)
  return jax.tree.map(lambda p, u: p + u, params, updates), dot


@pytest.mark.parametrize("objective,mode", [("acl", "drop"), ("acl_project", "project")])
def test_gated_update_equals_two_separate_grads(setup, objective, mode):
  task, model, params, batches, tx, schedule = setup
  config = step_config(objective=objective, aux_weight=LAMBDA, temperature=TEMPERATURE)
  step = jax.jit(objectives.make_train_step(model, tx, schedule, task, config))
  seen = set()
  for i, batch in enumerate(batches):
    state = optim.TrainState(step=jnp.asarray(i, jnp.int32), params=params,
                             opt_state=tx.init(params))
    rng = jax.random.key(100 + i)
    new_state, metrics = step(state, batch, rng)
    expected, dot = reference_update(model, params, batch, jax.random.fold_in(rng, i), tx,
                                     tx.init(params), mode=mode)
    conflict = dot < 0
    seen.add(conflict)
    np.testing.assert_allclose(float(metrics["dot"]), dot, rtol=1e-3, atol=1e-9)
    if mode == "drop":
      assert float(metrics["kept"]) == (0.0 if conflict else 1.0)
    for got, want in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # An update that moved nothing would match any reference.
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_state.params),
                                                         jax.tree.leaves(params)))
  # The batches must exercise both branches of the gate, or the test proves half of it.
  assert seen == {True, False}, f"only conflict={seen} seen; pick other batches"


def test_ungated_objective_is_the_plain_sum(setup):
  """acl_embed and scl take one backward pass of the summed loss; SCL mixes (1-l) CE + l SCL."""
  task, model, params, batches, tx, schedule = setup
  batch, rng = batches[0], jax.random.key(7)
  state = optim.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))
  config = step_config(objective="acl_embed", aux_weight=LAMBDA, temperature=TEMPERATURE)
  got, metrics = jax.jit(objectives.make_train_step(model, tx, schedule, task, config))(
      state, batch, rng)
  expected, _ = reference_update(model, params, batch, jax.random.fold_in(rng, 0), tx,
                                 tx.init(params), mode="none")
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert "kept" not in metrics and "aux" in metrics

  config = step_config(objective="scl", aux_weight=0.3, temperature=TEMPERATURE)
  got, metrics = jax.jit(objectives.make_train_step(model, tx, schedule, task, config))(
      state, batch, rng)
  out = keyed_forward(model, params, batch, jax.random.fold_in(rng, 0))
  ce = losses.cross_entropy(out["logits"], batch["labels"], mask=batch["mask"])
  scl = losses.scl(out["pooled"], batch["labels"], temperature=TEMPERATURE, mask=batch["mask"])
  np.testing.assert_allclose(metrics["loss"], 0.7 * ce + 0.3 * scl, rtol=1e-5)


def test_measure_conflict_logs_cosine_without_changing_the_update(setup):
  task, model, params, batches, tx, schedule = setup
  state = optim.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))
  make = lambda **kw: jax.jit(objectives.make_train_step(
      model, tx, schedule, task,
      step_config(objective="scl", aux_weight=LAMBDA, temperature=TEMPERATURE, **kw)))
  plain, _ = make()(state, batches[1], jax.random.key(3))
  measured, metrics = make(measure_conflict=True)(state, batches[1], jax.random.key(3))
  assert -1.0 <= float(metrics["cosine"]) <= 1.0 and float(metrics["kept"]) == 1.0
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(measured.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_acl_run_logs_gate_terms(tiny_bert_dir, glue_dir, tmp_path):
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,objective=acl,max_steps=4")
  train.train_and_evaluate(config, str(tmp_path / "run"))
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
          .splitlines() if '"loss"' in line]
  assert len(rows) == 2
  for row in rows:
    assert {"ce", "aux", "cosine", "kept", "dot"} <= set(row)
    assert 0.0 <= row["kept"] <= 1.0 and -1.0 <= row["cosine"] <= 1.0
    # Per-step statistics of the 2-step window: under gate mode drop a step is kept exactly
    # when its gradients do not conflict (the step's own decision, made in the graph).
    assert row["conflict_rate"] in (0.0, 0.5, 1.0)
    assert row["conflict_rate"] == pytest.approx(1.0 - row["kept"])
    assert -1.0 <= row["cosine_min"] <= row["cosine"] <= row["cosine_max"] <= 1.0


def test_a_log_line_keeps_the_conflict_rate_and_the_cosine_range_per_exit():
  window = [{"loss": 1.0, "lr": 0.1, "dot": np.array([-1.0, 2.0]),
             "cosine": np.array([-0.5, 0.2])},
            {"loss": 3.0, "lr": 0.2, "dot": np.array([0.5, 1.0]),
             "cosine": np.array([0.1, 0.4])},
            {"loss": 2.0, "lr": 0.3, "dot": np.array([-0.1, 0.0]),
             "cosine": np.array([-0.05, 0.0])}]
  logged = train.summarize_window(window)
  assert logged["loss"] == 2.0 and logged["lr"] == 0.3
  np.testing.assert_allclose(logged["conflict_rate"], [2 / 3, 0.0])  # a zero dot keeps
  np.testing.assert_allclose(logged["cosine"], [-0.15, 0.2])
  np.testing.assert_allclose(logged["cosine_min"], [-0.5, 0.0])
  np.testing.assert_allclose(logged["cosine_max"], [0.1, 0.4])
  assert "conflict_rate" not in train.summarize_window([{"loss": 1.0, "lr": 0.1}])


def test_contrastive_objective_on_regression_task_is_refused(tiny_bert_dir, glue_dir, tmp_path):
  config = tiny_run_config(tiny_bert_dir, glue_dir, "stsb", objective="acl")
  with pytest.raises(ValueError, match=r"objective='acl'.*stsb.*regression.*objective=ce"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
