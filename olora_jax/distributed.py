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

Every process runs the same command on the same workdir, on a file system they share. Each one
reads and preprocesses only its own rows of every batch and test batch (`sharding.local_rows`);
the train step, the plateau rule and the evaluation counts run on global arrays, so every process
computes the same decisions from the same values. Process 0 alone writes the run's files
(config.json, the manifest, metrics.jsonl, results.json, plots, the trace, the lock); every process
takes part in each checkpoint save and restore. On CPU the processes talk through gloo.
"""

from __future__ import annotations

import os

import jax
import ml_collections

from olora_jax import run_control

MODES = ("auto", "cluster", "off")
ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
# True while this process waits in `jax.distributed.initialize` for the others to join. That call
# does not come back to Python until every process has joined (or `initialization_timeout` has
# passed), and one that died never will: a signal then ends the process at once (launch/run.py's
# signal watcher), as during the imports; nothing has been written yet.
JOINING = [False]


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
  if not isinstance(c.initialization_timeout, int) or c.initialization_timeout < 1:
    raise ValueError(f"distributed.initialization_timeout={c.initialization_timeout!r} must be"
                     " a whole number of seconds >= 1")
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
        initialization_timeout=c.initialization_timeout)
  finally:
    JOINING[0] = False


def finish() -> None:
  """Leaves the multi-process run, once every process has got here (JAX's shutdown barrier); a
  no-op in a single-process run. For a process that ends without the interpreter's teardown,
  which would otherwise do it."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
