"""Aggregation of finished runs into paper-style tables: mean ± std over seeds.

Each run directory holds config.json and results.json (written by `olora_jax.trainer`). Every
table starts from one row per run (a cell of a sweep: `cell_row`, `results_rows`, the rows the
Python API returns, a pandas DataFrame with `as_dataframe`); `table_rows` groups them. Runs are
grouped by their whole config except `seed` and output-only keys (`IGNORED_KEYS`), so two runs
land in one cell only when they differ in nothing but the seed. A group is shown as a row (the
method: which Online-LoRA components are on, plus any config key that tells apart groups which
would otherwise share a label) and a column group (the setting: dataset, scenario, number of
tasks, backbone), like the paper's tables: methods down, datasets across, a few metrics each.

Numbers are percentages (wall time in seconds): mean ± sample standard deviation (ddof = 1) over
the seeds of a group; a group of one seed shows the mean alone. Runs whose metric is null (e.g.
Forgetting with one task, A_auc of GDumb, evaluated at task ends only) are left out of that
metric's mean, and the count says so.

Rows are ordered as the paper's Table 1 (baselines, then Online-LoRA, then the upper bound).
A row whose runs `launch/sweep.py --tune` made with its picked grid point (the method directory's
tuning.json, `tuning_record`) says so in its label, "(tuned: KEY=VALUE, ...)", and the table's
note says on what it was tuned; the sweep's validation runs (METHOD/tune/) are never tabulated
with the test runs.
Runs of one setting and one seed must share their stream manifest (results.json
`stream_manifest_sha256`; for the i.i.d. upper bound, `benchmark_manifest_sha256`, the stream it
shuffles): `aggregate` refuses to put runs made on different streams side by side.
"""

from __future__ import annotations

import csv
import dataclasses
import decimal
import hashlib
import io
import json
import math
import os
from collections.abc import Sequence

import numpy as np

from olora_jax import methods, validation
from olora_jax.methods.base import AUTHORS_CODE

# Keys that never change a run's numbers; runs differing only in these are one group.
IGNORED_KEYS = frozenset({"seed", "log_every", "eval.write_plots", "loggers", "logger_project"})
DEFAULT_METRICS = ("A_final", "forgetting", "A_auc")
# The compute ledger's budget (results.json "compute"), tabulated as a metric of the run.
BUDGET_KEYS = ("passes_per_step", "passes_per_sample")
NOT_PERCENT = frozenset({"wall_seconds", *BUDGET_KEYS})  # shown as they are, not x 100
# launch/sweep.py --tune: the pick, beside a method's seed workdirs, and the validation runs' dir.
TUNING_RECORD = "tuning.json"
TUNING_DIR = "tune"
# MLflow's record of an experiment and of a run in its file store (`find_runs` skips them).
TRACKER_RECORD = "meta.yaml"


def _method_names() -> dict[str, str]:
  """The `method` config key -> its report name, in the row order of the paper's Table 1, as each
  method module declares it (olora_jax/methods)."""
  return {spec.name: spec.report_name for spec in methods.specs()}


# How the paper prints each metric's header; an arrow says which direction is better.
METRIC_LABELS = {
    "A_final": "A_final ↑", "forgetting": "Forgetting ↓", "A_auc": "A_auc ↑",
    "A_last": "A_last ↑", "F_last": "F_last ↓", "backward_transfer": "BWT ↑",
    "task_balanced_accuracy_final": "task-balanced acc ↑", "wall_seconds": "wall time (s)",
    "passes_per_step": "budget (passes/step)", "passes_per_sample": "budget (passes/sample)",
    "A_final_task_il": "Task-IL A_final ↑", "A_auc_task_il": "Task-IL A_auc ↑",
}



def _paper_results() -> dict:
  """The paper's own numbers, (mean, std) in % (None: the paper prints "-"), gathered from the
  method modules' declarations (`MethodSpec.paper_results`): Table 1 (disjoint
  class-incremental, A_final / Forgetting), Table 2 (Si-Blurry, A_auc / A_final) and the
  appendix's Swin table (Split ImageNet-S and CORe50, A_final / Forgetting) of Online-LoRA
  (WACV 2025), by layout, setting (`setting_label`) and row (the paper's method name).
  `layout_table` prints them next to the runs where a setting matches."""
  out: dict = {}
  for spec in methods.specs():
    for layout, settings in spec.paper_results.items():
      for setting, values in settings.items():
        out.setdefault(layout, {}).setdefault(setting, {})[spec.paper_row(layout)] = values
  return out


@dataclasses.dataclass(frozen=True)
class Layout:
  """One of the paper's tables: which runs it shows (by `data.scenario`), the paper's two
  metrics (PAPER_RESULTS holds their values, in this order), the wall time per method and its
  budget (image passes per train step, from the compute ledger)."""

  title: str
  scenarios: tuple[str, ...]
  paper_metrics: tuple[str, str]
  backbones: tuple[str, ...] = ()  # the `model.name`s it shows (empty: any)

  @property
  def metrics(self) -> tuple[str, ...]:
    return (*self.paper_metrics, "wall_seconds", "passes_per_step")


LAYOUTS = {
    "table1": Layout("Table 1: disjoint class-incremental", ("disjoint",),
                     ("A_final", "forgetting")),
    "table2": Layout("Table 2: Si-Blurry class-incremental", ("si_blurry",), ("A_auc", "A_final")),
    "swin": Layout("Appendix: Swin Transformer (Split ImageNet-S, CORe50)", ("disjoint", "domain"),
                   ("A_final", "forgetting"), backbones=("swin_t",)),
}


class Run:
  """One finished run: its flattened config (dotted keys) and results."""

  def __init__(self, run_dir: str):
    paths = [os.path.join(run_dir, f) for f in ("config.json", "results.json")]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
      raise FileNotFoundError(
          f"{run_dir!r} is not a finished run (missing {', '.join(missing)}); pass the --workdir"
          " of a completed launch/run.py")
    self.config = validation.flatten(_read_run_file(paths[0]))
    self.results = _read_run_file(paths[1])
    for key in BUDGET_KEYS:  # the ledger's budget, as a metric (None where not recorded)
      self.results.setdefault(key, (self.results.get("compute") or {}).get(key))
    self.run_dir = run_dir
    self.tuning = tuning_record(run_dir, self.config)

  @property
  def seed(self):
    return self.config.get("seed")


REBUILD_RESULTS = ("delete it and rerun the run's launch/run.py command: it rebuilds results.json"
                   " from the final checkpoint")


def _read_run_file(path: str) -> dict:
  """A run's config.json or results.json; ValueError naming the file when it is damaged (cut
  short by a full disk, a copy that stopped half way)."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    record = json.loads(data)
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    fix = (REBUILD_RESULTS if os.path.basename(path) == "results.json"
           else "restore it from the run's checkpoints/ (its host record holds the config)")
    raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); {fix}") from None
  if not isinstance(record, dict):
    raise ValueError(f"{path} holds a JSON {type(record).__name__}, not a run's record")
  return record


def unfinished_reason(run_dir: str) -> str:
  """Why a run found by `find_runs` is left out: no results.json yet, or a damaged one."""
  path = os.path.join(run_dir, "results.json")
  if not os.path.isfile(path):
    return "not finished (no results.json)"
  try:
    _read_run_file(path)
  except (OSError, ValueError) as e:
    return str(e)
  return "finished"


def tuning_record(run_dir: str, config: dict) -> dict | None:
  """The `launch/sweep.py --tune` record (tuning.json) a run was made with: the one in the
  directory above its workdir (ROOT/NAME/METHOD/seedN), for the run's method, whose picked grid
  point the run's config holds (`config`: flattened); None for any other run (untuned, or run
  before the tuning picked another point)."""
  path = os.path.join(os.path.dirname(os.path.abspath(run_dir)), TUNING_RECORD)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    record = json.load(f)
  chosen = record.get("chosen") or {}
  block = record.get("block", record.get("method"))
  if (record.get("method") != config.get("method", "online_lora") or not chosen
      or any(config.get(f"{block}.{k}") != v for k, v in chosen.items())):
    return None
  return record


def tuned_suffix(record: dict | None) -> str:
  """What a tuned row's label adds: ' (tuned: learning_rate=0.003, ...)' (the picked point,
  keys of the method's config block), or '' for an untuned row."""
  if not record:
    return ""
  return " (tuned: " + ", ".join(f"{k}={v:g}" for k, v in sorted(record["chosen"].items())) + ")"


def tuning_note(rows: list[dict]) -> str:
  """The table's line on its tuned rows: what they were scored on (validation metric, held-out
  share, seed); '' when no row is tuned."""
  records = {(r["tuning"]["metric"], r["tuning"]["validation_fraction"], r["tuning"]["seed"])
             for r in rows if r.get("tuning")}
  if not records:
    return ""
  on = "; ".join(f"validation {metric} on the training split less a held-out {100 * fraction:g}%,"
                 f" seed {seed}" for metric, fraction, seed in sorted(records))
  return ("(tuned: ...): the grid point `launch/sweep.py --tune` picked by " + on + " (every"
          " point's score in tuning.json beside the runs); the other rows run their config's"
          " values.")


def comparable_config(config: dict) -> dict:
  """The config keys that can change a run's numbers: all but the seed and output switches; a
  checkpoint, and a user dataset's file, are compared by file name, since checkouts keep them at
  different absolute paths."""
  method = config.get("method", "online_lora")
  # Blocks of the methods that did not run are never read.
  own = _spec(method)
  unused = tuple(f"{m}." for m in _method_names()
                 if m != "online_lora" and (own is None or m != own.name))
  out = {k: v for k, v in config.items() if k not in IGNORED_KEYS and not k.startswith(unused)}
  if out.get("pretrained.path"):
    out["pretrained.path"] = os.path.basename(out["pretrained.path"])
  if "data.dataset" in out:
    out["data.dataset"] = dataset_name(out["data.dataset"])
  return out


def dataset_name(dataset) -> str:
  """`data.dataset` as reports show it: a user dataset's 'path/to/file.py:function' becomes
  'file.py:function'; every other name is kept."""
  if isinstance(dataset, str) and ".py:" in dataset:
    path, _, function = dataset.rpartition(":")
    return f"{os.path.basename(path)}:{function}"
  return dataset


def method_label(config: dict) -> str:
  """The method a config runs: a baseline by the paper's name (with what it trains unless it is
  the whole network, the prompt pool a prompt method always trains, or what the method's block
  trains by default: InfLoRA's and SD-LoRA's LoRA branches), Online-LoRA by its
  components (the paper's ablation table)."""
  method = config.get("method", "online_lora")
  if method != "online_lora":
    spec = _spec(method)
    name = str(method) if spec is None else spec.report_name
    block = method if spec is None else spec.name
    # What the block trains by default, as the method's module declares it; a block without a
    # `trainable` key (the training-free SLDA, RanPAC, SimpleCIL/APER) has nothing to tell apart.
    defaults = spec.config() if spec is not None and spec.config is not None else {}
    own = defaults.get("trainable", "all")
    trainable = config.get(f"{block}.trainable", own)
    name = name if trainable in ("all", "prompts", own) else f"{name} ({trainable})"
    if block == "simplecil" and config.get("simplecil.first_phase", "none") != "none":
      name = _aper_label(config, defaults)
    rule = config.get("boundaries.rule", "none")  # told of boundaries: marked (not task-free
    return name if rule == "none" else f"{name} [{rule} boundaries]"  # with 'oracle')
  incremental = config.get("learner.incremental_lora", True)
  hard = config.get("learner.hard_loss", True)
  if incremental and hard:
    name = "Online-LoRA"
  elif incremental:
    name = "Online-LoRA w/o hard loss"
  elif hard:
    name = "single LoRA + hard loss"
  else:
    name = "single LoRA"
  if "learner.fidelity" in config:
    name += f" ({config['learner.fidelity']})"
  return name


def detects_plateaus(config: dict) -> bool:
  """Whether a run (`config`: flattened) has a plateau rule: Online-LoRA's loss window
  (`learner.incremental_lora`), or a method told of boundaries by it (`boundaries.rule=plateau`);
  only then do its figures include the loss surface with the plateaus found."""
  if config.get("boundaries.rule") == "plateau":
    return True
  return (config.get("method", "online_lora") == "online_lora"
          and bool(config.get("learner.incremental_lora", True)))


def _aper_label(config: dict, defaults) -> str:
  """SimpleCIL with an adapted first phase: APER, with what the phase adapts and the first-phase
  keys that differ from the authors' reading (methods/simplecil.py)."""
  parts = [config["simplecil.first_phase"]]
  for key, what in (("first_phase_head", "head"), ("first_phase_optimizer", "")):
    value = config.get(f"simplecil.{key}", defaults.get(key))
    if value != defaults.get(key):
      parts.append(f"{value} {what}".strip())
  return f"APER ({', '.join(parts)})"


def setting_label(config: dict) -> str:
  """The benchmark a config runs: dataset, scenario, number of tasks and backbone, and the class
  order when it is not the labels' ('mnist_5k disjoint/5 custom, reversed order')."""
  order = class_order_label(config.get("data.class_order", "label"))
  return _benchmark(config) + (f", {order}" if order else "")


def _benchmark(config: dict) -> str:
  return (f"{dataset_name(config.get('data.dataset'))} {config.get('data.scenario')}/"
          f"{config.get('data.n_tasks')} {config.get('model.name')}")


def paper_setting(config: dict) -> str:
  """The setting as the paper's numbers are keyed (`MethodSpec.paper_results`): dataset,
  scenario/tasks and backbone. The paper's orders are the labels' or a seeded draw (its Split
  ImageNet-S, configs/split_imagenet_s.py); a run on an explicit order gets no paper column
  ('')."""
  named = config.get("data.class_order", "label") in ("label", "seeded")
  return _benchmark(config) if named else ""


def class_order_label(order) -> str:
  """`data.class_order` as a setting's label names it: '' for the labels' order (the default),
  'seeded order', 'reversed order' (an explicit list n-1, ..., 0), a short explicit order in
  full ('order 3,1,0,2'), a long one by its start, length and a digest of the whole list ('order
  5,2,9,... of 100, #1a2b3c'), so that two orders never share a label."""
  if order in (None, "label"):
    return ""
  if order == "seeded":
    return "seeded order"
  try:
    ids = [int(x) for x in (order.split(",") if isinstance(order, str) else order)]
  except (TypeError, ValueError):
    return f"order {order}"
  if ids == list(range(len(ids) - 1, -1, -1)):
    return "reversed order"
  if len(ids) <= 10:
    return "order " + ",".join(map(str, ids))
  digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:6]
  return f"order {','.join(map(str, ids[:3]))},... of {len(ids)}, #{digest}"


SCENARIO_NAMES = {"disjoint": "disjoint", "si_blurry": "Si-Blurry", "domain": "domain"}


def setting_title(config: dict) -> str:
  """A setting as figures and a run's closing table name it, e.g. 'mnist_5k: 5 disjoint tasks,
  custom ViT' (and ', reversed order' for another class order, `class_order_label`; `config`: a
  run's flattened config)."""
  scenario, model = config.get("data.scenario"), str(config.get("model.name"))
  backbone = model if model.startswith(("vit", "swin", "resnet")) else f"{model} ViT"
  order = class_order_label(config.get("data.class_order", "label"))
  return (f"{dataset_name(config.get('data.dataset'))}: {config.get('data.n_tasks')}"
          f" {SCENARIO_NAMES.get(scenario, scenario)} tasks, {backbone}"
          + (f", {order}" if order else ""))


FINISHED = "finished"  # a cell row's `status` when its run has a readable results.json
# Row keys of a cell that are not results.json's (`cell_row`); its metrics follow them.
CELL_KEYS = ("setting", "setting_title", "method", "method_key", "seed", "workdir", "status",
             "tuning", "config")
# Metrics some runs do not record (Task-IL: disjoint streams only, docs/metrics.md): a table
# shows n/a for such a run instead of refusing it.
OPTIONAL_METRICS = frozenset({"A_final_task_il", "A_auc_task_il"})


def cell_row(run: Run) -> dict:
  """One finished run as a row (a dict): "setting" (`setting_label`), "setting_title",
  "method" (`method_label`, with "(tuned: ...)" for a tuned run), "method_key" (the `method`
  config key), "seed", "workdir", "status" (FINISHED), "tuning" (sweep --tune's record, or None)
  and "config" (the flattened config.json); "tuned/KEY" for each hyperparameter sweep --tune
  picked; then every value of results.json but `metric_notes` under its own name, those of its
  records one level down as "RECORD/KEY" (`compute/step_seconds`, `plateau_detection/recall`,
  `fidelity/...`, and the method's check: `check/status`, `check/differing`, ...; `check_of`
  gathers them). A run whose results.json records no check (made before runs recorded it) has
  "check/status" CHECK_NOT_RECORDED. Accuracies stay fractions, as in results.json."""
  config = run.config
  chosen = (run.tuning or {}).get("chosen") or {}
  row = {"setting": setting_label(config), "setting_title": setting_title(config),
         "method": method_label(config) + tuned_suffix(run.tuning),
         "method_key": config.get("method", "online_lora"), "seed": run.seed,
         "workdir": run.run_dir, "status": FINISHED, "tuning": run.tuning, "config": config,
         **{f"tuned/{k}": v for k, v in sorted(chosen.items())}}
  for key, value in run.results.items():
    if key == "metric_notes":
      continue
    if isinstance(value, dict):
      row.update({f"{key}/{k}": v for k, v in value.items()})
    else:
      row[key] = value
  row.setdefault("check/status", CHECK_NOT_RECORDED)
  return row


# A cell row's "check/status" when its results.json records no check (`cell_row`); else one of
# `methods.base.CHECK_STATUSES` ('checked', 'differs', 'unchecked', 'undeclared').
CHECK_NOT_RECORDED = "not recorded"


def check_of(cell: dict) -> dict | None:
  """The check a cell row's run recorded (results.json `check`: kind, against, test, scope,
  variant, settings, differing, status; `methods.base.Check.record`), None where it recorded
  none."""
  if cell.get("check/status", CHECK_NOT_RECORDED) == CHECK_NOT_RECORDED:
    return None
  return {k.split("/", 1)[1]: v for k, v in cell.items() if k.startswith("check/")}


def unfinished_row(run_dir: str) -> dict:
  """A run `find_runs` leaves out, as a row: `cell_row`'s first keys (the setting, method and
  seed from its config.json where that reads, else None), "status" the reason it is left out
  (`unfinished_reason`), no metric."""
  try:
    config = validation.flatten(_read_run_file(os.path.join(run_dir, "config.json")))
  except (OSError, ValueError):
    config = None
  row = dict.fromkeys(CELL_KEYS)
  if config is not None:
    row.update(setting=setting_label(config), setting_title=setting_title(config),
               method=method_label(config), method_key=config.get("method", "online_lora"),
               seed=config.get("seed"), config=config)
  row.update(workdir=run_dir, status=unfinished_reason(run_dir))
  return row


def results_rows(paths: str | os.PathLike | Sequence[str | os.PathLike],
                 unfinished: bool = True, validation: list | None = None) -> list[dict]:
  """The results of a sweep ROOT (or of run workdirs, or directories of runs) as rows, one per
  run (cell), in `find_runs`' order: each finished run's `cell_row` (setting, method, seed, the
  tuned hyperparameters, every metric of its results.json, "status" FINISHED), then, with
  `unfinished`, a row per run left out (`unfinished_row`: "status" says why, no metric).
  sweep --tune's validation runs (METHOD/tune/) are not read, as in the report (their
  directories are appended to `validation` when given). `launch/report.py` builds its tables
  from the same rows (`table_rows`, `layout_table`); `as_dataframe` makes a pandas DataFrame of
  them. FileNotFoundError as `find_runs` (a missing path, no run under it)."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  finished, left_out = find_runs([os.fspath(p) for p in paths], validation)
  rows = [cell_row(Run(d)) for d in finished]
  return rows + ([unfinished_row(d) for d in left_out] if unfinished else [])


def as_dataframe(rows: Sequence[dict]):
  """`results_rows`' rows as a pandas DataFrame (one row per run; a column per key, NaN where
  a row lacks it). pandas is not a dependency of olora-jax: ImportError naming the install
  where it is missing."""
  try:
    import pandas
  except ImportError:
    raise ImportError("as_dataframe needs pandas, which olora-jax does not install: pip install"
                      " pandas (the rows themselves are a list of dicts)") from None
  return pandas.DataFrame(list(rows))


def aggregate(run_dirs: Sequence[str], metrics: Sequence[str] = DEFAULT_METRICS) -> list[dict]:
  """One row per group of runs (`table_rows` of the runs' `cell_row`s): method, setting,
  seeds, and mean/std/n of each metric (%)."""
  if not run_dirs:
    raise ValueError("no run directories given; pass one or more RUN_DIR")
  return table_rows([cell_row(Run(d)) for d in run_dirs], metrics)


def _group_key(cell: dict) -> str:
  """Cells of one group: the same comparable config, and tuned by --tune or not."""
  return json.dumps([comparable_config(cell["config"]), tuned_suffix(cell["tuning"])],
                    sort_keys=True)


def table_rows(cells: Sequence[dict], metrics: Sequence[str] = DEFAULT_METRICS) -> list[dict]:
  """The table's rows from cell rows (`results_rows`, `cell_row`; the unfinished ones are left
  out): one per group of runs whose configs differ only in the seed (and output-only keys),
  with the method, setting, seeds, runs, and each metric's mean/std/n over the group (in %, but
  NOT_PERCENT). A metric of OPTIONAL_METRICS that a run lacks counts as null (n/a); any other
  missing metric is a ValueError naming the run and the metrics it has. Each row's "check" is
  its runs' recorded check (`check_of`; None for runs that recorded none), which the tables
  mark (`check_footnotes`). Refuses runs of one setting and seed made on different streams
  (`check_same_streams`) and one run given twice."""
  cells = [c for c in cells if c["status"] == FINISHED]
  if not cells:
    raise ValueError("no finished run among the rows; a table needs runs with results.json")
  for m in metrics:
    missing = [c["workdir"] for c in cells if m not in c and m not in OPTIONAL_METRICS]
    if missing:
      first = next(c for c in cells if c["workdir"] == missing[0])
      available = sorted(k for k, v in first.items()
                         if k not in CELL_KEYS and "/" not in k and _is_scalar(v))
      raise ValueError(f"metric {m!r} is not in results.json of {missing[0]!r}; available:"
                       f" {available}")
  groups: dict[str, list[dict]] = {}
  for c in cells:
    groups.setdefault(_group_key(c), []).append(c)
  check_same_streams(cells)

  # Config keys that differ between groups sharing a (method, setting) label join the method.
  labels = {k: (g[0]["method"], g[0]["setting"]) for k, g in groups.items()}
  rows = []
  for key, group in groups.items():
    clash = [k for k in groups if k != key and labels[k] == labels[key]]
    variant = ""
    if clash:
      mine = comparable_config(group[0]["config"])
      others = [comparable_config(groups[o][0]["config"]) for o in clash]
      keys = sorted({k for other in others for k in set(mine) | set(other)
                     if mine.get(k) != other.get(k)})
      variant = ", ".join(f"{k}={mine.get(k)}" for k in keys)
    seeds = sorted(c["seed"] for c in group)
    by_seed: dict = {}
    for c in group:
      by_seed.setdefault(c["seed"], []).append(c["workdir"])
    for seed, dirs in by_seed.items():
      if len(dirs) > 1:
        raise ValueError(f"runs {dirs} have the same config and the same seed ({seed}): they"
                         " are one run twice; pass each run directory once")
    first = group[0]
    untuned = labels[key][0][:len(labels[key][0]) - len(tuned_suffix(first["tuning"]))]
    row = {"method": labels[key][0] + (f" [{variant}]" if variant else ""),
           "paper_name": untuned + (f" [{variant}]" if variant else ""),
           "setting": first["setting"], "setting_title": first["setting_title"],
           "paper_setting": paper_setting(first["config"]),
           "scenario": first["config"].get("data.scenario"), "method_key": first["method_key"],
           "backbone": first["config"].get("model.name"),
           "seeds": seeds, "runs": [c["workdir"] for c in group], "tuning": first["tuning"],
           # The group's runs share their config, so their check: the first one recorded.
           "check": next((check_of(c) for c in group if check_of(c) is not None), None)}
    for m in metrics:
      scale = 1 if m in NOT_PERCENT else 100
      row[m] = metric_stat([scale * c[m] for c in group if c.get(m) is not None])
    rows.append(row)
  rows.sort(key=lambda r: (r["setting"], _row_order(r["method"]), r["method"]))
  return rows


def metric_stat(values: Sequence[float]) -> dict:
  """A table cell's statistics of one metric over a group's runs (nulls already left out):
  mean, sample standard deviation (ddof = 1; NaN below two runs) and n."""
  return {"mean": float(np.mean(values)) if len(values) else math.nan,
          "std": float(np.std(values, ddof=1)) if len(values) > 1 else math.nan,
          "n": len(values)}


def format_half_up(value: float | None, decimals: int = 1) -> str:
  """`value` with `decimals` decimals, halves rounded up (87.25 -> 87.3, 87.35 -> 87.4), unlike
  Python's format, which rounds an exact binary half to even; 'n/a' for None or nan."""
  if value is None or not math.isfinite(value):
    return "n/a"
  # repr(round(., 9)) drops float noise (87.24999999999999 is printed as 87.25).
  exact = decimal.Decimal(repr(round(float(value), 9)))
  rounded = exact.quantize(decimal.Decimal(1).scaleb(-decimals), rounding=decimal.ROUND_HALF_UP)
  return str(abs(rounded) if rounded.is_zero() else rounded)  # "0.0", never "-0.0"


def format_fixed(value: float, decimals: int = 2) -> str:
  """`value` with `decimals` decimals as Python formats it, except that a value rounding to zero
  is "0.00", never "-0.00" (a forgetting of -0.001 % is no forgetting, not a gain)."""
  text = f"{value:.{decimals}f}"
  return text[1:] if text.startswith("-") and float(text) == 0 else text


def _row_order(label: str) -> float:
  """Position of a row in the paper's Table 1 (`MethodSpec.table_row`; unknown names last)."""
  rows = {spec.report_name: spec.table_row for spec in methods.specs()}
  rows.update({spec.report_name: spec.table_row for spec in _OUTSIDE.values() if spec})
  for name, row in sorted(rows.items(), key=lambda item: -len(item[0])):  # longest name first
    if label.startswith(name):
      return row
  if label.startswith("single LoRA"):
    return rows["Online-LoRA"]
  if label.startswith("APER"):  # SimpleCIL's adapted variant, beside it
    return rows["SimpleCIL"] + 0.5
  return math.inf


_OUTSIDE: dict = {}  # `method` value of a method outside the package -> its spec (None: unknown)


def _spec(method: str):
  """The spec of a run's `method`; for a method outside the package, loaded from where the
  config names it (relative to the working directory), or None when it cannot be loaded (its
  rows are then labelled with the `method` value itself)."""
  if not methods.is_outside(method):
    return next((s for s in methods.specs() if s.name == method), None)
  if method not in _OUTSIDE:
    try:
      _OUTSIDE[method] = methods.resolve(method)
    except (ValueError, OSError, ImportError):
      _OUTSIDE[method] = None
  return _OUTSIDE[method]


def check_same_streams(cells: Sequence[dict]) -> None:
  """Refuses runs (cell rows, `cell_row`) of one setting and seed whose stream manifests
  differ: a table compares methods only on identical streams (same data, order, batches and
  test set)."""
  first: dict[tuple, dict] = {}
  for c in cells:
    if _manifest(c) is None:  # a run written before manifests existed: nothing to check
      continue
    key = (c["setting"], c["seed"])
    other = first.setdefault(key, c)
    if _manifest(other) != _manifest(c):
      differ = stream_keys_differing(other["config"], c["config"])
      why = (f"their configs differ in {', '.join(differ)}" if differ else
             "their configs agree: the data they read differs")
      raise ValueError(
          f"runs {other['workdir']!r} and {c['workdir']!r} ({key[0]}, seed {key[1]}) were made"
          f" on different streams (manifest {_manifest(other)[:12]} !="
          f" {_manifest(c)[:12]}; {why}); compare methods on the same stream: same data,"
          " data.class_order, seed, data.scenario and learner.batch_size")


def _manifest(cell: dict) -> str | None:
  """The stream a cell is compared on (the shuffled stream's source for the upper bound)."""
  return cell.get("benchmark_manifest_sha256", cell.get("stream_manifest_sha256"))


def stream_keys_differing(a: dict, b: dict) -> list[str]:
  """The keys of two runs' flattened configs that shape their streams (`data.*`, the batch size,
  the seed) and differ, e.g. ['data.class_order']; a class order given as a list and the same
  order as a string ('9,8,...') are equal."""
  def value(config, key):
    v = config.get(key)
    if key == "data.class_order" and isinstance(v, str) and "," in v:
      return [int(x) for x in v.split(",")]
    return list(v) if isinstance(v, tuple) else v

  a, b = comparable_config(a), comparable_config(b)
  keys = {k for k in set(a) | set(b)
          if k.startswith("data.") or k in ("learner.batch_size", "seed")}
  return sorted(k for k in keys if value(a, k) != value(b, k))


def _is_scalar(v) -> bool:
  return v is None or isinstance(v, (int, float))


def stat_text(stat: dict) -> str:
  """A `metric_stat` as the tables print it: "mean ± std", the mean alone for one run, n/a for
  none."""
  if stat["n"] == 0:
    return "n/a"
  if stat["n"] == 1:
    return format_fixed(stat["mean"])
  return f"{format_fixed(stat['mean'])} ± {format_fixed(stat['std'])}"


def _paper_cell(value) -> str:
  return "" if value is None else f"{value[0]:.2f} ± {value[1]:.2f}"


# Which way is better for the metrics a table marks its best cell in (a cost, such as wall time or
# the budget, is not marked).
BETTER = {"A_final": max, "A_auc": max, "A_last": max, "backward_transfer": max,
          "task_balanced_accuracy_final": max, "forgetting": min, "F_last": min,
          "A_final_task_il": max, "A_auc_task_il": max}
UPPER_BOUND = "iid"  # the i.i.d. upper bound's `method`: a reference, never a table's best


@dataclasses.dataclass(frozen=True)
class Column:
  """One column of a table: a metric of a setting, ours or the paper's number beside it."""

  setting: str
  metric: str
  paper: bool = False


@dataclasses.dataclass
class Table:
  """What every format of a report table shows: methods down (the paper's Table 1 order), column
  groups across (one per setting, `groups`: (setting, its number of columns)), each group's
  metrics with the paper's numbers beside them where a setting is the paper's; `cells[method]`
  holds each column's text, `best` the (method, column) cells with a column's best mean;
  `marks[method]` the markers of the row's footnotes on its check, `check_notes` those
  footnotes (`check_footnotes`)."""

  columns: list[Column]
  groups: list[tuple[str, int]]
  methods: list[str]
  cells: dict[str, list[str]]
  best: set[tuple[str, int]]
  stats: dict[tuple[str, int], dict]
  notes: list[str]
  marks: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  check_notes: list[CheckNote] = dataclasses.field(default_factory=list)


UNCHECKED = "unchecked"  # the marker of the one footnote every unchecked method's row shares


@dataclasses.dataclass(frozen=True)
class CheckNote:
  """A table's footnote on rows that are not their method as checked against its authors' code:
  `marker` (a letter, or UNCHECKED for the note every row of an unchecked method shares), the row
  `method` it names, its runs' recorded `check` (results.json `check`), and the `setting` it
  holds in ('' where the row's check is the same in every setting)."""

  marker: str
  method: str
  check: dict
  setting: str = ""


def check_footnotes(rows: Sequence[dict], order: Sequence[str]
                    ) -> tuple[dict[str, list[str]], list[CheckNote]]:
  """(marks, notes) of `table_rows`' rows, `order` their method labels as the table lists them:
  a row whose runs differ from the settings their method's check ran in gets a footnote naming
  each differing setting, its value and the checked one; a row of an unchecked method (check
  kind 'none') the one UNCHECKED footnote; a row whose check declares no settings one saying so.
  A row as checked, or of runs that recorded no check (made before runs recorded it), gets
  none."""
  by_label: dict[str, list[dict]] = {}
  for r in rows:
    by_label.setdefault(r["method"], []).append(r)
  marks: dict[str, list[str]] = {}
  notes: list[CheckNote] = []
  found: dict[str, str] = {}
  for label in order:
    group = sorted(by_label.get(label, []), key=lambda r: r["setting"])
    records = [json.dumps(r.get("check"), sort_keys=True) for r in group]
    mixed = len(set(records)) > 1  # the row's settings differ in their check: each named
    for r, record in zip(group, records, strict=True):
      check = r.get("check")
      if check is None or check.get("status") == "checked":
        continue
      unchecked = check.get("status") == "unchecked"
      key = UNCHECKED if unchecked else json.dumps([label, r["setting"] if mixed else "",
                                                    record])
      if key not in found:
        found[key] = UNCHECKED if unchecked else _letter(sum(
            n.marker != UNCHECKED for n in notes))
        notes.append(CheckNote(found[key], label, check,
                               "" if unchecked or not mixed else r["setting"]))
      if found[key] not in marks.setdefault(label, []):
        marks[label].append(found[key])
  return marks, notes


def _letter(i: int) -> str:
  """The i-th footnote letter: a, b, ..., z, aa, ab, ..."""
  return _letter(i // 26 - 1) + chr(ord("a") + i % 26) if i >= 26 else chr(ord("a") + i)


def _check_phrase(check: dict) -> str:
  """'its check [of VARIANT] against its authors' code (or the code its record names),
  OWNER/REPO (TEST)'."""
  of = f" of {check['variant']}" if check.get("variant") else ""
  return (f"its check{of} against {check.get('code') or AUTHORS_CODE}, {check.get('against')}"
          f" ({check.get('test')})")


def _differing(check: dict, code) -> str:
  return "; ".join(f"{code(key)} {value['run']!r} (checked: {value['checked']!r})"
                   for key, value in (check.get("differing") or {}).items())


def check_summary(check: dict) -> str:
  """One line of a run's recorded check (results.json `check`), as its closing table says it."""
  status = check.get("status")
  if status == "unchecked":
    return "none: its method is not checked against its authors' code (docs/parity.md)"
  if status == "checked":
    return f"in the settings of {_check_phrase(check)}"
  if status == "undeclared":
    return f"{_check_phrase(check)}, declares no settings: whether this run is in them is unknown"
  return f"not the settings of {_check_phrase(check)}: {_differing(check, lambda k: f'`{k}`')}"


def check_note_text(note: CheckNote, code=lambda key: f"`{key}`") -> str:
  """What a check footnote says (`code` sets a config key in type: Markdown's backticks, or
  LaTeX's \\texttt)."""
  c = note.check
  if note.marker == UNCHECKED:
    return "not checked against its authors' code (docs/parity.md lists the methods that are)"
  where = f" ({note.setting})" if note.setting else ""
  if c.get("status") == "undeclared":
    return (f"{note.method}{where}: {_check_phrase(c)}, declares no settings: whether these"
            " runs are in them is not recorded")
  return f"{note.method}{where}: not the settings of {_check_phrase(c)}: {_differing(c, code)}"


def build_table(rows: list[dict], metrics: Sequence[str] = DEFAULT_METRICS,
                paper: dict | None = None) -> Table:
  """The table of `aggregate`'s rows. `paper` (one table of PAPER_RESULTS, its values in the
  order of `metrics`): a setting it holds gets a "(paper)" column after each metric the paper
  reports (the first ones of `metrics`), the paper's number for the row's method. The best mean
  of each column of a metric in `BETTER` (as printed, two decimals; ties all best) is found among
  the rows other than the upper bound; the paper's columns have none."""
  paper = paper or {}
  settings = sorted({r["setting"] for r in rows})
  methods_ = sorted({r["method"] for r in rows}, key=lambda m: (_row_order(m), m))
  by_cell = {(r["method"], r["setting"]): r for r in rows}
  # The paper's number of a tuned row is its method's (the paper tuned its methods too).
  paper_name = {r["method"]: r.get("paper_name", r["method"]) for r in rows}
  paper_of = {r["setting"]: r.get("paper_setting", r["setting"]) for r in rows}
  n_paper = len(next(iter(next(iter(paper.values())).values()))) if paper else 0
  columns, groups = [], []
  for s in settings:
    before = len(columns)
    for i, m in enumerate(metrics):
      columns.append(Column(s, m))
      if paper_of[s] in paper and i < n_paper:
        columns.append(Column(s, m, paper=True))
    groups.append((s, len(columns) - before))
  cells, stats = {}, {}
  for method in methods_:
    out = []
    for j, col in enumerate(columns):
      row = by_cell.get((method, col.setting))
      if col.paper:
        i = list(metrics).index(col.metric)
        out.append(_paper_cell(paper[paper_of[col.setting]].get(paper_name[method],
                                                                (None,) * n_paper)[i]))
      else:
        out.append(stat_text(row[col.metric]) if row else "")
        if row:
          stats[(method, j)] = row[col.metric]
    cells[method] = out
  upper = {r["method"] for r in rows if r.get("method_key") == UPPER_BOUND}
  best = set()
  for j, col in enumerate(columns):
    better = BETTER.get(col.metric)
    candidates = {m: f"{stats[(m, j)]['mean']:.2f}" for m in methods_
                  if (m, j) in stats and stats[(m, j)]["n"] and m not in upper}
    if better is None or len(candidates) < 2:
      continue
    top = better(float(v) for v in candidates.values())
    best |= {(m, j) for m, v in candidates.items() if float(v) == top}
  notes = [f"mean ± std (ddof 1) over {seeds_phrase(rows)}, in %"
           " (wall time in s, budget in image forward passes, a backward counted as XLA costs"
           " it); groups = identical configs up to `seed`; runs of one setting and seed share"
           " one stream manifest."]
  if tuning_note(rows):
    notes.append(tuning_note(rows))
  marks, check_notes = check_footnotes(rows, methods_)
  return Table(columns, groups, methods_, cells, best, stats, notes, marks, check_notes)


def seeds_phrase(rows: list[dict]) -> str:
  """How many seeds back the rows: '1 seed', '3 seeds', '3/5 seeds' (rows over different counts)."""
  counts = sorted({len(r["seeds"]) for r in rows})
  return f"{'/'.join(map(str, counts))} seed{'' if counts == [1] else 's'}"


def _header(col: Column) -> str:
  return "(paper)" if col.paper else METRIC_LABELS.get(col.metric, col.metric)


def markdown_table(rows: list[dict], metrics: Sequence[str] = DEFAULT_METRICS,
                   paper: dict | None = None) -> str:
  """`build_table` as Markdown: a header row naming each setting once over its columns (the
  cells it spans are left empty, `||` as MultiMarkdown writes a spanning cell; GitHub's Markdown
  shows them empty), then a row of the metrics, then one row per method, then the notes, then
  the footnotes on the rows' checks (`check_footnotes`), as GitHub's Markdown writes footnotes:
  `CODA-Prompt [^a]` in the row, `[^a]: ...` below."""
  table = build_table(rows, metrics, paper)
  header = "| method |" + "".join(f" {markdown_escape(s)} " + "|" * n for s, n in table.groups)
  lines = [header, "|" + "---|" * (1 + len(table.columns)),
           "| | " + " | ".join(markdown_escape(_header(c)) for c in table.columns) + " |"]
  lines += ["| " + " | ".join([markdown_escape(m) + "".join(
      f" [^{x}]" for x in table.marks.get(m, [])), *table.cells[m]]) + " |"
            for m in table.methods]
  footnotes = [f"[^{n.marker}]: " + markdown_escape(check_note_text(n))
               for n in table.check_notes]
  return "\n".join(lines + [""] + table.notes + ([""] + footnotes if footnotes else []))


def markdown_escape(text: str) -> str:
  """`text` as a Markdown table cell shows it: a `|` (which would end the cell) as `\\|`."""
  return str(text).replace("|", "\\|")


# LaTeX for what the tables print in Unicode or as a metric's name.
_LATEX_TEXT = {"±": r"$\pm$", "↑": r"$\uparrow$", "↓": r"$\downarrow$", "…": r"\ldots{}",
               "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
               "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
               "^": r"\textasciicircum{}", "<": r"\textless{}", ">": r"\textgreater{}"}
LATEX_METRIC_LABELS = {
    "A_final": r"$A_\mathrm{final}$ $\uparrow$", "A_auc": r"$A_\mathrm{AUC}$ $\uparrow$",
    "A_last": r"$A_\mathrm{last}$ $\uparrow$", "forgetting": r"Forgetting $\downarrow$",
    "F_last": r"$F_\mathrm{last}$ $\downarrow$", "backward_transfer": r"BWT $\uparrow$",
    "A_final_task_il": r"Task-IL $A_\mathrm{final}$ $\uparrow$",
    "A_auc_task_il": r"Task-IL $A_\mathrm{AUC}$ $\uparrow$",
}


def latex_escape(text: str) -> str:
  """`text` as LaTeX prints it verbatim (its special characters escaped, ± ↑ ↓ in math)."""
  return "".join(_LATEX_TEXT.get(ch, ch) for ch in str(text))


def _latex_cell(text: str, bold: bool) -> str:
  if text in ("", "n/a"):
    return "--" if text else ""
  number = "$" + text.replace("±", r"\pm") + "$"
  return r"{\boldmath" + number + "}" if bold else number


def latex_table(rows: list[dict], metrics: Sequence[str] = DEFAULT_METRICS,
                paper: dict | None = None, title: str = "", label: str = "tab:results",
                setting_names: Sequence[str] = ()) -> str:
  """`build_table` as a LaTeX table, nothing else (needs `\\usepackage{booktabs}`; `latex_notes`
  says so and holds the notes): \\toprule, a header row naming each setting once over its columns
  (\\multicolumn, a \\cmidrule under it), the metrics' row, \\midrule, one row per method,
  \\bottomrule; mean $\\pm$ std, the best mean of each metric column in bold (`BETTER`; never the
  upper bound's), a missing value as '--'. A setting is headed by its reader's title
  (`setting_title`: dataset, tasks and protocol, backbone, class order), or by `setting_names`
  (one per setting, in the table's order). The caption is `title` and what the numbers are,
  followed by `\\label{label}`; under the tabular, in small type, the footnotes on the rows'
  checks (`check_footnotes`: a row not as its method was checked, marked with a letter, names
  the settings that differ; an unchecked method's row is marked *)."""
  table = build_table(rows, metrics, paper)
  titles = setting_headers(rows, table, setting_names)
  spec = "@{}l" + "".join("c" * n for _, n in table.groups) + "@{}"
  settings, rules, first = [], [], 2
  for (_, n), name in zip(table.groups, titles, strict=True):
    settings.append(rf"\multicolumn{{{n}}}{{c}}{{{latex_escape(name)}}}")
    rules.append(rf"\cmidrule(lr){{{first}-{first + n - 1}}}")
    first += n
  caption = (f"{latex_escape(title)}. " if title else "") + (
      rf"Mean $\pm$ std over {seeds_phrase(rows)}, in \%; the best mean of each column in bold"
      + (" (the upper bound excluded)" if any(r.get("method_key") == UPPER_BOUND for r in rows)
         else "") + ".")
  lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{caption}}}",
           rf"\label{{{label}}}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
           " & ".join(["", *settings]) + r" \\", " ".join(rules),
           " & ".join(["Method", *(_latex_header(c) for c in table.columns)]) + r" \\",
           r"\midrule"]
  for m in table.methods:
    cells = [_latex_cell(text, (m, j) in table.best) for j, text in enumerate(table.cells[m])]
    label = latex_escape(m) + "".join(rf"\textsuperscript{{{_latex_marker(x)}}}"
                                      for x in table.marks.get(m, []))
    lines.append(" & ".join([label, *cells]) + r" \\")
  lines += [r"\bottomrule", r"\end{tabular}"]
  if table.check_notes:  # the footnotes on the rows' checks, under the table, in the float
    lines += [r"\par\smallskip", r"{\footnotesize\raggedright"]
    lines += [rf"\textsuperscript{{{_latex_marker(n.marker)}}}\,"
              + _latex_note(n) + r"\par" for n in table.check_notes]
    lines += ["}"]
  lines += [r"\end{table}"]
  return "\n".join(lines)


def _latex_marker(marker: str) -> str:
  return "*" if marker == UNCHECKED else marker


def _latex_note(note: CheckNote) -> str:
  """`check_note_text` in LaTeX: escaped, each config key in \\texttt."""
  keys = []
  text = check_note_text(note, code=lambda key: keys.append(key) or f"\0KEY{len(keys) - 1}\0")
  out = latex_escape(text)
  for i, key in enumerate(keys):
    out = out.replace(f"\0KEY{i}\0", rf"\texttt{{{latex_escape(key)}}}")
  return out


def latex_notes(rows: list[dict], metrics: Sequence[str] = DEFAULT_METRICS) -> list[str]:
  """What goes with `latex_table` but not into the .tex file (launch/report.py prints it on
  stderr): the preamble it needs, and the table's notes."""
  return [r"the LaTeX table needs \usepackage{booktabs} in the preamble (a table wider than the"
          r" text: table* in two columns, or \resizebox from graphicx)",
          *build_table(rows, metrics).notes]


def setting_headers(rows: list[dict], table: Table, names: Sequence[str] = ()) -> list[str]:
  """The header of each setting of `table`, in its order: `names` when given (as many as there
  are settings), else the setting's reader title (`setting_title`)."""
  settings = [s for s, _ in table.groups]
  if names:
    if len(names) != len(settings):
      raise ValueError(
          f"--setting_names gives {len(names)} name(s) for {len(settings)} setting(s); give one"
          " per setting, comma separated, in this order: " + "; ".join(settings))
    return list(names)
  title = {r["setting"]: r.get("setting_title") or r["setting"] for r in rows}
  return [title[s] for s in settings]


def _latex_header(col: Column) -> str:
  if col.paper:
    return "(paper)"
  return LATEX_METRIC_LABELS.get(col.metric) or latex_escape(METRIC_LABELS.get(col.metric,
                                                                               col.metric))


FORMATS = ("markdown", "latex", "csv")


def render(rows: list[dict], metrics: Sequence[str], fmt: str = "markdown",
           paper: dict | None = None, title: str = "", **latex) -> str:
  """The table of `rows` in `fmt` (FORMATS): Markdown (with `title` above it), LaTeX (`title`
  in its caption; `latex`: `latex_table`'s label and setting_names) or CSV (one line per method
  and setting, `write_csv`; no paper column)."""
  if fmt == "latex":
    return latex_table(rows, metrics, paper, title, **latex)
  if fmt == "csv":
    out = io.StringIO()
    write_csv(rows, out, metrics)
    return out.getvalue().rstrip("\n")
  if fmt != "markdown":
    raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
  return (f"{title}\n\n" if title else "") + markdown_table(rows, metrics, paper)


def write_csv(rows: list[dict], path, metrics: Sequence[str] = DEFAULT_METRICS) -> None:
  """One line per (method, setting): seeds, then mean, std and n of each metric (in %), into
  `path` (a file name, or an open text file)."""
  if isinstance(path, (str, os.PathLike)):
    with open(path, "w", newline="") as f:
      write_csv(rows, f, metrics)
    return
  writer = csv.writer(path)
  writer.writerow(["method", "setting", "n_runs", "seeds"] +
                  [f"{m}_{s}" for m in metrics for s in ("mean", "std", "n")])
  for r in rows:
    stats = [r[m][s] for m in metrics for s in ("mean", "std", "n")]
    writer.writerow([r["method"], r["setting"], len(r["seeds"]),
                     " ".join(map(str, r["seeds"]))] +
                    ["" if isinstance(v, float) and math.isnan(v) else v for v in stats])


def find_runs(paths: Sequence[str], validation: list | None = None
              ) -> tuple[list[str], list[str]]:
  """(finished, unfinished) run directories under `paths`: a path holding config.json is a run
  and must be finished (hold results.json); any other directory is searched below, e.g. the
  ROOT/setting/method/seedN tree of launch/sweep.py, where a run still missing results.json, or
  whose results.json is damaged, is returned as unfinished (`unfinished_reason` says which). A
  `tune` directory below a path (not itself a run) holds sweep --tune's validation runs, scored
  on held-out training data, not the test set: it is not searched, and appended to `validation`
  when given (name it as a path to tabulate its runs). A tracker's store below a path is not
  searched either: an MLflow file store (ROOT/mlruns of a sweep tracked with MLflow), whose
  experiments (directories holding MLflow's `meta.yaml`, TRACKER_RECORD) keep each run's
  config.json and results.json again as artifacts.
  FileNotFoundError for a missing path, an unfinished run given by name, or a tree with no
  run."""
  finished, unfinished = [], []
  for path in paths:
    if not os.path.isdir(path):
      raise FileNotFoundError(f"{path!r} is not a directory; pass run directories or a sweep ROOT")
    if os.path.isfile(os.path.join(path, "config.json")):
      Run(path)  # a run given by name must be finished (a clear error otherwise)
    found = []
    for here, dirs, files in os.walk(path):
      if TRACKER_RECORD in files:  # an MLflow store's experiment: copies of runs, not runs
        dirs.clear()
        continue
      if "config.json" in files:
        found.append(here)
        done = "results.json" in files and unfinished_reason(here) == "finished"
        (finished if done else unfinished).append(here)
        dirs.clear()  # a run's own subdirectories (checkpoints, plots) hold no runs
      if TUNING_DIR in dirs and not os.path.isfile(os.path.join(here, TUNING_DIR, "config.json")):
        dirs.remove(TUNING_DIR)
        if validation is not None:
          validation.append(os.path.join(here, TUNING_DIR))
      dirs.sort()
    if not found:
      raise FileNotFoundError(f"no run (a directory with config.json) under {path!r}; pass the"
                              " --workdir of launch/run.py or the ROOT of launch/sweep.py")
  return finished, unfinished


def layout_table(runs: Sequence[str] | Sequence[dict], layout: str, fmt: str = "markdown",
                 **latex) -> tuple[list[dict], str]:
  """The paper's table `layout` ('table1' | 'table2' | 'swin', LAYOUTS) from finished runs
  (their directories, or their cell rows, `results_rows`): the rows of `table_rows` for the
  layout's scenarios (and backbones) and metrics, and the table in
  `fmt` (`render`; `latex`: `latex_table`'s setting_names, and its label, `tab:LAYOUT` unless
  given) with the paper's own numbers beside ours where a setting matches (PAPER_RESULTS)."""
  if layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; use one of {tuple(LAYOUTS)}")
  spec = LAYOUTS[layout]
  cells = [r if isinstance(r, dict) else cell_row(Run(r)) for r in runs]
  rows = [r for r in table_rows(cells, spec.metrics) if r["scenario"] in spec.scenarios
          and (not spec.backbones or r["backbone"] in spec.backbones)]
  if not rows:
    raise ValueError(f"no run with data.scenario in {spec.scenarios} among the"
                     f" {sum(c['status'] == FINISHED for c in cells)} given; {layout} shows"
                     f" {spec.title}")
  if fmt == "latex":
    latex = {"label": f"tab:{layout}", **latex}
  return rows, render(rows, spec.metrics, fmt, _paper_results()[layout], spec.title, **latex)


def __getattr__(attribute: str):
  # Read from the method modules on first use (they import JAX; a report that never needs them
  # does not pay for it).
  if attribute == "METHOD_NAMES":
    return _method_names()
  if attribute == "PAPER_RESULTS":
    return _paper_results()
  raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
