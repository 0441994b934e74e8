"""Fills a table: runs methods x settings x seeds one after another on this machine.

(`launch/sweep.py`'s command line: its flags parsed, then one call of the sweep API,
olora_jax/sweep/__init__.py, whose exit code it exits with.)

    python launch/sweep.py --root ROOT --settings configs/demo.py,configs/demo_si_blurry.py \
        --methods pcr,lode,ema_der_pp,ema_rar --seeds 0,1,2 [-- --config.KEY=VALUE ...]
    python launch/report.py --layout table1 ROOT    # then --layout table2 ROOT

Each run is `launch/run.py --config SETTING --workdir ROOT/NAME/METHOD/seedN --config.method=METHOD
--config.seed=N --config.logger_group=SWEEP --config.logger_dir=ROOT` plus the overrides after
`--` (NAME: the config file's name, with its argument when it has one:
configs/split_cifar100.py:vit_s16 -> split_cifar100_vit_s16; SWEEP: ROOT's own name). The two
logger keys gather the cells in the trackers, when `--config.loggers` names W&B or MLflow: one
W&B group, one MLflow store in ROOT/mlruns (olora_jax/loggers.py). Each run's exit
is recorded in its workdir (exit.json: the code and the run's one `error: ...` line;
olora_jax/sweep/cells.py). A workdir holding results.json and a recorded exit 0 is finished and
skipped; any other is started or resumed from its newest checkpoint by run.py itself, so
rerunning the same command after a stop carries on where it stopped, and a run that failed (even
after writing results.json) runs again. The exit code of each run (olora_jax/errors.py) decides
what follows (olora_jax/sweep/local.py):
  0                      next run
  1 (bug), 3 (NaN/Inf)   the run is reported as failed with its one line, the sweep goes on
                         (--fail_fast: the sweep stops there)
  2 (bad input), 4 (environment), 128+s (signal)   the sweep stops with that code: the cause
                         would stop every later run too (or the user asked to stop)
At the end a summary lists every run with its status and wall time; the exit code is 0 when all
finished, else the first failed run's code.

    python launch/sweep.py --status ROOT   every cell: finished, running, queued, stopped, lost,
                                           failed (exit code and one-line reason), not started,
                                           with its newest checkpoint's step; from the workdirs
                                           and, for a SLURM sweep, the scheduler (docs/cluster.md)
    python launch/sweep.py --cancel ROOT   stops a SLURM sweep: its jobs cancelled, running cells
                                           checkpointed and not requeued (docs/cluster.md); the
                                           same sweep command resumes it

--launcher slurm (docs/cluster.md): the same cells as one SLURM job array, one task per cell
(tuning points included), from one batch script written to ROOT/slurm/sweep.sbatch and submitted
with sbatch (--dry_run prints it and the sbatch command, writing nothing); resubmitting the same
command submits only the cells not finished. olora_jax/sweep/slurm.py has the script's logic:
only the scheduler's signals requeue a cell (--requeue_on adds exit codes), --ntasks N runs each
cell over N processes under srun, --setup adds the batch script's set-up lines, and every cell
shares one compilation cache (ROOT/jax_cache unless --compilation_cache says otherwise).

--tune: the paper's tuning protocol (its appendix, after the online continual-learning survey of
Mai et al.): per setting and method, a grid search over keys of the method's config block
(`TUNING_GRIDS`, olora_jax/sweep/plan.py: the baselines' learning rate and weight decay, the
paper's grids; Online-LoRA's learning rate and the plateau rule's mean and variance thresholds,
in its `learner` block; `--grid` replaces them) on a validation stream held out from the
training data (`--config.data.validation_fraction`, default 0.1: each grid point trains on the
rest of the training split and is scored on the held-out part, never on the test set), one run
per grid point with seed `--tune_seed`, workdirs ROOT/NAME/METHOD/tune/lr*_wd* (Online-LoRA:
lr*_mean*_var*). The point with the best validation `--tune_metric` (A_final; the first in grid
order on a tie) is written to ROOT/NAME/METHOD/tuning.json with every point's score, and the
test seeds then run with it (a seed finished earlier with other values is kept, with a note).
A method without a grid (L2P, MVP: the paper kept their values; fine-tuning, the upper bound)
runs its test seeds with its defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import olora_jax.sweep as api
from olora_jax.sweep import cells, plan, slurm, status

# --launcher slurm: the #SBATCH values given as text (empty: the cluster's default).
SLURM_TEXT_FLAGS = {
    "partition": "#SBATCH --partition",
    "time": "time limit of one cell's task (#SBATCH --time, e.g. 4:00:00); a cell that needs"
            " longer checkpoints and is requeued",
    "mem": "memory per cell (#SBATCH --mem, e.g. 16G)",
    "gres": "generic resources per cell (#SBATCH --gres, e.g. gpu:1)",
}


def _list(text: str) -> list[str]:
  return [x for x in text.split(",") if x]


def _codes(text: str) -> list[int]:
  """'137,4' -> [137, 4]: exit codes 1-255."""
  try:
    codes = [int(x) for x in _list(text)]
  except ValueError:
    codes = []
  if not codes or not all(1 <= c <= 255 for c in codes):
    raise argparse.ArgumentTypeError(f"{text!r}: give exit codes 1-255, comma separated, e.g."
                                     " 137 (SIGKILL: the out-of-memory killer) or 4,137")
  return codes


def parse(argv: list[str]) -> argparse.Namespace:
  """`launch/sweep.py`'s flags (the `--config.KEY=VALUE` overrides after `--` in `overrides`),
  checked: a flag, setting, override or method it cannot run exits 2 with its one line."""
  overrides = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", help="where the workdirs go")
  parser.add_argument("--settings", type=_list,
                      help="config files, comma separated (configs/demo.py,...)")
  parser.add_argument("--methods", type=_list,
                      help="`method` names, comma separated (docs/methods.md)")
  parser.add_argument("--seeds", default=[0, 1, 2], type=lambda t: [int(s) for s in _list(t)],
                      help="comma separated (default 0,1,2)")
  parser.add_argument("--dry_run", action="store_true",
                      help="print the commands (with --launcher slurm: the batch script and the"
                      " sbatch command), run and write nothing")
  parser.add_argument("--fail_fast", action="store_true",
                      help="stop at the first run that fails (default: report it, go on; with"
                      " --launcher slurm it cancels the cells not started yet)")
  parser.add_argument("--status", metavar="ROOT",
                      help="print every cell of the sweep in ROOT and its state (asking SLURM for"
                      " a SLURM sweep's cells), run nothing")
  parser.add_argument("--cancel", metavar="ROOT",
                      help="stop a SLURM sweep: every job it submitted is cancelled (scancel);"
                      " its running cells checkpoint and stop without requeueing themselves,"
                      " the queued ones are removed; the same sweep command resumes it")
  parser.add_argument("--run_cell", nargs=2, metavar=("ROOT", "INDEX"),
                      help=argparse.SUPPRESS)  # one task of a SLURM array (slurm.run_task)
  parser.add_argument("--tune", action="store_true",
                      help="first pick each method's hyperparameters (TUNING_GRIDS: learning rate"
                      " and weight decay; Online-LoRA's learning rate and plateau thresholds) on a"
                      " held-out validation stream (the paper's protocol; module docstring)")
  parser.add_argument("--grid", type=plan.parse_grid, default=None,
                      help="with --tune: one grid for every method, keys of its config block, e.g."
                      " 'learning_rate=1e-3,1e-2;weight_decay=0' or (Online-LoRA)"
                      " 'mean_threshold=2.6,3.0;var_threshold=0.03' (default: TUNING_GRIDS)")
  parser.add_argument("--tune_seed", type=int, default=0, help="seed of the validation runs")
  parser.add_argument("--tune_metric", default="A_final",
                      help="results.json value the validation runs are ranked by")
  parser.add_argument("--validation_fraction", type=float, default=plan.VALIDATION_FRACTION,
                      help="share of the training split held out for --tune")
  cluster = parser.add_argument_group("--launcher slurm (docs/cluster.md)")
  cluster.add_argument("--launcher", choices=("local", "slurm"), default="local",
                       help="local: one run after another here (default); slurm: one job array")
  for flag, help_ in SLURM_TEXT_FLAGS.items():
    cluster.add_argument(f"--{flag}", default="", help=help_)
  cluster.add_argument("--cpus", type=int, default=None,
                       help="CPUs per cell (#SBATCH --cpus-per-task; default 1)")
  cluster.add_argument("--throttle", type=int, default=None, metavar="K",
                       help="at most K cells at once (--array=...%%K; default: no limit)")
  cluster.add_argument("--sbatch", action="append", default=[], metavar="LINE",
                       help="an extra #SBATCH line, e.g. '--account=abc' (repeatable)")
  cluster.add_argument("--signal_lead", type=int, default=None, metavar="SECONDS",
                       help="SIGUSR1 this long before the time limit, to checkpoint and requeue"
                       f" (default {slurm.SIGNAL_LEAD}; SLURM may send it up to 60 s earlier)")
  cluster.add_argument("--max_requeues", type=int, default=None,
                       help="requeue a cell at most this many times (default"
                       f" {slurm.MAX_REQUEUES})")
  cluster.add_argument("--requeue_on", type=_codes, default=None, metavar="CODES",
                       help="exit codes that also requeue a cell, comma separated, e.g. 137"
                       " (default: none; the scheduler's signals always requeue)")
  cluster.add_argument("--ntasks", type=int, default=None, metavar="N",
                       help="processes per cell (#SBATCH --ntasks; default 1): each cell is one"
                       " run over N processes started by srun inside the task, one per GPU")
  cluster.add_argument("--gpus_per_task", type=int, default=None, metavar="G",
                       help="GPUs of each process (#SBATCH --gpus-per-task; or give --gres)")
  cluster.add_argument("--setup", action="append", default=[], metavar="LINE",
                       help="a line the batch script runs before the cell, e.g. 'module load"
                       " cuda' or 'source ~/env/bin/activate' (repeatable)")
  cluster.add_argument("--compilation_cache", default=None, metavar="DIR",
                       help="the persistent compilation cache every cell shares (default"
                       f" ROOT/{slurm.CACHE}; 'off': each run's own default)")
  args = parser.parse_args(own)
  args.overrides = overrides
  if args.status or args.run_cell or args.cancel:
    return args
  need = [f"--{k}" for k in ("root", "settings", "methods") if not getattr(args, k)]
  if need:
    parser.error(f"{', '.join(need)} required (or --status ROOT, --cancel ROOT)")
  given = [f"--{k}" for k in (*SLURM_TEXT_FLAGS, "cpus", "throttle", "signal_lead",
                              "max_requeues", "requeue_on", "ntasks", "gpus_per_task",
                              "compilation_cache") if getattr(args, k) not in ("", None)]
  given += ["--sbatch"] if args.sbatch else []
  given += ["--setup"] if args.setup else []
  if args.launcher == "local" and given:
    parser.error(f"{', '.join(given)} only apply to --launcher slurm; add it or drop them")
  for flag, low in (("cpus", 1), ("throttle", 0), ("signal_lead", 1), ("max_requeues", 0),
                    ("ntasks", 1), ("gpus_per_task", 1)):
    if getattr(args, flag) is not None and getattr(args, flag) < low:
      parser.error(f"--{flag}={getattr(args, flag)} must be >= {low}")
  args.cpus = args.cpus or 1
  args.throttle = args.throttle or 0
  args.signal_lead = args.signal_lead or slurm.SIGNAL_LEAD
  args.max_requeues = slurm.MAX_REQUEUES if args.max_requeues is None else args.max_requeues
  args.requeue_on = args.requeue_on or []
  args.ntasks = args.ntasks or 1
  args.gpus_per_task = args.gpus_per_task or 0
  problem = (slurm.options_problem(slurm.Options(**_fields(args, slurm.Options)))
             or plan.input_problem(plan.Sweep(**_fields(args, plan.Sweep))))
  if problem:
    parser.error(problem)
  if args.launcher == "slurm" and not args.dry_run and slurm.check_available():
    parser.error(slurm.check_available())
  problem = plan.method_problem(plan.Sweep(**_fields(args, plan.Sweep)))
  if problem:
    parser.error(problem)
  return args


def _fields(args: argparse.Namespace, cls) -> dict:
  """The flags that are fields of the dataclass `cls` (plan.Sweep, slurm.Options)."""
  return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}


def main(argv: list[str], launcher: str = slurm.LAUNCHER) -> int:
  """The command line: `argv` parsed, one call, its exit code. `launcher`: the path of
  launch/sweep.py as the batch script runs it."""
  args = parse(argv)
  try:
    if args.status:
      return status.print_status(args.status, scheduler=slurm.tasks)
    if args.run_cell:
      return slurm.run_task(*args.run_cell)
    if args.cancel:
      return api.cancel(args.cancel, prog=sys.argv[0])
    if args.launcher == "slurm":
      return api.submit(**_fields(args, plan.Sweep), launcher=launcher, prog=sys.argv[0],
                        **_fields(args, slurm.Options))
    return api.run_local(**_fields(args, plan.Sweep))
  except cells.PlanDamaged as e:  # ROOT/sweep.json: one line, whatever read it
    print(f"error: {e}", file=sys.stderr)
    return e.exit_code
