"""Why a run stopped: one exception class per exit code, so the CLI, the docs and the tests share
one table.

  code  class               meaning                                          what is kept
  0     -                   finished (or the workdir held the finished run)  everything
  1     InternalError       an unexpected error (a bug): please report it    the newest checkpoint
  2     BadInput            bad input, refused before any compute            nothing was written
  3     NonFiniteLoss       the loss became NaN/Inf (or too many steps were  the last good state,
                            skipped with learner.skip_nonfinite), or the     checkpointed
                            model evaluated holds NaN/Inf
  4     EnvironmentFailure  disk full, file-size limit, read-only or         the newest good
                            unwritable workdir, workdir busy (another        checkpoint: rerun the
                            process holds it), another process of a          command to resume
                            multi-process run died or lost contact
  128+s Preempted           stopped by signal s (SIGTERM 143, SIGINT 130)    the state after the
                                                                             current step

Every message is one line that names the cause and the fix. `launch/run.py` prints it as the last
line of stderr; for the classes whose `write_log` is True (exits 1, 3 and 4, but a busy workdir)
it also writes the full traceback to a log file (`error.log` in the workdir when it can be
written, else in the system's temp directory). Bad input, a busy workdir and signals leave none.
"""

from __future__ import annotations

import errno
import os
import re
import sysconfig
import traceback

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_ENVIRONMENT = 4
EXIT_SIGNAL_BASE = 128

# errno values that mean "the machine cannot store what the run writes", not a bug in the run.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                            errno.EPERM, errno.EIO})
# The same causes as they appear in the text of errors that lost their errno on the way (orbax
# and tensorstore re-raise OS errors as ValueError / RuntimeError with the strerror inside).
STORAGE_MESSAGES = ("No space left on device", "Disk quota exceeded", "File too large",
                    "Read-only file system", "Permission denied", "Operation not permitted",
                    "Input/output error")
# NumPy's `np.save` / `ndarray.tofile` report a short write (a full disk) with no errno, only
# "<n> requested and <m> written".
SHORT_WRITE = re.compile(r"\b\d+ requested and \d+ written\b")
SHORT_WRITE_CAUSE = "No space left on device (a short write)"
# What to do about each storage failure, by its OS text (`storage_advice`).
_FULL = ("No space left on device", "Disk quota exceeded", SHORT_WRITE_CAUSE)
_NOT_WRITABLE = ("Read-only file system", "Permission denied", "Operation not permitted")


class RunError(Exception):
  """Base of every error with a documented exit code."""

  exit_code = EXIT_INTERNAL
  # Whether the CLI writes the traceback to the workdir's error log: not for bad input (nothing is
  # written) nor for a busy workdir (it belongs to another process).
  write_log = True
  # Whether every process of a multi-process run raises it at the same point, after the same
  # collective decision. The CLI then has the processes leave together (JAX's shutdown barrier,
  # `distributed.finish`), each after its own line: a process still running when process 0, which
  # hosts JAX's coordination service, has exited gets JAX's client abort (exit 134, no line),
  # held back only for a while (`distributed.hold_client_aborts`, the backstop for a peer that is
  # gone; an agreed stop has no need of it).
  every_process = False


class InternalError(RunError):
  """An unexpected error during the run (a bug): the newest checkpoint is intact."""

  exit_code = EXIT_INTERNAL


class BadInput(RunError, ValueError):
  """A bad config value or key, dataset, checkpoint or workdir, found before any compute."""

  exit_code = EXIT_BAD_INPUT
  write_log = False


class NonFiniteLoss(RunError):
  """The loss became NaN or Inf (the last good state has been checkpointed), or the model a
  method computes for evaluation did (`run_control.evaluated_state`)."""

  exit_code = EXIT_NONFINITE
  # The loss and the checkpoint's finite flags are replicated values: every process of a
  # multi-process run raises this at the same step, after the same collective save.
  every_process = True


class EnvironmentFailure(RunError):
  """The machine, not the run, failed: disk full, file-size limit, read-only or unwritable
  workdir, or a workdir held by another process. The newest good checkpoint is intact."""

  exit_code = EXIT_ENVIRONMENT


class OutOfMemory(EnvironmentFailure):
  """The device (or the host) ran out of memory while the run computed."""


def causes(e: BaseException | None):
  """`e`, then what it was raised from (`__cause__`, else `__context__`), and so on, each once:
  libraries re-raise errors under other types with the reason inside."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


# What an allocation failure looks like: Python's MemoryError, or XLA's status in the text of
# the runtime error it raises (on GPU, TPU and CPU alike).
OUT_OF_MEMORY_MESSAGES = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def out_of_memory(e: BaseException) -> bool:
  """Whether `e` (or what it was raised from) is an allocation failure. A storage failure is not,
  though tensorstore reports a full disk with the status of one ("RESOURCE_EXHAUSTED: Error
  writing local file ...: No space left on device")."""
  if storage_cause(e) is not None:
    return False
  return any(isinstance(x, MemoryError) or any(m in str(x) for m in OUT_OF_MEMORY_MESSAGES)
             for x in causes(e))


OOM_ADVICE = ("lower learner.batch_size (or eval.batch_size, a method's buffer_size or"
              " replay_batch), set model.compute_dtype=bfloat16, or use a device with more memory")


class WorkdirBusy(EnvironmentFailure):
  """Another live process holds the workdir's lock."""

  write_log = False


def start_up_stop(signum: int) -> str:
  """The one line of a stop before a launch wrote anything: the imports, the set-up, the join of
  a multi-process run. The processes of such a run reach the stages of their start-up at
  different moments, and each prints this same line wherever a signal found it: the signal watcher
  launch/run.py starts (olora_jax.signal_watch) during the imports and the join (it imports this
  light module before it starts), the loop's checks after them (`run_control.stop_if_signalled`)."""
  return (f"stopped by signal {signum} during start-up, before anything was written; run the"
          " same command to start (or resume)")


# One stop can reach a run twice within milliseconds: under SLURM, slurmstepd's SIGTERM to every
# process of the step and the sweep runner's forward of its own. A signal again within this many
# seconds of the one that began the stop is that stop, not a second one (the runner of
# olora_jax/sweep/cells.py applies the same rule to what it forwards).
SAME_STOP_SECONDS = 2.0


def second_signal_stop(signum: int) -> str:
  """The line of a second signal once a run has begun: it stops at once (never inside a
  checkpoint's save), printed by the loop's handler or, where the main thread is held in a
  long device call, by launch/run.py's signal watcher (olora_jax.signal_watch)."""
  return (f"stopped at once by a second signal {signum}; the newest checkpoint is kept: run the"
          " same command to resume from it")


class Preempted(RunError):  # a signal, not a failure
  """SIGTERM or SIGINT arrived; the state at the end of the current step has been checkpointed."""

  write_log = False

  def __init__(self, signum: int, message: str, every_process: bool = False):
    super().__init__(message)
    self.signum = signum
    self.exit_code = EXIT_SIGNAL_BASE + signum
    self.every_process = every_process  # raised by every process at the same point


# How the loss of another process of a multi-process run reaches the ones left: a collective
# whose peer closed its sockets (gloo on CPU, NCCL on GPU), or the coordination service that
# JAX's distributed runtime keeps on process 0 (its errors carry the type CoordinationServiceError,
# e.g. a checkpoint's barrier failing on the dead task's heartbeat timeout).
PEER_LOST_MESSAGES = ("Connection reset by peer", "Connection closed by peer", "Socket closed",
                      "remote process exited", "coordination service", "Broken pipe",
                      "CoordinationServiceError", "heartbeat timeout")


def peer_lost(e: BaseException) -> bool:
  """Whether `e` (or what it was raised from) says another process of the run is gone."""
  return any(any(m in str(x) for m in PEER_LOST_MESSAGES) for x in causes(e))


def storage_cause(e: BaseException) -> str | None:
  """The storage failure behind `e` (disk full, read-only, ...) as its OS text, or None.

  Follows `__cause__` / `__context__`, since libraries re-raise OS errors under other types.
  """
  for x in causes(e):
    if isinstance(x, OSError) and x.errno in STORAGE_ERRNOS:
      return x.strerror or errno.errorcode.get(x.errno, str(x.errno))
    text = str(x)
    for message in STORAGE_MESSAGES:
      if message in text:
        return message
    if isinstance(x, OSError) and SHORT_WRITE.search(text):
      return SHORT_WRITE_CAUSE
  return None


def storage_advice(cause: str, elsewhere: str = "pass another --workdir") -> str:
  """What frees a storage failure `cause` (`storage_cause`'s text): space for a full disk or
  quota, the limit for a file too large, write permission for a read-only or unwritable
  folder, the disk itself for an I/O error; `elsewhere` ('' for none) is the way around it."""
  alternative = f" (or {elsewhere})" if elsewhere else ""
  if cause in _FULL:
    return f"free space on that disk{alternative}"
  if cause == "File too large":
    return "lift the file-size limit (ulimit -f)"
  if cause in _NOT_WRITABLE:
    return f"make it writable{alternative}"
  return f"check the disk{alternative}"


def first_line(e: BaseException) -> str:
  """`TypeName: first line of the message` (some libraries put the reason on a later line:
  the first non-empty line that is not only a heading ending with ':' is taken)."""
  return _headline(type(e).__name__, str(e))


def _headline(name: str, message: str) -> str:
  """`name: ` and the first informative line of `message` (`first_line`)."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  informative = [line for line in lines if not line.endswith(":")]
  text = (informative or lines or [""])[0]
  return f"{name}: {text}" if text else name


# Where libraries and Python itself live: a frame there is not the user's code (nor ours).
_LIBRARY_DIRS = tuple(sorted({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                              for k in ("stdlib", "platstdlib", "purelib", "platlib")}))
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')


def _in_library(path: str) -> bool:
  return os.path.realpath(path).startswith(_LIBRARY_DIRS) or path.startswith("<")


def code_origin(e: BaseException) -> tuple[str, str | None]:
  """(`TypeName: first line`, 'file:line') of the error a run's code raised behind `e`.

  A method's exception inside a host callback reaches the run as JAX's runtime error whose text
  embeds the callback's traceback: the embedded exception and its innermost frame outside the
  libraries are taken from there. Otherwise the innermost frame of `e`'s traceback outside the
  libraries (the method's file, or olora_jax's own) is named; None when every frame is a
  library's."""
  for x in causes(e):
    lines = str(x).splitlines()
    if not any("Traceback (most recent call last)" in line for line in lines):
      continue
    frames = [(i, m.group(1), m.group(2)) for i, m in enumerate(map(_FRAME.match, lines)) if m]
    own = [f"{path}:{line}" for _, path, line in frames if not _in_library(path)]
    # The embedded exception: from the first unindented line after the last frame (its message
    # may span lines; the first is its type and first line).
    after = frames[-1][0] + 1 if frames else 0
    raised = [i for i in range(after, len(lines)) if lines[i].strip()
              and not lines[i].startswith(" ")]
    if own and raised:
      name, _, message = lines[raised[0]].partition(":")
      return _headline(name.strip(), "\n".join([message, *lines[raised[0] + 1:]])), own[-1]
  frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
  own = [f"{f.filename}:{f.lineno}" for f in frames if not _in_library(f.filename)]
  return first_line(e), (own[-1] if own else None)


_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep  # olora_jax's own code


def unexpected(e: BaseException, resume: str = "") -> str:
  """The line of an unexpected error (exit 1): the exception and the file and line that raised
  it (`code_origin`). Raised in olora_jax (or nowhere but in libraries): a bug to report. Raised
  in code outside the package (a method or dataset of the user's): the place to fix. `resume`
  ('from checkpoint 12', 'from the start'; '' before a run exists) says where a rerun starts."""
  what, where = code_origin(e)
  at = f" (raised at {where})" if where else ""
  if where is None or os.path.realpath(where.rpartition(":")[0]).startswith(_PACKAGE_DIR):
    return (f"unexpected {what}{at}; " + (f"the run can resume {resume}; " if resume else "")
            + "please report it with the error log")
  return (f"{what}{at}; fix the code there, then run the same command"
          + (f" to resume {resume}" if resume else ""))
