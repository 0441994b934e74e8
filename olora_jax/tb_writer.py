"""Optional TensorBoard scalars, written without TensorFlow through `tensorboardX` when installed.

metrics.jsonl stays the source of truth; the event files under `DIR/tensorboard/` are a view of
its numeric scalars for watching a run live. Tags are `EVENT/KEY` (e.g. `train/loss`,
`eval/anytime_accuracy`) and the TensorBoard step is the number of samples seen, the x axis of
the paper's anytime-accuracy plots. Without `tensorboardX` (`pip install tensorboardX`) nothing
is written and a run logs one line saying so.

The mirror can never block, slow or stop a run: records are written synchronously in the calling
thread (tensorboardX's own writer queues them to a thread that, once dead on a full disk, blocks
the next write forever), flushed at most every `FLUSH_SECONDS`, and the first error of any kind
(disk full, file-size limit, read-only directory) switches the mirror off with one warning.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import numbers
import os
import socket
import struct
import time

FLUSH_SECONDS = 5.0


class ScalarWriter:
  """Appends the finite numeric scalars of each metrics.jsonl record to a TensorBoard event file.

  The TFRecord framing (length, masked CRC32C of the length, data, masked CRC32C of the data)
  and the protos come from tensorboardX; the file is ours, so every failure is seen here.
  """

  def __init__(self, logdir: str):
    # Optional dependency, see the module docstring.
    from tensorboardX.proto import event_pb2, summary_pb2
    from tensorboardX.record_writer import masked_crc32c

    self._event_pb2, self._summary_pb2, self._crc = event_pb2, summary_pb2, masked_crc32c
    self._file = None
    self._last_flush = time.monotonic()
    try:
      os.makedirs(logdir, exist_ok=True)
      name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
      self._file = open(os.path.join(logdir, name), "ab")
      self._append(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  @property
  def active(self) -> bool:
    return self._file is not None

  def _append(self, event) -> None:
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    self._file.write(header + struct.pack("<I", self._crc(header)) + data
                     + struct.pack("<I", self._crc(data)))
    if time.monotonic() - self._last_flush > FLUSH_SECONDS:
      self._file.flush()
      self._last_flush = time.monotonic()

  def _switch_off(self, error: BaseException) -> None:
    logging.warning("TensorBoard mirror switched off (%s: %s); metrics.jsonl still has every"
                    " scalar", type(error).__name__, str(error).splitlines()[0] if str(error)
                    else "")
    file, self._file = self._file, None
    if file is not None:
      try:
        file.close()
      except Exception:  # the unflushed tail is lost; the run goes on
        pass

  def write(self, event: str, samples_seen: int, values: dict) -> None:
    if self._file is None:
      return
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=f"{event}/{key}", simple_value=float(v))
        for key, v in values.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)])
    if not summary.value:
      return
    try:
      self._append(self._event_pb2.Event(wall_time=time.time(), step=int(samples_seen),
                                         summary=summary))
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  def close(self) -> None:
    if self._file is None:
      return
    try:
      self._file.close()
      self._file = None
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)


def make_scalar_writer(logdir: str) -> ScalarWriter | None:
  """A writer into `logdir`, or None (with one log line) when tensorboardX is not installed."""
  if importlib.util.find_spec("tensorboardX") is None:
    logging.info("tensorboardX is not installed: no TensorBoard event files (metrics.jsonl has"
                 " every scalar); `pip install tensorboardX` to get them")
    return None
  return ScalarWriter(logdir)
