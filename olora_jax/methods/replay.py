"""Fixed-capacity replay buffers on the device, updated inside jit.

`ReplayBuffer` holds K samples with static shapes: images as uint8 (4x smaller than the float
model input, and exact: model inputs are k/255 or 2k/255 - 1 for a uint8 k, see
data/preprocess.py), labels, optionally the logits a sample had when it entered (DER++), and a
validity mask (a buffer starts empty). Padded batch items are never stored.

Policies (both draw from a key the caller derives from the run's seeded key and the step, so a
resumed run makes the same draws):
  reservoir       (ER, DER++, AGEM, MIR; Vitter 1985) the n-th real sample seen enters slot n while
                  the buffer fills, then replaces a uniform slot with probability K / n: every
                  sample seen so far is kept with probability K / n.
  class_balanced  (GDumb's greedy sampler) a sample enters a free slot; once full, it enters only
                  if its class holds fewer than K // (classes seen) samples, replacing a random
                  sample of the largest class.
`sample` draws n distinct valid slots uniformly (random retrieval).

Given draws (`data.replay_draws`, docs/replay.md): instead of the run's own keys, a run can take
each step's reservoir decisions and replay draws from a file, another codebase's, so that the two
runs store and replay the same samples (`read_draws`, `given_update`, `given_sample`). The file is
one JSON object, checked against this schema by `check_draws` before any compute:

    format          "olora-jax replay draws v1"
    stored_slot     T lists (one per stream step), one entry per item of the step's batch: the
                    slot the item is written to, or -1 when the reservoir rejects it
    replayed_slots  T lists: the slots replayed at the step, in order (at most the replay batch;
                    [] = no replay, e.g. an empty buffer)
    second_replayed_slots
                    T lists, only for a method that draws twice a step (DER++: `replayed_slots`
                    for its logit term, these for its label term), in the same form; a file
                    without it drives the one-draw methods as before
    source          optional: what recorded it (informational)

A step's replay draws are made before its batch enters the buffer, as in every method here.
"""

from __future__ import annotations

import json
import os

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class ReplayBuffer:
  """K stored samples with static shapes and a validity mask (a pytree: it lives in a method's
  state and is updated inside jit). Made by `init`, filled by `reservoir_update` or
  `class_balanced_update`, read by `sample` and `gather`."""

  images: jax.Array  # (K, H, W, 3) uint8
  labels: jax.Array  # (K,) int32
  logits: jax.Array  # (K, C) float32 logits at insertion (DER++), (K, 0) otherwise
  valid: jax.Array  # (K,) bool
  n_seen: jax.Array  # int32 (): real samples offered so far (the reservoir's n)

  @property
  def capacity(self) -> int:
    return self.labels.shape[0]


def init(capacity: int, image_shape: tuple[int, ...], n_logits: int = 0) -> ReplayBuffer:
  """An empty `ReplayBuffer` of K = `capacity` slots for uint8 images of `image_shape` (H, W, 3),
  with room for `n_logits` logits per sample (DER++; 0 keeps none). ValueError if K < 0."""
  if capacity < 0:
    raise ValueError(f"buffer_size={capacity} must be >= 0")
  return ReplayBuffer(images=jnp.zeros((capacity, *image_shape), jnp.uint8),
                      labels=jnp.zeros((capacity,), jnp.int32),
                      logits=jnp.zeros((capacity, n_logits), jnp.float32),
                      valid=jnp.zeros((capacity,), bool), n_seen=jnp.zeros((), jnp.int32))


def encode(images: jax.Array, input_scale: str) -> jax.Array:
  """Model inputs (N, H, W, 3) float32 -> the uint8 pixels they were made from (exact)."""
  unit = (images + 1.0) / 2.0 if input_scale == "signed" else images
  return jnp.clip(jnp.round(unit * 255.0), 0, 255).astype(jnp.uint8)


def decode(pixels: jax.Array, input_scale: str) -> jax.Array:
  """uint8 pixels -> model inputs, computed as data/preprocess.to_model_input does."""
  unit = pixels.astype(jnp.float32) / 255.0
  return 2.0 * unit - 1.0 if input_scale == "signed" else unit


def _write(buf: ReplayBuffer, slot, write, pixels, label, logits) -> ReplayBuffer:
  """Slot `slot` takes the sample when `write` (a traced bool), else stays as it was."""
  keep = lambda new, old: jnp.where(write, new, old)  # noqa: E731
  return buf.replace(
      images=buf.images.at[slot].set(keep(pixels, buf.images[slot])),
      labels=buf.labels.at[slot].set(keep(label, buf.labels[slot])),
      logits=buf.logits.at[slot].set(keep(logits, buf.logits[slot])),
      valid=buf.valid.at[slot].set(buf.valid[slot] | write))


def reservoir_update(buf: ReplayBuffer, batch: dict, key: jax.Array, input_scale: str,
                     logits: jax.Array | None = None) -> ReplayBuffer:
  """Offers the batch's real items, in order, to the reservoir (Vitter's algorithm R) and
  returns the updated buffer. `logits` (B, C) are stored with them when the buffer keeps logits.
  Pure; one draw per item from fold_in(key, item)."""
  if buf.capacity == 0:
    return buf
  k = buf.capacity
  pixels = encode(batch["images"], input_scale)
  if logits is None:
    logits = jnp.zeros((pixels.shape[0], buf.logits.shape[1]), jnp.float32)

  def offer(i, buf):
    real, n = batch["mask"][i], buf.n_seen
    j = jax.random.randint(jax.random.fold_in(key, i), (), 0, jnp.maximum(n + 1, 1))
    slot = jnp.where(n < k, n, j)  # while filling: the next free slot; then uniform in [0, n]
    write = real & (slot < k)
    buf = _write(buf, jnp.minimum(slot, k - 1), write, pixels[i], batch["labels"][i], logits[i])
    return buf.replace(n_seen=n + real.astype(jnp.int32))

  return jax.lax.fori_loop(0, pixels.shape[0], offer, buf)


def class_balanced_update(buf: ReplayBuffer, class_seen: jax.Array, batch: dict, key: jax.Array,
                          input_scale: str) -> tuple[ReplayBuffer, jax.Array]:
  """GDumb's greedy class-balanced sampler over the batch's real items; `class_seen` (C,) bool
  marks the classes met so far. Returns the buffer and the updated `class_seen`."""
  if buf.capacity == 0:
    return buf, class_seen
  k, num_classes = buf.capacity, class_seen.shape[0]
  pixels = encode(batch["images"], input_scale)
  no_logits = jnp.zeros((buf.logits.shape[1],), jnp.float32)

  def offer(i, carry):
    buf, class_seen = carry
    label, real = batch["labels"][i], batch["mask"][i]
    class_seen = class_seen.at[label].set(class_seen[label] | real)
    counts = jnp.zeros(num_classes, jnp.int32).at[buf.labels].add(buf.valid.astype(jnp.int32))
    full = jnp.all(buf.valid)
    quota = k // jnp.maximum(jnp.sum(class_seen), 1)
    largest = jnp.argmax(counts)
    draw = jax.random.uniform(jax.random.fold_in(key, i), (k,))
    victim = jnp.argmax(jnp.where(buf.valid & (buf.labels == largest), draw, -1.0))
    slot = jnp.where(full, victim, jnp.argmin(buf.valid))  # argmin: the first free slot
    write = real & (~full | (counts[label] < quota))
    buf = _write(buf, slot, write, pixels[i], label, no_logits)
    return buf.replace(n_seen=buf.n_seen + real.astype(jnp.int32)), class_seen

  return jax.lax.fori_loop(0, pixels.shape[0], offer, (buf, class_seen))


def sample(buf: ReplayBuffer, key: jax.Array, n: int, input_scale: str) -> dict:
  """n distinct slots drawn uniformly among the valid ones (fewer valid: the rest is masked).

  Returns {"images" (n, H, W, 3) float32 model inputs, "labels" (n,), "mask" (n,), "logits"
  (n, C), "index" (n,)}. Needs n <= capacity (checked by the config validation)."""
  scores = jnp.where(buf.valid, jax.random.uniform(key, (buf.capacity,)), -1.0)
  _, idx = jax.lax.top_k(scores, n)
  return gather(buf, idx, input_scale)


def gather(buf: ReplayBuffer, idx: jax.Array, input_scale: str) -> dict:
  """The buffer's slots `idx` as a batch (see `sample`)."""
  return {"images": decode(buf.images[idx], input_scale), "labels": buf.labels[idx],
          "mask": buf.valid[idx], "logits": buf.logits[idx], "index": idx}


DRAWS_FORMAT = "olora-jax replay draws v1"


class DrawsError(ValueError):
  """A replay-draws file that cannot drive the run (one line, with the fix)."""


REPLAY_FIELDS = ("replayed_slots", "second_replayed_slots")  # a step's draws, in order


def read_draws(path: str, capacity: int, batch_size: int, replay_batch: int,
               n_steps: int, draws_per_step: int = 1, step_items=None) -> dict:
  """The draws file `path` (module docstring) as {"stored_slot" (T, B) int32, "replayed_slots"
  (T, R) int32} (and "second_replayed_slots" (T, R) when `draws_per_step` is 2), -1 padded, for a
  run of `n_steps` steps of at most `batch_size` items, a buffer of `capacity` slots and
  `replay_batch` = R per draw; `step_items` (one count per step: the items of each stream step's
  batch), when given, is what each step's `stored_slot` must match. Checked first, before any
  compute, by `check_draws` (DrawsError, one line naming the file, the row and the value)."""
  where = f"data.replay_draws={path!r}"
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{where} does not exist; give the path of a replay-draws JSON file")
  with open(path) as f:
    try:
      draws = json.load(f)
    except json.JSONDecodeError as e:
      raise DrawsError(f"{where} is not JSON ({e})") from None
  fields = REPLAY_FIELDS[:draws_per_step]
  check_draws(draws, where, capacity, batch_size, replay_batch, n_steps, draws_per_step,
              step_items)
  out = {"stored_slot": np.full((n_steps, batch_size), -1, np.int32),
         **{name: np.full((n_steps, replay_batch), -1, np.int32) for name in fields}}
  for t, slots in enumerate(draws["stored_slot"]):
    out["stored_slot"][t, :len(slots)] = slots
    for name in fields:
      out[name][t, :len(draws[name][t])] = draws[name][t]
  return out


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is no slot


def check_draws(draws, where: str, capacity: int, batch_size: int, replay_batch: int,
                n_steps: int, draws_per_step: int = 1, step_items=None) -> None:
  """The one check of a replay-draws file against its documented schema (docs/replay.md): a JSON
  object of the format, with `stored_slot` and the method's `draws_per_step` replay fields, each
  a list of one list of integers per stream step (`n_steps`); each step's `stored_slot` one slot
  per item of its batch (`step_items`, else at most `batch_size`), each in [-1, `capacity`);
  each replay draw at most `replay_batch` distinct slots, each filled by an earlier step. Raises
  DrawsError naming `where` (the file), the row and the value."""
  if not isinstance(draws, dict) or draws.get("format") != DRAWS_FORMAT:
    raise DrawsError(f"{where}: not a replay-draws file (its format must be {DRAWS_FORMAT!r})")
  fields = REPLAY_FIELDS[:draws_per_step]
  if REPLAY_FIELDS[1] in draws and draws_per_step == 1:
    raise DrawsError(f"{where} has two replay draws a step ({REPLAY_FIELDS[1]}); the method"
                     " draws one: record the draws from the same method")
  for name in ("stored_slot", *fields):
    lists = draws.get(name)
    if not (isinstance(lists, list) and all(isinstance(x, list) for x in lists)):
      raise DrawsError(f"{where}: {name} must be a list of lists of integers, one per step")
    if len(lists) != n_steps:
      raise DrawsError(f"{where}: {name} has {len(lists)} steps, the run's stream {n_steps};"
                       " record the draws on the same stream manifest")
    for t, row in enumerate(lists):
      bad = next((i for i, v in enumerate(row) if not _is_int(v)), None)
      if bad is not None:
        slots = (f"a buffer slot in [-1, {capacity}) (-1: not stored)" if name == "stored_slot"
                 else f"buffer slots in [0, {capacity})")
        raise DrawsError(f"{where}: {name}[{t}][{bad}] is {json.dumps(row[bad])}, not an"
                         f" integer; give {slots}")
  filled = np.zeros(capacity, bool)
  for t, slots in enumerate(draws["stored_slot"]):
    items = batch_size if step_items is None else int(step_items[t])
    if len(slots) > items or (step_items is not None and len(slots) != items):
      raise DrawsError(f"{where}: stored_slot[{t}] has {len(slots)} entries but stream step {t}"
                       f" has {items} items; give one slot (or -1) per item of each step's batch,"
                       " recorded on the same stream manifest and learner.batch_size")
    outside = next((i for i, v in enumerate(slots) if not -1 <= v < capacity), None)
    if outside is not None:
      raise DrawsError(f"{where}: stored_slot[{t}][{outside}] is {slots[outside]}, outside"
                       f" [-1, {capacity}); give a slot of the buffer (its size is the method's"
                       " buffer_size) or -1")
    for name in fields:
      drawn = draws[name][t]
      if len(drawn) > replay_batch or len(set(drawn)) != len(drawn) or not all(
          0 <= v < capacity and filled[v] for v in drawn):
        raise DrawsError(f"{where}: step {t} replays slots {drawn}; give at most"
                         f" {replay_batch} distinct slots, each filled by an earlier step")
    filled[[v for v in slots if v >= 0]] = True


def given_update(buf: ReplayBuffer, batch: dict, slots: jax.Array, input_scale: str,
                 logits: jax.Array | None = None) -> ReplayBuffer:
  """The buffer after the batch's real items are written, in order, to the given `slots` (B,)
  (-1: not stored): a later item written to the same slot wins, as a sequential reservoir.
  `logits` (B, C) are stored with them when the buffer keeps logits (DER++)."""
  if buf.capacity == 0:
    return buf
  pixels = encode(batch["images"], input_scale)
  if logits is None:
    logits = jnp.zeros((pixels.shape[0], buf.logits.shape[1]), jnp.float32)

  def offer(i, buf):
    real = batch["mask"][i]
    buf = _write(buf, jnp.maximum(slots[i], 0), real & (slots[i] >= 0), pixels[i],
                 batch["labels"][i], logits[i])
    return buf.replace(n_seen=buf.n_seen + real.astype(jnp.int32))

  return jax.lax.fori_loop(0, pixels.shape[0], offer, buf)


def given_sample(buf: ReplayBuffer, slots: jax.Array, input_scale: str) -> dict:
  """The buffer's given `slots` (R,) as a replay draw (see `sample`); -1 entries are masked."""
  drawn = gather(buf, jnp.maximum(slots, 0), input_scale)
  return {**drawn, "mask": drawn["mask"] & (slots >= 0)}
