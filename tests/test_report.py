"""End to end on two tiny runs (seeds 0 and 1): every metric in results.json agrees with the
evaluation log in metrics.jsonl, the three plots are written, and `launch/report.py`
aggregates the runs into the expected mean ± std table. Plus the grouping rules of
`olora_jax.reporting` on run directories the test writes."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import pathlib
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import tiny
from olora_jax import evaluate, methods, metrics, plots, reporting, trainer
from olora_jax.models.vit import VisionTransformer, spec_from_config
from olora_jax.pretrained import save_timm_safetensors
from olora_jax.sweep import plan

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(seed: int):
  config = tiny.get_config()
  config.seed = seed
  config.learner.batch_size = 64  # 23 steps over sklearn's digits
  # Thresholds every window passes: a plateau fires whenever the peak rule re-arms, so the
  # telemetry has plateaus to match against the boundaries.
  config.learner.mean_threshold = 100.0
  config.learner.var_threshold = 100.0
  config.eval.eval_every = 200
  return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  # One random backbone saved as a timm checkpoint and loaded by both runs (through the real
  # loader), instead of the trainer's slower eager Flax init of a random backbone in each run.
  spec = spec_from_config(tiny_config(0).model)
  params = jax.jit(VisionTransformer(spec, 10).init)(
      jax.random.key(0), np.zeros((1, spec.image_size, spec.image_size, 3), np.float32))
  backbone = str(tmp_path_factory.mktemp("backbone") / "tiny_random.safetensors")
  save_timm_safetensors(jax.device_get(params["params"]), backbone)
  dirs = []
  for seed in (0, 1):
    workdir = str(tmp_path_factory.mktemp(f"tiny_seed{seed}"))
    config = tiny_config(seed)
    config.pretrained.path, config.pretrained.format = backbone, "timm"
    config.eval.write_plots = seed == 0  # output-only: the report still groups both runs
    traces = evaluate.TRACE_COUNTS["count"]
    trainer.train_and_evaluate(config, workdir, progress=False)
    # Every anytime and task-end evaluation of the run shares one compiled function.
    assert evaluate.TRACE_COUNTS["count"] == traces + 1
    dirs.append(workdir)
  return dirs


def test_results_agree_with_the_evaluation_log(runs):
  with open(os.path.join(runs[0], "results.json")) as f:
    results = json.load(f)
  events = plots.read_events(os.path.join(runs[0], "metrics.jsonl"))
  ends = events["task_end"]
  assert len(ends) == 5
  # The accuracy matrix, column by column, from the per-class counts logged at each task end.
  correct = np.array([e["class_correct"] for e in ends])
  total = np.array([e["class_total"] for e in ends])
  seen = np.array([np.isin(np.arange(10), e["seen_classes"]) for e in ends])
  tasks = [np.arange(2 * t, 2 * t + 2) for t in range(5)]
  acc = np.stack([metrics.task_accuracies(c, n, tasks) for c, n in zip(correct, total,
                                                                       strict=True)], axis=1)
  np.testing.assert_allclose(results["acc_matrix"], acc)
  np.testing.assert_allclose([e["task_accuracies"] for e in ends], acc.T)
  assert results["A_final"] == pytest.approx(acc[:, -1].mean())
  assert results["forgetting"] == pytest.approx(metrics.forgetting(acc))
  assert results["backward_transfer"] == pytest.approx(metrics.backward_transfer(acc))
  assert results["A_last"] == pytest.approx(correct[-1].sum() / total[-1].sum())
  assert results["F_last"] == pytest.approx(metrics.f_last(correct, total, seen))
  anytime = [e["anytime_accuracy"] for e in events["eval"]]
  assert results["A_auc"] == pytest.approx(np.mean(anytime))
  assert results["anytime_samples"] == [e["samples_seen"] for e in events["eval"]]
  # One anytime point at the first step past each multiple of eval_every (200 samples).
  assert np.all(np.diff(np.asarray(results["anytime_samples"]) // 200) == 1)
  end_samples = np.array([e["samples_seen"] for e in ends])
  assert [e["n_seen_classes"] for e in events["eval"]] == [  # 2 classes per task started
      2 * (1 + int(np.sum(end_samples < s))) for s in results["anytime_samples"]]
  # Plateau telemetry matches the plateau events against the true task ends.
  plateau_samples = [e["samples_seen"] for e in events.get("plateau", [])]
  assert results["n_plateaus"] == len(plateau_samples) > 0
  expected = metrics.plateau_detection(plateau_samples, [e["samples_seen"] for e in ends])
  got = results["plateau_detection"]
  for key in ("n_detected", "latency_samples", "plateaus_per_task", "boundary_samples"):
    assert got[key] == expected[key]
  for key in ("A_last", "F_last", "backward_transfer", "plateau_detection", "A_auc",
              "acc_matrix_task_il", "A_final_task_il", "A_auc_task_il"):
    assert key in results["metric_notes"]
  # Task-IL (a disjoint stream): the matrix from the task-end lines, its summaries; each task's
  # Task-IL accuracy at least its class-incremental one (the same logits, fewer rivals).
  til = np.array([e["task_accuracies_task_il"] for e in ends]).T
  np.testing.assert_allclose(results["acc_matrix_task_il"], til)
  assert results["A_final_task_il"] == pytest.approx(til[:, -1].mean())
  til_anytime = [e["anytime_accuracy_task_il"] for e in events["eval"]]
  assert results["A_auc_task_il"] == pytest.approx(np.mean(til_anytime))
  assert np.all(til >= acc) and np.all(np.asarray(til_anytime) >= np.asarray(anytime))
  for event in (e for group in events.values() for e in group):
    assert {"step", "samples_seen", "event"} <= set(event)


def test_the_run_writes_the_three_plots(runs):
  from test_plots import assert_png

  for name in plots.PLOT_FILES:
    assert_png(os.path.join(runs[0], "plots", name))


@pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is None,
                    reason="tensorboardX (optional) is not installed")
def test_tensorboard_events_are_written(runs):
  files = os.listdir(os.path.join(runs[0], "tensorboard"))
  assert any(f.startswith("events.out.tfevents") for f in files)
  size = sum(os.path.getsize(os.path.join(runs[0], "tensorboard", f)) for f in files)
  assert size > 1000


def test_report_aggregates_two_seeds(runs, tmp_path):
  values = {}
  for d in runs:
    with open(os.path.join(d, "results.json")) as f:
      r = json.load(f)
    for m in reporting.DEFAULT_METRICS:
      values.setdefault(m, []).append(100 * r[m])
  out_csv = tmp_path / "table.csv"
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), *runs,
                         f"--csv={out_csv}"], capture_output=True, text=True, check=True,
                        timeout=120)
  setting = "sklearn_digits disjoint/5 custom"
  # The setting is named once, over its three metrics.
  assert f"| method | {setting} |||\n|---|---|---|---|\n| | A_final ↑ | Forgetting ↓ | A_auc ↑ |" \
      in proc.stdout
  cells = [f"{np.mean(v):.2f} ± {np.std(v, ddof=1):.2f}" for v in values.values()]
  # Online-LoRA in the paper's fidelity: not the `reference` fidelity its check ran in.
  assert "| Online-LoRA [^a] | " + " | ".join(cells) + " |" in proc.stdout
  assert "\n[^a]: Online-LoRA: not the settings of its check against its authors' code," in (
      proc.stdout)
  assert "`fidelity` 'paper' (checked: 'reference')" in proc.stdout
  with open(out_csv) as f:
    (row,) = list(csv.DictReader(f))
  assert row["method"] == "Online-LoRA" and row["setting"] == setting
  assert row["seeds"] == "0 1" and row["n_runs"] == "2"
  for m, v in values.items():
    assert float(row[f"{m}_mean"]) == pytest.approx(np.mean(v))
    assert float(row[f"{m}_std"]) == pytest.approx(np.std(v, ddof=1))


def write_run(path, seed, results, **config_overrides):
  config = {"seed": seed, "model": {"name": "vit_b16"}, "log_every": 1,
            "data": {"dataset": "cifar100", "scenario": "disjoint", "n_tasks": 10},
            "learner": {"incremental_lora": True, "hard_loss": True, "learning_rate": 2e-4},
            "eval": {"write_plots": True}}
  for key, value in config_overrides.items():
    section, name = key.split("__")
    config[section][name] = value
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "results.json"), "w") as f:
    json.dump(results, f)
  return str(path)


def test_grouping_methods_settings_and_variants(tmp_path):
  r = lambda a, f: {"A_final": a, "forgetting": f, "A_auc": 0.5}
  dirs = [
      write_run(tmp_path / "a0", 0, r(0.50, 0.40)),
      write_run(tmp_path / "a1", 1, r(0.52, 0.42), eval__write_plots=False),  # same group
      write_run(tmp_path / "b0", 0, r(0.30, None), learner__hard_loss=False,
                learner__incremental_lora=False),
      write_run(tmp_path / "c0", 0, r(0.45, -1e-5), learner__learning_rate=1e-3),
      write_run(tmp_path / "d0", 0, r(0.60, 0.10), data__dataset="imagenet_r"),
  ]
  rows = reporting.aggregate(dirs)
  by = {(row["method"], row["setting"]): row for row in rows}
  lora = by[("Online-LoRA [learner.learning_rate=0.0002]", "cifar100 disjoint/10 vit_b16")]
  assert lora["seeds"] == [0, 1]
  assert lora["A_final"]["mean"] == pytest.approx(51.0)
  assert lora["A_final"]["std"] == pytest.approx(np.std([50, 52], ddof=1))
  assert ("Online-LoRA [learner.learning_rate=0.001]", "cifar100 disjoint/10 vit_b16") in by
  single = by[("single LoRA", "cifar100 disjoint/10 vit_b16")]
  assert single["forgetting"]["n"] == 0  # null forgetting is left out, not counted as 0
  table = reporting.markdown_table(rows)
  assert "| single LoRA | 30.00 | n/a | 50.00 |  |  |  |" in table
  assert table.splitlines()[:3] == [
      "| method | cifar100 disjoint/10 vit_b16 ||| imagenet_r disjoint/10 vit_b16 |||",
      "|---|---|---|---|---|---|---|",
      "| | A_final ↑ | Forgetting ↓ | A_auc ↑ | A_final ↑ | Forgetting ↓ | A_auc ↑ |"]
  # A forgetting of -0.001 % is 0.00, not "-0.00" (read as a gain).
  assert "| Online-LoRA [learner.learning_rate=0.001] | 45.00 | 0.00 | 50.00 |" in table
  assert "-0.00" not in table
  assert "| Online-LoRA | " in table


def mlflow_run(store, workdir):
  """An MLflow file store's layout (as MlflowClient writes it: STORE/.trash, STORE/EXPERIMENT/
  meta.yaml, STORE/EXPERIMENT/RUN/meta.yaml and artifacts/) holding `workdir`'s files as one
  run's artifacts, as olora_jax/loggers.py sends them."""
  run = store / "731" / "4f2c9d"
  (store / ".trash").mkdir(parents=True, exist_ok=True)
  (run / "artifacts").mkdir(parents=True)
  (run / "metrics").mkdir()
  (store / "731" / "meta.yaml").write_text("name: olora-jax\n")
  (run / "meta.yaml").write_text("run_id: 4f2c9d\n")
  for name in ("config.json", "results.json"):
    shutil.copy(os.path.join(workdir, name), run / "artifacts" / name)


def test_results_rows_one_per_run_with_every_metric_and_its_status(tmp_path, capsys):
  """`results_rows`: a sweep tree (an MLflow store beside its cells, a tuned method, an
  unfinished cell) as one row per run; the table is built from the same rows; a DataFrame of
  them where pandas is installed."""
  root = tmp_path / "sweep"
  metrics_ = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5, "acc_matrix": [[0.5]],
              "compute": {"passes_per_step": 3.0}, "metric_notes": {"A_final": "..."}}
  setting = root / "cifar100"
  dirs = [write_run(setting / "online_lora" / f"seed{s}", s, {**metrics_, "A_final": 0.5 + s / 10})
          for s in (0, 1)]
  tuned = write_run(setting / "er" / "seed0", 0, {**metrics_, "A_final_task_il": 0.9})
  config = json.loads((setting / "er" / "seed0" / "config.json").read_text())
  config.update(method="er", er={"learning_rate": 0.003})
  (setting / "er" / "seed0" / "config.json").write_text(json.dumps(config))
  (setting / "er" / reporting.TUNING_RECORD).write_text(json.dumps(
      {"method": "er", "block": "er", "chosen": {"learning_rate": 0.003}, "metric": "A_final",
       "validation_fraction": 0.1, "seed": 0}))
  unfinished = setting / "er" / "seed1"
  unfinished.mkdir()
  (unfinished / "config.json").write_text(json.dumps({"seed": 1, "method": "er"}))
  mlflow_run(root / "mlruns", dirs[0])
  rows = reporting.results_rows(str(root))  # one path, or a list of paths
  assert rows == reporting.results_rows([root])
  assert [(r["method"], r["seed"], r["status"]) for r in rows] == [
      ("ER (tuned: learning_rate=0.003)", 0, "finished"), ("Online-LoRA", 0, "finished"),
      ("Online-LoRA", 1, "finished"), ("ER", 1, "not finished (no results.json)")]
  er, first = rows[0], rows[1]
  assert er["tuned/learning_rate"] == 0.003 and "tuned/learning_rate" not in first
  assert first["setting"] == "cifar100 disjoint/10 vit_b16" and first["workdir"] == dirs[0]
  assert first["A_final"] == 0.5 and first["acc_matrix"] == [[0.5]]
  assert first["compute/passes_per_step"] == 3.0 and "metric_notes" not in first
  assert er["A_final_task_il"] == 0.9 and "A_final_task_il" not in first
  assert "A_final" not in rows[3] and rows[3]["workdir"] == str(unfinished)
  # The report's table from the same rows: the same numbers as from the run directories; a
  # metric only some runs record (Task-IL) is n/a for the others.
  table = reporting.table_rows(rows, ["A_final", "A_final_task_il"])
  assert table == reporting.aggregate([str(tuned), *dirs], ["A_final", "A_final_task_il"])
  assert [(r["method"], r["A_final"]["mean"], r["A_final_task_il"]["n"]) for r in table] == [
      ("ER (tuned: learning_rate=0.003)", 50.0, 1), ("Online-LoRA", pytest.approx(55.0), 0)]
  assert "| ER (tuned: learning_rate=0.003) | 50.00 | 90.00 |" in reporting.render(
      table, ["A_final", "A_final_task_il"])
  # examples/sweep_results.py (the docs' example) on this tree: rows, table, LaTeX.
  example = runpy.run_path(str(ROOT / "examples" / "sweep_results.py"))
  example["main"](str(root))
  printed = capsys.readouterr().out
  assert " ER 1 not finished (no results.json) None\n" in printed
  assert r"ER (tuned: learning\_rate=0.003) & $50.00$ & {\boldmath$10.00$} \\" in printed
  pandas = pytest.importorskip("pandas")
  frame = reporting.as_dataframe(rows)
  assert isinstance(frame, pandas.DataFrame) and len(frame) == 4
  assert frame.groupby("method")["A_final"].mean()["Online-LoRA"] == pytest.approx(0.55)


def test_a_markdown_row_escapes_a_pipe_in_a_method_name(tmp_path):
  """A method's report name (one's own method's) holding `|` stays one cell of its row."""
  stats = {"mean": 50.0, "std": math.nan, "n": 1}
  rows = [{"method": "ER | big buffer", "setting": "a|b", "seeds": [0], "A_final": stats}]
  table = reporting.markdown_table(rows, ["A_final"])
  lines = table.splitlines()
  assert lines[0] == "| method | a\\|b |" and lines[3] == "| ER \\| big buffer | 50.00 |"
  cells = [len(re.findall(r"(?<!\\)\|", line)) for line in lines[1:4]]
  assert cells == [3, 3, 3]  # every row: two cells


def test_report_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a finished run"):
    reporting.aggregate([str(tmp_path)])
  a = write_run(tmp_path / "a", 0, {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5})
  b = write_run(tmp_path / "b", 0, {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5})
  with pytest.raises(ValueError, match="same config and the same seed"):
    reporting.aggregate([a, b])
  with pytest.raises(ValueError, match="metric 'A_nope'"):
    reporting.aggregate([a], metrics=["A_nope"])
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py")],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and "run directories" in proc.stderr


def test_a_damaged_results_json_is_named_and_left_out(tmp_path):
  """A results.json cut short (a full disk, a copy stopped half way) is not a finished run: a
  sweep tree's report names the file and leaves it out; given by name it is refused naming it;
  the JSON parser's own message alone named no file."""
  metrics = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5}
  good = write_run(tmp_path / "root" / "good", 0, metrics)
  cut = write_run(tmp_path / "root" / "cut", 1, metrics)
  path = os.path.join(cut, "results.json")
  with open(path, "r+") as f:
    f.truncate(10)
  # A sweep tracked with MLflow keeps its store beside the cells (ROOT/mlruns), where each run's
  # config.json and results.json are artifacts again: a store, not runs (once, "one run twice").
  mlflow_run(tmp_path / "root" / "mlruns", good)
  finished, unfinished = reporting.find_runs([str(tmp_path / "root")])
  assert (finished, unfinished) == ([good], [cut])
  assert reporting.unfinished_reason(cut).startswith(f"{path} is damaged (JSONDecodeError: ")
  assert "rerun the run's launch/run.py command" in reporting.unfinished_reason(cut)
  with pytest.raises(ValueError, match=re.escape(f"{path} is damaged")):
    reporting.find_runs([cut])
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"),
                         str(tmp_path / "root")], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert f"note: {cut}: {path} is damaged (JSONDecodeError:" in proc.stderr
  assert "left out" in proc.stderr and "| 50.00 |" in proc.stdout  # the good run's row
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), cut],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {path} is damaged")


def test_report_groups_seeds_and_methods_and_draws_the_overlay(tmp_path):
  from test_plots import assert_png

  def curve(seed, level):
    samples = [100, 200, 300, 400]
    return {"A_final": level, "forgetting": 0.1, "A_auc": level,
            "anytime_samples": samples, "anytime_accuracy": [level + 0.01 * seed] * 4,
            "acc_matrix": [[0.9, level, level - 0.1 * seed], [0.0, 0.8, level], [0, 0, 0.7]]}

  dirs = [write_run(tmp_path / f"olora{s}", s, curve(s, 0.6)) for s in (0, 1, 2)]
  dirs += [write_run(tmp_path / f"lora{s}", s, curve(s, 0.3), learner__incremental_lora=False,
                     learner__hard_loss=False) for s in (0, 1)]
  rows = reporting.aggregate(dirs)
  assert [(r["method"], r["seeds"]) for r in rows] == [("Online-LoRA", [0, 1, 2]),
                                                        ("single LoRA", [0, 1])]
  assert rows[0]["A_final"]["mean"] == pytest.approx(60.0)
  # No --csv: the report writes nothing but what it is asked for (the figures), and nothing into
  # the directory it runs in.
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), *dirs,
                         f"--plots={tmp_path / 'figs'}"], cwd=cwd,
                        capture_output=True, text=True, check=True, timeout=120)
  # stdout holds the table alone; what was written is said on stderr, in one line: the PDFs'
  # font subsetting (fontTools, at INFO under absl's root logger) adds nothing.
  assert "figures written" in proc.stderr and "CSV" not in proc.stderr + proc.stdout
  assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr[:2000]
  assert proc.stdout.startswith("| method |") and "written" not in proc.stdout
  assert list(cwd.iterdir()) == []
  matrices = "accuracy_matrices_cifar100_disjoint_10_vit_b16"
  assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
      f"{matrices}.pdf", f"{matrices}.png", "anytime_overlay.pdf", plots.OVERLAY_FILE,
      "forgetting_per_task.pdf", plots.FORGETTING_FILE]
  for name in (plots.OVERLAY_FILE, f"{matrices}.png", plots.FORGETTING_FILE):
    assert_png(tmp_path / "figs" / name)
  with open(tmp_path / "figs" / "anytime_overlay.pdf", "rb") as f:
    assert f.read(5) == b"%PDF-"
  # The band is the std over seeds at each point, the line their mean.
  grid, mean, std = plots.mean_std_curve(
      [(np.array([100, 200, 300]), np.array([0.5, 0.6, 0.7])),
       (np.array([100, 250, 300]), np.array([0.7, 0.6, 0.5]))])
  np.testing.assert_allclose(grid, [100, 200, 250, 300])
  np.testing.assert_allclose(mean, [0.6, (0.6 + (0.7 - 0.1 / 1.5)) / 2, (0.65 + 0.6) / 2, 0.6])
  np.testing.assert_allclose(std[[0, 3]], [np.std([0.5, 0.7], ddof=1)] * 2)


def test_overlay_figure_marks_task_boundaries_and_names_methods(tmp_path):
  def run(name, seed, boundaries, **overrides):
    results = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5,
               "anytime_samples": [100, 200, 300, 400], "anytime_accuracy": [0.9, 0.7, 0.6, 0.5],
               "plateau_detection": {"boundary_samples": boundaries}}
    return write_run(tmp_path / name, seed, results, **overrides)

  dirs = [run("olora0", 0, [120, 240, 360]), run("olora1", 1, [120, 240, 360]),
          run("lora0", 0, [120, 240, 360], learner__incremental_lora=False,
              learner__hard_loss=False),
          # Si-Blurry: each seed's stream has its own task sizes, so its own boundaries.
          run("blurry0", 0, [150, 310], data__scenario="si_blurry", data__n_tasks=3),
          run("blurry1", 1, [90, 250], data__scenario="si_blurry", data__n_tasks=3)]
  fig = plots.overlay_figure(reporting.aggregate(dirs))
  by_title = {ax.get_title(): ax for ax in fig.axes}
  assert sorted(by_title) == ["cifar100: 10 disjoint tasks, vit_b16",
                              "cifar100: 3 Si-Blurry tasks, vit_b16"]  # a panel per setting

  def boundaries(ax):
    return sorted(line.get_xdata()[0] for line in ax.lines if line.get_gid() == "task_boundary")

  def legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]

  disjoint = by_title["cifar100: 10 disjoint tasks, vit_b16"]
  assert boundaries(disjoint) == [120, 240, 360]
  # The legend names the method (the setting is the panel's title) and its seeds, once each.
  assert legend(disjoint) == ["Online-LoRA (2 seeds)", "single LoRA (1 seed)",
                              "true task boundary"]
  blurry = by_title["cifar100: 3 Si-Blurry tasks, vit_b16"]
  assert boundaries(blurry) == [90, 150, 250, 310]
  assert legend(blurry) == ["Online-LoRA (2 seeds)", "true task boundaries (differ by run)"]
  assert "5 runs" in fig.get_suptitle()


def test_duplicate_runs_are_named_with_their_seed(tmp_path):
  r = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5}
  a = write_run(tmp_path / "demo", 0, r)
  b = write_run(tmp_path / "demo_seed0", 0, r)
  c = write_run(tmp_path / "demo_seed1", 1, r)
  with pytest.raises(ValueError, match=r"demo_seed0'\] have the same config and the same seed"
                                       r" \(0\)") as info:
    reporting.aggregate([a, b, c])
  assert "demo_seed1" not in str(info.value)


def test_user_dataset_files_group_by_file_name(tmp_path):
  r = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5}
  a = write_run(tmp_path / "a", 0, r, data__dataset="/checkout1/ex/my_data.py:load")
  b = write_run(tmp_path / "b", 1, r, data__dataset="/checkout2/ex/my_data.py:load")
  (row,) = reporting.aggregate([a, b])
  assert row["seeds"] == [0, 1] and row["setting"] == "my_data.py:load disjoint/10 vit_b16"


def test_matrix_cells_round_half_up():
  assert [reporting.format_half_up(v) for v in (87.25, 88.25, 87.35, 100 * 0.8725)] == [
      "87.3", "88.3", "87.4", "87.3"]
  assert reporting.format_half_up(float("nan")) == "n/a"
  # Rounded to zero, a negative value loses its sign; rounded away from zero, it keeps it.
  assert [reporting.format_half_up(v) for v in (-0.04, -0.05)] == ["0.0", "-0.1"]
  assert [reporting.format_fixed(v) for v in (-0.004, -0.006, 0.0)] == ["0.00", "-0.01", "0.00"]


def write_method_run(path, seed, method, manifest, a_final, trainable="all", wall=10.0,
                     passes=None, **config_overrides):
  results = {"A_final": a_final, "forgetting": 0.1, "A_auc": None if method == "gdumb" else 0.5,
             "stream_manifest_sha256": manifest, "wall_seconds": wall,
             "compute": {"passes_per_step": passes}}
  if method == "iid":  # trained on a shuffle of the benchmark stream `manifest`
    results.update(stream_manifest_sha256="shuffled" + manifest,
                   benchmark_manifest_sha256=manifest)
  run = write_run(path, seed, results, **config_overrides)
  with open(os.path.join(run, "config.json")) as f:
    config = json.load(f)
  config["method"] = method
  config[method] = {"trainable": trainable, "learning_rate": 1e-4}
  config["er" if method != "er" else "mir"] = {"learning_rate": seed}  # an unused block
  with open(os.path.join(run, "config.json"), "w") as f:
    json.dump(config, f)
  return run


def test_table_one_layout_and_stream_check(tmp_path):
  dirs = []
  for seed in (0, 1):
    m = f"stream{seed}"
    dirs += [write_method_run(tmp_path / f"iid{seed}", seed, "iid", m, 0.9, wall=5.0 + seed),
             write_method_run(tmp_path / f"er{seed}", seed, "er", m, 0.4 + 0.1 * seed),
             write_method_run(tmp_path / f"ft{seed}", seed, "finetune", m, 0.2, "head"),
             write_method_run(tmp_path / f"gd{seed}", seed, "gdumb", m, 0.3),
             write_method_run(tmp_path / f"agem{seed}", seed, "agem", m, 0.1)]
  metrics_ = ("A_final", "A_auc", "wall_seconds")
  rows = reporting.aggregate(dirs, metrics_)
  # One row per method whatever its unused blocks hold, in the paper's Table 1 order.
  assert [r["method"] for r in rows] == ["AGEM", "ER", "GDumb", "Fine-tuning (head)",
                                         "Upper bound (i.i.d.)"]
  er = rows[1]
  assert er["seeds"] == [0, 1] and er["A_final"]["mean"] == pytest.approx(45.0)
  assert rows[2]["A_auc"]["n"] == 0  # GDumb has no anytime accuracy
  assert rows[4]["wall_seconds"]["mean"] == pytest.approx(5.5)  # seconds, not x 100
  table = reporting.markdown_table(rows, metrics_)
  assert "| ER | 45.00 ± 7.07 | 50.00 ± 0.00 | 10.00 ± 0.00 |" in table
  # A run of seed 1 on another stream is refused, naming both runs.
  bad = write_method_run(tmp_path / "mir1", 1, "mir", "other", 0.5)
  with pytest.raises(ValueError, match=r"different streams .*their configs agree: the data they"
                                       r" read differs\); .*same data, data.class_order, seed"):
    reporting.aggregate(dirs + [bad])
  # Configs that differ in a key of the stream: the line names it.
  bad = write_method_run(tmp_path / "mir1b", 1, "mir", "other", 0.5, learner__batch_size=32)
  with pytest.raises(ValueError, match=r"their configs differ in learner.batch_size\)"):
    reporting.aggregate(dirs + [bad])


def test_class_order_names_the_setting(tmp_path):
  """A setting's label names a class order other than the labels' (a reversed-order table must
  not look like the normal one), so two orders are two column groups, never one."""
  assert [reporting.class_order_label(o) for o in (
      "label", "seeded", "4,3,2,1,0", [4, 3, 2, 1, 0], [3, 1, 0, 2])] == [
      "", "seeded order", "reversed order", "reversed order", "order 3,1,0,2"]
  long_a, long_b = list(range(100)), list(range(100))
  long_a[:2], long_b[98:] = [1, 0], [99, 98]
  labels = [reporting.class_order_label(o) for o in (long_a, long_b)]
  assert labels[0].startswith("order 1,0,2,... of 100, #") and labels[0] != labels[1]
  r = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5}
  runs = [write_run(tmp_path / f"label{s}", s, {**r, "stream_manifest_sha256": f"l{s}"})
          for s in (0, 1)]
  runs += [write_run(tmp_path / f"reversed{s}", s, {**r, "stream_manifest_sha256": f"r{s}"},
                     data__class_order="9,8,7,6,5,4,3,2,1,0") for s in (0, 1)]
  rows = reporting.aggregate(runs)
  assert [row["setting"] for row in rows] == ["cifar100 disjoint/10 vit_b16",
                                              "cifar100 disjoint/10 vit_b16, reversed order"]
  assert rows[1]["method"] == "Online-LoRA"  # the order is the setting's, not the method's
  table = reporting.markdown_table(rows)
  assert "| cifar100 disjoint/10 vit_b16, reversed order |||" in table
  assert reporting.setting_title({"data.dataset": "mnist_5k", "data.n_tasks": 5,
                                  "data.scenario": "disjoint", "model.name": "custom",
                                  "data.class_order": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]}) == (
      "mnist_5k: 5 disjoint tasks, custom ViT, reversed order")
  # The paper's numbers stand beside its orders (the labels', a seeded draw), not another.
  seeded = [write_method_run(tmp_path / f"seeded{s}", s, "er", f"s{s}", 0.5,
                             data__class_order="seeded") for s in (0, 1)]
  _, table = reporting.layout_table(seeded, "table1")
  assert "| method | cifar100 disjoint/10 vit_b16, seeded order ||||||" in table
  assert "| | A_final ↑ | (paper) | Forgetting ↓ | (paper) |" in table
  # A list and the same order written as a string are the same stream keys.
  config = {"data.class_order": [2, 1, 0], "learner.batch_size": 16}
  assert reporting.stream_keys_differing(config, {**config, "data.class_order": "2,1,0"}) == []
  assert reporting.stream_keys_differing(config, {**config, "data.class_order": "label"}) == [
      "data.class_order"]


def test_prompt_methods_are_labelled_by_name_and_ordered_before_online_lora():
  labels = [reporting.method_label({"method": m, f"{m}.trainable": "prompts"})
            for m in ("mvp", "l2p")]
  assert labels == ["MVP", "L2P"]
  order = sorted(labels + ["Online-LoRA", "DER++"], key=reporting._row_order)
  assert order == ["DER++", "L2P", "MVP", "Online-LoRA"]


def test_every_method_is_labelled_from_its_declared_defaults():
  """A method's label reads what its block trains by default from the block its module declares;
  the training-free methods' blocks have no `trainable` (SLDA, RanPAC and SimpleCIL once raised
  AttributeError here, at the end of every run)."""
  for spec in methods.specs():
    block = spec.config() if spec.config is not None else {}
    config = {"method": spec.name, **{f"{spec.name}.{k}": v for k, v in block.items()}}
    label = reporting.method_label(config)
    assert label == spec.report_name or spec.name == "online_lora", label
  assert reporting.method_label({"method": "slda"}) == "SLDA"
  assert reporting.method_label({"method": "er", "er.trainable": "head"}) == "ER (head)"
  assert reporting.method_label({"method": "inflora", "inflora.trainable": "lora"}) == "InfLoRA"
  # APER (SimpleCIL with a first phase), with the first-phase keys off the authors' reading.
  aper = {"method": "simplecil", "simplecil.first_phase": "lora", "boundaries.rule": "oracle"}
  assert reporting.method_label(aper) == "APER (lora) [oracle boundaries]"
  assert reporting.method_label({**aper, "simplecil.first_phase_head": "linear",
                                 "simplecil.first_phase_optimizer": "adam"}) == (
      "APER (lora, linear head, adam) [oracle boundaries]")
  order = sorted(["SLDA", "APER (all)", "SimpleCIL"], key=reporting._row_order)
  assert order == ["SimpleCIL", "APER (all)", "SLDA"]


def test_paper_layouts_from_a_sweep_tree(tmp_path):
  root = tmp_path / "root"
  for seed in (0, 1):
    m = f"stream{seed}"
    for method, a_final in (("pcr", 0.40 + 0.02 * seed), ("lode", 0.30), ("gdumb", 0.2)):
      write_method_run(root / "split_cifar100" / method / f"seed{seed}", seed, method, m, a_final,
                       passes=70.0 + seed if method == "pcr" else None)
    write_method_run(root / "si_blurry_cifar100" / "online_lora" / f"seed{seed}", seed,
                     "online_lora", "blurry" + m, 0.6, data__scenario="si_blurry",
                     data__n_tasks=5, learner__hard_loss=False)
  os.makedirs(root / "split_cifar100" / "er" / "seed0")  # a run the sweep has not finished
  (root / "split_cifar100" / "er" / "seed0" / "config.json").write_text("{}")
  finished, unfinished = reporting.find_runs([str(root)])
  assert len(finished) == 8 and unfinished == [str(root / "split_cifar100" / "er" / "seed0")]
  with pytest.raises(FileNotFoundError, match="not a finished run"):  # given by name: refused
    reporting.find_runs([str(root / "split_cifar100" / "er" / "seed0")])
  rows, table = reporting.layout_table(finished, "table1")
  assert [r["method"] for r in rows] == ["GDumb", "PCR", "LODE (DER++)"]  # Table 1's order
  assert table.startswith("Table 1: disjoint class-incremental")
  setting = "cifar100 disjoint/10 vit_b16"  # the paper's setting: its numbers join each metric
  assert (f"| method | {setting} ||||||\n|---|---|---|---|---|---|---|\n| | A_final ↑ | (paper) |"
          " Forgetting ↓ | (paper) | wall time (s) |" in table)  # the paper reports no wall time
  assert "| PCR | 41.00 ± 1.41 | 48.48 ± 0.15 | 10.00 ± 0.00 | 46.23 ± 1.29 | " in table
  # The budget column: image passes per step from each run's compute ledger, not x 100.
  assert " wall time (s) | budget (passes/step) |" in table
  assert "| 10.00 ± 0.00 | 70.50 ± 0.71 |" in table and table.count("| n/a |") == 2
  assert "| GDumb | 20.00 ± 0.00 | 41.00 ± 19.97 | 10.00 ± 0.00 |  | " in table  # paper: "-"
  rows, table = reporting.layout_table(finished, "table2")
  assert [r["method"] for r in rows] == ["Online-LoRA w/o hard loss"]
  setting = "cifar100 si_blurry/5 vit_b16"
  assert (f"| method | {setting} ||||||\n|---|---|---|---|---|---|---|\n| | A_auc ↑ | (paper) |"
          " A_final ↑ | (paper) | wall time (s) |" in table)
  assert "| Online-LoRA w/o hard loss | 50.00 ± 0.00 | 60.12 ± 5.79 | 60.00 ± 0.00 |" in table
  # Runs of one setting and seed on different streams are refused by both layouts.
  write_method_run(root / "split_cifar100" / "mir" / "seed1", 1, "mir", "other", 0.5)
  finished, _ = reporting.find_runs([str(root)])
  for layout in ("table1", "table2"):
    with pytest.raises(ValueError, match="different streams"):
      reporting.layout_table(finished, layout)
  with pytest.raises(ValueError, match="unknown layout 'table3'"):
    reporting.layout_table(finished, "table3")
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no run"):
    reporting.find_runs([str(tmp_path / "empty")])
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    reporting.find_runs([str(tmp_path / "missing")])


def test_sweep_runs_skips_and_fills_a_table(tmp_path):
  root = str(tmp_path / "sweep")
  command = [sys.executable, str(ROOT / "launch" / "sweep.py"), f"--root={root}",
             "--settings=configs/tiny.py", "--methods=finetune", "--seeds=0", "--",
             "--config.data.test_fraction=0.7", "--config.eval.write_plots=False"]
  proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  workdir = os.path.join(root, "tiny", "finetune", "seed0")
  assert os.path.isfile(os.path.join(workdir, "results.json"))
  again = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert again.returncode == 0 and f"{workdir}: finished, skipped" in again.stdout
  # Another seed would run (or resume) with the same command line but its seed and workdir.
  dry = subprocess.run([*command[:5], "--seeds=0,1", "--dry_run", *command[6:]],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert dry.returncode == 0
  # The cells' trackers' group and store are the sweep's (olora_jax/loggers.py).
  assert (f"--workdir={os.path.join(root, 'tiny', 'finetune', 'seed1')} --config.method=finetune"
          f" --config.seed=1 --config.logger_group=sweep --config.logger_dir={root}"
          " --config.data.test_fraction=0.7" in dry.stdout), dry.stdout
  bad = subprocess.run([*command[:4], "--methods=nope"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
  assert bad.returncode == 2 and "unknown method='nope'" in bad.stderr
  report = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), "--layout=table1",
                           root, f"--csv={tmp_path / 't.csv'}"], capture_output=True, text=True,
                          timeout=120)
  assert report.returncode == 0, report.stderr
  assert "| Fine-tuning [^unchecked] | " in report.stdout  # not checked: its footnote says so
  assert "sklearn_digits disjoint/5 custom" in report.stdout
  none = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), "--layout=table2",
                         root, f"--csv={tmp_path / 't.csv'}"], capture_output=True, text=True,
                        timeout=120)
  assert none.returncode == 2 and "no run with data.scenario in ('si_blurry',)" in none.stderr


def test_sweep_tune_picks_the_best_validation_point(tmp_path):
  # The pick: the highest score, the first on a tie, a failed point (None) never.
  a, b, c = {"learning_rate": 1e-3}, {"learning_rate": 1e-2}, {"learning_rate": 1e-1}
  assert plan.pick([(a, 0.5), (b, 0.7), (c, 0.7)]) == b
  assert plan.pick([(a, None), (b, 0.1)]) == b
  assert plan.grid_points({"weight_decay": [0.0], "learning_rate": [1, 2]}) == [
      {"learning_rate": 1, "weight_decay": 0.0}, {"learning_rate": 2, "weight_decay": 0.0}]
  # End to end on a tiny grid: the validation runs hold out part of the training split, the
  # point with the best validation A_final is recorded and the test seed runs with it.
  root = str(tmp_path / "tune")
  command = [sys.executable, str(ROOT / "launch" / "sweep.py"), f"--root={root}",
             "--settings=configs/tiny.py", "--methods=finetune", "--seeds=0", "--tune", "--dry_run",
             "--grid=learning_rate=1e-7,3e-3", "--", "--config.data.test_fraction=0.7",
             "--config.eval.write_plots=False"]
  # First the validation runs alone (no test seed), then a dry run prints the seed's command.
  tune_only = [{"--seeds=0": "--seeds="}.get(a, a) for a in command if a != "--dry_run"]
  proc = subprocess.run(tune_only, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  method_dir = os.path.join(root, "tiny", "finetune")
  with open(os.path.join(method_dir, "tuning.json")) as f:
    record = json.load(f)
  scores = []
  for entry in record["scores"]:
    workdir = os.path.join(method_dir, "tune", f"lr{entry['point']['learning_rate']:g}")
    with open(os.path.join(workdir, "results.json")) as f:
      assert entry["score"] == json.load(f)["A_final"]
    with open(os.path.join(workdir, "stream_manifest.json")) as f:
      manifest = json.load(f)
    trained = {i for step in manifest["steps"] for i in step}
    assert trained.isdisjoint(manifest["test"]["ids"])  # scored on held-out training data
    scores.append(entry["score"])
  assert scores[0] != scores[1]
  assert record["chosen"] == record["scores"][int(np.argmax(scores))]["point"]
  # The test seed runs with the picked value, on the test set (a dry run prints its command).
  seed_command = next(line for line in proc.stdout.splitlines()
                      if "--workdir=" + os.path.join(method_dir, "seed0") in line)
  picked = record["chosen"]["learning_rate"]
  assert seed_command.endswith(f"--config.finetune.learning_rate={picked!r}")
  assert "validation_fraction" not in seed_command


def _latex_fixture(tmp_path):
  """Runs of three methods and the upper bound on the paper's Table 1 setting, two seeds, plus
  ER on a reversed class order: the rows of `--layout table1`."""
  dirs = []
  for seed in (0, 1):
    m = f"stream{seed}"
    dirs += [write_method_run(tmp_path / f"iid{seed}", seed, "iid", m, 0.9, wall=5.0 + seed),
             write_method_run(tmp_path / f"er{seed}", seed, "er", m, 0.4 + 0.1 * seed),
             write_method_run(tmp_path / f"gd{seed}", seed, "gdumb", m, 0.3),
             write_method_run(tmp_path / f"agem{seed}", seed, "agem", m, 0.45),
             write_method_run(tmp_path / f"rev{seed}", seed, "er", "r" + m, 0.5 - 0.1 * seed,
                              data__class_order=list(range(99, -1, -1)))]
  return dirs


def _latex_cells(line: str) -> list[str]:
  return [c.strip() for c in re.split(r"(?<!\\)&", line.removesuffix(r"\\").strip())]


def test_latex_table_structure(tmp_path):
  """`--format latex`: a booktabs table whose settings head their columns once (multicolumn,
  cmidrule), one row per method with as many cells as columns, mean \\pm std, the best mean of
  each metric column in bold among the methods (the upper bound is a reference, never bold),
  text escaped; the paper's layout keeps its "(paper)" columns. (Compiled by pdflatex in
  test_latex_table_compiles where one is installed.)"""
  dirs = _latex_fixture(tmp_path)
  rows, tex = reporting.layout_table(dirs, "table1", "latex")
  lines = tex.splitlines()
  assert lines[:2] == [r"\begin{table}[t]", r"\centering"]  # the table alone: notes on stderr
  assert lines[3] == r"\label{tab:table1}"
  assert [line for line in lines if line in (r"\toprule", r"\midrule", r"\bottomrule")] == [
      r"\toprule", r"\midrule", r"\bottomrule"]
  assert lines[-3:] == [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
  assert r"\caption{Table 1: disjoint class-incremental. Mean $\pm$ std over 2 seeds" in tex
  spec = re.search(r"\\begin\{tabular\}\{@\{\}l(c+)@\{\}\}", tex).group(1)
  top = lines.index(r"\toprule")
  settings, rules, header = lines[top + 1], lines[top + 2], lines[top + 3]
  spans = re.findall(r"\\multicolumn\{(\d+)\}\{c\}\{([^}]*(?:\}[^}&]*)*)\}", settings)
  # Table 1's setting (with the paper's columns) and the reversed order, each named once, by
  # the title a reader understands.
  assert [name for _, name in spans] == [
      r"cifar100: 10 disjoint tasks, vit\_b16",
      r"cifar100: 10 disjoint tasks, vit\_b16, reversed order"]
  n = [int(k) for k, _ in spans]
  assert n == [6, 4] and sum(n) == len(spec)  # A_final, (paper), Forgetting, (paper), wall, budget
  assert rules == r"\cmidrule(lr){2-7} \cmidrule(lr){8-11}"
  ours = [r"$A_\mathrm{final}$ $\uparrow$", r"Forgetting $\downarrow$", "wall time (s)",
          "budget (passes/step)"]
  assert _latex_cells(header) == ["Method", ours[0], "(paper)", ours[1], "(paper)", *ours[2:],
                                  *ours]
  body = lines[lines.index(r"\midrule") + 1:lines.index(r"\bottomrule")]
  cells = {c[0]: c[1:] for c in map(_latex_cells, body)}
  assert list(cells) == ["AGEM", "ER", "GDumb", "Upper bound (i.i.d.)"]
  assert all(len(c) == len(spec) for c in cells.values())
  # A_final: AGEM (45.00) ties ER (45.00 ± 7.07): both bold; the upper bound's 90 is not.
  assert cells["AGEM"][0] == r"{\boldmath$45.00 \pm 0.00$}"
  assert cells["ER"][0] == r"{\boldmath$45.00 \pm 7.07$}"
  assert cells["Upper bound (i.i.d.)"][0] == r"$90.00 \pm 0.00$"
  assert cells["GDumb"][0] == r"$30.00 \pm 0.00$"
  paper_er = reporting.PAPER_RESULTS["table1"]["cifar100 disjoint/10 vit_b16"]["ER"][0]
  assert cells["ER"][1] == f"${paper_er[0]:.2f} \\pm {paper_er[1]:.2f}$"  # never bold
  assert cells["ER"][4] == r"$10.00 \pm 0.00$"  # wall time: a cost, not marked
  assert cells["ER"][5] == "--"  # no budget recorded
  assert cells["ER"][6] == r"$45.00 \pm 7.07$"  # alone in its column: nothing to be best of
  assert cells["GDumb"][6:] == [""] * 4  # no run there
  # The command line prints the table alone (for `> table.tex`), its notes on stderr; names of
  # one's own head the settings, with a label of one's own.
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), "--layout=table1",
                         "--format=latex", *dirs], capture_output=True, text=True, check=True,
                        timeout=120)
  assert proc.stdout.strip() == tex
  assert r"note: the LaTeX table needs \usepackage{booktabs}" in proc.stderr
  assert "note: mean ± std (ddof 1) over 2 seeds, in %" in proc.stderr
  _, named = reporting.layout_table(dirs, "table1", "latex", label="tab:ours",
                                    setting_names=["Split CIFAR-100", "reversed (ours)"])
  assert r"\label{tab:ours}" in named
  assert r"\multicolumn{6}{c}{Split CIFAR-100} & \multicolumn{4}{c}{reversed (ours)}" in named
  with pytest.raises(ValueError, match=r"gives 1 name\(s\) for 2 setting\(s\); give one per"
                     r" setting, comma separated, in this order: cifar100 disjoint/10 vit_b16;"):
    reporting.layout_table(dirs, "table1", "latex", setting_names=["one"])
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), "--label=tab:x",
                         *dirs], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --setting_names and --label shape the LaTeX table; add --format latex")
  one_seed = [d for d in dirs if d.endswith(("er0", "agem0"))]
  tex1 = reporting.render(reporting.aggregate(one_seed), ["A_final"], "latex")
  assert "Mean $\\pm$ std over 1 seed, in" in tex1 and r"\label{tab:results}" in tex1
  assert reporting.latex_escape("a_b & 50% #1 {x} ~ ^ \\ ±") == (
      r"a\_b \& 50\% \#1 \{x\} \textasciitilde{} \textasciicircum{} \textbackslash{} $\pm$")


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (.ci/run"
                    " installs Debian's texlive-latex-base and -recommended); the table's"
                    " structure is tested in test_latex_table_structure")
def test_latex_table_compiles(tmp_path):
  """The table as report.py prints it goes into a paper as it is: `\\input` after
  `\\usepackage{booktabs}`, and `\\ref` finds its label."""
  _, tex = reporting.layout_table(_latex_fixture(tmp_path), "table1", "latex")
  (tmp_path / "table1.tex").write_text(tex + "\n")
  (tmp_path / "t.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n"
                                  "\\begin{document}\n\\input{table1}\nSee Table~\\ref{tab:table1}."
                                  "\n\\end{document}\n")
  for _ in range(2):  # the second pass resolves the \ref
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "t.tex"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
  assert (tmp_path / "t.pdf").read_bytes()[:5] == b"%PDF-"
  assert "undefined" not in (tmp_path / "t.log").read_text(errors="replace").lower()


def test_accuracy_matrices_leave_no_panel_empty_and_print_at_paper_size(tmp_path):
  """Five methods: 3 panels over 2 (the last row centred), every axes of the figure a matrix or
  its colour bar (none switched off); the figure at most a paper's text width, its text 6-8 pt,
  the cells' values written where a cell holds them (5 tasks) and left out where it cannot (20)."""
  from matplotlib.text import Text

  def rows_of(n_tasks, sub):
    acc = (np.tril(np.ones((n_tasks, n_tasks))) * 0.5).T.tolist()
    dirs = [write_method_run(tmp_path / sub / m, 0, m, "s", 0.5, data__n_tasks=n_tasks)
            for m in ("er", "agem", "gdumb", "mir", "der_pp")]
    for d in dirs:
      results = json.loads(pathlib.Path(d, "results.json").read_text())
      pathlib.Path(d, "results.json").write_text(json.dumps({**results, "acc_matrix": acc}))
    return reporting.aggregate(dirs)

  # 5 tasks: 3 panels a row at most (a cell wide enough for its value), balanced.
  assert plots.matrix_grid(5, 5) == (2, 3) and plots.matrix_grid(4, 5) == (2, 2)
  assert plots.matrix_grid(7, 5) == (3, 3) and plots.matrix_grid(3, 20) == (3, 1)
  fig = plots.accuracy_matrices_figure(rows_of(5, "five"))
  panels = [ax for ax in fig.axes if ax.get_images()]
  assert len(panels) == 5 and len(fig.axes) == 6  # 5 matrices and the colour bar
  assert all(ax.axison for ax in fig.axes)
  boxes = sorted((round(ax.get_position().y0, 3), ax.get_position().x0) for ax in panels)
  top = [b for b in boxes if b[0] == boxes[-1][0]]
  bottom = [b for b in boxes if b[0] == boxes[0][0]]
  assert len(top) == 3 and len(bottom) == 2
  # The short row is centred between the top row's outer panels (within a quarter panel).
  width = panels[0].get_position().width
  centre = lambda row: np.mean([x for _, x in row])  # noqa: E731
  assert abs(centre(top) - centre(bottom)) < width / 4
  assert fig.get_size_inches()[0] <= plots.TEXT_WIDTH_IN
  sizes = {t.get_fontsize() for t in fig.findobj(Text) if t.get_text()}
  assert min(sizes) >= 6 and max(sizes) <= 8
  assert any(t.get_text() == "50.0" for t in panels[0].texts)
  big = plots.accuracy_matrices_figure(rows_of(20, "twenty"), titles=False)
  assert all(not ax.texts for ax in big.axes if ax.get_images())
  assert big.get_size_inches()[0] <= plots.TEXT_WIDTH_IN


def test_report_figures_of_a_paper(tmp_path):
  """`write_report_plots`: each method's final accuracy matrix (mean over seeds, titled by the
  method's display name) and the forgetting of each earlier task (bar = mean over seeds, error
  bar = std, ddof 1), as the Forgetting column computes it; `titles=False` drops the figure
  titles (a panel keeps its setting only where several panels need telling apart)."""
  def run(name, seed, acc, **overrides):
    results = {"A_final": 0.5, "forgetting": 0.1, "A_auc": 0.5,
               "anytime_samples": [100, 200, 300], "anytime_accuracy": [0.9, 0.7, 0.6],
               "acc_matrix": acc}
    return write_run(tmp_path / name, seed, results, **overrides)

  accs = {("olora", 0): [[0.9, 0.7, 0.6], [0.0, 0.8, 0.7], [0, 0, 0.9]],
          ("olora", 1): [[0.8, 0.8, 0.4], [0.0, 0.9, 0.9], [0, 0, 0.7]],
          ("lora", 0): [[0.9, 0.2, 0.1], [0.0, 0.9, 0.3], [0, 0, 0.9]]}
  dirs = [run(f"{m}{s}", s, acc, **({} if m == "olora" else {
      "learner__incremental_lora": False, "learner__hard_loss": False}))
          for (m, s), acc in accs.items()]
  rows = reporting.aggregate(dirs)
  fig = plots.forgetting_figure(rows)
  (ax,) = fig.axes
  from matplotlib.container import BarContainer

  bar_containers = [c for c in ax.containers if isinstance(c, BarContainer)]
  bars = {c.get_label(): [p.get_height() for p in c.patches] for c in bar_containers}
  per_task = {k: metrics.forgetting_per_task(np.asarray(a)) for k, a in accs.items()}
  np.testing.assert_allclose(
      bars["Online-LoRA (2 seeds)"],
      100 * np.mean([per_task[("olora", 0)], per_task[("olora", 1)]], axis=0), rtol=1e-12)
  np.testing.assert_allclose(bars["single LoRA (1 seed)"], 100 * per_task[("lora", 0)],
                             rtol=1e-12)
  # Their mean over tasks is the Forgetting column's definition.
  assert np.mean(per_task[("lora", 0)]) == pytest.approx(metrics.forgetting(accs[("lora", 0)]))
  whiskers = [c for c in bar_containers if c.get_label() == "Online-LoRA (2 seeds)"][0].errorbar
  segments = whiskers.lines[2][0].get_segments()
  np.testing.assert_allclose([s[1, 1] - s[0, 1] for s in segments], 2 * 100 * np.std(
      [per_task[("olora", 0)], per_task[("olora", 1)]], axis=0, ddof=1), rtol=1e-9)
  assert fig.get_suptitle().startswith("Forgetting per task")
  assert plots.forgetting_figure(rows, titles=False).get_suptitle() == ""

  fig = plots.accuracy_matrices_figure(rows)
  panels = [ax for ax in fig.axes if ax.get_images()]
  assert [ax.get_title() for ax in panels] == ["Online-LoRA (2 seeds)", "single LoRA (1 seed)"]
  np.testing.assert_allclose(panels[0].get_images()[0].get_array(),
                             100 * np.mean([accs[("olora", 0)], accs[("olora", 1)]], axis=0))
  assert "cifar100: 10 disjoint tasks" in fig.get_suptitle()
  assert plots.accuracy_matrices_figure(rows, titles=False).get_suptitle() == ""
  overlay = plots.overlay_figure(rows, titles=False)
  assert overlay.get_suptitle() == "" and overlay.axes[0].get_title() == ""
  # A one-task setting has no forgetting: no figure of it.
  one = [run(f"one{s}", s, [[0.5]], data__n_tasks=1) for s in (0, 1)]
  names = [os.path.basename(p) for p in plots.write_report_plots(
      reporting.aggregate(one), str(tmp_path / "figs"), titles=False)]
  assert names == [plots.OVERLAY_FILE, "accuracy_matrices_cifar100_disjoint_1_vit_b16.png"]
