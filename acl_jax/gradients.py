"""ACL-Grad: gate an auxiliary gradient on its agreement with the CE gradient.

`combine` gates two gradient pytrees; `gated_value_and_grad` is the transform that computes
them from any model's loss terms in one forward pass and one vjp. The method is in
docs/method.md ("The gate").

Everything is a pure function of gradient pytrees, free of Python branching on their values, so
it runs inside the jit-compiled train step. Agreement is measured in float32 at HIGHEST
precision: on TPU the default bf16 passes can flip the sign of a near-orthogonal dot product,
and that sign is the decision.
"""

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Microbatched:
  """A loss whose per-example part runs in micro-batches while every term stays a term over
  the whole batch (the GradCache idea), for `gated_value_and_grad` and `value_and_grad`.

  features(params, examples) -> per-example features: a pytree whose leaves have the examples
  on axis 0 (e.g. each exit's logits and pooled vector). terms(params, features, *args) ->
  what a plain `fun` returns: (main, aux), or ((main, aux), outputs) with has_aux. Called as
  fun(params, examples, *args), where examples is a pytree of arrays [B, ...] (the inputs, and
  anything else per example, such as dropout keys); unsplit, it is
  terms(params, features(params, examples), *args).

  The transforms split examples into num_microbatches micro-batches of B / num_microbatches:
  micro-batch k holds examples k, k + n, k + 2n, ... (strided, so that a batch sharded over
  devices in contiguous blocks gives every device its share of every micro-batch). They
    1. run features on each micro-batch (no gradient) and concatenate them;
    2. take the terms over the whole batch, and their vjp with respect to the features (and
       to the parameters terms reads directly, e.g. label embeddings);
    3. for each micro-batch, run features again under jax.vjp and pull the cotangents of its
       examples back, accumulating each gradient apart (main and auxiliary; per term for
       granularity="per_term").
  So the gradients, the dot products and the gate's decisions are the whole batch's, up to
  float rounding, whatever the split, provided features treats each example on its own (no
  batch statistics, and dropout keyed per example: acl_jax.models.per_example). Memory: one
  micro-batch's activations, the features of the whole batch, and the gradients in flight
  (2 for "global", 2 * chunk for "per_term"); time: one extra forward pass, and one forward
  and the backward passes per micro-batch.
  """
  features: Callable
  terms: Callable
  num_microbatches: int

  def __post_init__(self):
    if self.num_microbatches < 1:
      raise ValueError(f"num_microbatches={self.num_microbatches} must be >= 1")

  def __call__(self, params, examples, *args):
    return self.terms(params, self.features(params, examples), *args)


def _stacked_terms(out, has_aux: bool, *, need_aux: bool = True):
  """(concatenated [main, aux] terms, (number of main terms, outputs)) from fun's return."""
  (main, aux), outputs = out if has_aux else (out, None)
  main = jnp.atleast_1d(main)
  if aux is None and not need_aux:
    return main, (main.shape[0], outputs)
  aux = jnp.atleast_1d(aux)
  if main.shape != aux.shape or main.ndim != 1:
    raise ValueError(f"fun must return main and aux terms of one shape, scalars or [E]; "
                     f"got {main.shape} and {aux.shape}")
  return jnp.concatenate([main, aux]), (main.shape[0], outputs)


def _vjp(fun, params, args, has_aux: bool, need_aux: bool = True):
  """(term vector, pull_back, (number of main terms, outputs)): pull_back maps cotangent rows
  [R, terms] to R gradient pytrees stacked on axis 0."""
  if not isinstance(fun, Microbatched):
    vec, vjp, info = jax.vjp(
        lambda p: _stacked_terms(fun(p, *args), has_aux, need_aux=need_aux), params,
        has_aux=True)
    return vec, lambda rows: jax.vmap(vjp)(rows)[0], info

  examples, *rest = args
  n = fun.num_microbatches
  sizes = {x.shape[0] for x in jax.tree.leaves(examples)}
  if len(sizes) != 1:
    raise ValueError(f"examples must share their leading (batch) axis; got sizes {sizes}")
  (size,) = sizes
  if size % n:
    raise ValueError(f"a batch of {size} does not split into {n} micro-batches")
  split = lambda x: x.reshape(size // n, n, *x.shape[1:]).swapaxes(0, 1)  # [n, B / n, ...]
  merge = lambda x: x.swapaxes(0, 1).reshape(size, *x.shape[2:])
  micro = jax.tree.map(split, examples)
  features = jax.tree.map(merge, jax.lax.map(lambda ex: fun.features(params, ex), micro))
  vec, terms_vjp, info = jax.vjp(
      lambda p, f: _stacked_terms(fun.terms(p, f, *rest), has_aux, need_aux=need_aux),
      params, features, has_aux=True)

  def pull_back(rows):
    direct, feature_cts = jax.vmap(terms_vjp)(rows)  # [R, ...] and [R, B, ...]
    cts = jax.tree.map(lambda c: jax.vmap(split)(c).swapaxes(0, 1), feature_cts)

    def one_microbatch(total, piece):
      ex, ct = piece
      _, vjp = jax.vjp(lambda p: fun.features(p, ex), params)
      (grads,) = jax.vmap(vjp)(ct)
      return jax.tree.map(jnp.add, total, grads), None

    grads, _ = jax.lax.scan(one_microbatch, direct, (micro, cts))
    return grads

  return vec, pull_back, info


def value_and_grad(fun: Callable, *, has_aux: bool = False) -> Callable:
  """jax.value_and_grad of the summed terms of `fun` as gated_value_and_grad takes it, plain
  or Microbatched (where one backward pass per micro-batch pulls back the whole batch's
  cotangents). aux may be None (a task loss alone)."""
  def summed(params, *args):
    vec, (_, outputs) = _stacked_terms(fun(params, *args), has_aux, need_aux=False)
    return vec.sum(), outputs

  def wrapped(params, *args):
    if isinstance(fun, Microbatched):
      vec, pull_back, (_, outputs) = _vjp(fun, params, args, has_aux, need_aux=False)
      loss = vec.sum()
      grads = jax.tree.map(lambda g: g[0], pull_back(jnp.ones((1, vec.shape[0]), vec.dtype)))
    else:
      (loss, outputs), grads = jax.value_and_grad(summed, has_aux=True)(params, *args)
    return ((loss, outputs) if has_aux else loss), grads

  return wrapped


def gated_value_and_grad(fun: Callable, *, mode: str = "drop", granularity: str = "per_term",
                         chunk: int = 1, has_aux: bool = False) -> Callable:
  """ACL-Grad as a function transform, in the spirit of jax.value_and_grad.

  fun(params, *args) returns (main, aux), or ((main, aux), outputs) with has_aux: main and aux
  are the loss terms, each a scalar or a vector [E] of per-term losses (e.g. one per exit of a
  multi-exit model) with their weights already applied. fun may be a `Microbatched` loss, whose
  examples then run in micro-batches with every term and gradient still the whole batch's. The
  transform returns a function (params, *args) -> (loss, grads, info), or
  ((loss, outputs), grads, info) with has_aux:

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

  def wrapped(params, *args):
    loss_vec, pull_back, (n_terms, outputs) = _vjp(fun, params, args, has_aux)
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
  stacked = pull_back(rows)  # a batched backward pass for both cotangents
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
    stacked = pull_back(jnp.concatenate(rows))
    pick = lambda i: jax.tree.map(lambda g: g[i], stacked)
    gated, infos = zip(*(combine(pick(i), pick(chunk + i), mode=mode) for i in range(chunk)))
    total = jax.tree.map(lambda t, *g: t + sum(g), total, *gated)
    return total, jax.tree.map(lambda *v: jnp.stack(v), *infos)

  zeros = jax.tree.map(jnp.zeros_like, params)
  grads, info = jax.lax.scan(one_chunk, zeros, (main_rows, aux_rows))
  return grads, jax.tree.map(lambda v: v.reshape(-1)[:n_terms], info)
