"""The host input pipeline: a stream's padded batches, in order, prepared ahead of the device.

Batch `step` is a pure function of (source, stream, seed, step): the augmentation draws from
`numpy.random.default_rng([seed, step])`, so the batches do not depend on thread timing, and a run
resumed at any step sees the same batches. `prefetch` batches are prepared ahead by host threads
(image decoding and PIL resizing release the GIL) while the device runs the current step.

With `preprocess='device'` (`data.preprocess`) a batch holds uint8 images at their stored size,
plus for 'crop_flip' each image's crop box and flip, drawn by the same generator calls as the host
path; `on_device` turns the placed batch into the host path's float batch
(data/device_preprocess.py). Such batches need every image of the split at one stored size:
`device_image_shape` refuses, at setup, a source that cannot promise it.

`rows`: the rows of each padded batch this process prepares (a multi-process run splits every
batch between its processes, olora_jax/sharding.py); all of them by default. With augmentation
the random draws of the whole batch are made, in order, so every row gets the crop it gets in a
single-process run (the other rows' images are read for their sizes but not resized).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from olora_jax.data.preprocess import (
    AUGMENTATIONS,
    PREPROCESS_MODES,
    augment_images,
    crop_flip_draw,
    make_batch,
    pad_batch,
)
from olora_jax.data.streams import Stream

MAX_THREADS = 4  # host threads preparing batches ahead (`iterate`), at most


def _source_name(source) -> str:
  return f"{getattr(source, 'name', type(source).__name__)!r} ({getattr(source, 'split', '?')}"


def device_image_shape(source, augment: str) -> tuple[int, int, int]:
  """The one (H, W, C) of the uint8 images a device-preprocessing batch of `source` holds: what
  `source.get` returns with augment 'none' (TFDS sources: resized to the model's size at load),
  the stored size (`source.raw_image_shape`) with 'crop_flip'. A ValueError when the source
  cannot promise one size, before any compute."""
  if augment == "none":
    shape = tuple(source.get(np.arange(min(len(source), 1)))[0].shape[1:])
  else:
    shape = getattr(source, "raw_image_shape", None)
  if shape is None or len(shape) != 3 or shape[-1] not in (1, 3):
    raise ValueError(
        f"data.preprocess='device' ships fixed-shape uint8 batches, but the raw training images"
        f" of data.dataset={_source_name(source)} split) do not share one stored size"
        f" (raw_image_shape={shape}); use data.preprocess='host'")
  return tuple(int(d) for d in shape)


class InputPipeline:
  """Yields `make_batch` dicts for the steps of `stream`, from `start_step` on; with
  `preprocess='device'`, their uint8 counterparts for `on_device` (see the module docstring)."""

  def __init__(self, source, stream: Stream, batch_size: int, image_size: int,
               augment: str = "none", seed: int = 0, prefetch: int = 4,
               input_scale: str = "unit", preprocess: str = "host",
               rows: slice | None = None):
    if augment not in AUGMENTATIONS:
      raise ValueError(f"unknown data.augment={augment!r}; use one of {AUGMENTATIONS}")
    if prefetch < 1:
      raise ValueError(f"data.prefetch={prefetch} must be >= 1")
    if preprocess not in PREPROCESS_MODES:
      raise ValueError(f"unknown data.preprocess={preprocess!r}; use one of {PREPROCESS_MODES}")
    self.source, self.stream = source, stream
    self.batch_size, self.image_size = batch_size, image_size
    self.augment, self.seed, self.prefetch = augment, seed, prefetch
    self.input_scale, self.preprocess = input_scale, preprocess
    self.rows = slice(0, batch_size) if rows is None else rows
    self._device_fn = None
    if preprocess == "device":
      from olora_jax.data import device_preprocess  # JAX only where the device preprocesses

      self.stored_shape = device_image_shape(source, augment)
      device_preprocess.check_sizes(*self.stored_shape[:2], image_size)
      self._device_fn = device_preprocess.make_batch_fn(image_size, input_scale)

  def on_device(self, batch: dict) -> dict:
    """A batch placed on the device -> the batch the methods take (float images): the jitted
    device preprocessing in device mode, the batch itself in host mode."""
    return batch if self._device_fn is None else self._device_fn(batch)

  def __len__(self) -> int:
    return len(self.stream.steps)

  @property
  def threads(self) -> int:
    """The host threads `iterate` prepares batches in."""
    return min(self.prefetch, MAX_THREADS)

  def batch(self, step: int) -> dict:
    """This process's rows (`rows`) of the padded batch of `step` (deterministic)."""
    ids = self.stream.steps[step]
    local = np.arange(len(ids))[self.rows]  # positions of ids in this process's rows
    if self.preprocess == "device":
      return self._device_batch(step, ids, local)
    if self.augment == "none":
      images, labels = self.source.get(ids[local])
    else:
      raw, labels = self.source.get_raw(ids)
      rng = np.random.default_rng([self.seed, step])
      images = augment_images(raw, self.image_size, self.augment, rng, keep=local)
      labels = labels[local]
    n_rows = self.rows.stop - self.rows.start
    return make_batch(images, labels, n_rows, self.image_size, self.input_scale)

  def _device_batch(self, step: int, ids: np.ndarray, local: np.ndarray) -> dict:
    """This process's rows of the batch as uint8 images at the stored size, padded;
    'crop_flip': each image's box and flip, drawn as `batch` draws them on the host path (every
    image has the stored size, so the draws of the other processes' rows need no image)."""
    if len(ids) > self.batch_size:
      raise ValueError(f"{len(ids)} examples do not fit a batch of {self.batch_size}")
    extra = {}
    if self.augment == "none":
      images, labels = self.source.get(ids[local])
      shapes = [np.shape(images)[1:]] if len(local) else []
    else:
      raw, labels = self.source.get_raw(ids[local])
      raw = [im[..., None] if im.ndim == 2 else im for im in raw]
      shapes = [im.shape for im in raw]
    odd = next((shape for shape in shapes if tuple(shape) != self.stored_shape), None)
    if odd is not None:
      raise ValueError(
          f"data.preprocess='device': stream step {step} holds an image of shape {odd}, not the"
          f" {self.stored_shape} of the run's other images: the images of data.dataset="
          f"{_source_name(self.source)} split) do not share one size; use data.preprocess='host'")
    if self.augment != "none":
      rng = np.random.default_rng([self.seed, step])
      draws = [crop_flip_draw(*self.stored_shape[:2], rng) for _ in ids]
      draws = [draws[i] for i in local]
      images = np.stack(raw) if raw else np.zeros((0, *self.stored_shape), np.uint8)
      extra = {"boxes": np.array([box for box, _ in draws], np.int32).reshape(-1, 4),
               "flips": np.array([flip for _, flip in draws], bool)}
    images = np.asarray(images).reshape(-1, *self.stored_shape)
    batch = pad_batch(images, labels, self.rows.stop - self.rows.start, **extra)
    if "boxes" in batch:  # padding rows: the whole (zero) image, as a valid box
      batch["boxes"][len(local):] = (0, 0, *self.stored_shape[:2])
    return batch

  def iterate(self, start_step: int = 0,
              place: Callable[[dict], Any] | None = None) -> Iterator[Any]:
    """The batches from `start_step` on, in order. `place` (e.g. a copy to the device) is
    applied to each batch in the thread that prepared it, so the copies of the next batches
    overlap the current step too."""

    def prepared(step: int):
      batch = self.batch(step)
      return batch if place is None else place(batch)

    with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
      pending = collections.deque()
      next_step = start_step
      while pending or next_step < len(self):
        while next_step < len(self) and len(pending) < self.prefetch:
          pending.append(pool.submit(prepared, next_step))
          next_step += 1
        yield pending.popleft().result()

  def __iter__(self) -> Iterator[dict]:
    return self.iterate(0)
