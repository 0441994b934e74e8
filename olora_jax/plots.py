"""Figures of runs, drawn from their metrics.jsonl and results.json.

Every figure is written twice: a PNG (`DPI`) and a PDF (vector, for papers) of the same name.
Each title names the run (its directory, method and setting). One run, into `DIR/plots/`:

- `loss_surface.png`: the loss-window value of every logged step against samples seen (the
  signal the plateau rule reads, paper section 3.1 and its loss-surface figure), the window mean,
  the detected plateaus (where a LoRA was merged and a new one started) and the true task
  boundaries, which the learner never saw.
- `anytime_accuracy.png`: the anytime accuracy on the classes seen so far against samples seen
  (the curve whose mean is A_AUC), with the true task boundaries.
- `accuracy_matrix.png`: a_{i,j} as a heat map, row = task i (domain i for a domain stream
  evaluated by domain), column = after training task j; cells in % with one decimal, halves
  rounded up.

Several runs (`launch/report.py --plots DIR`): `anytime_overlay.png` overlays the anytime
accuracy curves of every run, one panel per setting and one colour per method in it: each run
thin, the mean over the method's seeds bold, a band of +-1 standard deviation (ddof 1) around it,
and the setting's true task boundaries.

Figures are drawn with matplotlib's object API on an Agg canvas: no pyplot, no global backend
change, no display needed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from matplotlib.figure import Figure

from olora_jax import reporting, validation

PLOT_FILES = ("loss_surface.png", "anytime_accuracy.png", "accuracy_matrix.png")
OVERLAY_FILE = "anytime_overlay.png"
DPI = 150  # PNG resolution; the PDF beside each PNG is vector


def read_events(path: str) -> dict[str, list[dict]]:
  """metrics.jsonl -> {event name: [records in file order]}."""
  events: dict[str, list[dict]] = {}
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n} is not valid JSON ({e}); the run log is corrupt") from e
      events.setdefault(record["event"], []).append(record)
  return events


def _import_matplotlib() -> None:
  try:
    from matplotlib.backends import backend_agg, backend_pdf  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401
  except ImportError:
    pass  # raised again, and reported, where the figures are drawn


def import_in_background() -> None:
  """Starts importing matplotlib (about half a second) in a daemon thread, so that a run which
  will draw its figures at the end imports it while the device computes. Drawing needs no join:
  an import the thread has begun is finished by Python's import lock first, and one that failed
  in the thread fails again, with its error, where the figures are drawn."""
  threading.Thread(target=_import_matplotlib, name="import matplotlib", daemon=True).start()


def _save(fig: Figure, path: str) -> str:
  """Writes `path` (PNG) and the same figure as a vector PDF beside it; returns `path`."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.backends.backend_pdf import FigureCanvasPdf

  with warnings.catch_warnings(record=True) as caught:
    # A character the font lacks (a run directory named in CJK) is drawn as a box, and matplotlib
    # warns once per character and figure: the run says it once instead.
    warnings.filterwarnings("always", GLYPH_WARNING, UserWarning)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    # The PDF keeps the PNG's layout (positions are fractions of the figure): one layout pass.
    fig.set_layout_engine("none")
    FigureCanvasPdf(fig)
    fig.savefig(os.path.splitext(path)[0] + ".pdf")
  _warn_missing_glyphs(caught)
  return path


GLYPH_WARNING = r"Glyph \d+ .* missing from"
_MISSING_GLYPHS: set[str] = set()  # characters already reported by this process


def _warn_missing_glyphs(caught) -> None:
  """Re-issues any other warning; says once which characters the figures draw as boxes."""
  missing, fonts = set(), set()
  for w in caught:
    found = re.match(r"Glyph (\d+) .* missing from (?:current )?font(?:\(s\))? (.*?)\.?$",
                     str(w.message))
    if found is None:
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    else:
      missing.add(chr(int(found.group(1))))
      fonts.add(found.group(2))
  new = missing - _MISSING_GLYPHS
  if new:
    _MISSING_GLYPHS.update(new)
    logging.warning("the figures' font (%s) has no glyph for %s in their titles (the run"
                    " directory's name): drawn as boxes", ", ".join(sorted(fonts)),
                    "".join(sorted(new)))


def _figure(**kwargs) -> Figure:
  """A matplotlib Figure; matplotlib (a second of imports) loads only when a run draws."""
  from matplotlib.figure import Figure

  return Figure(**kwargs)


def _titled(title: str, run_name: str) -> str:
  return f"{run_name}\n{title}" if run_name else title


def run_name(workdir: str, config: dict) -> str:
  """'<run directory>: <method> on <setting>', the name every figure of a run carries (e.g.
'demo: Online-LoRA on mnist_5k: 5 disjoint tasks, custom ViT')."""
  flat = validation.flatten(config)
  name = os.path.basename(os.path.normpath(workdir))
  return f"{name}: {reporting.method_label(flat)} on {reporting.setting_title(flat)}"


def _mark_boundaries(ax, boundary_samples, label: bool = True) -> None:
  for n, b in enumerate(boundary_samples):
    ax.axvline(b, color="0.35", linestyle="--", linewidth=1.0,
               label="true task boundary" if label and n == 0 else None)


def plot_loss_surface(samples: np.ndarray, window_value: np.ndarray,
                      window_mean: np.ndarray | None, plateau_samples, boundary_samples,
                      path: str, mean_threshold: float | None = None,
                      run_name: str = "", value_label: str = "loss-window value") -> str:
  """The loss surface with detected plateaus (red) and true task boundaries (grey, dashed)."""
  fig = _figure(figsize=(10.5, 4), layout="constrained")
  ax = fig.add_subplot()
  ax.plot(samples, window_value, color="tab:blue", linewidth=0.8, label=value_label)
  if window_mean is not None and np.isfinite(window_mean).any():
    ax.plot(samples, window_mean, color="tab:orange", linewidth=1.2, label="window mean")
  if mean_threshold is not None:
    ax.axhline(mean_threshold, color="tab:green", linestyle=":", linewidth=1.0,
               label="mean threshold")
  for n, p in enumerate(plateau_samples):
    ax.axvline(p, color="tab:red", linewidth=1.2, alpha=0.8,
               label="detected plateau (merge)" if n == 0 else None)
  _mark_boundaries(ax, boundary_samples)
  ax.set_xlabel("samples seen")
  ax.set_ylabel("loss (pre-update, no regulariser)")
  n, t = len(plateau_samples), len(boundary_samples)
  ax.set_title(_titled(f"Loss surface: {n} plateau{'' if n == 1 else 's'}, {t} true task"
                       f" boundar{'y' if t == 1 else 'ies'}", run_name))
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: no overlap
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_anytime_accuracy(samples: np.ndarray, accuracy: np.ndarray, boundary_samples,
                          path: str, run_name: str = "") -> str:
  """Anytime accuracy (%) on the seen classes against samples seen."""
  fig = _figure(figsize=(7, 4), layout="constrained")
  ax = fig.add_subplot()
  accuracy = 100 * np.asarray(accuracy, np.float64)
  ax.plot(samples, accuracy, marker="o", markersize=3, color="tab:blue",
          label="accuracy on seen classes")
  _mark_boundaries(ax, boundary_samples)
  auc = np.nanmean(accuracy) if np.isfinite(accuracy).any() else float("nan")
  ax.set_title(_titled(f"Anytime accuracy (A_AUC = {reporting.format_half_up(auc, 2)}%)",
                       run_name))
  ax.set_xlabel("samples seen")
  ax.set_ylabel("accuracy (%)")
  ax.set_ylim(0, 100)
  ax.legend(loc="lower left", fontsize=8)
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_accuracy_matrix(acc: np.ndarray, path: str, run_name: str = "",
                         row_label: str = "task") -> str:
  """Heat map of a_{i,j} (%) with the value written in each cell (one decimal, halves up);
  `row_label` names what a row is ('task', or 'domain' for a domain stream)."""
  acc = 100 * np.asarray(acc, np.float64)
  t = acc.shape[0]
  side = min(2.0 + 0.7 * t, 14.0)
  fig = _figure(figsize=(side + 1.2, side), layout="constrained")
  ax = fig.add_subplot()
  image = ax.imshow(acc, vmin=0, vmax=100, cmap="viridis")
  fig.colorbar(image, ax=ax, label="accuracy (%)")
  if t <= 20:  # numbers stay legible up to 20 tasks
    for i in range(t):
      for j in range(t):
        ax.text(j, i, reporting.format_half_up(acc[i, j], 1), ha="center", va="center",
                fontsize=7 if t > 10 else 8, color="white" if acc[i, j] < 60 else "black")
  ax.set_xticks(range(t))
  ax.set_yticks(range(t))
  ax.set_xlabel("after training task j")
  ax.set_ylabel(f"evaluated on {row_label} i")
  ax.set_title(_titled("Accuracy matrix a_{i,j}", run_name), fontsize=9 if run_name else None)
  return _save(fig, path)


def write_run_plots(workdir: str) -> list[str]:
  """Draws the three figures of the run in `workdir` into `workdir/plots/`; returns the paths."""
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  events = read_events(os.path.join(workdir, "metrics.jsonl"))
  out = os.path.join(workdir, "plots")
  os.makedirs(out, exist_ok=True)

  detection = results["plateau_detection"]
  boundaries = detection["boundary_samples"]
  train = events.get("train", [])
  samples = np.array([e["samples_seen"] for e in train])
  # Online-LoRA logs its loss-window value; the baselines (olora_jax/methods) their loss.
  online_lora = config.get("method", "online_lora") == "online_lora"
  key = "window_value" if online_lora else "loss"
  value = np.array([np.nan if e.get(key) is None else e[key] for e in train], np.float64)
  mean = np.array([np.nan if e.get("window_mean") is None else e["window_mean"]
                   for e in train], np.float64)
  threshold = config.get("learner", {}).get("mean_threshold") if online_lora else None
  name = run_name(workdir, config)
  paths = [plot_loss_surface(samples, value, mean, detection["plateau_samples"], boundaries,
                             os.path.join(out, PLOT_FILES[0]), threshold, name,
                             "loss-window value" if online_lora else "training loss")]
  evals = events.get("eval", [])
  paths.append(plot_anytime_accuracy(np.array([e["samples_seen"] for e in evals]),
                                     np.array([np.nan if e["anytime_accuracy"] is None
                                               else e["anytime_accuracy"] for e in evals]),
                                     boundaries, os.path.join(out, PLOT_FILES[1]), name))
  paths.append(plot_accuracy_matrix(np.asarray(results["acc_matrix"]),
                                    os.path.join(out, PLOT_FILES[2]), name,
                                    "domain" if "task_domains" in results else "task"))
  return paths


def mean_std_curve(curves: Sequence[tuple[np.ndarray, np.ndarray]]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean and std (ddof 1; 0 for one run) of several (samples, accuracy) curves on one grid.

  The grid is the union of their sample points within the range every curve covers; each curve
  is linearly interpolated onto it (seeds evaluate at nearly the same points). Pure."""
  curves = [(np.asarray(x, np.float64), np.asarray(y, np.float64)) for x, y in curves if len(x)]
  if not curves:
    return np.zeros(0), np.zeros(0), np.zeros(0)
  lo = max(x[0] for x, _ in curves)
  hi = min(x[-1] for x, _ in curves)
  grid = np.unique(np.concatenate([x for x, _ in curves]))
  grid = grid[(grid >= lo) & (grid <= hi)]
  ys = np.stack([np.interp(grid, x, y) for x, y in curves])  # (runs, points)
  std = ys.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(len(grid))
  return grid, ys.mean(axis=0), std


def _run_curve(run_dir: str) -> tuple[tuple[np.ndarray, np.ndarray], tuple[int, ...] | None]:
  """A finished run's anytime curve (samples, accuracy in [0, 1]) and its true task boundaries
  in samples (None when results.json does not record them)."""
  with open(os.path.join(run_dir, "results.json")) as f:
    results = json.load(f)
  acc = [np.nan if a is None else a for a in results["anytime_accuracy"]]
  boundaries = (results.get("plateau_detection") or {}).get("boundary_samples")
  return ((np.asarray(results["anytime_samples"]), np.asarray(acc, np.float64)),
          None if boundaries is None else tuple(boundaries))


def overlay_figure(rows: Sequence[dict]) -> Figure:
  """The overlay of `reporting.aggregate`'s groups (read from their runs' results.json): one
  panel per setting, titled with it (`setting_title`); in each, one colour per method (the
  legend names it and its number of seeds): every run thin, the mean over seeds bold with a
  +-1 std band (ddof 1), and the setting's true task boundaries as dashed vertical lines (gid
  'task_boundary'). When the runs of a setting have different boundaries (Si-Blurry's task sizes
  are drawn per seed), every run's boundaries are drawn, lighter."""
  panels: dict[str, list[dict]] = {}
  for row in rows:
    panels.setdefault(row["setting"], []).append(row)
  fig = _figure(figsize=(7 * len(panels), 5.2), layout="constrained")
  axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
  n_runs = sum(len(row["runs"]) for row in rows)
  for ax, (_, panel) in zip(axes, sorted(panels.items()), strict=True):
    boundary_sets = set()
    for i, row in enumerate(panel):
      colour = f"C{i % 10}"
      curves = []
      for run_dir in row["runs"]:
        curve, boundaries = _run_curve(run_dir)
        curves.append(curve)
        if boundaries is not None:
          boundary_sets.add(boundaries)
      for x, y in curves:
        ax.plot(x, 100 * y, color=colour, linewidth=0.6, alpha=0.35)
      grid, mean, std = mean_std_curve(curves)
      n = len(curves)
      ax.plot(grid, 100 * mean, color=colour, linewidth=2.0,
              label=f"{row['method']} ({n} seed{'s' if n > 1 else ''})")
      ax.fill_between(grid, 100 * (mean - std), 100 * (mean + std), color=colour, alpha=0.2,
                      linewidth=0)
    label = ("true task boundary" if len(boundary_sets) == 1
             else "true task boundaries (differ by run)")
    for n, b in enumerate(sorted(set().union(*boundary_sets))):
      ax.axvline(b, color="0.35", linestyle="--", linewidth=1.0 if len(boundary_sets) == 1
                 else 0.6, alpha=1.0 if len(boundary_sets) == 1 else 0.5, gid="task_boundary",
                 label=label if n == 0 else None)
    ax.set_title(reporting.setting_title(reporting.Run(panel[0]["runs"][0]).config),
                 fontsize=10)
    ax.set_xlabel("samples seen")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, frameon=False)
  axes[0].set_ylabel("anytime accuracy on seen data (%)")
  axes[0].set_ylim(0, 100)
  fig.suptitle(f"Anytime accuracy of {n_runs} runs (bold: mean over seeds, band: ±1 std,"
               " thin: each run)", fontsize=10)
  return fig


def write_overlay_plot(rows: Sequence[dict], out_dir: str) -> str:
  """`overlay_figure(rows)` into `out_dir/anytime_overlay.{png,pdf}`; returns the PNG's path."""
  os.makedirs(out_dir, exist_ok=True)
  return _save(overlay_figure(rows), os.path.join(out_dir, OVERLAY_FILE))
