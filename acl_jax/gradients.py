"""ACL-Grad: gate an auxiliary gradient on its agreement with the CE gradient.

The method is in docs/method.md ("The gate").

Everything is a pure function of gradient pytrees, free of Python branching on their values, so
it runs inside the jit-compiled train step. Agreement is measured in float32 at HIGHEST
precision: on TPU the default bf16 passes can flip the sign of a near-orthogonal dot product,
and that sign is the decision.
"""

import jax
import jax.numpy as jnp

MODES = ("none", "drop", "project")


def tree_dot(a, b) -> jax.Array:
  """<a, b> over every leaf of two pytrees of the same structure, as a float32 scalar."""
  def leaf_dot(x, y):
    x = jnp.ravel(jnp.asarray(x)).astype(jnp.float32)
    y = jnp.ravel(jnp.asarray(y)).astype(jnp.float32)
    return jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST)
  return sum(jax.tree.leaves(jax.tree.map(leaf_dot, a, b)), jnp.zeros((), jnp.float32))


def _cosine(dot, a_sq, b_sq) -> jax.Array:
  nonzero = (a_sq > 0) & (b_sq > 0)
  # Norms, not a_sq * b_sq: that product overflows float32 for gradient norms past ~1e10.
  norms = jnp.sqrt(jnp.where(nonzero, a_sq, 1.0)) * jnp.sqrt(jnp.where(nonzero, b_sq, 1.0))
  # Rounding can put |cosine| a hair above 1, which would break sqrt(1 - cosine^2) downstream.
  return jnp.where(nonzero, jnp.clip(dot / norms, -1.0, 1.0), 0.0)


def tree_cosine(a, b) -> jax.Array:
  """Cosine between two pytrees as flat vectors, float32; 0 when either is all zeros."""
  return _cosine(tree_dot(a, b), tree_dot(a, a), tree_dot(b, b))


def combine(g_ce, g_aux, *, mode="drop"):
  """Combines the CE gradient with the auxiliary one; returns (grads, info).

  mode "none": g_ce + g_aux. "drop" (ACL-Grad): g_ce alone when <g_ce, g_aux> < 0, else the sum.
  "project" (PCGrad-style ablation): when <g_ce, g_aux> < 0, g_aux loses its component along
  g_ce before the sum. info holds float32 scalars: dot, cosine, and kept (1./0. whether g_aux
  was added; for "project" the fraction of g_aux's norm that survives). Leaves keep the dtype
  g_ce + g_aux would have.
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}; expected one of {MODES}")
  dot = tree_dot(g_ce, g_aux)
  ce_sq = tree_dot(g_ce, g_ce)
  cosine = _cosine(dot, ce_sq, tree_dot(g_aux, g_aux))
  conflict = dot < 0  # a conflict implies both are nonzero, so ce_sq > 0 below

  one = jnp.ones((), jnp.float32)
  if mode == "none":
    grads, kept = jax.tree.map(jnp.add, g_ce, g_aux), one
  elif mode == "drop":
    # where, not a 0/1 multiplier: a non-finite g_aux that is dropped must not leak in as NaN.
    grads = jax.tree.map(lambda ce, aux: jnp.where(conflict, ce, ce + aux), g_ce, g_aux)
    kept = jnp.where(conflict, 0.0, 1.0)
  else:
    # g_aux - (dot / |g_ce|^2) g_ce, folded into the scale of g_ce; the scale is float32, the
    # result goes back to the leaves' dtype.
    coef = jnp.where(conflict, dot / jnp.where(conflict, ce_sq, 1.0), 0.0)
    grads = jax.tree.map(
        lambda ce, aux: (ce.astype(jnp.float32) * (1.0 - coef) + aux).astype(
            jnp.result_type(ce, aux)), g_ce, g_aux)
    # |projected g_aux| / |g_aux| = sin(angle), without another pass over the parameters.
    kept = jnp.where(conflict, jnp.sqrt(jnp.maximum(1.0 - cosine * cosine, 0.0)), 1.0)
  return grads, {"dot": dot, "cosine": cosine, "kept": kept.astype(jnp.float32)}
