"""Early exit: policies on hand-built logits, counted vs real (batch 1 and batched) exits."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acl_jax import data
from acl_jax import early_exit
from acl_jax import hf_weights
from acl_jax import train
from acl_jax.models import multi_exit
from conftest import tiny_run_config, write_tiny_bert


def confident(classes, strength=8.0, num_labels=2):
  """Logits [E, 1, K] putting most mass on classes[e]."""
  out = np.zeros((len(classes), 1, num_labels), np.float32)
  for e, c in enumerate(classes):
    out[e, 0, c] = strength
  return out


def logits_with_entropies(normalized):
  """Two-class logits [E, 1, 2] whose normalized entropies are the given values."""
  out = []
  for h in normalized:
    # Binary entropy is monotone on p in [0.5, 1]: bisect for H(p)/log 2 = h.
    lo, hi = 0.5, 1.0
    for _ in range(60):
      p = (lo + hi) / 2
      ent = -(p * math.log(p) + (1 - p) * math.log(1 - p)) / math.log(2)
      lo, hi = (p, hi) if ent > h else (lo, p)
    out.append([[math.log(p), math.log(1 - p)]])
  return np.asarray(out, np.float32)


def exit_of(policy, logits, regression=False):
  chosen, preds = early_exit.counted_exits(policy, jnp.asarray(logits), regression=regression)
  return int(chosen[0]), np.asarray(preds)[0]


def test_entropy_exits_at_the_first_confident_exit():
  logits = np.concatenate([confident([0], 0.1), confident([1], 0.5), confident([1], 6.0),
                           confident([0], 9.0)])
  # Entropies (nats): ~0.69, ~0.65, ~0.017, ~0.001.
  assert exit_of(early_exit.Policy("entropy", 0.1), logits) == (2, 1)
  assert exit_of(early_exit.Policy("entropy", 0.005), logits) == (3, 0)
  assert exit_of(early_exit.Policy("entropy", 0.68), logits)[0] == 1
  # Nothing below the threshold: the last exit decides.
  assert exit_of(early_exit.Policy("entropy", 1e-6), logits) == (3, 0)


def test_patience_exits_after_t_unchanged_predictions():
  logits = confident([0, 1, 1, 1, 0, 0])
  assert exit_of(early_exit.Policy("patience", 1), logits) == (2, 1)
  assert exit_of(early_exit.Policy("patience", 2), logits) == (3, 1)
  assert exit_of(early_exit.Policy("patience", 3), logits) == (5, 0)  # never: last exit


def test_pcee_counts_consecutive_confident_exits():
  logits = logits_with_entropies([0.9, 0.2, 0.8, 0.1, 0.1, 0.5])
  assert exit_of(early_exit.Policy("pcee", 0.3, patience=2), logits)[0] == 4
  assert exit_of(early_exit.Policy("pcee", 0.3, patience=1), logits)[0] == 1
  assert exit_of(early_exit.Policy("pcee", 0.95, patience=3), logits)[0] == 2
  assert exit_of(early_exit.Policy("pcee", 0.05, patience=1), logits)[0] == 5


def test_regression_patience_uses_the_change_between_exits():
  values = np.array([1.0, 2.0, 2.05, 2.08, 3.0, 3.01], np.float32)[:, None, None]
  assert exit_of(early_exit.Policy("patience", 2, tolerance=0.1), values, True) == (
      3, pytest.approx(2.08))
  assert exit_of(early_exit.Policy("patience", 1, tolerance=0.02), values, True)[0] == 5
  with pytest.raises(ValueError, match="entropy policy needs class probabilities"):
    exit_of(early_exit.Policy("entropy", 0.1), values, True)


def reference_exit(policy, logits):
  """Per-example loop, written from docs/method.md ("Early exit") without the library's state machine."""
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ent = -(probs * np.log(np.maximum(probs, 1e-30))).sum(-1)
  preds = logits.argmax(-1)
  count = 0
  for e in range(len(logits)):
    if policy.name == "entropy" and ent[e] < policy.threshold:
      return e
    if policy.name == "patience":
      count = count + 1 if e > 0 and preds[e] == preds[e - 1] else 0
      if count >= policy.threshold:
        return e
    if policy.name == "pcee":
      count = count + 1 if ent[e] / math.log(logits.shape[-1]) < policy.threshold else 0
      if count >= policy.patience:
        return e
  return len(logits) - 1


@pytest.mark.parametrize("policy", [early_exit.Policy("entropy", 0.3),
                                    early_exit.Policy("patience", 2),
                                    early_exit.Policy("pcee", 0.5, patience=2)])
def test_counted_exits_match_a_per_example_loop_on_random_batches(policy):
  rng = np.random.default_rng(0)
  logits = (rng.normal(size=(6, 200, 3)) * rng.uniform(0.1, 4, size=(6, 200, 1))
            ).astype(np.float32)
  chosen, preds = early_exit.counted_exits(policy, jnp.asarray(logits))
  expected = [reference_exit(policy, logits[:, b]) for b in range(200)]
  np.testing.assert_array_equal(np.asarray(chosen), expected)
  np.testing.assert_array_equal(np.asarray(preds), logits[expected, np.arange(200)].argmax(-1))
  assert len(set(expected)) > 2  # the batch exercises several exits


def test_speedup_conventions():
  out = early_exit.speedup(np.array([3, 6, 3, 6]), 6)
  assert out == {"mean_layers": 4.5, "speedup": 0.25, "speedup_ratio": pytest.approx(6 / 4.5)}


@pytest.fixture(scope="module")
def trained_like(tmp_path_factory, minilm_dir, glue_dir):
  """A 4-layer random multi-exit BERT whose exits disagree and are confident to varying
  degrees (scaled classifiers), with the first RTE dev examples."""
  path = write_tiny_bert(tmp_path_factory.mktemp("ee_bert"), minilm_dir, num_hidden_layers=4)
  bert_config = hf_weights.load_config(path)
  model = multi_exit.MultiExitBert(config=bert_config, num_labels=2)
  dummy = jnp.zeros((1, 8), jnp.int32)
  params = model.init(jax.random.key(0), dummy, dummy, dummy)["params"]
  params["bert"] = jax.tree.map(jnp.asarray, hf_weights.load_bert_params(path, bert_config))
  for i, layer in enumerate(model.resolved_exit_layers()):
    kernel = params[f"exit_{layer}"]["classifier"]["kernel"]
    params[f"exit_{layer}"]["classifier"]["kernel"] = kernel * (20.0 * 2 ** i)
  tokenizer = hf_weights.load_tokenizer(path)
  dev = data.load_encoded("rte", "validation", tokenizer, max_length=64, glue_dir=glue_dir,
                          cache_dir=tmp_path_factory.mktemp("cache"))
  return model, params, dev


POLICIES = [early_exit.Policy("entropy", 0.2), early_exit.Policy("entropy", 0.5),
            early_exit.Policy("patience", 1), early_exit.Policy("patience", 2),
            early_exit.Policy("pcee", 0.6, patience=2)]


# None: an exit after every layer.
EXITS_AND_POOLING = [(None, "cls"), ((2, 4), "cls"), (None, "mean")]


def _pooled_by(model, params, pooler_input):
  """The trained-like model with exits that pool `pooler_input`. In this random model the
  token mean varies less across examples than [CLS] does, so mean-pooled exits get 10x
  sharper classifiers: without them every policy exits at the same layer or two."""
  if pooler_input == "cls":
    return model, params
  params = {name: ({**sub, "classifier": {**sub["classifier"],
                                          "kernel": sub["classifier"]["kernel"] * 10.0}}
                   if name.startswith("exit_") else sub) for name, sub in params.items()}
  return model.clone(pooler_input=pooler_input), params


@pytest.mark.parametrize("exit_layers, pooler_input", EXITS_AND_POOLING)
def test_real_early_exit_matches_counted_mode_and_skips_layers(trained_like, exit_layers,
                                                               pooler_input):
  model, params, dev = trained_like
  model, params = _pooled_by(model, params, pooler_input)  # mean: padded batch-1 inputs need the mask
  if exit_layers:  # layers 1 and 3 run without an exit head
    model = model.clone(exit_layers=exit_layers)
    params = {k: v for k, v in params.items() if k not in ("exit_1", "exit_3")}
  boundaries = (32, 64)
  examples = early_exit.single_examples(dev, boundaries)[:24]
  runner = early_exit.EarlyExitRunner(model, params)
  layer_calls = []  # one entry per layer computed: plain layers and fused layer-and-exit calls
  counting = lambda fn: lambda *args: layer_calls.append(1) or fn(*args)
  runner.layer = counting(runner.layer)
  make_fused = runner.layer_and_exit
  runner.layer_and_exit = lambda policy: counting(make_fused(policy))
  exits_seen = set()
  forward = jax.jit(lambda *inputs: model.apply({"params": params}, *inputs)["logits"])
  for policy in POLICIES:
    for ids, mask, types in examples:
      full = forward(ids, mask, types)
      chosen, preds = early_exit.counted_exits(policy, full)
      layer_calls.clear()
      pred, layer = runner(policy, ids, mask, types)
      assert layer == model.resolved_exit_layers()[int(chosen[0])]
      assert pred[0] == preds[0]
      assert len(layer_calls) == layer  # the layers after the exit never ran
      exits_seen.add(layer)
  assert len(exits_seen) >= (2 if exit_layers else 3)


@pytest.mark.parametrize("exit_layers, pooler_input", EXITS_AND_POOLING)
def test_compiled_runner_matches_counted_mode_and_skips_layers(trained_like, exit_layers,
                                                               pooler_input):
  model, params, dev = trained_like
  model, params = _pooled_by(model, params, pooler_input)  # mean: padded batch-1 inputs need the mask
  if exit_layers:
    model = model.clone(exit_layers=exit_layers)
    params = {k: v for k, v in params.items() if k not in ("exit_1", "exit_3")}
  examples = early_exit.single_examples(dev, (32, 64))[:16]
  runner = early_exit.CompiledEarlyExit(model, params)
  # A host callback inside the compiled layer runs once per layer the program computes: in
  # the untaken branch of a lax.cond it never fires.
  layers_run = []
  layer_fn = runner.layer_fn
  def counted_layer(p, hidden, bias):
    jax.debug.callback(lambda: layers_run.append(1))
    return layer_fn(p, hidden, bias)
  runner.layer_fn = counted_layer
  forward = jax.jit(lambda *inputs: model.apply({"params": params}, *inputs)["logits"])
  exits_seen = set()
  for policy in POLICIES:
    for ids, mask, types in examples:
      chosen, preds = early_exit.counted_exits(policy, forward(ids, mask, types))
      layers_run.clear()
      pred, layer = runner(policy, ids, mask, types)
      jax.effects_barrier()
      assert layer == model.resolved_exit_layers()[int(chosen[0])]
      assert pred[0] == preds[0]
      assert len(layers_run) == layer  # the layers after the exit never ran
      exits_seen.add(layer)
  assert len(exits_seen) >= (2 if exit_layers else 3)


@pytest.mark.parametrize("pooler_input", multi_exit.POOLER_INPUTS)
def test_batched_server_path_matches_counted_mode(trained_like, pooler_input):
  model, params, dev = trained_like
  model, params = _pooled_by(model, params, pooler_input)  # mean: compacted rows keep their own mask
  server = early_exit.BatchedEarlyExit(model, params)
  batches = list(data.eval_batches(dev, batch_size=16, boundaries=(32, 64)))[:3]
  for policy in POLICIES:
    for batch in batches:
      inputs = [batch[k] for k in data.MODEL_INPUTS]
      chosen, preds = early_exit.counted_exits(policy, model.apply({"params": params},
                                                                   *inputs)["logits"])
      got_preds, got_layers = server(policy, *inputs)
      np.testing.assert_array_equal(got_layers, np.asarray(chosen) + 1)
      np.testing.assert_array_equal(got_preds, np.asarray(preds))


def test_early_exit_mode_writes_results_and_curve(tiny_bert_dir, glue_dir, tmp_path):
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,multi_exit,objective=ce,"
                           "max_steps=4")
  workdir = tmp_path / "run"
  train.train_and_evaluate(config, workdir)
  result = early_exit.run_on_workdir(workdir, max_examples=6, log=lambda _: None)
  on_disk = json.loads((workdir / "early_exit.json").read_text())
  assert on_disk["policies"].keys() == {"entropy", "patience", "pcee"}
  assert (workdir / "early_exit.png").stat().st_size > 1000
  final_exit = json.loads((workdir / "eval_results.json").read_text())["final"]["validation"]
  # The reloaded params reproduce the run's own dev metric at every exit.
  for layer in (1, 2):
    assert result["per_exit"][f"exit{layer}"]["accuracy"] == pytest.approx(
        final_exit[f"exit{layer}/accuracy"])
  for rows in on_disk["policies"].values():
    for row in rows:
      assert row["exits_agree_with_counted"] == 1.0
      # Two layers: the counted speed-ups in closed form from the mean exit layer, and the
      # real runner used exactly the layers counted mode says.
      assert 1.0 <= row["mean_layers"] <= 2.0
      assert row["speedup_ratio"] == pytest.approx(2.0 / row["mean_layers"])
      assert row["speedup"] == pytest.approx(1.0 - row["mean_layers"] / 2.0)
      assert row["measured_mean_layers"] == pytest.approx(row["counted_mean_layers_on_measured"])
      assert row["measured_latency_ms"] > 0
  assert {r["policy"] for r in on_disk["batched"]} == {"entropy", "patience", "pcee"}
  for row in on_disk["runner_comparison"]:
    assert row["exits_agree"] == 1.0 and row["per_layer_latency_ms"] > 0
    assert row["compiled_latency_ms"] > 0


def test_early_exit_mode_needs_a_run_directory(tmp_path):
  # A trained single-exit run is refused too: test_train's run-directory test.
  with pytest.raises(FileNotFoundError, match="not a run directory"):
    early_exit.run_on_workdir(tmp_path / "nothing")


def test_the_pareto_front_keeps_the_best_metric_at_each_speedup():
  points = [(1.0, 0.70), (1.5, 0.72), (1.6, 0.65), (2.0, 0.66), (2.5, 0.50), (1.2, 0.69)]
  assert early_exit.pareto_front(points) == [(1.5, 0.72), (2.0, 0.66), (2.5, 0.50)]
  assert early_exit.pareto_front([]) == []


def test_tradeoff_curves_average_the_seeds_of_a_label_per_threshold():
  """Two seeds of one objective are averaged threshold by threshold (not pooled, which would
  draw the luckier seed's points); another label gets its own curve; one panel per policy."""
  def sweep(objective, rows):
    return {"objective": objective, "main_metric": "accuracy", "policies": {"entropy": [
        {"threshold": t, "speedup_ratio": s, "metrics": {"accuracy": m},
         "measured_speedup_ratio": s * 0.9} for t, s, m in rows]}}
  seeds = [sweep("acl_cl", [(0.1, 1.0, 0.70), (0.5, 2.0, 0.60), (0.9, 3.0, 0.40)]),
           sweep("acl_cl", [(0.1, 1.2, 0.72), (0.5, 2.2, 0.70), (0.9, 2.8, 0.30)])]
  curves = early_exit.tradeoff_curves([*seeds, sweep("ce", [(0.1, 1.0, 0.5)])])
  assert set(curves) == {"entropy"} and set(curves["entropy"]) == {"acl_cl", "ce"}
  front = curves["entropy"]["acl_cl"]["counted"]
  np.testing.assert_allclose(front, [(1.1, 0.71), (2.1, 0.65), (2.9, 0.35)])
  np.testing.assert_allclose(curves["entropy"]["acl_cl"]["measured"],
                             [(0.99, 0.71), (1.89, 0.65), (2.61, 0.35)])
