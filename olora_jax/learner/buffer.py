"""The hard buffer (paper section 3.3): the K samples with the highest loss seen so far.

Two units (config key `learner.buffer_unit`, docs/fidelity.md): `HardBuffer` holds K single
samples, each scored by its own CE (the paper); `BatchBuffer` holds K whole batches, each scored
by its batch-mean CE (the released code, `reference` fidelity).

The sample buffer lives on the device with a static shape: K images, their labels and a validity
mask (the buffer starts empty and fills over the first steps). Candidates are the current batch
followed by the buffer's entries, scored by their *pre-update* per-example losses from the train
step; the top K are kept, highest first. On equal scores the later candidate ranks first. Padded
batch items and empty buffer slots score -inf and can only fill slots that stay invalid.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class HardBuffer:
  """The paper's hard buffer of K single samples, on the device with a static shape: `images`
  (K, H, W, 3) float32, `labels` (K,) int32, `valid` (K,) bool (empty slots are invalid)."""

  images: jax.Array  # (K, H, W, 3)
  labels: jax.Array  # (K,) int32
  valid: jax.Array  # (K,) bool

  @property
  def size(self) -> int:
    return self.labels.shape[0]


def check_size(size: int) -> None:
  """learner.buffer_size: K >= 0 (checked when the method is built, before any array exists)."""
  if size < 0:
    raise ValueError(f"learner.buffer_size={size} must be >= 0")


def init_buffer(size: int, image_shape: tuple[int, ...]) -> HardBuffer:
  """An empty sample buffer: images (K, *image_shape) float32, labels (K,), valid (K,) False."""
  check_size(size)
  return HardBuffer(images=jnp.zeros((size, *image_shape), jnp.float32),
                    labels=jnp.zeros((size,), jnp.int32),
                    valid=jnp.zeros((size,), bool))


def update_buffer(buffer: HardBuffer, batch: dict, scores: jax.Array) -> HardBuffer:
  """Keeps the K highest-scoring candidates among `batch` items then buffer entries.

  `scores` is (B + K,): the pre-update losses of the batch items followed by the buffer entries.
  """
  k = buffer.size
  if k == 0:
    return buffer
  valid = jnp.concatenate([batch["mask"], buffer.valid])
  idx = top_k_later_wins(scores, valid, k)
  images = jnp.concatenate([batch["images"], buffer.images])
  labels = jnp.concatenate([batch["labels"], buffer.labels])
  return HardBuffer(images=images[idx], labels=labels[idx], valid=valid[idx])


def top_k_later_wins(scores: jax.Array, valid: jax.Array, k: int) -> jax.Array:
  """Indices of the k highest `scores`, highest first; invalid candidates score -inf; on equal
  scores the later candidate ranks first."""
  scores = jnp.where(valid, scores, -jnp.inf)
  # lax.top_k prefers the lower index on ties; reversing makes the later candidate win.
  _, rev_idx = jax.lax.top_k(scores[::-1], k)
  return scores.shape[0] - 1 - rev_idx


@flax.struct.dataclass
class BatchBuffer:
  """K whole batches (the released code's hard buffer): static shape K x B, with the batches'
  own padding masks and a validity flag per entry (entries fill over the first K steps)."""

  images: jax.Array  # (K, B, H, W, 3)
  labels: jax.Array  # (K, B) int32
  mask: jax.Array  # (K, B) bool: real (unpadded) items of each stored batch
  valid: jax.Array  # (K,) bool

  @property
  def size(self) -> int:
    return self.valid.shape[0]


Buffer = HardBuffer | BatchBuffer


def init_batch_buffer(size: int, batch_size: int, image_shape: tuple[int, ...]) -> BatchBuffer:
  if size < 0:
    raise ValueError(f"learner.buffer_size={size} must be >= 0")
  if batch_size < 1:
    raise ValueError(f"learner.batch_size={batch_size} must be >= 1")
  return BatchBuffer(images=jnp.zeros((size, batch_size, *image_shape), jnp.float32),
                     labels=jnp.zeros((size, batch_size), jnp.int32),
                     mask=jnp.zeros((size, batch_size), bool),
                     valid=jnp.zeros((size,), bool))


def update_batch_buffer(buffer: BatchBuffer, batch: dict, scores: jax.Array) -> BatchBuffer:
  """Keeps the K highest-scoring batches among the current batch then the buffer's entries.

  `scores` is (1 + K,): the pre-update batch-mean CE of the current batch followed by each
  entry's. The kept entries are in rank order (entry 0, the hardest, feeds `flat_softmax`
  importance). A batch with no real item is never kept as valid.
  """
  k = buffer.size
  if k == 0:
    return buffer
  valid = jnp.concatenate([jnp.any(batch["mask"])[None], buffer.valid])
  idx = top_k_later_wins(scores, valid, k)
  images = jnp.concatenate([batch["images"][None], buffer.images])
  labels = jnp.concatenate([batch["labels"][None], buffer.labels])
  mask = jnp.concatenate([batch["mask"][None], buffer.mask])
  return BatchBuffer(images=images[idx], labels=labels[idx], mask=mask[idx], valid=valid[idx])
