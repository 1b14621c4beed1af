"""Times one training step per (framework, model shape, objective): our jitted JAX step and HF
transformers + PyTorch, on the same random batch, in one process.

Every measured configuration prints one JSON line (`"kind": "step"`), also appended to --out;
then `"kind": "ratio"` lines compare median step times measured in this same run against the
speed targets (ACL's two gradients cost <= 1.55x CE; SCL and ACL-Embed <= 1.05x CE; our CE and
ACL steps no slower than PyTorch's).

Full run (quiet machine; takes a while on CPU):
  python experiments/benchmark_step.py --out experiments/results/benchmark_step.jsonl
Smoke test (tiny 2x64 model, batch 4, seq 32, 2 timed steps; under a minute):
  python experiments/benchmark_step.py --quick
"""

import argparse
import gc
import json
import os
import pathlib
import resource
import statistics
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import exit_gate
from acl_jax import hf_weights
from acl_jax import host
from acl_jax import models
from acl_jax import objectives
from acl_jax import optim
from acl_jax.models import bert
from acl_jax.models import multi_exit

# Architecture only; random init, dropout 0.1 as in fine-tuning. "tiny" is for smoke tests.
SHAPES = {
    "minilm": dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=12,
                   intermediate_size=1536),
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                      intermediate_size=3072),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=256),
}
VOCAB_SIZE = 30522
SINGLE_EXIT_OBJECTIVES = tuple(name for name, o in objectives.OBJECTIVES.items()
                               if not o.multi_exit_only and name != "deebert")
# Multi-exit rows (JAX): a MultiExitBert with an exit after every layer, asc exit weights;
# name: (train objective, gate granularity).
MULTI_EXIT_OBJECTIVES = {
    "me_ce": ("ce", "per_exit"),
    "me_acl_global": ("acl", "global"),
    "me_acl_per_exit": ("acl", "per_exit"),
    "me_acl_cl": ("acl_cl", "per_exit"),
}
OBJECTIVES = SINGLE_EXIT_OBJECTIVES + tuple(MULTI_EXIT_OBJECTIVES)
# The objectives PyTorch has a step for: the CE baseline and ACL (ACL-Embed + the drop gate).
TORCH_OBJECTIVES = ("ce", "acl")
FRAMEWORKS = ("jax", "pytorch")
AUX_WEIGHT, TEMPERATURE = 0.5, 0.3
# BERT uncased vocabulary ids of [PAD], [CLS], [SEP]; ordinary tokens are drawn above 999.
PAD_ID, CLS_ID, SEP_ID, FIRST_WORD_ID = 0, 101, 102, 1000

# (name, numerator, denominator, target maximum): numerator and denominator are
# (framework, objective). acl_project has the same two-gradient structure as acl, so it gets
# acl's target.
RATIOS = (
    ("jax acl / jax ce", ("jax", "acl"), ("jax", "ce"), 1.55),
    ("jax scl / jax ce", ("jax", "scl"), ("jax", "ce"), 1.05),
    ("jax acl_embed / jax ce", ("jax", "acl_embed"), ("jax", "ce"), 1.05),
    ("jax acl_project / jax ce", ("jax", "acl_project"), ("jax", "ce"), 1.55),
    ("jax ce / pytorch ce", ("jax", "ce"), ("pytorch", "ce"), 1.0),
    ("jax acl / pytorch acl", ("jax", "acl"), ("pytorch", "acl"), 1.0),
    # Multi-exit: the per-exit gate (each exit's backward through its own layers, exit_gate)
    # at most 5.5x a multi-exit CE step on a 2-core CPU; the global gate is reported.
    ("jax me_acl_global / jax me_ce", ("jax", "me_acl_global"), ("jax", "me_ce"), None),
    ("jax me_acl_per_exit / jax me_ce", ("jax", "me_acl_per_exit"), ("jax", "me_ce"), 5.5),
    ("jax me_acl_cl / jax me_ce", ("jax", "me_acl_cl"), ("jax", "me_ce"), 5.5),
)

QUICK = dict(shapes="tiny", batch_size=4, seq_len=32, warmup=1, steps=2)
DEFAULTS = dict(shapes="minilm,bert-base", batch_size=32, seq_len=128, warmup=3, steps=10)


def make_batch(rng: np.random.Generator, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
  """A padded sentence-pair batch as acl_jax.data makes it: [CLS] a [SEP] b [SEP] [PAD]...

  Lengths vary per row, so attention masks and token types look like RTE's; labels alternate
  between the 2 classes (shuffled) so every contrastive anchor has positives; no padding rows.
  """
  lengths = rng.integers(max(seq_len // 4, 5), seq_len + 1, size=batch_size)
  input_ids = np.full((batch_size, seq_len), PAD_ID, np.int32)
  token_type_ids = np.zeros((batch_size, seq_len), np.int32)
  attention_mask = np.zeros((batch_size, seq_len), np.int32)
  for row, n in enumerate(lengths):
    first_sep = 1 + rng.integers(1, n - 3)  # at least one token in each segment
    input_ids[row, :n] = rng.integers(FIRST_WORD_ID, VOCAB_SIZE, size=n)
    input_ids[row, [0, first_sep, n - 1]] = CLS_ID, SEP_ID, SEP_ID
    token_type_ids[row, first_sep + 1:n] = 1
    attention_mask[row, :n] = 1
  labels = rng.permutation(np.arange(batch_size) % 2).astype(np.int32)
  return {"input_ids": input_ids, "attention_mask": attention_mask,
          "token_type_ids": token_type_ids, "labels": labels,
          "mask": np.ones((batch_size,), np.float32)}


def _reset_peak_rss() -> bool:
  """Resets the process's resident-set high-water mark (Linux >= 4.0), so that each
  configuration reports its own peak instead of the largest one run before it."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _rss_mib() -> float:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")


def _peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _timing(times: list[float], batch_size: int) -> dict[str, float]:
  median = statistics.median(times)
  return {"median_step_s": median,
          "p90_step_s": float(np.percentile(times, 90)),
          "min_step_s": min(times),
          "examples_per_s": batch_size / median,
          "step_times_s": times}


def bert_config(shape: str) -> bert.BertConfig:
  return bert.BertConfig(vocab_size=VOCAB_SIZE, **SHAPES[shape])


class Prepared(NamedTuple):
  """One configuration, compiled and warmed up: `step()` runs one training step and waits for
  it; `describe()` returns its row's framework-specific fields."""
  step: Callable[[], None]
  describe: Callable[[], dict]


def prepare_jax(shape: str, objective: str, batch_np, args, config) -> Prepared:
  """Compiles objectives.make_train_step as train.py does (jit, state donated) and warms it up."""
  model_config = bert_config(shape)
  multi = objective in MULTI_EXIT_OBJECTIVES
  objective, gate = MULTI_EXIT_OBJECTIVES.get(objective, (objective, "per_exit"))
  if multi:
    model = multi_exit.MultiExitBert(config=model_config, num_labels=2,
                                     dtype=models.DTYPES[args.dtype])
    weights = multi_exit.exit_weights("asc", model.resolved_exit_layers())
  else:
    model = bert.BertForSequenceClassification(config=model_config, num_labels=2,
                                               dtype=models.DTYPES[args.dtype])
    weights = None
  dummy = jnp.zeros((1, 8), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), dummy, dummy, dummy)["params"]
  if args.pretrained_minilm and shape == "minilm":
    ckpt = hf_weights.preset_dir(hf_weights.MINILM)
    params["bert"] = jax.tree.map(
        jnp.asarray, hf_weights.load_bert_params(ckpt, hf_weights.load_config(ckpt)))
  tx, schedule = optim.create_optimizer(config, total_steps=1 + args.warmup + 2 * args.steps)
  state = optim.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=tx.init(params))
  del params
  step_config = config.copy_and_resolve_references()
  step_config.update(objective=objective, aux_weight=AUX_WEIGHT, temperature=TEMPERATURE,
                     gate_granularity=gate, gate_chunk=args.gate_chunk)
  train_step = jax.jit(objectives.make_train_step(
      model, tx, schedule, data.get_task("rte"), step_config,
      objectives.Stage("train", objective, weights)), donate_argnums=0)
  # On the device once: the step is timed, not the host-to-device copy of the batch.
  batch = jax.device_put(batch_np)
  rng = jax.random.key(1)
  live = {"state": state}
  del state

  start = time.perf_counter()
  # Compiled ahead of time, so the row can carry XLA's buffer sizes for this program: a
  # per-configuration memory figure even when --interleave holds every state at once.
  compiled = train_step.lower(live["state"], batch, rng).compile()

  def step(sync: bool = True):
    live["state"], live["metrics"] = compiled(live["state"], batch, rng)
    if sync:
      jax.block_until_ready(live["state"])

  step()
  compile_s = time.perf_counter() - start
  for _ in range(args.warmup):
    step(sync=False)
  jax.block_until_ready(live["state"])

  def describe():
    device = jax.devices()[0]
    metrics = live["metrics"]
    row = {"framework": "jax", "backend": jax.default_backend(),
           "device_kind": device.device_kind, "compile_s": compile_s,
           **xla_memory_mib(compiled), "last_loss": float(metrics["loss"]),
           "kept": float(np.mean(metrics["kept"])) if "kept" in metrics else None,
           "exits": objectives.num_exits(model), "gate_chunk": args.gate_chunk if multi else None,
           "xla_gflops": _xla_flops(compiled) / 1e9}
    if multi:
      cost_gate = "none" if objective == "ce" else gate
      row["cost_model"] = exit_gate.layer_passes(
          model_config.num_hidden_layers, model.resolved_exit_layers(), gate=cost_gate)
    stats = device.memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
      # The allocator's peak since the process started (it cannot be reset), so it is an
      # upper bound for every configuration after the first.
      row["peak_device_mib"] = stats["peak_bytes_in_use"] / 2**20
    return row

  return Prepared(step, describe)


def _xla_flops(compiled) -> float:
  """XLA's count of the step's floating-point operations (noise-free, unlike its time)."""
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis.get("flops", float("nan"))) if analysis else float("nan")


def xla_memory_mib(compiled) -> dict[str, float]:
  """The buffers XLA assigned to one compiled step, in MiB: the state and batch it takes, its
  outputs (less those that reuse a donated input) and its temporaries (activations, gradient
  pytrees). xla_peak_mib, their sum, bounds what the step holds at once."""
  stats = compiled.memory_analysis()
  if stats is None:  # a backend without the analysis
    return {}
  sizes = {"xla_argument_mib": stats.argument_size_in_bytes,
           "xla_output_mib": stats.output_size_in_bytes - stats.alias_size_in_bytes,
           "xla_temp_mib": stats.temp_size_in_bytes}
  sizes["xla_peak_mib"] = sum(sizes.values())
  return {name: size / 2**20 for name, size in sizes.items()}


def torch_acl_embed(features, labels, label_embeddings, temperature):
  """acl_jax.losses.acl_embed (anchors="all", no padding rows) in torch: SupCon over the
  samples and the label embeddings together, float32, with the same masked logsumexp."""
  import torch  # pylint: disable=import-outside-toplevel
  n, k = features.shape[0], label_embeddings.shape[0]
  elements = torch.cat([features.float(), label_embeddings.float()])
  element_labels = torch.cat([labels, torch.arange(k, device=labels.device)])
  z = elements * torch.rsqrt(torch.clamp((elements * elements).sum(-1, keepdim=True), min=1e-12))
  sim = z @ z.T / temperature
  others = ~torch.eye(n + k, dtype=torch.bool, device=sim.device)
  positives = others & (element_labels[:, None] == element_labels[None, :])
  peak = sim.masked_fill(~others, float("-inf")).amax(-1, keepdim=True).detach()
  total = torch.exp((sim - peak).masked_fill(~others, float("-inf"))).sum(-1)
  log_normalizer = peak[:, 0] + torch.log(total.clamp_min(torch.finfo(torch.float32).tiny))
  log_prob = sim - log_normalizer[:, None]
  n_pos = positives.sum(-1)
  per_anchor = -log_prob.masked_fill(~positives, 0.0).sum(-1) / n_pos.clamp_min(1)
  counted = (n_pos > 0).float()
  return (per_anchor * counted).sum() / counted.sum().clamp_min(1.0)


def check_torch_acl_embed() -> float:
  """The torch port against acl_jax.losses.acl_embed on one small random input; returns the
  absolute difference (a wrong port would time a different computation)."""
  import torch  # pylint: disable=import-outside-toplevel
  from acl_jax import losses  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  features = rng.normal(size=(8, 16)).astype(np.float32)
  label_embeddings = rng.normal(size=(2, 16)).astype(np.float32)
  labels = np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int32)
  ours = float(losses.acl_embed(features, labels, label_embeddings, temperature=TEMPERATURE))
  theirs = float(torch_acl_embed(torch.from_numpy(features), torch.from_numpy(labels).long(),
                                 torch.from_numpy(label_embeddings), TEMPERATURE))
  return abs(ours - theirs)


def prepare_pytorch(shape: str, objective: str, batch_np, args, config) -> Prepared:
  """HF BertForSequenceClassification; `ce`: one backward; `acl`: two autograd.grad calls off
  one forward, their float32 dot, and the drop gate. Warmed up."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  import hf_pytorch_glue  # pylint: disable=import-outside-toplevel  (torch: only when asked)

  device = torch.device(args.torch_device)
  torch.manual_seed(0)
  if args.pretrained_minilm and shape == "minilm":
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(hf_weights.preset_dir(hf_weights.MINILM)), num_labels=2)
  else:
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB_SIZE, num_labels=2, **SHAPES[shape]))
  model.to(device).train()
  params = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(
      hf_pytorch_glue.decay_groups(model, config.weight_decay), lr=config.learning_rate,
      betas=(config.adam_b1, config.adam_b2), eps=config.adam_eps)
  total_steps = 1 + args.warmup + 2 * args.steps
  scheduler = transformers.get_linear_schedule_with_warmup(
      optimizer, int(np.ceil(config.warmup_ratio * total_steps)), total_steps)
  batch = {k: torch.from_numpy(v).to(device) for k, v in batch_np.items()}
  labels = batch["labels"].long()
  kept = []

  def forward():
    # BertForSequenceClassification.forward, opened up: the contrastive term needs the pooled
    # vector before dropout, as our model returns it.
    pooled = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        token_type_ids=batch["token_type_ids"]).pooler_output
    return pooled, model.classifier(model.dropout(pooled))

  def ce_step():
    _, logits = forward()
    torch.nn.functional.cross_entropy(logits.float(), labels).backward()

  def acl_step():
    pooled, logits = forward()
    ce = torch.nn.functional.cross_entropy(logits.float(), labels)
    aux = AUX_WEIGHT * torch_acl_embed(pooled, labels, model.classifier.weight, TEMPERATURE)
    g_ce = torch.autograd.grad(ce, params, retain_graph=True)
    # The classifier bias does not reach the auxiliary term: its gradient is None.
    g_aux = torch.autograd.grad(aux, params, allow_unused=True)
    pairs = [(a, b) for a, b in zip(g_ce, g_aux) if b is not None]
    dot = torch.stack([torch.dot(a.flatten().float(), b.flatten().float()) for a, b in pairs]
                      ).sum()
    keep = bool(dot >= 0)  # the one host sync; eager PyTorch branches on the value
    kept.append(keep)
    for p, a, b in zip(params, g_ce, g_aux):
      p.grad = a.add_(b) if keep and b is not None else a

  backward = {"ce": ce_step, "acl": acl_step}[objective]

  def step(sync: bool = True):
    backward()
    torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if sync and device.type == "cuda":
      torch.cuda.synchronize(device)

  if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats(device)
  start = time.perf_counter()
  step()
  first_s = time.perf_counter() - start
  for _ in range(args.warmup):
    step(sync=False)
  step()

  def describe():
    row = {"framework": "pytorch", "backend": device.type,
           "device_kind": (torch.cuda.get_device_name(device) if device.type == "cuda"
                           else host.cpu_model()),
           "compile_s": first_s,  # eager: the first step's one-off costs, no compilation
           "threads": torch.get_num_threads(),
           "attn_implementation": model.config._attn_implementation,
           "kept": float(np.mean(kept)) if kept else None}
    if device.type == "cuda":
      row["peak_device_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return row

  return Prepared(step, describe)


def measure(prepared: Prepared, steps: int) -> dict:
  """`steps` timed steps, each synced; then as train.py runs them: back to back, one sync at
  the end (`pipelined_step_s`)."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    prepared.step()
    times.append(time.perf_counter() - start)
  start = time.perf_counter()
  for _ in range(steps - 1):
    prepared.step(sync=False)
  prepared.step()
  return {"step_times_s": times, "pipelined_step_s": (time.perf_counter() - start) / steps}


def schedule(shapes, objectives, frameworks) -> list[tuple[str, str, str]]:
  """(shape, objective, framework) in run order: both frameworks of an objective back to back,
  and the framework that goes first flips from one shape to the next, so that slow drift of a
  noisy machine does not always favour the same side of a ratio."""
  runs = []
  for i, shape in enumerate(shapes):
    order = frameworks if i % 2 == 0 else frameworks[::-1]
    for objective in objectives:
      runs += [(shape, objective, fw) for fw in order
               if fw == "jax" or objective in TORCH_OBJECTIVES]
  return runs


def ratio_rows(rows: list[dict]) -> list[dict]:
  by_key = {(r["shape"], r["framework"], r["objective"]): r for r in rows}
  out = []
  for shape in dict.fromkeys(r["shape"] for r in rows):
    for name, num, den, target in RATIOS:
      a, b = by_key.get((shape, *num)), by_key.get((shape, *den))
      if a is None or b is None:
        continue
      ratio = a["median_step_s"] / b["median_step_s"]
      out.append({"kind": "ratio", "shape": shape, "name": name, "ratio": ratio,
                  "target": None if target is None else f"<= {target}",
                  "meets_target": None if target is None else ratio <= target,
                  "numerator_median_step_s": a["median_step_s"],
                  "denominator_median_step_s": b["median_step_s"],
                  "batch": a["batch"], "seq_len": a["seq_len"]})
      if a.get("xla_gflops") and b.get("xla_gflops"):
        out[-1]["xla_flops_ratio"] = a["xla_gflops"] / b["xla_gflops"]
      if a.get("cost_model") and b.get("cost_model"):  # exit_gate.layer_passes' prediction
        out[-1]["cost_model_ratio"] = a["cost_model"]["cost"] / b["cost_model"]["cost"]
  return out


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} "
                 f"(default {DEFAULTS['shapes']}; --quick: {QUICK['shapes']})")
  p.add_argument("--objectives", default=",".join(OBJECTIVES),
                 help="comma-separated, of " + ", ".join(OBJECTIVES) +
                 f" (PyTorch runs only {', '.join(TORCH_OBJECTIVES)})")
  p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="jax, pytorch or both")
  p.add_argument("--batch_size", type=int, help=f"default {DEFAULTS['batch_size']}")
  p.add_argument("--seq_len", type=int, help=f"default {DEFAULTS['seq_len']}")
  p.add_argument("--warmup", type=int, help="untimed steps after the first (compiling) one; "
                 f"default {DEFAULTS['warmup']}")
  p.add_argument("--steps", type=int, help=f"timed steps; default {DEFAULTS['steps']}")
  p.add_argument("--threads", type=int, default=None,
                 help="torch.set_num_threads (default: all usable cores). XLA sizes its own "
                 "CPU pool to all cores; pin both with taskset instead.")
  p.add_argument("--torch_device", default=None, help="default: cuda when available, else cpu")
  p.add_argument("--pretrained_minilm", action="store_true",
                 help="load the installed MiniLM weights for the minilm shape (same speed)")
  p.add_argument("--seed", type=int, default=0, help="seed of the random batch")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="JAX rows: compute dtype (parameters stay float32)")
  p.add_argument("--gate_chunk", type=int, default=1,
                 help="multi-exit rows: exits per chunk of the per-exit gate (memory bound)")
  p.add_argument("--quick", action="store_true",
                 help="smoke test: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) +
                 "; flags given explicitly still win")
  p.add_argument("--interleave", action="store_true",
                 help="compile every configuration first, then time one step of each in turn "
                 "(ratios robust to a machine whose speed drifts; all states stay in memory, "
                 "so peak memory is the process's, not per configuration)")
  p.add_argument("--out", default=None, help="JSON-lines file to append every line to")
  args = p.parse_args(argv)
  for key, value in (QUICK if args.quick else DEFAULTS).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
  args.objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
  args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
  for name, values, valid in (("shapes", args.shapes, SHAPES),
                              ("objectives", args.objectives, OBJECTIVES),
                              ("frameworks", args.frameworks, FRAMEWORKS)):
    bad = [v for v in values if v not in valid]
    if bad or not values:
      p.error(f"--{name}: {bad or 'empty'}; valid: {', '.join(valid)}")
  if args.steps < 1 or args.warmup < 0 or args.batch_size < 2 or args.seq_len < 5:
    p.error("need --steps >= 1, --warmup >= 0, --batch_size >= 2, --seq_len >= 5")
  return args


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  config = config_lib.get_config("rte")  # the trainer's optimizer settings, for both frameworks
  batch_np = make_batch(np.random.default_rng(args.seed), args.batch_size, args.seq_len)
  meta = host.run_metadata()
  common = {"batch": args.batch_size, "seq_len": args.seq_len, "warmup": args.warmup,
            "steps": args.steps, "dtype": args.dtype, "host_cpu": host.cpu_model(),
            "cpus_usable": host.cpus_usable(), "git_commit": meta["git_commit"],
            "python": meta["python"]}
  versions = {"jax": {k: meta["versions"][k] for k in ("jax", "jaxlib", "flax", "optax")}}
  if "pytorch" in args.frameworks:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(args.threads or common["cpus_usable"])
    args.torch_device = args.torch_device or ("cuda" if torch.cuda.is_available() else "cpu")
    versions["pytorch"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    error = check_torch_acl_embed()
    if error > 1e-4:
      raise SystemExit(f"the torch ACL-Embed port disagrees with acl_jax.losses by {error}")

  load = os.getloadavg()[0]
  if load > 0.5:
    # PyTorch's OpenMP threads slowed down up to 25x, and erratically, beside a busy process.
    print(f"warning: 1-minute load average {load:.1f} before the benchmark: another process is "
          "using the CPU, so step times and ratios are unreliable", file=sys.stderr)

  out = None
  if args.out:
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(out_path, "a")

  def emit(row):
    line = json.dumps(row)
    print(line, flush=True)
    if out:
      out.write(line + "\n")
      out.flush()

  rows = []
  prepare = {"jax": prepare_jax, "pytorch": prepare_pytorch}

  def row_of(shape, objective, framework, prepared, times, extra):
    return {"kind": "step", "framework": framework, "shape": shape, "objective": objective,
            **SHAPES[shape], "vocab_size": VOCAB_SIZE, **common, **prepared.describe(),
            **_timing(times, args.batch_size), **extra,
            "versions": versions[framework], "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

  runs = schedule(args.shapes, args.objectives, args.frameworks)
  if args.interleave:
    # Every configuration compiled and warmed up first, then one timed step of each in turn:
    # a machine that speeds up or slows down shifts them all alike, so their ratios hold.
    load_before = os.getloadavg()[0]
    prepared = [prepare[fw](shape, objective, batch_np, args, config)
                for shape, objective, fw in runs]
    times = [[] for _ in runs]
    for _ in range(args.steps):
      for i, p in enumerate(prepared):
        start = time.perf_counter()
        p.step()
        times[i].append(time.perf_counter() - start)
    for (shape, objective, fw), p, t in zip(runs, prepared, times):
      row = row_of(shape, objective, fw, p, t, {
          "interleaved": True, "peak_rss_mib": _peak_rss_mib(),
          "peak_rss_is_per_config": False, "load_avg_1m_before": load_before})
      rows.append(row)
      emit(row)
    del prepared
  for shape, objective, framework in ([] if args.interleave else runs):
    # Whatever the last configuration left behind goes first, so it is neither timed nor
    # counted in this one's peak memory.
    gc.collect()
    load_before = os.getloadavg()[0]
    rss_before = _rss_mib()
    reset = _reset_peak_rss()
    p = prepare[framework](shape, objective, batch_np, args, config)
    timing = measure(p, args.steps)
    row = row_of(shape, objective, framework, p, timing.pop("step_times_s"), {
        **timing, "interleaved": False, "peak_rss_mib": _peak_rss_mib(),
        "rss_before_mib": rss_before,
        # False: the kernel kept the process-wide peak, an upper bound for this config.
        "peak_rss_is_per_config": reset,
        # Anything else on the CPU skews the comparison (see the README).
        "load_avg_1m_before": load_before})
    del p
    rows.append(row)
    emit(row)
  gc.collect()
  for row in ratio_rows(rows):
    emit(row)
  if out:
    out.close()
  return rows


if __name__ == "__main__":
  main()
