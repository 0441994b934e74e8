"""A sweep as one SLURM job array: the batch script `launch/sweep.py --launcher slurm` writes and
submits (`submit_sweep`; docs/cluster.md explains it line by line), what a task does when its
cell ends (`run_task`: requeue, --fail_fast), what the scheduler says of each task (for
`--status`), and `--cancel` (`cancel_sweep`).

One script for the whole grid, ROOT/slurm/sweep.sbatch; array task i runs cell i of ROOT/sweep.json
through `launch/sweep.py --run_cell ROOT i` (`run_task`), with the function the local sweep runs
each cell with (olora_jax/sweep/cells.py: a finished cell is skipped, a stopped one resumes, the
exit is recorded).

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
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from olora_jax import errors
from olora_jax.sweep import cells
from olora_jax.sweep.plan import Sweep, choose, grid_cells, stale_pick
from olora_jax.sweep.status import cell_status

SCRIPT = "sweep.sbatch"
CACHE = "jax_cache"  # ROOT/jax_cache: the compilation cache every cell shares by default
# launch/sweep.py, which the batch script runs each cell through (`--run_cell`).
LAUNCHER = str(pathlib.Path(__file__).resolve().parents[2] / "launch" / "sweep.py")
SIGNAL_LEAD = 120  # s before the time limit: the checkpoint of a large model's step fits
MAX_REQUEUES = 50
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


@dataclasses.dataclass
class Options:
  """How a sweep's job array runs (`launch/sweep.py`'s --launcher slurm flags of the same names;
  docs/cluster.md): the #SBATCH values `partition`, `time` (one cell's task), `mem`, `gres`
  (text; '': the cluster's default), `cpus` per cell, `sbatch` (extra #SBATCH lines) and `setup`
  (lines the batch script runs first); at most `throttle` cells at once (0: no limit); SIGUSR1
  `signal_lead` seconds before the time limit; a cell requeued at most `max_requeues` times,
  after the scheduler's signals and the exit codes `requeue_on`; `ntasks` processes per cell
  (`gpus_per_task` GPUs each) under srun; `compilation_cache`, the cache every cell shares
  (None: ROOT/jax_cache; 'off': each run's own default)."""

  partition: str = ""
  time: str = ""
  mem: str = ""
  gres: str = ""
  cpus: int = 1
  throttle: int = 0
  sbatch: list[str] = ()
  signal_lead: int = SIGNAL_LEAD
  max_requeues: int = MAX_REQUEUES
  requeue_on: list[int] = ()
  ntasks: int = 1
  gpus_per_task: int = 0
  setup: list[str] = ()
  compilation_cache: str | None = None


def options_problem(options: Options) -> str | None:
  """One line naming the first value of `options` sbatch or the cells could not run with (a
  count below its least, a SIGUSR1 lead not shorter than the time limit, GPUs asked for twice),
  else None."""
  for flag, low in (("cpus", 1), ("throttle", 0), ("signal_lead", 1), ("max_requeues", 0),
                    ("ntasks", 1), ("gpus_per_task", 0)):
    if getattr(options, flag) < low:
      return f"--{flag}={getattr(options, flag)} must be >= {low}"
  limit = time_seconds(options.time) if options.time else None
  if limit is not None and options.signal_lead >= limit:
    return (f"--signal_lead={options.signal_lead} is not shorter than --time={options.time}"
            f" ({limit} s): the warning would come before the cell could run; give a"
            f" --signal_lead below {limit} (a step plus a checkpoint save) or a longer"
            " --time")
  if options.gpus_per_task and options.gres.startswith("gpu"):
    return "--gpus_per_task and --gres=gpu:... both ask for GPUs; give one of them"
  return None


def submit_sweep(sweep: Sweep, options: Options, launcher: str = LAUNCHER,
                 prog: str = "launch/sweep.py") -> int:
  """Writes the batch script and submits the cells not finished: the tuning points and the
  untuned cells as one array, the seeds picked by tuning as a second array that starts when the
  first has ended. sweep.json is read, extended and written under its lock, around the
  submission: two submissions into one root at once each get their own cells."""
  grid = grid_cells(sweep)
  if options.ntasks > 1:
    for cell in grid:
      cell["command"] = cell["command"] + ["--config.distributed.initialize=cluster"]
  root = os.path.abspath(sweep.root)
  cache = "" if options.compilation_cache == "off" else os.path.abspath(
      options.compilation_cache or os.path.join(root, CACHE))
  script = batch_script(
      root, sys.executable, launcher, os.getcwd(), partition=options.partition,
      time=options.time, mem=options.mem, cpus=options.cpus, gres=options.gres,
      signal_lead=options.signal_lead, extra=options.sbatch, ntasks=options.ntasks,
      gpus_per_task=options.gpus_per_task, setup=options.setup, cache=cache)
  path = os.path.join(root, "slurm", SCRIPT)
  if sweep.dry_run:
    merged = cells.merged_plan(sweep.root, grid)
    first, second = _arrays(grid, merged, _say_active(merged, _active(grid, merged)))
    print(f"--- {path}\n{script}---")
    if first:
      print(sbatch_command(path, first, options.throttle, None))
    if second:
      print(sbatch_command(path, second, options.throttle,
                           "<the first array's job id>" if first else None))
    return 0
  with cells.plan_lock(sweep.root):
    merged = cells.merged_plan(sweep.root, grid)
    first, second = _arrays(grid, merged, _say_active(merged, _active(grid, merged)))
    if not first and not second:
      return 0
    refused = test_only(script, first or second, options.throttle)
    if refused:
      print(f"error: {refused}", file=sys.stderr)
      return errors.EXIT_BAD_INPUT
    os.makedirs(os.path.join(root, "slurm", "logs"), exist_ok=True)
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
      f.write(script)
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    # The cells are in sweep.json before any task can start (a task reads it under the lock).
    cells.write_plan(sweep.root, merged)
    clear_cancelled(sweep.root)  # an earlier --cancel: this submission runs again
    jobs, submitted = [], {}
    for indices in (first, second):
      if indices:
        try:
          job = submit(path, indices, options.throttle, after=jobs[-1] if jobs else None)
        except RuntimeError as e:
          print(f"error: {e}", file=sys.stderr)
          break
        jobs.append(job)
        submitted.update({i: job for i in indices})
        print(f"submitted job array {job}: cells {array_ranges(indices)} (logs in"
              f" {root}/slurm/logs/{job}_<cell>.out)")
    for i, job in submitted.items():
      merged[i] = {**merged[i], "slurm": {
          "task": f"{job}_{i}", "jobs": jobs, "max_requeues": options.max_requeues,
          "requeue_on": options.requeue_on, "fail_fast": sweep.fail_fast, "ntasks": options.ntasks,
          "cpus": options.cpus}}
    cells.write_plan(sweep.root, merged, {"jobs": jobs, "submitted": cells.now(),
                                          "cells": sorted(submitted)})
  if len(submitted) < len(first) + len(second):
    return errors.EXIT_ENVIRONMENT
  print(f"see their state with: {prog} --status {sweep.root}")
  return 0


def _arrays(grid: list[dict], merged: list[dict], active: dict[int, str]
            ) -> tuple[list[int], list[int]]:
  """The plan indices of the cells to submit: (the first array, the tuned seeds after it); not
  the finished cells, nor those `active` (queued or running), and says how many of each."""
  index = {os.path.abspath(c["workdir"]): i for i, c in enumerate(merged)}
  todo = [c for c in grid if not cells.is_finished(c["workdir"])]
  first = [index[os.path.abspath(c["workdir"])] for c in todo if not c["tuning"]]
  second = [index[os.path.abspath(c["workdir"])] for c in todo if c["tuning"]]
  first, second = ([i for i in first if i not in active], [i for i in second if i not in active])
  print(f"{len(grid)} cells, {len(grid) - len(todo)} finished,"
        + (f" {len(todo) - len(first) - len(second)} queued or running," if active else "")
        + f" {len(first) + len(second)} to submit")
  return first, second


def _active(grid: list[dict], merged: list[dict]) -> dict[int, str]:
  """The plan indices of the grid's cells that an earlier submission's array task still holds
  (queued or running: submitting them again would queue a duplicate, which its run would refuse
  once it found the cell busy), each with what holds it. The scheduler says; where it cannot be
  asked, a cell whose record says running with a live runner (`cells._live_elsewhere`)."""
  index = {os.path.abspath(c["workdir"]): i for i, c in enumerate(merged)}
  wanted = [index[os.path.abspath(c["workdir"])] for c in grid
            if not cells.is_finished(c["workdir"])]
  held = {i: merged[i]["slurm"]["task"] for i in wanted if merged[i].get("slurm")}
  answers = tasks(sorted(set(held.values()))) if held else None
  active = {}
  for i in wanted:
    task = held.get(i)
    if answers is not None and task in answers:
      if answers[task]["state"] in ACTIVE:
        active[i] = f"SLURM task {task}, {answers[task]['state']}"
    elif cells._live_elsewhere(cells.read_record(merged[i]["workdir"]), None):
      active[i] = "its record says running, with a live runner"
  return active


def _say_active(merged: list[dict], active: dict[int, str]) -> dict[int, str]:
  for i, what in sorted(active.items()):
    print(f"{merged[i]['workdir']}: already queued or running ({what}): not submitted again")
  return active


def run_task(root: str, index: str) -> int:
  """One task of the SLURM array: cell `index` of ROOT/sweep.json, as the local sweep runs it;
  then what its exit asks of the scheduler: a requeue (only after the scheduler's signals, or
  the codes of --requeue_on, up to --max_requeues), or, with --fail_fast, the sweep's pending
  tasks cancelled."""
  with cells.plan_lock(root):  # waits for a submission still writing it
    plan = cells.load_plan(root)
  if not index.isdigit() or int(index) >= len(plan):
    print(f"error: --run_cell {root} {index}: its {cells.PLAN} has cells 0 to {len(plan) - 1};"
          " give one of those (the SLURM array index)", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  cell = plan[int(index)]
  workdir, command = cell["workdir"], cell["command"]
  job = cell.get("slurm") or {}
  if cells.is_finished(workdir):
    print(f"{workdir}: finished, skipped", flush=True)
    if cell.get("tuning") and (note := stale_pick(workdir)):
      print(note, file=sys.stderr, flush=True)
    return 0
  if cell.get("tuning"):
    try:
      command = command + choose(cell["tuning"])
    except (RuntimeError, ValueError) as e:
      exited = {"state": "exited", "code": errors.EXIT_ENVIRONMENT, "line": str(e),
                "ended": cells.now()}
      cells.update_record(workdir, lambda _: exited)
      print(f"error: {e}", file=sys.stderr)
      return errors.EXIT_ENVIRONMENT
  forward = None
  if job.get("ntasks", 1) > 1:  # one run over N processes: srun starts them
    command = ["srun", f"--ntasks={job['ntasks']}", f"--cpus-per-task={job.get('cpus', 1)}",
               *command]
    forward = lambda proc, signum: signal_step(signum)  # noqa: E731  (never to srun)
  state = cell_status(workdir)[0]
  print(f"{workdir}: {'starting' if state == 'not started' else 'resuming'}", flush=True)
  code, line, signalled = cells.run_cell(workdir, command, forward=forward)
  task = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{index}"
  why = requeue_reason(code, signalled, job.get("requeue_on", []))
  restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
  most = job.get("max_requeues", MAX_REQUEUES)
  note = None
  cancelled_by = cancelled(root, os.environ.get("SLURM_ARRAY_JOB_ID"))
  if why and cancelled_by:
    note = f"{why}: not requeued, the sweep was cancelled ({cancelled_by})"
  elif why and restarts < most:
    print(f"[{cells.now()}] {why}: requeueing {task} (requeue {restarts + 1} of at most"
          f" {most})", file=sys.stderr, flush=True)
    refused = requeue(task)
    if refused:
      note = f"{why}, but scontrol requeue refused: {refused}"
  elif why:
    note = (f"{why}: not requeued, --max_requeues={most} reached; submit the same command to"
            " resume it from its newest checkpoint")
  elif code and line.startswith("killed by the out-of-memory killer"):
    note = f"exit {code} (the out-of-memory killer, as its memory cgroup counted): not requeued;" \
           f" {cells.OOM_ADVICE}"
  elif code and cells.is_signal(code):
    note = (f"exit {code} ({cells.signal_name(code)}, not the scheduler's signal, and no"
            " out-of-memory kill in its memory cgroup's count: a kill): not requeued;"
            f" --requeue_on={code} requeues it")
  elif code and job.get("fail_fast"):
    others = [j for j in job.get("jobs", []) if j]
    note = (f"--fail_fast: cell {index} failed (exit {code}): cancelling the sweep's tasks not"
            f" started (jobs {', '.join(others)}); the running ones finish")
    refused = cancel_pending(others)
    if refused:
      note += f"; scancel refused: {refused}"
  if note:
    print(f"[{cells.now()}] {note}", file=sys.stderr, flush=True)
    if code != 0 and line != "finished earlier":
      cells.update_record(workdir, lambda current: {**current, "note": note}
                          if current and current.get("state") == "exited" else None)
  return code


def cancel_sweep(root: str, prog: str = "launch/sweep.py") -> int:
  """`--cancel ROOT`: marks the sweep cancelled (ROOT/slurm/cancelled.json, which its tasks read
  before requeueing themselves and a new submission removes), then cancels every job it
  submitted: the running tasks get SLURM's SIGTERM, their runs checkpoint and exit 143 and are
  not requeued; the pending ones never start."""
  if not os.path.isdir(root):
    print(f"error: {cells.root_problem(root, '--cancel') or f'--cancel {root}: no such directory'};"
          " give a sweep's --root", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  with cells.plan_lock(root):
    _, submissions = cells.load_plan(root, with_submissions=True)
    jobs = sorted({str(j) for s in submissions for j in s.get("jobs", []) if j}, key=int)
    if not jobs:
      print(f"error: --cancel {root}: no SLURM job in its {cells.PLAN}: nothing to cancel (a"
            " local sweep stops with Ctrl-C or SIGTERM to its process)", file=sys.stderr)
      return errors.EXIT_BAD_INPUT
    mark_cancelled(root, jobs)
  refused = cancel(jobs)
  if refused:
    print(f"error: scancel {' '.join(jobs)} refused: {refused}", file=sys.stderr)
    return errors.EXIT_ENVIRONMENT
  print(f"cancelled job(s) {', '.join(jobs)}: running cells checkpoint and stop (not requeued),"
        f" queued ones will not start; {prog} --status {root} shows where each stopped,"
        " and the same sweep command resumes it")
  return 0
