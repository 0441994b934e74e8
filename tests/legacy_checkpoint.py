"""Checkpoints in the format written before device digests: whole numpy arrays (every process
held a host copy), the SHA-256 of each, and a checksums record without a `digest` key. The
steps below are those that format's save took, so tests can check such workdirs still resume."""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp

from olora_jax import checkpointing


def save(ckpt: checkpointing.Checkpointer, step: int, arrays: Any, host: dict,
         initial: Any = None) -> None:
  """Writes checkpoint `step` of `ckpt` in the SHA-256 format; leaves of `arrays` equal to those
  of `initial` are left out and recorded under `from_initial`, as that format did."""
  host_arrays = checkpointing.to_numpy(arrays)
  digests = checkpointing.sha256_checksums(host_arrays)
  before = ({} if initial is None else
            checkpointing.sha256_checksums(checkpointing.to_numpy(initial)))
  from_initial = {k: v for k, v in digests.items() if before.get(k) == v}
  host_arrays = checkpointing._drop_empty(host_arrays, frozenset(from_initial))
  stored = [jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(host_arrays)[0]]
  checksums = {"arrays": {k: digests[k] for k in stored}, "from_initial": from_initial,
               "host": checkpointing._json_digest(host)}
  ckpt._manager.save(step, force=True, args=ocp.args.Composite(
      arrays=ocp.args.StandardSave(host_arrays), host=ocp.args.JsonSave(host),
      checksums=ocp.args.JsonSave(checksums)))
  ckpt._manager.wait_until_finished()
