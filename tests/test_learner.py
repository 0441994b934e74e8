"""The jitted learner: parameter partition, frozen weights, importance, one trace per run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, reduction_rtol, vit_rtol

from configs import tiny
from olora_jax import trainer
from olora_jax.learner import buffer as buffer_lib
from olora_jax.learner import online_lora
from olora_jax.models.vit import VisionTransformer, ViTSpec

SPEC = ViTSpec(width=16, depth=2, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
NUM_CLASSES = 4
CONFIG = online_lora.LearnerConfig(rank=2, reg_lambda=10.0)


def make_parts(seed=0):
  model = VisionTransformer(SPEC, NUM_CLASSES)
  params = model.init(jax.random.key(seed), jnp.zeros((1, 16, 16, 3)))["params"]
  params["head"] = jax.tree.map(
      lambda p: 0.1 * jax.random.normal(jax.random.key(seed + 1), p.shape), params["head"])
  frozen, head = online_lora.split_params(params)
  tx = online_lora.make_optimizer(1e-2)
  learner = online_lora.make_learner(model, tx, CONFIG)
  state = online_lora.init_train_state(jax.random.key(seed + 2), head, SPEC, CONFIG, tx)
  return model, params, frozen, learner, state


def random_batch(key, n, valid=None):
  k1, k2 = jax.random.split(key)
  mask = np.ones(n, bool) if valid is None else np.arange(n) < valid
  return {"images": np.asarray(jax.random.uniform(k1, (n, 16, 16, 3))),
          "labels": np.asarray(jax.random.randint(k2, (n,), 0, NUM_CLASSES), np.int32),
          "mask": mask}


def filled_buffer(key, size=4, valid=3):
  b = random_batch(key, size, valid)
  return buffer_lib.HardBuffer(images=jnp.asarray(b["images"]), labels=jnp.asarray(b["labels"]),
                               valid=jnp.asarray(b["mask"]))


def test_every_leaf_is_trainable_or_frozen_exactly_once():
  _, params, frozen, _, state = make_parts()
  frozen_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(frozen)}
  head_paths = {"['head']" + jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_leaves_with_path(state.trainable["head"])}
  all_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  assert frozen_paths.isdisjoint(head_paths)
  assert frozen_paths | head_paths == all_paths
  # The LoRA factors are not backbone parameters at all: they live only in the trainable tree.
  assert set(state.trainable) == {"lora", "head"}
  assert not any("lora" in p for p in all_paths)


def test_a_step_updates_lora_and_head_and_leaves_frozen_bit_identical():
  _, _, frozen, learner, state = make_parts()
  frozen_before = jax.tree.map(np.array, frozen)
  trainable_before = jax.tree.map(np.array, state.trainable)
  buf = filled_buffer(jax.random.key(5))
  for i in range(2):  # the first step moves A and the head; the second also moves B
    state, scalars, _ = learner.train_step(state, frozen, buf, random_batch(jax.random.key(i), 8))
  jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.array, frozen))
  moved = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), trainable_before,
                       state.trainable)
  assert all(jax.tree.leaves(moved))
  assert np.isfinite(scalars["loss"]) and int(state.step) == 2


def test_window_value_excludes_the_regulariser_and_masks_padding():
  _, _, frozen, learner, state = make_parts()
  state = state.replace(omega=jax.tree.map(jnp.ones_like, state.omega))
  buf = filled_buffer(jax.random.key(5))
  batch = random_batch(jax.random.key(1), 8, valid=5)
  _, scalars, scores = learner.train_step(state, frozen, buf, batch)
  scores = np.asarray(scores)
  # Means of a few positive losses, summed in another order: no cancellation, no atol.
  np.testing.assert_allclose(scalars["ce_current"], scores[:5].mean(), rtol=reduction_rtol(5))
  np.testing.assert_allclose(scalars["ce_buffer"], scores[8:11].mean(), rtol=reduction_rtol(3))
  np.testing.assert_allclose(scalars["window_value"],
                             scalars["ce_current"] + scalars["ce_buffer"], rtol=1e-6)
  assert scalars["reg"] > 0
  np.testing.assert_allclose(scalars["loss"], scalars["window_value"] + scalars["reg"], rtol=1e-6)


def test_importance_is_the_mean_of_per_sample_squared_gradients():
  model, _, frozen, learner, state = make_parts()
  # Move B off zero so that every factor has a gradient.
  state = state.replace(trainable={**state.trainable, "lora": jax.tree.map(
      lambda x: x + 0.05, state.trainable["lora"])})
  buf = filled_buffer(jax.random.key(7), size=4, valid=3)
  trainable = jax.tree.map(np.array, state.trainable)
  frozen_copy = jax.tree.map(np.array, frozen)

  def log_lik(lora, image, label):
    params = {**frozen_copy, "head": trainable["head"]}
    logits = model.apply({"params": params}, image[None], lora=lora)[0]
    return jax.nn.log_softmax(logits)[label]

  squares = [jax.tree.map(jnp.square, jax.grad(log_lik)(trainable["lora"], buf.images[i],
                                                        buf.labels[i])) for i in range(3)]
  expected = jax.tree.map(lambda *g: sum(g) / 3, *squares)
  state, _ = learner.consolidate(state, frozen, buf)  # first plateau: Omega_1 = g_1
  # The vmapped program and the loop above sum in other orders: along each block's backward pass
  # the width, the MLP and the tokens twice (softmax, values), doubled by the square (measured:
  # 1.3e-5 elementwise on an Intel host, 5e-6 on an AMD one).
  jax.tree.map(lambda a, b: assert_close(a, b, rtol=vit_rtol(SPEC, passes=2)), state.omega,
               expected)


def test_omega_is_the_running_mean_over_plateaus():
  _, _, frozen, learner, state = make_parts()
  buf = filled_buffer(jax.random.key(7))
  omegas, fresh = [], []
  for i in range(3):
    state, _, _ = learner.train_step(state, frozen, buf, random_batch(jax.random.key(i), 8))
    state, frozen = learner.consolidate(state, frozen, buf)
    omegas.append(jax.tree.map(np.array, state.omega))
    fresh.append(jax.tree.map(np.array, state.trainable["lora"]))
  assert int(state.n_plateaus) == 3
  # Omega_k = g_k / k + (1 - 1/k) Omega_{k-1}  =>  k Omega_k - (k - 1) Omega_{k-1} = g_k >= 0.
  for k in (2, 3):
    g = jax.tree.map(lambda a, b, k=k: k * a - (k - 1) * b, omegas[k - 1], omegas[k - 2])
    assert all(np.all(x >= -1e-6) for x in jax.tree.leaves(g))
  # Each merge starts a new LoRA: B = 0, a new A.
  for lora in fresh:
    assert all(np.all(f["lora_b"] == 0) for b in lora.values() for f in b.values())
  assert not np.array_equal(fresh[0]["encoderblock_0"]["query"]["lora_a"],
                            fresh[1]["encoderblock_0"]["query"]["lora_a"])


@pytest.fixture()
def fresh_trace_counts():
  online_lora.TRACE_COUNTS.clear()
  yield online_lora.TRACE_COUNTS
  online_lora.TRACE_COUNTS.clear()


def test_each_jitted_function_traces_once_over_a_stream_with_merges(tmp_path, fresh_trace_counts):
  config = tiny.get_config()
  config.learner.mean_threshold = 100.0  # every peak is followed by a plateau
  config.learner.var_threshold = 100.0
  results = trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert results["n_plateaus"] >= 2
  assert dict(fresh_trace_counts) == {"train_step": 1, "consolidate": 1, "update_buffer": 1,
                                      "predict": 1}
