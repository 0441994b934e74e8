"""Checkpoints: round trips, damaged checkpoints (flipped bytes, truncated files), NaN losses."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from olora_jax import checkpointing, trainer
from olora_jax.learner import plateau as plateau_lib
from olora_jax.methods import online_lora as online_lora_method


def _tree(value: float) -> dict:
  """A small run-like pytree: floats, ints, bools, a NamedTuple, a typed PRNG key and a zero-size
  array (the hard buffer with learner.buffer_size=0, which orbax cannot save as such)."""
  return {"w": jnp.full((64, 16), value, jnp.float32), "n": jnp.asarray(int(value), jnp.int32),
          "empty_buffer": jnp.zeros((0, 4, 4, 3), jnp.float32),
          "valid": jnp.asarray([True, False, value > 1]),
          "opt": (jnp.zeros(3), {"mu": jnp.full((2,), value)}),
          "key": jax.random.key(int(value))}


def _progress(cursor: int) -> checkpointing.Progress:
  p = checkpointing.Progress.initial(eval_every=10)
  p.cursor, p.samples_seen, p.seen_classes = cursor, 32 * cursor, [0, 1]
  p.acc_columns, p.anytime = [[0.5, 0.25]], [1 / 3]
  window, _ = plateau_lib.update(plateau_lib.init(), 0.1 * cursor + 1e-7,
                                 plateau_lib.PlateauConfig())
  p.method_host = {"window": online_lora_method.window_to_json(window)}
  return p


def _save_two(workdir: str) -> checkpointing.Checkpointer:
  ckpt = checkpointing.Checkpointer(workdir, max_to_keep=3)
  for step in (1, 2):
    ckpt.save(_tree(float(step)), _progress(step), {"config": {}, "stream_sha256": "s"})
  return ckpt


def _assert_tree_equal(a, b) -> None:
  a, b = checkpointing.to_numpy(a), checkpointing.to_numpy(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and np.array_equal(x, y)


def _largest_array_file(workdir: str, step: int) -> str:
  files = []
  for root, _, names in os.walk(os.path.join(workdir, "checkpoints", str(step), "arrays")):
    files += [os.path.join(root, n) for n in names]
  return max(files, key=os.path.getsize)


def test_round_trip_restores_every_leaf_and_the_progress_exactly(tmp_path):
  ckpt = _save_two(str(tmp_path))
  arrays, host = ckpt.restore_latest(_tree(0.0))
  _assert_tree_equal(arrays, _tree(2.0))
  assert jax.dtypes.issubdtype(arrays["key"].dtype, jax.dtypes.prng_key)
  restored = checkpointing.Progress.from_json(host["progress"])
  window = online_lora_method.window_from_json(restored.method_host["window"])
  assert isinstance(window, plateau_lib.PlateauState)
  # json.dumps compares the NaNs of the window (no plateau yet) too, and every float's bits.
  assert json.dumps(restored.to_json()) == json.dumps(_progress(2).to_json())


def test_flipped_bytes_in_the_newest_checkpoint_fall_back_to_the_previous(tmp_path, caplog):
  ckpt = _save_two(str(tmp_path))
  path = _largest_array_file(str(tmp_path), 2)
  data = bytearray(open(path, "rb").read())
  for i in range(64, len(data), 401):  # bytes spread over the file: some hold array data
    data[i] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with caplog.at_level(logging.WARNING):
    arrays, host = ckpt.restore_latest(_tree(0.0))
  _assert_tree_equal(arrays, _tree(1.0))
  assert host["progress"]["cursor"] == 1
  assert "checkpoint 2" in caplog.text and "damaged" in caplog.text
  assert os.path.isdir(tmp_path / "corrupt_checkpoints" / "2")
  assert ckpt.steps() == [1]


def test_truncated_file_in_the_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
  ckpt = _save_two(str(tmp_path))
  path = _largest_array_file(str(tmp_path), 2)
  os.truncate(path, os.path.getsize(path) // 2)
  with caplog.at_level(logging.WARNING):
    arrays, host = ckpt.restore_latest(_tree(0.0))
  _assert_tree_equal(arrays, _tree(1.0))
  assert "checkpoint 2" in caplog.text
  # The run can save over the damaged step number again.
  ckpt.save(_tree(5.0), _progress(2), {"config": {}, "stream_sha256": "s"})
  _assert_tree_equal(ckpt.restore_latest(_tree(0.0))[0], _tree(5.0))


def test_edited_host_record_is_detected(tmp_path):
  ckpt = _save_two(str(tmp_path))
  path = tmp_path / "checkpoints" / "2" / "host" / "metadata"
  host = json.loads(path.read_text())
  host["progress"]["samples_seen"] += 1  # valid JSON, wrong content
  path.write_text(json.dumps(host))
  assert ckpt.restore_latest(_tree(0.0))[1]["progress"]["cursor"] == 1


def test_no_usable_checkpoint_gives_none(tmp_path):
  ckpt = _save_two(str(tmp_path))
  for step in (1, 2):
    os.truncate(_largest_array_file(str(tmp_path), step), 3)
  assert ckpt.restore_latest(_tree(0.0)) is None


def test_config_differences_ignore_operational_keys():
  a = checkpointing.config_to_dict(tiny.get_config())
  c = tiny.get_config()
  c.checkpoint_every, c.max_to_keep, c.eval.write_plots = 7, 9, not c.eval.write_plots
  assert checkpointing.config_differences(a, checkpointing.config_to_dict(c)) == []
  c.learner.learning_rate = 0.5
  assert checkpointing.config_differences(a, checkpointing.config_to_dict(c)) == [
      "learner.learning_rate: 0.003 -> 0.5"]


def _nan_config(skip: bool):
  c = tiny.get_config()
  c.learner.learning_rate = 1e38  # one Adam step moves the weights by ~1e38: activations overflow
  c.learner.skip_nonfinite = skip
  c.checkpoint_every = 0
  return c


def test_nonfinite_loss_stops_with_a_checkpoint_of_the_last_good_state(tmp_path):
  """Through the command line: exit code 3 and one line naming the step."""
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run(
      [sys.executable, str(root / "launch" / "run.py"), "--config",
       str(root / "configs" / "tiny.py"), "--workdir", str(tmp_path),
       "--config.learner.learning_rate=1e38", "--config.checkpoint_every=0"],
      cwd=root, capture_output=True, text=True, timeout=300)
  assert done.returncode == 3, done.stderr[-2000:]
  errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
  assert len(errors) == 1 and "learner.skip_nonfinite=True" in errors[0]
  step = int(re.search(r"non-finite loss \(nan\) at stream step (\d+);", errors[0]).group(1))
  assert step >= 1 and not (tmp_path / "results.json").exists()
  assert checkpointing.Checkpointer(str(tmp_path), 1).steps() == [step]  # before the bad step
  host = json.loads((tmp_path / "checkpoints" / str(step) / "host" / "metadata").read_text())
  assert host["progress"]["cursor"] == step
  last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
  assert last["step"] == step - 1 and last["loss"] is not None  # last logged loss is finite


def test_nonfinite_loss_is_skipped_when_configured(tmp_path):
  config = _nan_config(True)
  config.learner.max_skipped_fraction = 1.0  # no bound (tests/test_failures.py tests the bound)
  results = trainer.train_and_evaluate(config, str(tmp_path), progress=False)
  assert results["nonfinite_steps"] and results["n_steps"] == 46
  assert results["nonfinite_steps"][0] >= 1
  events = [json.loads(x)["event"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert events.count("nonfinite_skipped") == len(results["nonfinite_steps"])


def test_a_checkpoint_of_another_stream_or_config_is_refused(tmp_path):
  config = tiny.get_config()
  ckpt = checkpointing.Checkpointer(str(tmp_path), max_to_keep=2)
  meta = {"config": checkpointing.config_to_dict(config), "stream_sha256": "a" * 64}
  ckpt.save(_tree(1.0), _progress(1), meta)
  arrays, progress = checkpointing.restore_run(ckpt, _tree(0.0), config, "a" * 64)
  assert progress.cursor == 1
  with pytest.raises(checkpointing.WorkdirError, match=r"different stream"):
    checkpointing.restore_run(ckpt, _tree(0.0), config, "b" * 64)
  config.seed = 1
  with pytest.raises(checkpointing.WorkdirError, match=r"different config \(seed: 0 -> 1\)"):
    checkpointing.restore_run(ckpt, _tree(0.0), config, "a" * 64)


def test_leaves_unchanged_since_the_initial_state_are_not_stored(tmp_path):
  """The frozen backbone is checkpointed once in the pretrained file, not in every checkpoint."""
  initial = {"frozen": jnp.arange(64 * 1024, dtype=jnp.float32), **_tree(0.0)}
  ckpt = checkpointing.Checkpointer(str(tmp_path), max_to_keep=3, initial=initial)
  state = {**_tree(2.0), "frozen": initial["frozen"]}  # everything trained but the backbone
  ckpt.save(state, _progress(2), {"config": {}, "stream_sha256": "s"})
  sums = json.loads((tmp_path / "checkpoints" / "2" / "checksums" / "metadata").read_text())
  assert "['frozen']" in sums["from_initial"] and "['frozen']" not in sums["arrays"]
  assert "['w']" in sums["arrays"]  # changed: stored
  stored = sum(os.path.getsize(os.path.join(r, n))
               for r, _, names in os.walk(tmp_path / "checkpoints" / "2" / "arrays") for n in names)
  assert stored < initial["frozen"].nbytes / 4
  arrays, _ = ckpt.restore_latest(initial)
  _assert_tree_equal(arrays, state)
  # The backbone changes (a merge): stored from then on, and restored from the checkpoint.
  merged = {**state, "frozen": state["frozen"] + 1.0}
  ckpt.save(merged, _progress(3), {"config": {}, "stream_sha256": "s"})
  _assert_tree_equal(ckpt.restore_latest(initial)[0], merged)


def test_a_changed_initial_state_is_refused_and_the_checkpoint_kept(tmp_path):
  initial = {"frozen": jnp.ones(256), **_tree(0.0)}
  ckpt = checkpointing.Checkpointer(str(tmp_path), max_to_keep=3, initial=initial)
  ckpt.save({**_tree(2.0), "frozen": initial["frozen"]}, _progress(2),
            {"config": {}, "stream_sha256": "s"})
  other = {**initial, "frozen": initial["frozen"].at[7].set(2.0)}  # the pretrained file changed
  with pytest.raises(checkpointing.InitialStateChanged,
                     match=r"relies on this run's initial weights.*\['frozen'\].*pass a new"):
    checkpointing.Checkpointer(str(tmp_path), 3, initial=other).restore_latest(other)
  assert ckpt.steps() == [2] and not (tmp_path / "corrupt_checkpoints").exists()


def test_a_run_resumed_on_a_changed_pretrained_file_is_refused(tmp_path):
  """End to end: a tiny run from a pretrained file, stopped, the file edited, resumed: exit 2
  naming the cause; with the original file back it resumes and finishes."""
  from olora_jax.models.vit import VisionTransformer, spec_from_config
  from olora_jax.pretrained import save_timm_safetensors

  config = tiny.get_config()
  config.eval.write_plots = False
  spec = spec_from_config(config.model)
  params = jax.jit(VisionTransformer(spec, 10).init)(
      jax.random.key(3), jnp.zeros((1, spec.image_size, spec.image_size, 3)))["params"]
  path = tmp_path / "backbone.safetensors"
  save_timm_safetensors(jax.device_get(params), path)
  config.pretrained.path, config.pretrained.format = str(path), "timm"
  config.checkpoint_every = 0  # the one checkpoint: the stop's
  workdir = str(tmp_path / "run")

  class StopAt10(trainer.StopSignal):
    @property
    def signum(self):
      self._n = getattr(self, "_n", 0) + 1
      return 15 if self._n >= 10 else None

    @signum.setter
    def signum(self, value):
      pass

  patch = pytest.MonkeyPatch()
  patch.setattr(trainer, "StopSignal", StopAt10)
  with pytest.raises(checkpointing.Preempted):
    trainer.train_and_evaluate(config, workdir, progress=False)
  patch.undo()
  original = path.read_bytes()
  edited = jax.device_get(params)
  fc1 = edited["encoderblock_0"]["mlp"]["fc1"]
  fc1["kernel"] = fc1["kernel"] * 2  # a weight no merge touches
  save_timm_safetensors(edited, path)
  with pytest.raises(checkpointing.InitialStateChanged, match="pretrained file"):
    trainer.train_and_evaluate(config, workdir, progress=False)
  path.write_bytes(original)
  assert trainer.train_and_evaluate(config, workdir, progress=False)["n_steps"] == 46
