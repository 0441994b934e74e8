"""Every baseline on the one loop: a tiny stream end to end, each jitted function traced once, and
a run killed mid-stream then resumed ends bit-identical to an uninterrupted one (results.json but
wall time and the compute ledger, metrics.jsonl, every array of the final checkpoint: weights,
optimizer state, replay buffers, Fisher, prompt pools and MVP's selection counts, the
streaming methods' class statistics and Gram matrices, PRNG key).

The uninterrupted run is the method's command-line run of test_all_methods_cli.py (one run per
method and session, tiny_methods.method_run); the resumed one runs in this process. The kill is
simulated from the uninterrupted run's own files, as SIGKILL leaves them right after
checkpoint KILLED_AFTER: its checkpoints up to that step, metrics.jsonl longer than that
checkpoint recorded, no results.json (the signal path itself, SIGTERM included, is the same loop
code for every method and is tested in test_resume.py and test_failures.py)."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import pytest
import tiny_methods

from olora_jax import compute, methods, plots, trainer
from olora_jax.methods import common

# Every packaged method but Online-LoRA (tested on its own in test_resume.py), from the registry.
BASELINES = tuple(s.name for s in methods.specs() if s.name != "online_lora")
TOLD_BOUNDARIES = tiny_methods.TOLD_BOUNDARIES
KILLED_AFTER = tiny_methods.CHECKPOINT_EVERY  # the checkpoint a killed run resumes from (of 17)
IID_EPOCHS = tiny_methods.STREAM["iid.epochs"]  # the upper bound's passes over the stream
# The figures depend on results.json alone; these two cover what every method's results can hold
# (one evaluated anytime, GDumb at task ends only, no A_auc); the all-methods CLI test looks for
# every method's own figures.
PLOTTED = ("finetune", "gdumb")


def _config(method: str):
  """tiny_methods.stream_config: ~540 training samples (17 steps of 32, 5 tasks), checkpoints
  at 8, 16 and the end, the upper bound's two passes, figures on."""
  return tiny_methods.stream_config(method)


class _Messages(logging.Handler):
  """Collects the log lines of a run (to see that it resumed rather than started over)."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


def _outputs(workdir) -> tuple[dict, bytes, dict]:
  results = json.loads((workdir / "results.json").read_text())
  for key in compute.MEASUREMENT_KEYS:
    del results[key]
  steps = sorted(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
  checksums = json.loads((workdir / "checkpoints" / str(steps[-1]) / "checksums" / "metadata")
                         .read_text())["arrays"]
  return results, (workdir / "metrics.jsonl").read_bytes(), checksums


def resume_after_simulated_kill(config, full: pathlib.Path, killed: pathlib.Path):
  """What SIGKILL right after checkpoint KILLED_AFTER leaves: the finished run `full` copied to
  `killed` without its results, export, plots and later checkpoints. Runs `config` there (a
  resume, which must say it resumed at that step) and returns its `_outputs`."""
  shutil.copytree(full, killed, ignore=shutil.ignore_patterns(
      "plots", "results.json", trainer.EXPORT_FILENAME))
  later = [d for d in (killed / "checkpoints").iterdir()
           if d.name.isdigit() and int(d.name) > KILLED_AFTER]
  assert later and (killed / "checkpoints" / str(KILLED_AFTER)).is_dir()
  for d in later:
    shutil.rmtree(d)
  messages = _Messages()
  logging.getLogger().addHandler(messages)
  try:
    trainer.train_and_evaluate(config, str(killed), progress=False)
  finally:
    logging.getLogger().removeHandler(messages)
  assert any(f"at stream step {KILLED_AFTER} of" in m for m in messages.lines), messages.lines
  return _outputs(killed)


@pytest.fixture(scope="module", params=BASELINES)
def runs(request, tmp_path_factory, method_runs_root, compilation_cache):
  """(method, traces of the resumed run, the uninterrupted run's outputs, outputs of the killed +
  resumed, the uninterrupted run's workdir). The uninterrupted run is the method's command-line
  run of the all-methods CLI test (tiny_methods.method_run: made once in the session, by whichever
  test needs it first); the resume runs here, in this process, and counts its traces."""
  name = request.param
  full, code, stderr = tiny_methods.method_run(method_runs_root, name, name, {},
                                               compilation_cache)
  assert code == 0, f"{name}: exit {code}: {stderr[-2000:]}"
  common.TRACE_COUNTS.clear()
  resumed = resume_after_simulated_kill(_config(name), full,
                                        tmp_path_factory.mktemp(name) / "killed")
  return name, dict(common.TRACE_COUNTS), _outputs(full), resumed, full


def test_runs_end_to_end_and_traces_each_function_once(runs):
  name, traces, (results, metrics, _), _, workdir = runs
  # The resumed run (steps 9-17: three task ends, evaluations, boundaries) traces each once.
  assert traces[f"{name}.train_step"] == 1
  # a model made (SLCA: its head aligned; EASE: its prototypes) per evaluation: one trace in all
  if name in ("gdumb", "slda", "ranpac", "slca", "ease", "hide_prompt"):
    assert traces[f"{name}.eval_state"] == 1
  if name in TOLD_BOUNDARIES:  # told at each of the 5 task ends
    assert results["boundaries"]["n_signalled"] == 5
  # a jitted hook: one trace for all of them
  if name in ("inflora", "sd_lora", "slca", "ease", "hide_prompt"):
    assert traces[f"{name}.at_boundary"] == 1
  if name == "gdumb":  # trained from the buffer at each task end
    assert results["A_auc"] is None  # evaluated at task ends only, as the paper reports it
  else:
    assert 0 <= results["A_auc"] <= 1
  assert len(results["acc_matrix"]) == 5 and 0 <= results["A_final"] <= 1
  lines = [json.loads(line) for line in metrics.decode().splitlines()]
  assert sum(line["event"] == "train" for line in lines) == results["n_steps"]
  steps = json.loads((workdir / "stream_manifest.json").read_text())["steps"]
  ids = [i for step in steps for i in step]
  assert results["samples_seen"] == len(ids)
  if name == "iid":  # several epochs over the shuffled stream: each sample IID_EPOCHS times
    assert results["benchmark_manifest_sha256"] != results["stream_manifest_sha256"]
    assert len(ids) == IID_EPOCHS * len(set(ids)) > 500
  else:
    assert len(ids) == len(set(ids))
  # No loss surface: neither method has a plateau rule (plots.plot_files).
  assert name not in PLOTTED or not (workdir / "plots" / plots.PLOT_FILES[0]).exists()
  for plot in plots.plot_files({"method": name}) if name in PLOTTED else ():
    assert (workdir / "plots" / plot).stat().st_size > 1000


def test_resumes_bit_exactly_after_a_kill(runs):
  _, _, (results, metrics, checksums), (results2, metrics2, checksums2), _ = runs
  assert results2 == results
  assert metrics2 == metrics
  assert checksums2 == checksums
