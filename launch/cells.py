"""A sweep's cells: one run each, its exit recorded in its workdir, its state read back from there.

A cell is one `launch/run.py` command and its workdir. `run_cell` runs it (locally or as one
task of a SLURM array: the same function) and keeps, in WORKDIR/exit.json, what happened:

    {"state": "running", "pid": ..., "host": ..., "since": ..., "slurm_task": ...}   while it runs
    {"state": "exited", "code": 0, "line": "", "seconds": ..., ...}                  when it ends

`line` is the run's last `error: ...` line (launch/run.py ends stderr with one on every non-zero
exit). A cell is finished when its workdir holds results.json and its record, if it has one,
says exit 0: a run that wrote results.json and then failed (exit 1 while drawing its figures, say)
is not finished and runs again. `cell_status` reads only the workdir (no scheduler, no
accounting), so `launch/sweep.py --status ROOT` works for local and SLURM sweeps alike.

The sweep's plan, ROOT/sweep.json, lists every cell any invocation on ROOT asked for, in the
order first asked (a cell keeps its index: it is the SLURM array index).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

EXIT_RECORD = "exit.json"
PLAN = "sweep.json"
EXIT_SIGNAL_BASE = 128  # olora_jax/errors.py: 128 + signal number


def now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def read_record(workdir: str) -> dict | None:
  """The cell's exit record, or None (none written, or unreadable: a half-written one)."""
  try:
    with open(os.path.join(workdir, EXIT_RECORD)) as f:
      record = json.load(f)
    return record if isinstance(record, dict) else None
  except (OSError, ValueError):
    return None


def write_record(workdir: str, record: dict) -> None:
  """Writes the record whole or not at all (a reader never sees half of it)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, EXIT_RECORD)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, path)


def is_finished(workdir: str) -> bool:
  """results.json written and no record of a non-zero exit after it."""
  if not os.path.isfile(os.path.join(workdir, "results.json")):
    return False
  record = read_record(workdir)
  return record is None or (record.get("state") == "exited" and record.get("code") == 0)


def signal_code(code: int) -> int:
  """Popen's -s (killed by signal s) as the shell's 128 + s."""
  return EXIT_SIGNAL_BASE - code if code < 0 else code


def is_signal(code: int) -> bool:
  return code > EXIT_SIGNAL_BASE


def _error_line(tail: bytes) -> str:
  """The last `error: ...` line of the run's stderr (its one-line reason), '' if none."""
  for line in reversed(tail.decode(errors="replace").replace("\r", "\n").splitlines()):
    if line.startswith("error: "):
      return line[len("error: "):].strip()
  return ""


def run_cell(workdir: str, command: list[str]) -> tuple[int, str]:
  """Runs `command` to its end, passing its stderr through, and records its exit in `workdir`;
  (exit code, one-line reason). SIGINT and SIGTERM sent to this process are passed on to the run
  once (it is in its own session, so a terminal's Ctrl-C reaches this process alone), which
  checkpoints its current step and exits 128 + signal. A run refused because another process
  holds the workdir leaves that process's record alone."""
  job = os.environ.get("SLURM_ARRAY_JOB_ID")
  task = f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if job else None
  before = read_record(workdir)
  start, since = time.monotonic(), now()
  proc = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
  running = {"state": "running", "pid": proc.pid, "host": socket.gethostname(), "since": since,
             "slurm_task": task, "command": command}
  _try_write(workdir, running)
  forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
  handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  tail = b""
  try:
    fd = proc.stderr.fileno()
    while chunk := os.read(fd, 65536):
      sys.stderr.buffer.write(chunk)
      sys.stderr.buffer.flush()
      tail = (tail + chunk)[-8192:]
    code = signal_code(proc.wait())
  finally:
    for s, handler in handlers.items():
      signal.signal(s, handler)
  line = _error_line(tail)
  if not line and is_signal(code):
    line = f"killed by signal {code - EXIT_SIGNAL_BASE} before it could checkpoint"
  elif not line and code:
    line = f"exited {code} without an error line; see its output"
  if " is in use by " in line:  # WorkdirBusy: the record belongs to the run holding the workdir
    if before is not None:
      _try_write(workdir, before)
    return code, line
  _try_write(workdir, {**running, "state": "exited", "code": code, "line": line, "ended": now(),
                       "seconds": round(time.monotonic() - start, 1)})
  return code, line


def _try_write(workdir: str, record: dict) -> None:
  """A workdir that cannot be written fails the run itself (exit 4, with its line): the record
  is then left out, not a second error."""
  try:
    write_record(workdir, record)
  except OSError:
    pass


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _progress(workdir: str) -> str:
  """'step N of M' from the run log's last line and the stream manifest ('' before either)."""
  try:
    with open(os.path.join(workdir, "stream_manifest.json")) as f:
      total = len(json.load(f)["steps"])
  except (OSError, ValueError, KeyError, TypeError):
    return ""
  step = 0
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 4096))
      for line in reversed(f.read().splitlines()):
        try:
          step = int(json.loads(line)["step"]) + 1
          break
        except (ValueError, KeyError, TypeError):
          continue
  except OSError:
    pass
  return f"step {step} of {total}"


def cell_status(workdir: str) -> tuple[str, str]:
  """(state, detail) of a cell from its workdir alone: state is one of 'finished', 'running',
  'failed', 'stopped', 'not started'."""
  record = read_record(workdir)
  if is_finished(workdir):
    seconds = record.get("seconds") if record else None
    return "finished", f"{seconds:.0f} s" if seconds is not None else ""
  if record is None:
    if not any(os.path.exists(os.path.join(workdir, f))
               for f in ("config.json", "metrics.jsonl", "checkpoints")):
      return "not started", ""
    progress = _progress(workdir)
    return "stopped", "no exit recorded (a run started outside a sweep?)" + (
        f", {progress}" if progress else "")
  where = f"pid {record.get('pid')} on {record.get('host')}"
  if record.get("slurm_task"):
    where += f", SLURM task {record['slurm_task']}"
  if record.get("state") == "running":
    progress = _progress(workdir) or "setting up"
    if record.get("host") == socket.gethostname() and not _pid_alive(int(record.get("pid", 0))):
      return "stopped", f"killed ({where} is gone, no exit recorded), {progress}"
    return "running", f"{progress} ({where}, since {record.get('since')})"
  code, line = record.get("code"), record.get("line") or "(no error line)"
  progress = _progress(workdir)
  if is_signal(int(code)):
    return "stopped", (f"exit {code}: {line}" + (f"; checkpointed at {progress}" if progress
                                                  else ""))
  return "failed", f"exit {code}: {line}"


def load_plan(root: str) -> list[dict]:
  """The cells of ROOT/sweep.json ([] when there is none)."""
  try:
    with open(os.path.join(root, PLAN)) as f:
      return json.load(f)["cells"]
  except FileNotFoundError:
    return []


def merged_plan(root: str, new: list[dict]) -> list[dict]:
  """ROOT/sweep.json's cells plus those of `new` not in it (by workdir, appended in order; a
  cell already there takes the new command): a cell keeps its index."""
  merged = load_plan(root)
  index = {c["workdir"]: i for i, c in enumerate(merged)}
  for cell in new:
    if cell["workdir"] in index:
      merged[index[cell["workdir"]]] = cell
    else:
      index[cell["workdir"]] = len(merged)
      merged.append(cell)
  return merged


def write_plan(root: str, plan: list[dict]) -> None:
  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, PLAN)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump({"cells": plan}, f, indent=1)
  os.replace(tmp, path)


def status_lines(root: str) -> tuple[list[str], dict]:
  """One line per cell of ROOT's plan (plus workdirs under ROOT holding an exit record that the
  plan lacks), and the count of each state."""
  workdirs = [c["workdir"] for c in load_plan(root)]
  known = {os.path.abspath(w) for w in workdirs}
  for folder, _, files in sorted(os.walk(root)):
    if EXIT_RECORD in files and os.path.abspath(folder) not in known:
      workdirs.append(folder)
  lines, counts = [], {}
  for workdir in workdirs:
    state, detail = cell_status(workdir)
    counts[state] = counts.get(state, 0) + 1
    lines.append(f"{workdir}: {state}" + (f", {detail}" if detail else ""))
  return lines, counts
