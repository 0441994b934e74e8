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
               it); the step is samples seen

Both runs are named after the method's display name, setting and seed, carry the run's
flattened config (W&B config, MLflow params), and live in the project (W&B) or experiment
(MLflow) `logger_project`. Their ids are kept in WORKDIR/loggers.json, so a resumed run goes on
logging into the same W&B and MLflow runs; the lines a resume writes again (those after its
checkpoint) are logged again at their samples seen.

Like the TensorBoard mirror, no logger can stop or fail a run once it has started: the first
error of any kind switches that logger off with one warning (metrics.jsonl has every value). A
logger the config names whose package is not installed is bad input, refused before any compute
(`check_loggers`).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
import uuid

# The `loggers` key's vocabulary lives with the config checks (validation imports no logger).
from olora_jax import plots, tb_writer, validation
from olora_jax import workdir as workdir_lib
from olora_jax.validation import LOGGERS, PACKAGES, check_loggers, parse_loggers  # noqa: F401

IDS_FILE = "loggers.json"  # the W&B and MLflow run ids, for a resume to log into the same runs


def scalars(values: dict) -> dict[str, float]:
  """The finite numeric, non-boolean values of a metrics.jsonl record, as floats."""
  return {k: float(v) for k, v in values.items()
          if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}


class _Mirror:
  """A logger that switches itself off with one warning at its first error (the run goes on),
  starting with `_start` (the run's workdir, project, display name and flattened config)."""

  label = ""

  def __init__(self, workdir: str, project: str, name: str, config: dict):
    self.active = True
    try:
      self._start(workdir, project, name, config)
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  def _switch_off(self, error: BaseException) -> None:
    if self.active:
      self.active = False
      logging.warning("%s mirror switched off (%s: %s); metrics.jsonl still has every scalar",
                      self.label, type(error).__name__,
                      str(error).splitlines()[0] if str(error) else "")
      try:
        self._finish(failed=True)
      except Exception:  # what it could not send is in metrics.jsonl
        pass

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

  def close(self) -> None:
    if not self.active:
      return
    try:
      self._finish(failed=False)
      self.active = False
    except Exception as e:  # the mirror must never stop the run
      self._switch_off(e)

  def _start(self, workdir: str, project: str, name: str, config: dict) -> None:
    raise NotImplementedError

  def _log(self, tagged: dict[str, float], samples_seen: int) -> None:
    raise NotImplementedError

  def _finish(self, failed: bool) -> None:
    raise NotImplementedError


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
  _run = None

  def _start(self, workdir, project, name, config):
    import wandb

    run_id = _ids(workdir).get("wandb") or uuid.uuid4().hex[:16]
    self._run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=workdir,
                           config=config, reinit="create_new",
                           # The run's terminal output is its own (progress bar, table).
                           settings=wandb.Settings(console="off"))
    self._run.define_metric("samples_seen")
    self._run.define_metric("*", step_metric="samples_seen")
    _keep_id(workdir, "wandb", run_id)

  def _log(self, tagged, samples_seen):
    self._run.log({"samples_seen": samples_seen, **tagged})

  def _finish(self, failed):
    if self._run is not None:
      self._run.finish(exit_code=1 if failed else 0)


class MlflowWriter(_Mirror):
  """An MLflow run (module docstring), written through `MlflowClient`: one `log_batch` per
  metrics.jsonl line, step = samples seen."""

  label = "MLflow"
  _client = None
  _run_id = None

  def _start(self, workdir, project, name, config):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    self._metric = Metric
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
      # The local file store, which MLflow 3 keeps in maintenance mode and refuses unless
      # asked: asked here, for the default only (a tracking URI of one's own is used as given).
      uri = _file_uri(os.path.join(workdir, "mlruns"))
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    run_id = _ids(workdir).get("mlflow")
    if run_id is None:
      experiment = client.get_experiment_by_name(project)
      experiment_id = (experiment.experiment_id if experiment is not None
                       else client.create_experiment(project))
      run_id = client.create_run(experiment_id, run_name=name).info.run_id
      _keep_id(workdir, "mlflow", run_id)
      # MLflow keeps a parameter's first value (a later, different one is an error): only a new
      # run logs the config. Values are capped at MLflow's 500 characters.
      params = [Param(k, str(v)[:500]) for k, v in sorted(config.items())]
      for start in range(0, len(params), 100):  # MLflow's limit per batch
        client.log_batch(run_id, params=params[start:start + 100])
    else:
      client.update_run(run_id, status="RUNNING")
    self._client, self._run_id = client, run_id

  def _log(self, tagged, samples_seen):
    now = int(time.time() * 1000)
    self._client.log_batch(self._run_id, metrics=[
        self._metric(_mlflow_key(k), v, now, samples_seen) for k, v in tagged.items()])

  def _finish(self, failed):
    if self._run_id is not None:
      self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


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

  def close(self) -> None:
    for w in self.writers:
      w.close()


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
