"""The run log's mirrors (`olora_jax.loggers`): the `loggers` key, what each logger receives (the
numeric scalars of every metrics.jsonl line), a failing logger switched off without stopping the
run, and Weights & Biases (offline mode) and MLflow (a local file store) end to end, skipped
where their packages are not installed (`pip install 'olora-jax[wandb]'`, `'[mlflow]'`)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

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
  real = validation.importlib.util.find_spec
  monkeypatch.setattr(validation.importlib.util, "find_spec",
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

    def _has_run(self):
      return hasattr(self, "finished")

    def _log(self, tagged, samples_seen):
      raise OSError("disk full")

    def _finish(self, status):
      self.finished = status

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
                      " every scalar; the Failing run is marked FAILED"]
  assert not bad.active and bad.finished == "FAILED"
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


# A finished run's files as the trackers find them: results.json with an accuracy matrix and
# nested records, a figure, an export, and an export write's leftover (never sent).
RESULTS = {"A_final": 0.5, "forgetting": 0.25, "A_auc": 0.625, "n_plateaus": 2,
           "acc_matrix": [[1.0, 0.5], [0.0, 0.75]], "samples_seen": 64, "fidelity": "paper",
           "acc_matrix_task_il": [[1.0, 0.5], [0.5, 1.0]],
           "compute": {"step_seconds": 1.5, "device": "cpu"},
           "plateau_detection": {"recall": None, "n_plateaus": 2}}
FILES = ["config.json", "results.json", "metrics.jsonl", "plots/accuracy_matrix.png",
         "export/task_1.npz"]


def finished_run(workdir, config):
  """The run log of `config` written and closed as the trainer does: the lines, metrics.jsonl
  closed, the results to the trackers, then the trackers closed."""
  for name in FILES:
    (workdir / name).parent.mkdir(parents=True, exist_ok=True)
    (workdir / name).write_text(json.dumps(RESULTS) if name == "results.json" else name)
  (workdir / "export" / "task_2.npz.123.tmp").write_text("a cut write")
  log = runlog.RunLog(str(workdir / "metrics.jsonl"), loggers.make_mirrors(str(workdir), config))
  log.write("train", 0, 16, loss=2.0)
  log.close_file()
  log.summarize(RESULTS, str(workdir))
  log.close()


def test_the_results_a_tracker_gets():
  """results.json's numbers (one level of records down), the matrix's table, the files (no
  leftover `.tmp`), and the params: the common keys and the run's own method block only."""
  assert loggers.results_summary(RESULTS) == {
      "A_final": 0.5, "forgetting": 0.25, "A_auc": 0.625, "n_plateaus": 2.0,
      "samples_seen": 64.0, "compute/step_seconds": 1.5, "plateau_detection/n_plateaus": 2.0}
  assert loggers.accuracy_table(RESULTS["acc_matrix"]) == (
      ["evaluated on task i", "after task 0", "after task 1"], [[0, 1.0, 0.5], [1, 0.0, 0.75]])
  flat = validation.flatten({**CONFIG, "er": {"learning_rate": 0.1}, "mir": {"k": 1},
                             "learner": {"rank": 4}})
  assert loggers.run_params(flat) == {k: v for k, v in flat.items() if not k.startswith("mir.")}
  online = validation.flatten({**CONFIG, "method": "online_lora", "er": {"learning_rate": 0.1},
                               "learner": {"rank": 4}})
  assert set(loggers.run_params(online)) == set(online) - {"er.learning_rate"}


def wandb_records(path):
  """The protobuf records of a W&B run file (its LevelDB-style log: a 7-byte header, then
  32 KiB blocks of chunks, each with a 7-byte header: checksum, length, type FULL=1 FIRST=2
  MIDDLE=3 LAST=4)."""
  import struct

  from wandb.proto import wandb_internal_pb2

  data, block, pos, pending, out = path.read_bytes(), 32768, 7, b"", []
  assert data[:4] == b":W&B"
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      out.append(record)
      pending = b""
  return out


def test_wandb_gets_the_results_summary_matrix_and_files(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = {**CONFIG, "loggers": "wandb", "logger_group": "sweep-a", "mir": {"k": 1}}
  finished_run(tmp_path, config)
  wandb.teardown()
  run_id = json.loads((tmp_path / loggers.IDS_FILE).read_text())["wandb"]
  (run_file,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
  records = wandb_records(run_file)
  summary = {}
  for r in records:
    if r.WhichOneof("record_type") == "summary":
      summary.update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
  expected = loggers.results_summary(RESULTS)
  assert {k: summary[k] for k in expected} == expected  # the summary values are results.json's
  (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
  assert run.run_group == "sweep-a"
  assert {i.key for i in run.config.update} >= {"seed", "method"}
  assert not any(i.key.startswith("mir") for i in run.config.update)  # another method's block
  artifacts = {r.artifact.type: r.artifact for r in records
               if r.WhichOneof("record_type") == "artifact"}
  assert sorted(e.path for e in artifacts["run-files"].manifest.contents) == sorted(FILES)
  assert "run_table" in artifacts  # the accuracy matrix, a W&B Table
  tables = f"offline-run-*-{run_id}/files/media/table/"
  (table,) = (tmp_path / "wandb").glob(tables + "acc_matrix_[0-9]*")
  assert json.loads(table.read_text())["data"] == [[0, 1.0, 0.5], [1, 0.0, 0.75]]
  (table,) = (tmp_path / "wandb").glob(tables + "acc_matrix_task_il*")
  assert json.loads(table.read_text())["data"] == [[0, 1.0, 0.5], [1, 0.5, 1.0]]


def test_mlflow_gets_the_results_and_a_sweep_shares_one_store(tmp_path, monkeypatch):
  pytest.importorskip("mlflow")
  from mlflow.tracking import MlflowClient

  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
  root = tmp_path / "sweep-a"
  for seed in (0, 1):  # two cells of one sweep: launch/sweep.py's logger keys
    cell = root / "demo" / "er" / f"seed{seed}"
    cell.mkdir(parents=True)
    finished_run(cell, {**CONFIG, "seed": seed, "loggers": "mlflow", "mir": {"k": 1},
                        "logger_group": "sweep-a", "logger_dir": str(root)})
  assert not list(root.glob("demo/er/*/mlruns"))  # no store of a cell's own
  client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
  (experiment,) = [e for e in client.search_experiments() if e.name == "olora-jax"]
  runs = client.search_runs([experiment.experiment_id])
  assert len(runs) == 2 and {r.data.tags["group"] for r in runs} == {"sweep-a"}
  for run in runs:
    expected = loggers.results_summary(RESULTS)
    assert {k: run.data.metrics[k] for k in expected} == expected
    assert not any(k.startswith("mir.") for k in run.data.params)
    assert run.data.params["seed"] in ("0", "1")
    listed = {a.path for a in client.list_artifacts(run.info.run_id)}
    listed |= {a.path for folder in ("plots", "export")
               for a in client.list_artifacts(run.info.run_id, folder)}
    assert listed >= set(FILES) | {"acc_matrix.csv"} and "export/task_2.npz.123.tmp" not in listed
    matrix = client.download_artifacts(run.info.run_id, "acc_matrix.csv", str(tmp_path))
    assert open(matrix).read().splitlines() == [
        "evaluated on task i,after task 0,after task 1", "0,1.0,0.5", "1,0.0,0.75"]
    matrix = client.download_artifacts(run.info.run_id, "acc_matrix_task_il.csv", str(tmp_path))
    assert open(matrix).read().splitlines()[1:] == ["0,1.0,0.5", "1,0.5,1.0"]


def _mlflow_run(workdir):
  from mlflow.tracking import MlflowClient

  client = MlflowClient(tracking_uri=(workdir / "mlruns").as_uri())
  return client, client.get_run(json.loads((workdir / loggers.IDS_FILE).read_text())["mlflow"])


def test_a_second_signal_during_the_mlflow_upload_stops_it_cleanly_and_a_rerun_sends_it(
    tmp_path, monkeypatch):
  """A second SIGTERM during the final artifact upload once ended the process at once (exit 143
  "run the same command to resume"): the store kept a staged `.artifact.uploading.*` file and
  no exports, the MLflow run stayed RUNNING, and the rerun said "nothing ran". Now the upload
  stops from the main thread: MLflow removes its staged copy, the run is marked KILLED, the
  workdir's files are untouched, and the rerun's `send_unsent` completes the upload (FINISHED)."""
  pytest.importorskip("mlflow")
  import os
  import signal

  from mlflow.store.artifact import local_artifact_repo

  from olora_jax import errors

  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  monkeypatch.setattr(errors, "SAME_STOP_SECONDS", 0.0)
  config = {**CONFIG, "loggers": "mlflow"}
  for name in FILES:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(json.dumps(RESULTS) if name == "results.json" else name * 1000)
  log = runlog.RunLog(str(tmp_path / "metrics.jsonl"), loggers.make_mirrors(str(tmp_path), config))
  log.write("train", 0, 16, loss=2.0)
  log.close_file()
  before = {name: (tmp_path / name).read_bytes() for name in FILES}
  real_copy = local_artifact_repo.shutil.copyfileobj

  def signalled_copy(source, target, length=0):  # two signals half way through the export
    target.write(source.read(10))
    if source.name.endswith("task_1.npz"):
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGTERM)
    real_copy(source, target)

  monkeypatch.setattr(local_artifact_repo.shutil, "copyfileobj", signalled_copy)
  heard = []

  def recorder(signum, frame):  # the handler outside the upload (launch/run.py's records them)
    heard.append(signum)

  outside = signal.signal(signal.SIGTERM, recorder)
  try:
    with pytest.raises(errors.Preempted) as stop:
      log.summarize(RESULTS, str(tmp_path))
    log.close()
    assert signal.getsignal(signal.SIGTERM) is recorder  # given back
  finally:
    signal.signal(signal.SIGTERM, outside)
  assert stop.value.exit_code == 143
  assert str(stop.value) == (
      f"stopped by a second signal 15 while the finished run's results were sent to MLflow;"
      f" results.json and the run's own files in {tmp_path} are whole; the MLflow run is marked"
      " KILLED: run the same command to send them")
  assert heard == [] and not loggers.UPLOADING[0]
  client, run = _mlflow_run(tmp_path)
  assert run.info.status == "KILLED"
  assert not list((tmp_path / "mlruns").rglob(loggers.MLFLOW_STAGING_PREFIX + "*"))
  assert client.list_artifacts(run.info.run_id, "export") == []  # the export cut: not there
  assert {name: (tmp_path / name).read_bytes() for name in FILES} == before
  assert json.loads((tmp_path / loggers.IDS_FILE).read_text())[loggers.UNSENT] == ["mlflow"]
  # The rerun of the finished run: a staged file a SIGKILL would have left goes too.
  monkeypatch.setattr(local_artifact_repo.shutil, "copyfileobj", real_copy)
  staged = tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts" / (
      loggers.MLFLOW_STAGING_PREFIX + "x")
  staged.parent.mkdir(parents=True, exist_ok=True)
  staged.write_text("cut")
  assert loggers.send_unsent(str(tmp_path), config) == ["MLflow"]
  client, run = _mlflow_run(tmp_path)
  assert run.info.status == "FINISHED" and not staged.exists()
  listed = {a.path for folder in ("", "export") for a in client.list_artifacts(run.info.run_id,
                                                                              folder or None)}
  assert "export/task_1.npz" in listed and "results.json" in listed
  assert json.loads((tmp_path / loggers.IDS_FILE).read_text())[loggers.UNSENT] == []
  assert loggers.send_unsent(str(tmp_path), config) == []  # nothing more to send


@pytest.mark.parametrize("error, status", [
    (ValueError("a bug"), "FAILED"), (None, "KILLED")], ids=["failed", "stopped"])
def test_a_run_that_fails_or_stops_is_not_marked_finished(tmp_path, monkeypatch, error, status):
  """The trackers' runs were marked FINISHED however the run ended (its files are closed as the
  error goes up): a failed run is FAILED, a stopped one KILLED, until a resume."""
  pytest.importorskip("mlflow")
  import contextlib

  from olora_jax import errors

  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  error = error or errors.Preempted(15, "stopped by signal 15")
  log = runlog.RunLog(str(tmp_path / "metrics.jsonl"),
                      loggers.make_mirrors(str(tmp_path), {**CONFIG, "loggers": "mlflow"}))
  with pytest.raises(type(error)), contextlib.closing(log):  # as trainer.py closes it
    log.write("train", 0, 16, loss=2.0)
    raise error
  assert _mlflow_run(tmp_path)[1].info.status == status


def test_a_store_that_cannot_be_written_is_said_truthfully(tmp_path, monkeypatch, caplog):
  """A read-only MLflow store mid-run gave one warning and left its run RUNNING unsaid."""
  pytest.importorskip("mlflow")
  from mlflow.tracking import MlflowClient

  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  mirrors = loggers.make_mirrors(str(tmp_path), {**CONFIG, "loggers": "mlflow"})

  def read_only(*args, **kwargs):
    raise PermissionError(13, "Permission denied")

  monkeypatch.setattr(MlflowClient, "log_batch", read_only)
  monkeypatch.setattr(MlflowClient, "set_terminated", read_only)
  with caplog.at_level("WARNING"):
    mirrors.write("train", 16, {"loss": 2.0})
  (writer,) = mirrors.writers
  assert [r.getMessage() for r in caplog.records] == [
      "MLflow mirror switched off (PermissionError: [Errno 13] Permission denied); metrics.jsonl"
      " still has every scalar; the MLflow run could not be marked FAILED (PermissionError:"
      " [Errno 13] Permission denied): it stays RUNNING in its store"]
  assert not writer.active


def test_a_run_sends_its_results_json_to_mlflow(tmp_path, monkeypatch, compilation_cache):
  """Through the command line: the trainer sends results.json's numbers and files once the run
  has written them (the tiny stream; its programs come from the session's compilation cache)."""
  pytest.importorskip("mlflow")
  import tiny_run
  from mlflow.tracking import MlflowClient

  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  # The reading client below opens the file store too (alone, no other test has allowed it).
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  workdir = tmp_path / "run"
  done = tiny_run.run(workdir, compilation_cache, "--config.loggers=mlflow")
  assert done.returncode == 0, done.stderr[-2000:]
  results = json.loads((workdir / "results.json").read_text())
  client = MlflowClient(tracking_uri=(workdir / "mlruns").as_uri())
  run = client.get_run(json.loads((workdir / loggers.IDS_FILE).read_text())["mlflow"])
  assert run.info.status == "FINISHED"
  expected = loggers.results_summary(results)
  assert expected["A_final"] == results["A_final"] and expected["n_plateaus"] == 4
  assert expected["A_final_task_il"] == results["A_final_task_il"]  # the tiny stream: disjoint
  assert {k: run.data.metrics[k] for k in expected} == pytest.approx(expected, rel=1e-12)
  listed = {a.path for a in client.list_artifacts(run.info.run_id)}
  assert {"results.json", "metrics.jsonl", "config.json", "acc_matrix.csv"} <= listed


UI_ENV = Path(__file__).resolve().parents[1] / ".venv-mlflow-ui"  # the docs' UI environment


def _pins(name: str) -> dict[str, str]:
  lines = (Path(__file__).resolve().parents[1] / name).read_text().splitlines()
  return dict(line.lower().split("==") for line in lines if line and not line.startswith("#"))


def test_the_documented_mlflow_ui_install_has_the_server():
  """`mlflow ui` is the full `mlflow` package's (the extra's mlflow-skinny has no flask): the
  docs name its own environment, pinned at the trackers' client version; where that
  environment is installed, its mlflow has the UI's server and page, and `mlflow ui` starts."""
  ui, trackers = _pins("constraints-mlflow-ui.txt"), _pins("constraints-trackers.txt")
  assert ui["mlflow"] == ui["mlflow-skinny"] == trackers["mlflow-skinny"]
  assert "flask" in ui and "flask" not in trackers
  command = ".venv-mlflow-ui/bin/pip install -c constraints-mlflow-ui.txt mlflow"
  outputs = (UI_ENV.parent / "docs" / "reference" / "outputs.md").read_text()
  assert command in outputs and ".venv-mlflow-ui/bin/mlflow ui --backend-store-uri" in outputs
  if not (UI_ENV / "bin" / "mlflow").exists():
    pytest.skip(f"the MLflow UI environment ({command}) is not installed")
  check = ("import os, flask, mlflow, mlflow.server\n"
           "from mlflow.server import app\n"  # the UI's Flask app: what `mlflow ui` serves
           "page = os.path.join(os.path.dirname(mlflow.server.__file__), 'js', 'build')\n"
           "assert os.path.isfile(os.path.join(page, 'index.html')), page\n"
           "print(mlflow.__version__)")
  done = subprocess.run([str(UI_ENV / "bin" / "python"), "-c", check], capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-1] == ui["mlflow"]
  done = subprocess.run([str(UI_ENV / "bin" / "mlflow"), "ui", "--help"], capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0 and "--backend-store-uri" in done.stdout, done.stderr[-2000:]
