"""What the step-for-step checks against the authors' recordings share (tests/test_parity_*.py):
our command-line run of a recording (its stream manifest, the authors' replay draws and the
recording's settings) and the comparison of a per-step quantity with theirs, relative to how far
their own code drifts from itself when its initial weights move at float32 rounding ("own drift",
the largest over their perturbed reruns; docs/parity.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tiny_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
import aml  # noqa: E402 (the AML driver: the command line of a recording's settings)

EXACT_STEPS = 3  # the first steps, before float32 rounding has grown: held to their own drift
EXACT_RTOL = 1e-6  # plus twice their own drift at those steps
DRIFT_FACTOR = 2.5  # the median and the largest over all steps, against their own drift's


def run_ours(rec: dict, folder: Path) -> tuple[Path, list[dict]]:
  """launch/run.py on the recording's stream with its draws (if it has any) and its settings,
  figures and checkpoints off, at the session's level for a convolutional network
  (tiny_run.convolution_level_env): (workdir, the train events of metrics.jsonl)."""
  manifest = folder / "manifest.json"
  manifest.write_text(json.dumps(rec["manifest"]))
  given = []
  if "draws" in rec:
    draws = folder / "draws.json"
    draws.write_text(json.dumps(rec["draws"]))
    given = [f"--config.data.replay_draws={draws}"]
  workdir = folder / "run"
  done = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "run.py"), "--config", str(ROOT / "configs" /
       "demo.py"), "--workdir", str(workdir), *aml.command_line(rec["overrides"]),
       f"--config.data.stream_manifest={manifest}", *given,
       "--config.eval.write_plots=False", "--config.checkpoint_every=0"],
      capture_output=True, text=True, cwd=ROOT, env=tiny_run.convolution_level_env())
  assert done.returncode == 0, done.stderr[-2000:]
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return workdir, [x for x in lines if x.get("event") == "train"]


def assert_within_own_drift(ours, theirs, own, what: str,
                            exact: int | Sequence[int] = EXACT_STEPS) -> np.ndarray:
  """Over the steps where theirs is defined (not NaN): the relative difference at each step of
  `exact` (the first `exact` steps, or those listed) within EXACT_RTOL + 2 x their own drift
  there, and its median and maximum over the steps within DRIFT_FACTOR x their own drift's.
  `own`: their perturbed reruns, (runs, steps). Returns the relative differences."""
  ours, theirs, own = (np.asarray(x, np.float64) for x in (ours, theirs, own))
  assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
  keep = ~np.isnan(theirs)
  drift = np.abs(ours[keep] - theirs[keep]) / np.abs(theirs[keep])
  own_drift = (np.abs(own[:, keep] - theirs[keep]) / np.abs(theirs[keep])).max(axis=0)
  first = list(range(exact)) if isinstance(exact, int) else list(exact)
  assert (drift[first] <= EXACT_RTOL + 2 * own_drift[first]).all(), (
      what, drift[first], own_drift[first])
  assert np.median(drift) <= DRIFT_FACTOR * np.median(own_drift), (what, drift, own_drift)
  assert drift.max() <= DRIFT_FACTOR * own_drift.max(), (what, drift, own_drift)
  return drift
