"""Tests of the TFDS sources (olora_jax/data/tfds_sources.py) on `tfds.testing.mock_data`, and of
the CORe50 builder (olora_jax/data/core50.py) on a generated folder in the public layout. Nothing
is downloaded: a guard makes any network connection an error."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import common
from olora_jax.data import core50, sources, streams, tfds_sources
from olora_jax.data.preprocess import resize_image
from tests.data_fixtures import no_network, write_core50_folder  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_network")


def _data_config(**overrides):
  c = common.get_config().data
  c.unlock()
  c.update(overrides)
  c.num_workers = 2
  return c


@pytest.mark.parametrize("dataset, num_classes, seeded_split", [
    ("cifar100", 100, False), ("imagenet_r", 200, True), ("imagenet_sketch", 1000, True),
    ("caltech_birds2011", 200, False)])
def test_mock_sources(dataset, num_classes, seeded_split, tmp_path):
  n = 400
  with tfds.testing.mock_data(num_examples=n):
    train, test = sources.load_sources(_data_config(dataset=dataset, data_dir=str(tmp_path)), 16)
    assert train.num_classes == test.num_classes == num_classes
    assert train.seeded_split == seeded_split
    ids = np.array([0, 5, 7])
    images, labels = train.get(ids)
    assert images.shape == (3, 16, 16, 3) and images.dtype == np.uint8
    assert np.array_equal(labels, train.labels[ids])
    cached, cached_labels = test.get(ids)  # the test source caches resized images
    again, _ = test.get(ids[::-1])
    assert np.array_equal(again, cached[::-1]) and test._cached.sum() == 3
    assert np.array_equal(cached_labels, test.labels[ids])
    assert np.array_equal(cached[1], resize_image(test._image(5), 16))
    raw, raw_labels = train.get_raw(ids)
    assert np.array_equal(raw_labels, labels) and all(r.dtype == np.uint8 for r in raw)
    # The label column read up front agrees with the records themselves.
    direct = [int(train._data_source[int(r)]["label"]) for r in train.record_ids[:20]]
    if dataset == "imagenet_r":  # ImageNet-1k index -> rank among ImageNet-R's sorted wnids
      names = train._data_source.dataset_info.features["label"].names
      direct = [tfds_sources.IMAGENET_R_WNIDS.index(names[d]) for d in direct]
    assert direct == train.labels[:20].tolist()
    assert 0 <= train.labels.min() and train.labels.max() < num_classes
    if seeded_split:  # one TFDS split, divided 80/20 per class; together they cover it once
      both = np.concatenate([train.record_ids, test.record_ids])
      assert len(np.unique(both)) == len(both)
      if dataset == "imagenet_sketch":
        assert np.array_equal(np.sort(both), np.arange(n))
      else:  # mock labels span all 1000 ImageNet classes; ImageNet-R keeps its 200
        assert 0.1 * n < len(both) < 0.3 * n
      all_labels = np.concatenate([train.labels, test.labels])
      for c in np.unique(all_labels):  # 20% of every class, at least one image, is test
        n_class, n_test = (all_labels == c).sum(), (test.labels == c).sum()
        assert n_test == max(1, round(0.2 * n_class))
    else:
      assert len(train) == len(test) == n


@pytest.mark.parametrize("dataset, raw_shape", [("cifar100", (32, 32, 3)), ("imagenet_r", None)])
def test_raw_image_shape_and_device_preprocessing(dataset, raw_shape, tmp_path):
  """CIFAR-100 stores one size, so crop_flip batches can ship uint8 to the device; ImageNet-R
  does not, and data.preprocess='device' with crop_flip is refused when the pipeline is built."""
  from olora_jax.data.pipeline import InputPipeline

  with tfds.testing.mock_data(num_examples=2000 if dataset == "imagenet_r" else 40):
    train, _ = sources.load_sources(_data_config(dataset=dataset, data_dir=str(tmp_path)), 16)
    assert train.raw_image_shape == raw_shape
    stream = streams.disjoint_class_incremental(train.labels, 1, 8, 0)
    if raw_shape is None:
      with pytest.raises(ValueError, match=r"do not share one stored size .*'host'"):
        InputPipeline(train, stream, 8, 16, augment="crop_flip", preprocess="device")
    else:
      pipe = InputPipeline(train, stream, 8, 16, augment="crop_flip", preprocess="device")
      host = InputPipeline(train, stream, 8, 16, augment="crop_flip")
      assert pipe.batch(0)["images"].shape == (8, 32, 32, 3)
      np.testing.assert_array_equal(np.asarray(pipe.on_device(pipe.batch(0))["images"]),
                                    host.batch(0)["images"])
    # augment 'none': `get` resizes at load, one size whatever the dataset stores
    pipe = InputPipeline(train, stream, 8, 16, preprocess="device")
    assert pipe.batch(0)["images"].shape == (8, 16, 16, 3)


def test_imagenet_r_split_is_seeded(tmp_path):
  with tfds.testing.mock_data(num_examples=2000):  # ~400 records of ImageNet-R's classes
    make = lambda seed: sources.load_sources(
        _data_config(dataset="imagenet_r", data_dir=str(tmp_path), split_seed=seed), 8)[1]
    a, b, c = make(0), make(0), make(1)
  assert np.array_equal(a.record_ids, b.record_ids)
  assert not np.array_equal(a.record_ids, c.record_ids)


def test_unprepared_dataset_says_how_to_prepare(tmp_path):
  with pytest.raises(FileNotFoundError, match="tfds build cifar100 --file_format=array_record"):
    sources.load_sources(_data_config(dataset="cifar100", data_dir=str(tmp_path)), 16)
  with pytest.raises(FileNotFoundError, match="python -m olora_jax.data.core50"):
    sources.load_sources(_data_config(dataset="core50", data_dir=str(tmp_path)), 16)
  with pytest.raises(ValueError, match="unknown data.dataset='cifar1000'"):
    sources.load_sources(_data_config(dataset="cifar1000", data_dir=str(tmp_path)), 16)
  assert not os.listdir(tmp_path) or not any("cifar100" in p for p in os.listdir(tmp_path))


@pytest.fixture(scope="module")
def core50_data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("core50")
  write_core50_folder(str(root / "manual"))
  core50.build(str(root / "manual"), str(root / "tfds"))
  return str(root / "tfds")


def test_core50_builder_splits_by_session(core50_data_dir):
  train, test = sources.load_sources(
      _data_config(dataset="core50", data_dir=core50_data_dir, scenario="domain"), 16)
  assert len(train) == 8 * 50 * 2 and len(test) == 3 * 50 * 2
  assert np.unique(train.metadata["session"]).tolist() == list(core50.TRAIN_SESSIONS)
  assert np.unique(test.metadata["session"]).tolist() == list(core50.TEST_SESSIONS)
  assert train.num_classes == 50
  for s in core50.TRAIN_SESSIONS:  # every object in every session, two frames each
    assert np.array_equal(np.bincount(train.labels[train.metadata["session"] == s]),
                          np.full(50, 2))
  images, _ = train.get(np.arange(4))
  assert images.shape == (4, 16, 16, 3)
  assert "tensorflow" not in sys.modules  # array_record + numpy decoding, no TensorFlow
  # The label/session columns were cached next to the prepared dataset, and read back equal.
  version_dir = os.path.join(core50_data_dir, "core50", "1.0.0")
  assert os.path.isfile(os.path.join(version_dir, "olora_jax_columns_train.npz"))
  again, _ = sources.load_sources(
      _data_config(dataset="core50", data_dir=core50_data_dir, scenario="domain"), 16)
  assert np.array_equal(again.labels, train.labels)
  assert np.array_equal(again.metadata["session"], train.metadata["session"])


def test_core50_stream_sessions_in_order(core50_data_dir):
  data = _data_config(dataset="core50", data_dir=core50_data_dir, scenario="domain")
  data.core50_order = "sequential"  # the paper fidelity's value (resolved from `fidelity` in a run)
  train, _ = sources.load_sources(data, 16)
  stream = streams.build_stream(data, train, 32, seed=0)
  sessions = train.metadata["session"]
  assert stream.n_tasks == 8
  ids = np.concatenate(stream.steps)
  assert len(np.unique(ids)) == len(ids) == len(train)
  first_session = [int(sessions[s[0]]) for s in stream.steps]
  assert all(len(np.unique(sessions[s])) == 1 for s in stream.steps)
  expected = [core50.TRAIN_SESSIONS[t] for t in stream.step_task]
  assert first_session == expected and first_session == sorted(first_session)
  data.core50_order = "shuffled"
  shuffled = streams.build_stream(data, train, 32, seed=0)
  assert shuffled.n_tasks == 1 and len(np.unique(sessions[shuffled.steps[0]])) > 1


def test_core50_builder_rejects_a_wrong_folder(tmp_path):
  with pytest.raises(FileNotFoundError, match="unpack core50_128x128.zip"):
    core50.find_root(str(tmp_path))
  write_core50_folder(str(tmp_path), frames=1, sessions=[1], objects=[1, 2])
  root = core50.find_root(str(tmp_path))
  assert core50.find_root(root) == root  # the folder itself is accepted too
  with pytest.raises(FileNotFoundError, match="o3 is missing"):
    core50.list_session(root, 1)
  with pytest.raises(FileNotFoundError, match="s2 is missing"):
    core50.list_session(root, 2)


def test_domain_scenario_needs_sessions():
  data = _data_config(dataset="mnist_5k", scenario="domain")
  train = sources.load_source("sklearn_digits", "train")
  with pytest.raises(ValueError, match="needs a dataset with per-sample domain ids"):
    streams.build_stream(data, train, 8, 0)
  assert tfds_sources.prepare_command("core50").startswith("python -m olora_jax.data.core50")
