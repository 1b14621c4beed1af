"""Pure loss functions of arrays (no model inside): CE, MSE, SCL, ACL-Embed, ACL-CL, KD.

Every loss takes an optional `mask` of shape [N] (1 = real example, 0 = padding row): padded
rows change nothing. Inputs may be float32 or bfloat16; reductions run in float32.
"""

import jax
import jax.numpy as jnp


def _valid(mask, n: int) -> jax.Array:
  return jnp.ones((n,), jnp.float32) if mask is None else mask.astype(jnp.float32)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  # max(., 1) keeps an all-padding batch at 0 instead of NaN.
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits, labels, *, mask=None) -> jax.Array:
  """Mean over valid rows of -log softmax(logits)[label]. logits [N, K], labels int [N]."""
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  # Padding rows may hold any label id; clip so the gather stays in range, the mask drops them.
  labels = jnp.clip(labels.astype(jnp.int32), 0, logits.shape[-1] - 1)
  nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
  return _masked_mean(nll, _valid(mask, logits.shape[0]))


def mse(predictions, targets, *, mask=None) -> jax.Array:
  """Mean over valid rows of (prediction - target)^2; predictions [N] or [N, 1]."""
  predictions = predictions.astype(jnp.float32).reshape(targets.shape[0])
  err = jnp.square(predictions - targets.astype(jnp.float32))
  return _masked_mean(err, _valid(mask, targets.shape[0]))


# Contrastive losses. One SupCon core serves SCL, ACL-Embed and ACL-CL: each builds a set of
# elements with labels, says which elements are valid candidates and which are anchors, and the
# core does the rest (docs/method.md, "Losses").

# Floor on the squared norm: a zero vector normalizes to zero with a finite (if large) gradient.
_NORM_FLOOR = 1e-12


def _normalize(x: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), _NORM_FLOOR))


def _masked_logsumexp(x: jax.Array, where: jax.Array) -> jax.Array:
  """logsumexp over the last axis, over entries where `where`; finite for an empty row."""
  # The shift cancels exactly in value and gradient, so it can be stopped; an empty row has no
  # finite max and gets shift 0.
  peak = jax.lax.stop_gradient(jnp.max(jnp.where(where, x, -jnp.inf), axis=-1, keepdims=True))
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  # -inf goes in before exp, not after: masked entries may exceed the peak and overflow, and a
  # where after exp would turn their zero cotangent into 0 * inf = NaN.
  total = jnp.sum(jnp.exp(jnp.where(where, x - peak, -jnp.inf)), axis=-1)
  return peak[..., 0] + jnp.log(jnp.maximum(total, jnp.finfo(jnp.float32).tiny))


def _supcon(features, labels, candidate, anchor, *, temperature, raw=None) -> jax.Array:
  """SupCon over M elements: features [M, d], labels int [M], candidate and anchor bool [M].

  For each anchor i: -(1/|P(i)|) sum_{p in P(i)} [s_ip - logsumexp_{a in C(i)} s_ia], with C(i)
  the candidates other than i and P(i) those of C(i) with i's label, and s_ij = z_i.z_j / tau
  where z is the element normalized, or as it is where `raw` (bool [M]; None: nowhere). Mean
  over anchors with >= 1 positive; 0 when there is none. Elements that are not candidates take
  no part at all.
  """
  # Padding may hold anything (inf, NaN): zero it before it can reach a product whose
  # cotangent is zero but whose value is not finite.
  features = jnp.where(candidate[:, None], features.astype(jnp.float32), 0.0)
  z = _normalize(features)
  if raw is not None:
    z = jnp.where(raw[:, None], features, z)
  # 1/temperature magnifies matmul error; bf16 passes (TPU default) would be visible here.
  sim = jnp.matmul(z, z.T, precision=jax.lax.Precision.HIGHEST) / temperature
  others = candidate[None, :] & ~jnp.eye(features.shape[0], dtype=bool)
  positives = others & (labels[:, None] == labels[None, :])
  log_prob = sim - _masked_logsumexp(sim, others)[:, None]
  n_pos = jnp.sum(positives, axis=-1)
  per_anchor = -jnp.sum(jnp.where(positives, log_prob, 0.0), axis=-1) / jnp.maximum(n_pos, 1)
  counted = (anchor & candidate & (n_pos > 0)).astype(jnp.float32)
  return _masked_mean(per_anchor, counted)


def scl(features, labels, *, temperature, mask=None) -> jax.Array:
  """Supervised contrastive loss (SupCon, single view). features [N, d], labels int [N]."""
  valid = _valid(mask, features.shape[0]) > 0
  return _supcon(features, labels.astype(jnp.int32), valid, valid, temperature=temperature)


ANCHORS = ("all", "samples")


def acl_embed(features, labels, label_embeddings, *, temperature, mask=None,
              anchors="all", normalize_labels=True) -> jax.Array:
  """ACL-Embed: SupCon over the samples and the label embeddings together.

  label_embeddings [K, d] are the classifier rows (row k = class k) and carry label k.
  anchors="all": samples and label embeddings are anchors; "samples": only the samples, the
  label embeddings staying candidates and positives. normalize_labels=False: the label
  embeddings enter the similarities as they are (the samples are still normalized), so their
  norms scale their logits.
  """
  if anchors not in ANCHORS:
    raise ValueError(f"anchors={anchors!r}; expected one of {ANCHORS}")
  n, k = features.shape[0], label_embeddings.shape[0]
  valid = _valid(mask, n) > 0
  elements = jnp.concatenate(
      [features.astype(jnp.float32), label_embeddings.astype(jnp.float32)], axis=0)
  element_labels = jnp.concatenate([labels.astype(jnp.int32), jnp.arange(k, dtype=jnp.int32)])
  candidate = jnp.concatenate([valid, jnp.ones((k,), bool)])
  anchor = jnp.concatenate([valid, jnp.full((k,), anchors == "all")])
  raw = jnp.concatenate([jnp.zeros((n,), bool), jnp.full((k,), not normalize_labels)])
  return _supcon(elements, element_labels, candidate, anchor, temperature=temperature, raw=raw)


def acl_cl(student_features, student_label_embeddings, teacher_features,
           teacher_label_embeddings, labels, *, temperature, mask=None,
           label_anchors=True, normalize_labels=True) -> jax.Array:
  """ACL-CL: a student exit contrasted against itself and a stop-gradient teacher exit.

  Candidates: the student's samples [N, d] and label embeddings [K, d], and the teacher's
  samples and label embeddings (no gradient flows to the teacher). Anchors: the student's
  samples, plus its label embeddings when label_anchors. The teacher view of a sample is one of
  its positives. `labels` and `mask` are shared by both views. normalize_labels: as acl_embed's,
  for both views' label embeddings.
  """
  n, k = student_features.shape[0], student_label_embeddings.shape[0]
  valid = _valid(mask, n) > 0
  elements = jnp.concatenate([
      student_features.astype(jnp.float32),
      student_label_embeddings.astype(jnp.float32),
      jax.lax.stop_gradient(teacher_features).astype(jnp.float32),
      jax.lax.stop_gradient(teacher_label_embeddings).astype(jnp.float32),
  ], axis=0)
  view_labels = jnp.concatenate([labels.astype(jnp.int32), jnp.arange(k, dtype=jnp.int32)])
  element_labels = jnp.concatenate([view_labels, view_labels])
  view_candidate = jnp.concatenate([valid, jnp.ones((k,), bool)])
  candidate = jnp.concatenate([view_candidate, view_candidate])
  anchor = jnp.concatenate([valid, jnp.full((k,), bool(label_anchors)), jnp.zeros((n + k,), bool)])
  view_raw = jnp.concatenate([jnp.zeros((n,), bool), jnp.full((k,), not normalize_labels)])
  return _supcon(elements, element_labels, candidate, anchor, temperature=temperature,
                 raw=jnp.concatenate([view_raw, view_raw]))


def kd(student_logits, teacher_logits, *, temperature=1.0, mask=None) -> jax.Array:
  """Distillation: mean over valid rows of T^2 * -sum_k p_teacher,k log p_student,k.

  p = softmax(logits / T), the teacher under stop-gradient. This is the soft-target
  cross-entropy; KL(p_teacher || p_student) is it minus the teacher's entropy, a constant for
  the student, so both give the same gradient and only the logged value differs. T^2 keeps the
  gradient's scale independent of T (Hinton et al., 2015).
  """
  valid = _valid(mask, student_logits.shape[0])
  keep = valid[:, None] > 0
  # As in _supcon: padding may hold anything, so it never reaches the arithmetic.
  student = jnp.where(keep, student_logits.astype(jnp.float32), 0.0)
  teacher = jnp.where(keep, jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), 0.0)
  p_teacher = jax.nn.softmax(teacher / temperature, axis=-1)
  soft_ce = -jnp.sum(p_teacher * jax.nn.log_softmax(student / temperature, axis=-1), axis=-1)
  return temperature ** 2 * _masked_mean(soft_ce, valid)
