"""experiments/layer_probe.py: the ridge probe against an independent least-squares solve, its
pooling against one example at a time, and its output on a tiny random BERT."""

import json

import numpy as np
import torch
import transformers

from conftest import run_experiment

import layer_probe

from acl_jax import data
from acl_jax import hf_weights


def test_ridge_matches_the_augmented_least_squares_solve():
  rng = np.random.default_rng(0)
  features, labels, ridge = rng.normal(size=(40, 5)), rng.integers(0, 3, 40), 0.3
  mean, scale, weights = layer_probe.fit_ridge(features, labels, 3, ridge)
  # The same objective written as one least-squares system: penalty rows under the data rows,
  # none for the bias column.
  x = np.concatenate([(features - mean) / scale, np.ones((40, 1))], axis=1)
  targets = np.where(labels[:, None] == np.arange(3), 1.0, -1.0)
  penalty_rows = np.sqrt(ridge * 40) * np.eye(6)[:5]
  expected = np.linalg.lstsq(np.concatenate([x, penalty_rows]),
                             np.concatenate([targets, np.zeros((5, 3))]), rcond=None)[0]
  np.testing.assert_allclose(weights, expected, rtol=1e-8, atol=1e-10)


def test_probe_is_scale_free_a_tiny_signal_on_a_large_constant_still_separates():
  # What a pretrained [CLS] state looks like in shallow layers: a large constant vector whose
  # input-dependent part is a thousandth of its norm.
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 2, 200)
  signal = rng.normal(size=(200, 8)) + 2.0 * labels[:, None]
  features = 100.0 + 1e-3 * signal
  score = lambda preds, y: float(np.mean(preds == y))
  result = layer_probe.probe(features[:150], labels[:150], features[150:], labels[150:], 2,
                             score)
  assert result["dev"] > 0.9 and result["ridge"] in layer_probe.RIDGES
  shuffled = layer_probe.probe(features[:150], rng.permutation(labels[:150]), features[150:],
                               labels[150:], 2, score)
  assert shuffled["dev"] < 0.75  # labels it cannot know: no better than about chance


def test_pooling_matches_each_example_alone(tiny_bert_dir, glue_dir, monkeypatch):
  monkeypatch.setenv("GLUE_DIR", str(glue_dir))
  tokenizer = hf_weights.load_tokenizer(tiny_bert_dir)
  model = transformers.BertModel.from_pretrained(str(tiny_bert_dir)).eval()
  examples = data.load_split("rte", "validation")
  n = 6
  subset = type(examples)(text_a=examples.text_a[:n], text_b=examples.text_b[:n],
                          labels=examples.labels[:n], source=examples.source,
                          line_numbers=examples.line_numbers[:n])
  # Batches of 4 sorted by length: padded, reordered, and split across two batches.
  pooled = layer_probe.pooled_layers(model, tokenizer, subset, max_length=128, batch_size=4)
  assert pooled["cls"].shape == pooled["mean"].shape == (3, n, model.config.hidden_size)
  for i in range(n):
    alone = tokenizer(subset.text_a[i], subset.text_b[i], truncation=True, max_length=128,
                      return_tensors="pt")
    with torch.no_grad():
      hidden = torch.stack(model(**alone, output_hidden_states=True).hidden_states)[:, 0]
    np.testing.assert_allclose(pooled["cls"][:, i], hidden[:, 0].numpy(), atol=1e-5)
    np.testing.assert_allclose(pooled["mean"][:, i], hidden.mean(1).numpy(), atol=1e-5)


def test_one_line_per_layer_and_pooling(tiny_bert_dir, glue_dir):
  proc = run_experiment("layer_probe.py", "--model", tiny_bert_dir, "--task", "rte",
                        "--train_examples", "40", glue_dir=glue_dir)
  assert proc.returncode == 0, proc.stderr
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert rows[0]["pooling"] == "majority class"
  assert [(r["layer"], r["pooling"]) for r in rows[1:]] == [
      (layer, pooling) for layer in range(3) for pooling in ("cls", "mean")]
  assert all(r["train_examples"] == 40 and r["dev_examples"] == 277 for r in rows[1:])
  assert all(0.0 <= r["dev"] <= 1.0 for r in rows)
  # Layer 0's [CLS] is the same embedding for every example: the probe can only learn the
  # bias, which predicts the majority class.
  assert rows[1]["dev"] == rows[0]["dev"]


def test_regression_tasks_are_refused(tiny_bert_dir, glue_dir):
  proc = run_experiment("layer_probe.py", "--model", tiny_bert_dir, "--task", "stsb",
                        glue_dir=glue_dir)
  assert proc.returncode != 0 and "regression" in proc.stderr
