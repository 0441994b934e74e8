"""A sweep's plan: its cells (settings x methods x seeds, one `launch/run.py` command and workdir
each), the grids of --tune and the pick among their points.

Each run is `launch/run.py --config SETTING --workdir ROOT/NAME/METHOD/seedN --config.method=METHOD
--config.seed=N --config.logger_group=SWEEP --config.logger_dir=ROOT` plus the overrides (NAME:
the config file's name, with its argument when it has one: configs/split_cifar100.py:vit_s16 ->
split_cifar100_vit_s16; SWEEP: ROOT's own name). `Sweep` holds what a sweep runs; `grid_cells`
lists its cells, tuning points first, as the plan ROOT/sweep.json keeps them
(olora_jax/sweep/cells.py). The command line's docstring (olora_jax/sweep/cli.py) describes
--tune's protocol.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import sys

from olora_jax.sweep import cells, status

# launch/run.py (the repository the package is in: it is installed editable, `pip install -e`).
RUN = str(pathlib.Path(__file__).resolve().parents[2] / "launch" / "run.py")
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


@dataclasses.dataclass
class Sweep:
  """What a sweep runs (the command line's flags of the same names): the runs of `settings` x
  `methods` x `seeds` into ROOT, with `overrides` (`--config.KEY=VALUE`) passed to every run;
  with `tune`, first the validation runs of each method's grid (`grid`, else its TUNING_GRIDS
  entry) with seed `tune_seed`, ranked by `tune_metric` on the `validation_fraction` held out.
  `dry_run`: print the commands, run and write nothing; `fail_fast`: stop at the first failed
  run."""

  root: str
  settings: list[str]
  methods: list[str]
  seeds: list[int] = (0, 1, 2)
  overrides: list[str] = ()
  tune: bool = False
  grid: dict | None = None
  tune_seed: int = 0
  tune_metric: str = "A_final"
  validation_fraction: float = VALIDATION_FRACTION
  dry_run: bool = False
  fail_fast: bool = False


def input_problem(sweep: Sweep) -> str | None:
  """One line naming the first problem of the sweep's grid that needs no JAX to see, else None:
  an empty list of settings, methods or seeds (no cells; no seeds is allowed with `tune`, which
  then runs the validation runs alone), an item given twice (two cells of one workdir), a ROOT
  that is a file, an override that is not `--config.KEY=VALUE`, a setting whose config file does
  not exist."""
  for name in ("settings", "methods", "seeds"):
    items = list(getattr(sweep, name))
    if not items and not (name == "seeds" and sweep.tune):
      return (f"{name} is empty: the sweep has no cells; give at least one (settings x methods x"
              " seeds make the cells; with --tune, no seeds runs the validation runs alone)")
    twice = sorted({repr(x) for x in items if items.count(x) > 1})
    if twice:
      return (f"{name} {items} name {', '.join(twice)} more than once: each cell has one"
              " workdir and runs once; give each once")
  problem = cells.root_problem(sweep.root, "--root")
  if problem:
    return problem
  bad = [o for o in sweep.overrides if not o.startswith("--config.")]
  if bad:
    return f"after '--' only --config.KEY=VALUE overrides are passed on, got {bad}"
  missing = [s for s in sweep.settings if not os.path.isfile(s.partition(":")[0])]
  if missing:
    return f"config file(s) {missing} do not exist; settings are in configs/"
  return None



def method_problem(sweep: Sweep) -> str | None:
  """One line naming the first method that does not resolve, an override key no run of the
  sweep's methods would know (`override_problem`), or (with --tune) the first grid key its
  method does not read (`grid_problem`), else None. Imports JAX."""
  from olora_jax import methods  # the names only (imports JAX, after the cheap checks)
  for method in sweep.methods:
    try:
      methods.resolve(method)
    except ValueError as e:
      return str(e)
  return override_problem(sweep) or (grid_problem(sweep) if sweep.tune else None)


def override_problem(sweep: Sweep) -> str | None:
  """The line `launch/run.py` would refuse every cell with when an override's key is not a
  config key (configs/common.py, with the block of each of the sweep's methods), else None: the
  sweep refuses it before any cell runs."""
  from configs import common
  from olora_jax import validation
  known = set().union(*(validation.flat_keys(common.get_config(m)) for m in sweep.methods))
  given = [o[len("--config."):].partition("=")[0] for o in sweep.overrides]
  unknown = [k for k in given if k not in known
             and not any(x.startswith(k + ".") or k.startswith(x + ".") for x in known)]
  return validation.unknown_keys_message(unknown, known, "in the overrides") if unknown else None


def setting_name(config: str) -> str:
  """configs/split_cifar100.py:vit_s16 -> 'split_cifar100_vit_s16'."""
  path, _, arg = config.partition(":")
  stem = pathlib.Path(path).stem
  return f"{stem}_{arg}" if arg else stem


def seed_runs(root: str, settings: list[str], methods: list[str], seeds: list[int],
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


def method_grid(sweep: Sweep, method: str) -> dict | None:
  """The grid --tune searches for `method`: --grid, else its TUNING_GRIDS entry (None: none)."""
  return sweep.grid if sweep.grid is not None else TUNING_GRIDS.get(method)


def grid_problem(sweep: Sweep) -> str | None:
  """One line naming the first --tune grid key that is not a float key of its method's config
  block (`--config.<block>.<key>` would fail every tuning run), else None."""
  from configs import common
  from olora_jax import methods
  if sweep.grid is not None and not isinstance(sweep.grid, dict):
    return (f"grid={sweep.grid!r}: give a dict of a method block's keys to lists of numbers,"
            " e.g. {'learning_rate': [1e-3, 1e-2]}")
  for key, values in (sweep.grid or {}).items():
    if (isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
      return (f"grid key {key!r} has the values {values!r}: give a non-empty list of numbers,"
              f" e.g. {{{key!r}: [1e-3, 1e-2]}} (an empty one has no point to tune)")
  for method in sweep.methods:
    grid = method_grid(sweep, method)
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


def tuning_plans(sweep: Sweep) -> list[dict]:
  """The validation runs of --tune, per setting and method with a grid: {"method_dir",
  "method", "block", "setting", "points", "workdirs", "commands", "metric",
  "validation_fraction", "seed"}; a point's keys are keys of the method's config block
  (`MethodSpec.block`: `learner` for Online-LoRA)."""
  from olora_jax import methods
  plans = []
  for config in sweep.settings:
    for method in sweep.methods:
      grid = method_grid(sweep, method)
      if not grid:
        continue
      block = methods.resolve(method).block
      method_dir_ = os.path.join(sweep.root, setting_name(config), method_dir(method))
      points = grid_points(grid)
      workdirs, commands = [], []
      for point in points:
        tag = "_".join(f"{TAGS.get(k, k)}{v:g}" for k, v in sorted(point.items()))
        workdir = os.path.join(method_dir_, "tune", tag)
        workdirs.append(workdir)
        commands.append([
            sys.executable, RUN, f"--config={config}", f"--workdir={workdir}",
            f"--config.method={method}", f"--config.seed={sweep.tune_seed}",
            *tracker_overrides(sweep.root), *sweep.overrides,
            f"--config.data.validation_fraction={sweep.validation_fraction}",
            *point_overrides(block, point)])
      plans.append({"method_dir": method_dir_, "method": method, "block": block,
                    "setting": config, "points": points, "workdirs": workdirs,
                    "commands": commands, "metric": sweep.tune_metric,
                    "validation_fraction": sweep.validation_fraction, "seed": sweep.tune_seed})
  return plans


def point_overrides(block: str, point: dict) -> list[str]:
  """A grid point as run.py overrides of the method's config block, keys sorted."""
  return [f"--config.{block}.{k}={v!r}" for k, v in sorted(point.items())]


def choose(plan: dict) -> list[str]:
  """The overrides of the best validation point of one method's tuning `plan`, written with
  every point's score to METHOD_DIR/tuning.json. A point that failed (its recorded exit is not 0)
  scores None; RuntimeError, naming them, while any point is not finished or failed yet."""
  waiting = [w for w in plan["workdirs"] if not cells.is_finished(w)
             and status.cell_status(w)[0] != "failed"]
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


def grid_cells(sweep: Sweep) -> list[dict]:
  """Every cell of the sweep, tuning points first: {"workdir", "command", "tuning"} ("tuning":
  the plan a test seed's overrides are picked from, or None)."""
  plans = tuning_plans(sweep) if sweep.tune else []
  by_dir = {p["method_dir"]: p for p in plans}
  grid = [{"workdir": w, "command": c, "tuning": None}
          for p in plans for w, c in zip(p["workdirs"], p["commands"], strict=True)]
  for workdir, command in seed_runs(sweep.root, sweep.settings, sweep.methods, sweep.seeds,
                                    sweep.overrides):
    tuning = by_dir.get(os.path.dirname(workdir))
    grid.append({"workdir": workdir, "command": command,
                 "tuning": {k: v for k, v in tuning.items() if k != "commands"} if tuning
                 else None})
  return grid


def write(sweep: Sweep) -> list[dict]:
  """The sweep's cells (`grid_cells`), added to ROOT/sweep.json under its lock (a cell already
  there keeps its index; olora_jax/sweep/cells.py's `merged_plan`)."""
  grid = grid_cells(sweep)
  with cells.plan_lock(sweep.root):
    cells.write_plan(sweep.root, cells.merged_plan(sweep.root, grid))
  return grid


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
