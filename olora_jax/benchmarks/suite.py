"""launch/bench.py --suite accelerator: what a GPU/TPU (or this CPU) does with the paper's
setting, in one command.

    accelerator_suite   the matmul peaks, then of its parts: the step cases, the host input
                        path, the stream, PyTorch's step
    suite_text          its report as Markdown (host_text: the host block)
"""

from __future__ import annotations

import argparse

import jax

from olora_jax import compute
from olora_jax.benchmarks.cases import DTYPES, matmul_peak_flops, run_cases, table
from olora_jax.benchmarks.host import run_host
from olora_jax.benchmarks.stream import STREAM_SPLIT, run_stream
from olora_jax.benchmarks.torch_compare import torch_steps

SUITES = ("accelerator",)
SUITE_PARTS = ("steps", "host", "stream", "torch")  # after the matmul peaks, in this order
# The suite's defaults (each shrinks with its flag, e.g. for a CPU test).
SUITE_SIZES = "vit_s16,vit_b16"


HOST_ROWS = (("pipeline_host", "pipeline, data.preprocess=host: {stored} px uint8 -> {size} px"
                                " float32"),
             ("pipeline_device", "pipeline, data.preprocess=device: {stored} px uint8 gathered"),
             ("jpeg_one_thread", "JPEG decode + resize to {size} px, one thread"),
             ("jpeg_all_threads", "JPEG decode + resize to {size} px, data.num_workers threads"))


def host_text(host: dict) -> list[str]:
  """The host block of the suite's report: a table of its rates and the stream's step rate."""
  lines = [f"host input path alone (no device work; {host['cores']} cores here, batch"
           f" {host['batch_size']}):", "",
           "| input path | threads (cores used) | images/s | images/s per core |"
           " steps/s it can feed |", "|---|---|---|---|---|"]
  for key, name in HOST_ROWS:
    rate = host[key]
    if rate is not None:
      lines.append(f"| {name.format(stored=host['stored_image_size'], size=host['image_size'])}"
                   f" | {rate['threads']} ({rate['cores_used']}) | {rate['images_per_s']:.0f} |"
                   f" {rate['images_per_s_per_core']:.0f} | {rate['steps_per_s']:.1f} |")
  files = host["jpeg_files"]
  if files:
    lines.append(f"(JPEGs: {host['jpeg_one_thread']['images']} files of about"
                 f" {files['mean_height']:.0f}x{files['mean_width']:.0f} px,"
                 f" {files['mean_kib']:.0f} KiB, quality {files['quality']}, read from the page"
                 " cache, as the folder source's first read of a dataset)")
  steps = host.get("stream_steps_per_s")
  lines.append(f"the stream's train steps ran at {steps:.1f} steps/s (steady, device step time)"
               if steps else "the stream did not run: no device step rate to compare with")
  return lines


def suite_text(report: dict) -> str:
  """The suite's report as Markdown: device, peaks, the step table, the stream, PyTorch."""
  peaks = ", ".join(f"{k} {v:.1f}" for k, v in report["matmul_peak_gflops"].items())
  lines = [f"device: {report['device']}", f"measured matmul peak (GFLOP/s): {peaks}"]
  if report["steps"]:
    lines += ["", table(report["steps"])]
  if report["host"]:
    lines += ["", *host_text(report["host"])]
  stream = report["stream"]
  if stream:
    lines += ["", f"stream: {stream['size']} {stream['fidelity']} {stream['compute_dtype']},"
              f" {stream['train_images']} train / {stream['test_images']} test images of"
              f" {stream['classes']} classes in {stream['tasks']} tasks at"
              f" {stream['image_size']} px, batch {stream['batch_size']}, {stream['n_steps']}"
              f" steps, {stream['n_anytime_evaluations']} anytime and"
              f" {stream['n_task_end_evaluations']} task-end evaluations", "",
              "| part | seconds |", "|---|---|"]
    lines += [f"| {k.removesuffix('_seconds')} | {stream[k]:.1f} |" for k in
              ("total_seconds", "setup_seconds", "loop_seconds", *STREAM_SPLIT, "other_seconds")]
    lines += ["", "(compile: JAX compilation anywhere in the run, set-up included, overlapping the"
              " rest; other: the methods' host hooks, logging)",
              f"steady samples/s {stream['steady_samples_per_second']:.1f},"
              f" {stream['n_compilations']} compilations, peak memory"
              f" {stream['peak_memory_bytes']:.3g} B ({stream['memory']}), checkpoint"
              f" {stream['checkpoint_bytes']:.3g} B saved in"
              f" {stream['checkpoint_save_seconds']:.2f} s ({stream['n_checkpoints']} saves)"]
  if report["torch_steps"] is None:
    lines.append("torch_step.py: not run (--parts)")
    return "\n".join(lines)
  for row in report["torch_steps"]:
    lines.append(f"torch_step.py {row['size']}: " + (
        row["error"] if "error" in row else
        f"{row['device']}, step median {1e3 * row['step_s_median']:.1f} ms,"
        f" min {1e3 * row['step_s_min']:.1f} ms ({row['images']} images)"))
  if not report["torch_steps"]:
    lines.append("torch_step.py: PyTorch is not importable here (skipped)")
  return "\n".join(lines)


def accelerator_suite(args: argparse.Namespace, sizes: list[str], fidelities: list[str],
                      dtypes: list[str], parts: list[str] = SUITE_PARTS) -> dict:
  """The suite: peaks, then of `parts`: each step case in its own process, the host input path,
  the stream, PyTorch's step."""
  devices = jax.devices()
  peaks = {dtype: matmul_peak_flops(args.peak_n or None, dtype=dtype) for dtype in DTYPES}
  print(f"{compute.device_description()}; matmul peak (GFLOP/s): "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()), flush=True)
  rows = run_cases(args, sizes, fidelities, dtypes, peaks) if "steps" in parts else []
  host = run_host(args) if "host" in parts and (args.host_images or args.host_jpegs) else None
  stream = run_stream(args) if "stream" in parts and args.stream_train else None
  if host is not None:  # the rate the device took batches at, beside what the host can feed
    host["stream_steps_per_s"] = (stream["steady_samples_per_second"] / stream["batch_size"]
                                  if stream and stream["steady_samples_per_second"] else None)
  return {
      "suite": "accelerator",
      "device": compute.device_description(), "platform": devices[0].platform,
      "device_kind": devices[0].device_kind, "device_count": len(devices),
      "matmul_peak_gflops": {k: v / 1e9 for k, v in peaks.items()},
      "steps": rows, "host": host, "stream": stream,
      "torch_steps": (torch_steps(rows, args.batch_size, args.warmup, args.steps)
                      if "torch" in parts else None),
  }
