"""Tests of `olora_jax.plots`: each figure is a valid PNG of sensible size, from a run directory
the test writes itself (the end-to-end run that writes them is in tests/test_report.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from olora_jax import metrics, plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_size=(400, 300), max_size=(3000, 3000)):
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE, f"{path} is not a PNG"
  with Image.open(path) as image:
    image.verify()  # checks the chunks' CRCs
  with Image.open(path) as image:
    w, h = image.size
    pixels = np.asarray(image.convert("L"))
  assert min_size[0] <= w <= max_size[0] and min_size[1] <= h <= max_size[1], (w, h)
  assert pixels.std() > 5, f"{path} looks blank"


def write_fake_run(workdir, n_tasks=3, steps_per_task=20, batch=8):
  """A run directory with the files and fields the trainer writes."""
  rng = np.random.default_rng(0)
  os.makedirs(workdir, exist_ok=True)
  lines, plateau_samples, task_end_samples = [], [], []
  for step in range(n_tasks * steps_per_task):
    samples = (step + 1) * batch
    in_task = step % steps_per_task
    loss = 4.0 * np.exp(-in_task / 4) + 0.5 + 0.05 * rng.normal()
    lines.append({"step": step, "samples_seen": samples, "event": "train", "loss": loss,
                  "window_value": loss, "window_mean": loss + 0.1, "window_var": 0.01})
    if in_task == 12:
      plateau_samples.append(samples)
      lines.append({"step": step, "samples_seen": samples, "event": "plateau", "n_plateaus":
                    len(plateau_samples), "window_mean": loss, "window_var": 0.01})
    if step % 10 == 9:
      lines.append({"step": step, "samples_seen": samples, "event": "eval",
                    "anytime_accuracy": float(rng.uniform(0.3, 0.9)), "n_seen_classes": 2})
    if in_task == steps_per_task - 1:
      task_end_samples.append(samples)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in lines)
  acc = np.triu(rng.uniform(0.2, 0.95, (n_tasks, n_tasks)))
  results = {"acc_matrix": acc.tolist(),
             "plateau_detection": metrics.plateau_detection(plateau_samples, task_end_samples)}
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"learner": {"mean_threshold": 1.0}}, f)
  return results


def test_write_run_plots_gives_three_valid_pngs(tmp_path):
  write_fake_run(tmp_path)
  paths = plots.write_run_plots(str(tmp_path))
  assert [os.path.basename(p) for p in paths] == list(plots.PLOT_FILES)
  for p in paths:
    assert os.path.dirname(p) == str(tmp_path / "plots")
    assert_png(p)


def test_accuracy_matrix_of_many_tasks_and_one_task(tmp_path):
  for t in (1, 25):  # a single task, and more tasks than get per-cell numbers
    path = plots.plot_accuracy_matrix(np.full((t, t), 0.5) * np.tri(t).T,
                                      str(tmp_path / f"acc{t}.png"))
    assert_png(path, min_size=(200, 200))


def test_empty_curves_still_draw(tmp_path):
  # No plateau, no boundary (T = 1), no evaluation point: the figures are still written.
  path = plots.plot_loss_surface(np.arange(1, 6), np.ones(5), None, [], [],
                                 str(tmp_path / "loss.png"))
  assert_png(path)
  path = plots.plot_anytime_accuracy(np.array([]), np.array([]), [], str(tmp_path / "any.png"))
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE


def test_corrupt_log_is_a_clear_error(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"event": "train"}\n{not json\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
    plots.read_events(str(tmp_path / "metrics.jsonl"))


def test_characters_the_font_lacks_are_one_warning_line_not_one_per_glyph(tmp_path, caplog):
  import warnings

  plots._MISSING_GLYPHS.clear()
  fig = plots._figure(figsize=(2, 2))
  fig.add_subplot().set_title("実験: ER")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # matplotlib's per-glyph UserWarning would fail here
    with caplog.at_level("WARNING"):
      plots._save(fig, str(tmp_path / "f.png"))
      plots._save(fig, str(tmp_path / "g.png"))  # the same characters: said once per process
  lines = [r.getMessage() for r in caplog.records if "glyph" in r.getMessage()]
  assert len(lines) == 1 and "no glyph for 実験" in lines[0], lines
  assert (tmp_path / "f.png").is_file() and (tmp_path / "g.pdf").is_file()


def test_every_pdf_embeds_truetype_fonts_not_type3(tmp_path):
  """Several venues' PDF checkers refuse Type 3 fonts (matplotlib's default): a figure's PDF
  embeds its text's font as TrueType (Type 42) and holds no Type 3 font."""
  fig = plots._figure(figsize=(2, 2))
  axes = fig.add_subplot()
  axes.set_title("A_final 53.6 %")
  axes.set_xlabel("samples seen")
  plots._save(fig, str(tmp_path / "f.png"))
  pdf = (tmp_path / "f.pdf").read_bytes()
  assert b"/FontFile2" in pdf  # TrueType glyph data (a Type 0 font with a CIDFontType2 part)
  assert b"/Type3" not in pdf


def test_figures_are_named_by_the_method_and_drawn_only_where_they_apply(tmp_path, monkeypatch):
  """A run's figures carry the method's display name, setting and seed (not its directory's
  name); a run without a plateau rule (a baseline, the training-free SLDA, a single LoRA) gets no
  loss surface; `titles=False` draws none."""
  config = {"method": "slda", "seed": 3, "model": {"name": "custom"},
            "data": {"dataset": "mnist_5k", "scenario": "disjoint", "n_tasks": 3}}
  name = "SLDA on mnist_5k: 3 disjoint tasks, custom ViT, seed 3"
  assert plots.run_name(config) == name
  assert plots.plot_files(config) == plots.PLOT_FILES[1:]
  assert plots.plot_files({"learner": {"incremental_lora": False}}) == plots.PLOT_FILES[1:]
  assert plots.plot_files({"method": "er", "boundaries": {"rule": "plateau"}}) == plots.PLOT_FILES
  assert plots.plot_files({}) == plots.PLOT_FILES  # Online-LoRA
  workdir = tmp_path / "seed0"
  write_fake_run(workdir)
  (workdir / "config.json").write_text(json.dumps(config))
  saved = []
  save = plots._save
  monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or save(fig, path))
  plots.write_run_plots(str(workdir))
  assert sorted(os.listdir(workdir / "plots")) == [
      "accuracy_matrix.pdf", "accuracy_matrix.png", "anytime_accuracy.pdf",
      "anytime_accuracy.png"]
  titles = [fig.axes[0].get_title() for fig in saved]
  assert [t.split("\n")[0] for t in titles] == [name, name]
  assert titles[1] == f"{name}\nAccuracy matrix a_{{i,j}}"
  saved.clear()
  plots.write_run_plots(str(workdir), titles=False)
  assert [fig.axes[0].get_title() for fig in saved] == ["", ""]
