"""Device mesh, shardings and multi-host start-up.

Training is one jit-compiled function of global arrays. The batch is sharded over the `data`
axis of a mesh that spans every device of every host; the train state is replicated, or with
`shard_params` split along one axis of each large tensor (parameters and optimizer moments
alike); XLA inserts the collectives. The losses therefore see the global batch: a contrastive
term over 32 examples on 8 devices compares all 32 with each other, exactly as on one device.

Multi-host: every host runs the same command. `initialize_distributed` joins the job when the
environment describes one. The configured batch size is global; every host builds the same
global batch from the same seeded order and hands JAX only the rows its own devices hold.
"""

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"

# Tensors smaller than this stay replicated under shard_params: splitting a bias or a
# LayerNorm scale saves nothing and costs a collective.
MIN_SHARDED_SIZE = 2 ** 14

# Environment variables that say "this process is one of several" (jax reads the first
# itself; the others are the launchers its cluster detection knows).
_MULTI_PROCESS_MARKERS = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                          "TPU_WORKER_HOSTNAMES")


def wants_distributed(environ: Mapping[str, str] = os.environ) -> bool:
  """Whether the environment describes a job of several processes.

  ACL_JAX_DISTRIBUTED=1 or 0 overrides the detection (e.g. a launcher jax knows but we don't).
  """
  forced = environ.get("ACL_JAX_DISTRIBUTED")
  if forced is not None:
    return forced.strip().lower() in ("1", "true", "yes")
  for name in _MULTI_PROCESS_MARKERS:
    value = environ.get(name, "").strip()
    if not value:
      continue
    if name == "JAX_COORDINATOR_ADDRESS":
      return True
    if name == "TPU_WORKER_HOSTNAMES":  # one name: a single-host TPU VM
      if len(value.split(",")) > 1:
        return True
    elif value.isdigit() and int(value) > 1:
      return True
  return False


def initialize_distributed(environ: Mapping[str, str] = os.environ) -> bool:
  """Joins the multi-host job the environment describes; on one host, does nothing.

  Must run before anything touches a JAX device. Coordinator address, process count and id
  come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID when set, otherwise
  from jax's cluster detection (Cloud TPU, SLURM, Open MPI, Kubernetes).
  """
  if not wants_distributed(environ):
    return False
  kwargs = {}
  if environ.get("JAX_NUM_PROCESSES"):
    kwargs["num_processes"] = int(environ["JAX_NUM_PROCESSES"])
  if environ.get("JAX_PROCESS_ID"):
    kwargs["process_id"] = int(environ["JAX_PROCESS_ID"])
  jax.distributed.initialize(**kwargs)
  logging.info("Joined a job of %d processes as process %d; %d devices in all, %d here",
               jax.process_count(), jax.process_index(), jax.device_count(),
               jax.local_device_count())
  return True


def is_main_process() -> bool:
  """Process 0 alone writes metrics, reports and run-directory files."""
  return jax.process_index() == 0


def make_mesh(num_devices: int = 0) -> Mesh:
  """A one-axis `data` mesh over all devices (num_devices=0) or the first num_devices."""
  available = jax.device_count()
  if num_devices < 0 or num_devices > available:
    raise ValueError(f"num_devices={num_devices}: this job has {available} devices "
                     f"(0 uses all of them)")
  if num_devices and jax.process_count() > 1 and num_devices != available:
    raise ValueError(f"num_devices={num_devices}: a multi-host job uses all {available} devices")
  devices = jax.devices()[:num_devices or available]
  return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,),
                       devices=devices)


def check_batch_size(batch_size: int, mesh: Mesh, *, name: str = "batch_size") -> None:
  """A global batch must split evenly over the data axis."""
  devices = mesh.shape[DATA_AXIS]
  if batch_size % devices:
    lower = batch_size - batch_size % devices
    raise ValueError(
        f"{name}={batch_size} does not divide over the {devices} devices of the data axis; "
        f"use a multiple of {devices} (e.g. {lower or devices} or {lower + devices}), or "
        f"fewer devices with --config.num_devices")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows (the leading axis) split over the data axis."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def _leaf_sharding(shape: tuple[int, ...], mesh: Mesh, shard: bool) -> NamedSharding:
  devices = mesh.shape[DATA_AXIS]
  if shard and math.prod(shape) >= MIN_SHARDED_SIZE:
    # The largest axis that splits evenly: for BERT that is the vocabulary or hidden axis.
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
      if shape[axis] % devices == 0:
        spec = [None] * len(shape)
        spec[axis] = DATA_AXIS
        return NamedSharding(mesh, PartitionSpec(*spec))
  return replicated(mesh)


def state_sharding(tree: Any, mesh: Mesh, *, shard_params: bool = False) -> Any:
  """Per-leaf shardings for a train state (or params): replicated, or FSDP-style split.

  With shard_params each tensor of at least MIN_SHARDED_SIZE elements is split along its
  largest evenly divisible axis; Adam's moments have the shapes of the parameters, so they
  follow them.
  """
  return jax.tree.map(lambda x: _leaf_sharding(np.shape(x), mesh, shard_params), tree)


def put(tree: Any, shardings: Any) -> Any:
  """Places values that are identical on every host as global arrays with these shardings.

  (jax.device_put cannot reach another host's devices.) PRNG keys travel as their key data.
  """
  def one(x, sharding):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding),
                                      impl=jax.random.key_impl(x))
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(one, tree, shardings)


def global_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """The global batch (identical on every host) as arrays sharded over the data axis.

  Each host copies only the rows its own devices hold.
  """
  sharding = batch_sharding(mesh)
  out = {}
  for name, value in batch.items():
    rows = _local_rows(sharding, value.shape)
    out[name] = jax.make_array_from_process_local_data(sharding, value[rows], value.shape)
  return out


def _local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
  """The contiguous rows of a batch of `shape` that this process's devices hold."""
  starts, stops = [], []
  for index in sharding.addressable_devices_indices_map(shape).values():
    rows = index[0]
    starts.append(rows.start or 0)
    stops.append(shape[0] if rows.stop is None else rows.stop)
  return slice(min(starts), max(stops))
