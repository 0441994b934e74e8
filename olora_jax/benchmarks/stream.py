"""The accelerator suite's stream (launch/bench.py --suite accelerator): Split CIFAR-100's
shape end to end through the real loop on synthetic images, its wall time split by the compute
ledger.

    stream_overrides   configs/split_cifar100.py's keys for a stream of its shape without its data
    apply_overrides    a config with dotted keys set, as --config.KEY=VALUE would
    stream_config      the suite's stream config from its --stream_* flags
    run_stream         the stream through trainer.train_and_evaluate: its report
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from configs import demo
from olora_jax import trainer

# The suite's defaults (each shrinks with its flag, e.g. for a CPU test).
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


def tree_bytes(directory: str) -> int:
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
    checkpoint_bytes = (tree_bytes(os.path.join(workdir, checkpointing.CHECKPOINT_DIR,
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
