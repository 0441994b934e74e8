"""Loss window and plateau/peak rule (paper section 3.2, appendix "loss surface").

A host-side state record with pure `init` / `update`, in the style of optax's
`reduce_on_plateau`. Every step the learner appends one value (the pre-update, pre-regulariser
loss: CE(current batch) + CE(hard buffer), the buffer term a mean in `paper` fidelity or a sum of
K batch CEs in `reference`, see `learner.window_value`) and asks whether the loss surface is on a
plateau:

    window  = the last `window` values
    mean, var = mean and population variance (ddof 0) of the window, in float32
    peak    : after a plateau fired, a new one may fire only once the window mean exceeds
              (mean at the last plateau) + sqrt(variance at the last plateau); evaluated before
              the plateau check in the same step. Initially a peak counts as seen.
    plateau : mean < mean_threshold and var < var_threshold and a peak was seen since the last
              plateau, and (unless `check_partial_window`) the window is full.

The window is not cleared at a plateau: the peak rule alone keeps one plateau from firing twice.
The detector is *armed* while a peak has been seen since the last plateau (`armed` in
`WindowStats`, at the step's plateau check): a plateau disarms it, a peak re-arms it (`rearmed`;
the run log's `rearm` event), possibly in the step that fires the next plateau.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class PlateauConfig:
  """Hyperparameters of the plateau rule, validated on construction: the window length, the
  mean and variance thresholds, and whether partial windows are checked (`reference`)."""

  window: int = 5
  mean_threshold: float = 2.6
  var_threshold: float = 0.03
  check_partial_window: bool = False  # `reference` fidelity checks from step 1 (a 1-value window)

  def __post_init__(self):
    if self.window < 1:
      raise ValueError(f"learner.window={self.window} must be >= 1 (the paper uses 5)")
    if not self.mean_threshold > 0:
      raise ValueError(f"learner.mean_threshold={self.mean_threshold} must be > 0")
    if not self.var_threshold > 0:
      raise ValueError(f"learner.var_threshold={self.var_threshold} must be > 0")


class PlateauState(NamedTuple):
  """The detector's host state: the loss window, the peak flag, the window mean and variance at
  the last plateau, and the number of plateaus. Immutable; `update` returns a new one."""

  values: tuple[float, ...]  # the loss window, oldest first, at most `window` values
  peak_seen: bool
  last_mean: float  # window mean at the last plateau (nan before the first)
  last_var: float  # window variance at the last plateau (nan before the first)
  n_plateaus: int


class WindowStats(NamedTuple):
  mean: float
  var: float
  fired: bool
  # Whether the detector was armed at this step's plateau check (a peak seen since the last
  # plateau, this step's included: a plateau could fire), and whether this step's peak re-armed
  # it (disarmed since the last plateau until now). A plateau disarms it for the next steps.
  armed: bool = True
  rearmed: bool = False


def init() -> PlateauState:
  """The detector before the first step: an empty window, a peak counted as seen."""
  return PlateauState(values=(), peak_seen=True, last_mean=float("nan"),
                      last_var=float("nan"), n_plateaus=0)


def update(state: PlateauState, value: float,
           config: PlateauConfig) -> tuple[PlateauState, WindowStats]:
  """Appends `value` (a float, the step's loss-window value) to the window; returns the new
  state and the window's mean, variance and whether a plateau fired. Pure (host, NumPy)."""
  values = (state.values + (float(value),))[-config.window:]
  window = np.asarray(values, np.float32)
  mean = window.mean(dtype=np.float32)
  var = np.mean(np.square(window - mean), dtype=np.float32)

  peak_seen = state.peak_seen
  if not peak_seen and mean > np.float32(state.last_mean) + np.sqrt(np.float32(state.last_var)):
    peak_seen = True

  full = len(values) == config.window
  fired = bool((full or config.check_partial_window) and peak_seen
               and mean < config.mean_threshold and var < config.var_threshold)
  rearmed = peak_seen and not state.peak_seen
  if fired:
    state = PlateauState(values, False, float(mean), float(var), state.n_plateaus + 1)
  else:
    state = state._replace(values=values, peak_seen=peak_seen)
  return state, WindowStats(float(mean), float(var), fired, peak_seen, rearmed)


def to_json(state: PlateauState) -> dict:
  """The detector's state as a JSON record (checkpointed with the run's progress)."""
  d = state._asdict()
  d["values"] = list(state.values)
  return d


def from_json(d: dict) -> PlateauState:
  d = dict(d)
  d["values"] = tuple(float(v) for v in d["values"])
  return PlateauState(**d)


def rearm_event(stats: WindowStats, before: PlateauState) -> tuple[str, dict]:
  """The run log's `rearm` event of a step whose peak re-armed the detector (`before`: the
  detector before the step): the window mean that passed the bar, the bar (mean + sqrt(variance)
  at the last plateau) and the plateaus so far."""
  bar = np.float32(before.last_mean) + np.sqrt(np.float32(before.last_var))
  return ("rearm", dict(window_mean=stats.mean, bar=float(bar), n_plateaus=before.n_plateaus))
