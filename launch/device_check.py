"""One command for a GPU lent for minutes: does the project run there, how fast, and do its
results agree with the CPU's?

    bash scripts/device_check.sh --out_dir DIR      # or: OUT=DIR bash scripts/device_check.sh

scripts/device_check.sh installs the wheels carried in `.whl/` (scripts/device_wheels.sh fetches
them) into a temporary directory, puts it and the repository on PYTHONPATH and runs this file
with the machine's python3; with the project installed, `python launch/device_check.py` runs it
directly. Everything happens inside a wall-time budget (`--budget`, 540 s by default: one
command of a 15-minute lease, which leaves about 10 minutes of commands): the parts share what is
left in fixed proportions, in the order below, so that what is cut first when time runs short is
last (docs/performance.md lists it); a part that outlasts its share is stopped and says so, and
the next parts get the rest. It prints, and writes as DIR/device_check.json and
DIR/device_check.md:

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
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# In the order they run: what is cut first when time runs short comes last (docs/performance.md).
PARTS = ("demo", "stream", "steps", "torch")
# Each part's share of the budget left when it starts, against the parts still to run.
SHARES = {"demo": 0.25, "stream": 0.45, "steps": 0.25, "torch": 0.05}
# The first stream dtype's share of the stream part (stopped and resumed: cold, then warm cache).
FIRST_STREAM_SHARE = 0.6
RESERVE_SECONDS = 8.0  # kept back for writing the report
GRACE_SECONDS = 30.0  # after a SIGTERM, before SIGKILL
PAPER_SECONDS = 864.6  # the paper's Split CIFAR-100 run on an A100 (the authors' code)
VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-collections",
            "torch")
# The demo runs compared, the default's first: (name, fidelity, model.matmul_precision or None
# for the fidelity's: 'highest' under `reference`, 'default' under `paper`).
DEMO_RUNS = (("reference", "reference", None), ("paper", "paper", None),
             ("paper_highest", "paper", "highest"))
DEFAULT_DEMO_RUNS = "reference,paper"
STEP_CASES = (("paper", "float32"), ("paper", "bfloat16"), ("reference", "float32"),
              ("reference", "bfloat16"))
DEFAULT_STEP_CASES = ",".join(f"{f}:{d}" for f, d in STEP_CASES)
# After them, if the part's share allows: the same step with model.scan_blocks (compile and step
# time beside the unrolled row of the same case).
SCANNED_STEP_CASES = (("paper", "float32"),)
DEMO_RTOL = {"accuracy": 1e-6, "loss": 1e-5}  # docs/performance.md's comparison


def versions() -> dict:
  out = {"python": platform.python_version()}
  for name in VERSIONS:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


class Budget:
  """The check's deadline and each part's share of what is left when the part starts."""

  def __init__(self, seconds: float, parts: list[str]):
    self.deadline = time.monotonic() + seconds
    self.pending = list(parts)

  def left(self) -> float:
    return self.deadline - time.monotonic() - RESERVE_SECONDS

  def start(self, part: str) -> float:
    """The seconds `part` may use: its share of what is left among the parts not yet run."""
    share = SHARES[part] / sum(SHARES[p] for p in self.pending)
    self.pending.remove(part)
    return max(0.0, self.left() * share)


def run_process(command: list[str], seconds: float, env: dict | None = None,
                stop_when=None, watch=None) -> dict:
  """Runs `command` for at most `seconds`: then SIGTERM (a run checkpoints and exits 143), and
  SIGKILL GRACE_SECONDS later. `stop_when()`, polled every 50 ms, may ask for the SIGTERM
  earlier (True); `watch(line, elapsed)` sees each stderr line as it comes. Returns its exit
  code, seconds, whether it was stopped, its stderr lines (with the seconds each came at) and
  stdout."""
  start = time.monotonic()
  proc = subprocess.Popen(command, cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, errors="replace")
  lines: list[tuple[float, str]] = []

  def read_stderr():
    for line in proc.stderr:
      elapsed = time.monotonic() - start
      lines.append((elapsed, line.rstrip("\n")))
      if watch is not None:
        watch(line, elapsed)

  reader = threading.Thread(target=read_stderr, daemon=True)
  reader.start()
  out_chunks: list[str] = []
  out_reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
  out_reader.start()
  stopped = False
  while proc.poll() is None:
    if time.monotonic() - start > seconds or (stop_when is not None and stop_when()):
      stopped = True
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(GRACE_SECONDS)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
      break
    time.sleep(0.05)
  reader.join(5)
  out_reader.join(5)
  return {"rc": proc.returncode, "seconds": time.monotonic() - start, "stopped": stopped,
          "stderr": lines, "stdout": "".join(out_chunks)}


PROGRESS_BAR = re.compile(r"\d+/\d+ \[")  # a tqdm update: "  3%|...| 25/790 [00:04<...]"


def last_line(done: dict) -> str:
  """The process's last stderr line that is not a progress bar's update, after how the check
  stopped it if it did."""
  lines = [part for _, line in done["stderr"] for part in line.split("\r")
           if part.strip() and not PROGRESS_BAR.search(part)]
  text = lines[-1][:300] if lines else "(no output)"
  if done["stopped"]:
    how = "SIGKILL" if done["rc"] == -signal.SIGKILL else "SIGTERM"
    text = f"stopped by the check ({how} after {done['seconds']:.0f} s): {text}"
  return text


# ----------------------------------------------------------------------------------------------
# demo: the embedded stream on the device and on this machine's CPU.

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
          _demo_command(args.demo_config, workdir, fidelity, _cache(args, work, "cpu")),
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
                                     _cache(args, work, "device"), precision), left)
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


# ----------------------------------------------------------------------------------------------
# steps: launch/bench.py's table.

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


# ----------------------------------------------------------------------------------------------
# stream: Split CIFAR-100's shape, stopped, resumed, measured and extrapolated.

def stream_overrides(args: argparse.Namespace, dtype: str = "float32") -> dict:
  """configs/split_cifar100.py's keys changed for the stream: bench.py's stream (synthetic
  CIFAR-shaped images resized on the device, a random backbone of `--size`'s shape) in
  model.compute_dtype `dtype`, with this check's cadence flags."""
  from launch import bench

  out = bench.stream_overrides(args.size, args.stream_train, args.stream_test,
                               args.stream_classes, args.stream_tasks)
  out["model.compute_dtype"] = dtype
  if args.stream_eval_every:
    out["eval.eval_every"] = args.stream_eval_every
  if args.stream_checkpoint_every:
    out["checkpoint_every"] = args.stream_checkpoint_every
  return out


def stream_config(args: argparse.Namespace, dtype: str = "float32"):
  from configs import split_cifar100
  from launch import bench

  return bench.apply_overrides(split_cifar100.get_config(), stream_overrides(args, dtype))


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
  deadline = time.monotonic() + seconds
  workdir, cache = os.path.join(work, f"stream_{dtype}"), _cache(args, work, "stream")
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
  out["checkpoint_bytes"] = _tree_bytes(os.path.join(workdir, "checkpoints",
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


def _tree_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(directory) for name in names)


# ----------------------------------------------------------------------------------------------
# The report.

def _cache(args: argparse.Namespace, work: str, name: str) -> str:
  """The persistent compilation cache of a part's runs: --compilation_cache, or a fresh one in
  the check's temporary directory (the first run compiles cold, as a user's first run does)."""
  return args.compilation_cache or os.path.join(work, f"cache_{name}")


def _fmt(v, spec: str = ".1f") -> str:
  return "-" if v is None else format(v, spec)


def stream_text(stream: dict) -> list[str]:
  """One stream's lines of the report."""
  lines = []
  if "skipped" in stream:
    return [f"{stream['compute_dtype']}: skipped ({stream['skipped']})"]
  if "error" in stream and "whole_stream" not in stream:
    lines.append(f"{stream.get('compute_dtype', '')} error: {stream['error']}")
  else:
    w = stream["whole_stream"]
    lines += [f"{stream['size']} {stream['fidelity']} {stream['compute_dtype']},"
              f" {stream['train_images']} train / {stream['test_images']} test images,"
              f" {stream['classes']} classes in {stream['tasks']} tasks, batch"
              f" {stream['batch_size']}, {stream['n_steps']} steps,"
              f" {stream['n_evaluations']} evaluations; ran {stream['steps_done']} steps in"
              f" {len(stream['segments'])} processes (exits "
              f"{', '.join(str(s['rc']) for s in stream['segments'])})", "",
              "| part | measured s | whole stream s |", "|---|---|---|"]
    for key in ("setup_seconds", "step_seconds", "eval_seconds", "host_wait_seconds",
                "checkpoint_seconds"):
      lines.append(f"| {key.removesuffix('_seconds')} | {_fmt(stream[key])} |"
                   f" {_fmt(w[key])} |")
    other = stream["loop_seconds"] - sum(stream[k] or 0 for k in (
        "step_seconds", "eval_seconds", "host_wait_seconds", "checkpoint_seconds"))
    lines += [f"| other (host hooks, logging) | {other:.1f} | {_fmt(w['other_seconds'])} |",
              f"| compile (inside the above) | {_fmt(stream['compile_seconds'])} | |",
              f"| total | {stream['process_seconds']:.1f} ({len(stream['segments'])} processes) |"
              f" {_fmt(w['total_seconds'])} ({'measured' if w['measured'] else 'extrapolated'})"
              " |", "",
              f"steady samples/s {_fmt(stream['steady_samples_per_second'])}; resume: "
              + (stream.get("resume_skipped") or "process start to the restored state"
                 f" {_fmt(stream.get('resume_seconds'))} s") + "; checkpoint"
              f" {stream['checkpoint_bytes'] / 1e6:.1f} MB, {stream['n_checkpoints']} saves in"
              f" {_fmt(stream['checkpoint_seconds'])} s; peak device memory"
              f" {_fmt(stream['peak_device_bytes'], '.3g')} B",
              f"whole stream / the paper's {PAPER_SECONDS} s on an A100 (their code):"
              f" {_fmt(stream['vs_paper'], '.2f')}"]
  if stream.get("eval_images_per_s") is not None:
    lines.append(f"evaluation: {stream['eval_images']} test images at"
                 f" {stream['eval_images_per_s']:.0f} images/s (compile included)")
  if stream.get("warm_compile_seconds") is not None:
    lines.append(f"compilation: {stream['cold_compile_seconds']:.1f} s in the first process"
                 f" (cold persistent cache), {stream['warm_compile_seconds']:.1f} s in the"
                 " resumed one (warm)")
  return lines


def report_text(report: dict) -> str:
  """The check as Markdown."""
  from launch import bench

  v = report["versions"]
  lines = ["# Device check", "", f"device: {report['device']}",
           "versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k]),
           f"budget: {report['budget_seconds']:.0f} s, used {report['seconds']:.0f} s"]
  if report.get("peaks_gflops"):
    lines.append("measured matmul peak (GFLOP/s): " + ", ".join(
        f"{k} {x:.1f}" for k, x in report["peaks_gflops"].items()))
  demo = report.get("demo")
  if demo:
    lines += ["", "## The demo on the device against the CPU", "",
              "| run | precision | device s | CPU s | same plateaus / task ends | A_final device"
              " / CPU | max rel. diff accuracy | max rel. diff train loss | within tolerance |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, row in demo.items():
      if "skipped" in row or "error" in row:
        lines.append(f"| {name} | | | | {row.get('skipped') or row.get('error')} | | | | |")
        continue
      c = row.get("comparison", {})
      if "error" in c or not c:
        lines.append(f"| {name} | {row['matmul_precision']} | {row['seconds']:.1f} | | "
                     f"{c.get('error', 'not compared')} | | | | |")
        continue
      lines.append(
          f"| {name} | {row['matmul_precision']} | {row['seconds']:.1f} |"
          f" {_fmt(row['cpu_seconds'])} | {c['same_plateau_steps']} / {c['same_task_ends']} |"
          f" {c['A_final'][0]:.4f} / {c['A_final'][1]:.4f} | {c['accuracy_max_rel_diff']:.2e} |"
          f" {c['loss_max_rel_diff']:.2e} | {c['within_tolerance']} |")
    lines.append(f"(tolerance: accuracies {DEMO_RTOL['accuracy']:g}, train losses"
                 f" {DEMO_RTOL['loss']:g}, relative to the compared values' scale)")
  steps = report.get("steps")
  if steps:
    steps = steps + report.get("steps_scanned", [])  # the scanned row below the unrolled ones
    done = [r for r in steps if "step_ms_median" in r]
    lines += ["", "## Train step", ""]
    if done:
      lines.append(bench.table(done))
    lines += [f"- {r['size']} {r['fidelity']} {r['compute_dtype']}"
              f"{' scanned' if r.get('scan_blocks') else ''}: "
              f"{r.get('error') or r.get('skipped')}" for r in steps if "step_ms_median" not in r]
  stream = report.get("stream")
  if stream:
    lines += ["", "## Split CIFAR-100's shape end to end", ""]
    for one in (stream, *report.get("stream_other_dtypes", {}).values()):
      lines += stream_text(one) + [""]
  torch_rows = report.get("torch_steps")
  if torch_rows is not None:
    lines.append("")
    for row in torch_rows:
      lines.append(f"torch_step.py {row['size']}: " + (
          row["error"] if "error" in row else
          f"{row['device']}, step median {1e3 * row['step_s_median']:.1f} ms, min"
          f" {1e3 * row['step_s_min']:.1f} ms ({row['images']} images, reference float32)"))
    if not torch_rows:
      lines.append("torch_step.py: PyTorch is not importable here (skipped)")
  for part, why in report["skipped"].items():
    lines.append(f"- {part}: skipped ({why})")
  return "\n".join(lines) + "\n"


def _write(out_dir: str, report: dict) -> None:
  text = report_text(report)
  for name, content in (("device_check.json", json.dumps(report, indent=1, default=str)),
                        ("device_check.md", text)):
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
      f.write(content)
    os.replace(tmp, os.path.join(out_dir, name))


def main(argv: list[str] | None = None) -> dict:
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
  from launch import bench

  if args.size not in bench.SIZES:
    raise SystemExit(f"error: --size={args.size!r}: use one of {bench.SIZES}")
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
  peaks = {dtype: bench.matmul_peak_flops(args.peak_n or None, dtype=dtype)
           for dtype in bench.DTYPES}
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
        report["torch_steps"] = bench.torch_steps([{"size": args.size}], args.batch_size,
                                                  args.warmup, args.steps, timeout=seconds)
      report.setdefault("part_seconds", {})[part] = time.monotonic() - part_start
      report["seconds"] = time.monotonic() - start
      _write(args.out_dir, report)  # what is done so far survives a later part's failure
  report["seconds"] = time.monotonic() - start
  _write(args.out_dir, report)
  print(report_text(report), flush=True)
  return report


if __name__ == "__main__":
  main()
