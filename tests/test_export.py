"""eval.export: per-sample test logits (or top-k classes) with record ids and the trained
parameters at each task end and at the stream's end (olora_jax/export.py). The task-end export of
a run equals what the same run cut at that task end (a prefix run, replaying the first task of its
stream manifest) ends with; a resumed run writes the same files; the export changes no result."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import numpy as np
import pytest
import tiny_run

from olora_jax import errors, export, trainer


def _config(**overrides):
  c = tiny_run.config()
  c.eval.export = "logits"
  for key, value in overrides.items():
    section, _, leaf = key.rpartition(".")
    setattr(c[section] if section else c, leaf, value)
  return c


def _load(path) -> dict:
  with np.load(path, allow_pickle=False) as z:
    return {k: z[k] for k in z.files}


def _events(workdir, event: str) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [x for x in map(json.loads, lines) if x["event"] == event]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("export") / "full"
  trainer.train_and_evaluate(_config(), str(workdir), progress=False)
  return workdir


def test_the_export_changes_no_result_and_matches_the_task_end_evaluations(exported,
                                                                         tiny_reference):
  tiny_run.assert_same_run(exported, tiny_reference)  # results, run log, final checkpoint
  manifest = json.loads((exported / "stream_manifest.json").read_text())
  ends = _events(exported, "task_end")
  files = sorted(p.name for p in (exported / export.DIRECTORY).iterdir())
  assert files == sorted([export.FINAL] + [export.task_file(e["task"]) for e in ends])
  for end in ends:
    z = _load(exported / export.DIRECTORY / export.task_file(end["task"]))
    assert z["record_ids"].tolist() == manifest["test"]["ids"]
    assert z["labels"].tolist() == manifest["test"]["labels"]
    assert (int(z["step"]), int(z["samples_seen"]), int(z["task"])) == (
        end["step"], end["samples_seen"], end["task"])
    assert z["seen_classes"].tolist() == end["seen_classes"]
    # The logits' argmax gives the evaluator's per-class counts of that task end.
    hits = z["logits"].argmax(axis=1) == z["labels"]
    correct = np.bincount(z["labels"][hits], minlength=z["logits"].shape[1])
    assert correct.tolist() == end["class_correct"]
    assert sorted(k for k in z if k.startswith("params/")) == [
        "params/head/bias", "params/head/kernel",
        *(f"params/lora/encoderblock_0/{p}/{f}" for p in ("query", "value")
          for f in ("lora_a", "lora_b"))]
  final = _load(exported / export.DIRECTORY / export.FINAL)
  assert int(final["task"]) == -1 and int(final["step"]) == tiny_run.N_STEPS - 1


def test_a_task_end_export_equals_the_end_of_the_run_cut_at_that_task_end(exported, tmp_path):
  """The prefix run replays the full run's manifest up to the end of task 0: its exports (at its
  only task end and at its stream's end) hold the full run's parameters and predictions at that
  task end, bit for bit."""
  manifest = json.loads((exported / "stream_manifest.json").read_text())
  n = manifest["step_task"].index(1)  # the steps of task 0
  prefix = {k: v for k, v in manifest.items() if k not in ("params", "si_blurry")}
  for key in ("steps", "step_task", "step_labels", "step_paths", "step_digests"):
    if key in prefix:
      prefix[key] = prefix[key][:n]
  prefix["task_classes"] = manifest["task_classes"][:1]
  prefix["task_end_steps"] = manifest["task_end_steps"][:1]
  path = tmp_path / "task0.json"
  path.write_text(json.dumps(prefix))
  workdir = tmp_path / "prefix"
  trainer.train_and_evaluate(_config(**{"data.stream_manifest": str(path)}), str(workdir),
                             progress=False)
  full = _load(exported / export.DIRECTORY / export.task_file(0))
  for name in (export.task_file(0), export.FINAL):
    cut = _load(workdir / export.DIRECTORY / name)
    assert sorted(cut) == sorted(full)
    for key in full:
      if key != "task":
        np.testing.assert_array_equal(cut[key], full[key], err_msg=f"{name}: {key}")


def test_a_resumed_run_writes_the_same_export_files(exported, tmp_path, compilation_cache):
  workdir = tmp_path / "run"
  stopped = tiny_run.stop_after_checkpoint(workdir, 20, signal.SIGTERM, compilation_cache,
                                           "--config.eval.export=logits")
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
  before = {p.name: p.stat().st_mtime_ns for p in (workdir / export.DIRECTORY).iterdir()}
  assert before and export.FINAL not in before
  done = tiny_run.run(workdir, compilation_cache, "--config.eval.export=logits")
  assert done.returncode == 0, done.stderr[-2000:]
  after = {p.name: p for p in (workdir / export.DIRECTORY).iterdir()}
  assert sorted(after) == sorted(p.name for p in (exported / export.DIRECTORY).iterdir())
  for name, p in after.items():
    assert p.read_bytes() == (exported / export.DIRECTORY / name).read_bytes(), name
  # The task ends before the checkpoint it resumed from were not written again.
  assert all(after[name].stat().st_mtime_ns == t for name, t in before.items()
             if int(_load(after[name])["step"]) < tiny_run.steps(workdir)[0])


def test_a_signal_at_the_end_stops_before_the_results_and_no_partial_file_stays(
    exported, tmp_path, monkeypatch):
  """A SIGTERM during the final export was recorded and ignored (exit 0), and the temporary file
  of an export write cut by SIGKILL stayed in export/ for good. The signal now stops the run
  before results.json (143), the rerun finishes from the final checkpoint, and a cut write's
  file is removed when the run starts again."""
  workdir = tmp_path / "run"
  shutil.copytree(exported, workdir)
  (workdir / "results.json").unlink()  # the run as it was before it wrote its results
  (workdir / export.DIRECTORY / export.FINAL).unlink()
  at_end = export.Export.at_end

  def at_end_then_signal(self, step, samples_seen, state):
    at_end(self, step, samples_seen, state)
    os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(export.Export, "at_end", at_end_then_signal)
  with pytest.raises(errors.Preempted, match=re.escape(
      "stopped by signal 15 after the stream's end, before results.json was written; the final"
      f" checkpoint is {workdir}/checkpoints/{tiny_run.N_STEPS}: run the same command to finish"
      " from it")):
    trainer.train_and_evaluate(_config(), str(workdir), progress=False)
  assert not (workdir / "results.json").exists()
  monkeypatch.undo()
  cut = workdir / export.DIRECTORY / f"{export.task_file(1)}.999999.tmp"  # a SIGKILLed write's
  cut.write_bytes(b"PK")
  trainer.train_and_evaluate(_config(), str(workdir), progress=False)
  assert sorted(p.name for p in (workdir / export.DIRECTORY).iterdir()) == sorted(
      p.name for p in (exported / export.DIRECTORY).iterdir())
  assert (workdir / export.DIRECTORY / export.FINAL).read_bytes() == (
      exported / export.DIRECTORY / export.FINAL).read_bytes()
  tiny_run.assert_same_run(workdir, exported)


def test_top_k_ranks_the_classes_the_evaluator_would(exported, tmp_path):
  workdir = tmp_path / "top_k"
  config = _config(**{"eval.export": "top_k", "eval.export_top_k": 3,
                      "eval.mask_unseen_logits": True})
  trainer.train_and_evaluate(config, str(workdir), progress=False)
  z = _load(workdir / export.DIRECTORY / export.task_file(0))
  assert z["top_k_classes"].shape == (len(z["labels"]), 3) and "logits" not in z
  seen = z["seen_classes"]
  # Masked to the seen classes: the first choices are seen ones, the logits highest first.
  assert np.isin(z["top_k_classes"][:, :len(seen)], seen).all()
  assert (np.diff(z["top_k_logits"][:, :len(seen)], axis=1) <= 0).all()


@pytest.mark.parametrize("key,value,says", [
    ("eval.export", "probs", r"eval.export='probs' is not one of \('none', 'logits', 'top_k'\)"),
    ("eval.export_top_k", 0, r"eval.export_top_k=0 must be in 1..10"),
])
def test_bad_export_keys_are_refused_before_any_compute(tmp_path, key, value, says):
  config = _config(**{"eval.export": "top_k", key: value})
  with pytest.raises(ValueError, match=says):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_every_method_has_trainable_parameters_to_export():
  import jax

  from olora_jax import methods
  from olora_jax.methods import base

  for spec in methods.specs():
    config = tiny_run.config()
    config.method = spec.name
    methods.add_config_block(config)
    try:
      setup = trainer.Setup(config)
    except ValueError:  # a ViT-only or deeper-model method on the tiny model
      continue
    assert isinstance(setup.method, base.Method)
    params = jax.eval_shape(lambda k, s=setup: trainer.initial_params(s, s.config, k),
                            jax.random.key(0))
    state = jax.eval_shape(setup.method.init, jax.random.key(1), params)
    if setup.method.eval_state is not None:  # the state the evaluator (and the export) reads
      state = jax.eval_shape(setup.method.eval_state, state)
    leaves = jax.tree.leaves(export.trainable_params(setup.method, state))
    assert leaves, spec.name
