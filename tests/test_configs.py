"""Every config file loads, is locked, validates and builds its stream: the TFDS benchmarks on
`tfds.testing.mock_data`, CORe50 on a generated folder in its public layout. No test downloads
anything (a guard makes any network connection an error)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags
from ml_collections import config_flags

from olora_jax import pretrained, trainer
from olora_jax.data import core50
from olora_jax.data.manifest import manifest_sha256
from tests.data_fixtures import no_network, write_core50_folder  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_network")

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
# setting -> (dataset, scenario, number of tasks)
BENCHMARKS = {
    "split_cifar100": ("cifar100", "disjoint", 10),
    "split_imagenet_r": ("imagenet_r", "disjoint", 10),
    "split_imagenet_s": ("imagenet_sketch", "disjoint", 10),
    "split_imagenet_s20": ("imagenet_sketch", "disjoint", 20),
    "split_cub200": ("caltech_birds2011", "disjoint", 5),
    "si_blurry_cifar100": ("cifar100", "si_blurry", 5),
    "si_blurry_imagenet_r": ("imagenet_r", "si_blurry", 5),
    "si_blurry_imagenet_s": ("imagenet_sketch", "si_blurry", 5),
    "core50": ("core50", "domain", 8),
}
MOCK_EXAMPLES = 2000


def load_config(name: str, *args):
  spec = importlib.util.spec_from_file_location(f"config_{name}", CONFIGS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


def test_every_config_file_is_covered():
  files = {p.stem for p in CONFIGS.glob("*.py")} - {"__init__", "common", "benchmark"}
  from test_benchmarks_more import NEW_BENCHMARKS  # tested there, on stand-ins of their own

  assert files == set(BENCHMARKS) | {"demo", "demo_si_blurry", "demo_reversed", "demo_swin",
                                      "tiny", "rotated_mnist"} | set(NEW_BENCHMARKS)


@pytest.fixture(scope="module")
def core50_data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("core50_configs")
  write_core50_folder(str(root / "manual"), frames=1)
  core50.build(str(root / "manual"), str(root / "tfds"))
  return str(root / "tfds")


def _setup(config, data_dir):
  config.pretrained.path = ""  # the benchmark checkpoints are user-supplied files
  config.data.data_dir = data_dir
  config.data.num_workers = 2
  if config.data.dataset == "core50":
    return trainer.Setup(config)
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    return trainer.Setup(config)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_config_builds_its_stream(name, core50_data_dir, tmp_path):
  dataset, scenario, n_tasks = BENCHMARKS[name]
  config = load_config(name)
  assert config.is_locked
  assert (config.data.dataset, config.data.scenario) == (dataset, scenario)
  assert config.model.name == "vit_b16" and config.learner.learning_rate == 2e-4
  assert config.pretrained.path.endswith("vit_base_patch16_224.augreg2_in21k_ft_in1k.safetensors")
  small = load_config(name, "vit_s16")
  assert small.model.name == "vit_s16" and small.learner.learning_rate == 5e-4
  assert small.pretrained.path.endswith("vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors")
  data_dir = core50_data_dir if dataset == "core50" else str(tmp_path)
  setup = _setup(config, data_dir)
  stream = setup.stream
  assert stream.n_tasks == n_tasks
  ids = np.concatenate(stream.steps)
  assert len(np.unique(ids)) == len(ids) == len(setup.train_source)  # one pass, no repeats
  assert all(1 <= len(s) <= config.learner.batch_size for s in stream.steps)
  present = np.unique(setup.train_source.labels)
  assert set(present) <= set(np.concatenate(stream.task_classes))  # every class is covered
  if scenario == "disjoint":
    assert len(np.unique(np.concatenate(stream.task_classes))) == sum(
        len(c) for c in stream.task_classes) == setup.num_classes
  # The same config and seed give the same manifest; another seed, another one.
  again = _setup(load_config(name), data_dir)
  assert manifest_sha256(again.manifest) == manifest_sha256(setup.manifest)
  other = load_config(name)
  other.seed = 1
  assert manifest_sha256(_setup(other, data_dir).manifest) != manifest_sha256(setup.manifest)


@pytest.mark.parametrize("name", ["demo", "demo_si_blurry", "demo_reversed", "demo_swin", "tiny",
                                  "rotated_mnist"])
def test_embedded_configs_build_their_streams(name):
  setup = trainer.Setup(load_config(name))
  if name == "demo_swin":  # the demo's stream, on a Swin whose last stage's window is its map
    assert setup.spec.stage_resolution(2) == setup.spec.window_size == 4
    path = load_config(name).pretrained.path  # the shipped backbone, in timm's Swin layout
    assert pretrained.detect_format(path) == "timm"
    assert pretrained.load_pretrained(path, setup.spec, 10)["head"]["kernel"].shape == (64, 10)
    assert manifest_sha256(setup.manifest) == manifest_sha256(
        trainer.Setup(load_config("demo")).manifest)
  ids = np.concatenate(setup.stream.steps)
  assert len(np.unique(ids)) == len(ids) == len(setup.train_source)
  assert setup.stream.n_tasks == 5 and setup.train_source.num_classes == 10
  if name == "demo_reversed":  # the demo's digits and split, its tasks 9-8, 7-6, ..., 1-0
    demo = trainer.Setup(load_config("demo"))
    assert [sorted(c) for c in setup.stream.task_classes] == [
        sorted(c) for c in reversed(demo.stream.task_classes)] == [[8, 9], [6, 7], [4, 5],
                                                                  [2, 3], [0, 1]]
    assert len(setup.train_source) == len(demo.train_source)
  if name == "demo_si_blurry":  # blurry: some digit is met in more than one task
    assert sum(len(c) for c in setup.stream.task_classes) > 10
    assert manifest_sha256(setup.manifest) != manifest_sha256(
        trainer.Setup(load_config("demo")).manifest)


def test_backbone_override_through_the_command_line_flag():
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, lock_config=True)
  values(["prog", f"--config={CONFIGS / 'split_cifar100.py'}:vit_s16"])
  assert values.config.model.name == "vit_s16" and values.config.is_locked
  assert load_config("split_cifar100", "vit_h14").model.name == "vit_h14"
  with pytest.raises(ValueError, match="unknown backbone 'vit_g14'"):
    load_config("split_cifar100", "vit_g14")


def test_si_blurry_end_to_end_on_mock_data(tmp_path):
  """A tiny ViT through the real trainer on a mocked Si-Blurry CIFAR-100 stream."""
  config = load_config("si_blurry_cifar100")
  tiny = load_config("tiny")
  config.model = tiny.model
  config.pretrained.path = ""
  config.data.data_dir = str(tmp_path / "tfds")
  config.data.num_workers = 2
  config.data.augment = "crop_flip"
  config.learner.batch_size = 16
  config.eval.eval_every = 100
  config.eval.batch_size = 64
  config.learner.incremental_lora = False  # the learner has its own tests; this one is the data
  with tfds.testing.mock_data(num_examples=300):
    results = trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  manifest = tmp_path / "run" / "stream_manifest.json"
  assert hashlib.sha256(manifest.read_bytes()).hexdigest() == results["stream_manifest_sha256"]
  loaded = json.loads(manifest.read_text())
  assert loaded["params"]["scenario"] == "si_blurry" and len(loaded["task_classes"]) == 5
  assert results["samples_seen"] == sum(len(s) for s in loaded["steps"]) == 300
  assert len(results["task_end_steps"]) == 5 and len(results["anytime_accuracy"]) == 3
