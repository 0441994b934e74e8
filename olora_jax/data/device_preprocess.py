"""Device-side preprocessing (`data.preprocess='device'`): uint8 images -> the model's float input.

The host then only gathers uint8 images at their stored size (and, for `data.augment='crop_flip'`,
draws each image's crop box and flip from the same generator calls as the host path,
data/preprocess.py); everything else runs here, in one jitted function vmapped over the batch:
the crop, the bilinear resize to `image_size`, the flip, grey -> RGB and the scaling to [0, 1] or
[-1, 1]. Padding rows (mask False) come out as zero images, as the host path pads them.
`model_levels` is the resize alone, to uint8 levels: the evaluator builds its test-set cache
with it (olora_jax/evaluate.py).

The resize is PIL's `Image.resize(..., BILINEAR)` (Pillow 13, pinned in constraints.txt) pass for
pass, in integer-exact arithmetic (int32, or float32 matmuls whose every value is an integer
below 2**24): the triangle filter stretched by the scale when downsampling (PIL's
antialiasing), pixel centres at i + 0.5, the filter cut at the edges of the crop and renormalised,
the weights in PIL's 22-bit fixed point, each pass's sums rounded half up and clipped to uint8, the
passes in Pillow's order. Those weights are ratios of small integers, so they are rounded here
exactly as PIL rounds them in double precision, and the output levels are PIL's, bit for bit, on
any backend (tests/test_device_preprocess.py compares them). The uint8 -> float step is the lookup
table the host path uses too (`preprocess.level_table`), so the float inputs are the host path's,
bit for bit.
A Pillow that orders or rounds its passes differently (older versions always ran the horizontal
pass first) would differ by a level on a few pixels of crops.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from olora_jax.data.preprocess import level_table

PRECISION_BITS = 22  # PIL's fixed-point weights of its 8-bit resampling passes (32 - 8 - 2)
SPLIT_BITS = 11  # a weight's low half, for exact float32 matmuls (`_pass`)
HIGHEST = jax.lax.Precision.HIGHEST


def bilinear_weights(in_size: int, start: jax.Array, length: jax.Array,
                     out_size: int) -> jax.Array:
  """(out_size, in_size) int32: PIL's BILINEAR weights, in its 22-bit fixed point, resizing the
  pixels [start, start + length) of an axis of `in_size` pixels to `out_size` (zero outside).

  PIL's filter value of pixel x for output o is 1 - |x + 0.5 - (o + 0.5) L / S| / max(L / S, 1)
  (L = length, S = out_size), i.e. m / D with m = max(0, D - |(2x + 1) S - (2o + 1) L|) and
  D = 2 max(S, L): integers, so the normalised weight m / sum(m) is rounded to fixed point here
  exactly as PIL's double arithmetic rounds it (a weight is never within 1e-6 of a tie)."""
  length = jnp.asarray(length, jnp.int32)
  pixel = jnp.arange(in_size, dtype=jnp.int32) - jnp.asarray(start, jnp.int32)
  out = jnp.arange(out_size, dtype=jnp.int32)
  n = (2 * pixel[None, :] + 1) * out_size - (2 * out[:, None] + 1) * length
  d = 2 * jnp.maximum(out_size, length)
  m = jnp.where((pixel >= 0) & (pixel < length), jnp.maximum(0, d - jnp.abs(n)), 0)
  total = jnp.sum(m, axis=1, keepdims=True)
  one = 1 << PRECISION_BITS
  whole, rest = one // total, one % total  # m * one / total without overflowing int32
  return m * whole + (2 * m * rest + total) // (2 * total)


def check_sizes(height: int, width: int, image_size: int) -> None:
  """Refuses stored sizes whose fixed-point weights would overflow int32 (far beyond 224 px)."""
  for size in (height, width):
    d = 2 * max(size, image_size)
    taps = 2 * -(-size // image_size) + 3
    if 2 * d * d * taps + d * taps >= 2**31 or 255 * ((1 << PRECISION_BITS) + taps) >= 2**31:
      raise ValueError(
          f"images stored at {height}x{width} are too large to resize on the device to"
          f" {image_size} px; use data.preprocess='host'")


def _exact_in_float32(in_size: int, image_size: int) -> bool:
  """Whether a pass over an axis of `in_size` pixels can run as float32 matmuls exactly: split
  into 11-bit halves, every weighted sum of a half stays an integer below 2**24 when at most 32
  weights of an output pixel are non-zero (downsampling by less than 15x)."""
  taps = 2 * -(-in_size // image_size) + 1
  return 255 * ((1 << SPLIT_BITS) - 1) * taps < 2**24


def _pass(weights: jax.Array, x: jax.Array, spec: str, in_float32: bool) -> jax.Array:
  """One of PIL's 8-bit passes: integer weighted sums, rounded half up, clipped to 0..255. With
  `in_float32` the sums are two float32 matmuls, one per 11-bit half of the weights, each exact
  (integers below 2**24; HIGHEST: no TF32 on a GPU), which CPUs and GPUs run faster than int32."""
  if in_float32:
    x = x.astype(jnp.float32)
    high, low = (jnp.einsum(spec, part.astype(jnp.float32), x, precision=HIGHEST)
                 for part in (weights >> SPLIT_BITS, weights & ((1 << SPLIT_BITS) - 1)))
    acc = (high.astype(jnp.int32) << SPLIT_BITS) + low.astype(jnp.int32)
  else:
    acc = jnp.einsum(spec, weights, x, preferred_element_type=jnp.int32)
  return jnp.clip((acc + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS, 0, 255)


def vertical_first(height, width, image_size: int):
  """Pillow's pass order (13.0, the pinned version): the vertical pass first when the height
  shrinks by more than twice what the width does, else the horizontal pass first."""
  return (height - image_size > 0) & (height - image_size > 2 * (width - image_size))


def resize_levels(image: jax.Array, box: jax.Array, image_size: int,
                  flip: jax.Array | None = None) -> jax.Array:
  """(H, W, C) uint8, `box` (4,) int (top, left, h, w) -> (image_size, image_size, C) int32
  levels 0..255: PIL's BILINEAR resize of the cropped image, pass for pass; mirrored left-right
  when `flip` (the horizontal weights' output rows reversed: the same sums, reordered)."""
  height, width = image.shape[:2]
  x = image.astype(jnp.int32)
  wx = bilinear_weights(width, box[1], box[3], image_size)  # (S, W)
  if flip is not None:
    wx = jnp.where(flip, wx[::-1], wx)
  wy = bilinear_weights(height, box[0], box[2], image_size)  # (S, H)

  def horizontal(x):
    return _pass(wx, x, "ow,hwc->hoc", _exact_in_float32(width, image_size))

  def vertical(x):
    return _pass(wy, x, "oh,hwc->owc", _exact_in_float32(height, image_size))

  if isinstance(box, np.ndarray):  # a static box: one order
    if vertical_first(int(box[2]), int(box[3]), image_size):
      return horizontal(vertical(x))
    return vertical(horizontal(x))
  if height <= image_size:  # no crop's height shrinks: always the horizontal pass first
    return vertical(horizontal(x))
  # A crop box drawn per image: both orders, one kept (the passes are cheap next to the model).
  return jnp.where(vertical_first(box[2], box[3], image_size), horizontal(vertical(x)),
                   vertical(horizontal(x)))


def model_levels(images: jax.Array, image_size: int, boxes: jax.Array | None = None,
                 flips: jax.Array | None = None) -> jax.Array:
  """(B, H, W, 1|3) uint8 -> (B, image_size, image_size, 1|3) int32 levels 0..255: each image
  cropped to its row of `boxes` (top, left, h, w; None: the whole image), resized (PIL's bilinear
  resize, `resize_levels`) and mirrored left-right where `flips` (traceable). Channels are kept:
  the device counterpart of `preprocess.to_model_levels`."""
  _, height, width, channels = images.shape
  if channels not in (1, 3):
    raise ValueError(f"images must be uint8 (B, H, W, 1|3), got {images.shape}")
  if boxes is None and (height, width) == (image_size, image_size):
    levels = images.astype(jnp.int32)  # nothing to resize (the host path does not resize either)
    if flips is not None:
      levels = jnp.where(flips[:, None, None, None], levels[:, :, ::-1], levels)
    return levels
  check_sizes(height, width, image_size)
  whole = np.array([0, 0, height, width])  # no boxes: one static box, one pass order

  def one(image, box, flip):
    return resize_levels(image, whole if box is None else box, image_size, flip)

  axes = (0, None if boxes is None else 0, None if flips is None else 0)
  return jax.vmap(one, in_axes=axes)(images, boxes, flips)


def preprocess_images(images: jax.Array, mask: jax.Array, image_size: int,
                      input_scale: str = "unit", boxes: jax.Array | None = None,
                      flips: jax.Array | None = None) -> jax.Array:
  """(B, H, W, 1|3) uint8 -> (B, image_size, image_size, 3) float32 model inputs (traceable).

  `boxes` (B, 4) int (top, left, h, w) crop each image before the resize (None: the whole
  image), `flips` (B,) bool mirror the resized image left-right (`model_levels`); rows with
  `mask` False are zero images."""
  levels = model_levels(images, image_size, boxes, flips)
  # Level 256 is a padding row's 0.0 (not level 0's value: -1.0 with 'signed').
  levels = jnp.where(mask[:, None, None, None], levels, 256)
  table = jnp.asarray(np.append(level_table(input_scale), np.float32(0.0)))
  x = table[levels]
  return jnp.broadcast_to(x, (*x.shape[:3], 3))  # grey -> RGB


def make_batch_fn(image_size: int, input_scale: str = "unit") -> Callable[[dict], dict]:
  """Jitted: a device batch of `pipeline.InputPipeline` in device mode ({"images" uint8 at the
  stored size, "labels", "mask"[, "boxes", "flips"]}) -> the batch every method takes
  ({"images" (B, S, S, 3) float32, "labels", "mask"}, the host path's batch)."""
  level_table(input_scale)  # an unknown scale fails here, not inside the trace

  def fn(batch: dict) -> dict:
    images = preprocess_images(batch["images"], batch["mask"], image_size, input_scale,
                               batch.get("boxes"), batch.get("flips"))
    return {"images": images, "labels": batch["labels"], "mask": batch["mask"]}

  return jax.jit(fn)
