"""Multi-exit training: per-exit and global ACL-Grad against exit-by-exit references, KD,
DeeBERT's frozen second stage, and per-exit evaluation."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import hf_weights
from acl_jax import losses
from acl_jax import objectives
from acl_jax import optim
from acl_jax import run_dir
from acl_jax import train
from acl_jax import models
from acl_jax.models import multi_exit
from conftest import (keyed_forward, rte_train_batches, step_config, tiny_run_config,
                      write_tiny_bert)

TEMPERATURE, LAMBDA, MU = 0.3, 0.5, 0.7


@pytest.fixture(scope="module")
def setup(minilm_dir, glue_dir, tmp_path_factory):
  ckpt = write_tiny_bert(tmp_path_factory.mktemp("tiny3"), minilm_dir, num_hidden_layers=3)
  task = data.get_task("rte")
  batches = rte_train_batches(ckpt, glue_dir, tmp_path_factory.mktemp("cache"), count=3,
                              seed=1)
  model = multi_exit.MultiExitBert(config=hf_weights.load_config(ckpt), num_labels=2)
  params = model.init(jax.random.key(0), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"]
  # Plain SGD with lr 1: the update is the gradient itself, so the comparison sees its scale
  # (Adam's first step would only see its sign).
  tx, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
  weights = multi_exit.exit_weights("asc", model.resolved_exit_layers())
  return ckpt, task, model, params, batches, tx, schedule, weights


def exit_terms(model, params, batch, rng, objective, *, cl_anchors="all", normalize=True):
  """Per-exit CE and aux (lambda, mu included), written out exit by exit."""
  out = keyed_forward(model, params, batch, rng)
  layers = model.resolved_exit_layers()
  emb = [params[f"exit_{e}"]["classifier"]["kernel"].T for e in layers]
  labels, mask = batch["labels"], batch["mask"]
  ce, aux = [], []
  for i in range(len(layers)):
    ce.append(losses.cross_entropy(out["logits"][i], labels, mask=mask))
    if objective == "kd":
      aux.append(LAMBDA * losses.kd(out["logits"][i], out["logits"][-1], temperature=2.0,
                                    mask=mask) if i < len(layers) - 1 else 0.0)
      continue
    term = LAMBDA * losses.acl_embed(out["pooled"][i], labels, emb[i], temperature=TEMPERATURE,
                                     mask=mask, normalize_labels=normalize)
    if objective.startswith("acl_cl") and i < len(layers) - 1:
      term += MU * losses.acl_cl(out["pooled"][i], emb[i], out["pooled"][-1], emb[-1], labels,
                                 temperature=TEMPERATURE, mask=mask,
                                 label_anchors=cl_anchors == "all", normalize_labels=normalize)
    aux.append(term)
  return ce, aux


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("cl_anchors", "normalize"))
def _reference_grads(model, params, batch, rng, weights, objective, **switches):
  """Exit e's CE and aux gradients, each from its own jax.grad (2E separate calls)."""
  def grad(i, which):
    return jax.grad(lambda p: weights[i] * exit_terms(model, p, batch, rng, objective,
                                                      **switches)[which][i])(params)
  n = len(model.resolved_exit_layers())
  return [grad(i, 0) for i in range(n)], [grad(i, 1) for i in range(n)]


def reference_grads(model, params, batch, rng, weights, objective, **switches):
  return jax.tree.map(np.float64, _reference_grads(model, params, batch, rng, weights,
                                                   objective, **switches))


def tree_dot(a, b):
  return sum(float((x * y).sum()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def apply(tx, params, grads):
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
  updates, _ = tx.update(grads, tx.init(params), params)
  return jax.tree.map(lambda p, u: p + u, params, updates)


# One compiled step per (model, step options), reused across batches: a per-exit-gate step takes
# tens of seconds to compile on a 2-core CPU, and the batches share one shape.
_STEPS = {}


def run_step(setup, batch_index, **kwargs):
  _, task, model, params, batches, tx, schedule, weights = setup
  key = (id(model), tuple(sorted(kwargs.items())))
  if key not in _STEPS:
    objective = kwargs.pop("objective")
    config = step_config("rte,multi_exit", objective=objective, aux_weight=LAMBDA,
                         temperature=TEMPERATURE, cl_weight=MU, **kwargs)
    stage = objectives.Stage("train", objective, weights)
    _STEPS[key] = jax.jit(objectives.make_train_step(model, tx, schedule, task, config, stage))
  step = _STEPS[key]
  state = optim.TrainState(step=jnp.asarray(batch_index, jnp.int32), params=params,
                           opt_state=tx.init(params))
  rng = jax.random.key(50 + batch_index)
  new_state, metrics = step(state, batches[batch_index], rng)
  return new_state, metrics, jax.random.fold_in(rng, batch_index)


def assert_trees_close(a, b, before=None):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-6)
  if before is not None:  # an update that moved nothing would match any reference
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                                         jax.tree.leaves(before)))


# gate_chunk 1 is the default; 2 over 3 exits pads the last chunk with a zero exit. ACL-CL
# runs with its switches (anchors on the samples only, raw label embeddings) in the step's
# config and in the reference; ACL-Embed with the defaults.
@pytest.mark.parametrize("objective,gate_chunk,switches", [
    ("acl", 2, {}), ("acl_cl", 1, {"cl_anchors": "samples", "normalize": False})])
def test_per_exit_gate_equals_exit_by_exit_reference(setup, objective, gate_chunk, switches):
  _, task, model, params, batches, tx, schedule, weights = setup
  step_switches = {("normalize_label_embeddings" if k == "normalize" else k): v
                   for k, v in switches.items()}
  decisions = []
  for b in range(len(batches)):
    new_state, metrics, rng = run_step(setup, b, objective=objective, gate_chunk=gate_chunk,
                                       **step_switches)
    g_ce, g_aux = reference_grads(model, params, batches[b], rng, weights, objective,
                                  **switches)
    total = jax.tree.map(np.zeros_like, g_ce[0])
    for e in range(len(weights)):
      dot = tree_dot(g_ce[e], g_aux[e])
      kept = dot >= 0
      decisions.append(kept)
      total = jax.tree.map(lambda t, c, a: t + c + (a if kept else 0.0), total, g_ce[e], g_aux[e])
      np.testing.assert_allclose(metrics["dot"][e], dot, rtol=1e-3, atol=1e-9)
      assert float(metrics["kept"][e]) == float(kept)
    assert_trees_close(new_state.params, apply(tx, params, total), params)
  # Both branches of the gate must occur, or the test proves half of it.
  assert set(decisions) == {True, False}, decisions


def test_global_gate_is_one_decision_on_the_sums(setup):
  _, task, model, params, batches, tx, schedule, weights = setup
  for b in range(len(batches)):
    new_state, metrics, rng = run_step(setup, b, objective="acl", gate_granularity="global")
    g_ce, g_aux = reference_grads(model, params, batches[b], rng, weights, "acl")
    ce_sum = jax.tree.map(lambda *g: sum(g), *g_ce)
    aux_sum = jax.tree.map(lambda *g: sum(g), *g_aux)
    dot = tree_dot(ce_sum, aux_sum)
    assert metrics["kept"].shape == () and float(metrics["kept"]) == float(dot >= 0)
    expected = ce_sum if dot < 0 else jax.tree.map(np.add, ce_sum, aux_sum)
    assert_trees_close(new_state.params, apply(tx, params, expected), params)


def test_acl_cl_project_removes_the_conflicting_component_of_the_sums(setup):
  """Gate mode project under the global gate: on conflict the summed aux gradient loses its
  component along the summed CE gradient (PCGrad, one-sided)."""
  _, task, model, params, batches, tx, schedule, weights = setup
  conflicts = []
  for b in range(len(batches)):
    new_state, metrics, rng = run_step(setup, b, objective="acl_cl_project",
                                       gate_granularity="global")
    g_ce, g_aux = reference_grads(model, params, batches[b], rng, weights, "acl_cl")
    ce_sum = jax.tree.map(lambda *g: sum(g), *g_ce)
    aux_sum = jax.tree.map(lambda *g: sum(g), *g_aux)
    dot = tree_dot(ce_sum, aux_sum)
    conflicts.append(dot < 0)
    scale = min(dot, 0.0) / tree_dot(ce_sum, ce_sum)
    expected = jax.tree.map(lambda c, a: c + a - scale * c, ce_sum, aux_sum)
    assert_trees_close(new_state.params, apply(tx, params, expected), params)
  assert any(conflicts), "no batch conflicted: the projection went untested"


def test_kd_is_the_weighted_sum_with_distillation_on_shallow_exits(setup):
  _, task, model, params, batches, tx, schedule, weights = setup
  new_state, metrics, rng = run_step(setup, 0, objective="kd")
  g_ce, g_aux = reference_grads(model, params, batches[0], rng, weights, "kd")
  expected = jax.tree.map(lambda *g: sum(g), *g_ce, *g_aux)
  assert_trees_close(new_state.params, apply(tx, params, expected), params)
  assert float(metrics["aux"][-1]) == 0.0 and float(metrics["aux"][0]) > 0.0


def multi_exit_config(ckpt, glue_dir, preset):
  return tiny_run_config(ckpt, glue_dir, f"rte,multi_exit,{preset}")


def test_deebert_second_stage_trains_only_the_off_ramps(setup, glue_dir):
  """Stage 2 trains each shallow exit's off-ramp (its own pooler and classifier) on the summed
  off-ramp losses, as DeeBERT does; the backbone and the final exit stay frozen."""
  ckpt, task, _, _, batches, _, _, _ = setup
  config = multi_exit_config(ckpt, glue_dir, "objective=deebert,pooler_weights=per_exit,"
                             "max_steps=2")
  model = models.from_config(config, hf_weights.load_config(ckpt), task.num_labels)
  params = multi_exit.init_per_exit_poolers(
      model.init(jax.random.key(0), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"])
  stages = objectives.stages_of(config, model)
  assert [s.name for s in stages] == ["final_exit", "other_exits"]
  np.testing.assert_array_equal(stages[1].exit_weights, [1.0, 1.0, 0.0])  # a sum
  config.warmup_ratio = 0.0
  frozen_tx, frozen_schedule = optim.create_optimizer(config, 10, frozen=stages[1].frozen)
  make_step = lambda frozen: objectives.make_train_step(
      model, frozen_tx, frozen_schedule, task, config,
      objectives.Stage("other_exits", "ce", stages[1].exit_weights, frozen))
  state = optim.TrainState(step=jnp.asarray(3, jnp.int32), params=params,
                           opt_state=frozen_tx.init(params))
  args = (state, batches[0], jax.random.key(0))
  compile_step = lambda frozen: jax.jit(make_step(frozen)).lower(*args).compile()
  step = compile_step(stages[1].frozen)
  new_state, metrics = step(*args)
  # Nothing reads the frozen gradients, so XLA drops the backbone's backward pass: the step
  # costs well under the one that logs the norm of every gradient (about 2.7x fewer FLOPs).
  flops = lambda compiled: compiled.cost_analysis()["flops"]
  assert flops(step) < 0.6 * flops(compile_step(None))
  # ... and the logged grad_norm is the off-ramps' gradient norm (what clipping sees).
  g_ce, _ = reference_grads(model, params, batches[0], jax.random.fold_in(jax.random.key(0), 3),
                            jnp.asarray(stages[1].exit_weights), "kd")
  total = jax.tree.map(lambda *g: sum(g), *g_ce)
  trained_norm = np.sqrt(sum(float((g ** 2).sum()) for root in ("exit_1", "exit_2")
                             for g in jax.tree.leaves(total[root])))
  np.testing.assert_allclose(float(metrics["grad_norm"]), trained_norm, rtol=1e-4)
  for root in ("bert", "exit_3"):
    for before, after in zip(jax.tree.leaves(params[root]),
                             jax.tree.leaves(new_state.params[root])):
      np.testing.assert_array_equal(before, after)
  for root in ("exit_1", "exit_2"):
    assert set(params[root]) == {"pooler", "classifier"}
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params[root]),
                                                         jax.tree.leaves(new_state.params[root]))]
    assert all(changed)

  # Both stages in one run, and across their boundary after a crash: test_run_dir.
  shared = multi_exit_config(ckpt, glue_dir, "max_steps=2")
  shared.objective = "deebert"
  with pytest.raises(ValueError, match="pooler_weights=per_exit"):
    config_lib.validate(shared)


@pytest.fixture(scope="module")
def mean_pooled_run(setup, glue_dir, tmp_path_factory):
  """A 2-step multi-exit ACL-CL run whose exits pool the token mean: (config, workdir, results,
  train rows of metrics.jsonl), read before any test changes the workdir. One run serves the
  reporting test and the mean-pooling test (each run compiles a per-exit-gate step)."""
  workdir = tmp_path_factory.mktemp("mean_pooled") / "run"
  config = multi_exit_config(setup[0], glue_dir, "objective=acl_cl,pooler_input=mean,max_steps=2")
  results = train.train_and_evaluate(config, str(workdir))
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()
          if '"loss"' in line]
  return config, workdir, results, rows


def test_multi_exit_run_reports_every_exit_and_their_average(mean_pooled_run):
  _, _, results, rows = mean_pooled_run
  dev = results["final"]["validation"]
  assert set(dev) == {"exit1/accuracy", "exit2/accuracy", "exit3/accuracy", "avg/accuracy"}
  np.testing.assert_allclose(dev["avg/accuracy"],
                             np.mean([dev[f"exit{e}/accuracy"] for e in (1, 2, 3)]))
  assert results["main_metric"] == "validation/avg/accuracy"
  assert len(rows[0]["kept"]) == 3 and len(rows[0]["ce"]) == 3


def test_multi_exit_objectives_need_the_multi_exit_preset(tiny_bert_dir, glue_dir, tmp_path):
  with pytest.raises(ValueError, match="objective='kd' needs a multi-exit model"):
    config_lib.get_config(f"rte,model={tiny_bert_dir},objective=kd")
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,objective=ce", objective="kd")
  with pytest.raises(ValueError, match="objective='kd' needs a multi-exit model"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()  # refused before the workdir was touched


def test_mean_pooled_exits_train_reload_resume_and_refuse_export(mean_pooled_run):
  config, workdir, results, _ = mean_pooled_run
  config = config.copy_and_resolve_references()
  assert set(results["final"]["validation"]) >= {"exit1/accuracy", "avg/accuracy"}
  run = run_dir.load_trained_run(workdir)
  assert run.model.pooler_input == "mean"
  # The reloaded model pools the mean: its exits differ from the same params read at [CLS].
  batch = next(iter(data.eval_batches(run.load_encoded("validation"), batch_size=8,
                                      boundaries=run.boundaries)))
  inputs = [batch[k] for k in data.MODEL_INPUTS]
  mean_logits = run.model.apply({"params": run.params}, *inputs)["logits"]
  cls_logits = run.model.clone(pooler_input="cls").apply({"params": run.params}, *inputs)["logits"]
  assert not np.allclose(mean_logits, cls_logits, atol=1e-4)
  with pytest.raises(ValueError, match=r"pooler_input='mean'.*BertForSequenceClassification"):
    hf_weights.export_hf(run, run.workdir / run_dir.EXPORT_DIR)

  # A config.json written before the field existed reads as [CLS] exits: such runs reload,
  # resume under a [CLS] config, and refuse a mean one.
  path = workdir / "config.json"
  saved = json.loads(path.read_text())
  del saved["config"]["pooler_input"]
  path.write_text(json.dumps(saved))
  assert run_dir.load_trained_run(workdir).model.pooler_input == "cls"
  with pytest.raises(ValueError, match=r"another config \(pooler_input: 'cls' -> 'mean'\)"):
    train.train_and_evaluate(config, str(workdir))
  config.pooler_input = "cls"
  resumed = train.train_and_evaluate(config, str(workdir))
  assert resumed["checkpoints"]["resumed_from_step"] == 2


@pytest.mark.parametrize("multi, pooler_input, message", [
    (True, "max", r"config\.pooler_input='max'; valid: cls, mean"),
    (False, "mean", r"pooler_input='mean' sets what multi-exit exits pool.*`multi_exit`"),
])
def test_bad_pooler_input_is_refused_before_loading(tiny_bert_dir, glue_dir, tmp_path, multi,
                                                    pooler_input, message):
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,objective=ce", multi_exit=multi,
                           pooler_input=pooler_input)
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()  # refused before the workdir was touched


def _deeper_teacher_terms(logits, pooled, label_emb, batch):
  """ACL-Embed per exit plus ACL-CL against every deeper exit (teachers under stop-gradient),
  written out exit by exit: a term that reads other exits than its own."""
  labels, mask = batch["labels"], batch["mask"]
  n = logits.shape[0]
  main = jnp.stack([losses.cross_entropy(logits[e], labels, mask=mask) for e in range(n)])
  aux = []
  for e in range(n):
    term = LAMBDA * losses.acl_embed(pooled[e], labels, label_emb[e], temperature=TEMPERATURE,
                                     mask=mask)
    for t in range(e + 1, n):
      term += MU / (n - 1 - e) * losses.acl_cl(pooled[e], label_emb[e], pooled[t], label_emb[t],
                                               labels, temperature=TEMPERATURE, mask=mask)
    aux.append(term)
  return (main, jnp.stack(aux)), logits


def matmul_flops(jaxpr) -> float:
  """2 * M * N * K summed over the dot_generals a jaxpr runs, sub-programs included. A scan
  runs its body `length` times; a lax.switch inside it counts the mean of its branches, which
  is exact for exit_gate's loop (iteration k takes branch k, so each branch runs once)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      k = np.prod([eqn.invars[0].aval.shape[d] for d in lhs_contract])
      total += 2.0 * np.prod(eqn.outvars[0].aval.shape) * k
    elif eqn.primitive.name == "cond":
      branches = eqn.params["branches"]
      total += sum(matmul_flops(b.jaxpr) for b in branches) / len(branches)
    else:
      inner = sum(matmul_flops(getattr(v, "jaxpr", v)) for v in eqn.params.values()
                  if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"))
      total += inner * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else inner
  return total


# Chunks of 2 exits run in test_per_exit_gate_equals_exit_by_exit_reference[acl-2].
@pytest.mark.parametrize("pooler_weights, pooler_input, exit_layers, chunk", [
    ("shared", "cls", None, 1), ("per_exit", "mean", (1, 3), 2)])
def test_exit_by_exit_backward_equals_one_vjp_of_the_whole_forward(setup, pooler_weights,
                                                                   pooler_input, exit_layers,
                                                                   chunk):
  """exit_gate's truncated backward passes against gradients.gated_value_and_grad's single vjp
  of the full forward (the per-exit step before exit_gate): same loss, decisions, gradients."""
  from acl_jax import exit_gate, gradients
  ckpt, _, _, _, batches, _, _, _ = setup
  model = multi_exit.MultiExitBert(config=hf_weights.load_config(ckpt), num_labels=2,
                                   exit_layers=exit_layers, pooler_weights=pooler_weights,
                                   pooler_input=pooler_input)
  params = model.init(jax.random.key(1), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"]
  batch, rng = batches[2], jax.random.key(11)

  def whole(p):
    out = keyed_forward(model, p, batch, rng)
    label_emb = multi_exit.label_embeddings(p, model.resolved_exit_layers())
    return _deeper_teacher_terms(out["logits"], out["pooled"], label_emb, batch)

  one_vjp = jax.jit(gradients.gated_value_and_grad(whole, granularity="per_term", has_aux=True))
  examples = {**{k: batch[k] for k in data.MODEL_INPUTS},
              "dropout_key": models.example_keys(rng, batch["labels"].shape[0])}
  exit_by_exit = jax.jit(lambda p: exit_gate.per_exit_gated_grads(
      model, p, examples, lambda *out: _deeper_teacher_terms(*out, batch), mode="drop",
      chunk=chunk))
  (want_loss, want_logits), want_grads, want_info = one_vjp(params)
  (loss, logits), grads, info = exit_by_exit(params)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-6, atol=1e-6)  # the same dropout
  np.testing.assert_array_equal(info["kept"], want_info["kept"])
  np.testing.assert_allclose(info["dot"], want_info["dot"], rtol=1e-4, atol=1e-9)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  if chunk == 1 and exit_layers is None:
    # The work is the cost model's: 3 layers, an exit on each, backward passes through
    # 2 * (1 + 2 + 3) = 12 layers against 3 for one backward pass of the summed loss (matmul
    # FLOPs counted in the traced programs, not a timing).
    flops = lambda f: matmul_flops(jax.make_jaxpr(f)(params).jaxpr)
    summed = jax.grad(lambda p: sum(jnp.sum(t) for t in whole(p)[0]))
    model_ratio = (exit_gate.layer_passes(3, (1, 2, 3), gate="per_exit")["cost"]
                   / exit_gate.layer_passes(3, (1, 2, 3), gate="none")["cost"])
    assert flops(exit_by_exit) / flops(summed) == pytest.approx(model_ratio, rel=0.15)
