"""Figures of one run, drawn from its metrics.jsonl and results.json into `DIR/plots/*.png`.

- `loss_surface.png`: the loss-window value of every logged step against samples seen (the
  signal the plateau rule reads, paper section 3.1 and its loss-surface figure), the window mean,
  the detected plateaus (where a LoRA was merged and a new one started) and the true task
  boundaries, which the learner never saw.
- `anytime_accuracy.png`: the anytime accuracy on the classes seen so far against samples seen
  (the curve whose mean is A_AUC), with the true task boundaries.
- `accuracy_matrix.png`: a_{i,j} as a heat map, row = task i, column = after training task j.

Figures are drawn with matplotlib's object API on an Agg canvas: no pyplot, no global backend
change, no display needed.
"""

from __future__ import annotations

import json
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PLOT_FILES = ("loss_surface.png", "anytime_accuracy.png", "accuracy_matrix.png")
DPI = 120


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


def _save(fig: Figure, path: str) -> str:
  FigureCanvasAgg(fig)
  fig.savefig(path, dpi=DPI)
  return path


def _mark_boundaries(ax, boundary_samples, label: bool = True) -> None:
  for n, b in enumerate(boundary_samples):
    ax.axvline(b, color="0.35", linestyle="--", linewidth=1.0,
               label="true task boundary" if label and n == 0 else None)


def plot_loss_surface(samples: np.ndarray, window_value: np.ndarray,
                      window_mean: np.ndarray | None, plateau_samples, boundary_samples,
                      path: str, mean_threshold: float | None = None,
                      value_label: str = "loss-window value") -> str:
  """The loss surface with detected plateaus (red) and true task boundaries (grey, dashed)."""
  fig = Figure(figsize=(10.5, 4), layout="constrained")
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
  ax.set_title(f"Loss surface: {len(plateau_samples)} plateaus, "
               f"{len(boundary_samples)} true task boundaries")
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: no overlap
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_anytime_accuracy(samples: np.ndarray, accuracy: np.ndarray, boundary_samples,
                          path: str) -> str:
  """Anytime accuracy (%) on the seen classes against samples seen."""
  fig = Figure(figsize=(7, 4), layout="constrained")
  ax = fig.add_subplot()
  accuracy = 100 * np.asarray(accuracy, np.float64)
  ax.plot(samples, accuracy, marker="o", markersize=3, color="tab:blue",
          label="accuracy on seen classes")
  _mark_boundaries(ax, boundary_samples)
  auc = np.nanmean(accuracy) if np.isfinite(accuracy).any() else float("nan")
  ax.set_title(f"Anytime accuracy (A_AUC = {auc:.2f}%)")
  ax.set_xlabel("samples seen")
  ax.set_ylabel("accuracy (%)")
  ax.set_ylim(0, 100)
  ax.legend(loc="lower left", fontsize=8)
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_accuracy_matrix(acc: np.ndarray, path: str) -> str:
  """Heat map of a_{i,j} (%) with the value written in each cell."""
  acc = 100 * np.asarray(acc, np.float64)
  t = acc.shape[0]
  side = min(2.0 + 0.7 * t, 14.0)
  fig = Figure(figsize=(side + 1.2, side), layout="constrained")
  ax = fig.add_subplot()
  image = ax.imshow(acc, vmin=0, vmax=100, cmap="viridis")
  fig.colorbar(image, ax=ax, label="accuracy (%)")
  if t <= 20:  # numbers stay legible up to 20 tasks
    for i in range(t):
      for j in range(t):
        ax.text(j, i, f"{acc[i, j]:.0f}", ha="center", va="center", fontsize=8,
                color="white" if acc[i, j] < 60 else "black")
  ax.set_xticks(range(t))
  ax.set_yticks(range(t))
  ax.set_xlabel("after training task j")
  ax.set_ylabel("evaluated on task i")
  ax.set_title("Accuracy matrix a_{i,j}")
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
  paths = [plot_loss_surface(samples, value, mean, detection["plateau_samples"], boundaries,
                             os.path.join(out, PLOT_FILES[0]), threshold,
                             "loss-window value" if online_lora else "training loss")]
  evals = events.get("eval", [])
  paths.append(plot_anytime_accuracy(np.array([e["samples_seen"] for e in evals]),
                                     np.array([np.nan if e["anytime_accuracy"] is None
                                               else e["anytime_accuracy"] for e in evals]),
                                     boundaries, os.path.join(out, PLOT_FILES[1])))
  paths.append(plot_accuracy_matrix(np.asarray(results["acc_matrix"]),
                                    os.path.join(out, PLOT_FILES[2])))
  return paths
