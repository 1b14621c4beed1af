"""experiments/cls_spread.py on a tiny random BERT: one line per layer, spreads that mean what
they say."""

import json

import numpy as np

from conftest import run_experiment

import cls_spread


def test_spread_is_zero_for_identical_vectors_and_scale_free():
  rng = np.random.default_rng(0)
  center = rng.normal(size=16)
  assert cls_spread.spread(np.tile(center, (5, 1))) == 0.0
  vectors = center + 0.1 * rng.normal(size=(5, 16))
  expected = np.mean([np.linalg.norm(v - vectors.mean(0)) for v in vectors]) / np.linalg.norm(
      vectors.mean(0))
  assert np.isclose(cls_spread.spread(vectors), expected)
  assert np.isclose(cls_spread.spread(3.0 * vectors), expected)


def test_one_line_per_layer_and_the_embedded_cls_does_not_vary(tiny_bert_dir, glue_dir):
  proc = run_experiment("cls_spread.py", "--model", tiny_bert_dir, "--task", "rte",
                        "--examples", "8", glue_dir=glue_dir)
  assert proc.returncode == 0, proc.stderr
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [r["layer"] for r in rows] == [0, 1, 2]  # embeddings + the tiny model's 2 layers
  # [CLS] is the same token at the same position in every example: its embedding is identical.
  assert rows[0]["cls_spread"] == 0.0 and rows[0]["token1_spread"] > 0.0
  assert all(r["cls_spread"] > 0.0 for r in rows[1:])  # attention mixes the input in
