"""Several processes, one run: `jax.distributed` from the config or the environment.

`initialize(config.distributed)` runs before anything touches a JAX backend:

  distributed.initialize='auto'     join a multi-process run when `coordinator_address` is given,
                                    or `$JAX_COORDINATOR_ADDRESS` is set (JAX's own variable,
                                    with `$JAX_NUM_PROCESSES` / `$JAX_PROCESS_ID`); else one process
  distributed.initialize='cluster'  always join, letting JAX find the cluster (Cloud TPU pods,
                                    SLURM, Open MPI, Kubernetes: no other key needed)
  distributed.initialize='off'      one process, whatever the environment says
  distributed.coordinator_address   'host:port' of process 0, reachable from every process
  distributed.num_processes         how many processes (0: from the environment)
  distributed.process_id            this process's index (-1: from the environment)
  distributed.initialization_timeout  seconds every process waits for the others to join
                                    (default 1800: after a preemption, a cold restart of many
                                    nodes can take longer than JAX's own 300 s)
  distributed.heartbeat_timeout     seconds without a heartbeat after which JAX's coordination
                                    service holds a process dead and stops the others (JAX's 100)

Every process runs the same command on the same workdir, on a file system they share. Each one
reads and preprocesses only its own rows of every batch and test batch (`sharding.local_rows`);
the train step, the plateau rule and the evaluation counts run on global arrays, so every process
computes the same decisions from the same values. Process 0 alone writes the run's files
(config.json, the manifest, metrics.jsonl, results.json, plots, the trace, the lock); every process
takes part in each checkpoint save and restore. On CPU the processes talk through gloo.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import threading
import time

import jax
import ml_collections

from olora_jax import run_control

MODES = ("auto", "cluster", "off")
ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
# True while this process waits in `jax.distributed.initialize` for the others to join. That call
# does not come back to Python until every process has joined (or `initialization_timeout` has
# passed), and one that died never will: a signal then ends the process at once (launch/run.py's
# signal watcher, olora_jax.signal_watch), as during the imports; nothing has been written yet.
JOINING = [False]
# How long an abort raised by JAX's distributed client, on one of its own threads, is held back
# (`hold_client_aborts`).
ABORT_GRACE_SECONDS = 30.0


def check(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError on a bad `distributed` block (before anything starts)."""
  if c.initialize not in MODES:
    raise ValueError(f"distributed.initialize={c.initialize!r} must be one of {MODES}")
  if not isinstance(c.num_processes, int) or c.num_processes < 0:
    raise ValueError(f"distributed.num_processes={c.num_processes!r} must be an integer >= 0"
                     " (0: from the environment)")
  if not isinstance(c.process_id, int) or c.process_id < -1 or (
      c.num_processes and c.process_id >= c.num_processes):
    raise ValueError(f"distributed.process_id={c.process_id!r} must be in [0,"
                     f" num_processes={c.num_processes}) (-1: from the environment)")
  for key in ("initialization_timeout", "heartbeat_timeout"):
    if not isinstance(c[key], int) or c[key] < 1:
      raise ValueError(f"distributed.{key}={c[key]!r} must be a whole number of seconds >= 1")
  if c.coordinator_address and ":" not in c.coordinator_address:
    raise ValueError(f"distributed.coordinator_address={c.coordinator_address!r} must be"
                     " 'host:port' of process 0")


def wanted(c: ml_collections.ConfigDict) -> bool:
  """Whether this config asks for a multi-process run."""
  if c.initialize == "off":
    return False
  return c.initialize == "cluster" or bool(c.coordinator_address or os.environ.get(ENV_ADDRESS))


def initialize(c: ml_collections.ConfigDict) -> None:
  """Joins the multi-process run the config asks for; a no-op when none is asked for or this
  process has joined already."""
  check(c)
  if not wanted(c) or jax.distributed.is_initialized():
    return
  # CPU processes exchange collectives through gloo (GPU and TPU use their own transports).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # XLA's preemption service would install its own SIGTERM handler in place of the run's
  # (launch/run.py records a signal from its first line; the loop checkpoints on it), and a run
  # signalled before its time limit would go on to be killed without a checkpoint.
  jax.config.update("jax_enable_preemption_service", False)
  JOINING[0] = True
  try:
    run_control.stop_if_signalled()  # one that came before: nothing is written yet
    jax.distributed.initialize(
        coordinator_address=c.coordinator_address or None,
        num_processes=c.num_processes or None,
        process_id=None if c.process_id < 0 else c.process_id,
        initialization_timeout=c.initialization_timeout,
        heartbeat_timeout_seconds=c.heartbeat_timeout)
  finally:
    JOINING[0] = False
  hold_client_aborts()


# JAX's coordination service (on process 0) holds a process dead once its heartbeats stop for
# `heartbeat_timeout` seconds, and tells every other process at once, twice over: the barrier
# that process's main thread waits in (each checkpoint save has some) fails with the error, which
# the run turns into exit 4 and its one line (trainer._guarded); and JAX's client, on a thread of
# its own, aborts the process (SIGABRT, exit 134, a C++ message and no line). The client's abort
# cannot be switched off from Python (a Python callback in its place fails to receive the status),
# and whichever comes first wins: the abort, whenever the main thread has work left to do before
# it exits. So, in a multi-process run, an abort raised on any thread but the main one waits up
# to ABORT_GRACE_SECONDS: the main thread, which got the same error, stops the run its own way
# meanwhile (os._exit). An abort the main thread raises, or one still pending after the grace,
# goes ahead as before, Python's tracebacks first where faulthandler is on (absl turns it on).
_ABORT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_HELD_ABORT = []  # the installed handler, kept alive as long as the process


def _hold_abort(signum: int) -> None:
  if threading.get_ident() != threading.main_thread().ident:
    time.sleep(ABORT_GRACE_SECONDS)
  if faulthandler.is_enabled():
    faulthandler.dump_traceback(all_threads=True)
  # Returning lets abort() go on: it restores the default action and raises SIGABRT again.


def hold_client_aborts() -> None:
  """Installs the SIGABRT handler above (once; where the C library offers `signal`)."""
  if _HELD_ABORT:
    return
  try:
    install = ctypes.CDLL(None).signal
  except (OSError, AttributeError):  # no C library to ask: aborts stay as they are
    return
  install.restype = ctypes.c_void_p
  install.argtypes = (ctypes.c_int, _ABORT_HANDLER)
  _HELD_ABORT.append(_ABORT_HANDLER(_hold_abort))
  install(signal.SIGABRT, _HELD_ABORT[0])


def finish() -> None:
  """Leaves the multi-process run, once every process has got here (JAX's shutdown barrier); a
  no-op in a single-process run. For a process that ends without the interpreter's teardown,
  which would otherwise do it."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
