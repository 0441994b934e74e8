"""Image digests: a name for each example's image that every source of a dataset computes alike.

A record id is an index in one source's own list of examples: TFDS numbers its records in the order
it shuffled them when it prepared the dataset, a folder source numbers the files of its layout. The
digest of an example's image names the image itself, so a stream manifest that records it
(`step_digests`, `test.digests`) replays on another source, or another folder layout, that holds
the same images (olora_jax/data/manifest.py, docs/streams.md "Replaying on the other source").

Two kinds, fixed per dataset so both sources compute the same one:

- `file-sha256-128`: the first 128 bits (32 hex digits) of the SHA-256 of the image file's bytes.
  The TFDS builders of ImageNet-R, ImageNet-Sketch and CUB-200 store each image file's bytes as
  they are, as does our CORe50 builder, so the TFDS record and the file on disk have one digest;
  nothing is decoded to compute it.
- `pixels-sha256-128`: the same of the decoded uint8 pixels, (H, W, C) in row-major order, after
  the text `HxWxC\\n`. CIFAR-100: TFDS stores the arrays re-encoded as PNG (lossless), the
  pickles store the arrays themselves, so only the pixels agree.
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_HEX = 32  # hex digits kept: 128 bits
FILE, PIXELS = "file-sha256-128", "pixels-sha256-128"
PIXEL_DATASETS = ("cifar100", "cifar10")  # datasets whose sources share pixels but not files


def kind_of(dataset: str) -> str:
  """The digest kind of `dataset` (the same for its TFDS and folder sources)."""
  return PIXELS if dataset in PIXEL_DATASETS else FILE


def of_bytes(data: bytes) -> str:
  """The digest of an image file's bytes."""
  return hashlib.sha256(data).hexdigest()[:DIGEST_HEX]


def of_pixels(image: np.ndarray) -> str:
  """The digest of a decoded image, (H, W, C) uint8 (a grey (H, W) image counts as C = 1)."""
  image = np.asarray(image)
  if image.dtype != np.uint8:
    raise ValueError(f"a pixel digest needs uint8 pixels, got {image.dtype}")
  if image.ndim == 2:
    image = image[..., None]
  h, w, c = image.shape
  header = f"{h}x{w}x{c}\n".encode()
  return hashlib.sha256(header + np.ascontiguousarray(image).tobytes()).hexdigest()[:DIGEST_HEX]


def as_array(digests) -> np.ndarray:
  """Digests as a fixed-width string array (what the caches store)."""
  return np.asarray(list(digests), dtype=f"<U{DIGEST_HEX}")
