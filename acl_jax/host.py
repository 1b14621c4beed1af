"""Facts about the machine a run happens on: CPU, git commit, package versions, and the
persistent compilation cache keyed by them.

Results are only comparable within one machine type and one commit, so every run directory and
every benchmark line records these; the experiments import them from here.
"""

import hashlib
import importlib.metadata
import os
import pathlib
import platform
import re
import subprocess
import sys
from typing import Any

import jax

from acl_jax import data

# The packages whose versions a result depends on.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "datasets",
            "numpy", "acl_jax")


def _cpuinfo_field(name: str) -> str | None:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
  except OSError:
    return None


def cpu_model() -> str:
  """The CPU's model name (e.g. "AMD EPYC 7B13"), from /proc/cpuinfo where there is one."""
  return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def machine() -> str:
  """The CPU model and core count: what decides whether two timings are comparable."""
  return f"{cpu_model()}, {os.cpu_count()} cores"


def cpus_usable() -> int:
  """Cores this process may run on (a run pinned with taskset sees fewer than the machine)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_fingerprint() -> str:
  """16 hex digits naming the CPU model and its feature flags: native code is only valid on a
  CPU with the same features, and XLA compiles for the features it finds, so two CPUs with one
  model name but other flags can round differently (seen: one run's loss differed at step 60)."""
  flags = _cpuinfo_field("flags") or ""
  return hashlib.sha256(f"{machine()}|{platform.machine()}|{flags}".encode()).hexdigest()[:16]


def recorded_cpu(meta: dict[str, Any]) -> str | None:
  """The CPU fingerprint in a run's config.json "meta": its "cpu" field or, in runs recorded
  before that field, the name of the automatic compilation cache directory it used
  (<cache_root>/xla/<fingerprint>); None when neither says."""
  if meta.get("cpu"):
    return meta["cpu"]
  cache = pathlib.PurePath(meta.get("compilation_cache") or "")
  if cache.parent.name == "xla" and re.fullmatch(r"[0-9a-f]{16}", cache.name):
    return cache.name
  return None


def git_commit(repo: pathlib.Path | None = None) -> str | None:
  """HEAD of `repo` (default: the repository this package runs from), "-dirty" when tracked
  files changed; None outside a git checkout (an installed wheel)."""
  repo = repo or pathlib.Path(__file__).resolve().parents[1]
  try:
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                            "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return commit + ("-dirty" if dirty else "")


def package_versions(packages=PACKAGES) -> dict[str, str | None]:
  versions = {}
  for package in packages:
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  return versions


def run_metadata() -> dict[str, Any]:
  """What config.json's "meta" records about the process: command, commit, machine and CPU
  fingerprint, versions, devices."""
  return {
      "argv": sys.argv,
      "git_commit": git_commit(),
      "python": platform.python_version(),
      "host": platform.node(),
      "machine": machine(),
      # The model name alone is not the machine type: VMs named alike differ in feature flags,
      # for which XLA compiles other code, with other rounding (see cpu_fingerprint).
      "cpu": cpu_fingerprint(),
      "versions": package_versions(),
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
      "compilation_cache": jax.config.jax_compilation_cache_dir,
  }


def enable_compilation_cache(setting: str = "auto") -> str | None:
  """Turns on JAX's persistent compilation cache; returns its directory (None: off).

  With it, the seeds of a grid, a resumed run and an early-exit sweep load the programs an
  earlier process compiled instead of compiling them again (on a 2-core CPU each train step
  shape takes about two minutes to compile). setting: a directory; "none" (off); or "auto":
  $JAX_COMPILATION_CACHE_DIR if set, else <cache_root>/xla/<CPU fingerprint>. XLA:CPU entries
  are native code for the CPU that compiled them and JAX's cache key does not name the CPU, so
  the automatic directory is per CPU model and feature set: a home directory shared by
  different machines never hands one of them another's code. Call before the first compile.
  """
  if setting == "none":
    # JAX reads $JAX_COMPILATION_CACHE_DIR itself when imported: turn that off too.
    jax.config.update("jax_compilation_cache_dir", None)
    return None
  if setting == "auto":
    setting = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if not setting:
    setting = str(data.cache_root() / "xla" / cpu_fingerprint())
  jax.config.update("jax_compilation_cache_dir", setting)
  return setting
