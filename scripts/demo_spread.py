"""The demo run N times as whole processes: the spread of its wall, CPU and page-fault figures.

Each run is `launch/run.py --config configs/demo.py --config.fidelity=FIDELITY --workdir NEW` in a
fresh workdir, a child process of this script measured by the kernel's own accounting of it
(`os.wait4`: user and system CPU seconds, minor and major page faults), beside its wall time and
the train steps' share (`compute.step_seconds` in its results.json). The compilation cache is
left as a user's is: the warm-up runs (not counted) fill it. A run is a spike when its minor
faults exceed `--spike-factor` times the median of all counted runs: a page-fault storm (memory
returned to the kernel and faulted back in) shows there first, more robustly than in system time,
which other jobs on a shared machine also inflate.

    .venv/bin/python scripts/demo_spread.py --runs 10
    .venv/bin/python scripts/demo_spread.py --runs 10 --vs ../other-checkout   # A B A B ...
    .venv/bin/python scripts/demo_spread.py --runs 5 --env MALLOC_ARENA_MAX=1 --json spread.json
    .venv/bin/python scripts/demo_spread.py --runs 5 --threads   # whose faults they are (Linux)

With `--vs`, the two checkouts run in turn (each with its own `olora_jax` on PYTHONPATH and the
same Python), and the medians' ratio A/B is printed beside each figure's min/median/max. The
script changes nothing in either checkout; its workdirs go to a temporary folder it removes
(`--keep` keeps them). `--threads` also samples each thread's own counts from /proc four times
a second and prints, per run, the thread names with the most minor faults (XLA's compute threads
are `tf_XLAEigen`, Python's threads carry the script's name): counts of a thread that ends
between two samples are short by at most a quarter second's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ("wall", "user", "sys", "minflt", "majflt", "step_seconds")


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--runs", type=int, default=5, help="counted runs of each checkout")
  parser.add_argument("--warmup", type=int, default=1,
                      help="runs of each checkout first, not counted (they warm the cache)")
  parser.add_argument("--fidelity", default="reference", choices=("paper", "reference"))
  parser.add_argument("--vs", metavar="CHECKOUT", help="a second checkout to alternate with")
  parser.add_argument("--python", default=sys.executable, help="the interpreter for the runs")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="an environment variable for every run (repeatable)")
  parser.add_argument("--spike-factor", type=float, default=4.0,
                      help="a run is a spike above this times the median minor faults")
  parser.add_argument("--threads", action="store_true",
                      help="sample per-thread faults from /proc; print the threads with the most")
  parser.add_argument("--json", metavar="FILE", help="also write every run's figures here")
  parser.add_argument("--keep", action="store_true", help="keep the workdirs and logs")
  args = parser.parse_args(argv)
  if args.runs < 1 or args.warmup < 0:
    parser.error("--runs must be at least 1 and --warmup at least 0")
  for item in args.env:
    if "=" not in item or item.startswith("="):
      parser.error(f"--env {item!r}: give KEY=VALUE, e.g. --env MALLOC_ARENA_MAX=1")
  if args.vs and not os.path.isfile(os.path.join(args.vs, "launch", "run.py")):
    parser.error(f"--vs {args.vs}: no launch/run.py there; give the root of another checkout")
  return args


def _thread_counts(pid: int, seen: dict) -> None:
  """Each live thread of `pid`: its name, minor faults and CPU seconds, into `seen` by thread id."""
  tick = os.sysconf("SC_CLK_TCK")
  try:
    tids = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return
  for tid in tids:
    try:
      with open(f"/proc/{pid}/task/{tid}/stat") as f:
        stat = f.read()
    except OSError:  # the thread ended
      continue
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()  # from the state, the stat's third field, on
    seen[tid] = (name, int(fields[7]), (int(fields[11]) + int(fields[12])) / tick)


def _by_name(seen: dict) -> list:
  """Per thread name: the threads, their minor faults and CPU seconds, most faults first."""
  names: dict = {}
  for name, minflt, cpu in seen.values():
    count, faults, seconds = names.get(name, (0, 0, 0.0))
    names[name] = (count + 1, faults + minflt, seconds + cpu)
  return sorted(((name, *v) for name, v in names.items()), key=lambda row: -row[2])


def run_once(checkout: str, python: str, fidelity: str, workdir: str, env: dict,
             threads: bool = False) -> dict:
  """One demo run in `workdir` (made fresh): its figures, from the kernel and its results.json;
  with `threads`, also its threads' faults by name (sampled from /proc)."""
  command = [python, os.path.join(checkout, "launch", "run.py"), "--config",
             os.path.join(checkout, "configs", "demo.py"), f"--config.fidelity={fidelity}",
             "--workdir", workdir]
  log_path = workdir + ".log"
  with open(log_path, "wb") as log:
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=checkout, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    seen: dict = {}
    try:
      while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG if threads else 0)
        if pid:
          break
        _thread_counts(process.pid, seen)
        time.sleep(0.25)
    except KeyboardInterrupt:  # the run in progress is ended and not counted
      process.terminate()
      process.wait()
      raise
    wall = time.perf_counter() - start
  process.returncode = os.waitstatus_to_exitcode(status)
  row = {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime,
         "minflt": usage.ru_minflt, "majflt": usage.ru_majflt, "exit": process.returncode,
         "step_seconds": None}
  if threads:
    row["threads"] = _by_name(seen)
  try:
    with open(os.path.join(workdir, "results.json")) as f:
      row["step_seconds"] = json.load(f)["compute"]["step_seconds"]
  except (OSError, KeyError, ValueError):
    with open(log_path, errors="replace") as f:
      row["last_line"] = (f.read().strip().splitlines() or [""])[-1]
  return row


def _summary(values):
  values = [v for v in values if v is not None]
  if not values:
    return None
  return min(values), statistics.median(values), max(values)


def _format(figure, value):
  if value is None:
    return "-"
  if figure in ("minflt", "majflt"):
    return f"{value / 1e6:.3f}M" if figure == "minflt" else f"{value:.0f}"
  return f"{value:.2f}"


def main(argv=None) -> int:
  args = _parse_args(argv)
  checkouts = {"A": REPO}
  if args.vs:
    checkouts["B"] = os.path.abspath(args.vs)
  extra = dict(item.split("=", 1) for item in args.env)
  root = tempfile.mkdtemp(prefix="demo_spread_")
  runs = {label: [] for label in checkouts}
  print(f"# {len(checkouts)} checkout(s), {args.warmup} warm-up + {args.runs} counted runs each, "
        f"fidelity {args.fidelity}, logs under {root}")
  for label, checkout in checkouts.items():
    print(f"# {label}: {checkout}")
  try:
    _all_runs(args, checkouts, extra, root, runs)
  except KeyboardInterrupt:
    print("# interrupted: the runs that finished follow")
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  if not any(runs.values()):
    return 1
  _report(args, runs)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"checkouts": checkouts, "fidelity": args.fidelity, "env": extra,
                 "runs": runs}, f, indent=1)
  return 0


def _all_runs(args, checkouts: dict, extra: dict, root: str, runs: dict) -> None:
  """The warm-up and counted runs, the checkouts in turn; each counted run into `runs`."""
  for i in range(args.warmup + args.runs):
    for label, checkout in checkouts.items():
      env = {**os.environ, "PYTHONPATH": checkout, **extra}
      workdir = os.path.join(root, f"{label}{i:03d}")
      row = run_once(checkout, args.python, args.fidelity, workdir, env, args.threads)
      counted = i >= args.warmup
      if counted:
        runs[label].append(row)
      number = i - args.warmup + 1 if counted else i + 1
      print(f"{label} {'run' if counted else 'warm-up'} {number}"
            + "".join(f"  {f} {_format(f, row[f])}" for f in FIGURES)
            + (f"  exit {row['exit']}: {row.get('last_line', '')}" if row["exit"] else ""),
            flush=True)
      for name, count, faults, cpu in row.get("threads", [])[:3]:
        print(f"    {count} thread(s) {name!r}: minflt {faults / 1e6:.3f}M, cpu {cpu:.1f} s")
      if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


def _report(args, runs: dict) -> None:
  """Each figure's min / median / max per checkout, the spikes, and A / B of the medians."""
  everything = [row["minflt"] for rows in runs.values() for row in rows]
  threshold = args.spike_factor * statistics.median(everything)
  print(f"\n# min / median / max; a spike: minor faults above {threshold / 1e6:.3f}M "
        f"({args.spike_factor:g} x the median of all counted runs)")
  medians = {}
  for label, rows in runs.items():
    spikes = sum(row["minflt"] > threshold for row in rows)
    failed = sum(row["exit"] != 0 for row in rows)
    print(f"{label}: {len(rows)} runs, {spikes} spike(s), {failed} failed")
    for figure in FIGURES:
      summary = _summary([row[figure] for row in rows])
      medians[label, figure] = summary[1] if summary else None
      print(f"  {figure:13s}" + " / ".join(_format(figure, v) for v in summary or (None,)))
  if len(runs) == 2:
    print("A / B, medians: " + ", ".join(
        f"{figure} {medians['A', figure] / medians['B', figure]:.3f}" for figure in FIGURES
        if medians.get(("A", figure)) and medians.get(("B", figure))))


if __name__ == "__main__":
  sys.exit(main())
