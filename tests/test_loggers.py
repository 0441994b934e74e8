"""The run log's mirrors (`olora_jax.loggers`): the `loggers` key, what each logger receives (the
numeric scalars of every metrics.jsonl line), a failing logger switched off without stopping the
run, and Weights & Biases (offline mode) and MLflow (a local file store) end to end, skipped
where their packages are not installed (`pip install 'olora-jax[wandb]'`, `'[mlflow]'`)."""

from __future__ import annotations

import json
import math

import pytest

from configs import tiny
from olora_jax import loggers, runlog, validation

CONFIG = {"seed": 2, "method": "er", "model": {"name": "custom"},
          "data": {"dataset": "mnist_5k", "scenario": "disjoint", "n_tasks": 5}}
LINES = [("train", 0, 16, {"loss": 2.5, "lr": 1e-3, "skipped": False, "note": "x", "w": None}),
         ("train", 1, 32, {"loss": 2.0, "inf": math.inf}),
         ("eval", 1, 32, {"anytime_accuracy": 0.625, "n_seen_classes": 2})]


class Recorder:
  def __init__(self, fail_at: int | None = None):
    self.calls, self.closed, self.fail_at = [], False, fail_at

  def write(self, event, samples_seen, values):
    if self.fail_at is not None and len(self.calls) == self.fail_at:
      raise OSError("disk full")
    self.calls.append((event, samples_seen, values))

  def close(self):
    self.closed = True


def write_lines(log):
  for event, step, samples, values in LINES:
    log.write(event, step, samples, **values)
  log.close()


def test_the_loggers_key_is_checked_before_any_compute(monkeypatch):
  assert loggers.parse_loggers("tensorboard, wandb,,tensorboard") == ("tensorboard", "wandb")
  assert loggers.parse_loggers("") == loggers.parse_loggers("none") == ()
  assert loggers.check_loggers("tensorboard") is None and loggers.check_loggers("") is None
  assert "unknown logger(s) ['neptune']" in loggers.check_loggers("tensorboard,neptune")
  real = loggers.importlib.util.find_spec
  monkeypatch.setattr(loggers.importlib.util, "find_spec",
                      lambda name: None if name in ("wandb", "tensorboardX") else real(name))
  # Asked for and absent: one line with the install command; TensorBoard stays optional.
  assert loggers.check_loggers("tensorboard,wandb") == (
      "loggers='tensorboard,wandb' names wandb, but wandb is not installed: pip install"
      " 'olora-jax[wandb]' (or leave wandb out of --config.loggers)")
  config = tiny.get_config()
  config.loggers = "wandb"
  with pytest.raises(validation.InputError, match=r"pip install 'olora-jax\[wandb\]'"):
    validation.check_config(config, config.model.width)
  config.loggers, config.logger_project = "", " "
  with pytest.raises(validation.InputError, match="logger_project=' ' must name"):
    validation.check_config(config, config.model.width)


def test_every_logger_gets_each_line_and_a_failing_one_is_switched_off(tmp_path, caplog):
  class Failing(loggers._Mirror):
    label = "Failing"

    def _start(self, *args):
      self.finished = None

    def _log(self, tagged, samples_seen):
      raise OSError("disk full")

    def _finish(self, failed):
      self.finished = "failed" if failed else "ok"

  good, bad = Recorder(), Failing(str(tmp_path), "p", "name", {})
  log = runlog.RunLog(str(tmp_path / "metrics.jsonl"), loggers.Mirrors([good, None, bad]))
  with caplog.at_level("WARNING"):
    write_lines(log)
  # Each logger gets every line of metrics.jsonl, as written there.
  written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(e, s, v) for e, s, v in good.calls] == [(r["event"], r["samples_seen"], r)
                                                  for r in written]
  assert good.closed
  warnings = [r.getMessage() for r in caplog.records]
  assert warnings == ["Failing mirror switched off (OSError: disk full); metrics.jsonl still has"
                      " every scalar"]
  assert not bad.active and bad.finished == "failed"
  # One that fails to start is off from the start, with the same one warning.
  caplog.clear()
  with caplog.at_level("WARNING"):
    broken = type("Broken", (Failing,), {"_start": lambda self, *a: 1 / 0})(
        str(tmp_path), "p", "name", {})
  assert not broken.active and [r.getMessage() for r in caplog.records] == [
      "Failing mirror switched off (ZeroDivisionError: division by zero); metrics.jsonl still"
      " has every scalar"]
  assert loggers.make_mirrors(str(tmp_path), {"loggers": ""}) is None
  # The tags and values a logger sends: finite numbers, not booleans, strings or the step.
  assert loggers.scalars(written[0]) == {"step": 0.0, "samples_seen": 16.0, "loss": 2.5,
                                         "lr": 1e-3}


def test_mlflow_local_file_store_gets_every_scalar_and_a_resume_goes_on(tmp_path, monkeypatch):
  pytest.importorskip("mlflow")
  from mlflow.tracking import MlflowClient

  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
  config = {**CONFIG, "loggers": "mlflow", "logger_project": "olora-test"}
  write_lines(runlog.RunLog(str(tmp_path / "metrics.jsonl"),
                            loggers.make_mirrors(str(tmp_path), config)))
  run_id = json.loads((tmp_path / loggers.IDS_FILE).read_text())["mlflow"]
  client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
  run = client.get_run(run_id)
  assert run.info.status == "FINISHED"
  assert run.info.run_name == "ER on mnist_5k: 5 disjoint tasks, custom ViT, seed 2"
  assert run.data.params["data.dataset"] == "mnist_5k" and run.data.params["seed"] == "2"
  assert client.get_experiment(run.info.experiment_id).name == "olora-test"
  history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
  assert history("train/loss") == [(16, 2.5), (32, 2.0)]
  assert history("eval/anytime_accuracy") == [(32, 0.625)]
  assert set(run.data.metrics) == {"train/loss", "train/lr", "eval/anytime_accuracy",
                                   "eval/n_seen_classes"}
  # A resume logs into the same run.
  log = runlog.RunLog(str(tmp_path / "metrics.jsonl"), loggers.make_mirrors(str(tmp_path), config),
                      truncate_to=(tmp_path / "metrics.jsonl").stat().st_size)
  log.write("train", 2, 48, loss=1.5)
  log.close()
  assert history("train/loss") == [(16, 2.5), (32, 2.0), (48, 1.5)]
  assert client.get_run(run_id).info.status == "FINISHED"


def test_wandb_offline_run_gets_every_scalar(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = {**CONFIG, "loggers": "wandb"}
  write_lines(runlog.RunLog(str(tmp_path / "metrics.jsonl"),
                            loggers.make_mirrors(str(tmp_path), config)))
  wandb.teardown()  # W&B's service writes the run file behind the process: wait for it
  run_id = json.loads((tmp_path / loggers.IDS_FILE).read_text())["wandb"]
  (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
  # The run file holds protobuf records (no reader ships with wandb): every tag is in it, with
  # the samples_seen axis, and the run's display name and config.
  data = (run_dir / f"run-{run_id}.wandb").read_bytes()
  for text in ("train/loss", "train/lr", "eval/anytime_accuracy", "samples_seen", "0.625",
               "ER on mnist_5k: 5 disjoint tasks, custom ViT, seed 2", "mnist_5k"):
    assert text.encode() in data, text
  assert b"train/skipped" not in data and b"train/inf" not in data
  # A resume logs into the same W&B run (its id kept in the workdir).
  log = runlog.RunLog(str(tmp_path / "metrics.jsonl"), loggers.make_mirrors(str(tmp_path), config),
                      truncate_to=(tmp_path / "metrics.jsonl").stat().st_size)
  log.write("train", 2, 48, loss=1.5)
  log.close()
  wandb.teardown()
  assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
  assert json.loads((tmp_path / loggers.IDS_FILE).read_text())["wandb"] == run_id
