"""A sweep from Python: plan the cells of settings x methods x seeds, run them here or as one
SLURM job array, read each cell's state as data, cancel a SLURM sweep.

`launch/sweep.py` is this API's command line (its flags are the arguments of the same names);
what a sweep does (the runs' workdirs and commands, resuming, --tune's protocol, the exit codes)
is in its `--help` and olora_jax/sweep/cli.py's docstring, the cluster side in docs/cluster.md.

    from olora_jax import sweep

    cells = sweep.plan_cells("runs/t", ["configs/demo.py"], ["er", "online_lora"], seeds=[0, 1])
    code = sweep.run_local("runs/t", ["configs/demo.py"], ["er", "online_lora"], seeds=[0, 1])
    for cell in sweep.read_status("runs/t"):
      print(cell["method"], cell["seed"], cell["state"], cell["seconds"])

Paths (ROOT, the config files) are relative to the working directory, as on the command line;
the runs are `launch/run.py` of the repository this package is in (installed editable). Importing
this package imports no JAX; planning imports it to resolve the method names.

The modules, by role: `plan` (the cells, the grids of --tune and their pick), `cells` (one
cell's run and exit record, the plan file ROOT/sweep.json and its lock), `local` (the cells one
after another here), `slurm` (the batch script, sbatch/squeue/sacct/scancel, the requeue policy
of an array task), `status` (a cell's state from its record and the scheduler), `cli` (the
command line's flags).
"""

from __future__ import annotations

import os

from olora_jax.sweep import cells, local, plan, slurm, status
from olora_jax.sweep.cells import PlanDamaged
from olora_jax.sweep.plan import TUNING_GRIDS, VALIDATION_FRACTION
from olora_jax.sweep.status import STATES

__all__ = ["STATES", "TUNING_GRIDS", "PlanDamaged", "cancel", "plan_cells", "read_status",
           "run_local", "submit"]


def _sweep(root: str, settings: list[str], methods: list[str], seeds: list[int],
           overrides: list[str], **options) -> plan.Sweep:
  """A checked plan.Sweep; TypeError for an argument that is not a list of its items (a string
  for `settings`, say, which would be read letter by letter), ValueError with the command line's
  one line for a sweep it would refuse."""
  sweep = plan.Sweep(root=os.fspath(root), settings=_items("settings", settings, "config files"),
                     methods=_items("methods", methods, "method names"),
                     seeds=_items("seeds", seeds, "integer seeds"),
                     overrides=_items("overrides", overrides, "'--config.KEY=VALUE' strings"),
                     **options)
  problem = plan.input_problem(sweep) or plan.method_problem(sweep)
  if problem:
    raise ValueError(problem)
  return sweep


def _items(name: str, value, what: str) -> list:
  """`value` as a list of `what` (paths given as os.PathLike become strings); TypeError for a
  single string or number, or an item of another type."""
  if isinstance(value, (str, bytes, os.PathLike)) or not hasattr(value, "__iter__"):
    raise TypeError(f"{name}={value!r}: give a list of {what}, e.g. {name}=[{value!r}]")
  items = [os.fspath(x) if isinstance(x, os.PathLike) else x for x in value]
  want = int if name == "seeds" else str
  bad = [x for x in items if not isinstance(x, want) or isinstance(x, bool)]
  if bad:
    raise TypeError(f"{name}={items!r}: {bad[0]!r} is not one of the {what} it lists")
  return items


def plan_cells(root: str, settings: list[str], methods: list[str], seeds: list[int] = (0, 1, 2),
               overrides: list[str] = (), *, tune: bool = False, grid: dict | None = None,
               tune_seed: int = 0, tune_metric: str = "A_final",
               validation_fraction: float = VALIDATION_FRACTION, write: bool = False
               ) -> list[dict]:
  """The cells of a sweep, tuning points first, settings outermost and seeds innermost, as
  {"workdir", "command" (the run's argv), "tuning" (for a tuned test seed: the plan its
  hyperparameters are picked from; else None)}. `settings`: config files (`configs/demo.py`,
  `configs/split_cifar100.py:vit_s16`); `methods`: method names (docs/methods.md); `overrides`:
  `--config.KEY=VALUE` passed to every run; `tune` and its arguments: `launch/sweep.py --tune`
  (`grid`: {key of the method's config block: [values]}, for every method; None: each method's
  TUNING_GRIDS entry). With `write`, the cells are added to ROOT/sweep.json (as a sweep does
  before it runs them), where a cell keeps its index. Runs nothing. TypeError for a `settings`,
  `methods`, `seeds` or `overrides` that is not a list of its items (a single string, which
  would be read letter by letter); ValueError, with the command line's one line, for what it
  would refuse: an empty list (no cells), an item given twice (`seeds=[0, 0]`: two cells of one
  workdir), a ROOT that is a file, a setting that does not exist, an unknown method, an
  override whose key no config of the sweep's methods has (checked against configs/common.py
  as launch/run.py checks it), a grid key the method does not read or with no values."""
  sweep = _sweep(root, settings, methods, seeds, overrides, tune=tune, grid=grid,
                 tune_seed=tune_seed, tune_metric=tune_metric,
                 validation_fraction=validation_fraction)
  return plan.write(sweep) if write else plan.grid_cells(sweep)


def run_local(root: str, settings: list[str], methods: list[str], seeds: list[int] = (0, 1, 2),
              overrides: list[str] = (), *, dry_run: bool = False, fail_fast: bool = False,
              **tuning) -> int:
  """Runs the sweep's cells one after another on this machine (each a `launch/run.py`
  subprocess; with `tune`, its validation runs and picks first), as `launch/sweep.py` does:
  finished cells skipped, stopped ones resumed, the progress and a summary printed. Returns the
  command line's exit code: 0 when every cell finished, else the first failed run's (2, 4 or a
  signal's stop the sweep; olora_jax/errors.py). `dry_run`: print the commands, run and write
  nothing; `fail_fast`: stop at the first failed run. `tuning`: `plan_cells`'s keywords."""
  return local.run(_sweep(root, settings, methods, seeds, overrides, dry_run=dry_run,
                          fail_fast=fail_fast, **tuning))


def submit(root: str, settings: list[str], methods: list[str], seeds: list[int] = (0, 1, 2),
           overrides: list[str] = (), *, dry_run: bool = False, fail_fast: bool = False,
           tune: bool = False, grid: dict | None = None, tune_seed: int = 0,
           tune_metric: str = "A_final", validation_fraction: float = VALIDATION_FRACTION,
           launcher: str | None = None, prog: str = "launch/sweep.py", **options) -> int:
  """Submits the sweep's cells not finished as SLURM job arrays (`launch/sweep.py --launcher
  slurm`): the batch script written to ROOT/slurm/sweep.sbatch, the cells to ROOT/sweep.json,
  the tuned seeds (with `tune`) as a second array after the first. `options`: the fields of
  `slurm.Options` (partition, time, mem, gres, cpus, throttle, sbatch, signal_lead,
  max_requeues, requeue_on, ntasks, gpus_per_task, setup, compilation_cache); `dry_run`: print
  the script and the sbatch commands, write nothing; `launcher`: the `launch/sweep.py` each
  array task runs its cell through (None: this repository's); `prog`: the command the messages
  name. Returns the command line's exit code (0 submitted, 2 refused by `sbatch --test-only`, 4
  sbatch failed); ValueError for an option the command line would refuse (the same one line),
  where sbatch is not on PATH, or for what `plan_cells` refuses."""
  sweep = _sweep(root, settings, methods, seeds, overrides, tune=tune, grid=grid,
                 tune_seed=tune_seed, tune_metric=tune_metric,
                 validation_fraction=validation_fraction, dry_run=dry_run, fail_fast=fail_fast)
  array = slurm.Options(**options)
  problem = slurm.options_problem(array) or (not dry_run and slurm.check_available())
  if problem:
    raise ValueError(problem)
  return slurm.submit_sweep(sweep, array, launcher or slurm.LAUNCHER, prog)


def read_status(root: str) -> list[dict]:
  """Every cell of the sweep in ROOT, as `launch/sweep.py --status ROOT` reads it (asking SLURM
  for a SLURM sweep's cells): one dict per cell, in plan order, with "workdir", "setting",
  "method", "seed", "point" (a tuning point's), "state" (one of `STATES`), "detail" (the status
  line's text after the state), "step" and "steps" (newest checkpoint, stream length),
  "seconds" and "allocations", "code" and "line" (its exit, once it exited), "slurm_task",
  "log" (olora_jax/sweep/status.py's `table`). [] when ROOT holds no sweep;
  FileNotFoundError when ROOT does not exist."""
  if not os.path.isdir(root):
    raise FileNotFoundError(f"{root}: no such directory; give a sweep's root")
  with cells.plan_lock(root):
    return status.table(root, scheduler=slurm.tasks)


def cancel(root: str, prog: str = "launch/sweep.py") -> int:
  """Stops the SLURM sweep in ROOT (`launch/sweep.py --cancel ROOT`): every job it submitted is
  cancelled, its running cells checkpoint and are not requeued; the same submission resumes
  it. Returns the command line's exit code (2: no SLURM job in ROOT's plan, 4: scancel
  refused)."""
  return slurm.cancel_sweep(root, prog)
