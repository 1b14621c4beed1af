"""Run checkpoints with orbax: periodic async saves, the best params by dev metric, resume.

Layout under <workdir>/checkpoints/:

    latest/<step>/state       TrainState (params, optimizer state, step within the stage)
    latest/<step>/progress    JSON: where the loop stands (global step, stage, epoch, batches
                              already taken from that epoch), timing totals, eval history
    best/<step>/params        params at the best dev evaluation so far
    best/<step>/progress      JSON: that evaluation

Dropout keys derive from (seed, stage, step) and each epoch's batch order from (seed, epoch),
so the progress record is all a restarted run needs to continue exactly. Orbax writes each step
to a temporary directory and renames it when complete, so a kill mid-save leaves the previous
checkpoint as the latest: a half-written one is never restored.
"""

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


def all_finite(tree) -> bool:
  """Whether every floating-point leaf of `tree` is finite (one host sync)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
  return bool(jax.device_get(jnp.all(jnp.stack(leaves)))) if leaves else True


def _manager(directory: pathlib.Path, items: tuple[str, ...], *, async_save: bool,
             read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=1, create=not read_only,
                                         enable_async_checkpointing=async_save,
                                         read_only=read_only)
  return ocp.CheckpointManager(directory, options=options, item_names=items)


class RunCheckpoints:
  """The latest train state (to resume) and the best params (by dev metric) of one run."""

  def __init__(self, workdir: pathlib.Path, *, async_save: bool = True):
    root = pathlib.Path(workdir) / CHECKPOINT_DIR
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


def load_params(workdir: pathlib.Path, abstract_params=None, *, which: str = "latest"
                ) -> tuple[Any, int]:
  """(params, global step) of a finished or interrupted run: `latest` (the final params once
  training has finished) or `best` (the best dev evaluation).

  abstract_params: the model's params (or their shapes), to check the saved tree against.
  """
  if which not in ("latest", "best"):
    raise ValueError(f"which={which!r}; use latest or best")
  directory = pathlib.Path(workdir) / CHECKPOINT_DIR / which
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
