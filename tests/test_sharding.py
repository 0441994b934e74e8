"""Data parallelism: a step on a batch split over 2 devices equals the single-device step; the
evaluator's cached test set counts the same on 2 devices as on one."""

import os
import subprocess
import sys
import textwrap

import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
  import jax, jax.numpy as jnp, numpy as np
  from numerics import assert_close
  from olora_jax import sharding
  from olora_jax.learner import buffer as buffer_lib, online_lora
  from olora_jax.models.vit import ViTSpec, VisionTransformer
  assert jax.local_device_count() == 2, jax.local_devices()
  spec = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
  model = VisionTransformer(spec, 4)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))["params"]
  params["head"]["kernel"] = 0.1 * jax.random.normal(jax.random.key(1), (16, 4))
  frozen, head = online_lora.split_params(params)
  tx = online_lora.make_optimizer(1e-2)
  config = online_lora.LearnerConfig(rank=2)
  learner = online_lora.make_learner(model, tx, config)
  rng = np.random.default_rng(0)
  batches = [{"images": rng.random((8, 16, 16, 3), np.float32),
              "labels": rng.integers(0, 4, 8).astype(np.int32),
              "mask": np.arange(8) < 7} for _ in range(3)]
  mesh = sharding.make_mesh()

  def run(shard):
    state = online_lora.init_train_state(jax.random.key(2), head, spec, config, tx)
    buf = buffer_lib.init_buffer(4, (16, 16, 3))
    fz = jax.tree.map(jnp.array, frozen)  # consolidate donates the frozen tree
    if shard:
      fz, state, buf = sharding.replicate((fz, state, buf), mesh)
    losses = []
    for b in batches:
      if shard:
        b = sharding.shard_batch(b, mesh)
      state, scalars, scores = learner.train_step(state, fz, buf, b)
      buf = learner.update_buffer(buf, b, scores)
      losses.append(float(scalars["loss"]))
    state, fz = learner.consolidate(state, fz, buf)
    return losses, jax.device_get((state.trainable, state.omega, fz))

  l1, t1 = run(False)
  l2, t2 = run(True)
  assert_close(l1, l2, rtol=1e-5)
  # Each device sums half the batch: the gradients' rounding scales with each leaf's largest.
  jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-4), t1, t2)

  # The evaluator's test set cached on the devices (replicated; each device gathers its rows of
  # every batch) counts as the host cache and as one device; built by the device resize
  # (data.preprocess='device': each device resizes half of every chunk), it is the same cache.
  from jax.sharding import Mesh
  from olora_jax import evaluate
  from olora_jax.data.sources import Source
  test = Source("toy", "test", rng.integers(0, 256, (21, 8, 8, 3)).astype(np.uint8),
                rng.integers(0, 4, 21), 4)
  predict = lambda p, x: model.apply({"params": p}, x)
  one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), sharding.AXES)
  counts = {}
  levels = {}
  for name, where, m, pre in (("two", "device", mesh, "host"), ("two_host", "host", mesh, "host"),
                              ("one", "device", one, "host"),
                              ("two_dev", "device", mesh, "device")):
    evaluate.cache_placement = lambda *args, where=where: where
    ev = evaluate.Evaluator(test, 16, 8, 4, predict, mesh=m, preprocess=pre)
    assert ev.cached == where
    levels[name] = np.asarray(ev._levels)
    counts[name] = ev.all_counts(sharding.replicate(params, m), np.arange(4))
  np.testing.assert_array_equal(levels["two_dev"], levels["two"])
  for name in ("two_host", "one", "two_dev"):
    np.testing.assert_array_equal(counts[name].correct, counts["two"].correct)
    np.testing.assert_array_equal(counts[name].total, counts["two"].total)
  print("OK", l1)
""")


def test_two_device_data_parallel_step_matches_one_device():
  env = dict(os.environ, XLA_FLAGS=tiny_run.xla_flags("--xla_force_host_platform_device_count=2"),
             JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
  proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
