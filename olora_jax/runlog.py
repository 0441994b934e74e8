"""The run's files: the append-only run log (metrics.jsonl) and whole-file JSON writes.

Every line of metrics.jsonl is one event with `step`, `samples_seen` and `event` (docs/metrics.md):
`train`, `plateau` (and a method's other events), `nonfinite_skipped`, `eval`, `task_end`.
"""

from __future__ import annotations

import hashlib
import json
import os

from olora_jax import errors, loggers
from olora_jax.protocol import jsonable
from olora_jax.workdir import write_json  # noqa: F401  (the run's JSON files)


class RunLogChanged(errors.EnvironmentFailure):
  """metrics.jsonl was changed under the running run (exit code 4)."""


class RunLog:
  """Append-only metrics.jsonl; every line has step, samples_seen and event. Numeric scalars are
  mirrored to the run's loggers when given (`loggers.Mirrors`: TensorBoard, W&B, MLflow;
  metrics.jsonl stays the source of truth).

  The log is the run's own: it keeps the size, file identity and SHA-256 of everything it wrote,
  and before each line (size and identity) and at each checkpoint (`text`: the whole content
  against the digest) checks that the file is still that, else `RunLogChanged` (exit 4) stops
  the run before anything else is written. A checkpoint records (size, digest) and a copy of
  the text, so a resume can verify the file and rebuild it (`workdir.restore_run_log`).
  """

  def __init__(self, path: str, scalars: loggers.Mirrors | None = None,
               truncate_to: int = 0):
    # On resume, drop the lines written after the checkpoint: they will be written again. The
    # first `truncate_to` bytes were verified against the checkpoint before this.
    self._digest = hashlib.sha256()
    if os.path.exists(path):
      os.truncate(path, truncate_to)
      with open(path, "rb") as f:
        self._digest.update(f.read())
    self.path = path
    self._file = open(path, "a")
    self._scalars = scalars
    self._size = os.fstat(self._file.fileno()).st_size
    self._inode = os.fstat(self._file.fileno()).st_ino

  def size(self) -> int:
    """Bytes written so far (every line is flushed)."""
    return self._size

  def _changed(self, found: str) -> RunLogChanged:
    return RunLogChanged(
        f"{self.path} was changed under the running run ({found}); nothing more was written."
        " Run the same command: it resumes from the newest checkpoint and rebuilds the log from"
        " the copy kept there")

  def _check_unchanged(self) -> None:
    try:
      st = os.stat(self.path)
    except FileNotFoundError:
      raise self._changed("deleted") from None
    if st.st_ino != self._inode:
      raise self._changed("replaced by another file")
    if st.st_size != self._size:
      raise self._changed(f"{st.st_size} bytes where the run wrote {self._size}")

  def text(self) -> str:
    """Everything written so far, read back and checked against the digest the log keeps."""
    self._check_unchanged()
    with open(self.path, "rb") as f:
      data = f.read()
    if len(data) != self._size or hashlib.sha256(data).hexdigest() != self.sha256():
      raise self._changed("its bytes differ from what the run wrote")
    return data.decode()

  def sha256(self) -> str:
    """SHA-256 of everything written so far."""
    return self._digest.hexdigest()

  def write(self, event: str, step: int, samples_seen: int, **values) -> None:
    record = {"step": int(step), "samples_seen": int(samples_seen), "event": event}
    record.update({k: jsonable(v) for k, v in values.items()})
    line = json.dumps(record) + "\n"
    self._check_unchanged()
    self._file.write(line)
    self._file.flush()
    self._digest.update(line.encode())
    self._size += len(line.encode())
    if self._scalars is not None:
      self._scalars.write(event, samples_seen, record)

  def close_file(self) -> None:
    """metrics.jsonl closed; its mirrors stay open for the run's results (`summarize`)."""
    self._file.close()

  def summarize(self, results: dict, workdir: str) -> None:
    """The finished run's results to its trackers (`loggers.Mirrors.summarize`)."""
    if self._scalars is not None:
      self._scalars.summarize(results, workdir)

  def close(self) -> None:
    self._file.close()
    if self._scalars is not None:
      self._scalars.close()


class NullLog:
  """The run log of a process that does not write the run's files (not process 0)."""

  def size(self) -> int:
    return 0

  def sha256(self) -> str:
    return hashlib.sha256().hexdigest()

  def text(self) -> str:
    return ""

  def write(self, event: str, step: int, samples_seen: int, **values) -> None:
    pass

  def close_file(self) -> None:
    pass

  def summarize(self, results: dict, workdir: str) -> None:
    pass

  def close(self) -> None:
    pass


def open_run_log(workdir: str, primary: bool, truncate_to: int, config=None
                 ) -> RunLog | NullLog:
  """The run log of this process: metrics.jsonl (with the loggers `config.loggers` names, see
  `olora_jax.loggers`; no config: TensorBoard) on process 0."""
  if not primary:
    return NullLog()
  return RunLog(os.path.join(workdir, "metrics.jsonl"), loggers.make_mirrors(workdir, config),
                truncate_to=truncate_to)




def read_json(path: str, fix: str):
  """A run file's JSON; a damaged file is bad input naming `fix`."""
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise errors.BadInput(f"{path} is damaged ({errors.first_line(e)}); {fix}") from None
