"""ACL-Grad gating against hand computation and NumPy, independently of acl_jax.gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acl_jax import gradients


def nested_tree(seed):
  """A parameter-like pytree with float32 and bfloat16 leaves, and its leaves as float64."""
  rng = np.random.default_rng(seed)
  kernel = rng.normal(size=(3, 4)).astype(np.float32)
  bias = np.asarray(jnp.asarray(rng.normal(size=4), jnp.bfloat16).astype(jnp.float32))
  scale = rng.normal(size=2).astype(np.float32)
  table = np.asarray(jnp.asarray(rng.normal(size=(2, 2)), jnp.bfloat16).astype(jnp.float32))
  tree = {"dense": {"kernel": kernel, "bias": jnp.asarray(bias, jnp.bfloat16)},
          "norm": [scale, jnp.asarray(table, jnp.bfloat16)]}
  flat = np.concatenate([x.ravel() for x in (kernel, bias, scale, table)]).astype(np.float64)
  return tree, flat


def test_tree_dot_and_cosine_match_numpy_on_mixed_dtypes():
  a, flat_a = nested_tree(0)
  b, flat_b = nested_tree(1)
  dot = gradients.tree_dot(a, b)
  assert dot.dtype == jnp.float32 and dot.shape == ()
  np.testing.assert_allclose(dot, flat_a @ flat_b, rtol=1e-5)
  cosine = gradients.tree_cosine(a, b)
  assert cosine.dtype == jnp.float32
  expected = flat_a @ flat_b / np.linalg.norm(flat_a) / np.linalg.norm(flat_b)
  np.testing.assert_allclose(cosine, expected, rtol=1e-5)
  np.testing.assert_allclose(gradients.tree_cosine(a, a), 1.0, rtol=1e-6)


def test_cosine_is_zero_when_either_side_is_zero():
  a, _ = nested_tree(0)
  zero = jax.tree.map(jnp.zeros_like, a)
  for x, y in ((a, zero), (zero, a), (zero, zero)):
    assert float(gradients.tree_cosine(x, y)) == 0.0
  # Large gradients: the product of the squared norms (1e60) would overflow float32.
  big = {"w": jnp.asarray([1e15, 0.0]), "v": jnp.asarray([-1e15])}
  np.testing.assert_allclose(gradients.tree_cosine(big, big), 1.0, rtol=1e-5)


# Hand-computed pairs over the flat vector (w0, w1, v0): g_ce = (1, 0, 0).
G_CE = {"w": np.array([1.0, 0.0], np.float32), "v": np.array([0.0], np.float32)}
CONFLICT = {"w": np.array([-1.0, 1.0], np.float32), "v": np.array([0.0], np.float32)}
AGREE = {"w": np.array([1.0, 1.0], np.float32), "v": np.array([2.0], np.float32)}

HAND = {
    # mode, g_aux: (g_ce + combined g_aux as (w0, w1, v0), dot, cosine, kept)
    ("none", "conflict"): ((0, 1, 0), -1, -1 / np.sqrt(2), 1),
    ("drop", "conflict"): ((1, 0, 0), -1, -1 / np.sqrt(2), 0),
    # g_aux minus its component along g_ce: (-1, 1, 0) - (-1)(1, 0, 0) = (0, 1, 0); norm 1 of
    # sqrt(2) survives.
    ("project", "conflict"): ((1, 1, 0), -1, -1 / np.sqrt(2), 1 / np.sqrt(2)),
    ("none", "agree"): ((2, 1, 2), 1, 1 / np.sqrt(6), 1),
    ("drop", "agree"): ((2, 1, 2), 1, 1 / np.sqrt(6), 1),
    ("project", "agree"): ((2, 1, 2), 1, 1 / np.sqrt(6), 1),
}


@pytest.mark.parametrize("mode,pair", sorted(HAND))
def test_combine_against_hand_computation(mode, pair):
  g_aux = CONFLICT if pair == "conflict" else AGREE
  expected, dot, cosine, kept = HAND[mode, pair]
  eager = functools.partial(gradients.combine, mode=mode)
  for fn in (eager, jax.jit(eager)):
    grads, info = fn(G_CE, g_aux)
    np.testing.assert_allclose(np.concatenate([grads["w"], grads["v"]]), expected, atol=1e-6)
    np.testing.assert_allclose(info["dot"], dot, atol=1e-6)
    np.testing.assert_allclose(info["cosine"], cosine, atol=1e-6)
    np.testing.assert_allclose(info["kept"], kept, atol=1e-6)
    assert all(info[k].dtype == jnp.float32 and info[k].shape == () for k in info)


def test_drop_is_the_default_mode():
  grads, info = gradients.combine(G_CE, CONFLICT)
  np.testing.assert_allclose(grads["w"], G_CE["w"])
  assert float(info["kept"]) == 0.0


def test_project_leaves_no_conflict_and_keeps_the_right_fraction():
  rng = np.random.default_rng(3)
  project = jax.jit(functools.partial(gradients.combine, mode="project"))
  def draw():
    return {"a": rng.normal(size=(4, 3)).astype(np.float32),
            "b": rng.normal(size=5).astype(np.float32)}

  for _ in range(20):
    ce, aux = draw(), draw()
    grads, info = project(ce, aux)
    flat_ce = np.concatenate([ce["a"].ravel(), ce["b"]]).astype(np.float64)
    flat_aux = np.concatenate([aux["a"].ravel(), aux["b"]]).astype(np.float64)
    flat_out = np.concatenate([np.ravel(grads["a"]), grads["b"]]).astype(np.float64)
    projected = flat_out - flat_ce
    assert flat_ce @ projected >= -1e-4 * np.linalg.norm(flat_ce) * np.linalg.norm(flat_aux)
    if flat_ce @ flat_aux < 0:
      expected = flat_aux - (flat_ce @ flat_aux) / (flat_ce @ flat_ce) * flat_ce
    else:
      expected = flat_aux
    np.testing.assert_allclose(projected, expected, atol=1e-5)
    np.testing.assert_allclose(info["kept"], np.linalg.norm(expected) / np.linalg.norm(flat_aux),
                               atol=1e-5)


@pytest.mark.parametrize("mode", gradients.MODES)
def test_leaves_keep_their_dtypes(mode):
  a, _ = nested_tree(0)
  b, _ = nested_tree(1)
  grads, _ = jax.jit(functools.partial(gradients.combine, mode=mode))(a, b)
  assert jax.tree.map(lambda x: x.dtype, grads) == jax.tree.map(lambda x: jnp.asarray(x).dtype, a)


def test_dropped_non_finite_aux_does_not_leak():
  bad = {"w": np.array([-np.inf, 1.0], np.float32), "v": np.array([0.0], np.float32)}
  grads, info = gradients.combine(G_CE, bad, mode="drop")
  assert float(info["kept"]) == 0.0
  np.testing.assert_array_equal(grads["w"], G_CE["w"])


def test_unknown_mode_lists_the_modes():
  with pytest.raises(ValueError, match="drop") as err:
    gradients.combine(G_CE, AGREE, mode="pcgrad")
  assert all(mode in str(err.value) for mode in ("none", "drop", "project", "pcgrad"))


# gated_value_and_grad on a model that is not ours: a plain-JAX MLP with three "exits", each
# with a main and an auxiliary loss. Exit 0's auxiliary term is built to conflict with its
# main term, exit 1's to agree, exit 2's is an unrelated loss; the reference takes every
# gradient with its own jax.grad call and gates in float64 NumPy.

def mlp_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"hidden": [jnp.asarray(rng.normal(size=(4, 4)) * 0.7, jnp.float32) for _ in range(3)],
          "heads": jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32)}


def mlp_terms(params, x, y):
  """(main [3], aux [3]), and the logits as an auxiliary output."""
  h, logits = x, []
  for kernel in params["hidden"]:
    h = jnp.tanh(h @ kernel)
    logits.append(h @ params["heads"][len(logits)])
  logits = jnp.stack(logits)  # [3, N, 2]
  main = -jnp.mean(jax.nn.log_softmax(logits)[:, jnp.arange(len(y)), y], axis=1)
  other = jnp.mean(jnp.square(logits - 0.3), axis=(1, 2))
  aux = jnp.stack([-0.5 * main[0], 0.3 * main[1], 0.2 * other[2]])
  return (main, aux), logits


def reference(params, x, y, *, mode, granularity):
  def grad_of(which, e=None):
    pick = lambda p: mlp_terms(p, x, y)[0][which]
    g = jax.grad(lambda p: pick(p).sum() if e is None else pick(p)[e])(params)
    return np.concatenate([np.asarray(l, np.float64).ravel() for l in jax.tree.leaves(g)])

  pairs = ([(grad_of(0), grad_of(1))] if granularity == "global" else
           [(grad_of(0, e), grad_of(1, e)) for e in range(3)])
  total, kept = 0.0, []
  for g_main, g_aux in pairs:
    dot = g_main @ g_aux
    if mode == "drop":
      kept.append(float(dot >= 0))
      total = total + g_main + (g_aux if dot >= 0 else 0.0)
    else:  # project
      scale = dot / (g_main @ g_main) if dot < 0 else 0.0
      kept.append(1.0)
      total = total + g_main + g_aux - scale * g_main
  return total, np.array(kept)


@pytest.mark.parametrize("mode", ["drop", "project"])
@pytest.mark.parametrize("granularity, chunk", [("per_term", 1), ("per_term", 2),
                                                ("global", 1)])
def test_gated_value_and_grad_equals_separate_grads_on_a_plain_mlp(mode, granularity, chunk):
  params = mlp_params()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 2, size=16))
  fn = jax.jit(gradients.gated_value_and_grad(mlp_terms, mode=mode, granularity=granularity,
                                              chunk=chunk, has_aux=True))
  (loss, logits), grads, info = fn(params, x, y)

  expected, kept = reference(params, x, y, mode=mode, granularity=granularity)
  flat = np.concatenate([np.asarray(l, np.float64).ravel() for l in jax.tree.leaves(grads)])
  np.testing.assert_allclose(flat, expected, rtol=1e-5, atol=1e-6)
  (main, aux), want_logits = mlp_terms(params, x, y)
  np.testing.assert_array_equal(logits, want_logits)
  shape = () if granularity == "global" else (3,)
  assert info["dot"].shape == info["cosine"].shape == info["kept"].shape == shape
  if granularity == "per_term":
    assert info["dot"][0] < 0 < info["dot"][1]  # both branches of the gate are exercised
    if mode == "drop":
      np.testing.assert_array_equal(info["kept"], kept)
      np.testing.assert_allclose(loss, main.sum() + (kept * aux).sum(), rtol=1e-6)
  if mode == "project":
    np.testing.assert_allclose(loss, main.sum() + aux.sum(), rtol=1e-6)


def test_gated_value_and_grad_on_scalar_terms_without_outputs():
  params = mlp_params(2)
  x = jnp.ones((4, 4), jnp.float32)
  y = jnp.array([0, 1, 1, 0])
  scalar_terms = lambda p, x, y: (mlp_terms(p, x, y)[0][0][2], mlp_terms(p, x, y)[0][1][2])
  loss, grads, info = gradients.gated_value_and_grad(scalar_terms)(params, x, y)
  g_main = jax.grad(lambda p: scalar_terms(p, x, y)[0])(params)
  g_aux = jax.grad(lambda p: scalar_terms(p, x, y)[1])(params)
  want, want_info = gradients.combine(g_main, g_aux, mode="drop")
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert info["kept"].shape == () and float(info["kept"]) == float(want_info["kept"])
  main, aux = scalar_terms(params, x, y)
  np.testing.assert_allclose(loss, main + float(info["kept"]) * aux, rtol=1e-6)


def test_gated_value_and_grad_refuses_bad_arguments():
  with pytest.raises(ValueError, match="mode='skip'"):
    gradients.gated_value_and_grad(mlp_terms, mode="skip")
  with pytest.raises(ValueError, match="granularity='exit'"):
    gradients.gated_value_and_grad(mlp_terms, granularity="exit")
  with pytest.raises(ValueError, match="chunk=0"):
    gradients.gated_value_and_grad(mlp_terms, chunk=0)
  mismatched = lambda p, x, y: (mlp_terms(p, x, y)[0][0], mlp_terms(p, x, y)[0][1][:2])
  with pytest.raises(ValueError, match=r"one shape.*\(3,\) and \(2,\)"):
    gradients.gated_value_and_grad(mismatched)(mlp_params(), jnp.ones((2, 4)), jnp.array([0, 1]))
