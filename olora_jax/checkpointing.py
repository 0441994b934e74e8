"""Full-state checkpoints with orbax, verified on restore, so a run resumes bit-exactly.

An online learner's state is more than its weights: what it does next also depends on its
buffers, the loss window and peak flag, the plateau count, Omega, the optimizer state, the RNG key
and where the stream stands. A checkpoint therefore holds the whole run (docs/checkpoints.md):

  arrays   (orbax StandardSave)  the method's whole state pytree (olora_jax/methods/base.py);
                                  for Online-LoRA {"state": TrainState (LoRA, head, optimizer
                                  state, Omega, plateau count k, step, PRNG key), "frozen": the
                                  backbone with every merged LoRA, "buffer": the hard buffer};
                                  for the replay baselines their replay buffers too
  host     (orbax JsonSave)      `Progress`: the stream cursor, samples seen, the next anytime
                                  evaluation point, seen classes, the evaluation log (accuracy
                                  columns, anytime accuracies, plateau steps), the method's host
                                  record (Online-LoRA: the loss window, `PlateauState`), the
                                  length of metrics.jsonl, elapsed time; plus the config and the
                                  stream's content hash
  checksums (orbax JsonSave)     a digest of every array (dtype, shape, bits; `array_checksums`)
                                  and the SHA-256 of the host record, taken before the save

The arrays are saved as they are, global `jax.Array`s: each process writes the shards its
devices hold, and a restore reads each array straight onto the sharding of the same leaf of the
template (the run's initial state, already placed on the run's mesh), each process reading only
its shards; the mesh and process count may differ from those of the save. Nothing is gathered
whole into a process. The digests are computed where the arrays live, by one compiled reduction
over the whole tree whose result does not depend on the sharding, so a digest taken on eight
devices equals the one taken on one; only the digests come to the host. A small state on one
device is digested in NumPy on the host instead, to the same bits (compiling the reduction costs
more than that takes). They detect damage, not forgery. orbax is imported on first use (a
background import starts with the run).

Leaves the run has not changed since its initial state (the frozen backbone until a merge
changes it, every frozen weight of a LoRA, head-only or prompt method) are not stored again: the
checkpoint records their digests under `checksums["from_initial"]`, and a restore takes them from
the run's freshly built initial state (the pretrained file and the seed), checking them against
those digests. A ViT-B/16 checkpoint therefore holds the LoRA, head, optimizer state and buffers,
plus after a merge the merged q/v weights, instead of the whole backbone every time; a pretrained
file changed since the checkpoint was written is refused (`InitialStateChanged`, exit code 2)
instead of resumed.

Orbax does not notice flipped bytes (a damaged array can restore as NaN without an error), so
`Checkpointer.restore_latest` recomputes the digests after every restore, and falls back to the
newest checkpoint that restores and verifies, moving damaged ones to `corrupt_checkpoints/` with a
warning (process 0 moves them while the others wait). The checkpoint's step number is the stream
cursor: the number of stream steps done.

The checksums record names its kind (`"digest": "device-v1"`). Checkpoints written before device
digests have no such key: their arrays were stored whole from host copies with their SHA-256,
and they still restore, read whole into every process, verified by SHA-256 and then placed on
the template's shardings. A kind this code does not know is refused (`WorkdirError`), not taken
for damage.

In a multi-process run (olora_jax/distributed.py) every process takes part in each save and
restore, on the shared workdir. Typed PRNG keys are stored as their raw key data and re-wrapped
on restore with the template's implementation. Saves are synchronous: the next train step
donates the state's buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from olora_jax import background, errors, sharding, validation
from olora_jax.protocol import EvaluationLog

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
ORBAX = "orbax.checkpoint"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's folder of a save in progress (`<step>` + this)
# Keys that change how a run is checkpointed or drawn, not what it computes: they may differ on
# resume. So do the placement keys: the device mesh and the processes may change between the
# processes of one run (results agree within float tolerance across meshes), where images are
# preprocessed (both places give the same batches bit for bit), and how many test images the
# evaluator passes through the model at once.
# So do the keys that change how a run goes on, not what it computed so far: the non-finite
# policy (a run stopped with exit 3 resumes with learner.skip_nonfinite=True) and the logging
# cadence. A resume with any of them changed records it (results.json `config_changes`).
OPERATIONAL_KEYS = ("checkpoint_every", "max_to_keep", "eval.write_plots", "data.preprocess",
                    "eval.predict_chunk", "eval.batch_size", "sharding.fsdp",
                    "distributed.initialize", "distributed.coordinator_address",
                    "distributed.num_processes", "distributed.process_id",
                    "distributed.initialization_timeout", "distributed.heartbeat_timeout",
                    "learner.skip_nonfinite", "learner.max_skipped_fraction", "log_every",
                    "loggers", "logger_project", "logger_group", "logger_dir")
# Of those, the ones a resume records when they changed (results.json `config_changes`): how the
# run goes on. The placement keys (mesh, processes, where images are preprocessed) are not: they
# may differ between the processes of one run and change nothing in its records.
RECORDED_CHANGES = ("learner.skip_nonfinite", "learner.max_skipped_fraction", "log_every",
                    "checkpoint_every", "max_to_keep", "eval.write_plots")


def _orbax():
  """orbax.checkpoint, imported on first use: with TensorStore it takes about 0.4 s, which a run
  spends in a background thread while it builds its state (`import_in_background`) rather than
  before its first step; a run that finds no checkpoint needs it only for its first save."""
  return importlib.import_module(ORBAX)


def import_in_background() -> None:
  """Starts importing orbax in a daemon thread (`background.import_modules`)."""
  background.import_modules(ORBAX)


class WorkdirError(errors.BadInput):
  """A workdir that cannot be resumed with this config (exit code 2)."""


class InitialStateChanged(WorkdirError):
  """A checkpoint's left-out leaves no longer match the run's initial state (exit code 2)."""


NonFiniteLossError = errors.NonFiniteLoss
Preempted = errors.Preempted


# The checkpointed host record's keys, in the order every version has written them.
PROGRESS_JSON_KEYS = (
    "cursor", "samples_seen", "next_eval", "seen_classes", "acc_columns", "anytime",
    "anytime_samples", "plateau_steps", "plateau_samples", "task_end_samples", "end_correct",
    "end_total", "end_seen", "nonfinite_steps", "method_host", "metrics_bytes", "metrics_sha256",
    "wall_seconds", "compute")
# Written after them where a run counts Task-IL (absent from earlier versions' records).
TASK_IL_JSON_KEYS = ("acc_columns_task_il", "anytime_task_il")


@dataclasses.dataclass
class Progress:
  """The host side of the run: where the stream stands, the evaluation protocol's records
  (`protocol.EvaluationLog`), the method's events and host record. Checkpointed as one flat JSON
  record (`to_json`; the layout of every earlier version)."""

  cursor: int  # next stream step to train on (= stream steps done)
  samples_seen: int
  evaluation: EvaluationLog  # next anytime point, seen classes, accuracy columns, counts
  plateau_steps: list[int]
  plateau_samples: list[int]  # samples seen at each plateau
  nonfinite_steps: list[int]  # steps skipped for a non-finite loss (learner.skip_nonfinite)
  method_host: dict  # the method's host-side record (Online-LoRA: its loss window)
  metrics_bytes: int = 0  # length of metrics.jsonl when this record was checkpointed
  metrics_sha256: str = ""  # SHA-256 of those bytes ("" in checkpoints older than the field)
  wall_seconds: float = 0.0  # compute time before the current process (not part of the result)
  # The compute ledger's totals so far (olora_jax/compute.py; not part of the result).
  compute: dict = dataclasses.field(default_factory=dict)
  # The boundary switch's record (olora_jax/boundaries.py; {} and not written with rule 'none').
  boundary: dict = dataclasses.field(default_factory=dict)
  # Operational keys changed at a resume, `key: before -> after (at step N)` (not written if none).
  config_changes: list = dataclasses.field(default_factory=list)

  @classmethod
  def initial(cls, eval_every: int, method_host: dict | None = None,
              boundary: dict | None = None) -> Progress:
    return cls(cursor=0, samples_seen=0, evaluation=EvaluationLog.initial(eval_every),
               plateau_steps=[], plateau_samples=[], nonfinite_steps=[],
               method_host=dict(method_host or {}), boundary=dict(boundary or {}))

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(d.pop("evaluation"))
    d["acc_columns"] = [[float(a) for a in col] for col in self.evaluation.acc_columns]
    optional = ("boundary", "config_changes", *TASK_IL_JSON_KEYS)
    keys = PROGRESS_JSON_KEYS + tuple(k for k in optional if d[k])
    return {k: d[k] for k in keys}

  @classmethod
  def from_json(cls, d: dict) -> Progress:
    d = dict(d)
    names = [f.name for f in dataclasses.fields(EvaluationLog)]
    evaluation = EvaluationLog(**{k: d.pop(k) for k in names if k in d})
    return cls(evaluation=evaluation, **d)


def config_to_dict(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json_best_effort(sort_keys=True))


def config_differences(saved: dict, current: dict, recorded: bool = False,
                       ignore=frozenset()) -> list[str]:
  """`key: saved -> current` for every non-operational key whose value differs (`recorded`: for
  every key of `RECORDED_CHANGES` instead), but those of `ignore`."""
  a, b = validation.flatten(saved), validation.flatten(current)
  keys = set(a) | set(b)
  keys = sorted(keys & set(RECORDED_CHANGES) if recorded else keys - set(OPERATIONAL_KEYS))
  return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
          for k in keys if k not in ignore and a.get(k, "<absent>") != b.get(k, "<absent>")]


def check_same_config(saved: dict, config: ml_collections.ConfigDict, workdir: str,
                      finished: bool = False) -> None:
  """Refuses a workdir whose run was made with another config, naming the differences.

  Keys that one side lacks came or went with a version (of olora-jax, or of the file of a method
  of the user's own): those of other methods' blocks, which the run never reads, are no
  difference (`methods.unread_overrides`), nor, for a `finished` run (nothing runs: its results
  are reprinted), any other. A key the saved config lacks in the run's own blocks refuses a
  resume: no config given to this version leaves it out, so the line says where it was added
  (olora-jax, or the user's method file) and that the way to resume is the version (or the file)
  that made the run."""
  from olora_jax import methods  # the method registry imports the methods (and this module)

  current = config_to_dict(config)
  flat_saved, flat_current = validation.flatten(saved), validation.flatten(current)
  one_sided = sorted((set(flat_saved) ^ set(flat_current)) - set(OPERATIONAL_KEYS))
  ignore = set(methods.unread_overrides(config.method, one_sided))
  if finished:
    ignore = set(one_sided)
  diffs = config_differences(saved, current, ignore=ignore)
  if not diffs:
    return
  shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
  added = [k for k in one_sided if k in flat_current and k not in ignore]
  own = _own_block_keys(config.method, added)
  ours = [k for k in added if k not in own]
  advice = []
  if ours:
    advice.append(f"{', '.join(ours)} {'is' if len(ours) == 1 else 'are'} newer than the run"
                  " (added to olora-jax since it was made): pass a new --workdir to run it with"
                  " this version, or resume it with the version of olora-jax that made it")
  if own:
    where = config.method.rpartition(":")[0]
    advice.append(f"{', '.join(own)} {'is' if len(own) == 1 else 'are'} newer than the run"
                  f" (added to the config block of your method in {where} since the run was"
                  " made): pass a new --workdir to run it with the file as it is now, or resume"
                  f" it with {where} as it was when the run was made")
  if not advice:
    advice = ["pass a new --workdir, or the run's original config to resume it"]
  elif len(added) < len(diffs):
    advice[-1] += " and the run's original config"
  raise WorkdirError(f"workdir {workdir!r} holds a run made with a different config ({shown});"
                     f" {'; '.join(advice)}")


def _own_block_keys(method: str, keys: list[str]) -> list[str]:
  """The keys of `keys` in the config block of `method` when it is a method outside the package
  (the user's file or module), whose keys come from that file, not from olora-jax."""
  from olora_jax import methods

  if not methods.is_outside(method):
    return []
  block = methods.resolve(method).name
  return [k for k in keys if k.split(".")[0] == block]


# --------------------------------------------------------------------------------------------
# Arrays: typed PRNG keys as raw key data, and the arrays' digests.


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _raw(tree: Any) -> Any:
  """`tree` with typed PRNG keys replaced by their raw key data, where they are (no copy)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def to_numpy(tree: Any) -> Any:
  """A host copy of `tree` with typed PRNG keys replaced by their raw key data (whole arrays,
  also those other processes hold parts of). Checkpoints no longer need it: it reads those
  written before device digests, and lets tests compare trees."""
  return sharding.to_host(_raw(tree))


def _drop_empty(tree: Any, also: frozenset = frozenset()) -> Any:
  """Zero-size leaves (e.g. the buffer with learner.buffer_size=0) hold no data and orbax
  refuses to save them: they become None, and are rebuilt from the template on restore. So do
  the leaves whose tree path is in `also` (those unchanged since the initial state)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: None if math.prod(np.shape(x)) == 0 or jax.tree_util.keystr(path) in also
      else x, tree)


DIGEST_KIND = "device-v1"  # checksums["digest"]; absent: SHA-256 of host copies (LEGACY_DIGEST)
LEGACY_DIGEST = "sha256"
# One 32-bit lane per seed, each an independent sum: a 128-bit digest.
_SEEDS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finalizer: a bijection of uint32 in which every input bit moves about half
  of the output bits."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """`x`'s bits as uint32 words: one per element (bool, 8- and 16-bit types widened), two per
  element of a 64-bit type (a trailing axis), real and imaginary parts of complex numbers."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
  if unsigned is None:
    raise TypeError(f"cannot checksum arrays of dtype {x.dtype}; store the leaf as a dtype of"
                    " 8, 16, 32 or 64 bits")
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_digests(x: jax.Array) -> jax.Array:
  """uint32[len(x), lanes]: the digest of each `x[i]`, the leaves of one shape and dtype stacked.
  Per lane, the sum mod 2^32 over a leaf's elements of fmix32(bits ^ key), the key fmix32 of the
  element's flat index in the leaf xor the lane's seed. For a given index the term is a bijection
  of the bits, so changing one element changes every lane; integer sums are exact and
  order-free, so the digest does not depend on how the array is split or summed. The lanes are a
  trailing axis: one fused reduction per stack."""
  w = _words(x)
  shape = w.shape[1:]  # one leaf's words
  index = jnp.zeros(shape, jnp.uint32)  # row-major flat index in the leaf (mod 2^32)
  for axis, n in enumerate(shape):
    index = index * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
  keys = _fmix32(index[..., None] ^ jnp.asarray(_SEEDS, jnp.uint32))
  return jnp.sum(_fmix32(w[..., None] ^ keys), axis=tuple(range(1, w.ndim)), dtype=jnp.uint32)


def _groups(leaves: list) -> dict:
  """{(shape, dtype): [leaf indices]}: leaves of one shape and dtype are reduced together."""
  groups: dict = {}
  for i, x in enumerate(leaves):
    groups.setdefault((x.shape, x.dtype), []).append(i)
  return groups


def _finite_flags(stack: jax.Array) -> jax.Array:
  """bool[len(stack)]: whether each stacked leaf is free of NaN/Inf (a leaf that is not
  floating point is finite)."""
  if not jnp.issubdtype(stack.dtype, jnp.inexact):
    return jnp.ones(len(stack), bool)
  return jnp.all(jnp.isfinite(stack), axis=tuple(range(1, stack.ndim)))


def _in_leaf_order(groups: dict, values: list) -> jax.Array:
  order = np.argsort(np.concatenate([np.asarray(m) for m in groups.values()]))
  return jnp.concatenate(values)[order]


@jax.jit
def _tree_checks(leaves: list) -> tuple[jax.Array, jax.Array]:
  """(uint32[len(leaves), lanes] digests, bool[len(leaves)] finite flags): both checks of a
  checkpoint in one program, so a run compiles one for its state. Leaves of one shape and dtype
  (the like-shaped layers of a ViT, their optimizer moments) are digested together, one
  reduction over their stack per group: the demo's 84 leaves in 17 groups trace in 0.16 s on 2
  CPU cores (0.29 s with the reduction vmapped over the stack, 0.39 s with one reduction per
  leaf). The finite flags are reduced over the same stacks, one reduction per group rather than
  per leaf."""
  groups = _groups(leaves)
  sums, finite = [], []
  for members in groups.values():
    stack = jnp.stack([leaves[i] for i in members])
    sums.append(_leaf_digests(stack))
    finite.append(_finite_flags(stack))
  return _in_leaf_order(groups, sums), _in_leaf_order(groups, finite)


@jax.jit
def _tree_finite(leaves: list) -> jax.Array:
  """The finite flags of `_tree_checks` alone (no digests): the check of an evaluated model."""
  groups = _groups(leaves)
  return _in_leaf_order(groups, [_finite_flags(jnp.stack([leaves[i] for i in members]))
                                 for members in groups.values()])


# A tree of at most this many elements, each array on one device, is checked on the host in
# NumPy (`_host_tree_checks`) instead of by the compiled `_tree_checks`: on a 2-core CPU NumPy
# digests about 10M elements a second, while compiling `_tree_checks` for a small model's state
# takes about as long as compiling its train step (a second or more, and a backend compile with
# autotuning on a GPU). A large state (a ViT-B/16's) keeps the program, which runs in a fraction
# of NumPy's time; the digests are the same bits either way. 4M (was 2M): the reduced ResNet-18's
# Adam state on the parity streams (3.6M elements, 232 leaves) compiled the program in 3.3-4.4
# CPU-s at XLA level 1 on a loaded 2-core AMD EPYC, where NumPy checks it in 0.33-0.35 CPU-s (a
# run checks its state twice: the initial digests and the final save).
HOST_CHECK_ELEMENTS = 1 << 22

_NP_SEEDS = np.asarray(_SEEDS, np.uint32)


def _np_fmix32(h: np.ndarray) -> np.ndarray:
  """`_fmix32` in NumPy (uint32 arithmetic wraps as XLA's does), in place on `h`."""
  h ^= h >> np.uint32(16)
  h *= np.uint32(0x85EBCA6B)
  h ^= h >> np.uint32(13)
  h *= np.uint32(0xC2B2AE35)
  h ^= h >> np.uint32(16)
  return h


def _np_words(x: np.ndarray) -> np.ndarray:
  """`_words` of a host array, its dtype already as jit sees it (`_host_tree_checks`)."""
  if x.dtype == np.bool_:  # its byte as stored, as XLA converts it (a damaged 0x81 is not 1)
    return x.view(np.uint8).astype(np.uint32)
  if np.issubdtype(x.dtype, np.complexfloating):
    x = np.stack([x.real, x.imag], axis=-1)
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}.get(x.dtype.itemsize)
  if unsigned is None:
    raise TypeError(f"cannot checksum arrays of dtype {x.dtype}; store the leaf as a dtype of"
                    " 8, 16, 32 or 64 bits")
  words = np.ascontiguousarray(x).view(unsigned)
  if x.dtype.itemsize == 8:  # two words per element, low word first, as a trailing axis
    words = words.reshape(*x.shape, 2)
  return words.astype(np.uint32)


def _np_leaf_digest(x: np.ndarray) -> np.ndarray:
  """uint32[lanes]: `_leaf_digests` of one leaf, on the host."""
  w = _np_words(x).reshape(-1)
  index = np.arange(w.size, dtype=np.uint64).astype(np.uint32)  # the flat index mod 2^32
  keys = _np_fmix32(index[:, None] ^ _NP_SEEDS)
  return _np_fmix32(w[:, None] ^ keys).sum(axis=0, dtype=np.uint32)


def _host_tree_checks(leaves: list) -> tuple[np.ndarray, np.ndarray]:
  """`_tree_checks(leaves)` computed in NumPy on host copies of the leaves, each leaf's dtype
  canonicalised as jit canonicalises an argument's (a NumPy float64 as float32 without x64)."""
  host = jax.device_get([jax.random.key_data(x) if _is_key(x) else x for x in leaves])
  sums = np.zeros((len(leaves), len(_SEEDS)), np.uint32)
  finite = np.ones(len(leaves), bool)
  for i, x in enumerate(host):
    x = np.asarray(x, jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
    sums[i] = _np_leaf_digest(x)
    finite[i] = not jnp.issubdtype(x.dtype, jnp.inexact) or bool(np.isfinite(x).all())
  return sums, finite


def _checked_on_host(leaves: list) -> bool:
  """Whether `tree_checks` digests `leaves` in NumPy: a small tree each of whose arrays lives
  on one device (or the host). Arrays on several devices (sharded or replicated) keep the
  program, so that nothing is gathered whole to a host."""
  return (sum(math.prod(np.shape(x)) for x in leaves) <= HOST_CHECK_ELEMENTS
          and all(not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1
                  for x in leaves))


def _stored_shape(x: Any) -> jax.ShapeDtypeStruct:
  """Shape and dtype of a leaf as stored (typed PRNG keys as their raw key data)."""
  if _is_key(x):
    x = jax.eval_shape(jax.random.key_data, x)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def tree_checks(tree: Any) -> tuple[dict[str, str], list[str]]:
  """(`array_checksums(tree)`, `nonfinite_leaves(tree)`) from one compiled program over the
  whole tree, run where the arrays live; only the digests and flags come to the host. A small
  tree whose arrays each live on one device is checked on the host in NumPy instead, to the same
  bits (`HOST_CHECK_ELEMENTS`): a program of its own costs more to compile than that takes."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves:
    return {}, []
  arrays = [x for _, x in leaves]
  if _checked_on_host(arrays):
    sums, finite = _host_tree_checks(arrays)
  else:
    sums, finite = sharding.to_host(_tree_checks(arrays))
  digests, bad = {}, []
  for (path, x), row, ok in zip(leaves, np.asarray(sums), np.asarray(finite), strict=True):
    s = _stored_shape(x)
    name = jax.tree_util.keystr(path)
    digests[name] = (f"{np.dtype(s.dtype).name}[{','.join(map(str, s.shape))}]:"
                     + "".join(f"{int(v):08x}" for v in row))
    if not ok:
      bad.append(name)
  return digests, bad


def array_checksums(tree: Any) -> dict[str, str]:
  """A digest of every leaf of `tree` (jax or numpy arrays; typed PRNG keys by their key data),
  keyed by its tree path: `"<dtype>[<shape>]:<32 hex digits>"`.

  The digest is computed where the arrays live, by one compiled reduction over the whole tree
  (`_leaf_digests`, in `_tree_checks`); only the digests come to the host. It is the same for
  any sharding, mesh and process count. It is a check against damage (flipped bits, truncated or
  mixed-up files), not a cryptographic hash: it does not resist deliberate forgery."""
  return tree_checks(tree)[0]


def finite_flags(tree: Any) -> jax.Array:
  """bool[leaves of `tree`]: whether each leaf is free of NaN/Inf, in the order of
  `tree_flatten_with_path` (`_tree_finite`; traced into the caller's program when called inside
  a jitted function, so a check folded into it compiles nothing of its own)."""
  leaves = jax.tree.leaves(_raw(tree))
  return _tree_finite(leaves) if leaves else jnp.ones((0,), bool)


def nonfinite_paths(tree: Any, flags: Any) -> list[str]:
  """The tree paths of `tree`'s leaves whose `finite_flags` are False (the flags come to the
  host; the arrays stay where they live)."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(_raw(tree))[0]]
  finite = np.asarray(sharding.to_host(flags))
  return [jax.tree_util.keystr(path) for path, ok in zip(paths, finite, strict=True) if not ok]


def nonfinite_leaves(tree: Any) -> list[str]:
  """The tree paths of the floating-point leaves that hold a NaN or an Inf (`_tree_finite`'s
  one program, where the arrays live; only the flags come to the host)."""
  return nonfinite_paths(tree, finite_flags(tree))


def _sha256(x: np.ndarray) -> str:
  x = np.ascontiguousarray(x)
  h = hashlib.sha256(f"{x.dtype.str}{x.shape}|".encode())
  h.update(x.tobytes())
  return h.hexdigest()


def sha256_checksums(tree: Any) -> dict[str, str]:
  """SHA-256 of every leaf of a numpy pytree, keyed by its tree path: the checksums of
  checkpoints written before device digests (their record has no `digest` key)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): _sha256(leaf) for path, leaf in leaves}


def _json_digest(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# The checkpointer.


class Checkpointer:
  """Saves and restores the whole run under `workdir/checkpoints` with orbax."""

  def __init__(self, workdir: str, max_to_keep: int, initial: Any = None):
    """`initial`: the run's initial state (what `restore_latest` gets as its template); its
    unchanged leaves are not stored again (module docstring). None stores every leaf."""
    self.workdir = workdir
    self._initial = {} if initial is None else array_checksums(_raw(initial))
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    self._max_to_keep = max_to_keep
    self._orbax_manager = None

  @property
  def _manager(self):
    """orbax's CheckpointManager of `self.directory`, made on first use (a fresh run's first
    save): making it imports orbax, creates the directory and drops the half-written saves of
    a killed process."""
    if self._orbax_manager is None:
      ocp = _orbax()
      options = ocp.CheckpointManagerOptions(
          max_to_keep=self._max_to_keep, create=True, enable_async_checkpointing=False,
          cleanup_tmp_directories=True)
      self._orbax_manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_names=("arrays", "host", "checksums"))
    return self._orbax_manager

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, arrays: Any, progress: Progress, meta: dict) -> None:
    """Writes checkpoint `progress.cursor` (arrays on device, host record, checksums). Each
    process writes the shards its devices hold (one copy of each); nothing is gathered."""
    step = progress.cursor
    if step in self._manager.all_steps():
      return  # this exact state is already saved (e.g. a periodic save at the last step)
    arrays = _raw(arrays)
    digests = self._finite_digests(step, arrays)
    arrays, host, checksums = self._record(arrays, digests, progress, meta)
    self._write(step, arrays, host, checksums)

  def _finite_digests(self, step: int, arrays: Any) -> dict[str, str]:
    """The digest of every array of the state to save at `step` (`tree_checks`, with their finite
    flags); `errors.NonFiniteLoss` when one holds NaN/Inf: such a state is never saved."""
    digests, bad = tree_checks(arrays)  # digests and finite flags together
    if bad:
      raise errors.NonFiniteLoss(
          f"the state to checkpoint at step {step} holds NaN/Inf ({len(bad)} array(s), e.g."
          f" {bad[0]}) though every loss was finite; it was not saved, the newest checkpoint"
          f" in {self.directory} is the last good state; lower the learning rate or check the"
          " data")
    return digests

  def _record(self, arrays: Any, digests: dict[str, str], progress: Progress,
              meta: dict) -> tuple[Any, dict, dict]:
    """What a checkpoint stores: (the arrays less those unchanged since the initial state and
    the zero-size ones, the host record, the checksums of both)."""
    from_initial = {k: v for k, v in digests.items() if self._initial.get(k) == v}
    arrays = _drop_empty(arrays, frozenset(from_initial))
    stored = [jax.tree_util.keystr(path) for path, _ in  # tree order; None leaves left out
              jax.tree_util.tree_flatten_with_path(arrays)[0]]
    host = {"progress": progress.to_json(), **meta}
    checksums = {"digest": DIGEST_KIND, "arrays": {k: digests[k] for k in stored},
                 "from_initial": from_initial, "host": _json_digest(host)}
    return arrays, host, checksums

  def _write(self, step: int, arrays: Any, host: dict, checksums: dict) -> None:
    """Writes checkpoint `step` and waits for it; a failed write leaves nothing behind."""
    try:
      ocp = _orbax()
      self._manager.save(step, force=True, args=ocp.args.Composite(
          arrays=ocp.args.StandardSave(arrays), host=ocp.args.JsonSave(host),
          checksums=ocp.args.JsonSave(checksums)))
      self._manager.wait_until_finished()
    except BaseException:
      self._remove_partial(step)  # a full disk keeps none of it: the space is the rerun's
      raise

  def _remove_partial(self, step: int) -> None:
    """Removes what a failed save of checkpoint `step` left (orbax's temporary folder; the next
    Checkpointer would drop it too, but a full disk needs the space now). Process 0 only."""
    if not sharding.is_primary():
      return
    with contextlib.suppress(OSError):
      for name in os.listdir(self.directory):
        if name.startswith(f"{step}.") and TMP_SUFFIX in name:
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def _restore_verified(self, step: int, template: Any, initial: dict) -> tuple[Any, dict]:
    """(arrays like `template` and on its shardings, host) of checkpoint `step`, every array
    verified: the stored ones against their digests, those left out as unchanged taken from
    `template` (the run's initial state) once its digests match. Each process reads only the
    shards its devices hold. `initial` caches what the SHA-256 format needs between calls."""
    ocp = _orbax()
    checksums = self._manager.restore(step, args=ocp.args.Composite(
        checksums=ocp.args.JsonRestore()))["checksums"]
    kind = checksums.get("digest", LEGACY_DIGEST)
    if kind == LEGACY_DIGEST:
      return self._restore_legacy(step, template, checksums, initial)
    if kind != DIGEST_KIND:
      raise WorkdirError(
          f"checkpoint {step} in {self.directory} has checksums of kind {kind!r}, which this"
          " version of olora_jax does not know; resume it with the version that wrote it, or"
          " pass a new --workdir")
    arrays, host = self._read_stored(step, _raw(template), checksums)
    found, bad = tree_checks(arrays)
    self._verify(step, host, checksums, found, lambda: found)
    if bad:  # saved before saves were checked: treated as damage, like a bad checksum
      raise ValueError(f"{len(bad)} array(s) hold NaN/Inf, e.g. {bad[0]}")
    arrays = jax.tree.map(
        lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t)
        else r, arrays, template)
    return arrays, host

  def _read_stored(self, step: int, raw: Any, checksums: dict) -> tuple[Any, dict]:
    """(arrays, host) of checkpoint `step`, unverified: the stored arrays read on the shardings of
    `raw` (the template, keys as raw data), the leaves left out taken from `raw`."""
    target = _drop_empty(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), raw),
        frozenset(checksums["from_initial"]))
    ocp = _orbax()
    out = self._manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(target), host=ocp.args.JsonRestore()))
    # Left-out leaves from the template: the zero-size ones and those unchanged since it. The
    # whole tree is digested at once, like at a save (the same compiled program).
    arrays = jax.tree.map(lambda r, t: t if r is None else r, out["arrays"], raw,
                          is_leaf=lambda x: x is None)
    return arrays, out["host"]

  def _restore_legacy(self, step: int, template: Any, checksums: dict,
                      initial: dict) -> tuple[Any, dict]:
    """`_restore_verified` for a checkpoint written before device digests: its arrays are read
    whole into every process and checked against their SHA-256, then placed on the template's
    shardings."""
    if "host_copy" not in initial:
      initial["host_copy"] = to_numpy(template)
    host_copy = initial["host_copy"]
    from_initial = checksums.get("from_initial", {})  # absent in older checkpoints
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), host_copy)
    ocp = _orbax()
    out = self._manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(_drop_empty(target, frozenset(from_initial))),
        host=ocp.args.JsonRestore()))

    def initial_digests() -> dict[str, str]:
      if "sha256" not in initial:
        initial["sha256"] = sha256_checksums(host_copy)
      return initial["sha256"]

    self._verify(step, out["host"], checksums, sha256_checksums(out["arrays"]), initial_digests)

    def leaf(r, i, t):  # left-out leaves: zero-size or unchanged since the initial state
      r = i if r is None else r
      if _is_key(t):
        return jax.random.wrap_key_data(jnp.asarray(r), impl=jax.random.key_impl(t))
      return r

    arrays = jax.tree.map(leaf, out["arrays"], host_copy, template, is_leaf=lambda x: x is None)
    return sharding.place_state(arrays, jax.tree.map(lambda t: t.sharding, template)), out["host"]

  def _verify(self, step: int, host: dict, checksums: dict, found: dict[str, str],
              initial_digests: Callable[[], dict[str, str]]) -> None:
    """Raises ValueError when the host record or a stored array (`found`: their digests) does
    not match its checksum, `InitialStateChanged` when a leaf left out as unchanged no longer
    matches the initial state (`initial_digests()`)."""
    if _json_digest(host) != checksums["host"]:
      raise ValueError("the host record does not match its checksum")
    bad = [k for k, v in checksums["arrays"].items() if found.get(k) != v]
    if bad:
      raise ValueError(f"{len(bad)} array(s) do not match their checksums, e.g. {bad[:2]}")
    from_initial = checksums.get("from_initial", {})
    digests = initial_digests() if from_initial else {}
    changed = [k for k, v in from_initial.items() if digests.get(k) != v]
    if changed:
      raise InitialStateChanged(
          f"checkpoint {step} in {self.directory} relies on this run's initial weights, but"
          f" {len(changed)} of them differ from when it was written (e.g. {changed[0]}): the"
          " pretrained file (or the code that builds the initial state) changed; restore the"
          " original file, or pass a new --workdir to start over")

  def restore_latest(self, template: Any) -> tuple[Any, dict] | None:
    """The newest checkpoint that restores and verifies, as (arrays like `template`, host).

    `template` is the run's initial state, on the shardings the run uses: each process reads
    only the shards it holds, and the arrays come back on those shardings. Damaged checkpoints
    (unreadable, or any checksum mismatch) are moved to `workdir/corrupt_checkpoints/` with a
    warning, so the run falls back to an older one and can later save over their step numbers.
    Returns None when no checkpoint is usable.
    """
    template = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x),
                            template)
    if not checkpoint_steps(self.workdir):  # a fresh run: nothing to read, no orbax needed
      return None
    initial: dict = {}  # the template's host copy and SHA-256, if an old checkpoint needs them
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        return self._restore_verified(step, template, initial)
      except WorkdirError:
        raise  # not damage: every checkpoint of the run would say the same
      except Exception as e:  # any failure to restore means: do not use it
        self._set_aside(step, e)
    return None

  def _set_aside(self, step: int, e: Exception) -> None:
    """Moves damaged checkpoint `step` to `workdir/corrupt_checkpoints/` (process 0; every
    process waits for it) and warns why (`e`, the failure to restore it)."""
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    moved = self._quarantine(step) if sharding.is_primary() else "corrupt_checkpoints/"
    sharding.barrier(f"quarantined checkpoint {step}")
    self._manager.reload()
    logging.warning("checkpoint %d in %s is damaged (%s: %s); moved it to %s and falling"
                    " back to an older one", step, self.directory, type(e).__name__,
                    reason[:200], moved)

  def _quarantine(self, step: int) -> str:
    dest_root = os.path.join(self.workdir, CORRUPT_DIR)
    os.makedirs(dest_root, exist_ok=True)
    dest, n = os.path.join(dest_root, str(step)), 1
    while os.path.exists(dest):
      dest, n = os.path.join(dest_root, f"{step}.{n}"), n + 1
    shutil.move(os.path.join(self.directory, str(step)), dest)
    return dest

  def close(self) -> None:
    if self._orbax_manager is not None:
      self._orbax_manager.close()


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the finished checkpoints in `workdir` (not verified; orbax's temporary
  directories of interrupted saves are not counted)."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def has_checkpoint(workdir: str) -> bool:
  return bool(checkpoint_steps(workdir))


def latest_step(workdir: str) -> int | None:
  steps = checkpoint_steps(workdir)
  return steps[-1] if steps else None


def restore_run(checkpointer: Checkpointer, template: Any, config: ml_collections.ConfigDict,
                stream_sha256: str, with_host: bool = False):
  """Restores the newest good checkpoint and checks it belongs to this config and stream:
  (arrays, progress), and the whole host record (with the run log's copy) when `with_host`;
  None when there is no usable checkpoint."""
  restored = checkpointer.restore_latest(template)
  if restored is None:
    return None
  arrays, host = restored
  check_same_config(host["config"], config, checkpointer.workdir)
  if host["stream_sha256"] != stream_sha256:
    raise WorkdirError(
        f"workdir {checkpointer.workdir!r} was made on a different stream (hash"
        f" {host['stream_sha256'][:12]} != {stream_sha256[:12]}): the data or the stream code"
        " changed; pass a new --workdir")
  progress = Progress.from_json(host["progress"])
  changed = config_differences(host["config"], config_to_dict(config), recorded=True)
  progress.config_changes += [f"{c} (at step {progress.cursor})" for c in changed]
  return (arrays, progress, host) if with_host else (arrays, progress)


def read_host(workdir: str, step: int) -> dict | None:
  """The host record of checkpoint `step` as stored (unverified; None when unreadable)."""
  path = os.path.join(workdir, CHECKPOINT_DIR, str(step), "host", "metadata")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None
