"""The paper's benchmarks through TFDS, read with random access and without TensorFlow.

Each split is opened with `tfds.data_source` (array_record files, decoded with numpy/PIL), never
with `download=True`: the datasets are prepared once on a machine with network, in the
array_record format, and their `data_dir` is given as `config.data.data_dir`:

    tfds build cifar100 imagenet_r imagenet_sketch caltech_birds2011 \\
        --file_format=array_record --data_dir=DIR
    .venv/bin/python -m olora_jax.data.core50 --manual_dir=DIR_WITH_core50_128x128 --data_dir=DIR

| data.dataset        | TFDS name         | classes | train split          | test split           |
|---------------------|-------------------|---------|----------------------|----------------------|
| `cifar100`          | cifar100          | 100     | train (50,000)       | test (10,000)        |
| `imagenet_r`        | imagenet_r        | 200     | 80% of test (30,000) | 20% of test          |
| `imagenet_sketch`   | imagenet_sketch   | 1000    | 80% of test (50,889) | 20% of test          |
| `caltech_birds2011` | caltech_birds2011 | 200     | train (5,994)        | test (5,794)         |
| `core50`            | core50 (ours)     | 50      | sessions 1 2 4 5 6 8 9 11 | sessions 3 7 10 |
| `cifar10`           | cifar10           | 10      | train (50,000)       | test (10,000)        |
| `imagenet_a`        | imagenet_a        | 200     | 80% of test (7,500)  | 20% of test          |
| `mnist`, `fashion_mnist`, `svhn_cropped` | the same | 10 | train      | test                 |

ImageNet-R and ImageNet-Sketch ship a single split and no official test split: as
docs/streams.md fixes, 20% of every class is held out, drawn per class with
`numpy.random.default_rng(data.split_seed)` (`splits.stratified_split`: for each class in label
order, a permutation of its ids; the first round(test_fraction * n), at least one, are test). Both
sources keep each row's index in the TFDS split (`record_ids`), which the stream manifest records.
TFDS labels ImageNet-R with ImageNet-1k indices; its 200 classes (`IMAGENET_R_WNIDS`) are
renumbered 0..199 in sorted WordNet-id order. ImageNet-A likewise, its classes being those its
split holds (`PRESENT`), renumbered in ImageNet-1k index order (which is sorted WordNet-id
order); it too is split 80/20 per class. The datasets in sequence (5-datasets, DomainNet) read
their TFDS parts through `load_tfds_dataset` (olora_jax/data/sequences.py).

Labels (and CORe50's `session`) are read once from every record, with its image left encoded,
together with the image's digest (data/digests.py: the stored file's bytes hashed; CIFAR-100's
pixels, decoded once), and cached next to the prepared dataset (`olora_jax_columns_<split>.npz`)
when that folder is writable.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from olora_jax.data import digests as digests_lib
from olora_jax.data.folder_sources import IMAGENET_R_WNIDS
from olora_jax.data.preprocess import resize_image
from olora_jax.data.splits import stratified_split


@dataclasses.dataclass(frozen=True)
class TfdsDataset:
  tfds_name: str
  train_split: str
  test_split: str | None  # None: a seeded per-class split of `train_split` (data.test_fraction)
  metadata_keys: tuple[str, ...] = ()
  # Keep only these class names, renumbered 0..len-1 in this (sorted) order; None keeps all;
  # PRESENT keeps the classes the split holds, renumbered in label order (ImageNet-A).
  class_subset: tuple[str, ...] | str | None = None


PRESENT = "present"


TFDS_DATASETS = {
    "cifar100": TfdsDataset("cifar100", "train", "test"),
    "imagenet_r": TfdsDataset("imagenet_r", "test", None, class_subset=IMAGENET_R_WNIDS),
    "imagenet_sketch": TfdsDataset("imagenet_sketch", "test", None),
    "caltech_birds2011": TfdsDataset("caltech_birds2011", "train", "test"),
    "core50": TfdsDataset("core50", "train", "test", metadata_keys=("session",)),
    "cifar10": TfdsDataset("cifar10", "train", "test"),
    # ImageNet-A: one split of 7,500 images of 200 ImageNet classes, labelled with ImageNet-1k
    # indices: its classes renumbered 0..199 in that (sorted WordNet id) order, 80/20 per class.
    "imagenet_a": TfdsDataset("imagenet_a", "test", None, class_subset=PRESENT),
    # The parts of the sequences of olora_jax/data/sequences.py, also usable alone.
    "mnist": TfdsDataset("mnist", "train", "test"),
    "fashion_mnist": TfdsDataset("fashion_mnist", "train", "test"),
    "svhn_cropped": TfdsDataset("svhn_cropped", "train", "test"),
}


# What `tfds build` needs besides tensorflow-datasets (4.9.10): its CLI imports TensorFlow, Apache
# Beam and mlcroissant on start, the builders read and encode with TensorFlow, and TFDS looks its
# builders up with importlib_resources (docs/streams.md, "Preparing the TFDS datasets").
TFDS_BUILD_INSTALL = "pip install tensorflow-cpu apache-beam mlcroissant importlib_resources"


def prepare_command(tfds_name: str) -> str:
  if tfds_name == "core50":
    return ("python -m olora_jax.data.core50 --manual_dir=DIR_WITH_core50_128x128"
            " --data_dir=DIR")
  return f"tfds build {tfds_name} --file_format=array_record --data_dir=DIR"


def prepare_needs(tfds_name: str) -> str:
  """What the machine that prepares `tfds_name` must have installed, for the error line."""
  if tfds_name == "core50":
    return "our builder needs no TensorFlow"
  return f"it needs TensorFlow there: {TFDS_BUILD_INSTALL}"


def open_data_source(tfds_name: str, split: str, data_dir: str):
  """`tfds.data_source` without download; a missing dataset says how to prepare it."""
  if tfds_name == "core50":
    from olora_jax.data import core50  # noqa: F401  (registers the builder with TFDS)
  try:
    return tfds.data_source(tfds_name, split=split, data_dir=data_dir or None, download=False)
  # A folder without a generated dataset gives a KeyError about empty splits.
  except (AssertionError, FileNotFoundError, KeyError, NotImplementedError, ValueError) as e:
    where = data_dir or "the TFDS default (~/tensorflow_datasets)"
    raise FileNotFoundError(
        f"TFDS dataset {tfds_name!r} (split {split!r}) is not prepared as array_record in"
        f" data_dir={where}; prepare it with `{prepare_command(tfds_name)}` (downloads need a"
        f" machine with network, and {prepare_needs(tfds_name)}: then copy DIR here) and pass"
        f" --config.data.data_dir=DIR, or read the images you have with"
        f" --config.data.source=folder (docs/streams.md) [tfds said {type(e).__name__}]") from e


class TfdsSource:
  """Rows `record_ids` of one TFDS split, with random access through `tfds.data_source`.

  `get(ids)` decodes the rows' images and resizes them to `image_size` (uint8 NHWC);
  `get_raw(ids)` returns them at their stored size, for training augmentation. With
  `cache_resized`, `get` keeps every resized image in host memory after its first decode (the
  test set is evaluated many times: 150 KB per image at 224 px).
  """

  def __init__(self, name: str, split: str, data_source, record_ids: np.ndarray,
               columns: dict[str, np.ndarray], num_classes: int, image_size: int,
               num_workers: int = 8, seeded_split: bool = False, cache_resized: bool = False):
    self.name, self.split = name, split
    self._data_source = data_source
    self.record_ids = np.asarray(record_ids, np.int64)
    self.labels = columns["label"][self.record_ids]
    self.metadata = {k: v[self.record_ids] for k, v in columns.items()
                     if k not in ("label", "digest")}
    # Each row's image digest (olora_jax/data/digests.py), None where the records give none.
    self.digest_kind = digests_lib.kind_of(name) if "digest" in columns else None
    self.digests = columns["digest"][self.record_ids] if "digest" in columns else None
    self._rebuild = (name, data_source, columns, num_classes, image_size, num_workers,
                     seeded_split, cache_resized)
    # The domains of a domain-incremental stream: CORe50's sessions (None for the others).
    self.domains = self.metadata.get("session")
    self.num_classes = num_classes
    self.seeded_split = seeded_split  # train/test drawn from one split (test_fraction, split_seed)
    self.image_size = image_size
    self.version = f"{data_source.dataset_info.name}:{data_source.dataset_info.version}"
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, num_workers))
    self._cache = None  # (N, S, S, 3) uint8, allocated on first use (pages fill as rows do)
    self._cached = np.zeros(len(self.record_ids), bool) if cache_resized else None

  def __len__(self) -> int:
    return len(self.record_ids)

  @property
  def record_pool(self):
    """The TFDS split the record ids index (shared by train and test of a seeded split)."""
    return self._data_source

  def with_records(self, record_ids: np.ndarray, split: str) -> TfdsSource:
    """The records `record_ids` of the same TFDS split, as split `split` (a replayed
    manifest's sets)."""
    name, data_source, columns, num_classes, size, workers, seeded, cache = self._rebuild
    return TfdsSource(name, split, data_source, record_ids, columns, num_classes, size, workers,
                      seeded, cache)

  @property
  def raw_image_shape(self) -> tuple[int, ...] | None:
    """(H, W, C) when the dataset's image feature has one fixed shape (CIFAR-100: 32x32x3),
    else None (images of varying size: ImageNet-R, ImageNet-Sketch, CUB)."""
    try:
      shape = tuple(self._data_source.dataset_info.features["image"].shape)
    except (AttributeError, KeyError, TypeError):
      return None
    return shape if len(shape) == 3 and all(isinstance(d, int) for d in shape) else None

  def _image(self, row: int) -> np.ndarray:
    return np.asarray(self._data_source[int(self.record_ids[row])]["image"])

  def get_raw(self, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    ids = np.asarray(ids, np.int64)
    return list(self._pool.map(self._image, ids)), self.labels[ids]

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, np.int64)
    size = self.image_size
    if self._cached is None:
      images = list(self._pool.map(lambda i: resize_image(self._image(i), size), ids))
      if not images:
        return np.zeros((0, size, size, 3), np.uint8), self.labels[ids]
      return np.stack(images), self.labels[ids]
    if self._cache is None:
      self._cache = np.empty((len(self), size, size, 3), np.uint8)
    missing = np.unique(ids[~self._cached[ids]])
    for i, image in zip(missing, self._pool.map(lambda i: resize_image(self._image(i), size),
                                                missing), strict=True):
      self._cache[i] = image
    self._cached[missing] = True
    return self._cache[ids], self.labels[ids]


def _record_reader(data_source, keys: tuple[str, ...], digest_kind: str | None):
  """A function: record index -> [its `keys` values, its image digest]. It parses the stored
  record with the image left encoded (the labels need no decoding; a file digest hashes the
  stored bytes, a pixel digest decodes them), or, where the data source gives no stored bytes
  (tfds' mock data), reads the decoded example and records no digest (None)."""
  features = data_source.dataset_info.features
  stored = getattr(data_source, "data_source", None)
  try:
    raw = stored[0] if stored is not None and len(data_source) else None
  except Exception:  # noqa: BLE001  (a data source without random access to its records)
    raw = None
  if not isinstance(raw, (bytes, memoryview)) or digest_kind is None:

    def read_decoded(i):
      example = data_source[i]
      return [int(example[k]) for k in keys] + [None]

    return read_decoded
  skip = {"image": tfds.decode.SkipDecoding()}

  def read_stored(i):
    example = features.deserialize_example_np(stored[i], decoders=skip)
    image = example["image"]
    digest = (digests_lib.of_bytes(image) if digest_kind == digests_lib.FILE else
              digests_lib.of_pixels(features["image"].decode_example_np(image)))
    return [int(example[k]) for k in keys] + [digest]

  return read_stored


def read_columns(data_source, keys: tuple[str, ...], num_workers: int = 8,
                 digest_kind: str | None = None) -> dict:
  """{key: (N,) int64} for 'label' and `keys` of every record of a split, and, with
  `digest_kind`, 'digest': each record's image digest (olora_jax/data/digests.py), when the
  records are stored ones (cached next to the dataset when possible)."""
  keys = ("label", *keys)
  info = data_source.dataset_info
  # Only a really prepared dataset folder (with its dataset_info.json) holds a cache.
  prepared = os.path.isfile(os.path.join(str(info.data_dir), "dataset_info.json"))
  cache = os.path.join(str(info.data_dir), f"olora_jax_columns_{data_source.split}.npz")
  stored_as = {k: k for k in keys}  # column -> its name in the cache (a digest's names its kind)
  if digest_kind and prepared:
    stored_as["digest"] = f"digest_{digest_kind}"
  if prepared and os.path.isfile(cache):
    with np.load(cache) as f:
      if all(k in f for k in stored_as.values()) and len(f["label"]) == len(data_source):
        return {k: f[name] for k, name in stored_as.items()}

  read = _record_reader(data_source, keys, digest_kind)
  with concurrent.futures.ThreadPoolExecutor(max(1, num_workers)) as pool:
    rows = list(pool.map(read, range(len(data_source))))
  columns = {k: np.array([r[j] for r in rows], np.int64) for j, k in enumerate(keys)}
  if rows and rows[0][-1] is not None:
    columns["digest"] = digests_lib.as_array(r[-1] for r in rows)
  if prepared and os.access(str(info.data_dir), os.W_OK):
    tmp = f"{cache}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
      np.savez(f, **{stored_as.get(k, k): v for k, v in columns.items()})
    os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
  return columns


def load_tfds_sources(data_config: ml_collections.ConfigDict,
                      image_size: int) -> tuple[TfdsSource, TfdsSource]:
  """(train, test) sources of the TFDS benchmark `data_config.dataset`."""
  c = data_config
  if c.dataset not in TFDS_DATASETS:
    raise ValueError(
        f"unknown TFDS dataset data.dataset={c.dataset!r}; available: {tuple(TFDS_DATASETS)}"
        " (the other datasets are loaded by sources.load_sources)")
  return load_tfds_dataset(TFDS_DATASETS[c.dataset], c.dataset, c, image_size)


def load_tfds_dataset(spec: TfdsDataset, name: str, data_config: ml_collections.ConfigDict,
                      image_size: int) -> tuple[TfdsSource, TfdsSource]:
  """(train, test) sources of the TFDS dataset `spec`, named `name` (its data.dataset, or a part
  of a sequence: olora_jax/data/sequences.py), read as `data_config` says."""
  c = data_config
  workers = c.num_workers
  if workers < 1:
    raise ValueError(f"data.num_workers={workers} must be >= 1")

  def open_split(split):
    ds = open_data_source(spec.tfds_name, split, c.data_dir)
    return ds, read_columns(ds, spec.metadata_keys, workers, digests_lib.kind_of(name))

  train_ds, train_columns = open_split(spec.train_split)
  label_feature = train_ds.dataset_info.features["label"]
  num_classes, relabel = label_feature.num_classes, None
  if spec.class_subset == PRESENT:
    relabel = np.full(num_classes, -1, np.int64)
    present = np.unique(train_columns["label"])
    relabel[present] = np.arange(len(present))
    num_classes = len(present)
  elif spec.class_subset is not None:
    # ImageNet-R: ImageNet-1k indices -> 0..199 in sorted WordNet-id order (the order of a
    # torchvision ImageFolder over the class folders, as the released code reads it).
    relabel = np.full(num_classes, -1, np.int64)
    relabel[[label_feature.str2int(name) for name in spec.class_subset]] = np.arange(
        len(spec.class_subset))
    num_classes = len(spec.class_subset)

  def kept(columns):
    """Record ids whose class is kept (all of them, except in tfds' mock data for ImageNet-R)."""
    if relabel is None:
      return np.arange(len(columns["label"]))
    columns["label"] = relabel[columns["label"]]
    ids = np.flatnonzero(columns["label"] >= 0)
    if len(ids) < len(columns["label"]):
      logging.warning("%s: %d records outside its %d classes are left out", name,
                      len(columns["label"]) - len(ids), num_classes)
    return ids

  if spec.test_split is None:
    ids = kept(train_columns)
    train_pos, test_pos = stratified_split(
        train_columns["label"][ids], c.test_fraction, c.split_seed)
    train_ids, test_ids = ids[train_pos], ids[test_pos]
    test_ds, test_columns = train_ds, train_columns
  else:
    test_ds, test_columns = open_split(spec.test_split)
    train_ids, test_ids = kept(train_columns), kept(test_columns)
  seeded = spec.test_split is None
  train = TfdsSource(name, "train", train_ds, train_ids, train_columns, num_classes,
                     image_size, workers, seeded)
  test = TfdsSource(name, "test", test_ds, test_ids, test_columns, num_classes,
                    image_size, workers, seeded, cache_resized=c.cache_test_images)
  return train, test
