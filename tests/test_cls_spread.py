"""experiments/cls_spread.py on a tiny random BERT: one line per layer, spreads that mean what
they say."""

import json
import os
import subprocess
import sys

import numpy as np

from conftest import REPO_ROOT

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
  env = {**os.environ, "GLUE_DIR": str(glue_dir), "HF_HUB_OFFLINE": "1"}
  proc = subprocess.run([sys.executable, "experiments/cls_spread.py", "--model",
                         str(tiny_bert_dir), "--task", "rte", "--examples", "8"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [r["layer"] for r in rows] == [0, 1, 2]  # embeddings + the tiny model's 2 layers
  # [CLS] is the same token at the same position in every example: its embedding is identical.
  assert rows[0]["cls_spread"] == 0.0 and rows[0]["token1_spread"] > 0.0
  assert all(r["cls_spread"] > 0.0 for r in rows[1:])  # attention mixes the input in
