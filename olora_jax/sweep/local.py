"""A sweep on this machine: its cells one after another (`launch/sweep.py` without --launcher
slurm). The exit code of each run (olora_jax/errors.py) decides what follows:
  0                      next run
  1 (bug), 3 (NaN/Inf)   the run is reported as failed with its one line, the sweep goes on
                         (--fail_fast: the sweep stops there)
  2 (bad input), 4 (environment), 128+s (signal)   the sweep stops with that code: the cause
                         would stop every later run too (or the user asked to stop)
At the end a summary lists every run with its status and wall time.
"""

from __future__ import annotations

import os
import sys

from olora_jax import errors
from olora_jax.sweep import cells
from olora_jax.sweep.plan import (
    Sweep,
    choose,
    method_dir,
    seed_runs,
    setting_name,
    stale_pick,
    tuning_plans,
    write,
)
from olora_jax.sweep.status import cell_status

# Exit codes after which no later run can do better: stop the sweep.
STOP_CODES = (errors.EXIT_BAD_INPUT, errors.EXIT_ENVIRONMENT)


def tune(sweep: Sweep) -> tuple[dict, int]:
  """The validation runs of --tune, one after another: (ROOT/NAME/METHOD -> overrides of the
  picked point, exit code: 0, or the code that stops the sweep). Writes each method's
  tuning.json."""
  chosen = {}
  plans = {p["method_dir"]: p for p in tuning_plans(sweep)}
  for config in sweep.settings:
    for method in sweep.methods:
      method_dir_ = os.path.join(sweep.root, setting_name(config), method_dir(method))
      if method_dir_ not in plans:
        print(f"{method_dir_}: no grid, the defaults", flush=True)
        continue
      plan_ = plans[method_dir_]
      code, stop = execute(list(zip(plan_["workdirs"], plan_["commands"], strict=True)), sweep)
      if stop:
        return chosen, code
      if sweep.dry_run and not all(map(cells.is_finished, plan_["workdirs"])):
        continue  # nothing to pick from yet
      try:
        chosen[method_dir_] = choose(plan_)
      except ValueError as e:  # every point failed
        print(f"{method_dir_}: {e}; its test seeds are not run", file=sys.stderr, flush=True)
        return chosen, code or errors.EXIT_INTERNAL
  return chosen, 0


def execute(runs: list[tuple[str, list[str]]], sweep: Sweep) -> tuple[int, bool]:
  """Runs each (workdir, command) not finished yet, in order, and prints a summary; (the first
  failed run's exit code or 0, whether the sweep must stop)."""
  summary, first_failure, stop = [], 0, False
  for i, (workdir, command) in enumerate(runs, 1):
    head = f"[{i}/{len(runs)}] {workdir}"
    if cells.is_finished(workdir):
      print(f"{head}: finished, skipped", flush=True)
      summary.append((workdir, "finished earlier", 0.0))
      continue
    if sweep.dry_run:
      print(" ".join(command), flush=True)
      continue
    state = cell_status(workdir)[0]
    print(f"{head}: {'starting' if state == 'not started' else 'resuming'}"
          + (" (it failed before)" if state == "failed" else ""), flush=True)
    code, line, _ = cells.run_cell(workdir, command)
    record = cells.read_record(workdir) or {}
    seconds = record.get("seconds", 0.0)
    status = "finished" if code == errors.EXIT_OK else f"failed (exit {code}): {line}"
    summary.append((workdir, status, seconds))
    print(f"{head}: {status}" + (f" in {seconds:.0f} s" if code == 0 else ""), flush=True)
    if code != errors.EXIT_OK:
      first_failure = first_failure or code
      if code in STOP_CODES:
        print(f"sweep stopped: exit {code} would stop every later run too ({line}); fix it and"
              " run the same command to carry on", file=sys.stderr)
        stop = True
        break
      if cells.is_signal(code):
        print(f"sweep stopped by a signal (exit {code}): the run checkpointed its step; run the"
              " same command to carry on", file=sys.stderr)
        stop = True
        break
      if sweep.fail_fast:
        print(f"sweep stopped at the first failed run (--fail_fast): {workdir}: {line}",
              file=sys.stderr)
        stop = True
        break
  if summary:
    print("\nsummary (wall time of this invocation):")
    for workdir, status, seconds in summary:
      print(f"  {workdir}: {status}" + (f", {seconds:.0f} s" if seconds else ""))
  return first_failure, stop


def run(sweep: Sweep) -> int:
  """The sweep's cells one after another on this machine (its tuning first, with --tune): the
  plan written to ROOT/sweep.json, each run not finished run or resumed, a summary printed; the
  first failed run's exit code or 0."""
  if not sweep.dry_run:
    write(sweep)
  chosen = {}
  if sweep.tune:
    chosen, code = tune(sweep)
    if code:
      return code
  runs = [(workdir, command + chosen.get(os.path.dirname(workdir), []))
          for workdir, command in seed_runs(sweep.root, sweep.settings, sweep.methods,
                                            sweep.seeds, sweep.overrides)]
  for workdir, _ in runs:
    if os.path.dirname(workdir) in chosen and (note := stale_pick(workdir)):
      print(note, file=sys.stderr, flush=True)
  return execute(runs, sweep)[0]
