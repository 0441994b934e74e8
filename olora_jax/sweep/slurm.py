"""A sweep as one SLURM job array: the batch script `launch/sweep.py --launcher slurm` writes and
submits (docs/cluster.md explains it line by line), what a task does when its cell ends
(requeue, --fail_fast), and what the scheduler says of each task (for `--status`).

One script for the whole grid, ROOT/slurm/sweep.sbatch; array task i runs cell i of ROOT/sweep.json
through `launch/sweep.py --run_cell ROOT i`, the function the local sweep runs each cell with
(launch/cells.py: a finished cell is skipped, a stopped one resumes, the exit is recorded).

Time limits and preemption: the script asks for `--signal=B:USR1@LEAD` (the batch shell alone
gets SIGUSR1 LEAD seconds, or up to 60 s more, before the time limit) and `--requeue`. On the
signal it sends SIGTERM to the cell's runner (never to srun: srun would kill the tasks outright,
without a checkpoint), which passes it to the run (a multi-process cell's runner signals the
tasks of its srun step with `scancel --signal`); the run checkpoints the end of its step and
exits 143; the runner then requeues its own array task (`scontrol requeue JOB_TASK`), which
resumes from that checkpoint. Only the scheduler's signals requeue (`requeue_reason`): a task
signalled by it (time limit, preemption, `scancel --signal`) or a run stopped by SIGTERM; SIGKILL
(the out-of-memory killer) and every other exit are final unless named in --requeue_on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess

from launch import cells

SCRIPT = "sweep.sbatch"
CACHE = "jax_cache"  # ROOT/jax_cache: the compilation cache every cell shares by default
# The scheduler's states of a task that still runs or will (squeue's long names).
ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
          "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT")


def array_ranges(indices: list[int]) -> str:
  """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
  parts, start = [], None
  for i, index in enumerate(indices):
    if start is None:
      start = index
    if i + 1 == len(indices) or indices[i + 1] != index + 1:
      parts.append(f"{start}-{index}" if index != start else f"{start}")
      start = None
  return ",".join(parts)


def time_seconds(text: str) -> int | None:
  """SLURM's --time forms (minutes, minutes:seconds, hours:minutes:seconds, days-hours,
  days-hours:minutes, days-hours:minutes:seconds) in seconds; None for '' or a form sbatch
  would refuse (sbatch --test-only names it) or no limit ('infinite', 'unlimited')."""
  m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
  if not m:
    return None
  days, a, b, c = (int(x) if x is not None else None for x in m.groups())
  if days is not None:  # days-hours[:minutes[:seconds]]
    return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
  if c is not None:  # hours:minutes:seconds
    return a * 3600 + b * 60 + c
  if b is not None:  # minutes:seconds
    return a * 60 + b
  return a * 60


def batch_script(root: str, python: str, sweep: str, chdir: str, *, partition: str, time: str,
                 mem: str, cpus: int, gres: str, signal_lead: int, extra: list[str],
                 ntasks: int = 1, gpus_per_task: int = 0, setup: list[str] = (),
                 cache: str = "") -> str:
  """The batch script of every cell of ROOT (the array's indices are given to sbatch)."""
  logs = os.path.join(root, "slurm", "logs")
  lines = ["#!/bin/bash",
           "# One task of the sweep's job array: runs cell $SLURM_ARRAY_TASK_ID of sweep.json.",
           "# Written by launch/sweep.py --launcher slurm; docs/cluster.md explains it.",
           "#SBATCH --job-name=olora-sweep",
           f"#SBATCH --chdir={chdir}",
           f"#SBATCH --output={logs}/%A_%a.out",
           "#SBATCH --open-mode=append",
           f"#SBATCH --ntasks={ntasks}",
           f"#SBATCH --cpus-per-task={cpus}"]
  lines += [f"#SBATCH --gpus-per-task={gpus_per_task}"] if gpus_per_task else []
  lines += [f"#SBATCH --partition={partition}"] if partition else []
  lines += [f"#SBATCH --time={time}"] if time else []
  lines += [f"#SBATCH --mem={mem}"] if mem else []
  lines += [f"#SBATCH --gres={gres}"] if gres else []
  lines += [f"#SBATCH --signal=B:USR1@{signal_lead}", "#SBATCH --requeue"]
  lines += [line if line.startswith("#SBATCH") else f"#SBATCH {line}" for line in extra]
  task = "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
  lines += [
      "",
      f'echo "[$(date -Is)] task {task} on $(hostname): cell $SLURM_ARRAY_TASK_ID,'
      ' restart ${SLURM_RESTART_COUNT:-0}"']
  if setup:
    lines += ["# Set-up lines (--setup)."] + list(setup)
  if cache:
    lines += ["# One compilation cache for every cell of the sweep (--compilation_cache).",
              f"export JAX_COMPILATION_CACHE_DIR={shlex.quote(cache)}"]
  if gpus_per_task:
    lines += ["# --gpus-per-task: each task sees its own GPUs from ordinal 0 (jax#23452).",
              "export JAX_LOCAL_DEVICE_IDS=" + ",".join(map(str, range(gpus_per_task)))]
  lines += [
      "pid=",
      "# The time limit is near (or `scancel --signal=USR1 --batch`), or the scheduler stops",
      "# the task (preemption, scancel): the run checkpoints and exits 143. SIGTERM goes to the",
      "# runner, which passes it to the run; never to srun. A runner that has already ended",
      "# (the scheduler's SIGTERM after its warning's stop) needs nothing: kill stays quiet.",
      "# (printf starts a new line: the run's progress bar may be mid-line.)",
      'trap \'printf "\\n[%s] SIGUSR1: stopping the run\\n" "$(date -Is)"; [ -n "$pid" ] &&'
      ' kill -TERM "$pid" 2>/dev/null\' USR1',
      'trap \'printf "\\n[%s] SIGTERM (the scheduler stops or requeues the task): stopping the'
      ' run\\n" "$(date -Is)"; [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null\' TERM',
      f"{shlex.quote(python)} {shlex.quote(sweep)} --run_cell {shlex.quote(root)}"
      ' "$SLURM_ARRAY_TASK_ID" &',
      "pid=$!",
      '# `wait` returns early when the trap runs: wait again until the run has ended.',
      'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done',
      "# The runner has requeued the task if the scheduler stopped it (docs/cluster.md).",
      'wait "$pid"; code=$?',
      'echo "[$(date -Is)] exit $code"',
      'exit "$code"',
      ""]
  return "\n".join(lines)


def requeue_reason(code: int, signalled: bool, requeue_on: list[int]) -> str | None:
  """Why a cell that exited `code` is requeued ('' when it is not: None means it finished)."""
  if code == 0:
    return None
  if signalled:
    return f"stopped by the scheduler's signal, exit {code}"
  if code == cells.EXIT_SIGNAL_BASE + 15:
    return "stopped by SIGTERM (the scheduler's stop signal), exit 143"
  if code in requeue_on:
    return f"exit {code}, in --requeue_on"
  return ""


def requeue(task: str) -> str | None:
  """`scontrol requeue TASK`; None, or scontrol's line when it refuses."""
  proc = subprocess.run(["scontrol", "requeue", task], capture_output=True, text=True)
  if proc.returncode == 0:
    return None
  return (proc.stderr.strip().splitlines() or ["(no message)"])[-1]


def cancel_pending(jobs: list[str]) -> str | None:
  """Cancels the tasks of `jobs` not started yet (`scancel --state=PENDING`); None, or
  scancel's line when it fails."""
  proc = subprocess.run(["scancel", "--state=PENDING", *jobs], capture_output=True, text=True)
  if proc.returncode == 0:
    return None
  return (proc.stderr.strip().splitlines() or ["(no message)"])[-1]


CANCELLED = "cancelled.json"  # ROOT/slurm/cancelled.json: `launch/sweep.py --cancel` was run


def mark_cancelled(root: str, jobs: list[str]) -> None:
  """Records that the sweep in ROOT was cancelled (its jobs `jobs`), before they are: each task
  reads it before requeueing itself (`cancelled`)."""
  folder = os.path.join(root, "slurm")
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, CANCELLED)
  with open(f"{path}.{os.getpid()}.tmp", "w") as f:
    json.dump({"jobs": jobs, "at": cells.now()}, f)
  os.replace(f"{path}.{os.getpid()}.tmp", path)


def cancelled(root: str, job: str | None) -> str:
  """'' unless `launch/sweep.py --cancel ROOT` cancelled the array `job` (then when it did)."""
  try:
    with open(os.path.join(root, "slurm", CANCELLED)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return ""
  return (f"launch/sweep.py --cancel at {record.get('at')}"
          if job is not None and str(job) in map(str, record.get("jobs", [])) else "")


def clear_cancelled(root: str) -> None:
  """A new submission into ROOT: the earlier --cancel no longer holds."""
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(root, "slurm", CANCELLED))


def cancel(jobs: list[str]) -> str | None:
  """`scancel JOBS` (every task, running or pending); None, or scancel's line when it fails."""
  proc = subprocess.run(["scancel", *jobs], capture_output=True, text=True)
  if proc.returncode == 0:
    return None
  return (proc.stderr.strip().splitlines() or ["(no message)"])[-1]


def signal_step(signum: int) -> None:
  """Sends `signum` to the tasks of this job's srun steps, never to srun itself nor the batch
  shell (`scancel --signal` without --batch)."""
  subprocess.run(["scancel", f"--signal={signum}", os.environ["SLURM_JOB_ID"]],
                 capture_output=True)


def tasks(ids: list[str]) -> dict | None:
  """What the scheduler says of the array tasks `ids` ('JOB_INDEX'): {id: {"state", "reason",
  "exit", "restarts"}} for those it still knows (squeue, which keeps an ended task for the
  cluster's MinJobAge; sacct, where accounting exists, for older ones); None when neither can
  be asked here."""
  jobs = sorted({i.split("_")[0] for i in ids})
  found, asked = {}, False
  if shutil.which("sacct"):
    try:
      proc = subprocess.run(["sacct", "-n", "-P", "-X", "-j", ",".join(jobs), "-o",
                             "JobID,State,ExitCode"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
      proc = None
    if proc is not None and proc.returncode == 0:
      asked = True
      for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0] in ids:
          state = parts[1].split()[0] if parts[1] else ""
          code, _, sig = parts[2].partition(":")
          exit_ = f"{code}" + (f" (signal {sig})" if sig not in ("", "0") else "")
          found[parts[0]] = {"state": state, "reason": "", "exit": exit_, "restarts": 0}
  if shutil.which("squeue"):
    # One call per job: squeue refuses the whole list when one job id is no longer known.
    for job in jobs:
      try:
        proc = subprocess.run(
            ["squeue", "-h", "-r", "-t", "all", "-j", job, "-O",
             "JobArrayID:|,State:|,Reason:|,exit_code:|,RestartCnt:"],
            capture_output=True, text=True, timeout=30)
      except subprocess.TimeoutExpired:
        continue
      if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        continue  # no controller to ask
      asked = True
      for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 5 or parts[0] not in ids:
          continue
        status = int(parts[3]) if parts[3].isdigit() else 0
        exit_ = str(status >> 8) + (f" (signal {status & 0x7f})" if status & 0x7f else "")
        found[parts[0]] = {"state": parts[1], "reason": parts[2], "exit": exit_,
                           "restarts": int(parts[4]) if parts[4].isdigit() else 0}
  return found if asked else None


def check_available() -> str | None:
  """None when sbatch can be run, else the line saying what is missing."""
  if shutil.which("sbatch") is None:
    return ("sbatch is not on PATH: run --launcher slurm on a SLURM login node (or use"
            " --launcher local)")
  return None


def submit(script_path: str, indices: list[int], throttle: int, after: str | None = None
           ) -> str:
  """Submits `script_path` for the array tasks `indices` (at most `throttle` at once, 0: no
  limit), after job `after` has ended when given; returns the job id. RuntimeError with sbatch's
  own line when it refuses."""
  array = array_ranges(indices) + (f"%{throttle}" if throttle else "")
  command = ["sbatch", "--parsable", f"--array={array}"]
  if after:
    command.append(f"--dependency=afterany:{after}")
  proc = subprocess.run([*command, script_path], capture_output=True, text=True)
  if proc.returncode != 0:
    reason = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
    raise RuntimeError(f"sbatch refused the sweep: {reason}")
  return proc.stdout.strip().split(";")[0]


def test_only(script: str, indices: list[int], throttle: int) -> str | None:
  """None when sbatch would take `script` for these tasks (`sbatch --test-only`, nothing
  submitted), else sbatch's reason as one line."""
  array = array_ranges(indices) + (f"%{throttle}" if throttle else "")
  proc = subprocess.run(["sbatch", "--test-only", f"--array={array}"], input=script,
                        capture_output=True, text=True)
  if proc.returncode == 0:
    return None
  reason = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
  return (f"sbatch refuses the sweep's batch script: {reason}; fix that value and run the"
          " same command")


def sbatch_command(script_path: str, indices: list[int], throttle: int, after: str | None
                   ) -> str:
  """The sbatch command `submit` runs, for --dry_run."""
  array = array_ranges(indices) + (f"%{throttle}" if throttle else "")
  depends = f" --dependency=afterany:{after}" if after else ""
  return f"sbatch --parsable --array={array}{depends} {script_path}"
