"""The host input pipeline: a stream's padded batches, in order, prepared ahead of the device.

Batch `step` is a pure function of (source, stream, seed, step): the augmentation draws from
`numpy.random.default_rng([seed, step])`, so the batches do not depend on thread timing, and a run
resumed at any step sees the same batches. `prefetch` batches are prepared ahead by host threads
(image decoding and PIL resizing release the GIL) while the device runs the current step.

`rows`: the rows of each padded batch this process prepares (a multi-process run splits every
batch between its processes, olora_jax/sharding.py); all of them by default. With augmentation
the random draws of the whole batch are made, in order, so every row gets the crop it gets in a
single-process run (the other rows' images are read for their sizes but not resized).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Iterator

import numpy as np

from olora_jax.data.preprocess import AUGMENTATIONS, augment_images, make_batch
from olora_jax.data.streams import Stream


class InputPipeline:
  """Yields `make_batch` dicts for the steps of `stream`, from `start_step` on."""

  def __init__(self, source, stream: Stream, batch_size: int, image_size: int,
               augment: str = "none", seed: int = 0, prefetch: int = 4,
               input_scale: str = "unit", rows: slice | None = None):
    if augment not in AUGMENTATIONS:
      raise ValueError(f"unknown data.augment={augment!r}; use one of {AUGMENTATIONS}")
    if prefetch < 1:
      raise ValueError(f"data.prefetch={prefetch} must be >= 1")
    self.source, self.stream = source, stream
    self.batch_size, self.image_size = batch_size, image_size
    self.augment, self.seed, self.prefetch = augment, seed, prefetch
    self.input_scale = input_scale
    self.rows = slice(0, batch_size) if rows is None else rows

  def __len__(self) -> int:
    return len(self.stream.steps)

  def batch(self, step: int) -> dict:
    """This process's rows (`rows`) of the padded batch of `step` (deterministic)."""
    ids = self.stream.steps[step]
    local = np.arange(len(ids))[self.rows]  # positions of ids in this process's rows
    if self.augment == "none":
      images, labels = self.source.get(ids[local])
    else:
      raw, labels = self.source.get_raw(ids)
      rng = np.random.default_rng([self.seed, step])
      images = augment_images(raw, self.image_size, self.augment, rng, keep=local)
      labels = labels[local]
    n_rows = self.rows.stop - self.rows.start
    return make_batch(images, labels, n_rows, self.image_size, self.input_scale)

  def iterate(self, start_step: int = 0) -> Iterator[dict]:
    with concurrent.futures.ThreadPoolExecutor(min(self.prefetch, 4)) as pool:
      pending = collections.deque()
      next_step = start_step
      while pending or next_step < len(self):
        while next_step < len(self) and len(pending) < self.prefetch:
          pending.append(pool.submit(self.batch, next_step))
          next_step += 1
        yield pending.popleft().result()

  def __iter__(self) -> Iterator[dict]:
    return self.iterate(0)
