"""Experiment trackers: every row of metrics.jsonl also goes to TensorBoard and, on request, to
Weights & Biases (through run_dir.MetricsWriter, so they see exactly the rows the file does).

    <workdir>/tensorboard/events.out.tfevents.*   config.tensorboard (the `tensorboard` extra)
    the W&B project config.wandb_project          (the `wandb` extra); config.json's
                                                  meta.wandb_run_id names the run

Trackers get a row's numbers (not `stage`, a string); a term with one value per exit becomes
one scalar per exit, `<term>/exit<layer>`, by the layer numbers of eval's `exit<layer>/<metric>`.
A resumed run writes on from its checkpoint's step: TensorBoard's reader drops what the
interrupted process logged after it, and the W&B run (the same id) is resumed.
"""

import importlib.util
import json
import secrets
import string
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from absl import logging
from etils import epath

from acl_jax import run_dir

# W&B run ids: its own alphabet and length (wandb's generate_id is not public API).
_RUN_ID_CHARS = string.ascii_lowercase + string.digits


def scalars(row: dict[str, Any], exit_layers: Sequence[int] | None = None
            ) -> dict[str, float]:
  """A metrics row's numbers, per-exit lists split into `<name>/exit<layer>` (exits 1, 2, ...
  when exit_layers is None)."""
  out = {}
  for name, value in row.items():
    if isinstance(value, (int, float)):
      out[name] = float(value)
    elif isinstance(value, list):
      layers = exit_layers or range(1, len(value) + 1)
      out.update({f"{name}/exit{layer}": float(v)
                  for layer, v in zip(layers, value, strict=True)})
  return out


def hparams(config) -> dict[str, bool | int | float | str]:
  """The config as flat hyper-parameters (`data.buckets`); what is not a bool, number or
  string (tuples, unset placeholders) as its JSON text, which TensorBoard can show."""
  def flat(tree, prefix=""):
    for key, value in tree.items():
      if isinstance(value, dict):
        yield from flat(value, f"{prefix}{key}.")
      else:
        yield prefix + key, value
  return {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
          for key, value in flat(config.to_dict())}


def wandb_run_id(config, previous_meta: dict[str, Any] | None) -> str | None:
  """The W&B run a workdir logs to: the one its config.json already names (a rerun resumes
  it, even after a resume with W&B off), else a new id when config.wandb_project is set."""
  kept = (previous_meta or {}).get("wandb_run_id")
  if kept or not config.wandb_project:
    return kept
  return "".join(secrets.choice(_RUN_ID_CHARS) for _ in range(8))


def check_installed(config) -> None:
  """Raises ImportError before anything loads when W&B is asked for but not installed."""
  if config.wandb_project and importlib.util.find_spec("wandb") is None:
    raise ImportError(f"config.wandb_project={config.wandb_project!r} needs wandb: "
                      "pip install 'acl_jax[wandb]' (or drop wandb_project)")


class TensorBoard:
  """Scalars and the config (as hyper-parameters) in one TensorBoard run directory.

  Written with TensorBoard's own event file writer (what torch.utils.tensorboard uses): its
  flush waits until every queued event is in the file, so a killed run keeps every row it
  logged, as metrics.jsonl does. Each process opens a new event file; the first event of a
  resumed run is a session start at `first_step`, on which TensorBoard's reader drops the
  events from `first_step` on that earlier files hold (the interrupted process's tail).
  """

  def __init__(self, logdir: str, *, first_step: int, hparams: dict[str, Any]):
    # Imported here: the extra is optional (open_trackers checks for it).
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import summary_v2
    from tensorboard.summary.writer import event_file_writer
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    # An object store has no append (its filesystem overwrites the file with each flush's
    # bytes), so there the events go to a local file that flush() uploads whole.
    self._logdir = epath.Path(logdir)
    self._staging = None if run_dir.is_local(logdir) else tempfile.TemporaryDirectory()
    self._writer = event_file_writer.EventFileWriter(
        logdir if self._staging is None else self._staging.name)
    self._writer.add_event(event_pb2.Event(
        wall_time=time.time(), step=first_step,
        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=first_step,
                                           summary=summary_v2.hparams_pb(hparams)))
    self.flush()

  def write(self, step: int, values: dict[str, float]) -> None:
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
        for tag, value in values.items()])
    self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step,
                                                 summary=summary))
    if self._staging is None:
      self._writer.flush()  # a log row every log_every steps: cheap, and nothing is lost

  def flush(self) -> None:
    """Every event so far in the file; on an object store, uploaded."""
    self._writer.flush()
    if self._staging is not None:
      self._logdir.mkdir(parents=True, exist_ok=True)
      for path in epath.Path(self._staging.name).iterdir():
        (self._logdir / path.name).write_bytes(path.read_bytes())

  def close(self) -> None:
    self.flush()
    self._writer.close()
    if self._staging is not None:
      self._staging.cleanup()


class WandB:
  """A W&B run with the config, logging each row at its step.

  `run_id` resumes the same run when it exists (resume="allow"); W&B keeps a run's steps
  increasing, so rows a resumed run logs again (the interrupted process had logged them, with
  the same values, the run being deterministic) are dropped there rather than duplicated.
  """

  def __init__(self, *, project: str, entity: str, run_id: str, name: str,
               config: dict[str, Any]):
    import wandb
    # finish_previous: a run left open by an exception in this process is closed first.
    self._run = wandb.init(project=project, entity=entity or None, id=run_id, name=name,
                           resume="allow", config=config, reinit="finish_previous")

  def write(self, step: int, values: dict[str, float]) -> None:
    self._run.log(values, step=step)

  def flush(self) -> None:
    pass  # W&B streams each row to its own service

  def close(self) -> None:
    self._run.finish()


class Trackers:
  """The run's trackers behind one write and close (what run_dir.MetricsWriter calls)."""

  def __init__(self, trackers: Sequence[Any], exit_layers: Sequence[int] | None = None):
    self.trackers = tuple(trackers)
    self._exit_layers = exit_layers

  def write(self, step: int, row: dict[str, Any]) -> None:
    values = scalars(row, self._exit_layers)
    for tracker in self.trackers:
      tracker.write(step, values)

  def flush(self) -> None:
    for tracker in self.trackers:
      tracker.flush()

  def close(self) -> None:
    for tracker in self.trackers:
      tracker.close()


def open_trackers(config, workdir, *, first_step: int, wandb_run_id: str | None,
                  exit_layers: Sequence[int] | None = None) -> Trackers:
  """The trackers config asks for, writing from `first_step` (the checkpoint's step + 1 of a
  resumed run). TensorBoard is on by default and skipped, with a warning, where its extra is
  not installed; W&B needs config.wandb_project."""
  trackers = []
  if config.tensorboard:
    if importlib.util.find_spec("tensorboard") is None:
      logging.warning("config.tensorboard: TensorBoard is not installed (pip install "
                      "'acl_jax[tensorboard]'); the metrics go to metrics.jsonl only")
    else:
      trackers.append(TensorBoard(f"{workdir}/{run_dir.TENSORBOARD_DIR}",
                                  first_step=first_step, hparams=hparams(config)))
  if config.wandb_project:
    trackers.append(WandB(project=config.wandb_project, entity=config.wandb_entity,
                          run_id=wandb_run_id, name=str(workdir).rstrip("/").rsplit("/", 1)[-1],
                          config=config.to_dict()))
  return Trackers(trackers, exit_layers)
