"""EASE against NumPy and its paper: the prototype complement from the similarity of old and new
classes in the old subspace, the reweighted ensemble of subspace cosines, one trained module per
task (the others do not move) and prototypes only in the subspaces opened so far; its config
block is checked before any compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_methods
from numerics import assert_close

from configs import tiny
from olora_jax import validation
from olora_jax.methods import base, ease
from olora_jax.models.vit import ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 5
SHAPE = (16, 16, 3)


def cos(a, b):
  return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def test_complement_weights_new_classes_by_their_similarity_in_the_old_subspace():
  rng = np.random.default_rng(0)
  t, d = 3, 4
  sums = rng.normal(size=(C, t, d)).astype(np.float32)
  # class 0 (task 0): subspace 0 only; classes 1, 2 (task 1): 0-1; classes 3, 4 (task 2): 0-2
  counts = np.zeros((C, t), np.float32)
  counts[0, :1] = 2
  counts[1:3, :2] = 3
  counts[3:, :] = 4
  task = np.asarray([0, 1, 1, 2, 2], np.int32)
  got = np.asarray(ease.complement(jnp.asarray(sums), jnp.asarray(counts), jnp.asarray(task)))
  means = sums / np.maximum(counts, 1)[..., None]
  for c in range(C):
    for j in range(t):
      if counts[c, j] > 0:
        want = means[c, j]
      else:  # the classes with prototypes in c's own subspace and in j
        ref = [k for k in range(C) if counts[k, task[c]] > 0 and counts[k, j] > 0]
        s = np.asarray([cos(means[c, task[c]], means[k, task[c]]) for k in ref])
        w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        want = w @ means[ref, j]
      assert_close(got[c, j], want, rtol=1e-5)


def test_ensemble_reweights_the_other_subspaces_by_alpha_over_t():
  rng = np.random.default_rng(1)
  f = rng.normal(size=(3, 2, 4)).astype(np.float32)  # (T, N, D)
  p = rng.normal(size=(C, 3, 4)).astype(np.float32)
  task = np.asarray([0, 0, 1, 1, 2], np.int32)
  got = np.asarray(ease.ensemble_logits(jnp.asarray(f), jnp.asarray(p), jnp.asarray(task),
                                        jnp.asarray(1), 0.1))
  for n in range(2):
    for c in range(C):
      want = sum((1.0 if j == task[c] else 0.1 / 1) * cos(f[j, n], p[c, j]) for j in range(2))
      assert_close(got[n, c], want, rtol=1e-5, scale=2.0)


def batch(labels, seed=0):
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels, np.int32)
  images = rng.random((len(labels), *SHAPE)).astype(np.float32) + labels[:, None, None, None]
  return {"images": images, "labels": labels, "mask": np.ones(len(labels), bool)}


def slot(tree, j):
  return [np.asarray(x[j]) for x in jax.tree.leaves(tree)]


def test_one_module_per_task_and_prototypes_in_the_opened_subspaces():
  method, state, _ = tiny_methods.build(ease, SPEC, C, rank=2, n_tasks=3)
  step = jax.jit(method.train_step)
  before = state["params"]["adapters"]
  state, scalars, _ = step(state, batch([0, 1, 0, 1]))
  after = state["params"]["adapters"]
  assert any(np.any(a != b) for a, b in zip(slot(before, 0), slot(after, 0), strict=True))
  for j in (1, 2):  # the later slots do not move
    for a, b in zip(slot(before, j), slot(after, j), strict=True):
      np.testing.assert_array_equal(a, b)
  assert np.asarray(state["counts"])[:2].tolist() == [[2, 0, 0], [2, 0, 0]]

  state, _ = method.at_boundary(state, {})
  frozen = state["params"]["adapters"]
  state, scalars, _ = step(state, batch([2, 3, 2, 3], seed=1))
  for a, b in zip(slot(frozen, 0), slot(state["params"]["adapters"], 0), strict=True):
    np.testing.assert_array_equal(a, b)  # task 0's module is frozen
  assert int(scalars["task_classes"]) == 2
  assert np.asarray(state["counts"])[2:4].tolist() == [[2, 2, 0], [2, 2, 0]]
  assert np.asarray(state["class_task"])[:4].tolist() == [0, 0, 1, 1]
  read = jax.jit(method.eval_state)(state)
  # class 0 has no samples in subspace 1: its prototype there is the complement, not zero
  assert np.linalg.norm(np.asarray(read["prototypes"])[0, 1]) > 0
  logits = np.asarray(jax.jit(method.predict)(read, batch([0, 2])["images"]))
  assert np.all(logits[:, 4] == -1e9) and np.all(np.isfinite(logits[:, :4]))


@pytest.mark.parametrize("key,value,match", [
    ("rank", 17, r"ease.rank=17 must be an integer in \[1, model width=16\]"),
    ("trainable", "all", r"ease.trainable='all'"),
    ("n_tasks", -1, r"ease.n_tasks=-1 must be an integer >= 0"),
])
def test_bad_ease_config_is_refused(key, value, match):
  config = tiny.get_config()
  config.method = "ease"
  validation.check_method(config, width=16)
  setattr(config.ease, key, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config, width=16)


def test_a_backbone_without_attention_is_refused_in_one_line():
  config = tiny.get_config()
  config.method = "ease"
  config.model.name = "resnet18_reduced"
  spec = type("ConvSpec", (), {"width": 160})()  # no lora_layers: no q and v to adapt
  with pytest.raises(ValueError, match=r"method='ease' puts a LoRA module per task on q and v"
                     r" .* model.name='resnet18_reduced' does not have"):
    ease.build(base.Context(config=config, model=None, spec=spec, num_classes=C, batch_size=8,
                            image_shape=SHAPE))
