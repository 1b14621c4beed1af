"""The per-exit ACL-Grad of a multi-exit BERT at its cost floor: each exit's two backward
passes run through that exit's own layers only.

Exit e's losses depend on the embeddings, layers 1..e and the exit heads, never on the layers
above it, so its CE and auxiliary gradients are zero there. A single vjp of the whole forward
(gradients.gated_value_and_grad) cannot know that and pulls every exit's cotangents back
through all L layers: 2E full backward passes. Here the forward runs piece by piece (the
embeddings, each layer, the exit heads), keeping each piece's vjp, and exit e's cotangents
enter at layer e and go down from there. Cost, counting a layer's backward pass as 1 and
ignoring the (small) heads:

    forward                    L                 (once, as in any step)
    one vjp of the whole       2E * L            (today's per-exit step before this module)
    per exit, here             2 * sum_e l_e     (l_e: exit e's layer; every layer: E(E+1))
    CE step, for scale         L

so with an exit after each of 6 layers 42 layer-backwards instead of 72, and as the backward
pass costs about twice the forward, a step of about (6 + 2*42) / (6 + 2*6) = 5x a multi-exit
CE step instead of 8.3x. The pieces run through the model's own modules (MultiExitBert.embed,
.encoder_layer, .exits), so parameters and dropout keys are the full forward's: the result
equals the single-vjp step up to float rounding.

Memory: the forward's residuals (as in any backward pass), plus, for the exits in flight, two
gradients truncated to their layers, plus the running gated sum. The chunks of exits run as the
iterations of a lax.scan, chunk k taking branch k of a lax.switch, so XLA runs them one after
another and reuses their buffers; unrolled, it overlapped them and held about twice the
temporaries of a multi-exit CE step (MiniLM, batch 32 x 128: 3.8 GiB against 1.8 GiB).
`chunk` exits are pulled back together as one batched backward pass from the deepest of them
down (the shallower ones carry zero cotangents until their own layer): fewer, larger passes, at
the price of those zeros.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

from acl_jax import data
from acl_jax import gradients
from acl_jax import models
from acl_jax.models import bert
from acl_jax.models import multi_exit

# A layer's backward pass costs about twice its forward pass (two matmuls per forward one).
BACKWARD_OVER_FORWARD = 2.0
LAYERS = ("bert", "encoder", "layer")
EMBEDDINGS = ("bert", "embeddings")


def layer_passes(num_layers: int, exit_layers, *, gate: str) -> dict[str, float]:
  """The cost model above: layer forward and backward passes of one multi-exit step, and its
  cost in layer forwards (backward = BACKWARD_OVER_FORWARD forwards), for gate "none" (one
  backward of the summed loss: CE, KD, ungated objectives), "global" (two), "one_vjp" (2E
  full backward passes: the per-exit gate through a single vjp) or "per_exit" (this module)."""
  exit_layers = sorted(exit_layers)
  forward = exit_layers[-1]
  backward = {"none": forward, "global": 2 * forward, "one_vjp": 2 * len(exit_layers) * forward,
              "per_exit": 2 * sum(exit_layers)}[gate]
  return {"forward": forward, "backward": backward,
          "cost": forward + BACKWARD_OVER_FORWARD * backward}


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _with(tree, path, value):
  """A copy of the nested dict `tree` with `value` at `path` (the rest shared, not copied)."""
  if not path:
    return value
  return {**tree, path[0]: _with(tree[path[0]], path[1:], value)}


def _head_paths(params) -> list[tuple[str, ...]]:
  """The exit heads' parameters, and the shared pooler they may read."""
  heads = [(name,) for name in params if name.startswith("exit_")]
  return heads + ([("bert", "pooler")] if "pooler" in params["bert"] else [])


def per_exit_gated_grads(model: multi_exit.MultiExitBert, params, examples,
                         terms_of: Callable, *, mode: str, chunk: int = 1):
  """((loss, outputs), grads, info) as gradients.gated_value_and_grad(granularity="per_term")
  computes them for the loss terms of `model`, each exit's gradients through its own layers.

  examples: the model inputs (data.MODEL_INPUTS) and each example's dropout key
  ("dropout_key", models.example_keys), every piece of the forward keyed per example as
  objectives' whole-model forward is. terms_of(logits [E, B, K], pooled [E, B, H],
  label_embeddings [E, K, H]) returns ((main [E], aux [E]), outputs), weights applied.
  info: dot, cosine, kept, each [E].
  """
  inputs = [examples[k] for k in data.MODEL_INPUTS]
  attention_mask = examples["attention_mask"]
  exit_layers = model.resolved_exit_layers()
  n_exits = len(exit_layers)

  def apply(p, *batched, method, batch_axis=0, **static):
    def one(key, *xs):
      return model.apply({"params": p}, *xs, deterministic=False, rngs={"dropout": key},
                         method=method, **static)
    return models.per_example(one, batch_axis=batch_axis)(examples["dropout_key"], *batched)

  # The forward, piece by piece, each piece's vjp kept for the backward passes below.
  hidden, embed_vjp = jax.vjp(
      lambda p: apply(_with(params, EMBEDDINGS, p), *inputs, method=model.embed)[0],
      _get(params, EMBEDDINGS))
  bias = bert.attention_bias(attention_mask)
  states, layer_vjps = {0: hidden}, {}
  for layer in range(1, exit_layers[-1] + 1):
    path = (*LAYERS, str(layer - 1))
    states[layer], layer_vjps[layer] = jax.vjp(
        lambda p, h, layer=layer, path=path: apply(_with(params, path, p), h, bias, layer=layer,
                                                    method=model.encoder_layer),
        _get(params, path), states[layer - 1])

  head_paths = _head_paths(params)

  def heads(head_params, exit_hidden):
    p = params
    for path, value in zip(head_paths, head_params):
      p = _with(p, path, value)
    out = apply(p, dict(zip(exit_layers, exit_hidden)), attention_mask, method=model.exits,
                batch_axis=1)
    (main, aux), outputs = terms_of(out["logits"], out["pooled"],
                                    multi_exit.label_embeddings(p, exit_layers))
    return jnp.concatenate([main, aux]), outputs

  loss_vec, heads_vjp, outputs = jax.vjp(
      heads, [_get(params, path) for path in head_paths],
      tuple(states[layer] for layer in exit_layers), has_aux=True)

  eye = jnp.eye(2 * n_exits, dtype=loss_vec.dtype)
  zeros = jax.tree.map(jnp.zeros_like, params)

  def gated_chunk(first):
    """The gated sum of one chunk of exits (a full gradient tree, zero above its deepest exit)
    and their gate info, padded to `chunk` exits."""
    members = list(range(first, min(first + chunk, n_exits)))
    # Rows: the chunk's main terms, then its auxiliary terms.
    rows = jnp.concatenate([eye[jnp.array(members)], eye[jnp.array(members) + n_exits]])
    head_grads, hidden_cts = jax.vmap(heads_vjp)(rows)
    entering = dict(zip(exit_layers, hidden_cts))  # exit layer -> cotangents [2c, B, T, H]
    layer_grads, cotangent = {}, None
    # Exits above the chunk's deepest are skipped: no term of the chunk reads them (teachers
    # are under stop-gradient), so their cotangents are zero.
    for layer in range(exit_layers[members[-1]], 0, -1):
      if layer in entering:
        cotangent = entering[layer] if cotangent is None else cotangent + entering[layer]
      layer_grads[layer], cotangent = jax.vmap(layer_vjps[layer])(cotangent)
    (embed_grads,) = jax.vmap(embed_vjp)(cotangent)

    pieces = {"embeddings": embed_grads, "layers": layer_grads, "heads": head_grads}
    c, total, infos = len(members), zeros, []
    for i in range(c):
      g_main = jax.tree.map(lambda g, i=i: g[i], pieces)
      g_aux = jax.tree.map(lambda g, i=i: g[c + i], pieces)
      gated, info = gradients.combine(g_main, g_aux, mode=mode)
      total = _add(total, gated, head_paths)
      infos.append(info)
    infos += [jax.tree.map(jnp.zeros_like, infos[0])] * (chunk - c)
    return total, jax.tree.map(lambda *v: jnp.stack(v), *infos)

  # One chunk per iteration of a loop, each chunk a branch of lax.switch: XLA then runs the
  # chunks one after another and reuses one chunk's buffers for the next. Unrolled, it
  # overlapped them and held about twice the temporaries of a CE step.
  branches = [lambda first=first: gated_chunk(first) for first in range(0, n_exits, chunk)]

  def one_chunk(total, index):
    gated, info = jax.lax.switch(index, branches)
    return jax.tree.map(jnp.add, total, gated), info

  total, info = jax.lax.scan(one_chunk, zeros, jnp.arange(len(branches)))
  info = jax.tree.map(lambda v: v.reshape(-1)[:n_exits], info)
  kept = info["kept"] if mode == "drop" else 1.0
  loss = loss_vec[:n_exits].sum() + (kept * loss_vec[n_exits:]).sum()
  return (loss, outputs), total, info


def _add(total, pieces: dict[str, Any], head_paths):
  """total + the gated pieces of one exit, each added where it sits in the parameter tree."""
  def add_at(tree, path, value):
    return _with(tree, path, jax.tree.map(jnp.add, _get(tree, path), value))

  total = add_at(total, EMBEDDINGS, pieces["embeddings"])
  for layer, value in pieces["layers"].items():
    total = add_at(total, (*LAYERS, str(layer - 1)), value)
  for path, value in zip(head_paths, pieces["heads"]):
    total = add_at(total, path, value)
  return total
