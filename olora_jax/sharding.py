"""Where arrays live: one device mesh over every process's devices, data parallel plus an optional
FSDP axis that shards the weights.

The mesh has two axes, `data` and `fsdp` (size `sharding.fsdp`, 1 by default), over
`jax.devices()` (all processes' devices, process by process, so each process holds a contiguous
block of every batch):

- Batches (the current batch, evaluation batches) are split along their leading axis over every
  device (`PartitionSpec(("data", "fsdp"))`). In a multi-process run each process builds only its
  own rows (`local_rows`) and `shard_batch` assembles the global array from them.
- With `fsdp` = 1 every state leaf is replicated: plain data parallelism. With `fsdp` = F > 1 every
  state leaf of two or more dimensions (the frozen backbone, and for methods that train the whole
  ViT its weights and optimizer moments) is split F ways along its largest dimension divisible by
  F, FSDP style; vectors and scalars stay replicated. XLA's partitioner gathers a layer's weights
  where it is used and reduces the gradients, so the jitted functions are unchanged and results
  match one device within float tolerance.

On one device (the CPU here) every placement is a no-op.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")
BATCH = PartitionSpec(AXES)  # the leading axis over every device


def make_mesh(fsdp: int = 1) -> Mesh:
  """The ("data", "fsdp") mesh over every process's devices; `fsdp` must divide their count."""
  devices = np.array(jax.devices())
  if fsdp < 1 or devices.size % fsdp:
    raise ValueError(f"sharding.fsdp={fsdp} must be >= 1 and divide the {devices.size} devices;"
                     f" pick a divisor of {devices.size}")
  return Mesh(devices.reshape(-1, fsdp), AXES)


def check_divisible(batch_size: int, mesh: Mesh, key: str) -> None:
  n = mesh.devices.size
  if batch_size % n:
    raise ValueError(f"{key}={batch_size} must be a multiple of the {n} devices;"
                     f" pick a batch size divisible by {n}")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def leaf_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
  """A state leaf's sharding: split over `fsdp` along its largest divisible dimension when it has
  two or more dimensions and the axis is larger than 1, else replicated."""
  f = mesh.shape["fsdp"]
  dims = [d for d in np.argsort(shape, kind="stable")[::-1] if shape[d] % f == 0]
  if f == 1 or len(shape) < 2 or not dims:
    return replicated(mesh)
  spec = [None] * len(shape)
  spec[int(dims[0])] = "fsdp"
  return NamedSharding(mesh, PartitionSpec(*spec))


def state_shardings(tree, mesh: Mesh):
  """The sharding of every leaf of a state pytree (arrays or `jax.ShapeDtypeStruct`s)."""
  return jax.tree.map(lambda x: leaf_sharding(np.shape(x), mesh), tree)


def place_state(tree, shardings):
  """`tree` with every leaf on its sharding. Leaves already there are left alone (no copy, no
  dispatch), so calling it after every step costs nothing once the state has settled. Host
  (numpy) leaves are placed from the host value, which must be the same in every process.

  "There" means the very sharding, not an equivalent one: jit keys its compiled programs on the
  arguments' shardings, so a state whose leaves change sharding type (a single-device sharding
  after `jax.jit`, a mesh sharding after a step) would be traced and compiled twice."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(shardings)
  moved = [i for i, (x, s) in enumerate(zip(leaves, targets, strict=True))
           if not (isinstance(x, jax.Array) and x.sharding == s)]
  if not moved:
    return tree
  out = list(leaves)
  if jax.process_count() == 1:
    for i in moved:
      out[i] = jax.device_put(leaves[i], targets[i])
    return treedef.unflatten(out)
  # Global arrays are resharded by a compiled identity; anything else is placed from the host.
  on_device = [i for i in moved
               if isinstance(leaves[i], jax.Array) and not leaves[i].is_fully_addressable]
  if on_device:
    resharded = jax.jit(lambda xs: xs, out_shardings=[targets[i] for i in on_device])(
        [leaves[i] for i in on_device])
    for i, x in zip(on_device, resharded, strict=True):
      out[i] = x
  for i in moved:
    if i not in on_device:
      out[i] = _from_host(leaves[i], targets[i])
  return treedef.unflatten(out)


def _from_host(x, sharding: NamedSharding) -> jax.Array:
  """A global array from a value every process holds whole (typed PRNG keys included)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _from_host(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(tree, mesh: Mesh):
  return place_state(tree, jax.tree.map(lambda _: replicated(mesh), tree))


def local_rows(batch_size: int, mesh: Mesh) -> slice:
  """The rows of a `batch_size` batch that this process's devices hold (all rows with one
  process)."""
  index_map = NamedSharding(mesh, BATCH).addressable_devices_indices_map((batch_size,))
  bounds = sorted({(idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)
                   for idx in index_map.values()})
  start, stop = bounds[0][0], bounds[-1][1]
  if sum(b - a for a, b in bounds) != stop - start:
    raise ValueError("this process's devices do not hold one contiguous block of the batch")
  return slice(start, stop)


def shard_batch(tree, mesh: Mesh):
  """The global batch from this process's rows (`local_rows`) of every array of `tree`, split
  along the leading axis over every device."""
  sharding = NamedSharding(mesh, BATCH)
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def to_host(tree):
  """Numpy copies of every array of `tree`, whole also when other processes hold parts of them,
  fetched by one `jax.device_get` (the copies overlap)."""

  def whole(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:  # every process holds it whole: no communication
        return x.addressable_data(0)
      return multihost_utils.process_allgather(x, tiled=True)
    return x

  return jax.tree.map(np.asarray, jax.device_get(jax.tree.map(whole, tree)))


def is_primary() -> bool:
  """True in the process that writes the run's files (process 0)."""
  return jax.process_index() == 0


def process_max(value: int) -> int:
  """The largest of every process's `value` (`value` itself with one process)."""
  if jax.process_count() == 1:
    return value
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def barrier(name: str) -> None:
  """Waits until every process reaches `name` (nothing to wait for with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
