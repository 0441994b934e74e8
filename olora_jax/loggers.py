"""The run log's mirrors: TensorBoard, Weights & Biases and MLflow views of metrics.jsonl.

metrics.jsonl stays the source of truth; each logger the `loggers` config key names (comma
separated, default 'tensorboard'; '' for none) gets the finite numeric scalars of every line it
writes, under the tag `EVENT/KEY` (`train/loss`, `eval/anytime_accuracy`) at the number of
samples seen, the x axis of the paper's anytime-accuracy plots:

  tensorboard  event files in WORKDIR/tensorboard/ (`olora_jax.tb_writer`), when tensorboardX is
               installed (else one log line, and the run goes on without them)
  wandb        a Weights & Biases run (`pip install 'olora-jax[wandb]'`), its files in
               WORKDIR/wandb/; the x axis is the `samples_seen` metric. Where it goes is W&B's
               own setting: `wandb login` for the cloud, WANDB_MODE=offline to keep it on disk
               (`wandb sync` later), WANDB_ENTITY / WANDB_BASE_URL as W&B reads them
  mlflow       an MLflow run (`pip install 'olora-jax[mlflow]'`) in the tracking store
               MLFLOW_TRACKING_URI names (a server, or sqlite:///mlflow.db with the full
               `mlflow` package), else a local file store in WORKDIR/mlruns (MLflow 3 keeps that
               store in maintenance mode; the run sets MLFLOW_ALLOW_FILE_STORE=true for it, and
               `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri WORKDIR/mlruns` shows
               it, from the full `mlflow` package in an environment of its own: the extra's
               mlflow-skinny has no server; constraints-mlflow-ui.txt, docs/reference/outputs.md);
               the step is samples seen

Both runs are named after the method's display name, setting and seed, carry the run's
flattened config without the other methods' blocks (W&B config, MLflow params: the common keys
and the run's own method block), and live in the project (W&B) or experiment (MLflow)
`logger_project`, in the group `logger_group` (W&B's group, an MLflow tag `group`; launch/sweep.py
names its cells' group after the sweep and puts their W&B files and MLflow store in its ROOT,
`logger_dir`, so the tracker's own comparison view shows the sweep). Their ids are kept in
WORKDIR/loggers.json, so a resumed run goes on logging into the same W&B and MLflow runs; the
lines a resume writes again (those after its checkpoint) are logged again at their samples seen.
A tracker's run is ended as the run ends: FINISHED, KILLED when a signal stopped it (a resume
marks it RUNNING again), FAILED when it failed (W&B: exit code 0 or 1).

When the run ends, after results.json is written, each tracker gets its results
(`summarize`): results.json's numbers as summary values (`results_summary`: A_final,
forgetting, A_auc, A_last, F_last, backward_transfer, n_plateaus, wall_seconds, A_final_task_il
and A_auc_task_il where the run has Task-IL, ...; its records one level down as `compute/...`
(the compute ledger's totals) and `plateau_detection/...`), the final accuracy matrix as a table
(a W&B Table `acc_matrix`; MLflow: the artifact acc_matrix.csv; the Task-IL matrix likewise as
`acc_matrix_task_il`), and the run's files as artifacts (`run_files`: config.json, results.json,
metrics.jsonl, stream_manifest.json, the figures in plots/, the exports in export/ and
Online-LoRA's exported model). W&B keeps the summary values as the run's summary; MLflow as
metrics at the run's last samples seen.

Until a tracker's run is ended FINISHED after that upload, loggers.json lists it as `unsent`: a
second signal during the upload (a first lets it go on: the run has finished) stops it from the
main thread, MLflow removing its staged copy, and the tracker's run is marked KILLED
(`errors.Preempted` says so); a rerun of the finished run sends the results again
(`send_unsent`, from launch/run.py), removing a staged copy a SIGKILL left.

Like the TensorBoard mirror, no logger can stop or fail a run once it has started: the first
error of any kind switches that logger off with one warning (metrics.jsonl has every value),
which says what became of its run (marked FAILED, or left RUNNING in a store that cannot be
written). A logger the config names whose package is not installed is bad input, refused
before any compute (`check_loggers`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import numbers
import os
import signal
import sys
import threading
import time
import uuid

# The `loggers` key's vocabulary lives with the config checks (validation imports no logger).
from olora_jax import errors, plots, tb_writer, validation
from olora_jax import workdir as workdir_lib
from olora_jax.validation import LOGGERS, PACKAGES, check_loggers, parse_loggers  # noqa: F401

IDS_FILE = "loggers.json"  # the W&B and MLflow run ids, for a resume to log into the same runs
UNSENT = "unsent"  # loggers.json: the trackers that have not received the finished run's results
# True while the trackers receive a finished run's results (`Mirrors.summarize`): a second
# signal then stops the upload from the main thread (olora_jax/signal_watch.py leaves it to it).
UPLOADING = [False]
# Where MLflow's local artifact store stages a file it copies (renamed into place when whole).
MLFLOW_STAGING_PREFIX = ".artifact.uploading."


class UploadStopped(BaseException):
  """A second signal during the trackers' upload (`Mirrors.summarize`): a BaseException, so that
  no library's `except Exception` takes it, and each library's own clean-up (`finally`: MLflow's
  staged file) runs."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def scalars(values: dict) -> dict[str, float]:
  """The finite numeric, non-boolean values of a metrics.jsonl record, as floats."""
  return {k: float(v) for k, v in values.items()
          if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}


def results_summary(results: dict) -> dict[str, float]:
  """results.json's numbers as a tracker's summary values: each finite numeric top-level value
  under its name (A_final, forgetting, ...), and those of each record one level down as
  `RECORD/KEY` (`compute/step_seconds`, `plateau_detection/recall`)."""
  out = scalars(results)
  for key, value in results.items():
    if isinstance(value, dict):
      out.update({f"{key}/{k}": v for k, v in scalars(value).items()})
  return out


# What `run_files` sends a tracker: the run's records, then its figures and exports.
RUN_RECORDS = ("config.json", "results.json", "metrics.jsonl", "stream_manifest.json")
RUN_FOLDERS = ("plots", "export")


# results.json's accuracy matrices a tracker shows as tables (the Task-IL one where recorded).
MATRICES = ("acc_matrix", "acc_matrix_task_il")


def result_matrices(results: dict) -> dict:
  """results.json's accuracy matrices (`MATRICES`) that it holds, by name."""
  return {name: results[name] for name in MATRICES if results.get(name)}


def run_files(workdir: str) -> list[str]:
  """The files of a finished run a tracker keeps as artifacts, relative to `workdir`: its records,
  every figure in plots/ and export in export/ (not a write's leftover `.tmp`), and Online-LoRA's
  exported model where there is one."""
  from olora_jax.methods import online_lora  # the export's file name, where the method keeps it

  found = [name for name in (*RUN_RECORDS, online_lora.EXPORT_FILENAME)
           if os.path.isfile(os.path.join(workdir, name))]
  for folder in RUN_FOLDERS:
    top = os.path.join(workdir, folder)
    for here, _, names in sorted(os.walk(top)):
      found += sorted(os.path.relpath(os.path.join(here, n), workdir) for n in names
                      if not n.endswith(".tmp"))
  return found


def accuracy_table(matrix) -> tuple[list[str], list[list]]:
  """The final accuracy matrix a_{i,j} (results.json `acc_matrix`) as a table's (columns, rows):
  a row per evaluated task i, a column per task j trained."""
  columns = ["evaluated on task i", *(f"after task {j}" for j in range(len(matrix)))]
  return columns, [[i, *map(float, row)] for i, row in enumerate(matrix)]


def run_params(config: dict) -> dict:
  """The run's flattened config as a tracker's params: every key but the other methods' blocks
  (the run's own block, the common keys and `learner`, which Online-LoRA reads, are kept)."""
  from olora_jax import methods

  method = config.get("method", "online_lora")
  own = methods.resolve(method).name if method else ""
  blocks = {spec.name for spec in methods.specs() if spec.config is not None} - {own}
  return {k: v for k, v in config.items() if k.split(".", 1)[0] not in blocks}


class _Mirror:
  """A logger that switches itself off with one warning at its first error (the run goes on),
  starting with `_start` (the run's workdir, project, display name and flattened config)."""

  label = ""
  name = ""  # its key in loggers.json

  def __init__(self, workdir: str, project: str, name: str, config: dict):
    self.active = True
    self.workdir = workdir
    self.summarized = False  # the finished run's results sent (`summarize`)
    self.sent = False  # ... and its run ended FINISHED (`close`)
    try:
      self._start(workdir, project, name, config)
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  def _end(self, status: str) -> str:
    """Ends the tracker's run with `status` ('FINISHED', 'FAILED', 'KILLED'); the clause saying
    what became of it ('' when no run was made)."""
    if not self._has_run():
      return ""
    try:
      self._finish(status)
    except Exception as e:  # the store cannot be written (read-only, unreachable)
      return (f"the {self.label} run could not be marked {status} ({_first(e)}): it stays"
              " RUNNING in its store")
    return f"the {self.label} run is marked {status}"

  def _switch_off(self, error: BaseException) -> None:
    if self.active:
      self.active = False
      ended = self._end("FAILED")
      logging.warning("%s mirror switched off (%s); metrics.jsonl still has every scalar%s",
                      self.label, _first(error), f"; {ended}" if ended else "")

  def write(self, event: str, samples_seen: int, values: dict) -> None:
    if not self.active:
      return
    tagged = {f"{event}/{k}": v for k, v in scalars(values).items()
              if k not in ("step", "samples_seen")}
    if not tagged:
      return
    try:
      self._log(tagged, int(samples_seen))
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  def summarize(self, results: dict, workdir: str) -> None:
    """The run's results (module docstring): summary values, the accuracy matrix, the files.
    Until its run is ended FINISHED (`close`), loggers.json lists the tracker as unsent, so that
    a stop or a kill in between leaves a rerun of the finished run to send them
    (`send_unsent`). `UploadStopped` (a second signal) ends its run KILLED and goes on up."""
    if not self.active:
      return
    _mark_unsent(workdir, self.name, True)
    try:
      self._summarize(results_summary(results), result_matrices(results), workdir,
                      run_files(workdir), int(results.get("samples_seen", 0)))
      self.summarized = True
    except UploadStopped as stop:
      self.active = False
      stop.ended = self._end("KILLED")
      raise
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  def close(self) -> None:
    """Ends the tracker's run: FINISHED, or, when the run's files are closed because it stopped
    (the exception being handled: `errors.Preempted`, a signal) KILLED, because it failed
    FAILED (a resume marks it RUNNING again)."""
    if not self.active:
      return
    stopped = sys.exc_info()[1]
    status = ("FINISHED" if stopped is None else "KILLED"
              if isinstance(stopped, (errors.Preempted, KeyboardInterrupt)) else "FAILED")
    try:
      self._finish(status)
      self.active = False
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)
      return
    if self.summarized and status == "FINISHED":
      self.sent = True
      _mark_unsent(self.workdir, self.name, False)

  def _has_run(self) -> bool:
    raise NotImplementedError

  def _start(self, workdir: str, project: str, name: str, config: dict) -> None:
    raise NotImplementedError

  def _log(self, tagged: dict[str, float], samples_seen: int) -> None:
    raise NotImplementedError

  def _summarize(self, summary: dict[str, float], matrices: dict, workdir: str,
                 files: list[str], samples_seen: int) -> None:
    raise NotImplementedError

  def _finish(self, status: str) -> None:
    raise NotImplementedError


def _first(error: BaseException) -> str:
  """`Type: first line` of an error."""
  return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _mark_unsent(workdir: str, name: str, unsent: bool) -> None:
  """Lists `name` in loggers.json's unsent trackers (or takes it off)."""
  ids = _ids(workdir)
  names = [n for n in ids.get(UNSENT, []) if n != name] + ([name] if unsent else [])
  with contextlib.suppress(OSError):  # a workdir that cannot be written failed the run already
    workdir_lib.write_json(os.path.join(workdir, IDS_FILE), {**ids, UNSENT: names})


def _ids(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, IDS_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _keep_id(workdir: str, name: str, run_id: str) -> None:
  workdir_lib.write_json(os.path.join(workdir, IDS_FILE), {**_ids(workdir), name: run_id})


class WandbWriter(_Mirror):
  """A Weights & Biases run (module docstring): one `wandb.log` per metrics.jsonl line, its x
  axis the `samples_seen` metric (W&B's own step only ever grows, and a resume logs again)."""

  label = "Weights & Biases"
  name = "wandb"
  _run = None

  def _has_run(self):
    return self._run is not None

  def _start(self, workdir, project, name, config):
    import wandb

    self._wandb = wandb
    run_id = _ids(workdir).get("wandb") or uuid.uuid4().hex[:16]
    place = config.get("logger_dir") or workdir
    os.makedirs(place, exist_ok=True)
    self._run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=place,
                           group=config.get("logger_group") or None, config=run_params(config),
                           reinit="create_new",
                           # The run's terminal output is its own (progress bar, table).
                           settings=wandb.Settings(console="off"))
    self._run.define_metric("samples_seen")
    self._run.define_metric("*", step_metric="samples_seen")
    _keep_id(workdir, "wandb", run_id)

  def _log(self, tagged, samples_seen):
    self._run.log({"samples_seen": samples_seen, **tagged})

  def _summarize(self, summary, matrices, workdir, files, samples_seen):
    self._run.summary.update(summary)
    for name, matrix in matrices.items():
      columns, rows = accuracy_table(matrix)
      self._run.log({"samples_seen": samples_seen,
                     name: self._wandb.Table(columns=columns, data=rows)})
    artifact = self._wandb.Artifact(f"run-{self._run.id}", type="run-files")
    for name in files:
      artifact.add_file(os.path.join(workdir, name), name=name)
    self._run.log_artifact(artifact)

  def _finish(self, status):
    if self._run is not None:  # W&B has no KILLED: a non-zero exit code marks the run failed
      self._run.finish(exit_code=0 if status == "FINISHED" else 1)


class MlflowWriter(_Mirror):
  """An MLflow run (module docstring), written through `MlflowClient`: one `log_batch` per
  metrics.jsonl line, step = samples seen."""

  label = "MLflow"
  name = "mlflow"
  _client = None
  _run_id = None

  def _has_run(self):
    return self._run_id is not None

  def _start(self, workdir, project, name, config):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    self._metric = Metric
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
      # The local file store, which MLflow 3 keeps in maintenance mode and refuses unless
      # asked: asked here, for the default only (a tracking URI of one's own is used as given).
      uri = _file_uri(os.path.join(config.get("logger_dir") or workdir, "mlruns"))
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    run_id = _ids(workdir).get("mlflow")
    if run_id is None:
      experiment = client.get_experiment_by_name(project)
      experiment_id = (experiment.experiment_id if experiment is not None
                       else client.create_experiment(project))
      group = config.get("logger_group")
      run_id = client.create_run(experiment_id, run_name=name,
                                 tags={"group": group} if group else None).info.run_id
      _keep_id(workdir, "mlflow", run_id)
      # MLflow keeps a parameter's first value (a later, different one is an error): only a new
      # run logs the config. Values are capped at MLflow's 500 characters.
      params = [Param(k, str(v)[:500]) for k, v in sorted(run_params(config).items())]
      for start in range(0, len(params), 100):  # MLflow's limit per batch
        client.log_batch(run_id, params=params[start:start + 100])
    else:
      client.update_run(run_id, status="RUNNING")
    self._client, self._run_id = client, run_id

  def _log(self, tagged, samples_seen):
    now = int(time.time() * 1000)
    self._client.log_batch(self._run_id, metrics=[
        self._metric(_mlflow_key(k), v, now, samples_seen) for k, v in tagged.items()])

  def _summarize(self, summary, matrices, workdir, files, samples_seen):
    self._remove_staged()
    now = int(time.time() * 1000)
    metrics_ = [self._metric(_mlflow_key(k), v, now, samples_seen) for k, v in summary.items()]
    for start in range(0, len(metrics_), 1000):  # MLflow's limit per batch
      self._client.log_batch(self._run_id, metrics=metrics_[start:start + 1000])
    for name, matrix in matrices.items():
      columns, rows = accuracy_table(matrix)
      text = io.StringIO()
      csv.writer(text, lineterminator="\n").writerows([columns, *rows])
      self._client.log_text(self._run_id, text.getvalue(), f"{name}.csv")
    for name in files:
      folder = os.path.dirname(name)
      self._client.log_artifact(self._run_id, os.path.join(workdir, name), folder or None)

  def _finish(self, status):
    if self._run_id is not None:
      self._client.set_terminated(self._run_id, status=status)

  def _remove_staged(self) -> None:
    """Removes what an upload killed outright (SIGKILL, a second signal before this version)
    left in a local artifact store: MLflow's staged copies, `.artifact.uploading.*`."""
    uri = self._client.get_run(self._run_id).info.artifact_uri
    if not uri.startswith("file:"):
      return
    from mlflow.utils.file_utils import local_file_uri_to_path
    for here, _, names in os.walk(local_file_uri_to_path(uri)):
      for n in names:
        if n.startswith(MLFLOW_STAGING_PREFIX):
          with contextlib.suppress(OSError):
            os.remove(os.path.join(here, n))


def _mlflow_key(tag: str) -> str:
  """A tag as an MLflow metric name (letters, digits, '_', '-', '.', ' ', ':' and '/')."""
  return "".join(ch if ch.isalnum() or ch in "_-. :/" else "_" for ch in tag)


def _file_uri(path: str) -> str:
  import pathlib

  return pathlib.Path(os.path.abspath(path)).as_uri()


class Mirrors:
  """Every logger a run writes to, called as one by `runlog.RunLog` (write, close)."""

  def __init__(self, writers):
    self.writers = [w for w in writers if w is not None]

  def write(self, event: str, samples_seen: int, values: dict) -> None:
    for w in self.writers:
      w.write(event, samples_seen, values)

  def summarize(self, results: dict, workdir: str) -> None:
    """The finished run's results to each tracker (TensorBoard's event files have the scalars).
    A first signal meanwhile lets the upload go on (the run has finished); a second one stops
    it: each tracker's run it reached is ended KILLED, MLflow's staged copy removed, and
    `errors.Preempted` says so (a rerun sends the results again: `send_unsent`)."""
    trackers = [w for w in self.writers if hasattr(w, "summarize") and w.active]
    if not trackers:
      return
    for w in trackers:  # before any upload: a kill in between leaves each to a rerun
      _mark_unsent(workdir, w.name, True)
    with _stoppable_upload():
      try:
        for w in trackers:
          w.summarize(results, workdir)
      except UploadStopped as stop:
        ended = "; ".join(filter(None, [getattr(stop, "ended", "")] + [
            w._end("KILLED") for w in trackers if w.active]))  # those not reached yet
        for w in trackers:
          w.active = False
        raise errors.Preempted(stop.signum, (
            f"stopped by a second signal {stop.signum} while the finished run's results were"
            f" sent to {', '.join(w.label for w in trackers)}; results.json and the run's own"
            f" files in {workdir} are whole" + (f"; {ended}" if ended else "")
            + ": run the same command to send them")) from None

  def close(self) -> None:
    for w in self.writers:
      w.close()


@contextlib.contextmanager
def _stoppable_upload():
  """While the trackers get the results: the main thread's handler of SIGTERM and SIGINT lets a
  first signal be (counting one that came after the run's loop, `run_control.PENDING_SIGNALS`)
  and raises `UploadStopped` at a second (one within `errors.SAME_STOP_SECONDS` of the first is
  that one again); `UPLOADING` tells launch/run.py's signal watcher to leave it so."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  run_control = sys.modules.get("olora_jax.run_control")
  first = [-math.inf if run_control is not None and run_control.PENDING_SIGNALS else None]

  def handle(signum, frame):
    now = time.monotonic()
    if first[0] is None:
      first[0] = now
      return
    if now - first[0] >= errors.SAME_STOP_SECONDS:
      raise UploadStopped(signum)

  previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}
  UPLOADING[0] = True
  try:
    yield
  finally:
    UPLOADING[0] = False
    for s, handler in previous.items():
      signal.signal(s, handler)


def send_unsent(workdir: str, config) -> list[str]:
  """For a finished run found again (launch/run.py on its workdir): the trackers loggers.json
  lists as unsent (a stop or a kill cut their upload short, or their run was not ended) get the
  results now and are ended FINISHED; returns their labels (those it could send: one that fails
  switches off with its warning, as in a run). [] when none is unsent."""
  unsent = _ids(workdir).get(UNSENT) or []
  if not unsent:
    return []
  flat = validation.flatten(config or {})
  project = flat.get("logger_project") or "olora-jax"
  writers = [(WandbWriter if name == "wandb" else MlflowWriter)(
      workdir, project, plots.run_name(flat), flat)
      for name in parse_loggers(flat.get("loggers", "tensorboard")) if name in unsent]
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  mirrors = Mirrors(writers)
  try:
    mirrors.summarize(results, workdir)
  finally:
    mirrors.close()
  return [w.label for w in writers if w.sent]


def make_mirrors(workdir: str, config: dict | None = None) -> Mirrors | None:
  """The loggers `config` (the run's flattened config; None: TensorBoard alone, as before the
  `loggers` key) names, writing into `workdir`; None when it names none."""
  config = validation.flatten(config or {})
  names = parse_loggers(config.get("loggers", "tensorboard"))
  writers = []
  for name in names:
    if name == "tensorboard":
      writers.append(tb_writer.make_scalar_writer(os.path.join(workdir, "tensorboard")))
      continue
    display = plots.run_name(config)
    project = config.get("logger_project") or "olora-jax"
    writer = (WandbWriter if name == "wandb" else MlflowWriter)(workdir, project, display, config)
    writers.append(writer)
  mirrors = Mirrors(writers)
  return mirrors if mirrors.writers else None
