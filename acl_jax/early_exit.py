"""Early-exit inference for multi-exit BERT: exit policies, counted and measured speed-ups.

Policies (docs/method.md, "Early exit"), each a state machine stepped exit by exit:
  entropy   DeeBERT: exit at the first exit whose prediction entropy < threshold (nats);
  patience  PABEE: exit once the argmax has stayed the same for `threshold` consecutive exits
            (classification), or the prediction has moved by less than `tolerance` for
            `threshold` consecutive exits (regression, PABEE's STS-B variant);
  pcee      patience plus confidence: count consecutive exits whose normalized entropy
            H(p)/log K is below `threshold`; exit when the count reaches `patience`.
The last exit always exits.

The same `policy_step` drives both paths, so they cannot disagree by construction:
  - counted mode (`counted_exits`): one full forward of a batch, decisions vectorized over the
    batch by a lax.scan over exits. Speed-up in the papers' convention, 1 - mean layers / L,
    and as the ratio L / mean layers.
  - real early exit at batch size 1, two runners with the same results: `CompiledEarlyExit`
    (the sweep's: the whole forward as one compiled program, the rest of the network in the
    untaken branch of a lax.cond after each exit) and `EarlyExitRunner` (a compiled function
    per layer, stepped from Python, one host sync per exit). Either way the layers after the
    exit are never run. A vmapped lax.cond would run both branches, so neither is vmapped.
  - batched serving (`BatchedEarlyExit`): a batch where each example leaves at its own exit;
    after every exit the rows still running are compacted (padded to a power of two so only a
    few shapes compile) and the finished ones are not computed any further.
"""

import dataclasses
import functools
import io
import math
import time
from typing import Any, Callable, Iterable, Sequence

from etils import epath
import jax
import jax.numpy as jnp
import numpy as np

from acl_jax import data
from acl_jax import host
from acl_jax import metrics as metrics_lib
from acl_jax import run_dir
from acl_jax.models import multi_exit
from acl_jax.models.bert import BertLayer

POLICIES = ("entropy", "patience", "pcee")
REGRESSION_POLICIES = ("patience",)


@dataclasses.dataclass(frozen=True)
class Policy:
  """One exit policy at one threshold.

  threshold: entropy S in nats (entropy); the patience t (patience); the normalized-entropy
  bound theta in (0, 1] (pcee). patience: pcee's t. tolerance: regression patience's bound on
  the change between consecutive exits' predictions.
  """
  name: str
  threshold: float
  patience: int = 2
  tolerance: float = 0.1

  def __post_init__(self):
    if self.name not in POLICIES:
      raise ValueError(f"policy {self.name!r}; valid: {', '.join(POLICIES)}")
    if self.name == "patience" and (self.threshold < 1 or self.threshold != int(self.threshold)):
      raise ValueError(f"patience threshold {self.threshold} must be an integer >= 1")
    if self.name == "pcee" and self.patience < 1:
      raise ValueError(f"pcee patience {self.patience} must be >= 1")

  def settings(self) -> dict[str, jax.Array]:
    """The numbers policy_step reads, as float32 scalars (traced, not baked into a compile)."""
    return {"threshold": jnp.float32(self.threshold), "patience": jnp.float32(self.patience),
            "tolerance": jnp.float32(self.tolerance)}


def entropy(logits: jax.Array) -> jax.Array:
  """Prediction entropy in nats, [..., K] -> [...], float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def init_state(batch_size: int) -> dict[str, jax.Array]:
  """count: consecutive exits meeting the policy's condition; prev: the previous exit's
  prediction (argmax or regressed value); started: whether an exit has been seen."""
  return {"count": jnp.zeros((batch_size,), jnp.int32),
          "prev": jnp.zeros((batch_size,), jnp.float32),
          "started": jnp.zeros((batch_size,), bool)}


def prediction(logits: jax.Array, regression: bool) -> jax.Array:
  return logits[..., 0] if regression else jnp.argmax(logits, axis=-1)


def policy_step(name: str, regression: bool, settings: dict[str, Any],
                state: dict[str, jax.Array], logits: jax.Array, is_last: jax.Array | bool
                ) -> tuple[dict[str, jax.Array], jax.Array]:
  """Feeds one exit's logits [B, K]; returns the new state and whether each row exits here.

  name: the policy; settings: Policy.settings() (numbers, which may be traced: one compiled
  step serves every threshold).
  """
  pred = prediction(logits, regression).astype(jnp.float32)
  if name != "patience" and regression:
    raise ValueError(f"the {name} policy needs class probabilities; use patience for "
                     "regression tasks")
  if name == "entropy":
    return state, (entropy(logits) < settings["threshold"]) | is_last
  if name == "patience":
    if regression:
      same = jnp.abs(pred - state["prev"]) < settings["tolerance"]
    else:
      same = pred == state["prev"]
    count = jnp.where(state["started"] & same, state["count"] + 1, 0)
    target = settings["threshold"]
  else:  # pcee
    normalized = entropy(logits) / math.log(logits.shape[-1])
    count = jnp.where(normalized < settings["threshold"], state["count"] + 1, 0)
    target = settings["patience"]
  new_state = {"count": count, "prev": pred, "started": jnp.ones_like(state["started"])}
  return new_state, (count >= target) | is_last


def counted_exits(policy: Policy, exit_logits: jax.Array, *, regression: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
  """Decisions for a batch from a full forward: exit_logits [E, B, K] -> (exit index [B] into
  the E exits, prediction [B] at that exit)."""
  return _counted(policy.name, regression, policy.settings(), jnp.asarray(exit_logits))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _counted(name: str, regression: bool, settings, exit_logits):
  num_exits, batch = exit_logits.shape[:2]

  def scan_step(carry, inputs):
    state, done, chosen = carry
    index, logits = inputs
    state, exit_now = policy_step(name, regression, settings, state, logits,
                                  index == num_exits - 1)
    chosen = jnp.where(~done & exit_now, index, chosen)
    return (state, done | exit_now, chosen), None

  init = (init_state(batch), jnp.zeros((batch,), bool), jnp.full((batch,), num_exits - 1))
  (_, _, chosen), _ = jax.lax.scan(scan_step, init, (jnp.arange(num_exits), exit_logits))
  preds = prediction(jnp.take_along_axis(exit_logits, chosen[None, :, None], axis=0)[0],
                     regression)
  return chosen, preds


def speedup(layers_used: np.ndarray, num_layers: int) -> dict[str, float]:
  """The papers' speed-up 1 - mean layers / L, and the ratio L / mean layers."""
  mean_layers = float(np.mean(layers_used))
  return {"mean_layers": mean_layers, "speedup": 1.0 - mean_layers / num_layers,
          "speedup_ratio": num_layers / mean_layers}


def default_thresholds(name: str, num_exits: int, num_labels: int) -> list[float]:
  """The sweep drawn as a quality-speed curve."""
  if name == "patience":
    return [float(t) for t in range(1, num_exits)]
  if name == "entropy":  # fractions of the largest possible entropy, log K
    return [round(f * math.log(num_labels), 4) for f in
            (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)]
  return [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def _pow2_at_least(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


class _LayerByLayer:
  """A MultiExitBert compiled piece by piece (embeddings, one layer, one exit head), each
  piece reused across layers or exits."""

  def __init__(self, model: multi_exit.MultiExitBert, params):
    if not isinstance(model, multi_exit.MultiExitBert):
      raise TypeError("early exit needs a multi-exit model (the `multi_exit` preset)")
    self.model, self.params = model, params
    self.num_layers = model.config.num_hidden_layers
    self.exit_layers = model.resolved_exit_layers()
    self.regression = model.num_labels == 1
    variables = {"params": params}
    self.embed = jax.jit(lambda ids, mask, types: model.apply(
        variables, ids, mask, types, method=multi_exit.MultiExitBert.embed))
    layer = BertLayer(model.config, model.dtype, model.precision, parent=None)
    # One function for every layer: the layer's parameters are an argument, not a constant.
    self.layer_fn = lambda p, hidden, bias: layer.apply({"params": p}, hidden, bias)
    self.layer = jax.jit(self.layer_fn)
    self.layer_params = [params["bert"]["encoder"]["layer"][str(i)]
                         for i in range(self.num_layers)]
    head = multi_exit.ExitHead(model.config, model.num_labels, own_pooler=True,
                               dtype=model.dtype, precision=model.precision, parent=None)
    pooler_input = model.pooler_input
    self.head_fn = lambda p, hidden, mask: head.apply(
        {"params": p}, multi_exit.pooled_tokens(hidden, mask, pooler_input),
        method=lambda m, h: m.classify(m.pool(h)))
    self.head = jax.jit(self.head_fn)
    shared = params["bert"]["pooler"]
    self.head_params = {
        layer: {"pooler": params[f"exit_{layer}"].get("pooler", shared),
                "classifier": params[f"exit_{layer}"]["classifier"]}
        for layer in self.exit_layers}
    self.full = jax.jit(lambda ids, mask, types: model.apply(
        variables, ids, mask, types)["logits"][-1])
    self._steps = {}
    self._settings = {}
    self._full_prediction = jax.jit(lambda *inputs: prediction(self.full(*inputs),
                                                               self.regression))

  def full_model(self, input_ids, attention_mask, token_type_ids) -> np.ndarray:
    """The full model's prediction (every layer, last exit): the latency baseline."""
    return np.asarray(self._full_prediction(input_ids, attention_mask, token_type_ids))

  def settings_of(self, policy: Policy) -> dict[str, jax.Array]:
    """policy.settings() as device scalars made once per policy, not per example."""
    if policy not in self._settings:
      self._settings[policy] = policy.settings()
    return self._settings[policy]

  def policy_step(self, policy: Policy) -> Callable:
    """policy_step compiled once per policy name; the threshold is an argument."""
    if policy.name not in self._steps:
      self._steps[policy.name] = jax.jit(
          functools.partial(policy_step, policy.name, self.regression))
    return functools.partial(self._steps[policy.name], policy.settings())


class EarlyExitRunner(_LayerByLayer):
  """Real early exit at batch size 1: layers after the exit are never computed.

  An exit layer is one compiled call (the layer, its exit head, the policy step and the
  prediction) followed by the one host sync that decides whether to go on; a layer without an
  exit is one call of the shared layer function. At batch size 1 each dispatch costs a
  noticeable fraction of a layer on CPU, so the calls are as few as the decisions allow.
  """

  def __init__(self, model: multi_exit.MultiExitBert, params):
    super().__init__(model, params)
    self._fused = {}
    self._init = init_state(1)

  def layer_and_exit(self, policy: Policy) -> Callable:
    """(settings, layer params, head params, hidden, bias, mask, state, is_last) -> (hidden,
    state, exit now, prediction [1]), compiled once per policy name."""
    if policy.name not in self._fused:
      name, regression = policy.name, self.regression

      def fused(settings, layer_params, head_params, hidden, bias, mask, state, is_last):
        hidden = self.layer_fn(layer_params, hidden, bias)
        logits = self.head_fn(head_params, hidden, mask)
        state, exit_now = policy_step(name, regression, settings, state, logits, is_last)
        return hidden, state, exit_now[0], prediction(logits, regression)

      self._fused[policy.name] = jax.jit(fused)
    return self._fused[policy.name]

  def __call__(self, policy: Policy, input_ids, attention_mask, token_type_ids
               ) -> tuple[np.ndarray, int]:
    """(prediction [1], exit layer) for one example given as [1, T] arrays."""
    settings, step = self.settings_of(policy), self.layer_and_exit(policy)
    hidden, bias = self.embed(input_ids, attention_mask, token_type_ids)
    state = self._init
    last_exit = self.exit_layers[-1]
    for layer in range(1, last_exit + 1):
      params = self.layer_params[layer - 1]
      if layer not in self.head_params:
        hidden = self.layer(params, hidden, bias)
        continue
      hidden, state, exit_now, pred = step(settings, params, self.head_params[layer], hidden,
                                           bias, attention_mask, state, layer == last_exit)
      if bool(exit_now):  # the host decides: the only sync per exit
        return np.asarray(pred), layer
    raise AssertionError("the last exit always exits")


class CompiledEarlyExit(_LayerByLayer):
  """Real early exit at batch size 1 as one compiled program per policy and length bucket.

  The layers are unrolled; after each exit head the rest of the network sits in the false
  branch of a lax.cond on the policy's scalar decision (not vmapped, so only the taken branch
  runs): the layers after the exit are never computed, and there is no host round trip or
  extra dispatch per exit. Each layer's parameters are a static element of a list, so nothing
  is sliced or copied per layer (a lax.while_loop over stacked layers copies every layer's
  weights out of the stack on each iteration, and measured no faster than the per-layer
  runner). On a 2-core CPU with MiniLM on RTE, going through all six exits costs 1.05x the
  full model, where EarlyExitRunner costs about 1.15x; the sweep times both on real data
  ("runner_comparison" in early_exit.json).
  """

  def __init__(self, model: multi_exit.MultiExitBert, params):
    super().__init__(model, params)
    self._programs = {}

  def program(self, name: str) -> Callable:
    """(settings, ids, mask, types) -> (prediction [], exit layer []), compiled once per
    policy name (and input length)."""
    if name in self._programs:
      return self._programs[name]
    last_exit, regression = self.exit_layers[-1], self.regression
    # The parameters are closed over, so they are constants of the program, as in the full
    # model it is timed against: passing ~130 parameter arrays per call cost 0.3-0.5 ms of
    # dispatch, 5-8% of a two-layer exit (MiniLM, batch 1, this CPU).
    layer_params, head_params = self.layer_params, self.head_params

    def run(settings, ids, mask, types):
      hidden, bias = self.embed(ids, mask, types)

      def from_layer(layer, hidden, state):
        hidden = self.layer_fn(layer_params[layer - 1], hidden, bias)
        if layer not in head_params:
          return from_layer(layer + 1, hidden, state)
        logits = self.head_fn(head_params[layer], hidden, mask)
        state, exit_now = policy_step(name, regression, settings, state, logits,
                                      layer == last_exit)
        pred = prediction(logits, regression)[0].astype(jnp.float32)
        if layer == last_exit:
          return pred, jnp.int32(layer)
        return jax.lax.cond(exit_now[0], lambda: (pred, jnp.int32(layer)),
                            lambda: from_layer(layer + 1, hidden, state))

      return from_layer(1, hidden, init_state(1))

    self._programs[name] = jax.jit(run)
    return self._programs[name]

  def __call__(self, policy: Policy, input_ids, attention_mask, token_type_ids
               ) -> tuple[np.ndarray, int]:
    """(prediction [1], exit layer) for one example given as [1, T] arrays."""
    pred, layer = self.program(policy.name)(self.settings_of(policy), input_ids,
                                            attention_mask, token_type_ids)
    pred = np.asarray(pred)[None]
    return (pred if self.regression else pred.astype(np.int64)), int(layer)


class BatchedEarlyExit(_LayerByLayer):
  """Per-example exits inside a batch: finished rows leave, the rest run on, compacted."""

  def __call__(self, policy: Policy, input_ids, attention_mask, token_type_ids
               ) -> tuple[np.ndarray, np.ndarray]:
    """(predictions [B], exit layers [B]) for one batch of [B, T] arrays."""
    batch = input_ids.shape[0]
    step = self.policy_step(policy)
    hidden, bias = self.embed(input_ids, attention_mask, token_type_ids)
    mask = attention_mask  # rows follow hidden's through the compaction
    state = init_state(batch)
    active = np.arange(batch)  # original row of each running row
    preds = np.zeros((batch,), np.float32 if self.regression else np.int32)
    exits = np.zeros((batch,), np.int32)
    last_exit = self.exit_layers[-1]
    for layer in range(1, last_exit + 1):
      hidden = self.layer(self.layer_params[layer - 1], hidden, bias)
      if layer not in self.head_params:
        continue
      logits = self.head(self.head_params[layer], hidden, mask)
      state, exit_now = step(state, logits, layer == last_exit)
      done = np.asarray(exit_now)[:len(active)]
      preds[active[done]] = np.asarray(prediction(logits, self.regression))[:len(active)][done]
      exits[active[done]] = layer
      active = active[~done]
      if not len(active):
        break
      keep = np.flatnonzero(~done)
      # Pad the survivors to a power of two by repeating the first one: a few static shapes.
      rows = np.concatenate([keep, np.full(_pow2_at_least(len(keep)) - len(keep), keep[0])])
      hidden, bias, mask = hidden[rows], bias[rows], mask[rows]
      state = jax.tree.map(lambda x: x[rows], state)
    return preds, exits


def timed(fns: Sequence[Callable], examples: Iterable[tuple]) -> tuple[list[float], list]:
  """Mean seconds per call of each fn(*example) over the examples, and each fn's results.

  The functions run alternately, example by example (each result synced), so a machine that
  speeds up or slows down during the measurement shifts them all alike and their ratio holds.
  """
  examples = list(examples)
  seconds, outputs = [0.0] * len(fns), [[] for _ in fns]
  for example in examples:
    for i, fn in enumerate(fns):
      start = time.perf_counter()
      outputs[i].append(jax.block_until_ready(fn(*example)))
      seconds[i] += time.perf_counter() - start
  return [s / len(examples) for s in seconds], outputs


def single_examples(encoded, boundaries: Sequence[int]) -> list[tuple[np.ndarray, ...]]:
  """Every example of a split as batch-1 arrays, padded to its length bucket."""
  out = []
  for i in range(len(encoded)):
    length = min(b for b in boundaries if b >= encoded.lengths[i])
    batch = data.make_batch(encoded, np.array([i]), int(length))
    out.append((batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]))
  return out


# The model is static (flax modules hash by their fields): equal models share compiled
# programs across calls, e.g. the test splits of one run (MNLI has three).
@functools.partial(jax.jit, static_argnums=0)
def _exit_logits_of_batch(model, params, *inputs) -> jax.Array:
  logits = model.apply({"params": params}, *inputs, deterministic=True)["logits"]
  return logits if logits.ndim == 3 else logits[None]


def exit_logits(run, encoded) -> tuple[np.ndarray, np.ndarray]:
  """Counted mode's one full forward over a split in eval order: every exit's logits
  [E, R, K] (E = 1 for a single-exit model) and each row's example index [R] (-1: a padding
  row). Labels are not read, so test splits work too."""
  logits, index = [], []
  for batch in data.eval_batches(encoded, batch_size=run.config.eval_batch_size,
                                 boundaries=run.boundaries):
    logits.append(_exit_logits_of_batch(run.model, run.params,
                                        *(batch[k] for k in data.MODEL_INPUTS)))
    index.append(batch["index"])
  return np.concatenate(jax.device_get(logits), axis=1), np.concatenate(index)


def sweep(run, *, split: str | None = None, policies: Sequence[str] | None = None,
          pcee_patience: int = 2, tolerance: float = 0.1, measure: bool = True,
          max_examples: int | None = None, server_batch_size: int = 32,
          log: Callable[[str], None] = print) -> dict[str, Any]:
  """Sweeps every policy's threshold on a trained multi-exit run: the dev metric and counted
  speed-up for each, and (measure=True) the measured batch-1 latency of real early exiting
  against the full model, in this same process. Returns early_exit.json's content."""
  if not isinstance(run.model, multi_exit.MultiExitBert):
    raise ValueError(f"{run.workdir} is a single-exit run; early exit needs a multi-exit one "
                     "(train with the `multi_exit` preset)")
  task = run.task
  split = split or next(iter(task.eval_splits))
  regression = task.is_regression
  valid = REGRESSION_POLICIES if regression else POLICIES
  policies = list(policies or valid)
  bad = [p for p in policies if p not in valid]
  if bad:
    raise ValueError(f"policies {bad} do not apply to {task.name}; valid: {', '.join(valid)}")
  encoded = run.load_encoded(split)
  exit_layers = run.model.resolved_exit_layers()
  num_layers = run.model.config.num_hidden_layers
  all_logits, order = exit_logits(run, encoded)
  mask = (order >= 0).astype(np.float32)
  labels = np.where(order >= 0, encoded.labels[np.maximum(order, 0)], 0)

  def score(preds) -> dict[str, float]:
    return metrics_lib.compute(task, np.asarray(preds), labels, mask)

  per_exit = {f"exit{layer}": score(prediction(all_logits[i], regression))
              for i, layer in enumerate(exit_layers)}
  result = {"workdir": str(run.workdir), "task": task.name, "split": split,
            "objective": run.config.objective, "checkpoint_step": run.step,
            "main_metric": task.main_metric, "num_layers": num_layers,
            "exit_layers": list(exit_layers), "per_exit": per_exit,
            "examples": int(mask.sum()), "policies": {}}
  settings = {"pcee": {"patience": pcee_patience}, "patience": {"tolerance": tolerance}}
  grid = []
  for name in policies:
    for threshold in default_thresholds(name, len(exit_layers), max(task.num_labels, 2)):
      policy = Policy(name, threshold, patience=pcee_patience, tolerance=tolerance)
      chosen, preds = counted_exits(policy, jnp.asarray(all_logits), regression=regression)
      layers = np.asarray(exit_layers)[np.asarray(chosen)][mask > 0]
      row = {"threshold": threshold, **settings.get(name, {}),
             "metrics": score(preds), **speedup(layers, num_layers)}
      result["policies"].setdefault(name, []).append(row)
      grid.append((policy, row, np.asarray(chosen), np.asarray(preds)))
  if not measure:
    return result

  # Real early exit at batch size 1, on the first max_examples examples of the split.
  runner = CompiledEarlyExit(run.model, run.params)
  rows_of = {int(i): r for r, i in enumerate(order) if i >= 0}
  count = len(encoded) if max_examples is None else min(max_examples, len(encoded))
  examples = single_examples(encoded, run.boundaries)[:count]
  warm = {int(ex[0].shape[1]): ex for ex in examples}.values()  # one per length: compiles
  for example in warm:
    runner.full_model(*example)
    for policy, *_ in grid:
      runner(policy, *example)
  log(f"measuring batch-1 latency on {count} {split} examples, "
      f"{len(grid)} thresholds and the full model")
  # Each threshold is timed alternately with the full model, example by example: its speed-up
  # is the ratio of the two, measured under the same machine conditions.
  full_times = []
  for policy, row, chosen, preds in grid:
    (full, seconds), (_, outputs) = timed([runner.full_model, functools.partial(runner, policy)],
                                          examples)
    full_times.append(full)
    exits = np.array([layer for _, layer in outputs])
    counted_layers = np.asarray(exit_layers)[chosen[[rows_of[i] for i in range(count)]]]
    row.update(measured_latency_ms=1e3 * seconds, full_latency_ms=1e3 * full,
               measured_speedup_ratio=full / seconds, measured_examples=count,
               measured_mean_layers=float(exits.mean()),
               counted_mean_layers_on_measured=float(counted_layers.mean()),
               exits_agree_with_counted=float(np.mean(exits == counted_layers)))
    # Against the speed-up counted on the same examples (the measured subset).
    row["measured_over_counted"] = row["measured_speedup_ratio"] / (
        num_layers / row["counted_mean_layers_on_measured"])
  result["full_model"] = {"latency_ms": 1e3 * float(np.mean(full_times)),
                          "latency_ms_min": 1e3 * min(full_times),
                          "latency_ms_max": 1e3 * max(full_times),
                          "metrics": per_exit[f"exit{exit_layers[-1]}"]}

  result["runner_comparison"] = _compare_runners(run, runner, examples, grid, log)
  # Batched serving: the threshold nearest a counted 2x of each policy, at server_batch_size.
  result["batched"] = _measure_batched(run, encoded, grid, server_batch_size, log, max_examples)
  result["device"] = str(jax.devices()[0])
  return result


def _nearest_2x(grid) -> list[tuple[Policy, dict[str, Any]]]:
  """Each policy's threshold whose counted speed-up ratio is nearest 2x, with its row."""
  by_policy = {}
  for policy, row, *_ in grid:
    best = by_policy.get(policy.name)
    if best is None or abs(row["speedup_ratio"] - 2) < abs(best[1]["speedup_ratio"] - 2):
      by_policy[policy.name] = (policy, row)
  return list(by_policy.values())


def _compare_runners(run, runner, examples, grid, log) -> list[dict[str, Any]]:
  """One compiled program (CompiledEarlyExit, the sweep's runner) against per-layer functions
  stepped from Python (EarlyExitRunner), timed alternately on the same examples at each
  policy's ~2x threshold: the measurement behind the choice of runner."""
  per_layer = EarlyExitRunner(run.model, run.params)
  out = []
  for policy, row in _nearest_2x(grid):
    compiled, stepped = functools.partial(runner, policy), functools.partial(per_layer, policy)
    for example in {int(ex[0].shape[1]): ex for ex in examples}.values():
      stepped(*example)  # compile each length bucket
    (fast, slow), (ours, theirs) = timed([compiled, stepped], examples)
    agree = np.mean([a[1] == b[1] for a, b in zip(ours, theirs)])
    out.append({"policy": policy.name, "threshold": policy.threshold,
                "compiled_latency_ms": 1e3 * fast, "per_layer_latency_ms": 1e3 * slow,
                "exits_agree": float(agree)})
    log(f"runners at {policy.name} {policy.threshold}: compiled "
        f"{out[-1]['compiled_latency_ms']:.2f} ms, per-layer "
        f"{out[-1]['per_layer_latency_ms']:.2f} ms")
  return out


def _measure_batched(run, encoded, grid, batch_size: int, log, max_examples: int | None
                     ) -> list[dict[str, Any]]:
  server = BatchedEarlyExit(run.model, run.params)
  batches = [tuple(b[k] for k in data.MODEL_INPUTS) for b in data.eval_batches(
      encoded, batch_size=batch_size, boundaries=run.boundaries)]
  if max_examples is not None:
    batches = batches[:max(1, -(-max_examples // batch_size))]
  out = []
  for policy, row in _nearest_2x(grid):
    for batch in batches:  # compile each compacted shape before timing
      server(policy, *batch)
      server.full(*batch)
    (early, full), _ = timed([functools.partial(server, policy), server.full], batches)
    out.append({"policy": policy.name, "threshold": policy.threshold,
                "batch_size": batch_size, "counted_speedup_ratio": row["speedup_ratio"],
                "full_examples_per_s": batch_size / full,
                "early_exit_examples_per_s": batch_size / early,
                "throughput_gain": full / early})
    log(f"batched {policy.name} {policy.threshold}: {out[-1]['throughput_gain']:.2f}x "
        "throughput")
  return out


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
  """The (speed-up, metric) points that no other point beats on both, by rising speed-up: the
  best metric reachable at each speed-up."""
  front, best = [], -math.inf
  for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
    if y > best:
      front.append((x, y))
      best = y
  return front[::-1]


def tradeoff_curves(results: Sequence[dict[str, Any]], labels: Sequence[str] | None = None
                    ) -> dict[str, dict[str, dict[str, list[tuple[float, float]]]]]:
  """{policy: {label: {"counted": front, "measured": points}}}: what `plot` draws.

  Runs with one label (default: the objective) are seeds of one configuration: each threshold's
  counted speed-up, metric and measured speed-up are averaged over them (their sweeps share
  thresholds), and the counted front is drawn from those means; "measured" holds the measured
  batch-1 speed-up at each threshold on the front (where the sweep timed it).
  """
  groups: dict[str, list[dict[str, Any]]] = {}
  for index, result in enumerate(results):
    groups.setdefault(labels[index] if labels else result["objective"], []).append(result)
  curves: dict[str, dict[str, dict[str, list[tuple[float, float]]]]] = {}
  for label, group in groups.items():
    metric = group[0]["main_metric"]
    for name in group[0]["policies"]:
      by_threshold: dict[float, list[dict[str, Any]]] = {}
      for result in group:
        for row in result["policies"].get(name, []):
          by_threshold.setdefault(row["threshold"], []).append(row)
      mean = lambda rows, key: float(np.mean([r[key] for r in rows]))
      points = {(mean(rows, "speedup_ratio"), float(np.mean([r["metrics"][metric]
                                                             for r in rows]))): rows
                for rows in by_threshold.values() if len(rows) == len(group)}
      front = pareto_front(points)
      measured = [(mean(points[p], "measured_speedup_ratio"), p[1]) for p in front
                  if all("measured_speedup_ratio" in r for r in points[p])]
      curves.setdefault(name, {})[label] = {"counted": front, "measured": measured}
  return curves


def plot(results: Sequence[dict[str, Any]], path, *, labels: Sequence[str] | None = None,
         title: str | None = None) -> None:
  """Quality-speed trade-off, one panel per policy: each label's Pareto front of the dev metric
  against the counted speed-up L / mean layers (line; seeds averaged per threshold), and the
  measured batch-1 speed-up of the same thresholds (hollow circles)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  curves = tradeoff_curves(results, labels)
  fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 4), sharey=True,
                           squeeze=False)
  colours = {}
  for ax, (name, by_label) in zip(axes[0], curves.items()):
    for label, curve in by_label.items():
      colour = colours.setdefault(label, f"C{len(colours)}")
      # A step: between two front points the better one reachable is the faster one's.
      ax.plot(*zip(*curve["counted"]), "-", color=colour, marker="o", markersize=3, label=label,
              drawstyle="steps-pre")
      if curve["measured"]:
        ax.scatter(*zip(*curve["measured"]), facecolors="none", edgecolors=colour, s=30)
    ax.set_title(name)
    ax.set_xlabel("speed-up L / mean layers")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel(f"dev {results[0]['main_metric']} (best at each speed-up)")
  axes[0][-1].legend(fontsize=7)
  fig.suptitle(title or f"{results[0]['task']}: quality-speed trade-off (lines: counted; "
               "circles: measured, batch 1)", fontsize=9)
  fig.tight_layout()
  png = io.BytesIO()  # then written through epath: `path` may be in an object store
  fig.savefig(png, format="png", dpi=120)
  plt.close(fig)
  epath.Path(path).write_bytes(png.getvalue())


def run_on_workdir(workdir, *, which: str = "latest", max_examples: int | None = None,
                   measure: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
  """--mode=early_exit: sweeps a trained multi-exit run and writes <workdir>/early_exit.json
  and <workdir>/early_exit.png."""
  run = run_dir.load_trained_run(workdir, which=which)
  result = sweep(run, max_examples=max_examples, measure=measure, log=log)
  result["params"] = which
  result["meta"] = host.run_metadata()
  # The figure first: the JSON's presence is what marks the run as swept (run_grid).
  plot([result], run.workdir / run_dir.EARLY_EXIT_PLOT)
  run_dir.write_json(run.workdir / run_dir.EARLY_EXIT_FILE, result)
  for name, rows in result["policies"].items():
    for row in rows:
      measured = (f", measured {row['measured_speedup_ratio']:.2f}x "
                  f"({row['measured_latency_ms']:.2f} ms)" if "measured_speedup_ratio" in row
                  else "")
      log(f"{name} {row['threshold']:g}: {result['main_metric']} "
          f"{row['metrics'][result['main_metric']]:.4f}, counted {row['speedup_ratio']:.2f}x"
          + measured)
  return result
