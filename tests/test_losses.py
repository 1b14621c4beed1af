"""Losses against NumPy re-derivations written here, independently of acl_jax.losses."""

import jax
import jax.numpy as jnp
import numpy as np

from acl_jax import losses


def np_cross_entropy(logits, labels, mask):
  logits = logits.astype(np.float64)
  shifted = logits - logits.max(axis=1, keepdims=True)
  log_z = np.log(np.exp(shifted).sum(axis=1))
  nll = log_z - shifted[np.arange(len(labels)), labels]
  return (nll * mask).sum() / mask.sum()


def test_cross_entropy_matches_numpy_and_ignores_padded_rows():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(9, 3)).astype(np.float32) * 4
  labels = rng.integers(0, 3, size=9)
  mask = np.array([1, 1, 0, 1, 1, 1, 0, 0, 1], np.float32)
  expected = np_cross_entropy(logits, labels, mask)
  np.testing.assert_allclose(losses.cross_entropy(logits, labels, mask=mask), expected, rtol=1e-5)
  np.testing.assert_allclose(losses.cross_entropy(logits[:4], labels[:4]),
                             np_cross_entropy(logits[:4], labels[:4], np.ones(4)), rtol=1e-5)
  # Garbage in padded rows (huge logits, out-of-range labels) changes nothing.
  logits[mask == 0] = 1e4
  labels[mask == 0] = 7
  np.testing.assert_allclose(losses.cross_entropy(logits, labels, mask=mask), expected, rtol=1e-5)


def test_cross_entropy_gradient_is_softmax_minus_onehot():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(5, 4)).astype(np.float32)
  labels = rng.integers(0, 4, size=5)
  grad = jax.grad(lambda x: losses.cross_entropy(x, labels))(logits)
  p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  np.testing.assert_allclose(grad, (p - np.eye(4)[labels]) / 5, atol=1e-6)


def test_bfloat16_inputs_reduce_in_float32():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(64, 2)).astype(np.float32)
  labels = rng.integers(0, 2, size=64)
  out = losses.cross_entropy(jnp.asarray(logits, jnp.bfloat16), labels)
  assert out.dtype == jnp.float32
  expected = np_cross_entropy(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32), labels,
                              np.ones(64))
  np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_all_padding_batch_is_zero_not_nan():
  out = losses.cross_entropy(np.zeros((3, 2), np.float32), np.zeros(3, np.int32),
                             mask=np.zeros(3, np.float32))
  assert float(out) == 0.0


def test_mse_matches_numpy():
  rng = np.random.default_rng(3)
  pred = rng.normal(size=(8, 1)).astype(np.float32)
  target = rng.uniform(0, 5, size=8).astype(np.float32)
  mask = np.array([1, 0, 1, 1, 0, 1, 1, 1], np.float32)
  expected = ((pred[:, 0] - target) ** 2 * mask).sum() / mask.sum()
  np.testing.assert_allclose(losses.mse(pred, target, mask=mask), expected, rtol=1e-6)
