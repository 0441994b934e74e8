"""The device check's `stream` part: Split CIFAR-100's shape (launch/bench.py --suite
accelerator's stream) through launch/run.py in each of --stream_dtypes: the first stopped
half-way and resumed, each measured and, unfinished, extrapolated to the whole stream.

    run_streams          the stream in each dtype, one after another
    run_stream           one dtype's run(s) and its report
    extrapolate          the whole stream's seconds from a run stopped after some steps
    first_process_done   when the stopped-and-resumed stream's first process is stopped
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from olora_jax.benchmarks import ROOT
from olora_jax.benchmarks.device_runs import cache_dir, last_line, run_process

# The first stream dtype's share of the stream part (stopped and resumed: cold, then warm cache).
FIRST_STREAM_SHARE = 0.6
PAPER_SECONDS = 864.6  # the paper's Split CIFAR-100 run on an A100 (the authors' code)


def stream_overrides(args: argparse.Namespace, dtype: str = "float32") -> dict:
  """configs/split_cifar100.py's keys changed for the stream: the bench suite's stream (synthetic
  CIFAR-shaped images resized on the device, a random backbone of `--size`'s shape) in
  model.compute_dtype `dtype`, with this check's cadence flags."""
  from olora_jax.benchmarks import stream as suite_stream

  out = suite_stream.stream_overrides(args.size, args.stream_train, args.stream_test,
                                      args.stream_classes, args.stream_tasks)
  out["model.compute_dtype"] = dtype
  if args.stream_eval_every:
    out["eval.eval_every"] = args.stream_eval_every
  if args.stream_checkpoint_every:
    out["checkpoint_every"] = args.stream_checkpoint_every
  return out


def stream_config(args: argparse.Namespace, dtype: str = "float32"):
  from configs import split_cifar100
  from olora_jax.benchmarks import stream as suite_stream

  return suite_stream.apply_overrides(split_cifar100.get_config(), stream_overrides(args, dtype))


def _stream_command(args: argparse.Namespace, workdir: str, cache: str,
                    dtype: str) -> list[str]:
  return [sys.executable, str(ROOT / "launch" / "run.py"), "--config",
          str(ROOT / "configs" / "split_cifar100.py"), "--workdir", workdir,
          f"--compilation_cache={cache}",
          *(f"--config.{k}={v}" for k, v in stream_overrides(args, dtype).items())]


def _checkpoint_steps(workdir: str) -> list[int]:
  from olora_jax import checkpointing

  return checkpointing.checkpoint_steps(workdir)


def _stream_plan(config) -> dict:
  """The stream's steps, checkpoint saves and per-evaluation test images, from its schedule."""
  from olora_jax import protocol, trainer

  setup = trainer.Setup(config)
  c = setup.config
  test_labels = setup.test_source.labels
  points = protocol.evaluation_points(setup.stream, setup.train_source.labels, c.eval.eval_every,
                                      setup.method.anytime_eval)
  images = [(step, len(test_labels) if at_end else int(np.isin(test_labels, seen).sum()))
            for step, seen, at_end in points]
  n_steps = len(setup.stream.steps)
  return {"n_steps": n_steps, "eval_images": images, "batch_size": c.learner.batch_size,
          "eval_every": c.eval.eval_every, "checkpoint_every": c.checkpoint_every,
          "image_size": setup.spec.image_size, "fidelity": c.fidelity,
          "compute_dtype": c.model.compute_dtype}


def _ledger_at(workdir: str) -> tuple[int, float, dict]:
  """The newest checkpoint's stream cursor, loop wall seconds and compute ledger (the totals of
  every process of the run so far)."""
  from olora_jax import checkpointing

  step = checkpointing.latest_step(workdir)
  host = checkpointing.read_host(workdir, step)
  p = host["progress"]
  return p["cursor"], p["wall_seconds"], p["compute"]


def extrapolate(plan: dict, cursor: int, loop_seconds: float, setup_seconds: float,
                ledger: dict) -> dict:
  """The whole stream's seconds from a run stopped after `cursor` steps: the parts measured so
  far plus the rest at the measured rates (steps at the steady step time, evaluations per test
  image evaluated, host wait and the rest per step, checkpoints per save); set-up once."""
  n = plan["n_steps"]
  measured = {k: ledger.get(k, 0.0) for k in ("step_seconds", "eval_seconds",
                                              "host_wait_seconds", "checkpoint_seconds")}
  other = loop_seconds - sum(measured.values())
  if cursor == n:  # finished: nothing to extrapolate
    est = {"setup_seconds": setup_seconds, **measured, "other_seconds": other}
    return {**est, "total_seconds": sum(est.values()), "steady_step_seconds": None}
  steady = ledger.get("steady_seconds", 0.0) / max(1, ledger.get("steady_steps", 0))
  done_images = sum(i for step, i in plan["eval_images"] if step < cursor)
  all_images = sum(i for _, i in plan["eval_images"])
  eval_rate = ledger.get("eval_seconds", 0.0) / done_images if done_images else None
  saves = n // plan["checkpoint_every"] + 1 if plan["checkpoint_every"] else 1
  save_seconds = ledger.get("checkpoint_seconds", 0.0) / max(1, ledger.get("n_checkpoints", 0))
  rest = n - cursor
  est = {
      "setup_seconds": setup_seconds,
      "step_seconds": measured["step_seconds"] + rest * steady,
      "eval_seconds": (measured["eval_seconds"] + (all_images - done_images) * eval_rate
                       if eval_rate is not None else None),
      "host_wait_seconds": measured["host_wait_seconds"] * n / max(1, cursor),
      "checkpoint_seconds": saves * save_seconds,
      "other_seconds": other * n / max(1, cursor),
  }
  total = (sum(v for v in est.values()) if est["eval_seconds"] is not None else None)
  return {**est, "total_seconds": total, "eval_images_done": done_images,
          "eval_images_total": all_images, "steady_step_seconds": steady}


def run_streams(args: argparse.Namespace, seconds: float, work: str) -> tuple[dict, dict]:
  """The stream in each of --stream_dtypes, one after another: the first stopped half-way and
  resumed (its first process compiles with a cold persistent cache, the resumed one with a warm
  one) in FIRST_STREAM_SHARE of `seconds`, the others in one process each in the rest. Returns
  (the first's report, {dtype: report} of the others)."""
  deadline = time.monotonic() + seconds
  dtypes = args.stream_dtypes.split(",")
  first = run_stream(args, seconds * (FIRST_STREAM_SHARE if len(dtypes) > 1 else 1.0), work,
                     dtypes[0], resume=True)
  others = {}
  for i, dtype in enumerate(dtypes[1:]):
    left = (deadline - time.monotonic()) / (len(dtypes) - 1 - i)
    if left < 10:
      others[dtype] = {"compute_dtype": dtype, "skipped": "the stream's share was spent"}
      continue
    others[dtype] = run_stream(args, left, work, dtype, resume=False)
  return first, others


def first_process_done(workdir: str, half: int, elapsed: float, soft_seconds: float) -> bool:
  """Whether the stopped-and-resumed stream's first process is stopped now: a checkpoint at or
  past `half` exists, or `soft_seconds` have passed and the run has trained a step (a
  `"event": "train"` line in its metrics.jsonl, each flushed). Not before that step: a process
  stopped while it still compiles leaves nothing to resume or measure (an H200's float32
  ViT-B/16 stream compiled for longer than its 66 s), so it runs on to the end of its share."""
  steps = _checkpoint_steps(workdir)
  if steps and steps[-1] >= half:
    return True
  if elapsed < soft_seconds:
    return False
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
      return b'"event": "train"' in f.read()
  except FileNotFoundError:
    return False


def run_stream(args: argparse.Namespace, seconds: float, work: str, dtype: str = "float32",
               resume: bool = True) -> dict:
  """The stream in `dtype` in two processes (`resume`): stopped (SIGTERM) half-way or at 60% of
  `seconds` once it has trained (first_process_done), resumed and run to its end or to the end of
  `seconds`; or in one process to its end or to the end of `seconds`. Measured, and extrapolated
  if unfinished."""
  from olora_jax.benchmarks.stream import tree_bytes

  deadline = time.monotonic() + seconds
  workdir, cache = os.path.join(work, f"stream_{dtype}"), cache_dir(args, work, "stream")
  plan = _stream_plan(stream_config(args, dtype))
  half = plan["n_steps"] // 2
  command = _stream_command(args, workdir, cache, dtype)
  out = {"size": args.size, "train_images": args.stream_train, "test_images": args.stream_test,
         "classes": args.stream_classes, "tasks": args.stream_tasks,
         **{k: v for k, v in plan.items() if k != "eval_images"},
         "n_evaluations": len(plan["eval_images"]), "segments": []}

  started = time.monotonic()

  def stop_first():  # half the stream saved, or 60% of the time spent once a step has run
    return first_process_done(workdir, half, time.monotonic() - started, 0.6 * seconds)

  first = run_process(command, seconds, stop_when=stop_first if resume else None)
  out["segments"].append({"rc": first["rc"], "seconds": first["seconds"],
                          "stopped": first["stopped"], "last_line": last_line(first)})
  if first["rc"] not in (0, 143) or not _checkpoint_steps(workdir):
    out["error"] = f"the first process ended with exit {first['rc']}: {last_line(first)}"
    return out
  resumed_at = []

  def on_resume(line, elapsed):
    if "resuming" in line and not resumed_at:
      resumed_at.append(elapsed)

  if first["rc"] == 143 and resume and deadline - time.monotonic() < 10:
    out["resume_skipped"] = "the first process used the stream's share: no time left to resume"
  elif first["rc"] == 143 and resume:
    _, _, cold = _ledger_at(workdir)  # the first process's ledger, at its SIGTERM checkpoint
    out["cold_compile_seconds"] = cold.get("compile_seconds")
    second = run_process(command, deadline - time.monotonic(), watch=on_resume)
    out["segments"].append({"rc": second["rc"], "seconds": second["seconds"],
                            "stopped": second["stopped"], "last_line": last_line(second)})
    out["resume_seconds"] = resumed_at[0] if resumed_at else None
    if second["rc"] not in (0, 143):
      out["error"] = f"the resumed process ended with exit {second['rc']}: {last_line(second)}"
      return out
  cursor, loop_seconds, ledger = _ledger_at(workdir)
  process_seconds = sum(s["seconds"] for s in out["segments"])
  out.update({"steps_done": cursor, "finished": cursor == plan["n_steps"],
              "loop_seconds": loop_seconds, "process_seconds": process_seconds,
              **{k: ledger.get(k) for k in ("step_seconds", "eval_seconds", "host_wait_seconds",
                                            "checkpoint_seconds", "compile_seconds",
                                            "n_compilations", "n_checkpoints",
                                            "peak_device_bytes", "peak_host_rss_bytes")}})
  out["steady_samples_per_second"] = (
      ledger["steady_samples"] / ledger["steady_seconds"] if ledger.get("steady_seconds")
      else None)
  out["checkpoint_bytes"] = tree_bytes(os.path.join(workdir, "checkpoints",
                                                    str(_checkpoint_steps(workdir)[-1])))
  # Set-up as one process pays it: the processes' wall time outside the loop, less the resumed
  # process's own set-up (its time to the restored state).
  setup_seconds = process_seconds - loop_seconds - (out.get("resume_seconds") or 0.0)
  out["setup_seconds"] = setup_seconds
  out["whole_stream"] = extrapolate(plan, cursor, loop_seconds, setup_seconds, ledger)
  out["whole_stream"]["measured"] = out["finished"]
  evaluated = (out["whole_stream"]["eval_images_done"] if not out["finished"]
               else sum(i for _, i in plan["eval_images"]))
  out["eval_images"] = evaluated
  if out.get("cold_compile_seconds") is not None and ledger.get("compile_seconds") is not None:
    out["warm_compile_seconds"] = ledger["compile_seconds"] - out["cold_compile_seconds"]
  out["eval_images_per_s"] = (evaluated / ledger["eval_seconds"] if ledger.get("eval_seconds")
                              else None)
  total = out["whole_stream"]["total_seconds"]
  out["vs_paper"] = total / PAPER_SECONDS if total else None
  return out

