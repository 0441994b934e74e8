"""Figures of runs, drawn from their metrics.jsonl and results.json.

Every figure is written twice: a PNG (`DPI`) and a PDF (vector, fonts embedded as TrueType, for
papers) of the same name.
Each title names the run by its method's display name, setting and seed (`run_name`); with
`titles=False` (`launch/report.py --no_titles`) a figure has no title, for a paper's caption to
say it. One run, into `DIR/plots/` (`plot_files`):

- `loss_surface.png`, only for a run with a plateau rule (`reporting.detects_plateaus`:
  Online-LoRA, or `boundaries.rule=plateau`): the loss-window value of every logged step against
  samples seen (the signal the plateau rule reads, paper section 3.1 and its loss-surface
  figure), the window mean, the detected plateaus (where a LoRA was merged and a new one started)
  and the true task boundaries, which the learner never saw.
- `anytime_accuracy.png`: the anytime accuracy on the classes seen so far against samples seen
  (the curve whose mean is A_AUC), with the true task boundaries.
- `accuracy_matrix.png`: a_{i,j} as a heat map, row = task i (domain i for a domain stream
  evaluated by domain), column = after training task j; cells in % with one decimal, halves
  rounded up.

Several runs (`launch/report.py --plots DIR`, `write_report_plots`), the figures a paper shows:

- `anytime_overlay.png` overlays the anytime accuracy curves of every run, one panel per setting
  and one colour per method in it: each run thin, the mean over the method's seeds bold, a band
  of +-1 standard deviation (ddof 1) around it, and the setting's true task boundaries.
- `accuracy_matrices_<setting>.png`, one per setting: the final accuracy matrix a_{i,j} of each
  method (one panel each, its mean over seeds, cells in % with one decimal), one colour scale.
- `forgetting_per_task.png`: the forgetting of each earlier task (max_{t<T} a_{k,t} - a_{k,T},
  whose mean is the Forgetting column) per method, mean over seeds with a +-1 std bar, one panel
  per setting.

Figures are drawn with matplotlib's object API on an Agg canvas: no pyplot, no global backend
change, no display needed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from matplotlib.figure import Figure

from olora_jax import background, metrics, reporting, validation

PLOT_FILES = ("loss_surface.png", "anytime_accuracy.png", "accuracy_matrix.png")
OVERLAY_FILE = "anytime_overlay.png"
FORGETTING_FILE = "forgetting_per_task.png"
MATRICES_FILE = "accuracy_matrices_{setting}.png"  # one per setting (`setting_slug`)
DPI = 150  # PNG resolution; the PDF beside each PNG is vector
PDF_FONTS = {"pdf.fonttype": 42}  # TrueType in the PDFs, which submission systems accept


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


def import_in_background() -> None:
  """Starts importing matplotlib (about half a second) in a daemon thread, so that a run which
  will draw its figures at the end imports it while the device computes
  (`background.import_modules`)."""
  background.import_modules("matplotlib.backends.backend_agg", "matplotlib.backends.backend_pdf",
                            "matplotlib.figure")


def _save(fig: Figure, path: str) -> str:
  """Writes `path` (PNG) and the same figure as a vector PDF beside it, its fonts embedded as
  TrueType (`PDF_FONTS`); returns `path`."""
  import matplotlib
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
    # TrueType (Type 42) fonts, not matplotlib's default Type 3, which several venues' PDF
    # checkers refuse.
    with matplotlib.rc_context(PDF_FONTS), _quiet_font_subsetting():
      fig.savefig(os.path.splitext(path)[0] + ".pdf")
  _warn_missing_glyphs(caught)
  return path


# The logger of fontTools, which subsets the TrueType fonts a PDF embeds and reports each table
# it prunes at INFO: hundreds of lines per report where the root logger is at INFO (absl's).
FONT_SUBSET_LOGGER = "fontTools"


class _quiet_font_subsetting:
  """Within: fontTools logs WARNING and above only (its level restored on leaving)."""

  def __enter__(self):
    self._logger = logging.getLogger(FONT_SUBSET_LOGGER)
    self._level = self._logger.level
    if self._logger.getEffectiveLevel() < logging.WARNING:
      self._logger.setLevel(logging.WARNING)

  def __exit__(self, *exc):
    self._logger.setLevel(self._level)


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
    logging.warning("the figures' font (%s) has no glyph for %s in their text (a method's or"
                    " a dataset's name): drawn as boxes", ", ".join(sorted(fonts)),
                    "".join(sorted(new)))


def _figure(**kwargs) -> Figure:
  """A matplotlib Figure; matplotlib (a second of imports) loads only when a run draws."""
  from matplotlib.figure import Figure

  return Figure(**kwargs)


def _title(ax, title: str, run_name: str, titles: bool, **kwargs) -> None:
  """Sets `ax`'s title: the run's name over the figure's own line; none when not `titles`."""
  if titles:
    ax.set_title(f"{run_name}\n{title}" if run_name else title, **kwargs)


def run_name(config: dict) -> str:
  """'<method> on <setting>, seed N', the name every figure of a run carries, by the method's
  display name (`reporting.method_label`), e.g. 'Online-LoRA on mnist_5k: 5 disjoint tasks,
  custom ViT, seed 0' (`config`: the run's config.json, nested or flattened)."""
  flat = validation.flatten(config)
  seed = f", seed {flat['seed']}" if "seed" in flat else ""
  return f"{reporting.method_label(flat)} on {reporting.setting_title(flat)}{seed}"


def plot_files(config: dict) -> tuple[str, ...]:
  """The figures a run draws into its plots/ (`config`: its config, nested or flattened): the
  loss surface only where the run has a plateau rule (`reporting.detects_plateaus`)."""
  if reporting.detects_plateaus(validation.flatten(config)):
    return PLOT_FILES
  return PLOT_FILES[1:]


def _mark_boundaries(ax, boundary_samples, label: bool = True) -> None:
  for n, b in enumerate(boundary_samples):
    ax.axvline(b, color="0.35", linestyle="--", linewidth=1.0,
               label="true task boundary" if label and n == 0 else None)


def plot_loss_surface(samples: np.ndarray, window_value: np.ndarray,
                      window_mean: np.ndarray | None, plateau_samples, boundary_samples,
                      path: str, mean_threshold: float | None = None,
                      run_name: str = "", value_label: str = "loss-window value",
                      titles: bool = True) -> str:
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
  _title(ax, f"Loss surface: {n} plateau{'' if n == 1 else 's'}, {t} true task"
         f" boundar{'y' if t == 1 else 'ies'}", run_name, titles)
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: no overlap
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_anytime_accuracy(samples: np.ndarray, accuracy: np.ndarray, boundary_samples,
                          path: str, run_name: str = "", titles: bool = True) -> str:
  """Anytime accuracy (%) on the seen classes against samples seen."""
  fig = _figure(figsize=(7, 4), layout="constrained")
  ax = fig.add_subplot()
  accuracy = 100 * np.asarray(accuracy, np.float64)
  ax.plot(samples, accuracy, marker="o", markersize=3, color="tab:blue",
          label="accuracy on seen classes")
  _mark_boundaries(ax, boundary_samples)
  auc = np.nanmean(accuracy) if np.isfinite(accuracy).any() else float("nan")
  _title(ax, f"Anytime accuracy (A_AUC = {reporting.format_half_up(auc, 2)}%)", run_name, titles)
  ax.set_xlabel("samples seen")
  ax.set_ylabel("accuracy (%)")
  ax.set_ylim(0, 100)
  ax.legend(loc="lower left", fontsize=8)
  ax.grid(alpha=0.3)
  return _save(fig, path)


def _draw_matrix(ax, acc: np.ndarray, row_label: str, values: bool | None = None,
                 fontsize: float | None = None):
  """a_{i,j} (in %) as a heat map on `ax`, each cell's value written in it (one decimal, halves
  up) where `values` (default: up to 20 tasks), its text at `fontsize` points (default: the
  axes' own, the cells' 7-8); returns the image (for a colour bar)."""
  t = acc.shape[0]
  image = ax.imshow(acc, vmin=0, vmax=100, cmap="viridis")
  if values if values is not None else t <= 20:  # numbers stay legible up to 20 tasks
    for i in range(t):
      for j in range(t):
        ax.text(j, i, reporting.format_half_up(acc[i, j], 1), ha="center", va="center",
                fontsize=fontsize - 1 if fontsize else 7 if t > 10 else 8,
                color="white" if acc[i, j] < 60 else "black")
  ax.set_xticks(range(t))
  ax.set_yticks(range(t))
  ax.set_xlabel("after training task j", fontsize=fontsize)
  ax.set_ylabel(f"evaluated on {row_label} i", fontsize=fontsize)
  if fontsize:
    ax.tick_params(labelsize=fontsize)
  return image


def plot_accuracy_matrix(acc: np.ndarray, path: str, run_name: str = "",
                         row_label: str = "task", titles: bool = True) -> str:
  """Heat map of a_{i,j} (%) with the value written in each cell (one decimal, halves up);
  `row_label` names what a row is ('task', or 'domain' for a domain stream)."""
  acc = 100 * np.asarray(acc, np.float64)
  side = min(2.0 + 0.7 * acc.shape[0], 14.0)
  fig = _figure(figsize=(side + 1.2, side), layout="constrained")
  ax = fig.add_subplot()
  fig.colorbar(_draw_matrix(ax, acc, row_label), ax=ax, label="accuracy (%)")
  _title(ax, "Accuracy matrix a_{i,j}", run_name, titles, fontsize=9 if run_name else None)
  return _save(fig, path)


def write_run_plots(workdir: str, titles: bool = True) -> list[str]:
  """Draws the figures of the run in `workdir` (`plot_files`) into `workdir/plots/`; returns the
  paths."""
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
  name = run_name(config)
  paths = []
  if PLOT_FILES[0] in plot_files(config):
    paths.append(plot_loss_surface(samples, value, mean, detection["plateau_samples"], boundaries,
                                   os.path.join(out, PLOT_FILES[0]), threshold, name,
                                   "loss-window value" if online_lora else "training loss",
                                   titles))
  evals = events.get("eval", [])
  paths.append(plot_anytime_accuracy(np.array([e["samples_seen"] for e in evals]),
                                     np.array([np.nan if e["anytime_accuracy"] is None
                                               else e["anytime_accuracy"] for e in evals]),
                                     boundaries, os.path.join(out, PLOT_FILES[1]), name, titles))
  paths.append(plot_accuracy_matrix(np.asarray(results["acc_matrix"]),
                                    os.path.join(out, PLOT_FILES[2]), name,
                                    "domain" if "task_domains" in results else "task", titles))
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


def overlay_figure(rows: Sequence[dict], titles: bool = True) -> Figure:
  """The overlay of `reporting.aggregate`'s groups (read from their runs' results.json): one
  panel per setting, titled with it (`setting_title`); in each, one colour per method (the
  legend names it and its number of seeds): every run thin, the mean over seeds bold with a
  +-1 std band (ddof 1), and the setting's true task boundaries as dashed vertical lines (gid
  'task_boundary'). When the runs of a setting have different boundaries (Si-Blurry's task sizes
  are drawn per seed), every run's boundaries are drawn, lighter. Without `titles`, no figure
  title, and a panel's title only where several panels need telling apart."""
  panels = _by_setting(rows)
  fig = _figure(figsize=(7 * len(panels), 5.2), layout="constrained")
  axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
  n_runs = sum(len(row["runs"]) for row in rows)
  for ax, panel in zip(axes, panels, strict=True):
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
    if titles or len(panels) > 1:
      ax.set_title(_setting_title(panel), fontsize=10)
    ax.set_xlabel("samples seen")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, frameon=False)
  axes[0].set_ylabel("anytime accuracy on seen data (%)")
  axes[0].set_ylim(0, 100)
  if titles:
    fig.suptitle(f"Anytime accuracy of {n_runs} runs (bold: mean over seeds, band: ±1 std,"
                 " thin: each run)", fontsize=10)
  return fig


def _setting_title(panel: Sequence[dict]) -> str:
  return reporting.setting_title(reporting.Run(panel[0]["runs"][0]).config)


def _by_setting(rows: Sequence[dict]) -> list[list[dict]]:
  """`aggregate`'s rows grouped by setting, settings sorted, rows in their table order."""
  panels: dict[str, list[dict]] = {}
  for row in rows:
    panels.setdefault(row["setting"], []).append(row)
  return [panel for _, panel in sorted(panels.items())]


def _acc_matrices(row: dict) -> tuple[np.ndarray, str]:
  """The accuracy matrices a_{i,j} (fractions) of a row's runs, stacked (seeds, T, T), and what
  a matrix row is ('task', or 'domain' for a domain stream evaluated by domain)."""
  results = [reporting.Run(d).results for d in row["runs"]]
  shapes = {np.shape(r["acc_matrix"]) for r in results}
  if len(shapes) != 1:
    raise ValueError(f"the runs of {row['method']} on {row['setting']} have accuracy matrices"
                     f" of different shapes {sorted(shapes)}; pass runs of one setting")
  row_label = "domain" if "task_domains" in results[0] else "task"
  return np.stack([np.asarray(r["acc_matrix"], np.float64) for r in results]), row_label


# The accuracy matrices are drawn at the size a paper prints them: at most a two-column paper's
# text width (a figure* spans it), fonts of 6-8 pt at that size, each cell's value written where
# the cell is wide enough for it ('100.0' at 6 pt).
TEXT_WIDTH_IN = 7.0
MIN_CELL_IN = 0.28
MATRIX_FONT_PT = 7


def matrix_grid(n_panels: int, n_tasks: int) -> tuple[int, int]:
  """(rows, columns) of the accuracy matrices' panels: as many columns (at most 4) as fit the
  text width with cells wide enough for their values, then balanced (5 panels: 3 and 2, not 4
  and 1); the last row's panels are centred, so no panel of the grid is empty."""
  fit = int((TEXT_WIDTH_IN - 0.9) // max(1.6, MIN_CELL_IN * n_tasks + 0.6))
  ncols = max(1, min(n_panels, 4, fit))
  nrows = -(-n_panels // ncols)
  return nrows, -(-n_panels // nrows)


def accuracy_matrices_figure(panel: Sequence[dict], titles: bool = True) -> Figure:
  """The final accuracy matrix of each method of one setting (`panel`: `aggregate`'s rows of
  it), one heat map per method in table order (`matrix_grid`: no empty panel, the last row
  centred): the mean over its seeds of a_{i,j} in %, each panel titled with the method's display
  name and its number of seeds, one colour bar; the figure's title names the setting (`titles`).
  Drawn at print size (at most `TEXT_WIDTH_IN` wide, 6-8 pt text), each cell's value written in
  it where the cell is at least `MIN_CELL_IN` wide."""
  mats = [_acc_matrices(row) for row in panel]
  t = mats[0][0].shape[1]
  nrows, ncols = matrix_grid(len(panel), t)
  side = min((TEXT_WIDTH_IN - 0.9) / ncols, 3.2)
  fig = _figure(figsize=(side * ncols + 0.9, (side + 0.25) * nrows + (0.35 if titles else 0.1)),
                layout="constrained")
  grid = fig.add_gridspec(nrows, 2 * ncols)  # half columns: a short last row sits centred
  values = (side - 0.6) / t >= MIN_CELL_IN
  axes, image = [], None
  for k, (row, (acc, row_label)) in enumerate(zip(panel, mats, strict=True)):
    r, c = divmod(k, ncols)
    offset = ncols - min(ncols, len(panel) - r * ncols)  # in half columns
    ax = fig.add_subplot(grid[r, offset + 2 * c:offset + 2 * c + 2])
    image = _draw_matrix(ax, 100 * acc.mean(axis=0), row_label, values=values,
                         fontsize=MATRIX_FONT_PT)
    n = len(acc)
    ax.set_title(f"{row['method']} ({n} seed{'s' if n > 1 else ''})", fontsize=MATRIX_FONT_PT + 1)
    axes.append(ax)
  bar = fig.colorbar(image, ax=axes, shrink=0.8)
  bar.set_label("accuracy (%), mean over seeds", fontsize=MATRIX_FONT_PT)
  bar.ax.tick_params(labelsize=MATRIX_FONT_PT)
  if titles:
    fig.suptitle(f"Final accuracy matrices $a_{{i,j}}$: {_setting_title(panel)}",
                 fontsize=MATRIX_FONT_PT + 1)
  return fig


def forgetting_figure(rows: Sequence[dict], titles: bool = True) -> Figure:
  """The forgetting of each earlier task k < T (`metrics.forgetting_per_task`, in %; its mean
  is the Forgetting column): one panel per setting, a group of bars per task, one bar per
  method in table order (the legend names it and its seeds), the mean over seeds with a +-1 std
  (ddof 1) error bar."""
  panels = _by_setting(rows)
  widths = [max(4.5, 1.0 + 0.35 * len(p) * max(1, _acc_matrices(p[0])[0].shape[1] - 1))
            for p in panels]
  fig = _figure(figsize=(sum(widths), 4.8), layout="constrained")
  axes = fig.subplots(1, len(panels), squeeze=False, width_ratios=widths)[0]
  for ax, panel in zip(axes, panels, strict=True):
    width = 0.8 / len(panel)
    n_tasks = 0
    for i, row in enumerate(panel):
      acc, row_label = _acc_matrices(row)
      per_task = 100 * np.stack([metrics.forgetting_per_task(a) for a in acc])  # (seeds, T-1)
      n_tasks = per_task.shape[1]
      std = per_task.std(axis=0, ddof=1) if len(acc) > 1 else None
      n = len(acc)
      ax.bar(np.arange(n_tasks) - 0.4 + width * (i + 0.5), per_task.mean(axis=0), width,
             yerr=std, capsize=2, color=f"C{i % 10}", error_kw={"linewidth": 0.8},
             label=f"{row['method']} ({n} seed{'s' if n > 1 else ''})")
    ax.axhline(0, color="0.3", linewidth=0.8)
    ax.set_xticks(range(n_tasks))
    ax.set_xlabel(f"{row_label} k (forgetting after the last task)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, frameon=False)
    if titles or len(panels) > 1:
      ax.set_title(_setting_title(panel), fontsize=10)
  axes[0].set_ylabel(r"forgetting (%): $\max_{t<T}\, a_{k,t} - a_{k,T}$")
  if titles:
    fig.suptitle("Forgetting per task (bars: mean over seeds, whiskers: ±1 std)", fontsize=10)
  return fig


def setting_slug(setting: str) -> str:
  """A setting's label as a file name part: 'mnist_5k disjoint/5 custom' -> 'mnist_5k_disjoint_5
  _custom' (letters, digits, '_', '-' and '.')."""
  return re.sub(r"[^A-Za-z0-9.-]+", "_", setting).strip("_")


def write_overlay_plot(rows: Sequence[dict], out_dir: str, titles: bool = True) -> str:
  """`overlay_figure(rows)` into `out_dir/anytime_overlay.{png,pdf}`; returns the PNG's path."""
  os.makedirs(out_dir, exist_ok=True)
  return _save(overlay_figure(rows, titles), os.path.join(out_dir, OVERLAY_FILE))


def write_report_plots(rows: Sequence[dict], out_dir: str, titles: bool = True) -> list[str]:
  """The report's figures of `aggregate`'s rows into `out_dir` (PNG and PDF each): the anytime
  overlay, the final accuracy matrices of each setting, the forgetting per task (a setting of
  one task has no forgetting: left out of it, and no figure when no setting has more); returns
  the PNGs' paths."""
  paths = [write_overlay_plot(rows, out_dir, titles)]
  for panel in _by_setting(rows):
    name = MATRICES_FILE.format(setting=setting_slug(panel[0]["setting"]))
    paths.append(_save(accuracy_matrices_figure(panel, titles), os.path.join(out_dir, name)))
  several = [row for row in rows if _acc_matrices(row)[0].shape[1] > 1]
  if several:
    paths.append(_save(forgetting_figure(several, titles), os.path.join(out_dir, FORGETTING_FILE)))
  return paths
