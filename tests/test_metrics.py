"""Masked GLUE metrics against scikit-learn / scipy on the real rows only."""

import warnings

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from acl_jax import data
from acl_jax import metrics


def _padded(rng, n, pad, *, kind):
  """n real rows plus pad garbage rows, shuffled together, and the mask picking the real ones."""
  if kind == "binary":
    preds, labels = rng.integers(0, 2, n), rng.integers(0, 2, n)
    junk = rng.integers(-5, 7, (2, pad))
  elif kind == "multiclass":
    preds, labels = rng.integers(0, 3, n), rng.integers(0, 3, n)
    junk = rng.integers(-5, 7, (2, pad))
  else:
    labels = rng.uniform(0, 5, n)
    preds = labels + rng.normal(0, 1.5, n)
    junk = rng.choice([np.nan, np.inf, -1e30, 1e30], (2, pad))
  mask = np.concatenate([np.ones(n), np.zeros(pad)]).astype(np.float32)
  perm = rng.permutation(n + pad)
  all_preds = np.concatenate([preds, junk[0]])[perm]
  all_labels = np.concatenate([labels, junk[1]])[perm]
  return all_preds, all_labels, mask[perm], preds, labels


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_match_sklearn_with_garbage_padding(seed):
  rng = np.random.default_rng(seed)
  n, pad = int(rng.integers(5, 300)), int(rng.integers(0, 40))
  p, y, mask, real_p, real_y = _padded(rng, n, pad, kind="binary")
  assert metrics.accuracy(p, y, mask) == pytest.approx(
      sklearn.metrics.accuracy_score(real_y, real_p))
  assert metrics.f1(p, y, mask) == pytest.approx(sklearn.metrics.f1_score(real_y, real_p))
  assert metrics.matthews_corrcoef(p, y, mask) == pytest.approx(
      sklearn.metrics.matthews_corrcoef(real_y, real_p), abs=1e-12)

  p, y, mask, real_p, real_y = _padded(rng, n, pad, kind="multiclass")
  assert metrics.accuracy(p, y, mask) == pytest.approx(
      sklearn.metrics.accuracy_score(real_y, real_p))
  assert metrics.matthews_corrcoef(p, y, mask) == pytest.approx(
      sklearn.metrics.matthews_corrcoef(real_y, real_p), abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_correlations_match_scipy_with_garbage_padding(seed):
  rng = np.random.default_rng(seed)
  n, pad = int(rng.integers(3, 300)), int(rng.integers(1, 40))
  p, y, mask, real_p, real_y = _padded(rng, n, pad, kind="regression")
  assert metrics.pearson(p, y, mask) == pytest.approx(scipy.stats.pearsonr(real_p, real_y)[0],
                                                      abs=1e-12)
  assert metrics.spearman(p, y, mask) == pytest.approx(
      scipy.stats.spearmanr(real_p, real_y)[0], abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_spearman_ties_use_average_ranks(seed):
  rng = np.random.default_rng(seed)
  n = 200
  # STS-B gold scores repeat a lot (multiples of 0.2); predictions tie too.
  labels = rng.integers(0, 26, n) / 5
  preds = np.round(labels + rng.normal(0, 1, n), 1)
  preds[:20] = preds[0]
  mask = rng.random(n) < 0.8
  garbage_p, garbage_y = np.where(mask, preds, -7.0), np.where(mask, labels, 99.0)
  expected = scipy.stats.spearmanr(preds[mask], labels[mask])[0]
  assert metrics.spearman(garbage_p, garbage_y, mask) == pytest.approx(expected, abs=1e-12)


def test_no_mask_means_all_rows():
  rng = np.random.default_rng(0)
  p, y = rng.integers(0, 2, 50), rng.integers(0, 2, 50)
  assert metrics.accuracy(p, y) == pytest.approx(sklearn.metrics.accuracy_score(y, p))
  assert metrics.f1(p, y, None) == pytest.approx(sklearn.metrics.f1_score(y, p))


@pytest.mark.parametrize("fn", [metrics.accuracy, metrics.f1, metrics.matthews_corrcoef,
                                metrics.pearson, metrics.spearman])
def test_degenerate_inputs_give_zero_without_warnings(fn):
  ones = np.ones(6)
  cases = [
      (np.zeros(0), np.zeros(0), None),  # nothing at all
      (ones, ones, np.zeros(6)),  # everything masked
      (np.array([0.0, 1.0, 2.0]), np.array([0.0, 1.0, 5.0]), np.array([0, 1, 0])),  # one row
  ]
  if fn is not metrics.accuracy:
    cases.append((np.zeros(6), np.zeros(6), None))  # constant, no positive class
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for p, y, m in cases:
      value = fn(p, y, m)
      assert isinstance(value, float)
      if fn is metrics.f1 and len(p) == 3:
        assert value == 1.0  # one true positive is a perfect F1, not a degenerate case
      elif fn is metrics.accuracy and len(p) == 3:
        assert value == 1.0
      else:
        assert value == 0.0, (fn.__name__, p, y, m)


def test_constant_predictions_match_sklearn_zero():
  labels = np.array([0, 1, 1, 0, 1])
  constant = np.zeros(5, int)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert metrics.matthews_corrcoef(constant, labels) == 0.0
    assert metrics.f1(constant, labels) == 0.0
    assert metrics.pearson(constant, labels) == 0.0
    assert metrics.spearman(constant, labels) == 0.0
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sklearn warns here; we must not
    assert sklearn.metrics.matthews_corrcoef(labels, constant) == 0.0
    assert sklearn.metrics.f1_score(labels, constant, zero_division=0.0) == 0.0


def test_non_finite_prediction_on_a_real_row_is_nan():
  p = np.array([1.0, np.nan, 3.0, 4.0])
  y = np.array([1.0, 2.0, 3.0, 5.0])
  assert np.isnan(metrics.pearson(p, y))
  assert np.isnan(metrics.spearman(p, y))
  assert metrics.pearson(p, y, np.array([1, 0, 1, 1])) == pytest.approx(
      scipy.stats.pearsonr([1, 3, 4], [1, 3, 5])[0])


def test_padding_and_batching_do_not_change_results():
  """Same rows padded to a multiple of 8 (or of 32) give the same numbers (RTE dev: 277)."""
  rng = np.random.default_rng(1)
  p, y = rng.integers(0, 2, 277), rng.integers(0, 2, 277)
  scores, gold = rng.normal(size=277), rng.normal(size=277)

  def pad_to(x, multiple, fill):
    return np.concatenate([x, np.full(-len(x) % multiple, fill)])

  results = []
  for multiple in (1, 8, 32):
    mask = pad_to(np.ones(277), multiple, 0)
    results.append([
        metrics.compute(data.get_task("mrpc"), pad_to(p, multiple, 1), pad_to(y, multiple, 1),
                        mask),
        metrics.compute(data.get_task("cola"), pad_to(p, multiple, 1), pad_to(y, multiple, 0),
                        mask),
        metrics.compute(data.get_task("stsb"), pad_to(scores, multiple, 9.0),
                        pad_to(gold, multiple, -9.0), mask),
    ])
  for other in results[1:]:
    for a, b in zip(results[0], other):
      assert a.keys() == b.keys()
      for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-12)


def test_compute_returns_each_tasks_metrics():
  rng = np.random.default_rng(2)
  ids, gold = rng.integers(0, 2, 40), rng.integers(0, 2, 40)
  for name, keys, main in [("cola", {"mcc"}, "mcc"), ("mrpc", {"f1", "accuracy"}, "f1"),
                           ("qqp", {"f1", "accuracy"}, "f1"), ("rte", {"accuracy"}, "accuracy"),
                           ("sst2", {"accuracy"}, "accuracy"), ("qnli", {"accuracy"}, "accuracy"),
                           ("wnli", {"accuracy"}, "accuracy"), ("mnli", {"accuracy"}, "accuracy")]:
    task = data.get_task(name)
    out = metrics.compute(task, ids, gold)
    assert set(out) == keys and task.main_metric == main
    assert all(isinstance(v, float) for v in out.values())
    assert metrics.main_score(task, out) == out[main]

  stsb = data.get_task("stsb")
  scores = rng.normal(size=(40, 1)).astype(np.float32)  # a regression head's [N, 1] output
  out = metrics.compute(stsb, scores, gold.astype(np.float32))
  assert set(out) == {"pearson", "spearman"}
  assert out["pearson"] == pytest.approx(scipy.stats.pearsonr(scores[:, 0], gold)[0], abs=1e-6)
  assert metrics.main_score(stsb, out) == out["pearson"]


def test_compute_refuses_test_splits_and_logits():
  task = data.get_task("rte")
  with pytest.raises(ValueError, match="not scored"):
    metrics.compute(task, np.zeros(3), None)
  with pytest.raises(ValueError, match="argmax"):
    metrics.compute(task, np.zeros((3, 2)), np.zeros(3))
  with pytest.raises(ValueError, match="shape"):
    metrics.accuracy(np.zeros(3), np.zeros(4))
