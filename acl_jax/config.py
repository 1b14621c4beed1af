"""The run config: its defaults, the preset string that adjusts them, and `validate`.

    get_config("rte")                               the defaults for RTE
    get_config("rte,model=minilm,objective=ce,seed=1")
    get_config("cola,multi_exit,objective=acl_cl,gate_granularity=global")

The preset string (big_vision style) is the task name, then `field=value` for any top-level
field of the config (its type is read from the default), and bare words for boolean fields
(`multi_exit`, `overwrite`, ...). A few short or older names are kept as aliases (ALIASES), so
that recorded commands still run. On the command line, `configs/glue.py:<preset string>`
passes through here, and `--config.<field>=value` overrides any field, nested ones included.

Defaults are the paper's (docs/method.md, "Defaults"): bert-base-uncased, max length 128, batch
32, lr 2e-5, 3 epochs, AdamW with decay 0.01, 10% linear warm-up, clip 1.0.
"""

import difflib
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from acl_jax import data
from acl_jax import losses
from acl_jax import models
from acl_jax import objectives
from acl_jax.models import multi_exit

# Small checkpoints want a larger learning rate than bert-base. The value was tuned once for
# CE on RTE and is kept fixed across objectives so comparisons stay fair (see
# experiments/results/README.md for the sweep).
MODEL_DEFAULTS = {
    "minilm": {"learning_rate": 1e-4},
}

# Preset names that differ from the field they set: short names, and the names of fields
# before they were renamed (kept so that recorded commands still run).
ALIASES = {"epochs": "num_epochs", "lr": "learning_rate", "devices": "num_devices",
           "lambda": "aux_weight", "gate": "gate_granularity", "pooler": "pooler_weights",
           "exit_pooling": "pooler_input"}

# The valid values of every enumerated field, from the registries that define them.
CHOICES = {
    "objective": tuple(objectives.OBJECTIVES),
    "gate_granularity": objectives.GATE_GRANULARITIES,
    "teacher": objectives.TEACHERS,
    "anchors": losses.ANCHORS,
    "cl_anchors": losses.ANCHORS,
    "exit_weights": multi_exit.EXIT_WEIGHTS,
    "pooler_weights": multi_exit.POOLER_WEIGHTS,
    "pooler_input": multi_exit.POOLER_INPUTS,
    "dtype": tuple(models.DTYPES),
    "matmul_precision": tuple(models.PRECISIONS),
}

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def defaults(task: data.TaskSpec) -> ml_collections.ConfigDict:
  """Every field, with its default for `task`."""
  config = ml_collections.ConfigDict()
  config.task = task.name
  # A preset name (`minilm`), a local HF checkpoint directory, or an HF hub id.
  config.model = "bert-base-uncased"
  # Loading PyTorch .bin files unpickles them: only on explicit request.
  config.allow_pickle = False
  # ce | scl (CE+SCL baseline) | acl_embed | acl (ACL-Embed + ACL-Grad) | acl_project; the
  # multi-exit ones kd | acl_cl | deebert (acl_jax.objectives.OBJECTIVES). Contrastive terms
  # need classes, so the regression task (STS-B) defaults to CE (MSE).
  config.objective = "ce" if task.is_regression else "acl"
  # lambda, the auxiliary term's weight: (1-lambda) CE + lambda SCL; CE + lambda ACL-Embed.
  config.aux_weight = 0.5
  config.temperature = 0.3  # tau, of every contrastive term
  config.anchors = "all"  # ACL-Embed anchors: all (samples and label embeddings) | samples.
  # Label embeddings normalized like the samples (cosine), the method's default; false: as
  # they are, so their norms scale their logits (ACL-Embed and ACL-CL).
  config.normalize_label_embeddings = True
  # Compute CE's and the auxiliary term's gradients separately even when the objective does
  # not gate, to log their cosine (the pilot experiment); costs a second backward pass.
  config.measure_conflict = False

  # Multi-exit BERT (the `multi_exit` preset): an exit after every layer, or after exit_layers.
  config.multi_exit = False
  config.exit_layers = ()  # 1-based layer numbers; () = every layer
  # The exits' pooler weights: shared (the pretrained pooler) | per_exit (a copy per exit).
  config.pooler_weights = "shared"
  # What each exit's pooler reads: cls ([CLS], the method's) | mean (the mean of the real
  # tokens; for mean-pooling sentence encoders whose shallow [CLS] states carry no sentence).
  config.pooler_input = "cls"
  config.exit_weights = "asc"  # asc (w_e proportional to e, PABEE) | uniform | desc
  # ACL-Grad decisions on a multi-exit model: per_exit (one per exit) | global (one).
  config.gate_granularity = "per_exit"
  # Exits whose two gradient pytrees are pulled back at once by the per-exit gate: peak memory
  # holds 2 * gate_chunk gradient pytrees plus the running sum.
  config.gate_chunk = 1
  config.cl_weight = 0.5  # mu: weight of ACL-CL (objective acl_cl)
  config.teacher = "last"  # ACL-CL teacher: last exit | deeper (every deeper exit, averaged)
  # ACL-CL anchors: all (the student's samples and label embeddings) | samples.
  config.cl_anchors = "all"
  config.kd_temperature = 2.0  # objective kd: softening temperature of the last-exit teacher
  config.seed = 0

  config.num_epochs = 3
  config.max_steps = 0  # > 0 caps the number of train steps (smoke tests, sweeps).
  config.batch_size = 32
  # > 0: run each (global) batch in micro-batches of this many examples, every loss term and
  # gradient still the whole batch's (acl_jax.gradients.Microbatched): batches larger than
  # memory. It must divide batch_size (and be a multiple of the device count). 0 = off.
  config.microbatch_size = 0
  config.eval_batch_size = 64
  config.learning_rate = 2e-5
  config.warmup_ratio = 0.1
  config.weight_decay = 0.01
  config.max_grad_norm = 1.0
  config.adam_b1 = 0.9
  config.adam_b2 = 0.999
  config.adam_eps = 1e-8
  config.dropout = 0.1  # hidden, attention and classifier dropout.

  config.max_length = 128
  config.dtype = "float32"  # compute dtype; parameters stay float32.
  # "default" | "high" | "highest": TPUs run float32 matmuls in bf16 passes by default.
  config.matmul_precision = "default"

  config.log_every = 20  # steps between metrics.jsonl lines.
  # Every number of metrics.jsonl and the config (as hyper-parameters) also as TensorBoard
  # event files in <workdir>/tensorboard, where the `tensorboard` extra is installed (else a
  # warning). acl_jax.tracking.
  config.tensorboard = True
  # Weights & Biases: the project to log the same numbers and the config to; "" = off (the
  # `wandb` extra). A rerun resumes the W&B run that config.json names. WANDB_MODE,
  # WANDB_DIR and wandb's other variables apply.
  config.wandb_project = ""
  config.wandb_entity = ""  # the W&B team or user; "" = the account's default.
  config.eval_every = 0  # steps between dev evaluations; 0 = at the end of every epoch.
  # Steps between checkpoints (<workdir>/checkpoints, async); runs also save at every
  # evaluation and at the end. Rerunning the same command resumes from the latest one.
  config.checkpoint_every = 200
  # Also save when this many minutes have passed since the last save (checked at each log
  # point), for machines that vanish without a SIGTERM; 0 = off. A SIGTERM or Ctrl-C always
  # saves at the step the run is at (acl_jax.preemption).
  config.checkpoint_every_minutes = 0.0
  # Rerunning in a workdir that holds another config's run is refused unless this is set
  # (the `overwrite` preset): then that run's outputs are deleted first.
  config.overwrite = False

  # Devices of the data-parallel mesh; 0 = all (of every host). batch_size and
  # eval_batch_size are global and must divide evenly over them.
  config.num_devices = 0
  # Also split large parameters and Adam's moments over the devices (FSDP-style) instead of
  # replicating them: less memory per device, more communication.
  config.shard_params = False

  config.data = ml_collections.ConfigDict()
  # GLUE TSV root in the original layout; unset = $GLUE_DIR, else the HF hub.
  config.data.glue_dir = config_dict.placeholder(str)
  # Length buckets: a few static shapes instead of padding every batch to max_length.
  config.data.buckets = (32, 64, 96)
  # Tokenization cache; unset = $ACL_JAX_CACHE or ~/.cache/acl_jax.
  config.data.cache_dir = config_dict.placeholder(str)
  return config


# Boolean fields, which a preset string switches on with their bare name (`multi_exit`).
_BOOL_FIELDS = tuple(key for key, value in defaults(data.TASKS["rte"]).items()
                     if isinstance(value, bool))


def parse_presets(arg: str | None) -> tuple[str, dict[str, str]]:
  """Splits "rte,model=minilm,multi_exit" into the task name and {field: raw value}; fields
  are resolved through ALIASES, and a bare boolean field means "true"."""
  task, presets = None, {}
  for token in filter(None, (t.strip() for t in (arg or "").split(","))):
    key, sep, value = token.partition("=")
    key = ALIASES.get(key, key)
    if sep:
      presets[key] = value
    elif key in _BOOL_FIELDS:
      presets[key] = "true"
    elif task is None:
      task = token  # data.get_task names the valid tasks if it is none of them
    else:
      raise ValueError(f"Config string {arg!r}: two task names, {task!r} and {token!r}.")
  return task or "rte", presets


def _parse_value(key: str, raw: str, default: Any) -> Any:
  """raw read as the type of the field's default."""
  if isinstance(default, bool):
    if raw.lower() in _TRUE + _FALSE:
      return raw.lower() in _TRUE
  elif isinstance(default, (int, float, str)):
    try:
      return type(default)(raw)
    except ValueError:
      pass
  else:
    raise ValueError(f"Config preset {key}={raw!r}: {key} is not a scalar field; set it with "
                     f"--config.{key}=... instead.")
  raise ValueError(f"Config preset {key}={raw!r}: expected {type(default).__name__}.")


def _unknown_preset(arg, key: str, config) -> ValueError:
  fields = sorted(k for k, v in config.items()
                  if k != "task" and not isinstance(v, ml_collections.ConfigDict))
  close = difflib.get_close_matches(key, fields + list(ALIASES), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  return ValueError(
      f"Config string {arg!r}: unknown preset {key!r}{hint}. Valid presets are the config's "
      f"fields ({', '.join(fields)}) and the aliases "
      f"{', '.join(f'{a}={f}' for a, f in ALIASES.items())}; nested fields take "
      "--config.<field>=value.")


def check_overrides(argv: Sequence[str]) -> None:
  """Raises a ValueError naming the first `--config.<field>=value` in argv whose field the
  config lacks, with a "did you mean" and the valid fields at that level. (ml_collections
  itself raises an AttributeError from deep inside flag parsing.)"""
  config = defaults(data.get_task("rte"))
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    flag = arg.split("=", 1)[0]
    path = flag[len("--config."):].split(".")
    node = config
    for depth, key in enumerate(path):
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        where = "config" + "".join(f".{k}" for k in path[:depth])
        if not isinstance(node, ml_collections.ConfigDict):
          raise ValueError(f"{flag}: {where} is a value, not a group of fields.")
        fields = sorted(node.keys())
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{flag}: {where} has no field {key!r}{hint}. Its fields: "
                         f"{', '.join(fields)}.")
      node = node[key]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The defaults for the preset string's task, with its presets applied, validated."""
  task_name, presets = parse_presets(arg)
  config = defaults(data.get_task(task_name))
  for key in presets:
    if key not in config or key == "task":
      raise _unknown_preset(arg, key, config)
  model = presets.get("model")
  if model is not None:  # the model's defaults first, so that explicit presets win
    for key, value in MODEL_DEFAULTS.get(model, {}).items():
      config[key] = value
  for key, raw in presets.items():
    config[key] = _parse_value(key, raw, config[key])
  validate(config)
  return config


def _choice(config, key: str) -> None:
  if config[key] not in CHOICES[key]:
    raise ValueError(f"config.{key}={config[key]!r}; valid: {', '.join(CHOICES[key])}.")


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field and its valid values for any value that would
  otherwise fail deep inside training. Needs no checkpoint, data or device."""
  task = data.get_task(config.task)
  for key in CHOICES:
    _choice(config, key)
  spec = objectives.OBJECTIVES[config.objective]
  if spec.multi_exit_only and not config.multi_exit:
    raise ValueError(f"config.objective={config.objective!r} needs a multi-exit model: add the "
                     f"`multi_exit` preset (configs/glue.py:<task>,multi_exit,objective=...).")
  if config.objective == "deebert" and config.pooler_weights != "per_exit":
    raise ValueError("config.objective='deebert' trains each off-ramp's own pooler and "
                     "classifier in its second stage, as DeeBERT does: add "
                     "pooler_weights=per_exit.")
  if spec.aux and task.is_regression:
    raise ValueError(f"config.objective={config.objective!r} is contrastive and needs class "
                     f"labels; {task.name} is a regression task: use objective=ce (MSE).")
  if config.pooler_input != "cls" and not config.multi_exit:
    raise ValueError(f"config.pooler_input={config.pooler_input!r} sets what multi-exit exits "
                     "pool; a single-exit model pools [CLS] as BertForSequenceClassification "
                     "does: add the `multi_exit` preset or drop pooler_input.")
  bad_layers = [layer for layer in config.exit_layers
                if not isinstance(layer, int) or layer < 1]
  if bad_layers:
    raise ValueError(f"config.exit_layers={tuple(config.exit_layers)}: {bad_layers[0]!r} is not "
                     "a 1-based layer number.")
  if config.gate_chunk < 1:
    raise ValueError(f"config.gate_chunk={config.gate_chunk} must be >= 1 (exits per chunk).")
  for key in ("temperature", "kd_temperature", "learning_rate"):
    if config[key] <= 0:
      raise ValueError(f"config.{key}={config[key]} must be positive.")
  for key in ("batch_size", "eval_batch_size", "num_epochs", "max_length", "log_every"):
    if config[key] <= 0:
      raise ValueError(f"config.{key}={config[key]} must be positive.")
  for key in ("max_steps", "eval_every", "checkpoint_every", "checkpoint_every_minutes",
              "num_devices", "aux_weight", "cl_weight", "weight_decay"):
    if config[key] < 0:
      raise ValueError(f"config.{key}={config[key]} must be >= 0.")
  if config.microbatch_size < 0 or (config.microbatch_size
                                    and config.batch_size % config.microbatch_size):
    raise ValueError(f"config.microbatch_size={config.microbatch_size} must divide "
                     f"batch_size={config.batch_size} (or be 0: off).")
  if config.wandb_entity and not config.wandb_project:
    raise ValueError(f"config.wandb_entity={config.wandb_entity!r} names where W&B runs go; "
                     "set wandb_project too (W&B is off without it).")
  for key in ("warmup_ratio", "dropout"):
    if not 0 <= config[key] < 1:
      raise ValueError(f"config.{key}={config[key]} must be in [0, 1).")
