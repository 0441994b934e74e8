"""The device check's `demo` part: configs/demo.py end to end through launch/run.py on the device
in each fidelity of --demo_runs, beside the same run on this machine's CPU, compared (the same
decisions; accuracies and train losses within DEMO_RTOL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from olora_jax.benchmarks import ROOT
from olora_jax.benchmarks.device_runs import GRACE_SECONDS, cache_dir, last_line, run_process

# The demo runs compared, the default's first: (name, fidelity, model.matmul_precision or None
# for the fidelity's: 'highest' under `reference`, 'default' under `paper`).
DEMO_RUNS = (("reference", "reference", None), ("paper", "paper", None),
             ("paper_highest", "paper", "highest"))
DEFAULT_DEMO_RUNS = "reference,paper"
DEMO_RTOL = {"accuracy": 1e-6, "loss": 1e-5}  # docs/performance.md's comparison


def _demo_command(config: str, workdir: str, fidelity: str, cache: str,
                  precision: str | None = None) -> list[str]:
  return [sys.executable, str(ROOT / "launch" / "run.py"), "--config", config, "--workdir",
          workdir, f"--compilation_cache={cache}", f"--config.fidelity={fidelity}",
          *([f"--config.model.matmul_precision={precision}"] if precision else [])]


def _train_losses(workdir: str) -> np.ndarray:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  return np.array([x["loss"] for x in lines if x["event"] == "train"], np.float64)


def _max_rel(got, want) -> float:
  """max |got - want| / max|want|: a difference relative to the compared values' scale."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return float("inf")
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  return float(np.max(np.abs(got - want)) / scale) if scale else float(np.max(np.abs(got)))


def compare_runs(workdir: str, reference: str) -> dict:
  """`workdir`'s run against `reference`'s: the decisions equal, the accuracies and train losses
  within DEMO_RTOL (relative to the compared values' scale)."""
  with open(os.path.join(workdir, "results.json")) as f:
    got = json.load(f)
  with open(os.path.join(reference, "results.json")) as f:
    want = json.load(f)
  same = {k: got[k] == want[k] for k in ("plateau_steps", "task_end_steps", "n_steps")}
  accuracy = max(_max_rel(got["acc_matrix"], want["acc_matrix"]),
                 _max_rel(got["anytime_accuracy"], want["anytime_accuracy"]))
  loss = _max_rel(_train_losses(workdir), _train_losses(reference))
  return {"same_plateau_steps": same["plateau_steps"], "same_task_ends": same["task_end_steps"],
          "same_n_steps": same["n_steps"], "n_plateaus": (got["n_plateaus"], want["n_plateaus"]),
          "A_final": (got["A_final"], want["A_final"]),
          "accuracy_max_rel_diff": accuracy, "loss_max_rel_diff": loss,
          "within_tolerance": all(same.values()) and accuracy <= DEMO_RTOL["accuracy"]
          and loss <= DEMO_RTOL["loss"]}


def run_demo(args: argparse.Namespace, seconds: float, work: str) -> dict:
  """The demo's runs (DEMO_RUNS named by --demo_runs) on the device, one after another, while the
  same fidelities run on this machine's CPU alongside; each device run compared with its CPU
  twin."""
  deadline = time.monotonic() + seconds
  runs = [run for run in DEMO_RUNS if run[0] in args.demo_runs.split(",")]
  cpu_runs = {}

  def cpu():  # one CPU run at a time beside the device's runs (they share the host's cores)
    for fidelity in dict.fromkeys(f for _, f, _ in runs):
      workdir = os.path.join(work, f"demo_cpu_{fidelity}")
      cpu_runs[fidelity] = (workdir, run_process(
          _demo_command(args.demo_config, workdir, fidelity, cache_dir(args, work, "cpu")),
          deadline - time.monotonic(), {**os.environ, "JAX_PLATFORMS": "cpu"}))

  cpu_thread = threading.Thread(target=cpu)
  cpu_thread.start()
  out = {}
  for name, fidelity, precision in runs:
    left = deadline - time.monotonic()
    if left < 10:
      out[name] = {"skipped": f"the demo's share of the budget was spent ({seconds:.0f} s)"}
      continue
    workdir = os.path.join(work, f"demo_{name}")
    done = run_process(_demo_command(args.demo_config, workdir, fidelity,
                                     cache_dir(args, work, "device"), precision), left)
    from olora_jax import fidelity as fidelity_lib

    row = {"fidelity": fidelity, "matmul_precision": precision or fidelity_lib.FIDELITY_DEFAULTS[
        ("model", "matmul_precision")][fidelity],
           "seconds": done["seconds"], "rc": done["rc"]}
    if done["rc"] != 0:
      row["error"] = last_line(done)
    out[name] = row
  cpu_thread.join(max(1.0, deadline - time.monotonic() + 2 * GRACE_SECONDS))
  for name, fidelity, _ in runs:
    row = out[name]
    if "rc" not in row or row["rc"] != 0:
      continue
    cpu_dir, cpu_done = cpu_runs.get(fidelity, (None, None))
    row["cpu_seconds"] = cpu_done["seconds"] if cpu_done else None
    if cpu_done is None or cpu_done["rc"] != 0:
      row["comparison"] = {"error": "the CPU run did not finish: " + (
          last_line(cpu_done) if cpu_done else "not started")}
      continue
    row["comparison"] = compare_runs(os.path.join(work, f"demo_{name}"), cpu_dir)
  return out

