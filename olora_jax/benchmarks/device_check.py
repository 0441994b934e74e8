"""One command for a GPU lent for minutes: does the project run there, how fast, and do its
results agree with the CPU's?

    bash scripts/device_check.sh --out_dir DIR      # or: OUT=DIR bash scripts/device_check.sh

scripts/device_check.sh installs the wheels carried in `.whl/` (scripts/device_wheels.sh fetches
them) into a temporary directory, puts it and the repository on PYTHONPATH and runs
launch/device_check.py (this module's `main`) with the machine's python3; with the project
installed, `python launch/device_check.py` runs it directly. Everything happens inside a wall-time
budget (`--budget`, 540 s by default: one command of a 15-minute lease, which leaves about 10
minutes of commands): the parts share what is left in fixed proportions, in the order below, so
that what is cut first when time runs short is last (docs/performance.md lists it); a part that
outlasts its share is stopped and says so, and the next parts get the rest. It prints, and writes
as DIR/device_check.json and DIR/device_check.md:

  versions  Python, jax, jaxlib, flax, optax, orbax-checkpoint, numpy, torch and the device; with
            no GPU visible to JAX it stops at once with one `error:` line (exit 2), unless
            --allow_cpu (a rehearsal on a CPU)
  peaks     the measured matmul peak in float32 and bfloat16 (launch/bench.py, best of 10)
  demo      configs/demo.py end to end through launch/run.py on the device in `reference`
            fidelity (full float32 matmuls: model.matmul_precision=highest), then in `paper`
            fidelity (JAX's default precision: TF32 on a recent NVIDIA GPU), and with
            --demo_runs=...,paper_highest in `paper` with model.matmul_precision=highest, each
            beside the same run on this machine's CPU (JAX_PLATFORMS=cpu, run alongside),
            compared as docs/performance.md compares device layouts: the same plateau steps and
            task ends, accuracies equal within 1e-6 relative, train losses within 1e-5 relative
  stream    Split CIFAR-100's shape (launch/bench.py --suite accelerator's stream: 100 classes in
            10 tasks, 50,000 synthetic 32 px images resized on the device, a random frozen
            backbone of `--size`'s shape, configs/split_cifar100.py's batch, evaluation and
            checkpoint cadence) through launch/run.py in each of --stream_dtypes (float32, then
            bfloat16). The first is stopped with SIGTERM (it checkpoints and exits 143) once half
            the stream's checkpoints are written or 60% of its share is spent and it has
            trained a step (else it runs on to the end of its share), then the same
            command resumes it (the time to the restored state is measured) and runs on to the
            end or to the end of its share: its first process compiles with a cold persistent
            cache, the resumed one with a warm one. The others run in one process each. Each
            run's wall time is split into set-up, steps, evaluations, host wait, checkpoints and
            the rest, with the compilation inside them, and evaluation images/s; a stream that
            did not finish is extrapolated to its whole length from the measured rates (steps by
            the steady step time, evaluations by the test images the protocol evaluates,
            `protocol.evaluation_points`) and set beside the paper's 864.6 s on an A100 (the
            authors' code, real data and weights)
  steps     launch/bench.py's step table for `--size` (ViT-B/16 at 224 px) in both fidelities
            and both compute dtypes (--step_cases: which, in what order), at the paper's batch
            of 64, with % of the measured peak; then (--scanned_steps) `paper` float32 with
            model.scan_blocks
  torch     scripts/torch_step.py on the same device for the same step (`reference`, float32)

`--parts` picks parts; the flags below shrink each (the test suite rehearses the whole check on a
CPU with `--size tiny --allow_cpu` and a small stream).

This module is the check's command line; its parts are olora_jax.benchmarks' `device_runs` (the
budget, the processes), `device_demo`, `device_stream`, `device_steps` and `device_report`.
"""


from __future__ import annotations

import argparse
import os
import tempfile
import time

from olora_jax.benchmarks import ROOT
from olora_jax.benchmarks.device_demo import DEFAULT_DEMO_RUNS, DEMO_RUNS, run_demo
from olora_jax.benchmarks.device_report import report_text, write_report
from olora_jax.benchmarks.device_runs import PARTS, Budget, versions
from olora_jax.benchmarks.device_steps import DEFAULT_STEP_CASES, run_steps, step_cases
from olora_jax.benchmarks.device_stream import run_streams


def main(argv: list[str] | None = None) -> dict:
  """launch/device_check.py: `argv` (default: the command line) parsed and checked, every refusal
  a SystemExit with one `error: ...` line; then the parts within the budget, the report written
  after each part (DIR/device_check.json and .md) and printed at the end; returns the report."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.environ.get("OUT", ""),
                      help="where device_check.json and .md go (default: $OUT)")
  parser.add_argument("--budget", type=float, default=540.0,
                      help="wall seconds for the check (default 540: one command of a lease)")
  parser.add_argument("--parts", default=",".join(PARTS), help=f"of {','.join(PARTS)}")
  parser.add_argument("--allow_cpu", action="store_true",
                      help="run on a CPU too (a rehearsal); without it, no GPU stops the check")
  parser.add_argument("--demo_config", default=str(ROOT / "configs" / "demo.py"),
                      help="the stream compared on the device and the CPU")
  parser.add_argument("--demo_runs", default=DEFAULT_DEMO_RUNS,
                      help=f"of {','.join(r[0] for r in DEMO_RUNS)}")
  parser.add_argument("--compilation_cache", default="",
                      help="a persistent compilation cache for every run (default: fresh ones,"
                      " so first compiles are cold)")
  parser.add_argument("--size", default="vit_b16", help="the model of the steps and the stream")
  parser.add_argument("--batch_size", type=int, default=64, help="the step table's batch")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per step case")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
  parser.add_argument("--peak_n", type=int, default=0,
                      help="the matmul peak's matrices' side (default: bench.py's)")
  parser.add_argument("--step_cases", default=DEFAULT_STEP_CASES,
                      help="the step table's cases, fidelity:dtype, in the order they run (each"
                      " compiles for about two minutes at ViT-B/16 on an H200: name the ones a"
                      " short budget must reach)")
  parser.add_argument("--scanned_steps", type=int, default=1,
                      help="1: after the step table, the step once more with model.scan_blocks"
                      " (0: not)")
  parser.add_argument("--stream_dtypes", default="float32,bfloat16",
                      help="the stream's model.compute_dtype, one run each in this order; the"
                      " first is stopped half-way and resumed")
  parser.add_argument("--stream_train", type=int, default=50_000)
  parser.add_argument("--stream_test", type=int, default=10_000)
  parser.add_argument("--stream_classes", type=int, default=100)
  parser.add_argument("--stream_tasks", type=int, default=10)
  parser.add_argument("--stream_eval_every", type=int, default=0,
                      help="default: the setting's (1,000 samples)")
  parser.add_argument("--stream_checkpoint_every", type=int, default=0,
                      help="default: the setting's (200 steps); the stream is stopped and"
                      " resumed once a checkpoint half-way exists")
  args = parser.parse_args(argv)
  parts = [p for p in args.parts.split(",") if p]
  if not args.out_dir:
    raise SystemExit("error: no output directory: pass --out_dir DIR or set OUT=DIR")
  if not os.path.isdir(args.out_dir):
    raise SystemExit(f"error: --out_dir={args.out_dir!r} is not a directory: create it first")
  if not parts or any(p not in PARTS for p in parts):
    raise SystemExit(f"error: --parts={args.parts!r}: use a comma-separated list of {PARTS}")
  demo_runs = args.demo_runs.split(",")
  if not demo_runs or any(r not in [d[0] for d in DEMO_RUNS] for r in demo_runs):
    raise SystemExit(f"error: --demo_runs={args.demo_runs!r}: use a comma-separated list of"
                     f" {[d[0] for d in DEMO_RUNS]}")
  dtypes = args.stream_dtypes.split(",")
  if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes) or len(set(dtypes)) < len(
      dtypes):
    raise SystemExit(f"error: --stream_dtypes={args.stream_dtypes!r}: use float32, bfloat16 or"
                     " both, comma-separated")
  step_cases(args.step_cases)
  if args.budget < 30:
    raise SystemExit(f"error: --budget={args.budget:g}: give at least 30 seconds")
  if min(args.stream_train, args.stream_test) < args.stream_classes or args.stream_tasks < 1:
    raise SystemExit("error: the stream needs an image of each of its --stream_classes in"
                     " --stream_train and --stream_test, and --stream_tasks >= 1")
  from olora_jax.benchmarks import cases, torch_compare

  if args.size not in cases.SIZES:
    raise SystemExit(f"error: --size={args.size!r}: use one of {cases.SIZES}")
  start = time.monotonic()
  import jax

  from olora_jax import compute

  report = {"check": "device", "versions": versions(), "device": compute.device_description(),
            "platform": jax.default_backend(), "budget_seconds": args.budget, "skipped": {}}
  print(f"device: {report['device']}", flush=True)
  print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
  if jax.default_backend() != "gpu" and not args.allow_cpu:
    raise SystemExit(f"error: JAX sees no GPU (devices: {jax.devices()}); install JAX with its"
                     " CUDA plugin (pip install 'jax[cuda13]'), or pass --allow_cpu to rehearse")
  budget = Budget(args.budget - (time.monotonic() - start), parts)
  peaks = {dtype: cases.matmul_peak_flops(args.peak_n or None, dtype=dtype)
           for dtype in cases.DTYPES}
  report["peaks_gflops"] = {k: v / 1e9 for k, v in peaks.items()}
  print("matmul peak (GFLOP/s): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()),
        flush=True)
  with tempfile.TemporaryDirectory() as work:
    for part in parts:
      seconds = budget.start(part)
      print(f"{part}: up to {seconds:.0f} s", flush=True)
      if seconds < 10:
        report["skipped"][part] = f"{seconds:.0f} s of the budget left for it"
        continue
      part_start = time.monotonic()
      if part == "demo":
        report["demo"] = run_demo(args, seconds, work)
      elif part == "steps":
        rows = run_steps(args, seconds, peaks)
        report["steps"] = [r for r in rows if not r["scan_blocks"]]
        report["steps_scanned"] = [r for r in rows if r["scan_blocks"]]
      elif part == "stream":
        report["stream"], report["stream_other_dtypes"] = run_streams(args, seconds, work)
      else:
        report["torch_steps"] = torch_compare.torch_steps([{"size": args.size}], args.batch_size,
                                                          args.warmup, args.steps, timeout=seconds)
      report.setdefault("part_seconds", {})[part] = time.monotonic() - part_start
      report["seconds"] = time.monotonic() - start
      write_report(args.out_dir, report)  # what is done so far survives a later part's failure
  report["seconds"] = time.monotonic() - start
  write_report(args.out_dir, report)
  print(report_text(report), flush=True)
  return report


if __name__ == "__main__":
  main()
