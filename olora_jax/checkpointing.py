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
  checksums (orbax JsonSave)     SHA-256 of every array (dtype, shape, bytes) and of the host
                                  record, taken before the save

Leaves the run has not changed since its initial state (the frozen backbone until a merge
changes it, every frozen weight of a LoRA, head-only or prompt method) are not stored again: the
checkpoint records their SHA-256 under `checksums["from_initial"]`, and a restore takes them from
the run's freshly built initial state (the pretrained file and the seed), checking them against
those digests. A ViT-B/16 checkpoint therefore holds the LoRA, head, optimizer state and buffers,
plus after a merge the merged q/v weights, instead of the whole backbone every time; a pretrained
file changed since the checkpoint was written is refused (`WorkdirError`) instead of resumed.

Orbax does not notice flipped bytes (a damaged array can restore as NaN without an error), so
`Checkpointer.restore_latest` recomputes the checksums after every restore, and falls back to the
newest checkpoint that restores and verifies, moving damaged ones to `corrupt_checkpoints/` with a
warning. The checkpoint's step number is the stream cursor: the number of stream steps done.

Typed PRNG keys are stored as their raw key data and re-wrapped on restore with the template's
implementation. Saves are synchronous: the next train step donates the state's buffers.

In a multi-process run (olora_jax/distributed.py) every process takes part in each save and
restore: the arrays are gathered whole into every process (their checksums are the same
everywhere), orbax's primary process writes them, and every process restores them from the
shared workdir. A damaged checkpoint is moved aside by process 0 while the others wait.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from olora_jax import errors, sharding, validation

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
# Keys that change how a run is checkpointed or drawn, not what it computes: they may differ on
# resume. So do the placement keys: the device mesh and the processes may change between the
# processes of one run (results agree within float tolerance across meshes), and where images are
# preprocessed (both places give the same batches bit for bit).
OPERATIONAL_KEYS = ("checkpoint_every", "max_to_keep", "eval.write_plots", "data.preprocess",
                    "sharding.fsdp",
                    "distributed.initialize", "distributed.coordinator_address",
                    "distributed.num_processes", "distributed.process_id")


class WorkdirError(errors.BadInput):
  """A workdir that cannot be resumed with this config (exit code 2)."""


class InitialStateChanged(WorkdirError):
  """A checkpoint's left-out leaves no longer match the run's initial state (exit code 2)."""


NonFiniteLossError = errors.NonFiniteLoss
Preempted = errors.Preempted


@dataclasses.dataclass
class Progress:
  """The host side of the run: where the stream stands and the evaluation log so far."""

  cursor: int  # next stream step to train on (= stream steps done)
  samples_seen: int
  next_eval: int  # samples_seen at which the next anytime evaluation is due
  seen_classes: list[int]
  acc_columns: list[list[float]]  # task-end evaluations, one column a_{:, j} each
  anytime: list[float]  # anytime accuracies on the classes seen so far
  anytime_samples: list[int]  # samples seen at each anytime evaluation
  plateau_steps: list[int]
  plateau_samples: list[int]  # samples seen at each plateau
  task_end_samples: list[int]  # samples seen at each true task end
  end_correct: list[list[int]]  # per-class correct counts at each task end (T, C)
  end_total: list[list[int]]  # per-class test counts at each task end (T, C)
  end_seen: list[list[bool]]  # classes seen by each task end (T, C)
  nonfinite_steps: list[int]  # steps skipped for a non-finite loss (learner.skip_nonfinite)
  method_host: dict  # the method's host-side record (Online-LoRA: its loss window)
  metrics_bytes: int = 0  # length of metrics.jsonl when this record was checkpointed
  metrics_sha256: str = ""  # SHA-256 of those bytes ("" in checkpoints older than the field)
  wall_seconds: float = 0.0  # compute time before the current process (not part of the result)
  # The compute ledger's totals so far (olora_jax/compute.py; not part of the result).
  compute: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def initial(cls, eval_every: int, method_host: dict | None = None) -> Progress:
    return cls(cursor=0, samples_seen=0, next_eval=eval_every, seen_classes=[], acc_columns=[],
               anytime=[], anytime_samples=[], plateau_steps=[], plateau_samples=[],
               task_end_samples=[], end_correct=[], end_total=[], end_seen=[],
               nonfinite_steps=[], method_host=dict(method_host or {}))

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["acc_columns"] = [[float(a) for a in col] for col in self.acc_columns]
    return d

  @classmethod
  def from_json(cls, d: dict) -> Progress:
    return cls(**d)


def config_to_dict(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json_best_effort(sort_keys=True))


def config_differences(saved: dict, current: dict) -> list[str]:
  """`key: saved -> current` for every non-operational key whose value differs."""
  a, b = validation.flatten(saved), validation.flatten(current)
  keys = sorted((set(a) | set(b)) - set(OPERATIONAL_KEYS))
  return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
          for k in keys if a.get(k, "<absent>") != b.get(k, "<absent>")]


def check_same_config(saved: dict, config: ml_collections.ConfigDict, workdir: str) -> None:
  diffs = config_differences(saved, config_to_dict(config))
  if diffs:
    shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    raise WorkdirError(
        f"workdir {workdir!r} holds a run made with a different config ({shown}); pass a new"
        " --workdir, or the run's original config to resume it")


# --------------------------------------------------------------------------------------------
# Arrays: device pytree <-> numpy pytree, and their checksums.


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_numpy(tree: Any) -> Any:
  """A host copy of `tree` with typed PRNG keys replaced by their raw key data (whole arrays,
  also those other processes hold parts of)."""
  tree = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)
  return sharding.to_host(tree)


def _like_template(restored: Any, template: Any) -> Any:
  def leaf(r, t):
    if _is_key(t):
      return jax.random.wrap_key_data(jnp.asarray(r), impl=jax.random.key_impl(t))
    return jnp.asarray(r)

  return jax.tree.map(leaf, restored, template)


def _drop_empty(tree: Any, also: frozenset = frozenset()) -> Any:
  """Zero-size leaves (e.g. the buffer with learner.buffer_size=0) hold no data and orbax
  refuses to save them: they become None, and are rebuilt from the template on restore. So do
  the leaves whose tree path is in `also` (those unchanged since the initial state)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: None if np.size(x) == 0 or jax.tree_util.keystr(path) in also else x,
      tree)


def _digest(x: np.ndarray) -> str:
  x = np.ascontiguousarray(x)
  h = hashlib.sha256(f"{x.dtype.str}{x.shape}|".encode())
  h.update(x.tobytes())
  return h.hexdigest()


def array_checksums(tree: Any) -> dict[str, str]:
  """SHA-256 of every leaf of a numpy pytree, keyed by its tree path."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): _digest(leaf) for path, leaf in leaves}


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
    self._initial = {} if initial is None else array_checksums(to_numpy(initial))
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False,
        cleanup_tmp_directories=True)  # half-written saves of a killed process are dropped
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("arrays", "host", "checksums"))

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, arrays: Any, progress: Progress, meta: dict) -> None:
    """Writes checkpoint `progress.cursor` (arrays on device, host record, checksums)."""
    step = progress.cursor
    if step in self._manager.all_steps():
      return  # this exact state is already saved (e.g. a periodic save at the last step)
    host_arrays = to_numpy(arrays)
    digests = array_checksums(host_arrays)
    from_initial = {k: v for k, v in digests.items() if self._initial.get(k) == v}
    host_arrays = _drop_empty(host_arrays, frozenset(from_initial))
    stored = [jax.tree_util.keystr(path) for path, _ in  # tree order; None leaves left out
              jax.tree_util.tree_flatten_with_path(host_arrays)[0]]
    host = {"progress": progress.to_json(), **meta}
    checksums = {"arrays": {k: digests[k] for k in stored}, "from_initial": from_initial,
                 "host": _json_digest(host)}
    self._manager.save(step, force=True, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(host_arrays), host=ocp.args.JsonSave(host),
        checksums=ocp.args.JsonSave(checksums)))
    self._manager.wait_until_finished()

  def _restore_verified(self, step: int, target: Any, initial: Any,
                        initial_digests: dict[str, str]) -> tuple[Any, dict]:
    """(arrays, host) of checkpoint `step`, every array verified: the stored ones against
    their checksums, those left out as unchanged taken from `initial` (numpy, like `target`;
    `initial_digests` its `array_checksums`)."""
    checksums = self._manager.restore(step, args=ocp.args.Composite(
        checksums=ocp.args.JsonRestore()))["checksums"]
    from_initial = checksums.get("from_initial", {})  # absent in older checkpoints
    out = self._manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(_drop_empty(target, frozenset(from_initial))),
        host=ocp.args.JsonRestore()))
    arrays, host = out["arrays"], out["host"]
    if _json_digest(host) != checksums["host"]:
      raise ValueError("the host record does not match its checksum")
    found = array_checksums(arrays)
    bad = [k for k, v in checksums["arrays"].items() if found.get(k) != v]
    if bad or set(found) != set(checksums["arrays"]):
      raise ValueError(f"{len(bad)} array(s) do not match their checksums, e.g. {bad[:2]}")
    changed = [k for k, v in from_initial.items() if initial_digests.get(k) != v]
    if changed:
      raise InitialStateChanged(
          f"checkpoint {step} in {self.directory} relies on this run's initial weights, but"
          f" {len(changed)} of them differ from when it was written (e.g. {changed[0]}): the"
          " pretrained file (or the code that builds the initial state) changed; restore the"
          " original file, or pass a new --workdir to start over")
    # Left-out leaves back: the empty ones from the template's shapes, the unchanged ones
    # from the initial state.
    arrays = jax.tree_util.tree_map_with_path(
        lambda path, r, t, i: r if r is not None else (
            i if jax.tree_util.keystr(path) in from_initial else t),
        arrays, target, initial, is_leaf=lambda x: x is None)
    return arrays, host

  def restore_latest(self, template: Any) -> tuple[Any, dict] | None:
    """The newest checkpoint that restores and verifies, as (arrays like `template`, host).

    Damaged checkpoints (unreadable, or any checksum mismatch) are moved to
    `workdir/corrupt_checkpoints/` with a warning, so the run falls back to an older one and can
    later save over their step numbers. Returns None when no checkpoint is usable.
    """
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), to_numpy_shapes(template))
    initial = initial_digests = None
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        if initial is None:  # the template is the run's initial state
          initial = to_numpy(template)
          initial_digests = array_checksums(initial)
        arrays, host = self._restore_verified(step, target, initial, initial_digests)
      except InitialStateChanged:
        raise  # not damage: every checkpoint of the run would say the same
      except Exception as e:  # any failure to restore means: do not use it
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        moved = self._quarantine(step) if sharding.is_primary() else "corrupt_checkpoints/"
        sharding.barrier(f"quarantined checkpoint {step}")
        self._manager.reload()
        logging.warning("checkpoint %d in %s is damaged (%s: %s); moved it to %s and falling"
                        " back to an older one", step, self.directory, type(e).__name__,
                        reason[:200], moved)
        continue
      return _like_template(arrays, template), host
    return None

  def _quarantine(self, step: int) -> str:
    dest_root = os.path.join(self.workdir, CORRUPT_DIR)
    os.makedirs(dest_root, exist_ok=True)
    dest, n = os.path.join(dest_root, str(step)), 1
    while os.path.exists(dest):
      dest, n = os.path.join(dest_root, f"{step}.{n}"), n + 1
    shutil.move(os.path.join(self.directory, str(step)), dest)
    return dest

  def close(self) -> None:
    self._manager.close()


def to_numpy_shapes(tree: Any) -> Any:
  """Shapes and dtypes of `to_numpy(tree)` without copying anything to the host."""

  def leaf(x):
    if _is_key(x):
      x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

  return jax.tree.map(leaf, tree)


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
                stream_sha256: str) -> tuple[Any, Progress] | None:
  """Restores the newest good checkpoint and checks it belongs to this config and stream."""
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
  return arrays, Progress.from_json(host["progress"])
