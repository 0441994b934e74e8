"""The device check's `steps` part: launch/bench.py's step table, each (fidelity, dtype) case in
its own process of launch/bench.py, against the measured peak of its dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from olora_jax.benchmarks import ROOT
from olora_jax.benchmarks.device_runs import last_line, run_process

STEP_CASES = (("paper", "float32"), ("paper", "bfloat16"), ("reference", "float32"),
              ("reference", "bfloat16"))
DEFAULT_STEP_CASES = ",".join(f"{f}:{d}" for f, d in STEP_CASES)
# After them, if the part's share allows: the same step with model.scan_blocks (compile and step
# time beside the unrolled row of the same case).
SCANNED_STEP_CASES = (("paper", "float32"),)


def step_cases(text: str) -> list[tuple[str, str]]:
  """--step_cases's 'fidelity:dtype,...' as (fidelity, dtype) pairs in the order given, each one
  of STEP_CASES at most once; SystemExit in one line otherwise."""
  cases = [tuple(c.split(":", 1)) for c in text.split(",") if c]
  if not cases or any(c not in STEP_CASES for c in cases) or len(set(cases)) < len(cases):
    raise SystemExit(f"error: --step_cases={text!r}: use a comma-separated list of"
                     f" {DEFAULT_STEP_CASES.split(',')}, each at most once")
  return cases


def run_steps(args: argparse.Namespace, seconds: float, peaks: dict) -> list[dict]:
  """Each (fidelity, dtype) case of --step_cases (STEP_CASES by default) in its own process of
  launch/bench.py, against the peak of its dtype, until the part's share is spent."""
  from olora_jax.data import synthetic

  deadline = time.monotonic() + seconds
  dataset = synthetic.name(max(1000, args.batch_size * (args.warmup + args.steps + 2)), 100, 10)
  rows = []
  cases = [(f, d, False) for f, d in step_cases(args.step_cases)]
  cases += [(f, d, True) for f, d in SCANNED_STEP_CASES] if args.scanned_steps else []
  for fidelity, dtype, scan in cases:
    left = deadline - time.monotonic()
    case = {"size": args.size, "fidelity": fidelity, "compute_dtype": dtype, "scan_blocks": scan}
    if left < 5:
      rows.append({**case, "skipped": "budget spent"})
      continue
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "row.json")
      done = run_process([sys.executable, str(ROOT / "launch" / "bench.py"),
                          f"--sizes={args.size}", f"--fidelities={fidelity}",
                          f"--compute_dtypes={dtype}", f"--batch_size={args.batch_size}",
                          f"--steps={args.steps}", f"--warmup={args.warmup}",
                          f"--peak_gflops={peaks[dtype] / 1e9!r}", f"--dataset={dataset}",
                          f"--compilation_cache={args.compilation_cache or 'off'}",
                          *(["--scan_blocks"] if scan else []), f"--out={out}"], left)
      if done["rc"] == 0:
        with open(out) as f:
          (row,) = json.load(f)
        rows.append(row)
      else:
        rows.append({**case, "error": f"exit {done['rc']}: {last_line(done)}"})
    print(f"steps {args.size} {fidelity} {dtype}{' scanned' if scan else ''}: "
          + (f"{rows[-1]['step_ms_median']:.1f} ms" if "step_ms_median" in rows[-1]
             else rows[-1].get("error") or rows[-1].get("skipped")), flush=True)
  return rows

