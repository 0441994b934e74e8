"""Bad input is refused before any compute: one clear line, exit code 2, the workdir untouched."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from configs import common, demo, tiny
from olora_jax import fidelity, trainer, validation
from olora_jax.data import sources as sources_lib
from olora_jax.pretrained import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(workdir: Path) -> dict | None:
  if not workdir.exists():
    return None
  return {str(p.relative_to(workdir)): (p.stat().st_mtime_ns, p.read_bytes())
          for p in workdir.rglob("*") if p.is_file()}


def _refused(config: ml_collections.ConfigDict, workdir: Path, error, match: str) -> None:
  """The run raises `error` matching `match`, in one line, and leaves `workdir` as it was."""
  before = _snapshot(workdir)
  with pytest.raises(error, match=match) as err:
    trainer.train_and_evaluate(config, str(workdir), progress=False)
  assert "\n" not in str(err.value)
  assert _snapshot(workdir) == before


BAD_VALUES = [
    ("learner.learning_rate", 0.0, r"learner.learning_rate=0.0 must be > 0"),
    ("learner.learning_rate", -1e-3, r"learner.learning_rate=-0.001 must be > 0"),
    ("learner.rank", 0, r"learner.rank=0 must be in \[1, width=16\]"),
    ("learner.rank", 17, r"learner.rank=17 must be in \[1, width=16\]"),
    ("learner.window", 0, r"learner.window=0 must be >= 1"),
    ("learner.mean_threshold", 0.0, r"learner.mean_threshold=0.0 must be > 0"),
    ("learner.var_threshold", -0.1, r"learner.var_threshold=-0.1 must be > 0"),
    ("learner.batch_size", 0, r"learner.batch_size=0 must be >= 1"),
    ("data.validation_fraction", 1.0, r"data.validation_fraction=1.0 must be in \[0, 1\)"),
    ("learner.buffer_size", -1, r"learner.buffer_size=-1 must be >= 0"),
    ("learner.reg_lambda", -1.0, r"learner.reg_lambda=-1.0 must be >= 0"),
    ("eval.eval_every", 0, r"eval.eval_every=0 must be >= 1"),
    ("eval.predict_chunk", 48, r"eval.predict_chunk=48 must be 0 .* divide the 128 rows"),
    ("checkpoint_every", -1, r"checkpoint_every=-1 must be >= 0"),
    ("max_to_keep", 0, r"max_to_keep=0 must be >= 1"),
    ("data.scenario", "blurry", r"unknown data.scenario='blurry'"),
    ("data.dataset", "cifar100_missing", r"unknown data.dataset='cifar100_missing'"),
    ("data.n_tasks", 3, r"data.n_tasks=3 must be >= 1 and divide the 10 classes"),
    ("data.class_order", [0, 1, 2], r"data.class_order misses \[3, 4, .* list every class exactly"),
    ("data.dataset", "no_such_module_xyz:load", r"cannot import 'no_such_module_xyz'"),
    ("data.scenario", "domain", r"data.scenario='domain' needs a dataset with per-sample domain"),
    ("method", "ewc", r"unknown method='ewc'; use one of \('online_lora', 'agem'"),
    ("pretrained.keep_head", True, r"pretrained.keep_head=True needs a checkpoint"),
    ("learner.adam_bias_correction", "float64", r"unknown learner.adam_bias_correction"),
    ("data.preprocess", "gpu", r"unknown data.preprocess='gpu'; use one of \('host', 'device'\)"),
]


@pytest.mark.parametrize("key,value,match", BAD_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_VALUES])
@pytest.mark.parametrize("existing", [False, True], ids=["new_workdir", "existing_workdir"])
def test_bad_config_values_are_refused_before_anything_is_written(tmp_path, key, value, match,
                                                                  existing):
  workdir = tmp_path / "run"
  if existing:  # an unrelated file in a workdir that already exists
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
  config = tiny.get_config()
  section, _, leaf = key.rpartition(".")
  setattr(config[section] if section else config, leaf, value)
  _refused(config, workdir, ValueError, match)


def test_unknown_fidelity_and_scenario_names_are_refused():
  config = tiny.get_config()
  config.fidelity = "papr"
  with pytest.raises(ValueError, match=r"unknown fidelity='papr'; use one of"):
    fidelity.resolve(config)
  config = fidelity.resolve(tiny.get_config())
  config.data.scenario = "blurry"
  with pytest.raises(validation.InputError, match=r"unknown data.scenario='blurry'; use one of"):
    validation.check_config(config, width=16)


def test_unknown_config_keys_are_refused():
  config = tiny.get_config()
  config.unlock()
  config.learner.lerning_rate = 1.0
  with pytest.raises(validation.InputError, match=r"unknown config key\(s\) learner.lerning_rate:"
                     r" .* \(did you mean learner.learning_rate\?\)"):
    validation.check_known_keys(config, common.get_config())
  validation.check_known_keys(tiny.get_config(), common.get_config())  # the real one passes
  config.mvp.query_before_norm = True  # renamed: the line names the key to give instead
  with pytest.raises(validation.InputError, match=r"mvp.query_before_norm is now mvp.query"):
    validation.check_known_keys(config, common.get_config())


@pytest.mark.parametrize("name", ["swin_t", "swin_custom"])
def test_a_vit_file_for_a_swin_is_said_first(tmp_path, name):
  """The demo's ViT weights with model.name='swin_t' were first refused for the Swin's image
  size (32 is no multiple of its window); following that advice only then led to the line that
  the file holds a ViT. That line comes first."""
  config = demo.get_config()
  config.model.name = name
  _refused(config, tmp_path / "run", CheckpointError, re.escape(
      f"checkpoint {config.pretrained.path} holds a ViT, but the model (model.name) is a Swin:"
      " give a Swin's weights in pretrained.path, or a model.name of the ViT this file holds;"
      " for the demo on a Swin run configs/demo_swin.py"))


def test_missing_or_malformed_pretrained_checkpoint(tmp_path):
  config = tiny.get_config()
  config.pretrained.path = str(tmp_path / "absent.safetensors")
  _refused(config, tmp_path / "run", FileNotFoundError, r"does not exist")
  bad = tmp_path / "truncated.safetensors"
  bad.write_bytes(b"\x10\x00\x00")
  config.pretrained.path = str(bad)
  _refused(config, tmp_path / "run", CheckpointError, r"cannot read checkpoint")


def _patched_source(monkeypatch, images_fn=None, labels_fn=None, num_classes=None) -> None:
  real = sources_lib.load_source

  def load(name, split, *args):
    s = real(name, split, *args)
    images = images_fn(s.images) if images_fn else s.images
    labels = labels_fn(s.labels) if labels_fn else s.labels
    return sources_lib.Source(s.name, s.split, images, labels, num_classes or s.num_classes)

  monkeypatch.setattr(sources_lib, "load_source", load)


@pytest.mark.parametrize("images_fn,match", [
    (lambda x: x.astype(np.float32) / 255, r"images must be uint8, got float32"),
    # The split's shape (its 1438 training images), not that of the 8 images checked.
    (lambda x: x[..., 0], r"images must be \(N, H, W, 1\|3\), got shape \(1438, 8, 8\)"),
    (lambda x: np.repeat(x, 2, axis=-1), r"got shape \(1438, 8, 8, 2\)"),
], ids=["float_images", "no_channel_axis", "two_channels"])
def test_images_of_the_wrong_dtype_or_shape(tmp_path, monkeypatch, images_fn, match):
  _patched_source(monkeypatch, images_fn=images_fn)
  _refused(tiny.get_config(), tmp_path / "run", validation.InputError, match)


def test_labels_out_of_range(tmp_path, monkeypatch):
  _patched_source(monkeypatch, num_classes=9)  # label 9 exists
  _refused(tiny.get_config(), tmp_path / "run", validation.InputError,
           r"labels span \[0, 9\] but must lie in \[0, 9\)")
  monkeypatch.undo()
  _patched_source(monkeypatch, labels_fn=lambda y: np.where(y == 3, -1, y))
  _refused(tiny.get_config(), tmp_path / "run", validation.InputError, r"labels span \[-1, 9\]")


def test_a_stray_huge_label_is_refused_naming_it(tmp_path, monkeypatch):
  """A user dataset's classes are 1 + its largest label: one label of 10^12 made the stream
  builder ask for a 7 TiB array (exit 4, "out of memory ... lower learner.batch_size")."""
  _patched_source(monkeypatch, labels_fn=lambda y: np.where(np.arange(len(y)) == 5, 10**12, y),
                  num_classes=10**12 + 1)
  _refused(tiny.get_config(), tmp_path / "run", validation.InputError, re.escape(
      "data.dataset='sklearn_digits': 1000000000001 classes (0..1000000000000), more than its"
      " 1797 examples (11 distinct labels, the largest 1000000000000); relabel the classes as"
      " 0..C-1, e.g. classes, labels = np.unique(labels, return_inverse=True)"))


class _StoredAtManySizes(sources_lib.Source):
  """An in-memory split that cannot promise one stored size (as a folder of photographs)."""

  @property
  def raw_image_shape(self):
    return None


def test_device_preprocessing_of_images_without_one_stored_size(tmp_path, monkeypatch):
  real = sources_lib.load_sources

  def load(data_config, image_size):
    train, test = real(data_config, image_size)
    return _StoredAtManySizes(train.name, train.split, train.images, train.labels,
                              train.num_classes), test

  monkeypatch.setattr(sources_lib, "load_sources", load)
  config = tiny.get_config()
  config.data.augment, config.data.preprocess = "crop_flip", "device"
  _refused(config, tmp_path / "run", ValueError,
           r"data.preprocess='device' ships fixed-shape uint8 batches, but the raw training"
           r" images of data.dataset='sklearn_digits' \(train split\) do not share one stored"
           r" size \(raw_image_shape=None\); use data.preprocess='host'")


def _cli(workdir: Path, *overrides: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, str(ROOT / "launch" / "run.py"), "--config",
       str(ROOT / "configs" / "tiny.py"), "--workdir", str(workdir), *overrides],
      cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("override,message", [
    ("--config.learner.lerning_rate=1",
     "error: unknown config key(s) learner.lerning_rate: no code reads them; fix the spelling"
     " (did you mean learner.learning_rate?) or remove them"),
    # A renamed key names its replacement (issue 42 replaced CODA's block count).
    ("--config.coda_prompt.n_blocks=10", "error: unknown config key(s) coda_prompt.n_blocks:"
     " coda_prompt.n_blocks is now coda_prompt.n_tasks"),
    ("--config.learner.rank=0", "error: learner.rank=0 must be in [1, width=16]"),
    ("--config.data.stream_manifest=/nonexistent/m.json",
     "error: data.stream_manifest='/nonexistent/m.json' does not exist"),
    # A preset sizes itself: a size key for it would change nothing (issue: swin_t silently ran
    # with its window 7 after --config.model.window_size=4).
    (("--config.model.name=swin_t", "--config.model.window_size=4"),
     "error: model.name='swin_t' is a preset with its own sizes: --config.model.window_size would"
     " change nothing (the preset's is 7); drop it, or use model.name='swin_custom'"),
    (("--config.model.name=vit_s16", "--config.model.depth=3"),
     "error: model.name='vit_s16' is a preset with its own sizes: --config.model.depth would"
     " change nothing (the preset's is 12); drop it, or use model.name='custom'"),
], ids=["unknown_key", "renamed_key", "bad_value", "missing_manifest", "swin_preset_window",
      "vit_preset_depth"])
def test_command_line_exit_code_2_and_one_line(tmp_path, override, message):
  workdir = tmp_path / "run"
  done = _cli(workdir, *((override,) if isinstance(override, str) else override))
  assert done.returncode == 2
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(message), done.stderr[-1000:]
  assert not workdir.exists()


@pytest.mark.parametrize("assignment,key", [
    ("config.learner.learning_rat = 3e-4", "learner.learning_rat"),
    ('config["learner"]["learning_rat"] = 3e-4', "learner.learning_rat"),
], ids=["attribute", "item"])
def test_an_unknown_key_set_in_a_config_file_is_one_clean_line(tmp_path, assignment, key):
  """ml_collections refuses it with its whole block printed (escaped quotes, FieldReference
  addresses, a literal \\n, the suggestion last): the line names the key, where the file sets
  it and the key meant."""
  config_file = tmp_path / "my_config.py"
  config_file.write_text("from configs import tiny\n\n\ndef get_config():\n"
                         f"  config = tiny.get_config()\n  {assignment}\n  return config\n")
  workdir = tmp_path / "run"
  done = subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), "--config",
                         str(config_file), "--workdir", str(workdir)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  assert done.stderr.splitlines()[-1] == (
      f"error: unknown config key(s) {key} set at {config_file}:6: no code reads them; fix the"
      " spelling (did you mean learner.learning_rate?) or remove them (the keys are listed in"
      " configs/common.py)"), done.stderr[-1000:]
  assert not workdir.exists()
