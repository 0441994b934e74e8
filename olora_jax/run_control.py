"""How a run steps, saves and stops: the guarded train step, the non-finite policy, checkpoint
cadence and signals. The loop of `olora_jax.trainer` calls these; none of them knows the method.

    make_guarded_step   the method's jitted step, keeping the last good state on a NaN/Inf loss
    NonFinitePolicy     a non-finite loss: checkpoint and stop (exit 3), or skip the step
                        (`learner.skip_nonfinite`) until `learner.max_skipped_fraction` is passed
    Saver               checkpoints the whole run (state, progress, run-log length and digest,
                        compute ledger, trace) every `checkpoint_every` steps, at the end, and
                        when a signal asks the run to stop
    StopSignal          SIGTERM / SIGINT as a flag the loop checks after each step; a second
                        signal stops the run at once, but never inside a checkpoint's save
    evaluated_state     a method's `eval_state` (the model the evaluator reads) checked for
                        NaN/Inf, as the trained state is by its loss and checkpoints (exit 3)
    stop_if_signalled   a signal that came before the loop (imports, set-up: `PENDING_SIGNALS`,
                        recorded by launch/run.py's first handler) stops the run there
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from olora_jax import checkpointing, errors, sharding

# Signals received before the loop's handlers, in order (launch/run.py records them from its
# first line on; empty in a run started from Python).
PENDING_SIGNALS: list[int] = []
# True while a checkpoint is being written: a second signal then waits for the save to end.
SAVING = [False]


def stop_if_signalled(when: str | None = None) -> None:
  """Raises `errors.Preempted` (exit 128 + signal) if a signal came before the loop, to any
  process of a multi-process run (one small collective, once the processes have joined): every
  process stops at the same stage, none is left waiting in a collective for one that stopped.
  `when` None: nothing is written yet, the line is `errors.start_up_stop`'s; else it names
  the stage."""
  signum = PENDING_SIGNALS[0] if PENDING_SIGNALS else 0
  joined = jax.distributed.is_initialized()
  if joined:  # never before: that would start the backend
    signum = sharding.process_max(signum)
  if signum:
    raise errors.Preempted(signum, errors.start_up_stop(signum) if when is None else
                           f"stopped by signal {signum} {when}, before any step ran; what is"
                           " written is complete: run the same command to start (or resume)",
                           every_process=joined)


def learning_rate_key(config, block: str) -> str | None:
  """The key of the learning rate a method with config block `block` trains with (its own
  block's, e.g. `er.learning_rate`; Online-LoRA's `learner.learning_rate`), None when the block
  has none (a method that fits no weights by gradient)."""
  return f"{block}.learning_rate" if "learning_rate" in config.get(block, {}) else None


def make_guarded_step(train_step: Callable) -> Callable:
  """The method's train step, but a non-finite loss leaves the state as it was.

  The step donates the state, so the last good state must be kept inside jit: the trainer can
  then checkpoint it (and stop) or skip the step (`learner.skip_nonfinite`).
  """

  def step(state, batch):
    new_state, scalars, extras = train_step(state, batch)
    finite = jnp.isfinite(scalars["loss"])
    return jax.lax.cond(finite, lambda: new_state, lambda: state), scalars, extras

  return jax.jit(step, donate_argnums=(0,))


def evaluated_state(method, checkpointer) -> Callable | None:
  """`(state, step) -> state`: `method.eval_state(state)`, the model the evaluator (and
  eval.export) reads, refused with `errors.NonFiniteLoss` (exit 3) when it holds a NaN or an Inf:
  its predictions would be meaningless (an argmax over NaN logits counts as class 0) while the
  loss the trained state passed was finite. None when the method evaluates its state as it is
  (that state is the one the loss and the checkpoints guard). The state is not saved: the
  newest checkpoint stays the run's last good one."""
  if method.eval_state is None:
    return None
  # The method's own keys that set what eval_state computes, else its settings as a whole.
  fix = (f"lower {' or '.join(method.eval_state_keys)}" if method.eval_state_keys else
         "change its settings")

  def flagged(state):
    evaluated = method.eval_state(state)
    return evaluated, checkpointing.finite_flags(evaluated)

  # A jitted eval_state (every packaged method's) takes the flags into its own program, so the
  # check compiles nothing more; a plain Python one is checked by a program of its own.
  if hasattr(method.eval_state, "lower"):
    flagged = jax.jit(flagged)

  def view(state, step: int):
    evaluated, flags = flagged(state)
    bad = checkpointing.nonfinite_paths(evaluated, flags)
    if bad:
      steps = checkpointer.steps()
      kept = (f"the newest checkpoint, {checkpointer.directory}/{steps[-1]}, is kept" if steps
              else "no checkpoint was written yet")
      raise errors.NonFiniteLoss(
          f"the model evaluated after stream step {step} holds NaN/Inf ({len(bad)} array(s),"
          f" e.g. {bad[0]}) though the trained state's loss was finite: method={method.name!r}"
          f" computes it for evaluation (its eval_state); {fix} with a new --workdir"
          f" (this one keeps this run's config), or check the data; {kept}")
    return evaluated

  return view


class StopSignal:
  """Turns SIGTERM / SIGINT into a flag the loop checks at the end of each step (a signal that
  came before, `PENDING_SIGNALS`, counts as the first).

  A second signal stops the run at once (`errors.Preempted`, the newest checkpoint kept), unless
  a checkpoint is being written: that save ends first, then the run stops. A signal within
  `errors.SAME_STOP_SECONDS` of the first is that stop again (SLURM delivers one stop twice), not
  a second one.
  """

  def __init__(self):
    self.signum: int | None = PENDING_SIGNALS[0] if PENDING_SIGNALS else None
    self._first_at = time.monotonic() if PENDING_SIGNALS else None
    self._previous: dict = {}

  def __enter__(self) -> StopSignal:
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    if self.signum is None:
      self.signum, self._first_at = signum, time.monotonic()
      return
    if time.monotonic() - self._first_at < errors.SAME_STOP_SECONDS:
      return  # the first stop delivered again
    if SAVING[0]:  # asked twice during a save: the save ends, then the loop stops
      return
    self.__exit__()
    raise errors.Preempted(signum, errors.second_signal_stop(signum))

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}


class Saver:
  """Checkpoints the run: `save(state, progress)` records the run log's length and digest, the
  elapsed time and the compute ledger in the progress, then writes the checkpoint and the trace.
  `after_step` applies the cadence (`checkpoint_every`) and the stop signal."""

  def __init__(self, checkpointer, meta: dict, log, ledger, trace, checkpoint_every: int,
               wall_before: float, host_failed=None):
    self.checkpointer, self.meta, self.log, self.ledger, self.trace = (
        checkpointer, meta, log, ledger, trace)
    # `host_failed(method_host)`: names the method's hook when its host record is why a
    # checkpoint could not be written (`methods.base.HookCheck.host_failed`).
    self.host_failed = host_failed
    self.checkpoint_every = checkpoint_every
    self.wall_before = wall_before  # compute time of earlier processes of this run
    self.start = time.time()

  def wall_seconds(self) -> float:
    return self.wall_before + time.time() - self.start

  def save(self, state, p) -> None:
    """Checkpoints the run; the checkpoint carries a copy of the run log (checked unchanged), so
    a damaged or deleted log costs no more than resuming from it."""
    run_log = self.log.text()  # RunLogChanged (exit 4) if the file changed under the run
    p.metrics_bytes, p.metrics_sha256 = self.log.size(), self.log.sha256()
    p.wall_seconds = self.wall_seconds()
    p.compute = self.ledger.checkpoint_record()
    SAVING[0] = True
    start = time.perf_counter()
    try:
      self.checkpointer.save(state, p, {**self.meta, "run_log": run_log})
      self.trace.save()
    except (TypeError, ValueError):  # e.g. a record JSON cannot store: the method's own?
      if self.host_failed is not None:
        self.host_failed(p.method_host)
      raise
    finally:
      SAVING[0] = False
    self.ledger.timed_checkpoint(time.perf_counter() - start)

  def after_step(self, state, p, step: int, stop: StopSignal) -> None:
    """At the cadence, a checkpoint; on a signal (to any process), a checkpoint, then
    `errors.Preempted`: every process stops after the same step."""
    if self.checkpoint_every and p.cursor % self.checkpoint_every == 0:
      self.save(state, p)
    signum = sharding.process_max(stop.signum or 0)
    if signum:
      self.save(state, p)
      raise errors.Preempted(signum, (
          f"stopped by signal {signum} after stream step {step}; checkpointed in"
          f" {self.checkpointer.directory}/{p.cursor}: run the same command to resume"),
          every_process=True)

  def stop_if_signalled_at_end(self, stop: StopSignal, p) -> None:
    """After the stream's end and its exports (a signal to any process): `errors.Preempted`
    before results.json is written, the final checkpoint kept; a rerun finishes from it."""
    signum = sharding.process_max(stop.signum or 0)
    if signum:
      raise errors.Preempted(signum, (
          f"stopped by signal {signum} after the stream's end, before results.json was written;"
          f" the final checkpoint is {self.checkpointer.directory}/{p.cursor}: run the same"
          " command to finish from it"), every_process=True)

  def close(self) -> None:
    """The checkpointer and metrics.jsonl; the log's mirrors are the run's to close (they get
    its results first: trainer.py)."""
    self.checkpointer.close()
    self.log.close_file()


class NonFinitePolicy:
  """What a non-finite loss does: with `skip_nonfinite` False, checkpoint the last good state
  (the guarded step kept it) and stop with exit 3; with True, skip the step, until more than
  `max_skipped_fraction` of the stream's steps were skipped."""

  def __init__(self, skip_nonfinite: bool, max_skipped_fraction: float, n_steps: int,
               saver: Saver, learning_rate_key: str | None = "learner.learning_rate"):
    self.skip, self.fraction, self.n_steps, self.saver = (
        skip_nonfinite, max_skipped_fraction, n_steps, saver)
    self.max_skipped = int(max_skipped_fraction * n_steps)
    # A changed learning rate is another config: the workdir holds this run's, so the advice
    # names a new --workdir (the non-finite policy's keys may change on resume).
    self.lower = ("check the data and the method's settings" if learning_rate_key is None else
                  f"lower {learning_rate_key}")
    self.lower += " with a new --workdir (this one keeps this run's config)"

  def check(self, step: int, scalars: dict, state, p) -> bool:
    """Whether the step's loss was finite; raises `errors.NonFiniteLoss` (after checkpointing)
    when the run must stop."""
    if bool(np.isfinite(scalars["loss"])):
      return True
    where = f"the last good state is checkpointed in {self.saver.checkpointer.directory}/{step}"
    if not self.skip:
      self.saver.save(state, p)  # the state is the one before this step: the last good state
      raise errors.NonFiniteLoss(
          f"non-finite loss ({scalars['loss']}) at stream step {step}; {where}; {self.lower},"
          " or rerun the same command with --config.learner.skip_nonfinite=True to skip such"
          " steps (it resumes here)")
    if len(p.nonfinite_steps) + 1 > self.max_skipped:
      self.saver.save(state, p)
      raise errors.NonFiniteLoss(
          f"{len(p.nonfinite_steps) + 1} stream steps skipped for a non-finite loss (the"
          f" latest: {step}), more than learner.max_skipped_fraction={self.fraction} of the"
          f" {self.n_steps} steps allow; {where}; {self.lower}, or rerun the same command with"
          " a higher --config.learner.max_skipped_fraction (it resumes here)")
    return False

  def record_skip(self, step: int, scalars: dict, p, log) -> None:
    """A skipped step (the state is the one before it) in the progress and the run log."""
    p.nonfinite_steps.append(step)
    log.write("nonfinite_skipped", step, samples_seen=p.samples_seen, loss=scalars["loss"])
