"""Benchmarks made of several datasets in sequence: one source whose rows are those of its parts,
each part a dataset read as it is read alone (TFDS, or image files with `folder`).

- `five_datasets` (labels `offset`, 50 classes): cifar10, mnist, svhn_cropped (TFDS), notMNIST
  (folder), fashion_mnist;
- `domainnet` (labels `shared`, 345 classes): DomainNet's clipart, infograph, painting,
  quickdraw, real and sketch (TFDS configs `domainnet/<domain>`).

`offset` (class-incremental across datasets): part k's classes follow part k-1's, so a
'disjoint' stream of one task per part (`data.n_tasks` = parts, classes in label order) is the
sequence of datasets. `shared` (domain-incremental): every part has the same classes, and the
part's index is each row's domain (`data.scenario='domain'`: one task per part, in order).
Every row's domain is its part's index in both kinds.

TFDS parts are read from `data.data_dir` (prepared as for a dataset alone,
olora_jax/data/tfds_sources.py); a folder part from its sub-folder of `data.data_dir`
(`five_datasets`: notMNIST_small/, the letter folders A..J, split 80/20 per class by
`data.test_fraction` and `data.split_seed` as any one ImageFolder tree). Each part keeps its own
train/test split; a part without one is split as it is alone. Images of every part come resized
to the model's size with 3 channels (a grey image's channel repeated). Record ids index the
concatenation of the parts' rows (train and test each), so a stream manifest replays on the same
parts; the rows carry no image digests.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections
import numpy as np

from olora_jax import errors


@dataclasses.dataclass(frozen=True)
class Part:
  dataset: str  # the TFDS name (a key of tfds_sources.TFDS_DATASETS, or a TFDS config name)
  folder: str = ""  # read with data.source='folder' from this sub-folder of data.data_dir


@dataclasses.dataclass(frozen=True)
class Sequence:
  parts: tuple[Part, ...]
  labels: str  # 'offset' (class-incremental across the parts) | 'shared' (domain-incremental)


DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")

SEQUENCES = {
    "five_datasets": Sequence((Part("cifar10"), Part("mnist"), Part("svhn_cropped"),
                               Part("notmnist", folder="notMNIST_small"),
                               Part("fashion_mnist")), "offset"),
    "domainnet": Sequence(tuple(Part(f"domainnet/{d}") for d in DOMAINNET_DOMAINS), "shared"),
}


class SequenceSource:
  """One split of a sequence: the rows of its parts' same split, one after another."""

  def __init__(self, name: str, split: str, parts: list, shared_labels: bool):
    self.name, self.split, self._parts = name, split, parts
    sizes = [len(p) for p in parts]
    self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    offsets = ([0] * len(parts) if shared_labels
               else np.concatenate([[0], np.cumsum([p.num_classes for p in parts])[:-1]]))
    self.num_classes = (max(p.num_classes for p in parts) if shared_labels
                        else sum(p.num_classes for p in parts))
    self.labels = np.concatenate([np.asarray(p.labels, np.int64) + o
                                  for p, o in zip(parts, offsets, strict=True)])
    self._offsets = np.asarray(offsets, np.int64)
    self.domains = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    self.record_ids = np.arange(len(self.labels), dtype=np.int64)
    self.metadata = {}
    self.seeded_split = any(getattr(p, "seeded_split", False) for p in parts)
    self.version = "+".join(str(getattr(p, "version", p.name)) for p in parts)
    shapes = {getattr(p, "raw_image_shape", None) for p in parts}
    self.raw_image_shape = shapes.pop() if len(shapes) == 1 else None

  def __len__(self) -> int:
    return len(self.labels)

  def _by_part(self, ids: np.ndarray):
    """(part index, the part's own row ids, positions in `ids`) of every part `ids` reach."""
    ids = np.asarray(ids, np.int64)
    which = np.searchsorted(self._starts, ids, side="right") - 1
    for k in np.unique(which):
      at = np.flatnonzero(which == k)
      yield int(k), ids[at] - self._starts[k], at

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, np.int64)
    images = None
    for k, local, at in self._by_part(ids):
      part_images, _ = self._parts[k].get(local)
      part_images = np.asarray(part_images)
      if part_images.shape[-1] == 1:  # a grey part among colour ones
        part_images = np.repeat(part_images, 3, axis=-1)
      if images is None:
        images = np.empty((len(ids), *part_images.shape[1:]), np.uint8)
      images[at] = part_images
    if images is None:
      return np.zeros((0, 1, 1, 3), np.uint8), self.labels[ids]
    return images, self.labels[ids]

  def get_raw(self, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    ids = np.asarray(ids, np.int64)
    images: list = [None] * len(ids)
    for k, local, at in self._by_part(ids):
      raw, _ = self._parts[k].get_raw(local)
      for i, image in zip(at, raw, strict=True):
        images[i] = image
    return images, self.labels[ids]


def load_sequence_sources(data_config: ml_collections.ConfigDict,
                          image_size: int) -> tuple[SequenceSource, SequenceSource]:
  """(train, test) of the sequence `data_config.dataset` (module docstring)."""
  from olora_jax.data import folder_sources, tfds_sources

  c = data_config
  sequence = SEQUENCES[c.dataset]
  trains, tests = [], []
  for part in sequence.parts:
    if part.folder:
      where = os.path.join(os.path.expanduser(c.data_dir), part.folder)
      if not os.path.isdir(where):
        raise errors.BadInput(
            f"data.dataset={c.dataset!r} reads its part {part.dataset!r} from {where}, which is"
            f" not a folder; put the dataset's class folders there (docs/streams.md)")
      part_config = ml_collections.ConfigDict(c.to_dict())
      part_config.dataset, part_config.data_dir = part.dataset, where
      train, test = folder_sources.load_folder_sources(part_config, image_size)
    else:
      spec = tfds_sources.TFDS_DATASETS.get(part.dataset) or tfds_sources.TfdsDataset(
          part.dataset, "train", "test")
      train, test = tfds_sources.load_tfds_dataset(spec, part.dataset, c, image_size)
    trains.append(train)
    tests.append(test)
  shared = sequence.labels == "shared"
  if shared and len({p.num_classes for p in trains}) != 1:
    raise errors.BadInput(
        f"data.dataset={c.dataset!r}: its parts must share their classes, but they have"
        f" {sorted({p.num_classes for p in trains})}; prepare every part of the same version")
  return (SequenceSource(c.dataset, "train", trains, shared),
          SequenceSource(c.dataset, "test", tests, shared))
