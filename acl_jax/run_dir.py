"""Everything under a run's --workdir: its names, its life (prepare, refuse, resume), the
metrics file, the orbax checkpoints, and loading a trained run back.

    <workdir>/config.json          the resolved config and the run's metadata
    <workdir>/metrics.jsonl        one JSON object per logged step (MetricsWriter)
    <workdir>/eval_results.json    dev metrics: final, best, history
    <workdir>/early_exit.json|png  --mode=early_exit
    <workdir>/hf_export/           --mode=export
    <workdir>/glue_submission/     --mode=predict: GLUE test-set predictions, one TSV per
    <workdir>/glue_submission.zip    file of the benchmark, and the zip to upload
    <workdir>/run.log              library log lines (orbax, absl), appended by every mode
    <workdir>/tensorboard/         TensorBoard event files of metrics.jsonl's numbers
                                   (acl_jax.tracking)
    <workdir>/checkpoints/latest/<step>/state      TrainState (params, optimizer state, step
                                                   within the stage)
    <workdir>/checkpoints/latest/<step>/progress   JSON: where the loop stands (global step,
                                                   stage, epoch, batches taken from that
                                                   epoch), timing totals, eval history
    <workdir>/checkpoints/best/<step>/params       params at the best dev evaluation so far
    <workdir>/checkpoints/best/<step>/progress     JSON: that evaluation

A workdir is any path etils.epath (orbax's own path type) reaches: a local directory, or an
object store such as gs://bucket/run (with gcsfs installed: the `gcs` extra). Every file here
is read and written through epath. Object stores have no append, so metrics.jsonl and run.log
are rewritten whole there: metrics.jsonl at every checkpoint save and at the end, run.log when
the command ends.

Dropout keys derive from (seed, stage, step) and each epoch's batch order from (seed, epoch),
so the progress record is all a restarted run needs to continue exactly. Orbax writes each step
to a temporary directory and renames it when complete, so a kill mid-save leaves the previous
checkpoint as the latest: a half-written one is never restored.
"""

import contextlib
import dataclasses
import io
import json
import logging
import os
import pathlib
import tempfile
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_collections
from etils import epath
import numpy as np
import orbax.checkpoint as ocp

from acl_jax import data
from acl_jax import hf_weights
from acl_jax import models

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
EVAL_RESULTS_FILE = "eval_results.json"
EARLY_EXIT_FILE = "early_exit.json"
EARLY_EXIT_PLOT = "early_exit.png"
EXPORT_DIR = "hf_export"
SUBMISSION_DIR = "glue_submission"
SUBMISSION_ZIP = f"{SUBMISSION_DIR}.zip"  # beside the directory it zips
LOG_FILE = "run.log"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"

# Written by the run, not by the user: removed when a workdir is overwritten.
RUN_OUTPUTS = (CONFIG_FILE, METRICS_FILE, EVAL_RESULTS_FILE, EARLY_EXIT_FILE, EARLY_EXIT_PLOT,
               SUBMISSION_DIR, SUBMISSION_ZIP, LOG_FILE, CHECKPOINT_DIR, TENSORBOARD_DIR)
# Config fields that may differ between a run and its resumption.
# A run may resume on another number of devices (bitwise equality then no longer holds), and
# save more or less often, and with its trackers switched on or off (they only see what
# metrics.jsonl gets).
RESUMABLE_CHANGES = ("overwrite", "num_devices", "shard_params", "checkpoint_every",
                     "checkpoint_every_minutes", "tensorboard", "wandb_project", "wandb_entity")
# Config fields renamed after runs were recorded: old name -> new name. A config.json that
# holds an old name reads as holding the new one, so recorded runs load, resume and export.
RENAMED_FIELDS = {"lambda": "aux_weight", "gate": "gate_granularity",
                  "pooler": "pooler_weights", "exit_pooling": "pooler_input"}
# Config fields added after runs were recorded, with the value those runs had: a config.json
# without one reads as holding it.
ADDED_FIELDS = {"pooler_input": "cls", "microbatch_size": 0, "checkpoint_every_minutes": 0.0,
                "tensorboard": False, "wandb_project": "", "wandb_entity": "",
                "normalize_label_embeddings": True, "cl_anchors": "all"}


def upgrade_config(saved: dict[str, Any]) -> dict[str, Any]:
  """A recorded config (config.json's "config") in today's field names; where a config holds
  both a field's old and new name, the new one wins."""
  upgraded = dict(ADDED_FIELDS)
  upgraded.update({RENAMED_FIELDS[key]: value for key, value in saved.items()
                   if key in RENAMED_FIELDS})
  upgraded.update({key: value for key, value in saved.items() if key not in RENAMED_FIELDS})
  return upgraded


def read_config(workdir: epath.PathLike) -> ml_collections.ConfigDict:
  """The config a run directory was trained with, in today's field names."""
  path = epath.Path(workdir) / CONFIG_FILE
  try:
    return ml_collections.ConfigDict(upgrade_config(json.loads(path.read_text())["config"]))
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} not found: {workdir} is not a run directory (train "
                            "into it first with --mode=train)") from None
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{path}: unreadable run directory ({type(e).__name__}: {e})") from e


def read_meta(workdir: epath.PathLike) -> dict[str, Any] | None:
  """The metadata of the run a workdir holds (config.json's "meta"); None before its first
  run, or when that record has none."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text()).get("meta")
  except (OSError, ValueError, AttributeError) as e:
    raise ValueError(f"{path}: unreadable run directory ({type(e).__name__}: {e})") from e


def read_json(path: epath.PathLike) -> dict[str, Any]:
  return json.loads(epath.Path(path).read_text())


def write_json(path: epath.PathLike, content: dict[str, Any]) -> None:
  """Writes `content` as JSON, whole or not at all: a run whose eval_results.json (or sweep
  whose early_exit.json) exists counts as done, so a kill mid-write must not leave part of one.
  A local file is written beside its place and renamed there; an object (gs://...) is
  replaced whole by the store."""
  path = epath.Path(path)
  text = json.dumps(content, indent=2, default=str) + "\n"
  if not is_local(path):
    path.write_text(text)
    return
  partial = path.with_name(f".{path.name}.partial")
  partial.write_text(text)
  os.replace(partial, path)


def is_local(path: epath.PathLike) -> bool:
  """Whether a path is on this machine's file system (not gs://, s3://, ...)."""
  return "://" not in os.fspath(path)


def resolve(workdir: epath.PathLike) -> epath.Path:
  """A --workdir as an absolute epath.Path (orbax needs absolute paths); gs://... as given."""
  if not is_local(workdir):
    return epath.Path(workdir)
  return epath.Path(pathlib.Path(workdir).expanduser().resolve())


class _ObjectLogHandler(logging.StreamHandler):
  """Log records kept in memory and appended to `path` when closed: object stores have no
  append."""

  def __init__(self, path: epath.Path):
    super().__init__(io.StringIO())
    self._path = path

  def close(self):
    self.flush()
    text, self.stream = self.stream.getvalue(), io.StringIO()  # logging may close it twice
    if text:
      earlier = self._path.read_text() if self._path.exists() else ""
      self._path.write_text(earlier + text)
    super().close()


@contextlib.contextmanager
def logging_to(workdir: epath.PathLike | None) -> Iterator[None]:
  """Sends every library log record (orbax, absl, ours) to <workdir>/run.log, appended, while
  the block runs (nowhere when workdir is None or does not exist).

  The console stays for the progress bar, evaluations and results; the chatter of libraries
  (orbax dumps its options at INFO for every checkpoint manager) is kept here for when
  something goes wrong.
  """
  if workdir is None or not epath.Path(workdir).is_dir():
    yield
    return
  path = epath.Path(workdir) / LOG_FILE
  handler = (logging.FileHandler(os.fspath(path)) if is_local(path)
             else _ObjectLogHandler(path))
  handler.setFormatter(logging.Formatter(
      "%(asctime)s %(levelname).1s %(filename)s:%(lineno)d] %(message)s"))
  handler.setLevel(logging.INFO)
  root = logging.getLogger()
  level = root.level
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  try:
    yield
  finally:
    root.removeHandler(handler)
    root.setLevel(level)
    handler.close()


class MetricsWriter:
  """Writes one JSON object per line to <workdir>/metrics.jsonl (METRICS_FILE), and hands each
  row to `tracker` (acl_jax.tracking.Trackers: TensorBoard, W&B), so that every tracker gets
  exactly the rows the file does.

  A fresh run starts the file anew; a resumed run keeps the lines up to its checkpoint's step
  (later ones came from the interrupted process and will be logged again) and appends. A
  local file gets each line as it is written; an object (gs://...) is rewritten whole at each
  flush() (the loop flushes at every checkpoint save) and at close(), and so are the
  trackers' files there.
  """

  def __init__(self, path: epath.PathLike, *, keep_through: int | None = None,
               active: bool = True, tracker=None):
    self._path = epath.Path(path)
    self._file = None
    self._lines = []  # of an object; a local file is appended to instead
    self._active = active  # processes other than 0 write nothing
    self._tracker = tracker if active else None
    if not active:
      return
    kept = []
    if keep_through is not None and self._path.exists():
      kept = [line + "\n" for line in self._path.read_text().splitlines()
              if line.strip() and json.loads(line)["step"] <= keep_through]
    self._path.write_text("".join(kept))
    if is_local(self._path):
      self._file = open(os.fspath(self._path), "a")
    else:
      self._lines = kept

  def write(self, step: int, values: dict[str, Any]) -> None:
    if not self._active:
      return
    row = {k: to_python(v) for k, v in values.items()}
    line = json.dumps({"step": int(step), **row}) + "\n"
    if self._file is None:
      self._lines.append(line)
    else:
      self._file.write(line)
      self._file.flush()
    if self._tracker is not None:
      self._tracker.write(int(step), row)

  def flush(self) -> None:
    if self._active and self._file is None:
      self._path.write_text("".join(self._lines))
    if self._tracker is not None:
      self._tracker.flush()

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()
    if self._tracker is not None:
      self._tracker.close()


def to_python(value):
  value = np.asarray(value)
  return value.item() if value.ndim == 0 else value.tolist()


def prepare_workdir(workdir: epath.PathLike, config, *, delete: bool = True) -> None:
  """Refuses a workdir that holds a run with another config, unless config.overwrite.

  The same config resumes (or, with no checkpoint yet, starts over); config.overwrite deletes
  the earlier run's outputs first (only where `delete`: one process of a multi-host job).
  """
  workdir = resolve(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise NotADirectoryError(f"--workdir={workdir} exists and is not a directory")
  workdir.mkdir(parents=True, exist_ok=True)
  if config.overwrite:
    for name in RUN_OUTPUTS if delete else ():
      path = workdir / name
      if path.is_dir():
        path.rmtree()
      elif path.exists():
        path.unlink()
    return
  path = workdir / CONFIG_FILE
  if not path.exists():
    if (workdir / CHECKPOINT_DIR).exists():
      raise ValueError(f"{workdir} holds checkpoints but no config.json, so it cannot tell "
                       "whether they belong to this config; add `overwrite` to the config "
                       "string (or --config.overwrite=True) to start over")
    return
  try:
    saved = upgrade_config(json.loads(path.read_text())["config"])
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{path}: unreadable run directory ({type(e).__name__}: {e}); add "
                     "`overwrite` to the config string (or --config.overwrite=True) to start "
                     "over in it") from e
  current = _json_config(config)
  differ = sorted(key for key in set(_flatten(saved)) | set(_flatten(current))
                  if key not in RESUMABLE_CHANGES
                  and _flatten(saved).get(key) != _flatten(current).get(key))
  if differ:
    changes = "; ".join(f"{key}: {_flatten(saved).get(key)!r} -> {_flatten(current).get(key)!r}"
                        for key in differ)
    raise ValueError(f"{workdir} holds a run with another config ({changes}). Use another "
                     "--workdir, or add `overwrite` to the config string (or "
                     "--config.overwrite=True) to delete that run and start over")


def _json_config(config) -> dict[str, Any]:
  return json.loads(json.dumps(config.to_dict(), default=str))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def all_finite(tree) -> bool:
  """Whether every floating-point leaf of `tree` is finite (one host sync)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
  return bool(jax.device_get(jnp.all(jnp.stack(leaves)))) if leaves else True


def _manager(directory: epath.Path, items: tuple[str, ...], *, async_save: bool,
             read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=1, create=not read_only,
                                         enable_async_checkpointing=async_save,
                                         read_only=read_only)
  return ocp.CheckpointManager(directory, options=options, item_names=items)


class RunCheckpoints:
  """The latest train state (to resume) and the best params (by dev metric) of one run."""

  def __init__(self, workdir: epath.PathLike, *, async_save: bool = True):
    root = epath.Path(workdir) / CHECKPOINT_DIR
    self.directory = root
    self._latest = _manager(root / "latest", ("state", "progress"), async_save=async_save)
    self._best = _manager(root / "best", ("params", "progress"), async_save=async_save)

  def latest_step(self) -> int | None:
    return self._latest.latest_step()

  def save(self, step: int, state, progress: dict[str, Any]) -> None:
    """Starts an async save of `state` and the loop position at global step `step`.

    Refuses non-finite parameters or optimizer state: a resumable run must never resume
    from a diverged state.
    """
    if not all_finite(state):
      raise FloatingPointError(f"step {step}: the train state holds NaN or inf; not saving it "
                               f"(the last good checkpoint stays in {self.directory})")
    # The train step donates its state, so the next step may overwrite these buffers while
    # the background save still reads them: save a copy.
    state = jax.tree.map(lambda x: x.copy(), state)
    self._latest.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress)))

  def save_best(self, step: int, params, record: dict[str, Any]) -> None:
    params = jax.tree.map(lambda x: x.copy(), params)
    self._best.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), progress=ocp.args.JsonSave(record)))

  def latest_progress(self) -> dict[str, Any] | None:
    """The loop position saved with the latest checkpoint; None when there is none."""
    step = self._latest.latest_step()
    if step is None:
      return None
    return self._latest.restore(step, args=ocp.args.Composite(
        progress=ocp.args.JsonRestore()))["progress"]

  def restore_state(self, abstract_state):
    """The latest checkpoint's train state.

    abstract_state: a TrainState of the same structure (arrays or ShapeDtypeStructs), e.g.
    the freshly initialized one of the stage being resumed; its shardings are kept.
    """
    step = self._latest.latest_step()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    return self._latest.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]

  def wait(self) -> None:
    """Blocks until every save started so far is on disk."""
    self._latest.wait_until_finished()
    self._best.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self._latest.close()
    self._best.close()


def load_params(workdir: epath.PathLike, abstract_params=None, *, which: str = "latest"
                ) -> tuple[Any, int]:
  """(params, global step) of a finished or interrupted run: `latest` (the final params once
  training has finished) or `best` (the best dev evaluation).

  abstract_params: the model's params (or their shapes), to check the saved tree against.
  """
  if which not in ("latest", "best"):
    raise ValueError(f"which={which!r}; use latest or best")
  directory = epath.Path(workdir) / CHECKPOINT_DIR / which
  if not directory.is_dir():
    raise FileNotFoundError(f"{directory} does not exist: {workdir} holds no {which} checkpoint "
                            "(train first: python -m acl_jax.main --workdir=...)")
  item = "state" if which == "latest" else "params"
  manager = _manager(directory, (item, "progress"), async_save=False, read_only=True)
  step = manager.latest_step()
  if step is None:
    raise FileNotFoundError(f"{directory} holds no complete checkpoint")
  # The target comes from the checkpoint's own metadata, so the optimizer state (whose
  # structure depends on the stage's optimizer) needs no template; only params are kept. Every
  # array lands on this process's first device, whatever mesh the run was trained on (a
  # checkpoint from a pod loads on one CPU).
  metadata = ocp.StandardCheckpointer().metadata(directory / str(step) / item).item_metadata
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        metadata)
  restored = manager.restore(step, args=ocp.args.Composite(
      **{item: ocp.args.StandardRestore(target)}))
  params = restored[item]["params"] if which == "latest" else restored[item]
  if (abstract_params is not None
      and jax.tree.structure(params) != jax.tree.structure(abstract_params)):
    raise ValueError(f"{directory}/{step}: the saved params do not match this model's "
                     f"structure; was the run trained with another config?")
  manager.close()
  return jax.tree.map(jnp.asarray, params), step


@dataclasses.dataclass
class TrainedRun:
  """A run directory's model and trained parameters, rebuilt from config.json and
  checkpoints/ (for early exit and export)."""
  workdir: epath.Path
  config: ml_collections.ConfigDict
  task: data.TaskSpec
  model: Any
  params: Any
  step: int
  ckpt_dir: pathlib.Path
  tokenizer: Any
  boundaries: tuple[int, ...]

  def load_examples(self, split: str, task: data.TaskSpec | None = None) -> data.Examples:
    """A split of the run's task (or of `task`, e.g. data.DIAGNOSTIC) from the run's data."""
    return data.load_split(task or self.task, split,
                           glue_dir=data.resolve_glue_dir(self.config.data.glue_dir))

  def encode(self, examples: data.Examples) -> data.Encoded:
    """Examples tokenized as the run's were (data.encode with the run's settings)."""
    return data.encode(examples, self.tokenizer, max_length=self.config.max_length,
                       cache_dir=self.config.data.cache_dir)

  def load_encoded(self, split: str) -> data.Encoded:
    """A split tokenized as the run was (data.load_encoded with the run's settings)."""
    return self.encode(self.load_examples(split))


def write_export(run: "TrainedRun") -> epath.Path:
  """<workdir>/hf_export (hf_weights.export_hf); staged in a local directory first when the
  workdir is an object store, since transformers writes local files only."""
  out = run.workdir / EXPORT_DIR
  if is_local(out):
    return epath.Path(hf_weights.export_hf(run, out))
  with tempfile.TemporaryDirectory() as staging:
    for path in hf_weights.export_hf(run, staging).iterdir():
      (out / path.name).write_bytes(path.read_bytes())
  return out


def load_trained_run(workdir, *, which: str = "latest") -> TrainedRun:
  """Rebuilds a trained run: its config, model and `which` params (latest | best)."""
  workdir = resolve(workdir)
  config = read_config(workdir)
  task = data.get_task(config.task)
  ckpt_dir, bert_config, tokenizer = hf_weights.load_backbone(config)
  model = models.from_config(config, bert_config, task.num_labels)
  dummy = jnp.zeros((1, 8), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), dummy, dummy, dummy)["params"]
  params, step = load_params(workdir, abstract, which=which)
  boundaries = data.bucket_boundaries(config.max_length, tuple(config.data.buckets))
  return TrainedRun(workdir, config, task, model, params, step, ckpt_dir, tokenizer, boundaries)
