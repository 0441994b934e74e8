"""The evaluator: per-class correct/total counts of the current model on chosen test examples.

One evaluator serves every method: it only needs a pure `predict(state, images) -> logits` (the
method's, olora_jax/methods/base.py) and never changes the learner's state (nothing is donated,
nothing is written back).
Counting runs inside one jitted function that takes a padded batch, its validity mask and a
boolean class mask, and adds the batch's per-class counts to running (C,) accumulators on the
device; the host fetches the two count vectors once per evaluation. Batches are padded to
`batch_size` (eval.batch_size, 1024 by default: large passes keep a GPU busy), their padding rows
masked, so the function compiles once per run whatever the number of test examples. Where the
device reports its memory (GPUs, TPUs), the first evaluation compiles that program ahead of time
and halves the batch while its working memory exceeds the device's free memory (`fit_batch`);
the program that fits is the one every evaluation then runs.
The test set is decoded once, when the evaluator is built, at the model's input resolution as
uint8 levels: on the devices when it fits there (a quarter of one device's memory, a
single-process run), else in host memory (a quarter of it), so an anytime evaluation never
decodes or resizes an image again. The levels are PIL's bilinear resize either way: with
`preprocess='host'` PIL computes them on the host (`decode_levels`); with 'device' the device
resize, which reproduces PIL bit for bit (data/device_preprocess.py), computes them from the
stored uint8 images in fixed-size chunks (`decode_levels_on_device`), falling back to PIL for
images beyond its sizes (`resizes_on_device`). Every source kind can take the device path, as
`source.get` returns one stored size (`pipeline.device_image_shape`; TFDS and folder sources
return images resized to `image_size` at load, which leaves only the copy to the device). At
evaluation each batch is gathered by row ids and its levels become the model's float input (the
shared lookup table) inside the counting function. The model sees the same floats as without
the cache. A test set too large for both is read, resized and scaled batch by batch at every
evaluation: on the host with `preprocess='host'`, on the device from uint8 at the stored size
with `preprocess='device'` (`data.preprocess`).

`mask_unseen_logits` (Si-Blurry's protocol): logits of classes the stream has not shown yet are
set to -inf before the argmax, so the model can only predict seen classes. The mask is a traced
argument, so switching it or growing the seen set never recompiles.

Task-IL (`task_of_class`, each class's task; the protocol gives it where every class belongs to
one task, `protocol.task_il_map`): the same program also masks each example's logits to the
classes of its own task and counts that argmax's hits (`ClassCounts.task_il_correct`), one more
masked argmax on the same logits; without it the program is unchanged (docs/metrics.md).

The evaluator is the only part of the run that knows the task structure: which test examples
belong to which class and task. Per-class counts are the evaluation log from which
`olora_jax.metrics` derives every accuracy (per task, per class, sample-weighted, task-balanced).

Test sources with per-sample domain ids (`Source.domains`: rotated MNIST, CORe50's sessions, a
user dataset) are counted per (domain, class) cell, so a domain stream's "task i" can be domain
i's test data (`group_accuracies` with the stream's `EvaluationGroups`): an accuracy matrix over
domains, and forgetting per domain. Class counts are the sums over domains.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olora_jax import compute as compute_lib
from olora_jax import metrics as metrics_lib
from olora_jax import sharding
from olora_jax.data import device_preprocess
from olora_jax.data.pipeline import device_image_shape
from olora_jax.data.preprocess import PREPROCESS_MODES, pad_batch, to_model_input, to_model_levels
from olora_jax.data.sources import Source, domains_of
from olora_jax.data.streams import EvaluationGroups

# The test-set cache's budgets: the share of one device's memory it may take there, and of the
# host's memory when it does not fit the device (compute.device_memory_bytes; on a CPU both are
# the machine's memory). Beyond both, test batches are preprocessed at every evaluation.
CACHE_DEVICE_FRACTION = 0.25
CACHE_HOST_FRACTION = 0.25
CACHE_WHERE = ("device", "host", "none")  # where `Evaluator.cached` can be
# With data.preprocess='device' the cache is built on the device, from chunks of this many bytes
# of int32 levels at the model's resolution (`build_chunk`).
DEVICE_BUILD_CHUNK_BYTES = 64 * 2**20
TRACE_COUNTS = {"count": 0}


class ClassCounts(NamedTuple):
  """Per-class counts of one evaluation: `correct` and `total` (C,) int64 on the host; with
  `domain_correct` / `domain_total` (D, C), the same per test domain `domain_ids[d]` (D = 1 and
  domain id 0 for a source without domains); `task_il_correct` (C,), the task-incremental
  counts of the same predictions (module docstring), where the evaluator counts them."""

  correct: np.ndarray
  total: np.ndarray
  domain_correct: np.ndarray | None = None
  domain_total: np.ndarray | None = None
  domain_ids: np.ndarray | None = None
  # Task-IL (C,): examples right when the logits are masked to their task's classes (an
  # evaluator given `task_of_class`; None otherwise).
  task_il_correct: np.ndarray | None = None

  def accuracy(self, classes: np.ndarray | None = None,
               domains: np.ndarray | None = None) -> float:
    """Sample-weighted accuracy over the test examples of `classes` (all when None) in
    `domains` (all when None)."""
    if domains is None:
      return metrics_lib.sample_weighted_accuracy(self.correct, self.total, classes)
    rows = np.isin(self.domain_ids, domains)
    return metrics_lib.sample_weighted_accuracy(self.domain_correct[rows].sum(0),
                                                self.domain_total[rows].sum(0), classes)

  def class_accuracy(self) -> np.ndarray:
    return metrics_lib.class_accuracy(self.correct, self.total)

  def task_accuracies(self, task_classes) -> np.ndarray:
    return metrics_lib.task_accuracies(self.correct, self.total, task_classes)

  def task_il_accuracy(self, classes: np.ndarray | None = None) -> float:
    """The Task-IL accuracy (sample-weighted) over the test examples of `classes` (all when
    None); nan where the evaluator does not count Task-IL."""
    if self.task_il_correct is None:
      return float("nan")
    return metrics_lib.sample_weighted_accuracy(self.task_il_correct, self.total, classes)

  def task_il_accuracies(self, task_classes) -> np.ndarray:
    """The Task-IL accuracy on each task's test data: a column of the Task-IL matrix."""
    return metrics_lib.task_accuracies(self.task_il_correct, self.total, task_classes)


def group_accuracies(counts: ClassCounts, groups: EvaluationGroups,
                     classes: np.ndarray | None = None,
                     domains: np.ndarray | None = None) -> np.ndarray:
  """The accuracy on each task's test data, (T,): a column a_{:, j} of the accuracy matrix.

  By class (`groups.by_domain` False): task i = the test examples of `groups.classes[i]`. By
  domain: task i = the test examples of domain `groups.domains[i]`. Only the test examples of
  `classes` (all when None) count, and with `domains` given a task whose domain is not in it
  is nan (not seen yet). Pure, on host counts."""
  if not groups.by_domain:
    if classes is None:
      return metrics_lib.task_accuracies(counts.correct, counts.total, groups.classes)
    mask = np.isin(np.arange(len(counts.correct)), classes)
    return metrics_lib.task_accuracies(counts.correct * mask, counts.total * mask, groups.classes)
  mask = (np.ones(len(counts.correct), bool) if classes is None
          else np.isin(np.arange(len(counts.correct)), classes))
  out = []
  for task_classes, domain in zip(groups.classes, groups.domains, strict=True):
    if domains is not None and domain not in np.asarray(domains):
      out.append(float("nan"))
      continue
    row = int(np.flatnonzero(counts.domain_ids == domain)[0])
    out.append(metrics_lib.sample_weighted_accuracy(
        counts.domain_correct[row] * mask, counts.domain_total[row] * mask, task_classes))
  return np.array(out)


def predict_in_pieces(predict_fn: Callable[..., jax.Array], state: Any, images: jax.Array,
                      chunk: int, n_shards: int = 1, mask: jax.Array | None = None
                      ) -> jax.Array:
  """`predict_fn(state, images)` (B, C), computed `chunk` images per shard at a time.

  The batch's rows are split in `n_shards` equal blocks (one per device, as the batch is
  sharded); piece i holds rows i*chunk..(i+1)*chunk - 1 of every block, so each device keeps
  predicting its own rows, and `jax.lax.map` runs the pieces one after another. Each example's
  logits depend on that example alone, so the pieces give the whole batch's predictions (up to
  float rounding: XLA may round a logit's last bit differently for another pass size); the
  smaller passes keep a large batch's activations closer to the CPU caches. `chunk=0`, or a chunk
  holding a whole block, is one pass. With `mask` (B,), a piece of padding rows alone skips the
  model (its logits are zeros): a padded last batch costs the passes of its real rows, rounded up
  to a piece."""
  b = images.shape[0]
  if not chunk or b // n_shards <= chunk:
    return predict_fn(state, images)
  pieces = b // n_shards // chunk
  rest = images.shape[1:]
  x = images.reshape(n_shards, pieces, chunk, *rest).swapaxes(0, 1)
  x = x.reshape(pieces, n_shards * chunk, *rest)
  if mask is None:
    logits = jax.lax.map(lambda piece: predict_fn(state, piece), x)  # (pieces, shards*chunk, C)
  else:
    valid = mask.reshape(n_shards, pieces, chunk).swapaxes(0, 1).reshape(pieces, -1)
    out = jax.eval_shape(predict_fn, state, x[0])

    def piece_logits(piece_and_valid):
      piece, any_valid = piece_and_valid
      return jax.lax.cond(any_valid, lambda p: predict_fn(state, p),
                          lambda p: jnp.zeros(out.shape, out.dtype), piece)

    logits = jax.lax.map(piece_logits, (x, valid.any(axis=1)))
  logits = logits.reshape(pieces, n_shards, chunk, -1).swapaxes(0, 1)
  return logits.reshape(b, -1)


def make_count_fn(predict_fn: Callable[..., jax.Array], num_classes: int,
                  num_domains: int = 1, preprocess_fn: Callable | None = None,
                  predict_chunk: int = 0, n_shards: int = 1) -> Callable:
  """Jitted `(state, images, labels, domains, mask, class_mask, correct, total[, cache,
  task_of_class, task_il_correct]) -> (correct, total[, task_il_correct])`: adds one padded
  batch's per-(domain, class) counts to the (D, C) accumulators; `domains` (B,) are row indices
  0..D-1. With `cache` (the test set's uint8 levels on the device), `images` are row ids into
  it. With `preprocess_fn(images, mask)`, the images are uint8 and become the model's input
  inside the same program (data.preprocess). With `predict_chunk`, the logits are computed that
  many images per shard at a time (`predict_in_pieces`, eval.predict_chunk). With
  `task_of_class` (C,) int32 (each class's task), the same logits are also masked to the
  classes of each example's task (its label's task; `class_mask` is not applied) and their
  argmax's hits added to `task_il_correct` (D, C): Task-IL, one more masked argmax in the same
  program (without it the program is what it always was)."""

  def count(state, images, labels, domains, mask, class_mask, correct, total, cache=None,
            task_of_class=None, task_il_correct=None):
    TRACE_COUNTS["count"] += 1
    if cache is not None:  # `images` are the batch's row ids in the cached test set
      images = cache[images]
    if preprocess_fn is not None:
      images = preprocess_fn(images, mask)
    raw_logits = predict_in_pieces(predict_fn, state, images, predict_chunk, n_shards,
                                   mask)  # (B, C)
    logits = jnp.where(class_mask[None, :], raw_logits, -jnp.inf)
    hits = (jnp.argmax(logits, axis=-1) == labels) & mask  # (B,)
    cells = jnp.zeros((num_domains, num_classes), jnp.int32)
    correct = correct + cells.at[domains, labels].add(hits.astype(jnp.int32))
    total = total + cells.at[domains, labels].add(mask.astype(jnp.int32))
    if task_of_class is None:
      return correct, total
    same_task = task_of_class[None, :] == task_of_class[labels][:, None]  # (B, C)
    til_logits = jnp.where(same_task, raw_logits, -jnp.inf)
    til_hits = (jnp.argmax(til_logits, axis=-1) == labels) & mask
    task_il_correct = task_il_correct + cells.at[domains, labels].add(til_hits.astype(jnp.int32))
    return correct, total, task_il_correct

  return jax.jit(count)


def make_logits_fn(predict_fn: Callable[..., jax.Array], preprocess_fn: Callable | None = None,
                   predict_chunk: int = 0, n_shards: int = 1) -> Callable:
  """Jitted `(state, images, mask[, cache]) -> logits (B, C)`: the model's raw logits (no class
  mask) on one padded batch, the inputs made as `make_count_fn` makes them (eval.export)."""

  def logits(state, images, mask, cache=None):
    if cache is not None:
      images = cache[images]
    if preprocess_fn is not None:
      images = preprocess_fn(images, mask)
    return predict_in_pieces(predict_fn, state, images, predict_chunk, n_shards, mask)

  return jax.jit(logits)


# The share of a device's free memory one evaluation batch's program may take beyond the arrays
# it reads (the state, the cached test set): `fit_batch`.
EVAL_MEMORY_FRACTION = 0.9


def free_device_bytes() -> int | None:
  """The free memory of the least free local device (allocator limit minus bytes in use), or
  None where the backend does not report it (a CPU: there it is the host's)."""
  free = []
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None
    free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  return min(free) if free else None


def fit_batch(batch_size: int, needed: Callable[[int], int], free: int, step: int) -> int:
  """The largest of `batch_size`, batch_size / 2, ... (multiples of `step`, at least `step`)
  whose program's working memory `needed(b)` fits EVAL_MEMORY_FRACTION of `free` bytes;
  `step` when none does (the run then fails as it would have, out of memory, with its advice)."""
  b = batch_size
  while b > step and needed(b) > EVAL_MEMORY_FRACTION * free:
    b = max(step, b // 2 // step * step)
  return b


# eval.predict_chunk=-1 (the default): picked by the backend (`resolve_predict_chunk`).
AUTO_PREDICT_CHUNK = -1
# On a CPU: passes of 64 images keep a ViT's activations closer to the caches
# (docs/performance-internals.md).
CPU_PREDICT_CHUNK = 64


def resolve_predict_chunk(chunk: int, batch_size: int, n_devices: int,
                          backend: str | None = None) -> int:
  """eval.predict_chunk as it runs: `chunk` itself, or for -1 (auto) CPU_PREDICT_CHUNK on a CPU
  backend when it divides each device's rows of a test batch, else 0 (one pass: GPUs and TPUs,
  whose large passes are faster)."""
  if chunk != AUTO_PREDICT_CHUNK:
    return chunk
  per_device = batch_size // n_devices
  on_cpu = (backend or jax.default_backend()) == "cpu"
  return CPU_PREDICT_CHUNK if on_cpu and per_device % CPU_PREDICT_CHUNK == 0 else 0


def check_predict_chunk(chunk: int, batch_size: int, n_devices: int) -> None:
  """eval.predict_chunk: 0 (one pass), -1 (by backend) or a divisor of each device's rows of a
  test batch."""
  per_device = batch_size // n_devices
  if chunk < AUTO_PREDICT_CHUNK or (chunk > 0 and per_device % chunk):
    raise ValueError(
        f"eval.predict_chunk={chunk} must be 0 (whole batches), -1 (picked by the backend) or"
        f" divide the {per_device} rows of a test batch per device (eval.batch_size={batch_size}"
        f" over {n_devices} devices); pick a divisor")


def cache_placement(source: Source, image_size: int, mesh: Mesh) -> str:
  """Where the test set's uint8 levels at `image_size` are kept: 'device' when they fit
  CACHE_DEVICE_FRACTION of one device's memory in a single-process run, else 'host' when they
  fit CACHE_HOST_FRACTION of the host's, else 'none'."""
  if not len(source):
    return "none"
  channels = np.asarray(source.get(np.arange(1))[0]).shape[-1]
  n_bytes = len(source) * image_size * image_size * channels
  device_bytes = compute_lib.device_memory_bytes()
  if (jax.process_count() == 1 and device_bytes
      and n_bytes <= CACHE_DEVICE_FRACTION * device_bytes):
    return "device"
  host_bytes = compute_lib.host_memory_bytes()
  if host_bytes and n_bytes <= CACHE_HOST_FRACTION * host_bytes:
    return "host"
  return "none"


def decode_levels(source: Source, image_size: int, chunk: int = 1024) -> np.ndarray:
  """Every test image of `source` decoded and resized once on the host (PIL):
  (N, S, S, 1|3) uint8 levels, read `chunk` images at a time (the decoded originals never all in
  memory at once)."""
  first = to_model_levels(np.asarray(source.get(np.arange(1))[0]), image_size)
  out = np.empty((len(source), *first.shape[1:]), np.uint8)
  for start in range(0, len(source), chunk):
    ids = np.arange(start, min(start + chunk, len(source)))
    out[ids] = to_model_levels(np.asarray(source.get(ids)[0]), image_size)
  return out


def resizes_on_device(source: Source, image_size: int) -> bool:
  """Whether `decode_levels_on_device` takes `source`: its images (what `source.get` returns,
  one stored size for every source kind, `device_image_shape`) within the device resize's sizes
  (`device_preprocess.check_sizes`); else the cache is built with PIL (the same levels)."""
  try:
    device_preprocess.check_sizes(*device_image_shape(source, "none")[:2], image_size)
  except ValueError:
    return False
  return True


def build_chunk(n_images: int, image_size: int, channels: int, n_devices: int) -> int:
  """Images per chunk of `decode_levels_on_device`: DEVICE_BUILD_CHUNK_BYTES of int32 levels at
  the model's resolution (the resize's intermediates are a few times that), a multiple of
  `n_devices` (each device resizes its share), at most the test set (rounded up likewise)."""
  per_image = image_size * image_size * channels * 4
  rows = max(n_devices, DEVICE_BUILD_CHUNK_BYTES // per_image // n_devices * n_devices)
  return min(rows, -(-n_images // n_devices) * n_devices)


@functools.partial(jax.jit, static_argnames="image_size")
def _uint8_levels(images: jax.Array, image_size: int) -> jax.Array:
  """`device_preprocess.model_levels` of a chunk of stored images, as uint8."""
  return device_preprocess.model_levels(images, image_size).astype(jnp.uint8)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="placement")
def _write_rows(cache: jax.Array, levels: jax.Array, start: jax.Array,
                placement: jax.sharding.Sharding) -> jax.Array:
  """`cache` (donated) with rows start.. set to `levels`, kept on `placement`; rows past the
  cache's end (a padded chunk's) are dropped."""
  cache = cache.at[start + jnp.arange(levels.shape[0])].set(levels, mode="drop")
  return jax.lax.with_sharding_constraint(cache, placement)


def decode_levels_on_device(source: Source, image_size: int, mesh: Mesh, where: str,
                            chunk: int = 0) -> jax.Array | np.ndarray:
  """`decode_levels` with the device resize (data.preprocess='device'): the same (N, S, S, 1|3)
  uint8 levels, bit for bit (Pillow's fixed point, data/device_preprocess.py).

  The stored uint8 images (what `source.get` returns) go to the device `chunk` at a time
  (`build_chunk` when 0), the last chunk padded, so the resize compiles once. With `where`
  'device' (a single-process run) each chunk is split over the mesh's devices and its levels
  are written into the replicated cache in place (a donated buffer): nothing returns to the
  host. With 'host' one local device resizes each chunk and the host copies it into a NumPy
  array while the device resizes the next."""
  n = len(source)
  height, width, channels = device_image_shape(source, "none")
  if where == "device":
    n_devices, cache_sharding = mesh.devices.size, sharding.replicated(mesh)
    in_sharding = jax.sharding.NamedSharding(mesh, sharding.BATCH)
  else:
    n_devices = 1
    in_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  chunk = chunk or build_chunk(n, image_size, channels, n_devices)

  shape = (n, image_size, image_size, channels)
  if where == "device":
    cache = jnp.zeros(shape, jnp.uint8, device=cache_sharding)
  else:
    cache = np.empty(shape, np.uint8)
  pending = None  # the previous chunk's levels on the device, and their rows
  for start in range(0, n, chunk):
    ids = np.arange(start, min(start + chunk, n))
    images = np.asarray(source.get(ids)[0])
    if images.shape[1:] != (height, width, channels) or images.dtype != np.uint8:
      raise ValueError(
          f"test images {ids[0]}..{ids[-1]} of data.dataset={getattr(source, 'name', '?')!r}"
          f" are {images.dtype} {images.shape[1:]}, not uint8 {(height, width, channels)} as"
          " the first test image: return one size for every image; or use"
          " data.preprocess='host'")
    padded = np.zeros((chunk, height, width, channels), np.uint8)
    padded[:len(ids)] = images
    padded = jax.device_put(padded, in_sharding)
    if where == "device":
      cache = _write_rows(cache, _uint8_levels(padded, image_size), np.int32(start),
                          cache_sharding)
      continue
    levels = _uint8_levels(padded, image_size)  # dispatched: the copy below overlaps the resize
    if pending is not None:
      cache[pending[1]] = np.asarray(pending[0])[:len(pending[1])]
    pending = (levels, ids)
  if pending is not None:
    cache[pending[1]] = np.asarray(pending[0])[:len(pending[1])]
  return cache


class Evaluator:
  """Per-class counts of `predict` on a test `Source`; see the module docstring."""

  def __init__(self, source: Source, image_size: int, batch_size: int, num_classes: int,
               predict_fn: Callable[..., jax.Array], mask_unseen_logits: bool = False,
               mesh: Mesh | None = None, input_scale: str = "unit", preprocess: str = "host",
               predict_chunk: int = 0, task_of_class: np.ndarray | None = None):
    if batch_size < 1:
      raise ValueError(f"eval.batch_size={batch_size} must be >= 1")
    self.mesh = mesh or sharding.make_mesh()  # batches split over devices (olora_jax/sharding.py)
    check_predict_chunk(predict_chunk, batch_size, self.mesh.devices.size)
    predict_chunk = resolve_predict_chunk(predict_chunk, batch_size, self.mesh.devices.size)
    if len(source) and int(source.labels.max()) >= num_classes:
      raise ValueError(
          f"test label {int(source.labels.max())} >= num_classes={num_classes}; the head must"
          " cover every class of the benchmark")
    self.source = source
    self.image_size = image_size
    self.batch_size = batch_size
    self.num_classes = num_classes
    self.mask_unseen_logits = mask_unseen_logits
    self.task_of_class = self._check_task_of_class(task_of_class, num_classes)
    self._set_domain_rows(source)
    if preprocess not in PREPROCESS_MODES:
      raise ValueError(f"unknown data.preprocess={preprocess!r}; use one of {PREPROCESS_MODES}")
    self.preprocess = preprocess
    # This process's rows of each test batch (all of them in a single-process run).
    self.rows = sharding.local_rows(batch_size, self.mesh)
    self.input_scale = input_scale
    self._cache_test_set(source, image_size, preprocess)
    self._build_programs(predict_fn, num_classes, image_size, input_scale, preprocess,
                         predict_chunk)
    # A test batch's rows: each device's a multiple of the chunk (`fit_batch`'s step).
    self._batch_step = self.mesh.devices.size * max(predict_chunk, 1)
    self._fitted = False  # `_fit_batch` runs at the first evaluation (it needs the state)

  @staticmethod
  def _check_task_of_class(task_of_class: np.ndarray | None, num_classes: int
                           ) -> np.ndarray | None:
    """`task_of_class` as the counting program takes it: (C,) int32, or None (no Task-IL)."""
    if task_of_class is None:
      return None
    task_of_class = np.asarray(task_of_class, np.int32)
    if task_of_class.shape != (num_classes,):
      raise ValueError(f"task_of_class has shape {task_of_class.shape}; it needs one task id per"
                       f" class, ({num_classes},)")
    return task_of_class

  def _set_domain_rows(self, source: Source) -> None:
    """`domain_ids`, the source's domains in order, and `_domain_row`, each test example's row in
    the (D, C) counts."""
    domains = domains_of(source)
    # Each test example's row in the (D, C) counts; one row when the source has no domains.
    if domains is None:
      self.domain_ids, self._domain_row = np.zeros(1, np.int64), np.zeros(len(source), np.int32)
    else:
      self.domain_ids, rows = np.unique(domains, return_inverse=True)
      self._domain_row = rows.astype(np.int32)

  def _cache_test_set(self, source: Source, image_size: int, preprocess: str) -> None:
    """Where the test set is kept at the model's resolution (`cached`: 'device', 'host' or
    'none', `cache_placement`) and the cache itself (`_levels`), decoded once."""
    self.cached = cache_placement(source, image_size, self.mesh)
    self._levels = None  # the cached test set: (N, S, S, 1|3) uint8, on the devices or the host
    if self.cached != "none" and preprocess == "device" and resizes_on_device(source, image_size):
      self._levels = decode_levels_on_device(source, image_size, self.mesh, self.cached)
    elif self.cached != "none":
      self._levels = decode_levels(source, image_size)
      if self.cached == "device":
        self._levels = sharding.replicate(self._levels, self.mesh)
    elif preprocess == "device":
      self._stored_shape = device_image_shape(source, "none")

  def _build_programs(self, predict_fn: Callable[..., jax.Array], num_classes: int,
                      image_size: int, input_scale: str, preprocess: str,
                      predict_chunk: int) -> None:
    """The counting program (`_count`) and the maker of the logits program (`_make_logits`,
    built on first use), both taking uint8 batches scaled on the device when the test set is
    cached or preprocessed there."""
    preprocess_fn = None
    if self.cached != "none" or preprocess == "device":  # uint8 batches, scaled in `count`
      preprocess_fn = functools.partial(device_preprocess.preprocess_images,
                                        image_size=image_size, input_scale=input_scale)
    self._count = make_count_fn(predict_fn, num_classes, len(self.domain_ids), preprocess_fn,
                                predict_chunk, self.mesh.devices.size)
    self._make_logits = functools.partial(make_logits_fn, predict_fn, preprocess_fn,
                                          predict_chunk, self.mesh.devices.size)
    self._logits = None  # built on first use (`logits`)

  def _batch(self, ids: np.ndarray) -> dict:
    """This process's rows of the padded test batch of `ids`."""
    ids = ids[self.rows]
    n_rows = self.rows.stop - self.rows.start
    labels = self.source.labels[ids]
    if self.cached == "device":  # row ids: the images are gathered on the device, in `count`
      images = ids.astype(np.int32)
    elif self.cached == "host":  # uint8 at the model's resolution
      images = self._levels[ids]
    elif self.preprocess == "device":
      images = self.source.get(ids)[0]
    else:
      images = to_model_input(self.source.get(ids)[0], self.image_size, self.input_scale)
    return pad_batch(images, labels, n_rows, domains=self._domain_row[ids])

  def class_mask(self, seen_classes: np.ndarray) -> np.ndarray:
    """The logits the model may predict: the seen classes when masking, else every class."""
    if not self.mask_unseen_logits:
      return np.ones(self.num_classes, bool)
    mask = np.zeros(self.num_classes, bool)
    mask[np.asarray(seen_classes, np.int64)] = True
    return mask

  def ids_of_classes(self, classes: np.ndarray, domains: np.ndarray | None = None) -> np.ndarray:
    """Test example ids of `classes`, restricted to `domains` when given."""
    keep = np.isin(self.source.labels, classes)
    if domains is not None:
      keep &= np.isin(self.domain_ids[self._domain_row], domains)
    return np.flatnonzero(keep)

  def counts(self, state: Any, ids: np.ndarray, seen_classes: np.ndarray) -> ClassCounts:
    """Per-class (and per-domain) correct/total over test `ids` with the model given by the
    method's `state`. Reads the state, never changes it."""
    ids = np.asarray(ids, np.int64)
    shape = (len(self.domain_ids), self.num_classes)
    # Accumulators and the class mask are replicated like the state: one placement, one compile.
    # With Task-IL: its class -> task map and its own accumulator, in the same program.
    til = () if self.task_of_class is None else (self.task_of_class, np.zeros(shape, np.int32))
    class_mask, correct, total, til = sharding.replicate(
        (self.class_mask(seen_classes), np.zeros(shape, np.int32), np.zeros(shape, np.int32),
         til), self.mesh)
    if not self._fitted:
      self._fit_batch(state, class_mask, correct, total, til)
    for start in range(0, len(ids), self.batch_size):
      out = self._count(*self._args(state, ids[start:start + self.batch_size], class_mask,
                                    correct, total, til))
      correct, total, til = out[0], out[1], (til[0], out[2]) if til else ()
    # One transfer per evaluation (the counts are replicated: no communication either).
    correct, total, til_correct = sharding.to_host((correct, total, til[1] if til else None))
    correct, total = correct.astype(np.int64), total.astype(np.int64)
    til_correct = None if til_correct is None else til_correct.astype(np.int64).sum(0)
    return ClassCounts(correct.sum(0), total.sum(0), correct, total, self.domain_ids,
                       til_correct)

  def _args(self, state: Any, ids: np.ndarray, class_mask, correct, total, til=()) -> tuple:
    """The counting program's arguments for the test batch of `ids` (padded, placed); `til`:
    Task-IL's (task_of_class, task_il_correct) on the devices, or () without Task-IL."""
    batch = sharding.shard_batch(self._batch(ids), self.mesh)
    return (state, batch["images"], batch["labels"], batch["domains"], batch["mask"],
            class_mask, correct, total, self._levels if self.cached == "device" else None,
            *til)

  def _fit_batch(self, state: Any, class_mask, correct, total, til=()) -> None:
    """Where the device reports its free memory: eval.batch_size halved (`fit_batch`) until
    the counting program's working memory (XLA's temporaries and outputs; the state and test
    set it reads are already there) fits it. Each try is compiled ahead of time; JAX keeps the
    one that fits for every later call, so a batch that fits at once costs no extra compile.
    The predictions do not depend on the batch size (each example's logits are its own)."""
    self._fitted = True
    free = free_device_bytes()
    if free is None or not len(self.source):
      return

    def needed(b: int) -> int:
      self.batch_size, self.rows = b, sharding.local_rows(b, self.mesh)
      args = self._args(state, np.arange(min(b, len(self.source))), class_mask, correct, total,
                        til)
      memory = self._count.lower(*args).compile().memory_analysis()
      return 0 if memory is None else memory.temp_size_in_bytes + memory.output_size_in_bytes

    asked = self.batch_size
    fitted = -sharding.process_max(-fit_batch(asked, needed, free, self._batch_step))
    if fitted != self.batch_size:  # the last try was another size (or another process's)
      self.batch_size, self.rows = fitted, sharding.local_rows(fitted, self.mesh)
    if fitted < asked:
      logging.warning("eval.batch_size=%d does not fit the device's %.1f GiB of free memory:"
                      " evaluating in batches of %d (the same predictions)", asked,
                      free / 2**30, fitted)

  def seen_counts(self, state: Any, seen_classes: np.ndarray,
                  seen_domains: np.ndarray | None = None) -> ClassCounts:
    """Counts on the test data of the classes (and domains, when given) seen so far: the
    anytime evaluation."""
    return self.counts(state, self.ids_of_classes(seen_classes, seen_domains), seen_classes)

  def all_counts(self, state: Any, seen_classes: np.ndarray) -> ClassCounts:
    """Counts on the whole test set (the task-end evaluation filling a column of a_{i,j})."""
    return self.counts(state, np.arange(len(self.source)), seen_classes)

  def logits(self, state: Any, ids: np.ndarray) -> np.ndarray:
    """(len(ids), C) float32 on the host: the model's raw logits (no class mask) on test
    examples `ids`, in their order, from the same inputs and forward pass as `counts` (one more
    compiled program, built on first use: eval.export). Reads the state, never changes it."""
    if self._logits is None:
      self._logits = self._make_logits()
    ids = np.asarray(ids, np.int64)
    out = []
    for start in range(0, len(ids), self.batch_size):
      batch = sharding.shard_batch(self._batch(ids[start:start + self.batch_size]), self.mesh)
      logits = self._logits(state, batch["images"], batch["mask"],
                            self._levels if self.cached == "device" else None)
      logits, mask = sharding.to_host((logits, batch["mask"]))  # every process's rows, in order
      out.append(np.asarray(logits, np.float32)[np.asarray(mask, bool)])
    if not out:
      return np.zeros((0, self.num_classes), np.float32)
    return np.concatenate(out)
