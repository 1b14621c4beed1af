"""Stopping a run cleanly when the machine is about to go: SIGTERM (a pre-emption notice on
Cloud TPU VMs, Slurm and Kubernetes) or Ctrl-C.

The training loop asks `StopRequests.reached(step)` after every step. When it says yes, the
loop saves the latest checkpoint at that step and raises `Preempted`; the command line exits
with EXIT_CODE, and rerunning the same command resumes from that step exactly.

Every host of a multi-host job must stop at the same step, or the checkpoint save (a
collective) would hang. There the decision is JAX's pre-emption sync service, which orbax
uses too: its C++ handler catches SIGTERM on any host, the hosts agree on a step a little
ahead of all of them, and `reached_preemption_sync_point` says yes on every host at that step.
A single process decides alone, from a Python signal handler.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

import jax
from jax.experimental import multihost_utils

# os.EX_TEMPFAIL: "temporary failure, retry" to schedulers and shells; 143 would read as killed.
EXIT_CODE = 75


class Preempted(Exception):
  """Training stopped at `step` on a signal, after saving the latest checkpoint there."""

  def __init__(self, step: int, checkpoint: str):
    super().__init__(f"Pre-empted: saved the checkpoint at step {step} ({checkpoint}); rerun "
                     "the same command to resume from it")
    self.step = step
    self.checkpoint = checkpoint


@contextlib.contextmanager
def exit_on_sigterm(what: str) -> Iterator[None]:
  """For work that keeps nothing on the way (an early-exit sweep, an export, predictions): a
  SIGTERM stops it at once with EXIT_CODE, which run_grid and schedulers read as a stop to run
  again, where the signal's default would read as a failure (exit -15). A sweep's JSON, which
  marks a run as swept, is written last and whole (run_dir.write_json)."""
  if threading.current_thread() is not threading.main_thread():
    yield  # Python delivers signals to the main thread only
    return

  def handle(signum, frame):
    del frame
    sys.stderr.write(f"\n{signal.Signals(signum).name}: stopped {what}; rerun the same command "
                     "to do it again\n")
    sys.exit(EXIT_CODE)

  previous = signal.signal(signal.SIGTERM, handle)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


class StopRequests:
  """Whether a stop was requested, and at which step every process stops.

  Use as a context manager around the loop: it installs the handlers and puts the previous
  ones back. A second Ctrl-C stops at once (KeyboardInterrupt), without saving.
  """

  def __init__(self):
    self._requested = threading.Event()
    self._multi_process = jax.process_count() > 1
    self.signal_name = None

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    sys.stderr.write(f"\n{self.signal_name}: finishing the current step, then saving a "
                     "checkpoint to resume from (Ctrl-C again stops at once, without saving)\n")
    # The next Ctrl-C is for someone who does not want to wait for the save.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if self._multi_process:
      # Hand it to JAX's pre-emption service, which listens for SIGTERM, so that every host
      # learns of it and they agree on the step.
      os.kill(os.getpid(), signal.SIGTERM)
    else:
      self._requested.set()

  @contextlib.contextmanager
  def installed(self) -> Iterator["StopRequests"]:
    if threading.current_thread() is not threading.main_thread():
      yield self  # Python delivers signals to the main thread only; leave them alone
      return
    # Multi-host: SIGTERM stays with JAX's service (a Python handler would replace its own).
    signums = (signal.SIGINT,) if self._multi_process else (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, self._handle) for signum in signums}
    try:
      yield self
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)

  def reached(self, step: int) -> bool:
    """Whether to save and stop after `step`; call after every step, on every process."""
    if self._multi_process:
      try:
        reached = multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError:  # jax_enable_preemption_service is off: SIGTERM kills as before
        return False
      if reached:
        self.signal_name = self.signal_name or "SIGTERM"
      return reached
    return self._requested.is_set()
