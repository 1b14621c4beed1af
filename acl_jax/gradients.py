"""ACL-Grad: gate an auxiliary gradient on its agreement with the CE gradient.

`combine` gates two gradient pytrees; `gated_value_and_grad` is the transform that computes
them from any model's loss terms in one forward pass and one vjp. The method is in
docs/method.md ("The gate").

Everything is a pure function of gradient pytrees, free of Python branching on their values, so
it runs inside the jit-compiled train step. Agreement is measured in float32 at HIGHEST
precision: on TPU the default bf16 passes can flip the sign of a near-orthogonal dot product,
and that sign is the decision.
"""

from typing import Callable

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


GRANULARITIES = ("per_term", "global")


def gated_value_and_grad(fun: Callable, *, mode: str = "drop", granularity: str = "per_term",
                         chunk: int = 1, has_aux: bool = False) -> Callable:
  """ACL-Grad as a function transform, in the spirit of jax.value_and_grad.

  fun(params, *args) returns (main, aux), or ((main, aux), outputs) with has_aux: main and aux
  are the loss terms, each a scalar or a vector [E] of per-term losses (e.g. one per exit of a
  multi-exit model) with their weights already applied. The transform returns a function
  (params, *args) -> (loss, grads, info), or ((loss, outputs), grads, info) with has_aux:

    per_term (E decisions):  grads = sum_e combine(grad main_e, grad aux_e, mode)
    global (one decision):   grads = combine(grad sum(main), grad sum(aux), mode)
    loss = sum(main) + sum(kept * aux) for mode "drop", else sum(main) + sum(aux)

  info holds dot, cosine and kept (see `combine`): [E] per term, scalars for "global" or for
  scalar terms. Everything comes from one forward pass and one jax.vjp of the stacked terms:
  every gradient sees the same forward values (and dropout masks). "global" pulls its two
  cotangents back as one batched backward pass; "per_term" pulls back `chunk` terms (2 * chunk
  gradient pytrees) at a time inside a lax.scan that accumulates the gated sum, so memory
  stays bounded however many terms there are. The cost is one backward pass per gradient:
  two for "global", 2E for "per_term".
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}; expected one of {MODES}")
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity={granularity!r}; expected one of {GRANULARITIES}")
  if chunk < 1:
    raise ValueError(f"chunk={chunk} must be >= 1")

  def stacked(params, *args):
    out = fun(params, *args)
    (main, aux), outputs = out if has_aux else (out, None)
    main, aux = jnp.atleast_1d(main), jnp.atleast_1d(aux)
    if main.shape != aux.shape or main.ndim != 1:
      raise ValueError(f"fun must return main and aux terms of one shape, scalars or [E]; "
                       f"got {main.shape} and {aux.shape}")
    return jnp.concatenate([main, aux]), (main.shape[0], outputs)

  def wrapped(params, *args):
    loss_vec, pull_back, (n_terms, outputs) = jax.vjp(
        lambda p: stacked(p, *args), params, has_aux=True)
    if n_terms == 1 or granularity == "global":
      grads, info = _global_decision(loss_vec, pull_back, n_terms, mode)
    else:
      grads, info = _per_term_decisions(loss_vec, pull_back, params, n_terms, mode, chunk)
    kept = info["kept"] if mode == "drop" else 1.0
    loss = loss_vec[:n_terms].sum() + (kept * loss_vec[n_terms:]).sum()
    return ((loss, outputs) if has_aux else loss), grads, info

  return wrapped


def _global_decision(loss_vec, pull_back, n_terms: int, mode: str):
  # Cotangent row 0 selects every main term, row 1 every auxiliary one.
  rows = jnp.repeat(jnp.eye(2, dtype=loss_vec.dtype), n_terms, axis=1)
  (stacked,) = jax.vmap(pull_back)(rows)  # a batched backward pass for both cotangents
  g_main, g_aux = (jax.tree.map(lambda g, i=i: g[i], stacked) for i in range(2))
  return combine(g_main, g_aux, mode=mode)


def _per_term_decisions(loss_vec, pull_back, params, n_terms: int, mode: str, chunk: int):
  chunks = -(-n_terms // chunk)
  # Term e's cotangents are rows e (main) and E + e (aux) of the identity; padding terms get
  # zero rows, whose zero gradients add nothing.
  eye = jnp.eye(2 * n_terms, dtype=loss_vec.dtype)
  pad = jnp.zeros((chunks * chunk - n_terms, 2 * n_terms), loss_vec.dtype)
  main_rows = jnp.concatenate([eye[:n_terms], pad]).reshape(chunks, chunk, -1)
  aux_rows = jnp.concatenate([eye[n_terms:], pad]).reshape(chunks, chunk, -1)

  def one_chunk(total, rows):
    (stacked,) = jax.vmap(pull_back)(jnp.concatenate(rows))
    pick = lambda i: jax.tree.map(lambda g: g[i], stacked)
    gated, infos = zip(*(combine(pick(i), pick(chunk + i), mode=mode) for i in range(chunk)))
    total = jax.tree.map(lambda t, *g: t + sum(g), total, *gated)
    return total, jax.tree.map(lambda *v: jnp.stack(v), *infos)

  zeros = jax.tree.map(jnp.zeros_like, params)
  grads, info = jax.lax.scan(one_chunk, zeros, (main_rows, aux_rows))
  return grads, jax.tree.map(lambda v: v.reshape(-1)[:n_terms], info)
