"""The benchmarks beyond the paper's (issue 51): each config loads and builds its stream on a small
stand-in in the dataset's real layout, made here (TFDS's mock data for the TFDS datasets, folders
in tmp_path for the others); TinyImageNet's folder reader and the sequences of datasets
(olora_jax/data/sequences.py) on their own. Nothing is downloaded."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image
from test_configs import load_config

from olora_jax import errors, trainer
from olora_jax.data import folder_sources, sequences, sources
from tests.data_fixtures import no_network  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_network")

# setting -> (dataset, scenario, number of tasks, classes); test_configs.py covers them with this
NEW_BENCHMARKS = {
    "split_cifar10": ("cifar10", "disjoint", 5, 10),
    "split_tiny_imagenet": ("tiny_imagenet", "disjoint", 10, 200),
    "five_datasets": ("five_datasets", "disjoint", 5, 50),
    "split_imagenet_a": ("imagenet_a", "disjoint", 20, 200),
    "split_vtab": ("vtab", "disjoint", 5, 50),
    "split_omnibenchmark": ("omnibenchmark", "disjoint", 10, 300),
    "domainnet": ("domainnet", "domain", 6, 345),
}
MOCK_EXAMPLES = 60  # per TFDS split


def _png(path: str, size: int = 8, grey: bool = False, seed: int = 0) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  rng = np.random.default_rng(seed)
  shape = (size, size) if grey else (size, size, 3)
  Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


def write_tiny_imagenet(root: str, classes: int = 200, per_class: int = 1) -> str:
  """tiny-imagenet-200/ as shipped: train/<wnid>/images/*.JPEG (+ the boxes file), val/images/
  with val_annotations.txt, and an unlabelled test/images/."""
  wnids = [f"n{10000000 + 7 * i:08d}" for i in range(classes)]
  lines = []
  for c, wnid in enumerate(wnids):
    for j in range(per_class):
      _png(os.path.join(root, "train", wnid, "images", f"{wnid}_{j}.JPEG"), seed=c)
      name = f"val_{c * per_class + j}.JPEG"
      _png(os.path.join(root, "val", "images", name), seed=1000 + c)
      lines.append(f"{name}\t{wnid}\t0\t0\t8\t8\n")
    with open(os.path.join(root, "train", wnid, f"{wnid}_boxes.txt"), "w") as f:
      f.write("")
  with open(os.path.join(root, "val", "val_annotations.txt"), "w") as f:
    f.writelines(lines[::-1])  # the file's order is not the files' order
  _png(os.path.join(root, "test", "images", "test_0.JPEG"))
  return root


def write_train_test(root: str, classes: int) -> str:
  """train/<class>/ and test/<class>/ ImageFolder trees, one image each (the layout of the
  authors' VTAB, OmniBenchmark and ImageNet-A folders)."""
  for c in range(classes):
    for split in ("train", "test"):
      _png(os.path.join(root, split, f"class_{c:03d}", "0.png"), seed=c)
  return root


def write_notmnist(root: str, per_letter: int = 5) -> str:
  for k, letter in enumerate("ABCDEFGHIJ"):
    for j in range(per_letter):
      _png(os.path.join(root, "notMNIST_small", letter, f"{j}.png"), size=28, grey=True,
           seed=10 * k + j)
  return root


def _data_dir(name: str, tmp_path) -> str:
  if name == "split_tiny_imagenet":
    return write_tiny_imagenet(str(tmp_path / "tiny-imagenet-200"))
  if name in ("split_vtab", "split_omnibenchmark"):
    return write_train_test(str(tmp_path / name), NEW_BENCHMARKS[name][3])
  return write_notmnist(str(tmp_path / "tfds"))  # TFDS's mock data ignores the folder


def _setup(config, data_dir, examples: int = MOCK_EXAMPLES):
  config.data.data_dir, config.data.num_workers = data_dir, 2
  config.pretrained.path = ""  # the benchmark checkpoints are user-supplied files
  config.learner.batch_size = 8  # the stand-ins are small
  with tfds.testing.mock_data(num_examples=examples):
    return trainer.Setup(config)


@pytest.mark.parametrize("name", sorted(NEW_BENCHMARKS))
def test_config_builds_its_stream_on_a_stand_in(name, tmp_path):
  dataset, scenario, n_tasks, num_classes = NEW_BENCHMARKS[name]
  config = load_config(name)
  assert config.is_locked and config.model.name == "vit_b16"
  assert (config.data.dataset, config.data.scenario, config.data.n_tasks) == (
      dataset, scenario, n_tasks)
  examples = MOCK_EXAMPLES
  if dataset == "imagenet_a":  # mock labels are drawn over ImageNet-1k's 1000 classes: it keeps
    # those present (a few images each, not 200 classes of 37): one task of them all
    examples, config.data.n_tasks, n_tasks = 600, 1, 1
    with tfds.testing.mock_data(num_examples=examples):
      config.data.data_dir, config.data.num_workers = str(tmp_path), 2
      train, test = sources.load_sources(config.data, 8)
    labels = np.concatenate([train.labels, test.labels])
    num_classes = train.num_classes
    assert np.array_equal(np.unique(labels), np.arange(num_classes)) and num_classes < 1000
  setup = _setup(config, _data_dir(name, tmp_path), examples)
  assert setup.num_classes == num_classes
  assert setup.stream.n_tasks == n_tasks
  ids = np.concatenate(setup.stream.steps)
  assert len(np.unique(ids)) == len(ids) == len(setup.train_source)  # one pass, no repeats
  images, _ = setup.train_source.get(ids[:4])
  assert images.shape == (4, 224, 224, 3) and images.dtype == np.uint8
  if scenario == "domain":  # one task per domain, in the sequence's order
    stream, domains = setup.stream, setup.train_source.domains
    assert stream.task_domains.tolist() == list(range(6))
    for step, task in zip(stream.steps, stream.step_task, strict=True):
      assert set(domains[step]) == {task}
  elif dataset == "five_datasets":  # task k is dataset k: its labels 10k .. 10k + 9
    assert [sorted(c) for c in setup.stream.task_classes] == [
        list(range(10 * k, 10 * k + 10)) for k in range(5)]


@pytest.mark.parametrize("name, size", [("split_cifar10", 32), ("split_tiny_imagenet", 64)])
def test_resnet_variant_trains_from_scratch_at_the_datasets_size(name, size, tmp_path):
  config = load_config(name, "resnet18_reduced")
  assert (config.model.name, config.model.image_size, config.method) == (
      "resnet18_reduced", size, "er")
  assert config.pretrained.path == "" and config.learner.batch_size == 10
  setup = _setup(config, _data_dir(name, tmp_path))
  assert setup.spec.image_size == size and setup.method.name == "er"


def test_tiny_imagenet_reads_val_as_its_labelled_test_set(tmp_path):
  root = write_tiny_imagenet(str(tmp_path / "tiny"), classes=3, per_class=2)
  train, test = folder_sources.list_tiny_imagenet(root)
  assert train.class_names == tuple(sorted(os.listdir(os.path.join(root, "train"))))
  assert len(train.paths) == len(test.paths) == 6
  assert all(p.startswith("train/") and "/images/" in p for p in train.paths)
  assert list(test.paths) == sorted(test.paths) and all(p.startswith("val/images/")
                                                        for p in test.paths)
  table = dict(line.split("\t")[:2] for line in open(os.path.join(root, "val",
                                                                   "val_annotations.txt")))
  for path, label in zip(test.paths, test.labels, strict=True):  # labels from the annotations
    assert train.class_names[label] == table[path.rsplit("/", 1)[1]]


def test_tiny_imagenet_without_its_annotations_is_refused_in_one_line(tmp_path):
  root = write_tiny_imagenet(str(tmp_path / "tiny"), classes=2)
  os.remove(os.path.join(root, "val", "val_annotations.txt"))
  with pytest.raises(errors.BadInput, match="val_annotations.txt, which is missing; point"):
    folder_sources.list_tiny_imagenet(root)


def test_five_datasets_offsets_each_datasets_classes_and_repeats_grey_channels(tmp_path):
  config = load_config("five_datasets").data
  config.data_dir, config.num_workers = write_notmnist(str(tmp_path)), 2
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    train, test = sources.load_sources(config, 16)
  assert isinstance(train, sequences.SequenceSource) and train.num_classes == 50
  for k in range(5):  # part k: domain k, labels 10k .. 10k + 9
    rows = np.flatnonzero(train.domains == k)
    assert set(train.labels[rows]) <= set(range(10 * k, 10 * k + 10))
    images, labels = train.get(rows[:3])
    assert images.shape == (3, 16, 16, 3) and np.array_equal(labels, train.labels[rows[:3]])
  notmnist = np.flatnonzero(train.domains == 3)
  images, _ = train.get(notmnist[:2])
  assert np.array_equal(images[..., 0], images[..., 2])  # grey letters: one channel repeated
  mixed = np.array([0, notmnist[0], len(train) - 1])  # rows of several parts, in given order
  images, labels = train.get(mixed)
  assert np.array_equal(labels, train.labels[mixed])
  np.testing.assert_array_equal(images[1], train.get(notmnist[:1])[0][0])
  raw, raw_labels = train.get_raw(mixed)  # each at its part's stored size
  assert [r.shape[:2] for r in raw] == [(32, 32), (28, 28), (28, 28)]
  assert np.array_equal(raw_labels, labels)
  assert len(test) > 0 and test.num_classes == 50


def test_domainnet_parts_share_their_classes_and_are_its_domains(tmp_path):
  config = load_config("domainnet").data
  config.data_dir, config.num_workers = str(tmp_path), 2
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    train, test = sources.load_sources(config, 8)
  assert train.num_classes == test.num_classes == 345
  assert np.array_equal(np.unique(train.domains), np.arange(6))
  assert np.bincount(test.domains).tolist() == [MOCK_EXAMPLES] * 6


def test_a_sequence_refuses_the_folder_source(tmp_path):
  config = load_config("five_datasets").data
  config.data_dir, config.source = str(tmp_path), "folder"
  with pytest.raises(ValueError, match="drop data.source='folder'"):
    sources.load_sources(config, 8)


def test_five_datasets_without_notmnist_says_where_to_put_it(tmp_path):
  config = load_config("five_datasets").data
  config.data_dir, config.num_workers = str(tmp_path), 2
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES), pytest.raises(
      errors.BadInput, match="notMNIST_small, which is not a folder"):
    sources.load_sources(config, 8)
