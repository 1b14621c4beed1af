"""Losses against NumPy re-derivations written here, independently of acl_jax.losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


# Contrastive losses and KD. The references below loop over anchors and positives in float64,
# written from docs/method.md ("Losses"), and share no code with acl_jax.losses.

def np_supcon(vectors, labels, anchors, tau, raw=()):
  """SupCon over a list of candidate vectors; `anchors` are indices into it, and those in `raw`
  are not normalized."""
  z = []
  for i, v in enumerate(vectors):
    norm = np.linalg.norm(v)
    z.append(v if i in raw else v / norm if norm > 0 else np.zeros_like(v))
  terms = []
  for i in anchors:
    others = [a for a in range(len(z)) if a != i]
    positives = [p for p in others if labels[p] == labels[i]]
    if not positives:
      continue
    log_denominator = np.log(sum(np.exp(z[i] @ z[a] / tau) for a in others))
    terms.append(-np.mean([z[i] @ z[p] / tau - log_denominator for p in positives]))
  return float(np.mean(terms)) if terms else 0.0


def np_scl(features, labels, mask, tau):
  keep = [i for i in range(len(labels)) if mask[i]]
  return np_supcon([np.float64(features[i]) for i in keep], [labels[i] for i in keep],
                   range(len(keep)), tau)


def np_acl_embed(features, labels, label_embeddings, mask, tau, anchors, normalize_labels=True):
  keep = [i for i in range(len(labels)) if mask[i]]
  k = len(label_embeddings)
  vectors = [np.float64(features[i]) for i in keep] + [np.float64(w) for w in label_embeddings]
  element_labels = [labels[i] for i in keep] + list(range(k))
  n_anchors = len(keep) + k if anchors == "all" else len(keep)
  raw = () if normalize_labels else range(len(keep), len(keep) + k)
  return np_supcon(vectors, element_labels, range(n_anchors), tau, raw)


def np_acl_cl(student, student_w, teacher, teacher_w, labels, mask, tau, label_anchors,
              normalize_labels=True):
  keep = [i for i in range(len(labels)) if mask[i]]
  n, k = len(keep), len(student_w)
  view_labels = [labels[i] for i in keep] + list(range(k))
  vectors = ([np.float64(student[i]) for i in keep] + [np.float64(w) for w in student_w]
             + [np.float64(teacher[i]) for i in keep] + [np.float64(w) for w in teacher_w])
  n_anchors = n + (k if label_anchors else 0)
  raw = () if normalize_labels else [*range(n, n + k), *range(2 * n + k, 2 * n + 2 * k)]
  return np_supcon(vectors, view_labels + view_labels, range(n_anchors), tau, raw)


def np_kd(student, teacher, mask, temp):
  rows = []
  for i in range(len(mask)):
    if not mask[i]:
      continue
    s = np.float64(student[i]) / temp
    t = np.float64(teacher[i]) / temp
    p_teacher = np.exp(t - t.max()) / np.exp(t - t.max()).sum()
    log_p_student = s - s.max() - np.log(np.exp(s - s.max()).sum())
    rows.append(-temp ** 2 * (p_teacher * log_p_student).sum())
  return float(np.mean(rows)) if rows else 0.0


def contrastive_batch(seed, n=8, d=5, k=3):
  """Features, labels, mask, two classifier matrices and a teacher batch; class k-1 has one
  example (an anchor without a positive in SCL) and row 5 is padding."""
  rng = np.random.default_rng(seed)
  features = rng.normal(size=(n, d)).astype(np.float32)
  labels = np.array(([0, 1] * n)[:n - 1] + [k - 1], np.int32)
  mask = np.ones(n, np.float32)
  mask[5] = 0
  w = rng.normal(size=(k, d)).astype(np.float32)
  teacher = rng.normal(size=(n, d)).astype(np.float32)
  teacher_w = rng.normal(size=(k, d)).astype(np.float32)
  return features, labels, mask, w, teacher, teacher_w


# Each case: (name, jax function of its differentiable arrays, NumPy reference, arrays).
def loss_cases(seed=0, tau=0.3):
  features, labels, mask, w, teacher, teacher_w = contrastive_batch(seed)
  logits, teacher_logits = features[:, :3] * 3, teacher[:, :3] * 3

  def embed(anchors, normalize=True):
    return (lambda f, lw, m=mask: losses.acl_embed(f, labels, lw, temperature=tau, mask=m,
                                                   anchors=anchors, normalize_labels=normalize),
            lambda f, lw, m=mask: np_acl_embed(f, labels, lw, m, tau, anchors, normalize),
            (features, w))

  def cl(label_anchors, normalize=True):
    return (lambda f, lw, m=mask: losses.acl_cl(f, lw, teacher, teacher_w, labels,
                                                temperature=tau, mask=m,
                                                label_anchors=label_anchors,
                                                normalize_labels=normalize),
            lambda f, lw, m=mask: np_acl_cl(f, lw, teacher, teacher_w, labels, m, tau,
                                            label_anchors, normalize), (features, w))

  return {
      "scl": (lambda f, m=mask: losses.scl(f, labels, temperature=tau, mask=m),
              lambda f, m=mask: np_scl(f, labels, m, tau), (features,)),
      "acl_embed_all": embed("all"),
      "acl_embed_samples": embed("samples"),
      "acl_embed_raw_labels": embed("all", normalize=False),
      "acl_cl": cl(True),
      "acl_cl_no_label_anchors": cl(False),
      "acl_cl_raw_labels": cl(True, normalize=False),
      "kd": (lambda s, m=mask: losses.kd(s, teacher_logits, temperature=2.0, mask=m),
             lambda s, m=mask: np_kd(s, teacher_logits, m, 2.0), (logits,)),
  }


CASES = sorted(loss_cases())


@pytest.mark.parametrize("name", CASES)
def test_loss_matches_numpy(name):
  for seed, tau in ((0, 0.3), (1, 0.07)):
    fn, reference, arrays = loss_cases(seed, tau)[name]
    out = fn(*arrays)
    assert out.dtype == jnp.float32 and out.shape == ()
    np.testing.assert_allclose(out, reference(*arrays), rtol=2e-5, atol=1e-6)


def numeric_grad(f, x, eps=1e-5):
  x = np.float64(x)
  grad = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[idx] = eps
    grad[idx] = (f(x + step) - f(x - step)) / (2 * eps)
  return grad


@pytest.mark.parametrize("name", CASES)
def test_gradient_matches_finite_differences(name):
  fn, reference, arrays = loss_cases(2, 0.5)[name]
  grads = jax.grad(fn, argnums=tuple(range(len(arrays))))(*arrays)
  for j, (x, g) in enumerate(zip(arrays, grads)):
    def f(xj, j=j):
      return reference(*arrays[:j], xj, *arrays[j + 1:])
    expected = numeric_grad(f, x)
    np.testing.assert_allclose(g, expected, atol=2e-5 * max(1, np.abs(expected).max()))
  assert np.abs(grads[0][5]).max() == 0  # the padded row


def test_no_gradient_reaches_the_teacher():
  features, labels, mask, w, teacher, teacher_w = contrastive_batch(3)
  grads = jax.grad(lambda t, tw: losses.acl_cl(features, w, t, tw, labels, temperature=0.3,
                                               mask=mask), argnums=(0, 1))(teacher, teacher_w)
  grad_kd = jax.grad(lambda t: losses.kd(features, t, temperature=2.0))(teacher)
  for g in (*grads, grad_kd):
    assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("name", CASES)
def test_padded_rows_with_garbage_change_nothing(name):
  fn, _, arrays = loss_cases(4)[name]
  argnums = tuple(range(len(arrays)))
  value, grads = jax.value_and_grad(fn, argnums=argnums)(*arrays)
  garbage = np.array(arrays[0])
  garbage[5] = 1e30
  garbage[5, 0] = np.nan
  value2, grads2 = jax.value_and_grad(fn, argnums=argnums)(garbage, *arrays[1:])
  np.testing.assert_allclose(value2, value, rtol=1e-6)
  for g, g2 in zip(grads, grads2):
    np.testing.assert_allclose(g2, g, rtol=1e-6, atol=1e-9)
  # Any label on a padded row: build the batch again with the label changed.
  features, labels, mask, w, *_ = contrastive_batch(4)
  relabelled = labels.copy()
  relabelled[5] = 2
  for loss in (lambda y: losses.scl(features, y, temperature=0.3, mask=mask),
               lambda y: losses.acl_embed(features, y, w, temperature=0.3, mask=mask)):
    np.testing.assert_allclose(loss(relabelled), loss(labels), rtol=1e-6)


@pytest.mark.parametrize("name", [c for c in CASES if c != "kd"])
def test_invariant_to_batch_permutation_and_row_scaling(name):
  """Normalized vectors make every loss blind to each row's scale, except raw label embeddings,
  whose scale is then their logits'."""
  features, labels, mask, w, teacher, teacher_w = contrastive_batch(5)
  rng = np.random.default_rng(5)
  perm = rng.permutation(len(labels))
  scale = rng.uniform(0.01, 100, size=(len(labels), 1)).astype(np.float32)
  w_scale = rng.uniform(0.01, 100, size=(len(w), 1)).astype(np.float32)

  def loss(f, y, m, lw, t):
    if name == "scl":
      return losses.scl(f, y, temperature=0.3, mask=m)
    normalize = not name.endswith("raw_labels")
    if name.startswith("acl_embed"):
      return losses.acl_embed(f, y, lw, temperature=0.3, mask=m, normalize_labels=normalize,
                              anchors="samples" if name.endswith("samples") else "all")
    return losses.acl_cl(f, lw, t, teacher_w, y, temperature=0.3, mask=m,
                         label_anchors=name != "acl_cl_no_label_anchors",
                         normalize_labels=normalize)

  base = loss(features, labels, mask, w, teacher)
  np.testing.assert_allclose(
      loss(features[perm], labels[perm], mask[perm], w, teacher[perm]), base, rtol=1e-5)
  np.testing.assert_allclose(loss(features * scale, labels, mask, w, teacher), base, rtol=1e-5)
  scaled_labels = loss(features, labels, mask, w * w_scale, teacher)
  if name.endswith("raw_labels"):
    assert abs(scaled_labels - base) > 1e-2
  else:
    np.testing.assert_allclose(scaled_labels, base, rtol=1e-5)


def test_zero_vectors_and_lonely_anchors_stay_finite():
  features, labels, mask, w, teacher, teacher_w = contrastive_batch(6)
  features[0] = 0  # a valid row that is exactly zero
  w[1] = 0
  teacher[2] = 0
  for fn, args in (
      (lambda f, lw: losses.scl(f, labels, temperature=0.1, mask=mask), (features, w)),
      (lambda f, lw: losses.acl_embed(f, labels, lw, temperature=0.1, mask=mask), (features, w)),
      (lambda f, lw: losses.acl_cl(f, lw, teacher, teacher_w, labels, temperature=0.1,
                                   mask=mask), (features, w)),
  ):
    value, grads = jax.value_and_grad(fn, argnums=(0, 1))(*args)
    assert np.isfinite(value)
    assert all(np.all(np.isfinite(g)) for g in grads)
  # The zero vector's normalized form is zero, as in the reference.
  np.testing.assert_allclose(losses.scl(features, labels, temperature=0.1, mask=mask),
                             np_scl(features, labels, mask, 0.1), rtol=2e-5)
  # A batch where every anchor lacks a positive, and one with a single example.
  one = jax.value_and_grad(lambda f: losses.scl(f, labels[:1], temperature=0.1))(features[:1])
  assert float(one[0]) == 0.0 and np.all(np.asarray(one[1]) == 0)


def test_all_unique_labels_and_all_padding_give_zero():
  features, *_ = contrastive_batch(7)
  labels = np.arange(len(features), dtype=np.int32)
  value, grad = jax.value_and_grad(lambda f: losses.scl(f, labels, temperature=0.1))(features)
  assert float(value) == 0.0 and np.all(np.isfinite(grad))
  none = np.zeros(len(features), np.float32)
  assert float(losses.scl(features, labels * 0, temperature=0.1, mask=none)) == 0.0
  # ACL-Embed with no valid sample: label embeddings have no positive either.
  w = features[:3]
  assert float(losses.acl_embed(features, labels % 3, w, temperature=0.1, mask=none)) == 0.0


def test_closed_form_batches():
  tau = 0.2
  e1, e2 = np.eye(4, dtype=np.float32)[:2]
  # Two classes on orthogonal unit vectors, two examples each: every anchor has one positive
  # at similarity 1/tau and two negatives at 0.
  features = np.stack([e1, e1, 3 * e2, e2])
  labels = np.array([0, 0, 1, 1])
  expected = np.log(1 + 2 * np.exp(-1 / tau))
  # atol: the value is a difference of terms near 1/tau, so float32 rounding is absolute.
  np.testing.assert_allclose(losses.scl(features, labels, temperature=tau), expected, atol=1e-6)
  # The same value for ACL-Embed with one example per class lying on its class row.
  np.testing.assert_allclose(
      losses.acl_embed(np.stack([e2, e1]), np.array([1, 0]), np.stack([2 * e1, e2]),
                       temperature=tau), expected, atol=1e-6)
  # Identical vectors: all similarities equal, so each positive's log-probability is
  # -log(N - 1) whatever the labels.
  same = np.tile(e1, (5, 1))
  np.testing.assert_allclose(losses.scl(same, np.array([0, 0, 1, 1, 1]), temperature=tau),
                             np.log(4), rtol=1e-6)


def test_bfloat16_inputs_give_float32_close_to_float32_inputs():
  features, labels, mask, w, teacher, teacher_w = contrastive_batch(8)
  as_bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  rounded = lambda x: np.asarray(as_bf16(x), np.float32)
  pairs = [
      (losses.scl(as_bf16(features), labels, temperature=0.3, mask=mask),
       losses.scl(rounded(features), labels, temperature=0.3, mask=mask)),
      (losses.acl_embed(as_bf16(features), labels, as_bf16(w), temperature=0.3, mask=mask),
       losses.acl_embed(rounded(features), labels, rounded(w), temperature=0.3, mask=mask)),
      (losses.acl_cl(as_bf16(features), as_bf16(w), as_bf16(teacher), as_bf16(teacher_w),
                     labels, temperature=0.3, mask=mask),
       losses.acl_cl(rounded(features), rounded(w), rounded(teacher), rounded(teacher_w),
                     labels, temperature=0.3, mask=mask)),
      (losses.kd(as_bf16(features), as_bf16(teacher), temperature=2.0, mask=mask),
       losses.kd(rounded(features), rounded(teacher), temperature=2.0, mask=mask)),
  ]
  for out, expected in pairs:
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5)
  grad = jax.grad(lambda f: losses.acl_embed(f, labels, w, temperature=0.3))(as_bf16(features))
  assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))


def test_jit_and_vmap_over_a_batch_of_batches():
  batches = [contrastive_batch(seed) for seed in (10, 11, 12)]
  features, labels, mask, w, teacher, teacher_w = (np.stack(x) for x in zip(*batches))
  mask[1, :] = 0  # one batch entirely padding

  def all_losses(f, y, m, lw, t, tw):
    return jnp.stack([
        losses.scl(f, y, temperature=0.3, mask=m),
        losses.acl_embed(f, y, lw, temperature=0.3, mask=m),
        losses.acl_embed(f, y, lw, temperature=0.3, mask=m, anchors="samples"),
        losses.acl_cl(f, lw, t, tw, y, temperature=0.3, mask=m),
        losses.kd(f, t, temperature=2.0, mask=m),
    ])

  batched = jax.jit(jax.vmap(all_losses))(features, labels, mask, w, teacher, teacher_w)
  for b in range(3):
    expected = all_losses(features[b], labels[b], mask[b], w[b], teacher[b], teacher_w[b])
    np.testing.assert_allclose(batched[b], expected, rtol=1e-5, atol=1e-7)
  # With no valid sample only ACL-CL's label anchors remain (each has its teacher twin).
  np.testing.assert_array_equal(np.asarray(batched[1])[[0, 1, 2, 4]], 0)
  np.testing.assert_allclose(batched[1, 3], np_acl_cl(features[1], w[1], teacher[1],
                                                      teacher_w[1], labels[1], mask[1], 0.3,
                                                      True), rtol=1e-5)


def test_bad_anchors_value_is_named():
  features, labels, _, w, *_ = contrastive_batch(0)
  with pytest.raises(ValueError, match="labels"):
    losses.acl_embed(features, labels, w, temperature=0.3, anchors="labels")
