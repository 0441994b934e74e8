"""A sweep's cells: one run each, its exit recorded in its workdir (olora_jax/sweep/status.py reads
its state back from there and, for a SLURM sweep, from the scheduler), and the plan that lists
them.

A cell is one `launch/run.py` command and its workdir. `run_cell` runs it (locally or as one
task of a SLURM array: the same function) and keeps, in WORKDIR/exit.json, what happened:

    {"state": "running", "pid": ..., "host": ..., "since": ..., "heartbeat": ...,
     "slurm_task": ..., "seconds": ..., "allocations": ...}                        while it runs
    {"state": "exited", "code": 0, "line": "", "seconds": ..., "allocations": ...}   when it ends

`line` is the run's last `error: ...` line (launch/run.py ends stderr with one on every non-zero
exit). `seconds` is the cell's wall time summed over every allocation (every start of the cell:
a requeue, a resume), `allocations` their count. While the run goes, the runner rewrites the
`heartbeat` (and `seconds`) every HEARTBEAT_SECONDS; a running record whose heartbeat is older
than STALE_SECONDS belongs to a runner that is gone (its node died, it was killed): the cell is
`lost`, and its next start adds the time that allocation ran after its last heartbeat, up to
its run's last write (metrics.jsonl, a checkpoint). The record is written whole (a temporary
file renamed over it) under a lock; it is kept
RECORD_BYTES long or more, so that when the disk is full the exit record still overwrites it in
place, without a new block.

A cell is finished when its workdir holds results.json and its record, if it has one, says exit
0: a run that wrote results.json and then failed (exit 1 while drawing its figures, say) is not
finished and runs again. A second runner of a cell already finished, or one refused because
another process holds the workdir, leaves the record alone; so does one started while another
runner's run of the cell still goes on (its record says running, and its pid lives or, on
another host, its heartbeat is fresh): it exits 4 without starting the run, and the first
runner's exit record is the cell's.

The sweep's plan, ROOT/sweep.json, lists every cell any invocation on ROOT asked for, in the
order first asked (a cell keeps its index: it is the SLURM array index), with its workdir
relative to ROOT (a moved root keeps working) and, for a SLURM sweep, the array task that runs
it. It is read and changed under ROOT/sweep.json.lock and written whole, so submissions into one
root at once, the tuning seeds and `--status` never lose or corrupt a cell. Its fields:

    {"cells": [{"workdir": str,                 relative to ROOT, or absolute
                "command": [str, ...],          the run's argv (its --workdir added on reading)
                "tuning": null | {"method_dir": str, "workdirs": [str], "points": [{...}],
                                  "method": str, "metric": str, ...},   a tuned seed's pick
                "slurm": null | {"task": "JOB_INDEX", "jobs": [job id], "max_requeues": int,
                                 "requeue_on": [int], "fail_fast": bool, "ntasks": int >= 1,
                                 "cpus": int >= 1}},   the array task that runs it
               ...],
     "submissions": [{"jobs": [job id], "submitted": str, "cells": [int]}, ...]}

`plan_problem` is its one validator: every reader goes through it (`load_plan`) before anything
runs, and a plan that is not that shape is refused in one line naming the field (PlanDamaged,
exit 2).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

EXIT_RECORD = "exit.json"
PLAN = "sweep.json"
CHECKPOINTS = "checkpoints"  # olora_jax/checkpointing.py's CHECKPOINT_DIR
EXIT_SIGNAL_BASE = 128  # olora_jax/errors.py: 128 + signal number
EXIT_BAD_INPUT = 2  # olora_jax/errors.py
EXIT_ENVIRONMENT = 4  # olora_jax/errors.py: a busy workdir among others
HEARTBEAT_SECONDS = 30
STALE_SECONDS = 120  # four heartbeats missed
RECORD_BYTES = 8192
REPEAT_SECONDS = 2  # a signal again within this is the same stop (olora_jax/errors.py's rule)


def now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


@contextlib.contextmanager
def locked(path: str):
  """Holds an exclusive lock on `path`.lock while the block runs (flock: released when the
  process ends, whatever way)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def read_record(workdir: str) -> dict | None:
  """The cell's exit record, or None (none written, or unreadable)."""
  try:
    with open(os.path.join(workdir, EXIT_RECORD)) as f:
      record = json.load(f)
    return record if isinstance(record, dict) else None
  except (OSError, ValueError):
    return None


def _padded(record: dict, size: int) -> bytes:
  data = json.dumps(record, indent=1).encode()
  return data + b" " * (max(size, len(data) + 1) - len(data) - 1) + b"\n"


def write_record(workdir: str, record: dict) -> None:
  """Writes the record whole (a reader never sees half of it). When the disk is full, it
  overwrites the record in place instead, within the bytes the earlier one held."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, EXIT_RECORD)
  tmp = f"{path}.{os.getpid()}.tmp"
  data = _padded(record, RECORD_BYTES)
  try:
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    data = _padded(record, size)
    if len(data) > size:
      raise
    fd = os.open(path, os.O_WRONLY)
    try:
      os.pwrite(fd, data, 0)
    finally:
      os.close(fd)


def update_record(workdir: str, change) -> dict | None:
  """Under the record's lock: `change(current record or None)` -> the record to write, or None
  to leave it. Returns what was written (None: nothing). A workdir that cannot be written fails
  the run itself (exit 4, with its line): the record is then left out, not a second error."""
  path = os.path.join(workdir, EXIT_RECORD)
  try:
    with locked(path):
      new = change(read_record(workdir))
      if new is not None:
        write_record(workdir, new)
      return new
  except OSError:
    return None


def is_finished(workdir: str) -> bool:
  """results.json written, whole (a damaged one is not a result: the cell runs again, and the
  run's line says how to rebuild it), and no record of a non-zero exit after it."""
  try:
    with open(os.path.join(workdir, "results.json")) as f:
      json.load(f)
  except (OSError, ValueError):
    return False
  record = read_record(workdir)
  return record is None or (record.get("state") == "exited" and record.get("code") == 0)


def signal_code(code: int) -> int:
  """Popen's -s (killed by signal s) as the shell's 128 + s."""
  return EXIT_SIGNAL_BASE - code if code < 0 else code


def is_signal(code: int) -> bool:
  return code > EXIT_SIGNAL_BASE


def signal_name(code: int) -> str:
  """143 -> 'SIGTERM'."""
  try:
    return signal.Signals(code - EXIT_SIGNAL_BASE).name
  except ValueError:
    return f"signal {code - EXIT_SIGNAL_BASE}"


def _error_line(tail: bytes) -> str:
  """The last `error: ...` line of the run's stderr (its one-line reason), '' if none."""
  for line in reversed(tail.decode(errors="replace").replace("\r", "\n").splitlines()):
    if line.startswith("error: "):
      return line[len("error: "):].strip()
  return ""


def newest_checkpoint(workdir: str) -> int | None:
  """The step of the newest checkpoint in `workdir` (a resume starts there), None before one."""
  try:
    steps = [int(d) for d in os.listdir(os.path.join(workdir, CHECKPOINTS)) if d.isdigit()]
  except OSError:
    return None
  return max(steps) if steps else None


def run_cell(workdir: str, command: list[str], *, forward=None) -> tuple[int, str, bool]:
  """Runs `command` to its end, passing its stderr through, and records its exit in `workdir`;
  (exit code, one-line reason, whether this process was signalled). SIGINT and SIGTERM sent to
  this process are passed on to the run once (it is in its own session, so a terminal's Ctrl-C
  reaches this process alone) by `forward(proc, signum)` (default: the same signal to the run),
  and the run checkpoints its current step and exits 128 + signal. A cell found finished is not
  run: (0, 'finished earlier', False)."""
  job = os.environ.get("SLURM_ARRAY_JOB_ID")
  task = f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if job else None
  me = uuid.uuid4().hex
  start, since = time.monotonic(), now()
  state = {"before": None, "skip": False}

  def begin(current):
    state["before"] = current
    if is_finished(workdir):
      state["skip"] = True
      return None
    if _live_elsewhere(current, task):  # another runner's run goes on: its record is its own
      state["held"] = current
      return None
    earlier = current or {}
    before = float(earlier.get("seconds", 0.0) or 0.0) + _unrecorded_seconds(workdir, earlier)
    return {"state": "running", "run": me, "pid": None, "runner": os.getpid(),
            "host": socket.gethostname(),
            "since": since, "heartbeat": since, "slurm_task": task,
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "command": command,
            "seconds_before": round(before, 1), "seconds": round(before, 1),
            "allocations": int(earlier.get("allocations", 0) or 0) + 1}

  running = update_record(workdir, begin)
  if state["skip"]:
    return 0, "finished earlier", False
  if state.get("held"):  # a duplicate task (SLURM, at a requeue): it leaves the cell alone
    held = state["held"]
    line = (f"workdir {workdir} is in use by pid {held.get('pid')} on {held.get('host')}"
            + (f" (SLURM task {held['slurm_task']})" if held.get("slurm_task") else "")
            + "; not started again, its run and record are left to it")
    print(f"error: {line}", file=sys.stderr, flush=True)
    return EXIT_ENVIRONMENT, line, False
  try:
    proc = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
  except OSError as e:  # the plan's command names a program that is not there (or not one)
    line = (f"cannot start {workdir}'s run: {command[0]}: {e.strerror or e} (the first word of"
            " its command in the sweep's plan); if that Python moved or is gone, run the same"
            " sweep command again with the Python to use: it rewrites the cells' commands")
    print(f"error: {line}", file=sys.stderr, flush=True)
    if running is not None:
      update_record(workdir, lambda current: {
          **running, "state": "exited", "code": EXIT_BAD_INPUT, "line": line, "ended": now(),
          "heartbeat": None} if _mine(current, me) else None)
    return EXIT_BAD_INPUT, line, False
  memory = memory_cgroup(proc.pid)  # its out-of-memory kills are counted there
  kills_before = oom_kills(memory)
  if running is not None:
    running = {**running, "pid": proc.pid}
    update_record(workdir, lambda current: running if _mine(current, me) else None)
  signalled = []

  def on_signal(signum, frame):
    # One stop reaches the runner twice under SLURM (the scheduler's own SIGTERM and the batch
    # script's): the run gets it once; a second signal later on stops it at once, as it asks.
    if signalled and time.monotonic() - signalled[-1] < REPEAT_SECONDS:
      return
    signalled.append(time.monotonic())
    (forward or (lambda p, s: p.send_signal(s)))(proc, signum)

  handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  done = threading.Event()

  def heartbeat():
    while not done.wait(HEARTBEAT_SECONDS):
      beat = {"heartbeat": now(),
              "seconds": round(running["seconds_before"] + time.monotonic() - start, 1)}
      update_record(workdir, lambda current, beat=beat: {**current, **beat}
                    if _mine(current, me) else None)

  if running is not None:
    threading.Thread(target=heartbeat, daemon=True).start()
  tail = b""
  try:
    fd = proc.stderr.fileno()
    while chunk := os.read(fd, 65536):
      sys.stderr.buffer.write(chunk)
      sys.stderr.buffer.flush()
      tail = (tail + chunk)[-8192:]
    code = signal_code(proc.wait())
  finally:
    done.set()
    for s, handler in handlers.items():
      signal.signal(s, handler)
  if tail and not tail.endswith(b"\n"):  # a progress bar's line: what follows starts a new one
    sys.stderr.buffer.write(b"\n")
    sys.stderr.buffer.flush()
  line = _error_line(tail)
  if code == EXIT_SIGNAL_BASE + signal.SIGKILL and oom_kills(memory) > kills_before:
    line = ("killed by the out-of-memory killer (its memory cgroup counted the kill) before it"
            f" could checkpoint: {OOM_ADVICE}")
  elif not line and is_signal(code):
    line = f"killed by {signal_name(code)} before it could checkpoint"
  elif not line and code:
    line = f"exited {code} without an error line; see its output"
  busy = " is in use by " in line  # WorkdirBusy: the record belongs to the run holding it

  def end(current):
    if not _mine(current, me):
      return None  # another runner's record (finished, or running): not ours to change
    if busy:
      return state["before"] or {}
    return {**running, "state": "exited", "code": code, "line": line, "ended": now(),
            "heartbeat": None,
            "seconds": round(running["seconds_before"] + time.monotonic() - start, 1)}

  if running is not None:
    update_record(workdir, end)
  return code, line, bool(signalled)


OOM_ADVICE = ("the same memory would run out again: give the cell more (--mem), or lower"
              " learner.batch_size or eval.batch_size, then run the same command to resume")


def memory_cgroup(pid: int) -> str | None:
  """The file that counts the out-of-memory kills in process `pid`'s memory cgroup (cgroup v2:
  memory.events; v1: memory.oom_control), or None where there is none to read (no cgroup
  memory controller, or the process is gone)."""
  try:
    with open(f"/proc/{pid}/cgroup") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in lines:
    _, controllers, path = line.split(":", 2)
    if "memory" in controllers.split(","):  # v1
      candidates = [f"/sys/fs/cgroup/memory{path}/memory.oom_control"]
      break
  else:
    path = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    if path is None:
      return None
    candidates = [f"/sys/fs/cgroup{path}/memory.events",
                  f"/sys/fs/cgroup/unified{path}/memory.events"]
  return next((c for c in candidates if os.path.exists(c)), None)


def oom_kills(counter: str | None) -> int:
  """The `oom_kill` count of a memory cgroup's counter file (`memory_cgroup`); 0 without one."""
  if counter is None:
    return 0
  try:
    with open(counter) as f:
      for line in f:
        key, _, value = line.partition(" ")
        if key == "oom_kill":
          return int(value)
  except (OSError, ValueError):
    pass
  return 0


def _mine(record: dict | None, me: str) -> bool:
  return record is not None and record.get("run") == me


def _unrecorded_seconds(workdir: str, record: dict) -> float:
  """The seconds an allocation that ended without its exit record (SIGKILLed with its runner)
  ran after its last heartbeat, as far as its run's own files show: until the run last wrote
  metrics.jsonl (a line every step) or a checkpoint. 0 for a record that is not such a one."""
  if record.get("state") != "running":
    return 0.0
  beat = _age(record.get("heartbeat") or record.get("since"))
  if beat is None:
    return 0.0
  written = [os.path.getmtime(p) for p in (os.path.join(workdir, "metrics.jsonl"),
                                           os.path.join(workdir, CHECKPOINTS))
             if os.path.exists(p)]
  if not written:
    return 0.0
  return min(max(0.0, beat - (time.time() - max(written))), float(STALE_SECONDS))


def _live_elsewhere(record: dict | None, task: str | None) -> bool:
  """Whether `record` is another runner's, still running: on this host its pid lives, on
  another its heartbeat is fresh (not yet `STALE_SECONDS` old) and it is not an earlier
  allocation of this SLURM array task `task` (SLURM runs one allocation of a task at a time)."""
  if not record or record.get("state") != "running":
    return False
  # Before its run has a pid, the runner's own (a runner that died there leaves it behind).
  pid, host = record.get("pid") or record.get("runner"), record.get("host")
  if host == socket.gethostname() and pid:
    return _pid_alive(int(pid))
  if task is not None and record.get("slurm_task") == task:
    return False
  age = _age(record.get("heartbeat") or record.get("since"))
  return age is not None and age <= STALE_SECONDS


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _age(stamp: str | None) -> float | None:
  """Seconds since an ISO time `stamp` (None when missing or unreadable)."""
  try:
    return (datetime.datetime.now().astimezone()
            - datetime.datetime.fromisoformat(stamp)).total_seconds()
  except (TypeError, ValueError):
    return None


def _resolve(root: str, path: str) -> str:
  return path if os.path.isabs(path) else os.path.join(os.path.abspath(root), path)


def _relative(root: str, path: str) -> str:
  rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
  return path if rel.startswith("..") else rel


def _with_workdir(command: list[str], workdir: str) -> list[str]:
  return [a for a in command if not a.startswith("--workdir=")] + [f"--workdir={workdir}"]


class PlanDamaged(ValueError):
  """ROOT/sweep.json is not a plan this code wrote (cut short, or edited): bad input."""

  exit_code = EXIT_BAD_INPUT


def _load(root: str) -> dict:
  path = os.path.join(root, PLAN)
  try:
    with open(path) as f:
      plan = json.load(f)
  except FileNotFoundError:
    return {"cells": []}
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise _damaged(path, str(e).splitlines()[0]) from None
  bad = plan_problem(plan)
  if bad:
    raise _damaged(path, bad)
  plan.setdefault("cells", [])
  return plan


def _is(value, kind, *, empty: bool = True) -> bool:
  """`value` is a `kind` (bool is no int here), non-empty unless `empty`."""
  if isinstance(value, bool) and kind in (int, (int, float)):
    return False
  return isinstance(value, kind) and (empty or bool(value))


def _list_of(value, kind, *, empty: bool = True) -> bool:
  return _is(value, list, empty=empty) and all(_is(x, kind) for x in value)


# A plan's fields that this code reads, each with its check: (what it must be, check).
_CELL = {
    "workdir": ("a non-empty string", lambda v: _is(v, str, empty=False)),
    "command": ("a non-empty list of strings", lambda v: _list_of(v, str, empty=False)),
}
_TUNING = {
    "method_dir": ("a string", lambda v: _is(v, str, empty=False)),
    "workdirs": ("a list of strings", lambda v: _list_of(v, str)),
    "points": ("a list of objects", lambda v: _list_of(v, dict)),
    "method": ("a string", lambda v: _is(v, str, empty=False)),
    "metric": ("a string", lambda v: _is(v, str, empty=False)),
}
_SLURM = {
    "task": ("a string JOB_INDEX", lambda v: _is(v, str, empty=False)),
    "jobs": ("a list of job ids", lambda v: _list_of(v, (str, int))),
    "max_requeues": ("an integer >= 0", lambda v: _is(v, int) and v >= 0),
    "requeue_on": ("a list of exit codes", lambda v: _list_of(v, int)),
    "fail_fast": ("true or false", lambda v: isinstance(v, bool)),
    "ntasks": ("an integer >= 1", lambda v: _is(v, int) and v >= 1),
    "cpus": ("an integer >= 1", lambda v: _is(v, int) and v >= 1),
}
_OPTIONAL = {"slurm": _SLURM, "tuning": _TUNING}  # null (or left out) for a cell without one


def plan_problem(plan) -> str | None:
  """What in a loaded ROOT/sweep.json is not the plan this module writes (the module's
  docstring lists its fields), else None: the one check every reader of the plan goes through,
  before anything runs."""
  if not isinstance(plan, dict):
    return f"a JSON {type(plan).__name__}, not the object of a plan"
  if not isinstance(plan.get("cells", []), list):
    return "'cells' is not a list"
  submissions = plan.get("submissions", [])
  if not isinstance(submissions, list) or not all(
      isinstance(s, dict) and _list_of(s.get("jobs", []), (str, int)) for s in submissions):
    return "'submissions' is not a list of objects whose 'jobs' are job ids"
  for i, cell in enumerate(plan.get("cells", [])):
    if not isinstance(cell, dict):
      return f"cell {i} is a JSON {type(cell).__name__}, not an object"
    if "workdir" not in cell:
      return f"cell {i} has no workdir"
    for fields, where, part in ([(_CELL, f"cell {i}", cell)]
                                + [(fields, f"cell {i}'s {key!r}", cell[key])
                                   for key, fields in _OPTIONAL.items()
                                   if cell.get(key) is not None]):
      if not isinstance(part, dict):
        return f"{where} is {json.dumps(part)}, not an object (or null)"
      for key, (what, ok) in fields.items():
        if not ok(part.get(key)):
          return f"{where}'s {key!r} is {json.dumps(part.get(key))}, not {what}"
  return None


def _damaged(path: str, what: str) -> PlanDamaged:
  return PlanDamaged(
      f"{path} is damaged ({what}): it is the sweep's plan of cells. Restore it, or move it"
      " aside and run the same sweep command again to write it anew (each run keeps its own"
      " records in its workdir: finished runs are skipped); under SLURM, let the sweep's"
      " queued or running tasks end first (or scancel them)")


def load_plan(root: str, with_submissions: bool = False):
  """The cells of ROOT/sweep.json ([] when there is none), workdirs (and a tuning plan's) made
  absolute under ROOT wherever it is now; with `with_submissions`, also the submissions
  ({"jobs": [...], "fail_fast": ...})."""
  plan = _load(root)
  cells = []
  for cell in plan["cells"]:
    workdir = _resolve(root, cell["workdir"])
    cell = {**cell, "workdir": workdir}
    if cell.get("command"):
      cell["command"] = _with_workdir(cell["command"], workdir)
    if cell.get("tuning"):
      tuning = dict(cell["tuning"])
      tuning["method_dir"] = _resolve(root, tuning["method_dir"])
      tuning["workdirs"] = [_resolve(root, w) for w in tuning["workdirs"]]
      cell["tuning"] = tuning
    cells.append(cell)
  return (cells, plan.get("submissions", [])) if with_submissions else cells


def _stored(root: str, cell: dict) -> dict:
  stored = {**cell, "workdir": _relative(root, cell["workdir"])}
  if cell.get("command"):
    stored["command"] = [a for a in cell["command"] if not a.startswith("--workdir=")]
  if cell.get("tuning"):
    tuning = dict(cell["tuning"])
    tuning["method_dir"] = _relative(root, tuning["method_dir"])
    tuning["workdirs"] = [_relative(root, w) for w in tuning["workdirs"]]
    stored["tuning"] = tuning
  return stored


def merged_plan(root: str, new: list[dict]) -> list[dict]:
  """ROOT/sweep.json's cells plus those of `new` not in it (by workdir, appended in order; a
  cell already there takes the new command and keeps its scheduler record): a cell keeps its
  index. Call it under `plan_lock(root)` with the `write_plan` that follows."""
  merged = load_plan(root)
  index = {os.path.abspath(c["workdir"]): i for i, c in enumerate(merged)}
  for cell in new:
    key = os.path.abspath(cell["workdir"])
    if key in index:
      merged[index[key]] = {**merged[index[key]], **cell}
    else:
      index[key] = len(merged)
      merged.append(cell)
  return merged


def root_problem(root: str, flag: str) -> str | None:
  """One line when `root` exists but is not a directory (a sweep's ROOT holds its workdirs),
  else None."""
  if os.path.exists(root) and not os.path.isdir(root):
    return (f"{flag} {root} is a file, not a directory: a sweep's root holds its cells'"
            " workdirs; give a directory (it is created if missing)")
  return None


def plan_lock(root: str):
  """The lock every change of ROOT/sweep.json is made under (read, change, write)."""
  os.makedirs(root, exist_ok=True)
  return locked(os.path.join(root, PLAN))


def write_plan(root: str, plan: list[dict], submission: dict | None = None) -> None:
  """Writes ROOT/sweep.json whole (call under `plan_lock`), appending `submission` to its
  record of submissions."""
  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, PLAN)
  submissions = _load(root).get("submissions", []) + ([submission] if submission else [])
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump({"cells": [_stored(root, c) for c in plan], "submissions": submissions}, f,
              indent=1)
  os.replace(tmp, path)

