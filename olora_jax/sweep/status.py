"""A sweep's cells as their state: each cell's exit record (olora_jax/sweep/cells.py), its
workdir's files and, for a SLURM sweep, what the scheduler says of its array task
(olora_jax/sweep/slurm.py's `tasks`), read into one of STATES with a one-line detail.

`table(ROOT)` is that state as data, one dict per cell of ROOT/sweep.json (and per workdir under
ROOT that holds an exit record the plan lacks); `status_lines` prints it as `launch/sweep.py
--status ROOT` does, one line per cell.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from olora_jax import errors
from olora_jax.sweep.cells import (
    CHECKPOINTS,
    EXIT_RECORD,
    PLAN,
    STALE_SECONDS,
    _age,
    _pid_alive,
    is_finished,
    is_signal,
    load_plan,
    newest_checkpoint,
    plan_lock,
    read_record,
    root_problem,
)

STATES = ("finished", "running", "queued", "stopped", "lost", "failed", "not started")


def _total_steps(workdir: str) -> int | None:
  try:
    with open(os.path.join(workdir, "stream_manifest.json")) as f:
      return len(json.load(f)["steps"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def checkpoint_progress(workdir: str) -> str:
  """'checkpoint at step N of M' (the newest checkpoint: where a resume starts), 'no checkpoint
  yet' before one, '' before the stream is known."""
  total, step = _total_steps(workdir), newest_checkpoint(workdir)
  if step is None:
    return "no checkpoint yet" if total is not None else ""
  return f"checkpoint at step {step}" + (f" of {total}" if total is not None else "")


def _lost(detail: str, workdir: str) -> tuple[str, str]:
  progress = checkpoint_progress(workdir) or "no checkpoint yet"
  return "lost", f"{detail}; resumes from its {progress}" if progress.startswith(
      "checkpoint") else f"{detail}; {progress}, it starts over"


def _seconds(record: dict) -> str:
  seconds, allocations = record.get("seconds"), record.get("allocations") or 1
  if seconds is None:
    return ""
  return f"{seconds:.0f} s" + (f" over {allocations} allocations" if allocations > 1 else "")


def cell_status(workdir: str, task: dict | None = None, log: str | None = None,
                slurm_task: str | None = None) -> tuple[str, str]:
  """(state, detail) of a cell, one of STATES. `task`: what the scheduler says of the cell's
  array task ({"state", "reason", "exit", "restarts"}; {} when it no longer knows it), None
  when there is no scheduler to ask (a local sweep, or none reachable): then a running record is
  judged by its heartbeat (and, on its own host, by its pid). `log`: the task's log file, whose
  last line is shown for a task that never started its run. `slurm_task`: the cell's array task
  id as the plan records it, named while the task runs but its run has not yet written a record."""
  record = read_record(workdir)
  if is_finished(workdir):
    return "finished", _seconds(record) if record else ""
  where = ""
  if record is not None:
    where = f"pid {record.get('pid')} on {record.get('host')}"
    if record.get("slurm_task"):
      where += f", SLURM task {record['slurm_task']}"
  sched = (task or {}).get("state")
  if sched in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"):
    reason = (task or {}).get("reason") or "none"
    what = "requeued, waiting" if (task or {}).get("restarts") else "waiting"
    progress = checkpoint_progress(workdir) if record is not None else ""
    return "queued", f"{what} (scheduler: {sched}, reason {reason})" + (
        f", {progress}" if progress else "")
  if record is not None and record.get("state") == "running":
    if task is not None and sched not in ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED"):
      said = (f"the scheduler says {sched}" + (f" ({task['reason']})" if task.get("reason")
                                               not in (None, "None") else "")
              if sched else "the scheduler no longer runs its task")
      return _lost(f"its record says running ({where}) but {said}", workdir)
    if task is None:
      pid, host = record.get("pid") or record.get("runner"), record.get("host")
      if host == socket.gethostname() and pid and not _pid_alive(int(pid)):
        return _lost(f"{where} is gone without an exit record", workdir)
      age = _age(record.get("heartbeat") or record.get("since"))
      if age is not None and age > STALE_SECONDS:
        return _lost(f"no heartbeat from {where} for {age:.0f} s (stale after"
                     f" {STALE_SECONDS} s)", workdir)
    progress = checkpoint_progress(workdir) or "setting up"
    return "running", f"{progress} ({where}, since {record.get('since')})"
  if record is None:
    if sched in ("RUNNING", "COMPLETING"):
      named = f"SLURM task {slurm_task}, " if slurm_task else ""
      return "running", f"setting up ({named}scheduler: {sched})"
    if sched == "CANCELLED" and not _last_line(log):
      return "not started", "cancelled before it started (scheduler: CANCELLED)"
    if sched:  # ended without ever recording a run
      code = task.get("exit")
      why = f"the scheduler says {sched}" + (f", exit {code}" if code else "") + (
          f" ({task['reason']})" if task.get("reason") not in (None, "None") else "")
      last = _last_line(log)
      return "failed", f"its run never started: {why}" + (f"; its log ends: {last}" if last
                                                          else "")
    if task is not None or (log and os.path.exists(log)):
      last = _last_line(log)
      if last:
        return "failed", f"its run never started; its log ends: {last}"
    if not any(os.path.exists(os.path.join(workdir, f))
               for f in ("config.json", "metrics.jsonl", CHECKPOINTS)):
      return "not started", ""
    progress = checkpoint_progress(workdir)
    return "stopped", "no exit recorded (a run started outside a sweep?)" + (
        f", {progress}" if progress else "")
  code, line = record.get("code"), record.get("line") or "(no error line)"
  note = f"; {record['note']}" if record.get("note") else ""
  if code is not None and is_signal(int(code)):
    progress = checkpoint_progress(workdir)
    spent = _seconds(record)
    return "stopped", (f"exit {code}: {line}" + (f"; {progress}" if progress else "")
                       + (f" ({spent} so far)" if spent else "") + note)
  return "failed", f"exit {code}: {line}" + note


def _last_line(log: str | None) -> str:
  """The last non-empty line of a task's log ('' when there is none)."""
  if not log:
    return ""
  try:
    with open(log, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 4096))
      lines = [x.strip() for x in f.read().decode(errors="replace").replace("\r", "\n")
               .splitlines() if x.strip()]
  except OSError:
    return ""
  return lines[-1] if lines else ""


def table(root: str, scheduler=None) -> list[dict]:
  """Every cell of ROOT's plan (plus workdirs under ROOT holding an exit record that the plan
  lacks), in plan order, as a dict: "workdir"; "setting", "method" and "seed" (an int; None for
  a tuning point), "point" (a tuning point's workdir name, else None), read from the workdir's
  place under ROOT (ROOT/SETTING/METHOD/seedN or ROOT/SETTING/METHOD/tune/POINT; None for a
  workdir laid out otherwise); "state" (one of STATES) and "detail" (the line `--status` prints
  after it); "step" (the newest checkpoint's, None before one) and "steps" (the stream's, None
  before it is known); from its exit record, "seconds" (wall time over every allocation),
  "allocations", "code" and "line" (its exit code and one-line reason once it exited, else
  None); "slurm_task" (the array task running it, None for a local cell) and "log" (that
  task's log file). `scheduler(task ids) -> {task id: task} or None` answers for the cells a
  SLURM array runs (olora_jax/sweep/slurm.py's `tasks`)."""
  plan = load_plan(root)
  known = {os.path.abspath(c["workdir"]) for c in plan}
  entries = [(c["workdir"], c.get("slurm")) for c in plan]
  for folder, _, files in sorted(os.walk(root)):
    if EXIT_RECORD in files and os.path.abspath(folder) not in known:
      entries.append((folder, None))
  ids = [s["task"] for w, s in entries if s and s.get("task") and not is_finished(w)]
  answers = scheduler(ids) if scheduler and ids else None
  rows = []
  for workdir, slurm in entries:
    task = log = None
    if slurm and slurm.get("task"):
      task = None if answers is None else answers.get(slurm["task"], {})
      log = os.path.join(os.path.abspath(root), "slurm", "logs", f"{slurm['task']}.out")
    state, detail = cell_status(workdir, task, log, (slurm or {}).get("task"))
    record = read_record(workdir) or {}
    exited = record.get("state") == "exited"
    rows.append({"workdir": workdir, **_place(root, workdir), "state": state, "detail": detail,
                 "step": newest_checkpoint(workdir), "steps": _total_steps(workdir),
                 "seconds": record.get("seconds"), "allocations": record.get("allocations"),
                 "code": record.get("code") if exited else None,
                 "line": record.get("line") if exited else None,
                 "slurm_task": (slurm or {}).get("task"), "log": log})
  return rows


def _place(root: str, workdir: str) -> dict:
  """The setting, method, seed and tuning point a workdir's place under ROOT names."""
  parts = os.path.relpath(os.path.abspath(workdir), os.path.abspath(root)).split(os.sep)
  place = {"setting": None, "method": None, "seed": None, "point": None}
  if len(parts) == 3 and parts[2].startswith("seed") and parts[2][4:].isdigit():
    place.update(setting=parts[0], method=parts[1], seed=int(parts[2][4:]))
  elif len(parts) == 4 and parts[2] == "tune":
    place.update(setting=parts[0], method=parts[1], point=parts[3])
  return place


def status_lines(root: str, scheduler=None) -> tuple[list[str], dict]:
  """One line per cell of `table(root, scheduler)`, and the count of each state."""
  lines, counts = [], {}
  for row in table(root, scheduler):
    workdir, state, detail, log = row["workdir"], row["state"], row["detail"], row["log"]
    counts[state] = counts.get(state, 0) + 1
    line = f"{workdir}: {state}" + (f", {detail}" if detail else "")
    if log and state != "finished":
      line += f"; log {log}"
    lines.append(line)
  return lines, counts


def print_status(root: str, scheduler=None) -> int:
  """`launch/sweep.py --status ROOT`: `status_lines` printed with the count of each state; exit
  2 for a ROOT that holds no sweep."""
  if not os.path.isdir(root):
    print(f"error: {root_problem(root, '--status') or f'--status {root}: no such directory'};"
          " give a sweep's --root", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  with plan_lock(root):
    lines, counts = status_lines(root, scheduler=scheduler)
  if not lines:
    print(f"error: --status {root}: no sweep there (no {PLAN}, no cell's"
          f" {EXIT_RECORD}); give a sweep's --root", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  print("\n".join(lines))
  print(f"{len(lines)} cells: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATES))
  return 0
