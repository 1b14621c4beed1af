"""GLUE metrics from masked sums: accuracy, F1, Matthews correlation, Pearson, Spearman.

Every function takes the padded arrays of an eval pass and a 0/1 `mask`; rows with mask 0 may
hold anything (even NaN) and never change the result. Results are computed from masked counts
and sums, so the same rows give the same number however they were batched or sharded.
Degenerate inputs (no rows, a constant column) give 0.0 as scikit-learn does for MCC and F1,
without NaN or warnings. NumPy only.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from acl_jax.data import TaskSpec


def _flat(x, name: str) -> np.ndarray:
  x = np.asarray(x)
  if x.ndim == 2 and x.shape[1] == 1:
    x = x[:, 0]
  if x.ndim != 1:
    raise ValueError(f"{name} must have shape [N] (or [N, 1]), got {x.shape}")
  return x


def _prepare(preds, labels, mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Flat arrays and a boolean mask; masked-out rows are zeroed so garbage cannot leak."""
  preds, labels = _flat(preds, "preds"), _flat(labels, "labels")
  if preds.shape != labels.shape:
    raise ValueError(f"preds {preds.shape} and labels {labels.shape} differ in shape")
  keep = np.ones(preds.shape, bool) if mask is None else _flat(mask, "mask") > 0
  if keep.shape != preds.shape:
    raise ValueError(f"mask {keep.shape} does not match preds {preds.shape}")
  return np.where(keep, preds, 0), np.where(keep, labels, 0), keep


def accuracy(preds, labels, mask=None) -> float:
  """Fraction of real rows whose predicted class equals the label."""
  preds, labels, keep = _prepare(preds, labels, mask)
  total = np.count_nonzero(keep)
  return float(np.count_nonzero(keep & (preds == labels)) / total) if total else 0.0


def f1(preds, labels, mask=None) -> float:
  """Binary F1 of class 1 (every other id counts as negative)."""
  preds, labels, keep = _prepare(preds, labels, mask)
  pred_pos, true_pos = keep & (preds == 1), keep & (labels == 1)
  tp = np.count_nonzero(pred_pos & true_pos)
  fp = np.count_nonzero(pred_pos & ~true_pos)
  fn = np.count_nonzero(~pred_pos & true_pos)
  denominator = 2 * tp + fp + fn
  return float(2 * tp / denominator) if denominator else 0.0


def matthews_corrcoef(preds, labels, mask=None) -> float:
  """Matthews correlation (multi-class form, equal to the binary one for two classes)."""
  preds, labels, keep = _prepare(preds, labels, mask)
  classes, inverse = np.unique(np.concatenate([labels, preds]), return_inverse=True)
  k, n = len(classes), len(preds)
  # Masked rows were zeroed, so they may add an all-zero class: it changes none of the sums.
  confusion = np.bincount(inverse[:n] * k + inverse[n:], weights=keep,
                          minlength=k * k).reshape(k, k)
  true_counts, pred_counts = confusion.sum(axis=1), confusion.sum(axis=0)
  samples, correct = confusion.sum(), np.trace(confusion)
  cov_tp = correct * samples - true_counts @ pred_counts
  cov_pp = samples**2 - pred_counts @ pred_counts
  cov_tt = samples**2 - true_counts @ true_counts
  if cov_pp == 0 or cov_tt == 0:
    return 0.0
  return float(np.clip(cov_tp / np.sqrt(cov_tt * cov_pp), -1.0, 1.0))


def _pearson(x: np.ndarray, y: np.ndarray, keep: np.ndarray) -> float:
  w = keep.astype(np.float64)
  n = w.sum()
  if n < 2:
    return 0.0
  x, y = x.astype(np.float64), y.astype(np.float64)
  if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
    return float("nan")  # A diverged model must not be reported as a number.
  # Centre first (two passes): raw sums of squares cancel badly when the mean is large.
  dx = (x - (w @ x) / n) * w
  dy = (y - (w @ y) / n) * w
  sxx, syy = dx @ dx, dy @ dy
  if sxx == 0 or syy == 0:
    return 0.0
  return float(np.clip((dx @ dy) / np.sqrt(sxx * syy), -1.0, 1.0))


def pearson(preds, labels, mask=None) -> float:
  """Pearson correlation of real rows; 0.0 when either side is constant or n < 2."""
  return _pearson(*_prepare(preds, labels, mask))


def _average_ranks(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
  """1-based ranks among the real rows, ties sharing their mean rank; 0 on masked rows."""
  order = np.lexsort((x, ~keep))  # real rows first, each group sorted by value
  n = np.count_nonzero(keep)
  values = x[order[:n]]
  # A tie run from sorted position i to j (inclusive) gets rank (i + j) / 2 + 1.
  new_run = np.concatenate([[True], values[1:] != values[:-1]]) if n else np.zeros(0, bool)
  run = np.cumsum(new_run) - 1
  first = np.flatnonzero(new_run)
  last = np.append(first[1:], n) - 1
  ranks = np.zeros(len(x), np.float64)
  ranks[order[:n]] = (first[run] + last[run]) / 2 + 1
  return ranks


def spearman(preds, labels, mask=None) -> float:
  """Spearman rank correlation of real rows (average ranks for ties)."""
  preds, labels, keep = _prepare(preds, labels, mask)
  preds, labels = preds.astype(np.float64), labels.astype(np.float64)
  if not (np.all(np.isfinite(preds)) and np.all(np.isfinite(labels))):
    return float("nan")
  return _pearson(_average_ranks(preds, keep), _average_ranks(labels, keep), keep)


METRICS: Mapping[str, Callable[..., float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def compute(task: TaskSpec, predictions, labels, mask=None) -> dict[str, float]:
  """The task's metrics. predictions: class ids [N], or scores [N] / [N, 1] for regression."""
  if labels is None:
    raise ValueError(f"{task.name}: no labels (a test split?); GLUE test sets are not scored")
  predictions = np.asarray(predictions)
  if not task.is_regression and predictions.ndim != 1:
    raise ValueError(f"{task.name}: expected class ids of shape [N], got {predictions.shape};"
                     " take argmax of the logits first")
  return {name: METRICS[name](predictions, labels, mask) for name in task.metrics}


def main_score(task: TaskSpec, results: Mapping[str, float]) -> float:
  """The number model selection uses for this task (task.main_metric)."""
  return float(results[task.main_metric])
