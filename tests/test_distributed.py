"""Past one device: two processes on localhost (jax.distributed over gloo, CPU collectives) give
the results of one process, and so does the backbone sharded FSDP style over 8 forced CPU
devices. Each run is a subprocess of launch/run.py on the tiny stream (tiny_run)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tiny_run
from tiny_run import ROOT, assert_same_run, command, env, results

from olora_jax import errors


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _devices_env(cache, n: int) -> dict:
  return {**env(cache), "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": tiny_run.xla_flags(f"--xla_force_host_platform_device_count={n}")}


def _start_processes(workdir, cache, *overrides: str, n: int = 2) -> list[subprocess.Popen]:
  """The tiny stream on `n` processes of one device each, joined through localhost."""
  address = f"localhost:{_free_port()}"
  return [subprocess.Popen(
      command(workdir, f"--config.distributed.coordinator_address={address}",
              f"--config.distributed.num_processes={n}", f"--config.distributed.process_id={i}",
              *overrides),
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      env=_devices_env(cache, 1)) for i in range(n)]


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
  errs = [p.communicate(timeout=600)[1] for p in procs]
  return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def _train_losses(workdir) -> np.ndarray:
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return np.array([x["loss"] for x in lines if x["event"] == "train"])


def _assert_close_to(workdir, reference) -> None:
  """Same decisions and metrics as `reference`, losses within float tolerance (the gradient
  reductions are summed in another order)."""
  got, want = results(workdir), results(reference)
  for key in ("plateau_steps", "task_end_steps", "n_steps", "samples_seen", "stream_sha256"):
    assert got[key] == want[key], key
  np.testing.assert_allclose(got["acc_matrix"], want["acc_matrix"], rtol=1e-6)
  np.testing.assert_allclose(got["anytime_accuracy"], want["anytime_accuracy"], rtol=1e-6)
  np.testing.assert_allclose(_train_losses(workdir), _train_losses(reference), rtol=1e-5)


def test_two_processes_give_one_process_results_and_stop_together(tmp_path, compilation_cache,
                                                                  tiny_reference):
  # One process with two devices, the reference for two processes of one device each.
  one = tmp_path / "one_process"
  done = subprocess.run(command(one), cwd=ROOT,
                        capture_output=True, text=True, timeout=600,
                        env=_devices_env(compilation_cache, 2))
  assert done.returncode == 0, done.stderr[-3000:]

  # SIGTERM to process 1 alone: both processes checkpoint the same step and stop with 128 + 15.
  two = tmp_path / "two_processes"
  procs = _start_processes(two, compilation_cache)
  deadline = time.time() + 600
  while procs[1].poll() is None and not (tiny_run.steps(two) and tiny_run.steps(two)[-1] >= 8):
    assert time.time() < deadline, "the run made no checkpoint in time"
    time.sleep(0.005)
  procs[1].send_signal(signal.SIGTERM)
  for code, err in _wait(procs):
    assert code == 128 + signal.SIGTERM, err[-3000:]
  assert 8 <= tiny_run.steps(two)[-1] < tiny_run.N_STEPS and not (two / "results.json").exists()

  # Resumed by the same two processes: the run of one process, bit for bit. Process 0 alone
  # wrote the run's files.
  for code, err in _wait(_start_processes(two, compilation_cache)):
    assert code == 0, err[-3000:]
  assert not (two / "error.log").exists()
  assert_same_run(two, one)
  # One device: the same run within float tolerance.
  _assert_close_to(two, tiny_reference)


def test_a_nonfinite_loss_stops_every_process_at_the_same_step(tmp_path, compilation_cache):
  # The loss is replicated, so every process sees the same NaN at the same step: each checkpoints
  # the last good state with the others and stops with exit 3 and the same line, the processes
  # leaving together (errors.NonFiniteLoss.every_process). Here the two reach their line within
  # moments of each other, so this holds the path (exit 3, one line each, one checkpoint), not
  # the leaving together, which the SIGTERM test above holds for the agreed stops.
  workdir = tmp_path / "run"
  results = _wait(_start_processes(workdir, compilation_cache,
                                   "--config.learner.learning_rate=1e38",
                                   "--config.checkpoint_every=0"))
  lines = []
  for code, err in results:
    assert code == errors.EXIT_NONFINITE, err[-3000:]
    lines.append(tiny_run.last_line(err))
  assert lines[0] == lines[1] and lines[0].startswith("error: non-finite loss (nan) at stream step")
  step = int(lines[0].split("stream step ")[1].split(";")[0])
  assert tiny_run.steps(workdir) == [step] and not (workdir / "results.json").exists()


def test_a_process_that_dies_stops_the_other_with_one_line(tmp_path, compilation_cache):
  # Process 1 killed outright (SIGKILL: no handler, no checkpoint of its own) after the first
  # checkpoint: process 0, left in a collective with no peer, stops at once with exit 4 and one
  # line that names the cause, not a hang and not a bug report; the checkpoint is intact. Where
  # process 0 waits at a save's barrier, not in a collective, the coordination service tells it,
  # after the heartbeat timeout (20 s here, not JAX's 100 s).
  workdir = tmp_path / "run"
  procs = _start_processes(workdir, compilation_cache, "--config.distributed.heartbeat_timeout=20")
  deadline = time.time() + 600
  while procs[1].poll() is None and not tiny_run.steps(workdir):
    assert time.time() < deadline, "the run made no checkpoint in time"
    time.sleep(0.005)
  procs[1].kill()
  killed = time.time()
  code, err = _wait(procs)[0]
  assert time.time() - killed < 120, "process 0 took too long to notice"
  assert code == errors.EXIT_ENVIRONMENT, err[-3000:]
  line = tiny_run.last_line(err)
  assert line.startswith("error: another process of this 2-process run died or lost contact")
  assert "start every process again to resume from checkpoint" in line, line
  assert [x for x in err.splitlines() if x.startswith("error:")] == [line]
  assert tiny_run.steps(workdir) and not (workdir / "results.json").exists()


# Two processes joined by `distributed.initialize` that meet at a checkpoint save's barrier
# (orbax's, through JAX's coordination service); process 1 then sleeps, process 0 waits at a second
# barrier until the first error it sees, and stops the run's way: after its own work (here 2 s),
# os._exit(4).
_BARRIER_SCRIPT = """
import os, sys, time
from configs import common
from olora_jax import distributed
c = common.get_config().distributed
c.coordinator_address, c.num_processes = sys.argv[1], 2
c.process_id, c.heartbeat_timeout = int(sys.argv[2]), int(sys.argv[3])
c.initialization_timeout = 60  # a peer that never joins ends the test, not a 30-minute wait
distributed.initialize(c)
from orbax.checkpoint import multihost
barrier = multihost.get_barrier_sync_fn()
barrier(key="joined", timeout_ms=60_000)
print("joined", flush=True)
if c.process_id == 1:
  time.sleep(600)
try:
  barrier(key="never", timeout_ms=600_000)
except Exception as e:
  print("barrier failed:", str(e)[:200], flush=True)
  time.sleep(2)
  os._exit(4)
"""


def test_a_peer_lost_in_a_barrier_leaves_the_exit_to_the_main_thread(tmp_path):
  """Process 1 killed while process 0 waits at a barrier: when its heartbeats stop, JAX's
  coordination service fails that barrier and, at the same moment, JAX's client aborts process 0
  from a thread of its own. The abort is held back (distributed.hold_client_aborts): process 0
  leaves with its own exit code, not 134."""
  address = f"localhost:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", _BARRIER_SCRIPT, address, str(i), "5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}) for i in range(2)]
  try:
    for line in procs[1].stdout:  # gloo prints a line of its own first
      if line == "joined\n":
        break
    else:
      raise AssertionError(procs[1].communicate(timeout=60)[1][-3000:])
    procs[1].kill()
    out, err = procs[0].communicate(timeout=120)
  finally:
    for p in procs:
      p.kill()
  assert "barrier failed:" in out and "heartbeat" in out, err[-3000:]
  assert procs[0].returncode == 4, err[-3000:]


_ABORT_SCRIPT = """
import faulthandler, os, sys, threading, time
from olora_jax import distributed
faulthandler.enable()  # as absl's app.run does before launch/run.py's main
where, distributed.ABORT_GRACE_SECONDS, work = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
distributed.hold_client_aborts()
if where == "main":
  os.abort()
threading.Thread(target=os.abort).start()
time.sleep(work)
os._exit(4)
"""


@pytest.mark.parametrize("where, grace, work, code", [
    ("thread", 30, 1, 4),  # the main thread leaves first, with its own code
    ("thread", 1, 60, -signal.SIGABRT),  # past the grace the abort goes ahead
    ("main", 30, 60, -signal.SIGABRT),  # the main thread's own abort is not held
])
def test_an_abort_off_the_main_thread_waits_for_the_main_thread(where, grace, work, code):
  start = time.time()
  done = subprocess.run([sys.executable, "-c", _ABORT_SCRIPT, where, str(grace), str(work)],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == code, done.stderr[-3000:]
  assert time.time() - start < min(grace, work) + 20
  if code < 0:  # faulthandler's tracebacks still come before an abort
    assert "most recent call first" in done.stderr, done.stderr[-3000:]


def test_a_barrier_that_fails_on_a_dead_peers_heartbeat_is_a_lost_peer():
  """test_a_process_that_dies_stops_the_other_with_one_line lost its peer once while process 0
  waited in a checkpoint save's barrier: the coordination service's error (its text as JAX raised
  it, from orbax's barrier) is a lost peer too, so that process stops with exit 4 and its one
  line, not a bug report."""
  raised = RuntimeError(
      "INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat"
      " timeout. This indicates that the remote task has failed, got preempted, or crashed"
      " unexpectedly. [type.googleapis.com/tensorflow.CoordinationServiceError='']. Barrier Id:"
      " ThreadSaveMultiHostValueHolder:set_value_start::1, Task: 1")
  try:
    raise ValueError("the checkpoint could not be saved") from raised
  except ValueError as e:
    assert errors.peer_lost(e)
  assert not errors.peer_lost(RuntimeError("INTERNAL: an XLA error of this process alone"))


def test_a_signal_while_waiting_for_a_process_that_never_joins_stops_at_once(tmp_path):
  # Process 0 of two, alone: it starts the coordination service and waits for process 1, which
  # never comes (it died at start-up). SIGTERM ends the wait at once with 143 and one line, not
  # after `distributed.initialization_timeout` (1800 s).
  port = _free_port()
  proc = subprocess.Popen(
      command(tmp_path / "run", f"--config.distributed.coordinator_address=localhost:{port}",
              "--config.distributed.num_processes=2", "--config.distributed.process_id=0"),
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      env=_devices_env(tmp_path / "cache", 1))
  deadline = time.time() + 300
  while True:  # the coordinator listens: process 0 is waiting in the join
    assert proc.poll() is None and time.time() < deadline, "process 0 never started its join"
    with socket.socket() as s:
      if s.connect_ex(("localhost", port)) == 0:
        break
    time.sleep(0.05)
  time.sleep(1)
  proc.send_signal(signal.SIGTERM)
  signalled = time.time()
  err = proc.communicate(timeout=60)[1]
  assert time.time() - signalled < 30
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  # The signal watcher's line, word for word the one a process still in an earlier stage of its
  # start-up prints (errors.start_up_stop), so the processes of a run agree.
  assert tiny_run.last_line(err) == f"error: {errors.start_up_stop(15)}", err
  assert not (tmp_path / "run").exists()  # nothing was written


SHARDED_STATE = """
import jax, numpy as np
from configs import tiny
from olora_jax import trainer
config = tiny.get_config()
config.sharding.fsdp = 8
setup = trainer.Setup(config)
init_key, method_key = jax.random.split(jax.random.key(0))
params = trainer.initial_params(setup, setup.config, init_key)
state = trainer.initial_state(setup.method, method_key, params, setup.mesh)
qkv = state["frozen"]["encoderblock_0"]["attn"]["query"]["kernel"]
shard = qkv.addressable_shards[0].data.shape
assert len(qkv.sharding.device_set) == 8 and np.prod(shard) * 8 == qkv.size, (shard, qkv.shape)
print("SHARDED", qkv.shape, shard)
"""


def test_backbone_sharded_over_eight_devices_matches_one_device(tmp_path, compilation_cache,
                                                                tiny_reference):
  check = subprocess.run([sys.executable, "-c", SHARDED_STATE], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**_devices_env(compilation_cache, 8),
                                                      "PYTHONPATH": str(ROOT)})
  assert check.returncode == 0 and "SHARDED" in check.stdout, check.stderr[-3000:]

  # The evaluator's forward passes in pieces of 8 test images per device, too (2 pieces of each
  # device's 16 rows): every device keeps predicting its own rows.
  workdir = tmp_path / "fsdp8"
  done = subprocess.run(command(workdir, "--config.sharding.fsdp=8",
                                "--config.eval.predict_chunk=8"),
                        cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=_devices_env(compilation_cache, 8))
  assert done.returncode == 0, done.stderr[-3000:]
  _assert_close_to(workdir, tiny_reference)


def test_bad_distributed_and_sharding_values_fail_before_compute(tmp_path, compilation_cache):
  for override, message in (("--config.distributed.initialize=always", "distributed.initialize"),
                            ("--config.distributed.process_id=-3", "distributed.process_id"),
                            ("--config.distributed.initialization_timeout=0",
                             "distributed.initialization_timeout=0 must be a whole number"),
                            ("--config.distributed.heartbeat_timeout=0",
                             "distributed.heartbeat_timeout=0 must be a whole number"),
                            ("--config.sharding.fsdp=3", "sharding.fsdp=3")):
    done = tiny_run.run(tmp_path / "bad", compilation_cache, override)
    assert done.returncode == 2, (override, done.stderr[-2000:])
    assert message in tiny_run.last_line(done.stderr), done.stderr[-2000:]
    assert not os.path.exists(tmp_path / "bad"), override


def test_a_process_rows_of_a_batch_are_those_of_the_whole_batch():
  """Each process prepares only its rows; with augmentation they get the crops and flips they
  get in the whole batch (the draws of every row are made, in order)."""
  from olora_jax.data import sources, streams
  from olora_jax.data.pipeline import InputPipeline

  source = sources.load_source("sklearn_digits", "train", 0.2, 0)
  stream = streams.disjoint_class_incremental(source.labels, 5, 16, seed=0)
  short = next(i for i, ids in enumerate(stream.steps) if len(ids) < 16)
  for augment in ("none", "crop_flip"):
    whole = InputPipeline(source, stream, 16, 16, augment, seed=3)
    for rows in (slice(0, 8), slice(8, 16)):
      part = InputPipeline(source, stream, 16, 16, augment, seed=3, rows=rows)
      for step in (0, short):
        want, got = whole.batch(step), part.batch(step)
        for key in ("images", "labels", "mask"):
          np.testing.assert_array_equal(got[key], want[key][rows], err_msg=f"{augment} {key}")
