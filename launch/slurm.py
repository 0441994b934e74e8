"""A sweep as one SLURM job array: the batch script `launch/sweep.py --launcher slurm` writes and
submits (docs/cluster.md explains it line by line).

One script for the whole grid, ROOT/slurm/sweep.sbatch; array task i runs cell i of ROOT/sweep.json
through `launch/sweep.py --run_cell ROOT i`, the function the local sweep runs each cell with
(launch/cells.py: a finished cell is skipped, a stopped one resumes, the exit is recorded).

Time limits and preemption: the script asks for `--signal=B:USR1@LEAD` (the batch shell alone
gets SIGUSR1 LEAD seconds, or up to 60 s more, before the time limit) and `--requeue`. On the
signal it sends SIGTERM to the cell's runner (never to srun: srun would kill the tasks outright,
without a checkpoint), which passes it to the run; the run checkpoints the end of its step and
exits 143; the script then requeues its own array task (`scontrol requeue JOB_TASK`), which
resumes from that checkpoint. Any cell ending with a signal's exit code (128 + s) is requeued the
same way, up to `--max_requeues` times; any other code is final: 0 finished, else failed, with
the run's one-line reason in its exit record.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

SCRIPT = "sweep.sbatch"


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


def batch_script(root: str, python: str, sweep: str, chdir: str, *, partition: str, time: str,
                 mem: str, cpus: int, gres: str, signal_lead: int, max_requeues: int,
                 extra: list[str]) -> str:
  """The batch script of every cell of ROOT (the array's indices are given to sbatch)."""
  logs = os.path.join(root, "slurm", "logs")
  lines = ["#!/bin/bash",
           "# One task of the sweep's job array: runs cell $SLURM_ARRAY_TASK_ID of sweep.json.",
           "# Written by launch/sweep.py --launcher slurm; docs/cluster.md explains it.",
           "#SBATCH --job-name=olora-sweep",
           f"#SBATCH --chdir={chdir}",
           f"#SBATCH --output={logs}/%A_%a.out",
           "#SBATCH --open-mode=append",
           "#SBATCH --ntasks=1",
           f"#SBATCH --cpus-per-task={cpus}"]
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
      ' restart ${SLURM_RESTART_COUNT:-0}"',
      "pid=",
      "# The time limit is near (or `scancel --signal=USR1 --batch`): the run checkpoints and",
      "# exits 143. SIGTERM goes to the runner, which passes it to the run; never to srun.",
      'trap \'echo "[$(date -Is)] SIGUSR1: stopping the run"; [ -n "$pid" ] && kill -TERM "$pid"\''
      " USR1",
      f"{shlex.quote(python)} {shlex.quote(sweep)} --run_cell {shlex.quote(root)}"
      ' "$SLURM_ARRAY_TASK_ID" &',
      "pid=$!",
      '# `wait` returns early when the trap runs: wait again until the run has ended.',
      'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done',
      'wait "$pid"; code=$?',
      f'if [ "$code" -gt 128 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then',
      f'  echo "[$(date -Is)] exit $code (a signal): requeueing {task}"',
      f'  scontrol requeue "{task}"',
      "fi",
      'echo "[$(date -Is)] exit $code"',
      'exit "$code"',
      ""]
  return "\n".join(lines)


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
