"""Checkpoints: round trips, damaged checkpoints (flipped bytes, truncated files), NaN losses,
device digests on every layout, sharded saves, checkpoints of the older SHA-256 format."""

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
import legacy_checkpoint
import numpy as np
import pytest
import tiny_run

from configs import tiny
from olora_jax import checkpointing, trainer
from olora_jax import errors as errors_lib
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
  p.cursor, p.samples_seen, p.evaluation.seen_classes = cursor, 32 * cursor, [0, 1]
  p.evaluation.acc_columns, p.evaluation.anytime = [[0.5, 0.25]], [1 / 3]
  window, _ = plateau_lib.update(plateau_lib.init(), 0.1 * cursor + 1e-7,
                                 plateau_lib.PlateauConfig())
  p.method_host = {"window": online_lora_method.window_to_json(window)}
  return p


def _save_two(workdir: str) -> checkpointing.Checkpointer:
  ckpt = checkpointing.Checkpointer(workdir, max_to_keep=3)
  for step in (1, 2):
    ckpt.save(_tree(float(step)), _progress(step), {"config": {}, "stream_sha256": "s"})
  return ckpt


def test_a_save_that_fills_the_disk_leaves_no_partial_folder(tmp_path, monkeypatch):
  """A save that fails half way (tensorstore's full disk leaves orbax's temporary folder behind)
  removes what it wrote: the full disk gets its space back before the rerun, and the checkpoints
  before it are kept."""
  from orbax.checkpoint._src.path import atomicity_types

  assert checkpointing.TMP_SUFFIX == atomicity_types.TMP_DIR_SUFFIX  # orbax's name for it
  ckpt = _save_two(str(tmp_path))

  def fill_the_disk(step, *args, **kwargs):
    partial = Path(ckpt.directory) / f"{step}{checkpointing.TMP_SUFFIX}" / "arrays"
    partial.mkdir(parents=True)
    (partial / "d").write_bytes(bytes(1000))
    raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "arrays/d": No space left on'
                     " device [os_error_code='28']")

  monkeypatch.setattr(ckpt._manager, "save", fill_the_disk)
  with pytest.raises(ValueError, match="No space left on device"):
    ckpt.save(_tree(3.0), _progress(3), {"config": {}, "stream_sha256": "s"})
  assert sorted(os.listdir(ckpt.directory)) == ["1", "2"]


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


def test_the_advice_of_exit_3_works_on_the_same_workdir(tmp_path):
  """Stopped for a non-finite loss, the run resumes in the same workdir with
  learner.skip_nonfinite=True (a key that may change on resume), and says it changed."""
  with pytest.raises(errors_lib.NonFiniteLoss,
                     match=r"rerun the same command with --config.learner.skip_nonfinite=True"):
    trainer.train_and_evaluate(_nan_config(False), str(tmp_path), progress=False)
  config = _nan_config(True)
  config.learner.max_skipped_fraction = 1.0
  results = trainer.train_and_evaluate(config, str(tmp_path), progress=False)
  assert results["n_steps"] == 46 and results["nonfinite_steps"]
  step = results["nonfinite_steps"][0]
  assert results["config_changes"] == [
      f"learner.max_skipped_fraction: 0.05 -> 1.0 (at step {step})",
      f"learner.skip_nonfinite: False -> True (at step {step})"]


def test_a_nonfinite_state_is_never_saved_and_one_saved_before_is_quarantined(tmp_path, caplog):
  bad = _tree(2.0)
  bad["opt"] = (jnp.array([0.0, jnp.nan, 1.0]), bad["opt"][1])
  ckpt = checkpointing.Checkpointer(str(tmp_path), max_to_keep=3)
  ckpt.save(_tree(1.0), _progress(1), {"config": {}, "stream_sha256": "s"})
  with pytest.raises(errors_lib.NonFiniteLoss, match=r"holds NaN/Inf \(1 array\(s\), e.g."):
    ckpt.save(bad, _progress(2), {"config": {}, "stream_sha256": "s"})
  assert ckpt.steps() == [1]
  # One written by a version that did not check: restored as damage, the run falls back.
  patch = pytest.MonkeyPatch()
  checks = checkpointing.tree_checks
  patch.setattr(checkpointing, "tree_checks", lambda tree: (checks(tree)[0], []))
  ckpt.save(bad, _progress(2), {"config": {}, "stream_sha256": "s"})
  patch.undo()
  with caplog.at_level(logging.WARNING):
    arrays, host = ckpt.restore_latest(_tree(0.0))
  _assert_tree_equal(arrays, _tree(1.0))
  assert "hold NaN/Inf" in caplog.text and os.path.isdir(tmp_path / "corrupt_checkpoints" / "2")


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


# --------------------------------------------------------------------------------------------
# Device digests: the same on every layout, sensitive to one byte; saves that gather nothing.

EIGHT_DEVICES = {"XLA_FLAGS": tiny_run.xla_flags("--xla_force_host_platform_device_count=8"),
                 "JAX_PLATFORMS": "cpu"}


def _run_on_eight_devices(script: str, *args: str) -> str:
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run([sys.executable, "-c", script, *args], cwd=root, capture_output=True,
                        text=True, timeout=300,
                        env={**os.environ, **EIGHT_DEVICES,
                             "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"})
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _dtype_arrays() -> dict:
  """One small array of each dtype a run's state holds, and a typed PRNG key array."""
  rng = np.random.default_rng(0)
  return {"f32": rng.standard_normal((16, 8)).astype(np.float32),
          "bf16": rng.standard_normal((8, 24)).astype(jnp.bfloat16),
          "f16": rng.standard_normal((8, 16)).astype(np.float16),
          "i32": rng.integers(-2**31, 2**31, (8, 8), dtype=np.int32),
          "u32": rng.integers(0, 2**32, (24, 8), dtype=np.uint32),
          "u16": rng.integers(0, 2**16, (8, 8), dtype=np.uint16),
          "u8": rng.integers(0, 256, (16, 16), dtype=np.uint8),
          "bool": rng.random((8, 8)) < 0.5,
          "vector": rng.standard_normal(24).astype(np.float32),
          "scalar": np.float32(3.5),
          "keys": jax.random.split(jax.random.key(7), 8)}


LAYOUTS = """
import json
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from olora_jax import checkpointing, sharding
from test_checkpointing import _dtype_arrays
arrays = _dtype_arrays()
line = Mesh(np.array(jax.devices()), ("x",))
grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
def on(mesh, spec):
  return lambda x: NamedSharding(mesh, P(*spec[:np.ndim(x)]))
layouts = {
    "one device": lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[5]),
    "replicated": on(line, ()),
    "rows": on(line, ("x",)),
    "columns": lambda x: on(line, (None, "x") if np.ndim(x) > 1 else ())(x),
    "grid": on(grid, ("a", "b")),
    "fsdp=8": lambda x: sharding.leaf_sharding(np.shape(x), sharding.make_mesh(8)),
    "fsdp=2": lambda x: sharding.leaf_sharding(np.shape(x), sharding.make_mesh(2)),
}
out = {}
for name, where in layouts.items():
  placed = {k: jax.device_put(x, where(x)) for k, x in arrays.items()}
  assert name in ("one device", "replicated") or not placed["f32"].is_fully_replicated, name
  out[name] = checkpointing.array_checksums(placed)
print(json.dumps(out))
"""


def test_digests_are_the_same_on_every_layout_and_device_count():
  """One device here; eight devices in a subprocess, each array replicated or split along
  either axis or both: the same digest of every dtype."""
  here = checkpointing.array_checksums(_dtype_arrays())
  assert len(set(here.values())) == len(here)
  assert here["['keys']"].startswith("uint32[8,2]:") and here["['bf16']"].startswith(
      "bfloat16[8,24]:")
  for name, digests in json.loads(_run_on_eight_devices(LAYOUTS)).items():
    assert digests == here, name


def test_nonfinite_leaves_names_exactly_the_leaves_that_hold_a_nan_or_an_inf():
  """The finite flags are reduced per group of like-shaped leaves (tree_checks, and alone in
  nonfinite_leaves), and a group's leaves need not be neighbours in the tree (a, c, f below; b,
  e): each flag still lands on its own leaf, for every floating dtype; integers, booleans and
  keys are finite. Each digest is that of its leaf alone."""
  x = _dtype_arrays()
  tree = {"a": x["f32"], "b": x["bf16"], "c": x["f32"] * 2, "d": x["f16"], "e": x["bf16"] + 1,
          "f": x["f32"] + 1, "g": x["scalar"], **{f"z_{k}": v for k, v in x.items()}}
  assert checkpointing.nonfinite_leaves(tree) == []
  for bad in (["f"], ["a", "c"], ["e", "d", "g"], ["c", "z_vector"]):
    damaged = dict(tree)
    for name, value in zip(bad, (np.nan, np.inf, -np.inf)[:len(bad)], strict=True):
      leaf = np.array(damaged[name])
      leaf.reshape(-1)[-1] = value
      damaged[name] = leaf
    assert sorted(checkpointing.nonfinite_leaves(damaged)) == sorted(f"['{n}']" for n in bad)
    assert sorted(checkpointing.tree_checks(damaged)[1]) == sorted(f"['{n}']" for n in bad)
  together = checkpointing.array_checksums(tree)
  assert together == {f"['{k}']": checkpointing.array_checksums({k: v})[f"['{k}']"]
                      for k, v in tree.items()}


def _numpy_digest(words: np.ndarray) -> str:
  """The device-v1 digest of a leaf's uint32 words, written out in numpy (uint64 arithmetic,
  masked to 32 bits)."""
  mask = np.uint64(0xFFFFFFFF)

  def fmix32(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & mask
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & mask
    return h ^ (h >> np.uint64(16))

  w = words.reshape(-1).astype(np.uint64)
  index = np.arange(w.size, dtype=np.uint64)
  lanes = [int(fmix32(w ^ fmix32(index ^ np.uint64(seed))).sum() & mask)
           for seed in checkpointing._SEEDS]
  return "".join(f"{v:08x}" for v in lanes)


@pytest.fixture(params=["program", "host"])
def check_path(request, monkeypatch):
  """`tree_checks` by its compiled program, or in NumPy on the host (a small tree's way)."""
  monkeypatch.setattr(checkpointing, "HOST_CHECK_ELEMENTS",
                      -1 if request.param == "program" else 1 << 21)
  return request.param


def test_digests_keep_the_format_existing_checkpoints_hold(check_path):
  """Golden digests (device-v1): a change to how they are computed that changes a value would
  make every stored checkpoint fail its check. Leaves of one shape are digested as a stack.
  The same digests by the compiled program and in NumPy on the host."""
  tree = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
          "b": -np.arange(12, dtype=np.float32).reshape(3, 4),
          "levels": np.arange(5, dtype=np.uint8), "mask": np.array([[True, False], [False, True]]),
          "scale": np.float32(0.5), "key": jax.random.key(0)}
  assert checkpointing.array_checksums(tree) == {
      "['a']": "float32[3,4]:6b261eeabf5de127d84f726eb23e06f4",
      "['b']": "float32[3,4]:072c8535a6703a3489537a460558d528",
      "['key']": "uint32[2]:a232a6ebeff6e91275cf7c7e7a1543c7",
      "['levels']": "uint8[5]:fe9f4e8400f6dbe8e9f05a1861172884",
      "['mask']": "bool[2,2]:e3baa1ff6681c07493460c2f3f371bfe",
      "['scale']": "float32[]:5cd83e52f3397565c31c02bcc4680f63"}
  assert _numpy_digest(tree["a"].view(np.uint32)) == "6b261eeabf5de127d84f726eb23e06f4"
  assert _numpy_digest(tree["levels"]) == "fe9f4e8400f6dbe8e9f05a1861172884"


def test_host_checks_equal_the_programs_bit_for_bit():
  """`_host_tree_checks` (NumPy) against `_tree_checks` (compiled) on every dtype a state holds,
  NumPy leaves jit would narrow (float64, int64: checked as jit sees them), complex numbers,
  zero-size leaves, and NaN/Inf in each floating dtype: the same digests and finite flags."""
  x = _dtype_arrays()
  rng = np.random.default_rng(1)
  leaves = [*x.values(), rng.standard_normal((5, 3)), rng.integers(-9, 9, (4,)),
            (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
            np.zeros((0, 4), np.float32), jnp.asarray(x["f32"])]
  for name, inf in (("f32", np.inf), ("bf16", -np.inf), ("f16", np.nan), ("vector", np.nan)):
    bad = np.array(x[name])
    bad.reshape(-1)[3] = inf
    leaves.append(bad)
  want_sums, want_finite = jax.device_get(checkpointing._tree_checks(
      [jax.random.key_data(v) if checkpointing._is_key(v) else v for v in leaves]))
  got_sums, got_finite = checkpointing._host_tree_checks(leaves)
  np.testing.assert_array_equal(got_sums, want_sums)
  np.testing.assert_array_equal(got_finite, want_finite)
  assert list(got_finite).count(False) == 4


def test_a_large_tree_or_a_split_one_is_checked_by_the_program(monkeypatch):
  """The NumPy path is for small trees on one device; past HOST_CHECK_ELEMENTS the compiled
  program runs (and gives the same digests), as it does for arrays on several devices (where
  nothing is gathered to a host: test_a_sharded_state_is_saved_shard_by_shard_...)."""
  tree = {"a": np.arange(64, dtype=np.float32), "b": np.ones((8, 8), np.float32)}
  calls, on_host = [], checkpointing._host_tree_checks
  monkeypatch.setattr(checkpointing, "_host_tree_checks",
                      lambda leaves: calls.append(1) or on_host(leaves))
  small = checkpointing.array_checksums(tree)
  monkeypatch.setattr(checkpointing, "HOST_CHECK_ELEMENTS", 127)
  assert checkpointing.array_checksums(tree) == small and calls == [1]


def test_digests_change_with_any_flipped_byte_and_with_moved_elements():
  for name, x in _dtype_arrays().items():
    data = checkpointing.to_numpy(x)
    want = checkpointing.array_checksums({"x": data})["['x']"]
    flat = data.reshape(-1).view(np.uint8)
    for i in {0, 1, 2, 3, flat.size // 2, flat.size - 1}:  # every byte of an element too
      for bit in (0x01, 0x80):
        damaged = flat.copy()
        damaged[i] ^= bit
        got = checkpointing.array_checksums({"x": damaged.view(data.dtype).reshape(data.shape)})
        assert got["['x']"] != want, (name, i, bit)
    if data.size > 1:  # the same values elsewhere
      swapped = data.reshape(-1).copy()
      swapped[[0, -1]] = swapped[[-1, 0]]
      if not np.array_equal(swapped, data.reshape(-1)):
        assert checkpointing.array_checksums({"x": swapped.reshape(data.shape)})["['x']"] != want
    if data.ndim > 1:  # the same bits in another shape: told apart by the recorded shape
      assert checkpointing.array_checksums({"x": data.reshape(-1)})["['x']"] != want
  # Every lane differs, not only one: a 128-bit digest.
  a = checkpointing.array_checksums({"x": np.zeros(4, np.float32)})["['x']"].split(":")[1]
  b = checkpointing.array_checksums({"x": np.array([0, 0, 1e-45, 0], np.float32)})["['x']"]
  assert all(a[i:i + 8] != b.split(":")[1][i:i + 8] for i in range(0, 32, 8))


SHARDED_SAVE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from olora_jax import checkpointing, sharding
workdir = sys.argv[1]

def tree(v):
  return {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * v,
          "b": jnp.full((32,), v), "frozen": jnp.ones((16, 64), jnp.bfloat16),
          "key": jax.random.key(int(v)), "empty": jnp.zeros((0, 8))}

def placed(t, fsdp):
  return sharding.place_state(t, sharding.state_shardings(t, sharding.make_mesh(fsdp)))

initial = placed(tree(0.0), 8)
state = {**placed(tree(2.0), 8), "frozen": initial["frozen"]}
progress = checkpointing.Progress.initial(10)
progress.cursor = 1
ckpt = checkpointing.Checkpointer(workdir, 2, initial=initial)
largest = [0]  # the most elements copied to the host at once during the save
ArrayImpl = type(jnp.zeros(()))  # JAX's array class, not named by a private module path
value = ArrayImpl._value
def spy(self):
  largest[0] = max(largest[0], self.size)
  return value.fget(self)
def refuse(*args, **kwargs):
  raise AssertionError("a save gathered an array across processes")
ArrayImpl._value, multihost_utils.process_allgather = property(spy), refuse
ckpt.save(state, progress, {"config": {}, "stream_sha256": "s"})
ArrayImpl._value = value
shard = state["w"].addressable_shards[0].data.size
assert state["w"].size == 8 * shard and 0 < largest[0] <= shard, (largest, shard)

def same(a, b):
  a, b = checkpointing.to_numpy(a), checkpointing.to_numpy(b)
  return all(x.dtype == y.dtype and np.array_equal(x, y)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

# Back on the template's shardings: the run's own mesh, or another one (a resume on fsdp=2).
for fsdp in (8, 2):
  template = placed(tree(0.0), fsdp)
  arrays, _ = checkpointing.Checkpointer(workdir, 2, initial=template).restore_latest(template)
  assert same(arrays, state), fsdp
  for path, r, t in zip(jax.tree_util.tree_flatten_with_path(arrays)[0],
                        jax.tree.leaves(arrays), jax.tree.leaves(template), strict=True):
    assert r.sharding == t.sharding, (fsdp, path[0], r.sharding, t.sharding)
  assert jax.dtypes.issubdtype(arrays["key"].dtype, jax.dtypes.prng_key)
  print("RESTORED", fsdp)
"""


def test_a_sharded_state_is_saved_shard_by_shard_and_restored_on_the_templates_shardings(
    tmp_path):
  """FSDP over eight devices: no array is copied whole to the host during a save (the largest
  host copy is one shard), nothing is gathered across processes, and a restore puts every leaf
  on its template's sharding, on the saving mesh or another."""
  out = _run_on_eight_devices(SHARDED_SAVE, str(tmp_path))
  assert "RESTORED 8" in out and "RESTORED 2" in out
  sums = json.loads((tmp_path / "checkpoints" / "1" / "checksums" / "metadata").read_text())
  assert sums["digest"] == checkpointing.DIGEST_KIND
  assert "['frozen']" in sums["from_initial"] and "['w']" in sums["arrays"]


def test_a_checkpoint_of_the_sha256_format_still_restores_and_verifies(tmp_path, caplog):
  """Workdirs written before device digests resume: their arrays are checked against their
  SHA-256 (damage still quarantines them), their left-out leaves against the initial state."""
  initial = {"frozen": jnp.arange(512, dtype=jnp.float32), **_tree(0.0)}
  ckpt = checkpointing.Checkpointer(str(tmp_path), max_to_keep=5, initial=initial)
  meta = {"config": {}, "stream_sha256": "s"}
  states = {step: {**_tree(float(step)), "frozen": initial["frozen"]} for step in (1, 2)}
  for step, state in states.items():
    legacy_checkpoint.save(ckpt, step, state, {"progress": _progress(step).to_json(), **meta},
                           initial=initial)
  sums = json.loads((tmp_path / "checkpoints" / "2" / "checksums" / "metadata").read_text())
  assert "digest" not in sums and "['frozen']" in sums["from_initial"]
  arrays, host = ckpt.restore_latest(initial)
  _assert_tree_equal(arrays, states[2])
  assert host["progress"]["cursor"] == 2
  assert jax.dtypes.issubdtype(arrays["key"].dtype, jax.dtypes.prng_key)

  other = {**initial, "frozen": initial["frozen"].at[3].set(-1.0)}
  with pytest.raises(checkpointing.InitialStateChanged, match=r"\['frozen'\]"):
    checkpointing.Checkpointer(str(tmp_path), 5, initial=other).restore_latest(other)

  path = _largest_array_file(str(tmp_path), 2)
  data = bytearray(open(path, "rb").read())
  for i in range(64, len(data), 401):
    data[i] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with caplog.at_level(logging.WARNING):
    arrays, _ = ckpt.restore_latest(initial)
  _assert_tree_equal(arrays, states[1])
  assert "checkpoint 2" in caplog.text and (tmp_path / "corrupt_checkpoints" / "2").is_dir()
  # The run goes on in the new format, next to the old checkpoint.
  ckpt.save({**_tree(3.0), "frozen": initial["frozen"]}, _progress(3), meta)
  assert ckpt.steps() == [1, 3]
  _assert_tree_equal(ckpt.restore_latest(initial)[0], {**_tree(3.0), "frozen": initial["frozen"]})


def test_a_checkpoint_of_an_unknown_digest_kind_is_refused_not_quarantined(tmp_path):
  ckpt = _save_two(str(tmp_path))
  path = tmp_path / "checkpoints" / "2" / "checksums" / "metadata"
  path.write_text(json.dumps({**json.loads(path.read_text()), "digest": "device-v9"}))
  with pytest.raises(checkpointing.WorkdirError, match=r"kind 'device-v9'.*pass a new"):
    ckpt.restore_latest(_tree(0.0))
  assert ckpt.steps() == [1, 2]
