"""launch/run.py's signal watcher, started before the run's slow imports (JAX, Flax, Orbax).

    watch     starts the thread; `STARTED` tells it when main() has begun

launch/run.py's first lines record SIGINT / SIGTERM in a list (`run_control.PENDING_SIGNALS`);
this module imports no JAX (olora_jax.errors alone: a few milliseconds), so the launcher imports
it and starts the watcher before anything slow.
"""

import os
import signal
import sys
import threading
import time

# The watcher's lines (olora_jax.errors imports no JAX), imported before it starts: it never
# imports anything itself, the imports may be what a signal interrupted.
from olora_jax import errors

# Python runs a handler only when the main thread is back in the interpreter: not inside a long
# device call (a refit of minutes) nor a slow C import. Python's C-level handler also writes
# each signal's number to a pipe at once (`watch`), and a thread that waits on it ends the process
# (128 + signal, one error line) on a signal during the imports or while the processes of a
# multi-process run join (`distributed.JOINING`), where nothing is written yet, and on a second
# signal later on, but never inside a checkpoint's save (the save ends first), nor at the second
# signal during the trackers' upload of a finished run (`loggers.UPLOADING`: the main thread
# stops it there, ending the tracker's run KILLED; a third signal ends the process at once).
STARTED = [False]  # main() has begun: a first signal is the loop's to act on


def _watch_signals(fd: int) -> None:
  count, first_at = 0, None
  while True:
    try:
      data = os.read(fd, 64)
    except OSError:
      return
    for signum in data:
      if signum not in (signal.SIGINT, signal.SIGTERM):
        continue
      now = time.monotonic()
      if first_at is not None and now - first_at < errors.SAME_STOP_SECONDS:
        continue  # the first stop delivered again (SLURM sends one stop twice)
      first_at = first_at if first_at is not None else now
      count += 1
      run_control = sys.modules.get("olora_jax.run_control")
      if run_control is not None and run_control.SAVING[0]:
        continue  # the save ends, then the loop stops
      loggers = sys.modules.get("olora_jax.loggers")
      if loggers is not None and loggers.UPLOADING[0] and count == 2:
        continue  # the trackers' upload stops itself, cleanly (a third signal: at once)
      distributed = sys.modules.get("olora_jax.distributed")
      if not STARTED[0] or (distributed is not None and distributed.JOINING[0]):
        message = errors.start_up_stop(signum)
      elif count >= 2:
        message = errors.second_signal_stop(signum)
      else:
        continue
      os.write(2, f"\nerror: {message}\n".encode())
      os._exit(128 + signum)


def watch() -> None:
  """Starts the watcher: Python's C-level handler writes each signal's number to a pipe, which
  the thread reads."""
  wake_read, wake_write = os.pipe()
  os.set_blocking(wake_write, False)
  signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
  threading.Thread(target=_watch_signals, args=(wake_read,), name="signals", daemon=True).start()
