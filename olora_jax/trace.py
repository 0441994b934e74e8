"""Per-step traces of a run: `trace.enabled=True` writes WORKDIR/trace.npz.

What a trace holds (T = steps run, P = plateaus, K = buffer size, B = batch size):

    step              (T,)  int64    stream step
    window_value      (T,)  float32  the loss-window value of the step (pre-update, no regulariser)
    window_mean       (T,)  float32  window mean after appending it (nan without incremental LoRA)
    window_var        (T,)  float32  window population variance (nan likewise)
    reg               (T,)  float32  L_LoRA, the regulariser
    loss              (T,)  float32  window_value + reg, the objective
    ce_current        (T,)  float32  CE of the current batch
    ce_buffer         (T,)  float32  CE of the hard buffer (mean or sum, learner.window_value)
    plateau           (T,)  bool     a plateau fired at this step
    armed             (T,)  bool     the plateau detector was armed at the step's plateau check
                                     (a peak seen since the last plateau, this step's included:
                                     a plateau could fire); a plateau disarms it for the next steps
    rearmed           (T,)  bool     a peak re-armed it at this step (the run log's `rearm`)
    buffer_ids        (T, K) int64   example ids (the stream manifest's ids) in the hard buffer
                                     after the step's update, hardest first; (T, K, B) when
                                     learner.buffer_unit='batch'; -1 = empty slot or padding
    buffer_scores     (T, K) float32 the pre-update loss that ranked each entry (nan = empty)
    plateau_step      (P,)  int64    the steps at which plateaus fired
    omega/<path>      (P, ...)       Omega after each plateau's running mean, one array per LoRA
                                     leaf, e.g. omega/encoderblock_0/query/lora_a (P, D, r)
    merged_lora/<path> (P, ...)      the LoRA factors merged at each plateau
    frozen_lora/<path> (P, ...)      `factor_sum` merge only: the frozen pair after the merge

The buffer's ids are followed on the host: the learner's buffer holds images, labels and a mask
only (it is task-free, and ids would change nothing it computes), so the trace applies the same
`top_k_later_wins` ranking to the same pre-update scores and keeps the ids beside it. Nothing
the learner computes changes when tracing is on. When it is off, `make_trace` returns a
`NullTrace` whose methods do nothing: no extra device-to-host transfer, no file.

The file is written atomically at every checkpoint and at the end; a resumed run reads it back,
drops the steps after the checkpoint it resumes from, and goes on.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from olora_jax import errors
from olora_jax.data.streams import Stream
from olora_jax.learner import buffer as buffer_lib

FILENAME = "trace.npz"

_STEP_SCALARS = ("window_value", "reg", "loss", "ce_current", "ce_buffer")
_STEP_ARRAYS = (*_STEP_SCALARS, "step", "plateau", "armed", "rearmed", "window_mean",
                "window_var", "buffer_ids", "buffer_scores")


class NullTrace:
  """Tracing off: every method is a no-op."""

  enabled = False

  def fetch(self, tree):
    return None

  def record_step(self, step, scalars, stats, scores, buffer_updated) -> None:
    pass

  def record_plateau(self, step, merged_lora, omega, frozen_lora) -> None:
    pass

  def save(self) -> None:
    pass


def _flatten(tree, prefix: str) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {prefix + "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
          for path, v in leaves}


class StepTrace:
  """Records every step of a run into `path` (see the module docstring for the arrays).

  `stream` and `record_ids` ((N,) the training source's example ids) name each step's examples;
  `buffer_unit`, `buffer_size` and `batch_size` shape the buffer mirror. `cursor` > 0 resumes:
  the records of steps >= cursor are dropped and the buffer mirror restored from step cursor - 1.
  """

  enabled = True

  def __init__(self, path: str, stream: Stream, record_ids: np.ndarray, buffer_unit: str,
               buffer_size: int, batch_size: int, cursor: int = 0):
    self.path, self.stream, self.batch_size = path, stream, batch_size
    self.record_ids = np.asarray(record_ids, np.int64)
    self.batch_unit = buffer_unit == "batch"
    entry_shape = (buffer_size, batch_size) if self.batch_unit else (buffer_size,)
    self.ids = np.full(entry_shape, -1, np.int64)  # the mirror of the device buffer
    self.valid = np.zeros(buffer_size, bool)
    self.steps: list[dict] = []
    self.plateaus: list[dict] = []
    self._top_k = jax.jit(buffer_lib.top_k_later_wins, static_argnums=2)
    if cursor:
      self._resume(cursor)

  def _resume(self, cursor: int) -> None:
    if not os.path.exists(self.path):
      raise errors.BadInput(
          f"resuming at step {cursor} with trace.enabled=True but {self.path} is missing; start"
          " the run in a new --workdir")
    with np.load(self.path, allow_pickle=False) as z:
      arrays = {k: z[k] for k in z.files}
    keep = arrays["step"] < cursor
    if not keep.any() or arrays["step"][keep][-1] != cursor - 1:
      raise errors.BadInput(f"{self.path} does not reach step {cursor - 1}, where the checkpoint"
                            " resumes; start the run in a new --workdir")
    for i in np.flatnonzero(keep):  # (a trace written before `armed` was: armed, not re-armed)
      self.steps.append({k: arrays[k][i] if k in arrays else np.bool_(k == "armed")
                         for k in _STEP_ARRAYS})
    plateau_keep = arrays["plateau_step"] < cursor
    plateau_keys = [k for k in arrays if k.startswith(("omega/", "merged_lora/", "frozen_lora/"))]
    for i in np.flatnonzero(plateau_keep):
      self.plateaus.append({"plateau_step": arrays["plateau_step"][i],
                            **{k: arrays[k][i] for k in plateau_keys}})
    self.ids = self.steps[-1]["buffer_ids"].copy()
    if len(self.valid):  # an entry is valid iff it holds an example (padding is never valid)
      self.valid = (self.ids >= 0).reshape(len(self.valid), -1).any(axis=1)

  def fetch(self, tree):
    """A host copy of `tree` (e.g. the LoRA about to be merged; consolidate donates it)."""
    return jax.device_get(tree)

  def _step_ids(self, step: int) -> np.ndarray:
    ids = np.full(self.batch_size, -1, np.int64)
    rows = self.stream.steps[step]
    ids[:len(rows)] = self.record_ids[rows]
    return ids

  def record_step(self, step: int, scalars: dict, stats, scores, buffer_updated: bool) -> None:
    """After the step's buffer update. `scores` are the train step's pre-update candidate
    scores on the device ((B + K,) or (1 + K,)); `buffer_updated` False leaves the buffer."""
    entry_scores = np.full(len(self.valid), np.nan, np.float32)
    if len(self.valid):
      batch_ids = self._step_ids(step)
      scores = np.asarray(jax.device_get(scores), np.float32)
      if self.batch_unit:
        cand_ids = np.concatenate([batch_ids[None], self.ids])
        cand_valid = np.concatenate([[bool((batch_ids >= 0).any())], self.valid])
      else:
        cand_ids = np.concatenate([batch_ids, self.ids])
        cand_valid = np.concatenate([batch_ids >= 0, self.valid])
      if buffer_updated:
        idx = np.asarray(self._top_k(scores, cand_valid, len(self.valid)))
        self.ids, self.valid = cand_ids[idx], cand_valid[idx]
        self.ids[~self.valid] = -1
        entry_scores = scores[idx]
      else:  # the buffer stays: its entries' own scores follow the batch's candidates
        entry_scores = scores[1 if self.batch_unit else self.batch_size:]
      entry_scores = np.where(self.valid, entry_scores, np.nan).astype(np.float32)
    nan = np.float32(np.nan)
    record = {k: np.float32(scalars[k]) for k in _STEP_SCALARS}
    # A skipped step (no window value) leaves the detector as the step before left it.
    last = self.steps[-1] if self.steps else None
    armed = (stats.armed if stats is not None else
             True if last is None else bool(last["armed"] and not last["plateau"]))
    record.update(step=np.int64(step), plateau=np.bool_(stats is not None and stats.fired),
                  armed=np.bool_(armed), rearmed=np.bool_(stats is not None and stats.rearmed),
                  window_mean=nan if stats is None else np.float32(stats.mean),
                  window_var=nan if stats is None else np.float32(stats.var),
                  buffer_ids=self.ids.copy(), buffer_scores=entry_scores)
    self.steps.append(record)

  def record_plateau(self, step: int, merged_lora, omega, frozen_lora) -> None:
    """After `consolidate`: `merged_lora` from `fetch` before it, Omega and (factor_sum) the frozen
    pair after it."""
    record = {"plateau_step": np.int64(step), **_flatten(merged_lora, "merged_lora/"),
              **_flatten(jax.device_get(omega), "omega/")}
    if frozen_lora is not None:
      record.update(_flatten(jax.device_get(frozen_lora), "frozen_lora/"))
    self.plateaus.append(record)

  def arrays(self) -> dict[str, np.ndarray]:
    out = {k: np.stack([r[k] for r in self.steps]) for k in (self.steps[0] if self.steps else {})}
    if not self.steps:
      out["step"] = np.zeros(0, np.int64)
    out["plateau_step"] = np.array([r["plateau_step"] for r in self.plateaus], np.int64)
    for k in (self.plateaus[0] if self.plateaus else {}):
      if k != "plateau_step":
        out[k] = np.stack([r[k] for r in self.plateaus])
    return out

  def save(self) -> None:
    """Writes every record so far to `path`, atomically."""
    tmp = self.path + ".tmp"
    with open(tmp, "wb") as f:
      np.savez(f, **self.arrays())
    os.replace(tmp, self.path)


def make_trace(enabled: bool, workdir: str, stream: Stream, record_ids: np.ndarray,
               buffer_unit: str, buffer_size: int, batch_size: int,
               cursor: int = 0) -> StepTrace | NullTrace:
  """The run's trace: a `StepTrace` writing WORKDIR/trace.npz, or a `NullTrace` when off."""
  if not enabled:
    return NullTrace()
  return StepTrace(os.path.join(workdir, FILENAME), stream, record_ids, buffer_unit, buffer_size,
                   batch_size, cursor)
