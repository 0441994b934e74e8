"""The workdir as one run's property: an exclusive lock, a verified run log, a finished state.

- `WorkdirLock`: OS advisory locks (`flock`) on `DIR/.lock` and on DIR itself, held for the
  whole run. The kernel releases them when the process ends, however it ends (SIGKILL
  included), so a stale lock never blocks a rerun; a second process on the same DIR is refused
  at once, naming the holder's pid and host, even after the holder's `.lock` was removed. A run
  that ends removes its `.lock`; one killed leaves it, naming a dead pid, and the next run takes
  it over. (`flock` on network file systems is only as good as the file system's support.)
- `verify_run_log`: before a resume, metrics.jsonl must still be what the checkpoint recorded
  (its first `n` bytes and their SHA-256): a truncated, edited or deleted log is never silently
  padded or continued with steps missing. `restore_run_log` rebuilds it from the copy the
  checkpoint carries, and says so; only a checkpoint without a copy refuses.
- `missing_plots`: a run killed after results.json but before its figures gets them on rerun.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket

from olora_jax import errors

LOCK_FILE = ".lock"
RUN_LOG = "metrics.jsonl"


def _not_writable(workdir: str, e: OSError) -> errors.EnvironmentFailure:
  cause = errors.storage_cause(e) or e.strerror or str(e)
  return errors.EnvironmentFailure(
      f"workdir {workdir!r} cannot be written ({cause}); {errors.storage_advice(cause)}, then"
      " run the same command")


def check_is_directory(workdir: str) -> None:
  """Refuses a workdir path that exists but is not a directory (before anything is written)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.BadInput(f"--workdir={workdir!r} is a file, not a directory; pass a directory"
                          " path (it is created if missing)")


class WorkdirLock:
  """`with WorkdirLock(workdir):` creates `workdir` if needed and holds its lock.

  Two OS locks (`flock`), both released by the kernel when the process ends, however it ends:
  one on `DIR/.lock`, which names the holder (pid, host, start) for a second run's refusal, and
  one on the directory DIR itself, which a removed or replaced `.lock` cannot take away (a run
  that finds the directory held while the `.lock` it locked is free is refused too, and told that
  the holder's `.lock` was removed). Where the file system cannot lock a directory (some network
  file systems), the `.lock` file's lock alone holds. After the lock on `.lock` is taken, the
  file locked must still be the one at `DIR/.lock` (not one a finishing run just removed); only
  then is the run's line written. At the end the run removes its `.lock` while it still holds it,
  so a finished workdir keeps none. A `.lock` removed or replaced while the run held it is said
  at the end, in one warning (the directory's lock kept other runs out meanwhile) or, where the
  directory could not be locked, as an `EnvironmentFailure` (another run may have written DIR).

  Raises `errors.WorkdirBusy` when another live process holds it, `errors.BadInput` when
  `DIR/.lock` is a directory, `errors.EnvironmentFailure` when the directory or its lock file
  cannot be created or written (naming `.lock` when DIR itself can be written).
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: int | None = None
    self._dir_fd: int | None = None

  def __enter__(self) -> WorkdirLock:
    check_is_directory(self.workdir)
    self._made = not os.path.exists(self.workdir)
    try:
      os.makedirs(self.workdir, exist_ok=True)
    except OSError as e:
      raise _not_writable(self.workdir, e) from e
    while True:
      fd = self._open()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise errors.WorkdirBusy(
              f"workdir {self.workdir!r} is in use by {holder}; wait for that run to end (or"
              " stop it), or pass another --workdir") from e
        raise _not_writable(self.workdir, e) from e
      if self._at_path(fd):
        break
      os.close(fd)  # a finishing run removed the file just locked: lock the one there now
    self._lock_directory(fd)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} (since {started})\n"
                .encode(), 0)
    except OSError as e:
      self._fd = fd
      self._release()
      raise self._lock_file_failure(e) from e
    self._fd = fd
    return self

  def _open(self) -> int:
    """Opens (creating) `DIR/.lock` for writing; its failures named as the lock file's when
    DIR itself can be written, as DIR's otherwise."""
    try:
      return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      if os.path.isdir(self.path):
        raise errors.BadInput(
            f"{self.path} is a directory, where the workdir's lock file goes; remove it (rmdir"
            f" {self.path!r}, after moving out anything in it) and run the same command") from e
      raise self._lock_file_failure(e) from e

  def _lock_file_failure(self, e: OSError) -> errors.EnvironmentFailure:
    if not os.access(self.workdir, os.W_OK) or errors.storage_cause(e) not in (
        "Permission denied", "Operation not permitted"):
      return _not_writable(self.workdir, e)
    failure = errors.EnvironmentFailure(
        f"the workdir's lock file {self.path} cannot be written ({e.strerror}): it is read-only"
        f" or immutable; make it writable (chmod u+w {self.path!r}; chattr -i for an immutable"
        " file) or delete it, then run the same command")
    failure.write_log = False  # the line says it all; the workdir gets no error.log
    return failure

  def _at_path(self, fd: int) -> bool:
    """Whether the file open as `fd` is the one at `DIR/.lock` now."""
    try:
      here = os.stat(self.path)
    except FileNotFoundError:
      return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)

  def _lock_directory(self, fd: int) -> None:
    """Takes the lock on DIR itself (see the class), where the file system can lock a directory.
    Held by another run: that run's `.lock` was removed, and this one is refused."""
    try:
      dir_fd = os.open(self.workdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
      return
    try:
      fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(dir_fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return  # a directory this file system cannot lock: the .lock file's lock holds alone
      with contextlib.suppress(OSError):  # the lock file this refused run made goes with it
        os.remove(self.path)
      os.close(fd)
      raise errors.WorkdirBusy(
          f"workdir {self.workdir!r} is in use by another run, whose {self.path} was removed"
          " while it ran; wait for that run to end (or stop it), or pass another --workdir"
          ) from e
    self._dir_fd = dir_fd

  def _release(self) -> str:
    """Gives the locks back: the directory's first, then `.lock` is removed while still held
    (a run waiting on it then locks a removed file, sees so, and locks the next one). Returns
    '' or what became of `.lock` while the run held it ('removed', 'replaced by another
    file'), in which case the file at `DIR/.lock` now is left alone."""
    fd, self._fd = self._fd, None
    if self._dir_fd is not None:
      os.close(self._dir_fd)
      self._dir_fd = None
    lost = ""
    if not self._at_path(fd):
      lost = "replaced by another file" if os.path.lexists(self.path) else "removed"
    else:
      with contextlib.suppress(OSError):
        os.remove(self.path)
    os.close(fd)  # closing the descriptor releases the lock
    return lost

  def __exit__(self, *exc) -> None:
    if self._fd is None:
      return
    guarded = self._dir_fd is not None
    lost = self._release()
    # A run refused before it wrote anything leaves no workdir it made.
    if exc[0] is not None and self._made:
      with contextlib.suppress(OSError):
        os.rmdir(self.workdir)  # only if empty
    if not lost:
      return
    if guarded:  # the directory's lock kept other runs out: the run's files are its own
      logging.warning("%s was %s while this run held it; the workdir's own lock kept other"
                      " runs out meanwhile, so this run's files are its own", self.path, lost)
      return
    if exc[0] is None:
      raise errors.EnvironmentFailure(
          f"{self.path} was {lost} while this run held it, and this file system cannot lock the"
          f" directory itself, so another run may have written {self.workdir!r} meanwhile;"
          " check that no other run uses it, then run the same command (or pass a new"
          " --workdir)")
    logging.warning("%s was %s while this run held it: another run may have written %s"
                    " meanwhile", self.path, lost, self.workdir)


def file_digest(path: str, nbytes: int) -> str:
  """SHA-256 of the first `nbytes` bytes of `path`."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    left = nbytes
    while left > 0:
      chunk = f.read(min(left, 1 << 20))
      if not chunk:
        break
      h.update(chunk)
      left -= len(chunk)
  return h.hexdigest()


def verify_run_log(workdir: str, nbytes: int, sha256: str, checkpoint_step: int) -> None:
  """Refuses a resume whose metrics.jsonl is not what checkpoint `checkpoint_step` recorded:
  missing (while the checkpoint recorded lines), shorter, or with different first `nbytes` bytes
  (`sha256` is empty for checkpoints written before the digest was recorded)."""
  path = os.path.join(workdir, RUN_LOG)
  ways_out = (f"restore {path} as it was, or start over: pass a new --workdir (or delete"
              f" {os.path.join(workdir, 'checkpoints')})")
  if not os.path.exists(path):
    if nbytes:
      raise errors.BadInput(f"{path} is missing but checkpoint {checkpoint_step} recorded"
                            f" {nbytes} bytes of it, so the early steps would be lost; {ways_out}")
    return
  size = os.path.getsize(path)
  if size < nbytes:
    raise errors.BadInput(f"{path} has {size} bytes but checkpoint {checkpoint_step} recorded"
                          f" {nbytes} (truncated?); {ways_out}")
  if sha256 and file_digest(path, nbytes) != sha256:
    raise errors.BadInput(f"the first {nbytes} bytes of {path} differ from what checkpoint"
                          f" {checkpoint_step} recorded (edited?); {ways_out}")


def restore_run_log(workdir: str, nbytes: int, sha256: str, copy: str | None,
                    checkpoint_step: int, finished: bool = False) -> str | None:
  """Makes metrics.jsonl's first `nbytes` bytes what checkpoint `checkpoint_step` recorded: when
  the file is missing, shorter or different there, it is rebuilt from `copy` (the log's text
  the checkpoint carries, checked against `sha256`), and the line saying what was done is
  returned (None when the file was intact). `finished`: the final checkpoint of a finished run,
  whose log ends there (lines added after it are dropped, and said). Without a usable copy
  (checkpoints older than the copy), `verify_run_log`'s refusal."""
  path = os.path.join(workdir, RUN_LOG)
  try:
    verify_run_log(workdir, nbytes, sha256, checkpoint_step)
    if finished and os.path.getsize(path) > nbytes:
      extra = os.path.getsize(path) - nbytes
      os.truncate(path, nbytes)
      return (f"{path} had {extra} bytes after the end of the finished run (edited?); cut it"
              f" back to the {nbytes} bytes its final checkpoint {checkpoint_step} recorded")
    return None
  except errors.BadInput as damage:
    data = None if copy is None else copy.encode()
    if data is None or len(data) != nbytes or hashlib.sha256(data).hexdigest() != sha256:
      raise
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
    found = str(damage).split(";")[0]
    return (f"{found}; rebuilt its first {nbytes} bytes from the copy checkpoint"
            f" {checkpoint_step} keeps")


def finished_at(workdir: str) -> str:
  """When results.json was written, as local ISO time."""
  mtime = os.path.getmtime(os.path.join(workdir, "results.json"))
  return datetime.datetime.fromtimestamp(mtime).astimezone().isoformat(timespec="seconds")


def missing_plots(workdir: str, plot_files: tuple[str, ...]) -> list[str]:
  return [f for f in plot_files if not os.path.exists(os.path.join(workdir, "plots", f))]


def write_json(path: str, obj) -> None:
  """`obj` as JSON at `path`, whole or not at all (a reader never sees half a file)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)  # atomic: a reader never sees half a file
