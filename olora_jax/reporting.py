"""Aggregation of finished runs into paper-style tables: mean ± std over seeds.

Each run directory holds config.json and results.json (written by `olora_jax.trainer`). Runs are
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
Runs of one setting and one seed must share their stream manifest (results.json
`stream_manifest_sha256`; for the i.i.d. upper bound, `benchmark_manifest_sha256`, the stream it
shuffles): `aggregate` refuses to put runs made on different streams side by side.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence

import numpy as np

from olora_jax import validation

# Keys that never change a run's numbers; runs differing only in these are one group.
IGNORED_KEYS = frozenset({"seed", "log_every", "eval.write_plots"})
DEFAULT_METRICS = ("A_final", "forgetting", "A_auc")
NOT_PERCENT = frozenset({"wall_seconds"})  # shown as they are, not x 100
# The `method` config key -> the paper's name, in the row order of its Table 1.
METHOD_NAMES = {
    "agem": "AGEM", "er": "ER", "ewc_pp": "EWC++", "mir": "MIR", "gdumb": "GDumb",
    "pcr": "PCR", "der_pp": "DER++", "lode": "LODE (DER++)", "ema_der_pp": "EMA (DER++)",
    "ema_rar": "EMA (RAR)", "finetune": "Fine-tuning", "online_lora": "Online-LoRA",
    "iid": "Upper bound (i.i.d.)",
}
# How the paper prints each metric's header; an arrow says which direction is better.
METRIC_LABELS = {
    "A_final": "A_final ↑", "forgetting": "Forgetting ↓", "A_auc": "A_auc ↑",
    "A_last": "A_last ↑", "F_last": "F_last ↓", "backward_transfer": "BWT ↑",
    "task_balanced_accuracy_final": "task-balanced acc ↑", "wall_seconds": "wall time (s)",
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
    with open(paths[0]) as f:
      self.config = validation.flatten(json.load(f))
    with open(paths[1]) as f:
      self.results = json.load(f)
    self.run_dir = run_dir

  @property
  def seed(self):
    return self.config.get("seed")

  @property
  def manifest_sha256(self) -> str | None:
    """The stream the run is compared on (the shuffled stream's source for the upper bound)."""
    return self.results.get("benchmark_manifest_sha256",
                            self.results.get("stream_manifest_sha256"))

  def group_key(self) -> str:
    return json.dumps(comparable_config(self.config), sort_keys=True)


def comparable_config(config: dict) -> dict:
  """The config keys that can change a run's numbers: all but the seed and output switches; a
  checkpoint is compared by file name, since checkouts keep it at different absolute paths."""
  method = config.get("method", "online_lora")
  # Blocks of the baselines that did not run are never read.
  unused = tuple(f"{m}." for m in METHOD_NAMES if m not in (method, "online_lora"))
  out = {k: v for k, v in config.items() if k not in IGNORED_KEYS and not k.startswith(unused)}
  if out.get("pretrained.path"):
    out["pretrained.path"] = os.path.basename(out["pretrained.path"])
  return out


def method_label(config: dict) -> str:
  """The method a config runs: a baseline by the paper's name (with what it trains unless it is
  the whole network), Online-LoRA by its components (the paper's ablation table)."""
  method = config.get("method", "online_lora")
  if method != "online_lora":
    name = METHOD_NAMES.get(method, str(method))
    trainable = config.get(f"{method}.trainable", "all")
    return name if trainable == "all" else f"{name} ({trainable})"
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


def setting_label(config: dict) -> str:
  """The benchmark a config runs: dataset, scenario, number of tasks and backbone."""
  return (f"{config.get('data.dataset')} {config.get('data.scenario')}/"
          f"{config.get('data.n_tasks')} {config.get('model.name')}")


def aggregate(run_dirs: Sequence[str], metrics: Sequence[str] = DEFAULT_METRICS) -> list[dict]:
  """One row per group of runs: method, setting, seeds, and mean/std/n of each metric (%)."""
  if not run_dirs:
    raise ValueError("no run directories given; pass one or more RUN_DIR")
  runs = [Run(d) for d in run_dirs]
  for m in metrics:
    missing = [r.run_dir for r in runs if m not in r.results]
    if missing:
      raise ValueError(f"metric {m!r} is not in results.json of {missing[0]!r}; available:"
                       f" {sorted(k for k, v in runs[0].results.items() if _is_scalar(v))}")
  groups: dict[str, list[Run]] = {}
  for r in runs:
    groups.setdefault(r.group_key(), []).append(r)
  check_same_streams(runs)

  # Config keys that differ between groups sharing a (method, setting) label join the method.
  labels = {k: (method_label(g[0].config), setting_label(g[0].config)) for k, g in groups.items()}
  rows = []
  for key, group in groups.items():
    clash = [k for k in groups if k != key and labels[k] == labels[key]]
    variant = ""
    if clash:
      mine = comparable_config(group[0].config)
      others = [comparable_config(groups[o][0].config) for o in clash]
      keys = sorted({k for other in others for k in set(mine) | set(other)
                     if mine.get(k) != other.get(k)})
      variant = ", ".join(f"{k}={mine.get(k)}" for k in keys)
    seeds = sorted(r.seed for r in group)
    if len(set(seeds)) != len(seeds):
      dup = [r.run_dir for r in group]
      raise ValueError(f"runs {dup} have the same config and seed; aggregate each run once")
    row = {"method": labels[key][0] + (f" [{variant}]" if variant else ""),
           "setting": labels[key][1], "seeds": seeds, "runs": [r.run_dir for r in group]}
    for m in metrics:
      scale = 1 if m in NOT_PERCENT else 100
      values = [scale * r.results[m] for r in group if r.results[m] is not None]
      row[m] = {"mean": float(np.mean(values)) if values else math.nan,
                "std": float(np.std(values, ddof=1)) if len(values) > 1 else math.nan,
                "n": len(values)}
    rows.append(row)
  rows.sort(key=lambda r: (r["setting"], _row_order(r["method"]), r["method"]))
  return rows


def _row_order(label: str) -> int:
  """Position of a row in the paper's Table 1 (unknown names last)."""
  names = list(METHOD_NAMES.values())
  for i, name in enumerate(names):
    if label.startswith(name):
      return i
  if label.startswith("single LoRA"):
    return names.index("Online-LoRA")
  return len(names)


def check_same_streams(runs: Sequence[Run]) -> None:
  """Refuses runs of one setting and seed whose stream manifests differ: a table compares
  methods only on identical streams (same data, order, batches and test set)."""
  first: dict[tuple, Run] = {}
  for r in runs:
    if r.manifest_sha256 is None:  # a run written before manifests existed: nothing to check
      continue
    key = (setting_label(r.config), r.seed)
    other = first.setdefault(key, r)
    if other.manifest_sha256 != r.manifest_sha256:
      raise ValueError(
          f"runs {other.run_dir!r} and {r.run_dir!r} ({key[0]}, seed {key[1]}) were made on"
          f" different streams (manifest {other.manifest_sha256[:12]} !="
          f" {r.manifest_sha256[:12]}); compare methods on the same stream: same data, seed,"
          " scenario and learner.batch_size")


def _is_scalar(v) -> bool:
  return v is None or isinstance(v, (int, float))


def _cell(stat: dict) -> str:
  if stat["n"] == 0:
    return "n/a"
  if stat["n"] == 1:
    return f"{stat['mean']:.2f}"
  return f"{stat['mean']:.2f} ± {stat['std']:.2f}"


def markdown_table(rows: list[dict], metrics: Sequence[str] = DEFAULT_METRICS) -> str:
  """Methods down (in the paper's Table 1 order), settings across (each with its metrics)."""
  settings = sorted({r["setting"] for r in rows})
  methods = sorted({r["method"] for r in rows}, key=lambda m: (_row_order(m), m))
  cells = {(r["method"], r["setting"]): r for r in rows}
  header = ["method"] + [f"{s}: {METRIC_LABELS.get(m, m)}" for s in settings for m in metrics]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for method in methods:
    out = [method]
    for s in settings:
      row = cells.get((method, s))
      out += [_cell(row[m]) if row else "" for m in metrics]
    lines.append("| " + " | ".join(out) + " |")
  n_seeds = sorted({len(r["seeds"]) for r in rows})
  lines += ["", f"mean ± std (ddof 1) over {'/'.join(map(str, n_seeds))} seed(s), in %"
            " (wall time in s); groups = identical configs up to `seed`; runs of one setting and"
            " seed share one stream manifest."]
  return "\n".join(lines)


def write_csv(rows: list[dict], path: str, metrics: Sequence[str] = DEFAULT_METRICS) -> None:
  """One line per (method, setting): seeds, then mean, std and n of each metric (in %)."""
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["method", "setting", "n_runs", "seeds"] +
                    [f"{m}_{s}" for m in metrics for s in ("mean", "std", "n")])
    for r in rows:
      stats = [r[m][s] for m in metrics for s in ("mean", "std", "n")]
      writer.writerow([r["method"], r["setting"], len(r["seeds"]),
                       " ".join(map(str, r["seeds"]))] +
                      ["" if isinstance(v, float) and math.isnan(v) else v for v in stats])
