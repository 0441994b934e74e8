"""Benchmarks a method's train step per model size and fidelity on this machine:

    .venv/bin/python launch/bench.py --sizes tiny,vit_ti16,vit_s16 \
        --fidelities paper,reference --out bench.json

Each case builds the run exactly as launch/run.py does (the demo's embedded MNIST stream, resized
to the model's input; random backbone weights for the ViT presets, which do not change the
cost), runs `--warmup` steps (compilation; for Online-LoRA they also fill the hard buffer), then
times `--steps` steps, each from dispatch until its scalars are on the host, plus the method's
host hook (Online-LoRA: the loss window, and a consolidation when a plateau fires). Reported per
case, as a table and as JSON (`--out`):

  scan_blocks            model.scan_blocks of the case (`--scan_blocks`: the ViT's encoder
                         blocks as one scanned block); `matmul_precision` the resolved
                         model.matmul_precision (the fidelity's: 'highest' under `reference`)
  step_ms_median/min     steady step time
  samples_per_s          stream samples per second at the median step
  flops_per_step         XLA's estimate for the compiled train step
  passes_per_step        that in forward passes of one image (a backward costs about two)
  pct_of_peak            achieved FLOP/s at the median step against the matmul peak of the
                         case's `compute_dtype` (model.compute_dtype, `--compute_dtypes`) the
                         command measures on the same device (`peak_gflops`, best of 10)
  compile_s, n_compiles  JAX compilation during the case (setup, warm-up and timed steps), with
                         the persistent cache off unless --compilation_cache is given
  h2d_arrays/h2d_bytes   explicit host-to-device transfers per step (the batch) and
  d2h_arrays             device-to-host (the step's scalars); implicit transfers inside the step
                         are checked with jax.transfer_guard('disallow'): `implicit_transfers`
                         is 'none' or the first line of the refusal
  peak_memory_bytes      the device allocator's peak, or the process's peak RSS on CPU
                         (`memory` says which)
  matmul_pct, layout_pct, other_pct   with --profile DIR only: one more step is traced with
                         jax.profiler into DIR/<size>_<fidelity> (open it in XProf, TensorBoard
                         or Perfetto) and its op time split into matrix products, data movement
                         (copies, transposes, materialised broadcasts) and the rest (element-wise
                         math, reductions), in % (compute.op_time_shares; '-' where the trace
                         names no HLO op)

With more than one case, each case runs in a fresh process of launch/bench.py (`--peak_gflops`
passes the one matmul peak measured first), so its memory peak, allocator state and compile
count are its own, whatever ran before it.

`--suite accelerator` answers "what does the paper's setting cost on this device" in one
command (docs/performance.md, "Running on a GPU/TPU"):

    .venv/bin/python launch/bench.py --suite accelerator --out suite.json

It prints, and writes as one JSON object: the device kind and count; the measured matmul peak in
float32 and bfloat16; the step cases above for ViT-S/16 and ViT-B/16 in both fidelities and both
compute dtypes (on synthetic images: the suite needs no dataset); Split CIFAR-100's shape end to
end through the real loop (trainer.train_and_evaluate: 100 classes in 10 tasks, 50,000 training
and 10,000 test 32x32 uint8 images of noise, olora_jax/data/synthetic.py, resized on the device
to 224 px; the setting's batch size, evaluation and checkpoint cadence; ViT-B/16 with a random
frozen backbone), its wall time split into set-up, train steps, evaluations, waiting on the host,
checkpoints and the rest (and the compilation inside them), its peak memory, checkpoint size and
save time; and, when PyTorch is importable, scripts/torch_step.py's step of the same ViT shapes
on the same device (`reference`'s full-buffer step, float32).

Before the stream it measures the host input path alone, with no device work (`host` in the
JSON), so that a reader sees whether the host can feed the device. Each rate is given as
`images_per_s`, `images_per_s_per_core` (divided by `cores_used`: the threads, at most the
cores this process may use) and `steps_per_s`, the train steps per second it can feed (images/s
over the stream's batch size), printed beside the stream's measured steady steps/s
(`stream_steps_per_s`):

  pipeline_host      the stream setting's input pipeline as trainer.Setup builds it with
                     data.preprocess=host: `--host_images` synthetic 32x32 uint8 images resized
                     on the host to the model's input (224 px with the default
                     --stream_size), every batch pulled from the pipeline's threads, none placed
                     on the device
  pipeline_device    the same with data.preprocess=device: the host only gathers the uint8 images
  jpeg_one_thread,   the folder source's first read of a dataset (folder_sources.resized_images:
  jpeg_all_threads   PIL decode, resize to the model's input, written to its cache) of
                     `--host_jpegs` JPEGs of ImageNet-R-like size (sides of 300-600 px, quality
                     90, smooth colour with pixel texture; `jpeg_files`), on one thread and on
                     data.num_workers threads; the files are fresh, so they are read from the
                     page cache, not the disk

Every part shrinks with a flag (`--sizes`, `--fidelities`, `--compute_dtypes`, `--steps`,
`--host_images`, `--host_jpegs`, `--stream_size`, `--stream_train`, `--stream_test`,
`--stream_classes`, `--stream_tasks`, ...; `--host_images=0`, `--host_jpegs=0` and
`--stream_train=0` skip theirs), and `--parts` picks the parts run after the matmul peaks
(`steps,host,stream,torch`, all by default; `--parts=host` measures the host alone in seconds).

As launch/run.py, it first makes glibc keep freed memory for reuse (compute.keep_host_memory;
$OLORA_KEEP_HOST_MEMORY=0 measures without it).

The numbers are measurements: run cases alone on a quiet machine, and compare versions side by
side in one sitting.

This module is that command line (`main(argv)` returns the rows, or the suite's report); the
parts it calls are olora_jax.benchmarks' `cases`, `suite`, `stream`, `host` and `torch_compare`.
"""

from __future__ import annotations

import argparse
import json
import os

from olora_jax import compute
from olora_jax.benchmarks.cases import (
  DTYPES,
  FIDELITIES,
  SIZES,
  matmul_peak_flops,
  run_cases,
  table,
)
from olora_jax.benchmarks.host import HOST
from olora_jax.benchmarks.stream import STREAM
from olora_jax.benchmarks.suite import (
  SUITE_PARTS,
  SUITE_SIZES,
  SUITES,
  accelerator_suite,
  suite_text,
)


def _list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
  items = [x for x in text.split(",") if x]
  bad = [x for x in items if x not in allowed]
  if bad or not items:
    raise SystemExit(f"error: {flag}={text!r}: use a comma-separated list of {allowed}")
  return items


def _write_json(path: str, value) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1)
  os.replace(tmp, path)


def main(argv: list[str] | None = None) -> list[dict] | dict:
  """launch/bench.py: `argv` (default: the command line) parsed and checked, every refusal a
  SystemExit with one `error: ...` line before any compute; then the cases (their rows) or, with
  --suite, the suite (its report), printed and, with --out, written as JSON."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", default="",
                      help="'accelerator': peaks, steps in both precisions, the stream, PyTorch")
  parser.add_argument("--sizes", default="",
                      help=f"default: tiny ({SUITE_SIZES} with --suite)")
  parser.add_argument("--fidelities", default="paper,reference")
  parser.add_argument("--compute_dtypes", default="",
                      help="model.compute_dtype of the cases; default: float32 (both with --suite)")
  parser.add_argument("--method", default="online_lora")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
  parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
  parser.add_argument("--batch_size", type=int, default=None,
                      help="default: 16 for tiny (the demo's), 8 for the ViT presets")
  parser.add_argument("--dataset", default="",
                      help="the cases' data.dataset (default: the demo's; with --suite, synthetic"
                      " images)")
  parser.add_argument("--scan_blocks", action="store_true",
                      help="the cases with model.scan_blocks=True (the ViT's encoder blocks as"
                      " one scanned block: a shorter compile)")
  parser.add_argument("--compilation_cache", default="off",
                      help="a directory to use JAX's persistent compilation cache (default off:"
                      " compile times are measured cold)")
  parser.add_argument("--out", default="", help="also write the rows (the suite's report) as"
                      " JSON here")
  parser.add_argument("--profile", default="",
                      help="trace one more step per case into this directory and report how its"
                      " op time splits (matmul_pct, layout_pct, other_pct)")
  parser.add_argument("--peak_gflops", type=float, default=0.0,
                      help="the matmul peak to report against (default 0: measure it)")
  parser.add_argument("--peak_n", type=int, default=0,
                      help="the peak's square matrices' side (default: 2048 on CPU, else 8192)")
  parser.add_argument("--parts", default=",".join(SUITE_PARTS),
                      help="the suite's parts to run after the matmul peaks (default: all of"
                      f" {','.join(SUITE_PARTS)})")
  host = parser.add_argument_group("the suite's host input path (the stream's setting)")
  host.add_argument("--host_images", type=int, default=HOST["images"],
                    help="synthetic CIFAR-sized images through the input pipeline, per"
                    " data.preprocess mode (0: skip)")
  host.add_argument("--host_jpegs", type=int, default=HOST["jpegs"],
                    help="ImageNet-R-sized JPEGs decoded and resized (0: skip)")
  stream = parser.add_argument_group("the suite's stream (Split CIFAR-100's shape by default)")
  stream.add_argument("--stream_size", default=STREAM["size"])
  stream.add_argument("--stream_train", type=int, default=STREAM["train"],
                      help="training images (0: no stream)")
  stream.add_argument("--stream_test", type=int, default=STREAM["test"])
  stream.add_argument("--stream_classes", type=int, default=STREAM["classes"])
  stream.add_argument("--stream_tasks", type=int, default=STREAM["tasks"])
  stream.add_argument("--stream_batch_size", type=int, default=0, help="default: the paper's")
  stream.add_argument("--stream_eval_every", type=int, default=0, help="default: the paper's")
  stream.add_argument("--stream_checkpoint_every", type=int, default=None,
                      help="default: the setting's")
  stream.add_argument("--stream_fidelity", default="", help="default: the setting's")
  stream.add_argument("--stream_workdir", default="",
                      help="keep the stream's run here (default: a temporary directory)")
  args = parser.parse_args(argv)
  if args.suite and args.suite not in SUITES:
    raise SystemExit(f"error: --suite={args.suite!r}: use one of {SUITES}")
  sizes = _list(args.sizes or (SUITE_SIZES if args.suite else "tiny"), SIZES, "--sizes")
  fidelities = _list(args.fidelities, FIDELITIES, "--fidelities")
  dtypes = _list(args.compute_dtypes or (",".join(DTYPES) if args.suite else "float32"), DTYPES,
                 "--compute_dtypes")
  if args.steps < 1 or args.warmup < 1:
    raise SystemExit("error: --steps and --warmup must be at least 1")
  if args.peak_gflops < 0:
    raise SystemExit(f"error: --peak_gflops={args.peak_gflops} must be >= 0")
  if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
    raise SystemExit(f"error: --out={args.out!r}: its directory does not exist")
  parts = _list(args.parts, SUITE_PARTS, "--parts")
  if args.suite:
    _check_stream_args(args)
    _check_host_args(args)
  if args.compilation_cache != "off":
    compute.enable_compilation_cache(args.compilation_cache)
  keep = compute.keep_host_memory()  # as launch/run.py: before JAX's backend starts
  if args.suite:
    if not args.dataset:  # synthetic images: the suite needs no dataset package
      from olora_jax.data import synthetic

      args.dataset = synthetic.name(1000, 100, 10)
    report = accelerator_suite(args, sizes, fidelities, dtypes, parts)
    print(suite_text(report))
    if args.out:
      _write_json(args.out, report)
    return report
  peaks = {dtype: 1e9 * args.peak_gflops or matmul_peak_flops(args.peak_n or None, dtype=dtype)
           for dtype in dtypes}
  for dtype, peak in peaks.items():
    print(f"{dtype} matmul peak on {compute.device_description()}: {peak / 1e9:.1f} GFLOP/s"
          f" (host memory kept for reuse: {keep})", flush=True)
  rows = run_cases(args, sizes, fidelities, dtypes, peaks)
  print(table(rows))
  if args.out:
    _write_json(args.out, rows)
  return rows


def _check_stream_args(args: argparse.Namespace) -> None:
  """The suite's stream flags, refused in one line before any compute."""
  if args.stream_size not in SIZES:
    raise SystemExit(f"error: --stream_size={args.stream_size!r}: use one of {SIZES}")
  if args.stream_fidelity and args.stream_fidelity not in FIDELITIES:
    raise SystemExit(f"error: --stream_fidelity={args.stream_fidelity!r}: use one of"
                     f" {FIDELITIES}")
  if args.stream_train < 0 or (args.stream_train and (
      args.stream_classes < 1 or args.stream_tasks < 1
      or min(args.stream_train, args.stream_test) < args.stream_classes)):
    raise SystemExit(
        f"error: the stream needs at least one image of each of its --stream_classes="
        f"{args.stream_classes} classes in --stream_train={args.stream_train} and --stream_test="
        f"{args.stream_test}, and --stream_tasks >= 1 (--stream_train=0: no stream)")


def _check_host_args(args: argparse.Namespace) -> None:
  """The suite's host flags, refused in one line before any compute."""
  if args.host_jpegs < 0:
    raise SystemExit(f"error: --host_jpegs={args.host_jpegs}: give a number of JPEGs >= 0"
                     " (0: skip them)")
  if args.host_images < 0 or (args.host_images and (
      args.stream_classes < 1 or args.stream_tasks < 1
      or args.host_images < args.stream_classes)):
    raise SystemExit(
        f"error: --host_images={args.host_images}: the host pipeline's stream needs at least one"
        f" image of each of its --stream_classes={args.stream_classes} classes, and"
        f" --stream_tasks >= 1 (--host_images=0: skip it)")


if __name__ == "__main__":
  main()
