"""Fills a table: runs methods x settings x seeds one after another on this machine.

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
launch/cells.py). A workdir holding results.json and a recorded exit 0 is finished and skipped;
any other is started or resumed from its newest checkpoint by run.py itself, so rerunning the
same command after a stop carries on where it stopped, and a run that failed (even after writing
results.json) runs again. The exit code of each run (olora_jax/errors.py) decides what follows:
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
command submits only the cells not finished. launch/slurm.py has the script's logic: only the
scheduler's signals requeue a cell (--requeue_on adds exit codes), --ntasks N runs each cell
over N processes under srun, --setup adds the batch script's set-up lines, and every cell shares
one compilation cache (ROOT/jax_cache unless --compilation_cache says otherwise).

--tune: the paper's tuning protocol (its appendix, after the online continual-learning survey of
Mai et al.): per setting and method, a grid search over keys of the method's config block
(`TUNING_GRIDS`: the baselines' learning rate and weight decay, the paper's grids; Online-LoRA's
learning rate and the plateau rule's mean and variance thresholds, in its `learner` block;
`--grid` replaces them) on a validation stream held out from the training data
(`--config.data.validation_fraction`, default 0.1: each grid point trains on the rest of the
training split and is scored on the held-out part, never on the test set), one run per grid
point with seed `--tune_seed`, workdirs ROOT/NAME/METHOD/tune/lr*_wd* (Online-LoRA:
lr*_mean*_var*). The point with the best validation `--tune_metric` (A_final; the first in grid
order on a tie) is written to ROOT/NAME/METHOD/tuning.json with every point's score, and the
test seeds then run with it (a seed finished earlier with other values is kept, with a note).
A method without a grid (L2P, MVP: the paper kept their values; fine-tuning, the upper bound)
runs its test seeds with its defaults.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from launch import cells, slurm  # noqa: E402
from olora_jax import errors  # noqa: E402

RUN = str(pathlib.Path(__file__).resolve().parent / "run.py")
# Exit codes after which no later run can do better: stop the sweep.
STOP_CODES = (errors.EXIT_BAD_INPUT, errors.EXIT_ENVIRONMENT)
# The paper's grids (appendix, hyperparameter grid for the baselines on ViT-B/16): method ->
# {key of the method's config block (`MethodSpec.block`): values}. A method without a WD grid
# keeps its block's weight decay.
_EMA = {"learning_rate": [1e-4, 2e-4, 3e-4, 4e-4, 5e-4]}
_SMALL = {"learning_rate": [1e-4, 1e-3, 1e-2, 1e-1], "weight_decay": [1e-4, 1e-3]}
TUNING_GRIDS = {
    "agem": {"learning_rate": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1],
             "weight_decay": [1e-4, 1e-3, 1e-2, 1e-1]},
    "er": {"learning_rate": [1e-4, 3e-4, 1e-3, 3e-3], "weight_decay": [1e-4, 1e-3, 1e-2, 1e-1]},
    "ewc_pp": _SMALL, "mir": _SMALL, "pcr": _SMALL,
    "gdumb": {"learning_rate": [1e-3, 1e-2, 1e-1], "weight_decay": [1e-4, 1e-6]},
    "der_pp": {"learning_rate": [3e-4, 3e-3, 3e-2]},
    "lode": {"learning_rate": [3e-4, 3e-3, 3e-2]},
    "ema_der_pp": _EMA, "ema_rar": _EMA,
    # Online-LoRA (its `learner` block; docs/methods.md): learning rates from the demo's 1e-3 down
    # in half-decades past the paper's 2e-4 (ViT-B; 3e-4 Swin, 5e-4 ViT-S), and the plateau
    # rule's thresholds on the demo's loss scale, from its values (3.5, 0.05) up: there the window
    # of CE(batch) + CE(hard buffer) settles at 2.0-3.9 late in a task with a variance of
    # 0.005-0.03, and 3.5/0.05 misses a boundary on every seed; lower thresholds could only fire
    # fewer plateaus. The paper's settings have other loss scales: give their grids with --grid.
    "online_lora": {"learning_rate": [1e-4, 3e-4, 1e-3], "mean_threshold": [3.5, 4.5],
                    "var_threshold": [0.05, 0.1]},
}
# A grid key's short name in a tuning point's workdir name (any other key: its own name).
TAGS = {"learning_rate": "lr", "weight_decay": "wd", "mean_threshold": "mean",
        "var_threshold": "var"}
VALIDATION_FRACTION = 0.1  # of the training split, held out for --tune
# --launcher slurm: the #SBATCH values given as text (empty: the cluster's default).
SLURM_TEXT_FLAGS = {
    "partition": "#SBATCH --partition",
    "time": "time limit of one cell's task (#SBATCH --time, e.g. 4:00:00); a cell that needs"
            " longer checkpoints and is requeued",
    "mem": "memory per cell (#SBATCH --mem, e.g. 16G)",
    "gres": "generic resources per cell (#SBATCH --gres, e.g. gpu:1)",
}
SIGNAL_LEAD = 120  # s before the time limit: the checkpoint of a large model's step fits
MAX_REQUEUES = 50


def setting_name(config: str) -> str:
  """configs/split_cifar100.py:vit_s16 -> 'split_cifar100_vit_s16'."""
  path, _, arg = config.partition(":")
  stem = pathlib.Path(path).stem
  return f"{stem}_{arg}" if arg else stem


def plan(root: str, settings: list[str], methods: list[str], seeds: list[int],
         overrides: list[str]) -> list[tuple[str, list[str]]]:
  """(workdir, run.py command) of every run, settings outermost, seeds innermost."""
  runs = []
  for config in settings:
    for method in methods:
      for seed in seeds:
        workdir = os.path.join(root, setting_name(config), method_dir(method), f"seed{seed}")
        runs.append((workdir, [sys.executable, RUN, f"--config={config}", f"--workdir={workdir}",
                               f"--config.method={method}", f"--config.seed={seed}",
                               *tracker_overrides(root), *overrides]))
  return runs


def tracker_overrides(root: str) -> list[str]:
  """The cells' W&B group and MLflow store: the sweep's (ROOT's name, and ROOT)."""
  root = os.path.abspath(root)
  return [f"--config.logger_group={os.path.basename(root)}", f"--config.logger_dir={root}"]


def method_dir(method: str) -> str:
  """A run's method directory: the method's name (its spec's, for a method outside the package
  given as 'path/to/file.py:NAME')."""
  if ":" not in method:
    return method
  from olora_jax import methods  # imports JAX: only for a method of one's own
  return methods.resolve(method).name


def grid_points(grid: dict) -> list[dict]:
  """{key: [values]} -> every combination, in grid order (the last key varies fastest)."""
  keys = sorted(grid)
  return [dict(zip(keys, values, strict=True))
          for values in itertools.product(*(grid[k] for k in keys))]


def point_name(point: dict) -> str:
  """{'learning_rate': 0.001} -> 'learning_rate=0.001' (keys sorted, comma separated)."""
  return ",".join(f"{k}={v!r}" for k, v in sorted(point.items()))


def pick(scores: list[tuple[dict, float | None]]) -> dict:
  """The grid point of the best score (higher is better; the first on a tie; a failed run,
  None, never wins). ValueError when every point failed."""
  scored = [(point, s) for point, s in scores if s is not None]
  if not scored:
    raise ValueError("every grid point failed; nothing to pick")
  return max(scored, key=lambda ps: ps[1])[0]


def parse_grid(text: str) -> dict:
  """'learning_rate=1e-3,1e-2;weight_decay=0' -> {'learning_rate': [0.001, 0.01], ...}: keys of
  the tuned methods' config blocks (checked against each block by `grid_problem`)."""
  grid = {}
  for part in filter(None, text.split(";")):
    key, _, values = part.partition("=")
    try:
      if not key.isidentifier() or not values:
        raise ValueError
      grid[key] = [float(v) for v in values.split(",")]
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"--grid part {part!r}: use KEY=V,V;KEY=V,V with number values, e.g."
          " learning_rate=1e-3,1e-2;weight_decay=0") from None
  return grid


def method_grid(args, method: str) -> dict | None:
  """The grid --tune searches for `method`: --grid, else its TUNING_GRIDS entry (None: none)."""
  return args.grid if args.grid is not None else TUNING_GRIDS.get(method)


def grid_problem(args) -> str | None:
  """One line naming the first --tune grid key that is not a float key of its method's config
  block (`--config.<block>.<key>` would fail every tuning run), else None."""
  from configs import common
  from olora_jax import methods
  for method in args.methods:
    grid = method_grid(args, method)
    if not grid:
      continue
    block = methods.resolve(method).block
    defaults = common.get_config(method)[block]
    floats = sorted(k for k, v in defaults.items() if isinstance(v, float))
    for key in sorted(grid):
      if key not in floats:
        return (f"--grid key {key!r}: method={method} reads no float key {block}.{key}; its"
                f" block's float keys are {', '.join(floats)} (tune methods of other blocks in"
                " separate sweeps)")
  return None


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
                      help=argparse.SUPPRESS)  # one task of a SLURM array (launch/slurm.py)
  parser.add_argument("--tune", action="store_true",
                      help="first pick each method's hyperparameters (TUNING_GRIDS: learning rate"
                      " and weight decay; Online-LoRA's learning rate and plateau thresholds) on a"
                      " held-out validation stream (the paper's protocol; module docstring)")
  parser.add_argument("--grid", type=parse_grid, default=None,
                      help="with --tune: one grid for every method, keys of its config block, e.g."
                      " 'learning_rate=1e-3,1e-2;weight_decay=0' or (Online-LoRA)"
                      " 'mean_threshold=2.6,3.0;var_threshold=0.03' (default: TUNING_GRIDS)")
  parser.add_argument("--tune_seed", type=int, default=0, help="seed of the validation runs")
  parser.add_argument("--tune_metric", default="A_final",
                      help="results.json value the validation runs are ranked by")
  parser.add_argument("--validation_fraction", type=float, default=VALIDATION_FRACTION,
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
                       f" (default {SIGNAL_LEAD}; SLURM may send it up to 60 s earlier)")
  cluster.add_argument("--max_requeues", type=int, default=None,
                       help=f"requeue a cell at most this many times (default {MAX_REQUEUES})")
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
  args.signal_lead = args.signal_lead or SIGNAL_LEAD
  args.max_requeues = MAX_REQUEUES if args.max_requeues is None else args.max_requeues
  args.requeue_on = args.requeue_on or []
  args.ntasks = args.ntasks or 1
  args.gpus_per_task = args.gpus_per_task or 0
  limit = slurm.time_seconds(args.time) if args.time else None
  if limit is not None and args.signal_lead >= limit:
    parser.error(f"--signal_lead={args.signal_lead} is not shorter than --time={args.time}"
                 f" ({limit} s): the warning would come before the cell could run; give a"
                 f" --signal_lead below {limit} (a step plus a checkpoint save) or a longer"
                 " --time")
  if args.gpus_per_task and args.gres.startswith("gpu"):
    parser.error("--gpus_per_task and --gres=gpu:... both ask for GPUs; give one of them")
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    parser.error(f"after '--' only --config.KEY=VALUE overrides are passed on, got {bad}")
  missing = [s for s in args.settings if not os.path.isfile(s.partition(":")[0])]
  if missing:
    parser.error(f"config file(s) {missing} do not exist; settings are in configs/")
  if args.launcher == "slurm" and not args.dry_run and slurm.check_available():
    parser.error(slurm.check_available())
  from olora_jax import methods  # the names only (imports JAX, after the cheap checks)
  for method in args.methods:
    try:
      methods.resolve(method)
    except ValueError as e:
      parser.error(str(e))
  if args.tune and grid_problem(args):
    parser.error(grid_problem(args))
  return args


def tuning_plans(args) -> list[dict]:
  """The validation runs of --tune, per setting and method with a grid: {"method_dir",
  "method", "block", "setting", "points", "workdirs", "commands", "metric",
  "validation_fraction", "seed"}; a point's keys are keys of the method's config block
  (`MethodSpec.block`: `learner` for Online-LoRA)."""
  from olora_jax import methods
  plans = []
  for config in args.settings:
    for method in args.methods:
      grid = method_grid(args, method)
      if not grid:
        continue
      block = methods.resolve(method).block
      method_dir_ = os.path.join(args.root, setting_name(config), method_dir(method))
      points = grid_points(grid)
      workdirs, commands = [], []
      for point in points:
        tag = "_".join(f"{TAGS.get(k, k)}{v:g}" for k, v in sorted(point.items()))
        workdir = os.path.join(method_dir_, "tune", tag)
        workdirs.append(workdir)
        commands.append([
            sys.executable, RUN, f"--config={config}", f"--workdir={workdir}",
            f"--config.method={method}", f"--config.seed={args.tune_seed}",
            *tracker_overrides(args.root), *args.overrides,
            f"--config.data.validation_fraction={args.validation_fraction}",
            *point_overrides(block, point)])
      plans.append({"method_dir": method_dir_, "method": method, "block": block,
                    "setting": config, "points": points, "workdirs": workdirs,
                    "commands": commands, "metric": args.tune_metric,
                    "validation_fraction": args.validation_fraction, "seed": args.tune_seed})
  return plans


def point_overrides(block: str, point: dict) -> list[str]:
  """A grid point as run.py overrides of the method's config block, keys sorted."""
  return [f"--config.{block}.{k}={v!r}" for k, v in sorted(point.items())]


def choose(plan: dict) -> list[str]:
  """The overrides of the best validation point of one method's tuning `plan`, written with
  every point's score to METHOD_DIR/tuning.json. A point that failed (its recorded exit is not 0)
  scores None; RuntimeError, naming them, while any point is not finished or failed yet."""
  waiting = [w for w in plan["workdirs"] if not cells.is_finished(w)
             and cells.cell_status(w)[0] != "failed"]
  if waiting:
    raise RuntimeError(f"{len(waiting)} of the {len(plan['workdirs'])} tuning runs of"
                       f" {plan['method_dir']} have not finished ({waiting[0]}, ...); run the"
                       " sweep again once they have")
  scores = []
  for point, workdir in zip(plan["points"], plan["workdirs"], strict=True):
    score = None
    if cells.is_finished(workdir):
      with open(os.path.join(workdir, "results.json")) as f:
        score = json.load(f).get(plan["metric"])
    scores.append((point, score))
  best = pick(scores)
  block = plan.get("block", plan["method"])  # a plan written before `block` was: its name
  record = {"method": plan["method"], "block": block, "setting": plan["setting"],
            "metric": plan["metric"], "validation_fraction": plan["validation_fraction"],
            "seed": plan["seed"], "scores": [{"point": p, "score": s} for p, s in scores],
            "chosen": best}
  path = os.path.join(plan["method_dir"], "tuning.json")
  with open(f"{path}.{os.getpid()}.tmp", "w") as f:  # SLURM tasks may write it at once
    json.dump(record, f, indent=1)
  os.replace(f"{path}.{os.getpid()}.tmp", path)
  print(f"{plan['method_dir']}: picked {point_name(best)} (best validation {plan['metric']}, of"
        f" {len(plan['points'])} grid points)", flush=True)
  return point_overrides(block, best)


def tune(args) -> tuple[dict, int]:
  """The validation runs of --tune, one after another: (ROOT/NAME/METHOD -> overrides of the
  picked point, exit code: 0, or the code that stops the sweep). Writes each method's
  tuning.json."""
  chosen = {}
  plans = {p["method_dir"]: p for p in tuning_plans(args)}
  for config in args.settings:
    for method in args.methods:
      method_dir_ = os.path.join(args.root, setting_name(config), method_dir(method))
      if method_dir_ not in plans:
        print(f"{method_dir_}: no grid, the defaults", flush=True)
        continue
      plan_ = plans[method_dir_]
      code, stop = execute(list(zip(plan_["workdirs"], plan_["commands"], strict=True)), args)
      if stop:
        return chosen, code
      if args.dry_run and not all(map(cells.is_finished, plan_["workdirs"])):
        continue  # nothing to pick from yet
      try:
        chosen[method_dir_] = choose(plan_)
      except ValueError as e:  # every point failed
        print(f"{method_dir_}: {e}; its test seeds are not run", file=sys.stderr, flush=True)
        return chosen, code or errors.EXIT_INTERNAL
  return chosen, 0


def execute(runs: list[tuple[str, list[str]]], args) -> tuple[int, bool]:
  """Runs each (workdir, command) not finished yet, in order, and prints a summary; (the first
  failed run's exit code or 0, whether the sweep must stop)."""
  summary, first_failure, stop = [], 0, False
  for i, (workdir, command) in enumerate(runs, 1):
    head = f"[{i}/{len(runs)}] {workdir}"
    if cells.is_finished(workdir):
      print(f"{head}: finished, skipped", flush=True)
      summary.append((workdir, "finished earlier", 0.0))
      continue
    if args.dry_run:
      print(" ".join(command), flush=True)
      continue
    state = cells.cell_status(workdir)[0]
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
      if args.fail_fast:
        print(f"sweep stopped at the first failed run (--fail_fast): {workdir}: {line}",
              file=sys.stderr)
        stop = True
        break
  if summary:
    print("\nsummary (wall time of this invocation):")
    for workdir, status, seconds in summary:
      print(f"  {workdir}: {status}" + (f", {seconds:.0f} s" if seconds else ""))
  return first_failure, stop


def grid_cells(args) -> list[dict]:
  """Every cell of the sweep, tuning points first: {"workdir", "command", "tuning"} ("tuning":
  the plan a test seed's overrides are picked from, or None)."""
  plans = tuning_plans(args) if args.tune else []
  by_dir = {p["method_dir"]: p for p in plans}
  grid = [{"workdir": w, "command": c, "tuning": None}
          for p in plans for w, c in zip(p["workdirs"], p["commands"], strict=True)]
  for workdir, command in plan(args.root, args.settings, args.methods, args.seeds,
                               args.overrides):
    tuning = by_dir.get(os.path.dirname(workdir))
    grid.append({"workdir": workdir, "command": command,
                 "tuning": {k: v for k, v in tuning.items() if k != "commands"} if tuning
                 else None})
  return grid


def run_local(args) -> int:
  if not args.dry_run:
    with cells.plan_lock(args.root):
      cells.write_plan(args.root, cells.merged_plan(args.root, grid_cells(args)))
  chosen = {}
  if args.tune:
    chosen, code = tune(args)
    if code:
      return code
  runs = [(workdir, command + chosen.get(os.path.dirname(workdir), []))
          for workdir, command in plan(args.root, args.settings, args.methods, args.seeds,
                                       args.overrides)]
  for workdir, _ in runs:
    if os.path.dirname(workdir) in chosen and (note := stale_pick(workdir)):
      print(note, file=sys.stderr, flush=True)
  return execute(runs, args)[0]


def stale_pick(workdir: str) -> str | None:
  """A note for a finished test seed of a tuned method whose config does not hold the point its
  tuning.json picked (it ran before the tuning, or with an earlier pick): the sweep skips it as
  finished, and report.py does not label it tuned. None for any other workdir."""
  from olora_jax import reporting, validation
  method_dir = os.path.dirname(workdir)
  if (not cells.is_finished(workdir)
      or not os.path.isfile(os.path.join(method_dir, reporting.TUNING_RECORD))):
    return None
  with open(os.path.join(workdir, "config.json")) as f:
    if reporting.tuning_record(workdir, validation.flatten(json.load(f))):
      return None
  return (f"note: {workdir} finished with other values than the pick in"
          f" {method_dir}/{reporting.TUNING_RECORD}; it is kept and skipped (report.py does not"
          " label it tuned): remove it and run the sweep again to run the pick")


def run_slurm(args) -> int:
  """Writes the batch script and submits the cells not finished: the tuning points and the
  untuned cells as one array, the seeds picked by tuning as a second array that starts when the
  first has ended. sweep.json is read, extended and written under its lock, around the
  submission: two submissions into one root at once each get their own cells."""
  grid = grid_cells(args)
  if args.ntasks > 1:
    for cell in grid:
      cell["command"] = cell["command"] + ["--config.distributed.initialize=cluster"]
  root = os.path.abspath(args.root)
  cache = "" if args.compilation_cache == "off" else os.path.abspath(
      args.compilation_cache or os.path.join(root, slurm.CACHE))
  script = slurm.batch_script(
      root, sys.executable, os.path.abspath(__file__), os.getcwd(), partition=args.partition,
      time=args.time, mem=args.mem, cpus=args.cpus, gres=args.gres,
      signal_lead=args.signal_lead, extra=args.sbatch, ntasks=args.ntasks,
      gpus_per_task=args.gpus_per_task, setup=args.setup, cache=cache)
  path = os.path.join(root, "slurm", slurm.SCRIPT)
  if args.dry_run:
    merged = cells.merged_plan(args.root, grid)
    first, second = _arrays(grid, merged)
    print(f"{len(grid)} cells, {len(grid) - len(first) - len(second)} finished,"
          f" {len(first) + len(second)} to submit")
    print(f"--- {path}\n{script}---")
    if first:
      print(slurm.sbatch_command(path, first, args.throttle, None))
    if second:
      print(slurm.sbatch_command(path, second, args.throttle,
                                 "<the first array's job id>" if first else None))
    return 0
  with cells.plan_lock(args.root):
    merged = cells.merged_plan(args.root, grid)
    first, second = _arrays(grid, merged)
    print(f"{len(grid)} cells, {len(grid) - len(first) - len(second)} finished,"
          f" {len(first) + len(second)} to submit")
    if not first and not second:
      return 0
    refused = slurm.test_only(script, first or second, args.throttle)
    if refused:
      print(f"error: {refused}", file=sys.stderr)
      return errors.EXIT_BAD_INPUT
    os.makedirs(os.path.join(root, "slurm", "logs"), exist_ok=True)
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
      f.write(script)
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    # The cells are in sweep.json before any task can start (a task reads it under the lock).
    cells.write_plan(args.root, merged)
    slurm.clear_cancelled(args.root)  # an earlier --cancel: this submission runs again
    jobs, submitted = [], {}
    for indices in (first, second):
      if indices:
        try:
          job = slurm.submit(path, indices, args.throttle, after=jobs[-1] if jobs else None)
        except RuntimeError as e:
          print(f"error: {e}", file=sys.stderr)
          break
        jobs.append(job)
        submitted.update({i: job for i in indices})
        print(f"submitted job array {job}: cells {slurm.array_ranges(indices)} (logs in"
              f" {root}/slurm/logs/{job}_<cell>.out)")
    for i, job in submitted.items():
      merged[i] = {**merged[i], "slurm": {
          "task": f"{job}_{i}", "jobs": jobs, "max_requeues": args.max_requeues,
          "requeue_on": args.requeue_on, "fail_fast": args.fail_fast, "ntasks": args.ntasks,
          "cpus": args.cpus}}
    cells.write_plan(args.root, merged, {"jobs": jobs, "submitted": cells.now(),
                                         "cells": sorted(submitted)})
  if len(submitted) < len(first) + len(second):
    return errors.EXIT_ENVIRONMENT
  print(f"see their state with: {sys.argv[0]} --status {args.root}")
  return 0


def _arrays(grid: list[dict], merged: list[dict]) -> tuple[list[int], list[int]]:
  """The plan indices of the cells to submit: (the first array, the tuned seeds after it)."""
  index = {os.path.abspath(c["workdir"]): i for i, c in enumerate(merged)}
  todo = [c for c in grid if not cells.is_finished(c["workdir"])]
  return ([index[os.path.abspath(c["workdir"])] for c in todo if not c["tuning"]],
          [index[os.path.abspath(c["workdir"])] for c in todo if c["tuning"]])


def run_one_cell(root: str, index: str) -> int:
  """One task of the SLURM array: cell `index` of ROOT/sweep.json, as the local sweep runs it;
  then what its exit asks of the scheduler: a requeue (only after the scheduler's signals, or
  the codes of --requeue_on, up to --max_requeues), or, with --fail_fast, the sweep's pending
  tasks cancelled."""
  with cells.plan_lock(root):  # waits for a submission still writing it
    cell = cells.load_plan(root)[int(index)]
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
    forward = lambda proc, signum: slurm.signal_step(signum)  # noqa: E731  (never to srun)
  state = cells.cell_status(workdir)[0]
  print(f"{workdir}: {'starting' if state == 'not started' else 'resuming'}", flush=True)
  code, line, signalled = cells.run_cell(workdir, command, forward=forward)
  task = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{index}"
  why = slurm.requeue_reason(code, signalled, job.get("requeue_on", []))
  restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
  most = job.get("max_requeues", MAX_REQUEUES)
  note = None
  cancelled = slurm.cancelled(root, os.environ.get("SLURM_ARRAY_JOB_ID"))
  if why and cancelled:
    note = f"{why}: not requeued, the sweep was cancelled ({cancelled})"
  elif why and restarts < most:
    print(f"[{cells.now()}] {why}: requeueing {task} (requeue {restarts + 1} of at most"
          f" {most})", file=sys.stderr, flush=True)
    refused = slurm.requeue(task)
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
    refused = slurm.cancel_pending(others)
    if refused:
      note += f"; scancel refused: {refused}"
  if note:
    print(f"[{cells.now()}] {note}", file=sys.stderr, flush=True)
    if code != 0 and line != "finished earlier":
      cells.update_record(workdir, lambda current: {**current, "note": note}
                          if current and current.get("state") == "exited" else None)
  return code


def cancel(root: str) -> int:
  """`--cancel ROOT`: marks the sweep cancelled (ROOT/slurm/cancelled.json, which its tasks read
  before requeueing themselves and a new submission removes), then cancels every job it
  submitted: the running tasks get SLURM's SIGTERM, their runs checkpoint and exit 143 and are
  not requeued; the pending ones never start."""
  if not os.path.isdir(root):
    print(f"error: --cancel {root}: no such directory; give a sweep's --root", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  with cells.plan_lock(root):
    _, submissions = cells.load_plan(root, with_submissions=True)
    jobs = sorted({str(j) for s in submissions for j in s.get("jobs", []) if j}, key=int)
    if not jobs:
      print(f"error: --cancel {root}: no SLURM job in its {cells.PLAN}: nothing to cancel (a"
            " local sweep stops with Ctrl-C or SIGTERM to its process)", file=sys.stderr)
      return errors.EXIT_BAD_INPUT
    slurm.mark_cancelled(root, jobs)
  refused = slurm.cancel(jobs)
  if refused:
    print(f"error: scancel {' '.join(jobs)} refused: {refused}", file=sys.stderr)
    return errors.EXIT_ENVIRONMENT
  print(f"cancelled job(s) {', '.join(jobs)}: running cells checkpoint and stop (not requeued),"
        f" queued ones will not start; {sys.argv[0]} --status {root} shows where each stopped,"
        " and the same sweep command resumes it")
  return 0


def print_status(root: str) -> int:
  if not os.path.isdir(root):
    print(f"error: --status {root}: no such directory; give a sweep's --root", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  with cells.plan_lock(root):
    lines, counts = cells.status_lines(root, scheduler=slurm.tasks)
  if not lines:
    print(f"error: --status {root}: no sweep there (no {cells.PLAN}, no cell's"
          f" {cells.EXIT_RECORD}); give a sweep's --root", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  print("\n".join(lines))
  print(f"{len(lines)} cells: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in cells.STATES))
  return 0


def main(argv: list[str]) -> int:
  args = parse(argv)
  try:
    if args.status:
      return print_status(args.status)
    if args.run_cell:
      return run_one_cell(*args.run_cell)
    if args.cancel:
      return cancel(args.cancel)
    return run_slurm(args) if args.launcher == "slurm" else run_local(args)
  except cells.PlanDamaged as e:  # ROOT/sweep.json: one line, whatever read it
    print(f"error: {e}", file=sys.stderr)
    return e.exit_code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
