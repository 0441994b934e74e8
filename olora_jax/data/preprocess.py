"""Host-side preprocessing: uint8 images of any size -> the model's float input, and padded batches.

Images are resized to `image_size` x `image_size` (bilinear, PIL), grey images are repeated to
three channels, and pixels are scaled to [0, 1] (`data.input_scale='unit'`: the paper's appendix
and the released code both use [0, 1]; no mean/std normalisation) or to [-1, 1] ('signed', the
big_vision / AugReg convention). Batches are padded to a fixed size with a `mask` so the
jitted functions see one shape for the whole stream.

Training augmentation (`data.augment`): 'none', or 'crop_flip' as in the released code's training
transform: a random resized crop (area fraction in [0.08, 1], aspect ratio log-uniform in
[3/4, 4/3], ten tries then a centre crop) resized to `image_size`, then a horizontal flip with
probability 1/2. Every draw comes from a `numpy.random.Generator` the caller seeds, so a stream's
batches are a deterministic function of (seed, step).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

INPUT_SCALES = ("unit", "signed")
# `data.preprocess`: where uint8 images become model inputs. 'host' (here, PIL) or 'device' (the
# host ships uint8 images at their stored size, data/device_preprocess.py does the rest).
PREPROCESS_MODES = ("host", "device")


def level_table(input_scale: str) -> np.ndarray:
  """(256,) float32: uint8 level k -> the model's input value, k / 255 in [0, 1] ('unit') or
  2 k / 255 - 1 in [-1, 1] ('signed'). The host and the device (data/device_preprocess.py) both
  look levels up here, so their inputs agree bit for bit."""
  if input_scale not in INPUT_SCALES:
    raise ValueError(f"unknown data.input_scale={input_scale!r}; use one of {INPUT_SCALES}")
  unit = np.arange(256, dtype=np.uint8).astype(np.float32) / 255.0
  return 2.0 * unit - 1.0 if input_scale == "signed" else unit


def to_model_input(images: np.ndarray, image_size: int, input_scale: str = "unit") -> np.ndarray:
  """(N, H, W, C) uint8 with C in {1, 3} -> (N, image_size, image_size, 3) float32 in [0, 1]
  (`input_scale='unit'`) or [-1, 1] ('signed')."""
  table = level_table(input_scale)
  if not len(images):  # e.g. a process's rows of a short batch (olora_jax/sharding.py)
    return np.zeros((0, image_size, image_size, 3), np.float32)
  images = to_model_levels(images, image_size)
  if images.shape[-1] == 1:
    images = np.repeat(images, 3, axis=-1)
  return table[images]


def to_model_levels(images: np.ndarray, image_size: int) -> np.ndarray:
  """(N, H, W, C) uint8 with C in {1, 3} -> (N, image_size, image_size, C) uint8: the resize of
  `to_model_input` (PIL, bilinear), channels and levels kept (the evaluator's test-set cache)."""
  if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
    raise ValueError(
        f"images must be uint8 (N, H, W, 1|3), got {images.dtype} {images.shape};"
        " convert the dataset to 8-bit grey or RGB")
  if images.shape[1:3] == (image_size, image_size) or not len(images):
    return images
  resized = [np.asarray(Image.fromarray(im.squeeze(-1) if im.shape[-1] == 1 else im)
                        .resize((image_size, image_size), Image.BILINEAR)) for im in images]
  return np.stack(resized).reshape(len(images), image_size, image_size, -1)


AUGMENTATIONS = ("none", "crop_flip")
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)


def resize_image(image: np.ndarray, image_size: int,
                 box: tuple[int, int, int, int] | None = None) -> np.ndarray:
  """(H, W[, 1|3]) uint8 -> (image_size, image_size, 3) uint8; `box` = (top, left, h, w) crop."""
  if image.ndim == 2:
    image = image[..., None]
  if box is not None:
    top, left, h, w = box
    image = image[top:top + h, left:left + w]
  if image.shape[:2] != (image_size, image_size):
    pil = Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image)
    image = np.asarray(pil.resize((image_size, image_size), Image.BILINEAR))
    image = image.reshape(image_size, image_size, -1)
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  return image


def random_crop_box(height: int, width: int,
                    rng: np.random.Generator) -> tuple[int, int, int, int]:
  """(top, left, h, w) of a random resized crop: area and log-aspect drawn uniformly."""
  area = height * width
  log_ratio = np.log(CROP_RATIO)
  for _ in range(10):
    target_area = area * rng.uniform(*CROP_SCALE)
    aspect = np.exp(rng.uniform(*log_ratio))
    w = int(round(np.sqrt(target_area * aspect)))
    h = int(round(np.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
  aspect = width / height  # fallback: the largest centre crop with a ratio in range
  if aspect < CROP_RATIO[0]:
    w, h = width, int(round(width / CROP_RATIO[0]))
  elif aspect > CROP_RATIO[1]:
    h, w = height, int(round(height * CROP_RATIO[1]))
  else:
    h, w = height, width
  return (height - h) // 2, (width - w) // 2, h, w


def crop_flip_draw(height: int, width: int,
                   rng: np.random.Generator) -> tuple[tuple[int, int, int, int], bool]:
  """One image's 'crop_flip' draws, in the order both preprocessing paths take them: the crop box
  (top, left, h, w), then whether to flip the resized crop left-right."""
  box = random_crop_box(height, width, rng)
  return box, bool(rng.uniform() < 0.5)


def augment_images(images: list[np.ndarray], image_size: int, augment: str,
                   rng: np.random.Generator, keep: np.ndarray | None = None) -> np.ndarray:
  """Training images of any size -> (N, image_size, image_size, 3) uint8, augmented. With `keep`
  (indices into `images`), only those images are returned, augmented with the draws they get
  when every image is: the draws of all images are made, in order."""
  if augment not in AUGMENTATIONS:
    raise ValueError(f"unknown data.augment={augment!r}; use one of {AUGMENTATIONS}")
  kept = set(range(len(images)) if keep is None else np.asarray(keep).tolist())
  out = []
  for i, image in enumerate(images):
    if augment == "crop_flip":
      box, flip = crop_flip_draw(*image.shape[:2], rng)
      if i in kept:
        image = resize_image(image, image_size, box)
        out.append(image[:, ::-1] if flip else image)
    elif i in kept:
      out.append(resize_image(image, image_size))
  if not out:
    return np.zeros((0, image_size, image_size, 3), np.uint8)
  return np.stack(out)


def make_batch(images: np.ndarray, labels: np.ndarray, batch_size: int,
               image_size: int, input_scale: str = "unit") -> dict:
  """A padded batch: {"images" (B, S, S, 3) f32, "labels" (B,) i32, "mask" (B,) bool}."""
  n = len(labels)
  if n > batch_size:
    raise ValueError(f"{n} examples do not fit a batch of {batch_size}")
  return pad_batch(to_model_input(images, image_size, input_scale), labels, batch_size)


def pad_batch(images: np.ndarray, labels: np.ndarray, n_rows: int, **extra) -> dict:
  """{"images", "labels" int32, "mask"} of `n_rows` rows: the `len(labels)` given ones, then
  zero rows with `mask` False; `extra` arrays (one row per given image) are padded likewise."""
  pad = n_rows - len(labels)

  def padded(x):
    x = np.asarray(x)
    return np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])

  return {"images": padded(images), "labels": padded(labels).astype(np.int32),
          "mask": np.arange(n_rows) < len(labels), **{k: padded(v) for k, v in extra.items()}}
