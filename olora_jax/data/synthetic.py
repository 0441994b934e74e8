"""Synthetic CIFAR-shaped datasets: random 32x32 RGB uint8 images with balanced labels, for
measuring what a stream of a benchmark's shape costs without its data (launch/bench.py
--suite accelerator). Loaded as a user dataset (`data.dataset="module:function"`), the name
saying the sizes:

    --config.data.dataset=olora_jax.data.synthetic:train50000_test10000_classes100

is Split CIFAR-100's shape (50,000 training and 10,000 test images of 100 classes). The pixels
are seeded noise: the numbers a run reports on it measure cost, not learning.
"""

from __future__ import annotations

import re

import numpy as np

IMAGE_SHAPE = (32, 32, 3)  # CIFAR's
_NAME = re.compile(r"train(\d+)_test(\d+)_classes(\d+)")


def name(n_train: int, n_test: int, n_classes: int) -> str:
  """The `data.dataset` value of a synthetic dataset of these sizes."""
  return f"{__name__}:train{n_train}_test{n_test}_classes{n_classes}"


def splits(n_train: int, n_test: int, n_classes: int, seed: int = 0) -> dict:
  """{'train': (images, labels), 'test': (images, labels)}: uint8 (N, 32, 32, 3) noise, labels
  0..C-1 in turn (every class equally often in each split)."""
  if min(n_train, n_test) < n_classes or n_classes < 1:
    raise ValueError(f"a synthetic dataset needs at least one image of each of its {n_classes}"
                     f" classes per split, got {n_train} train and {n_test} test; raise the sizes")
  rng = np.random.default_rng(seed)
  return {split: (rng.integers(0, 256, (n, *IMAGE_SHAPE), dtype=np.uint8),
                  np.arange(n, dtype=np.int64) % n_classes)
          for split, n in (("train", n_train), ("test", n_test))}


def __getattr__(attr: str):
  """`trainN_testM_classesC` -> a function of no argument returning `splits(N, M, C)`."""
  match = _NAME.fullmatch(attr)
  if match is None:
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}; name a synthetic"
                         " dataset trainN_testM_classesC")
  n_train, n_test, n_classes = map(int, match.groups())
  return lambda: splits(n_train, n_test, n_classes)
