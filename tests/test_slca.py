"""SLCA against NumPy and its paper: the streamed class statistics are each class's mean and
unbiased covariance, the slow learner's two rates, the boundary's freeze of the finished task's
head columns, the authors' logit normalisation, and the classifier alignment that the evaluator
reads (a copy: training goes on with the slow learner's head); its config block is checked before
any compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_methods
from numerics import assert_close, reduction_rtol

from configs import tiny
from olora_jax import validation
from olora_jax.methods import slca
from olora_jax.models.vit import ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 5
SHAPE = (16, 16, 3)


def batch(labels, seed=0, mask=None):
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels, np.int32)
  images = rng.random((len(labels), *SHAPE)).astype(np.float32) + labels[:, None, None, None]
  return {"images": images, "labels": labels,
          "mask": np.ones(len(labels), bool) if mask is None else np.asarray(mask)}


def test_streamed_statistics_are_each_class_mean_and_unbiased_covariance():
  rng = np.random.default_rng(0)
  d, batches = 6, []
  for i in range(5):
    labels = rng.integers(0, 3, 7).astype(np.int32)
    mask = np.arange(7) < 7 - (i % 2) * 2
    features = (rng.normal(size=(7, d)) * 3 + 10 * labels[:, None]).astype(np.float32)
    batches.append((features, labels, mask))
  counts, means, scatter = (jnp.zeros(C), jnp.zeros((C, d)), jnp.zeros((C, d, d)))
  absorb = jax.jit(slca.absorb_statistics)
  for f, y, m in batches:
    counts, means, scatter = absorb(counts, means, scatter, f, y, m)
  cov = slca.class_covariances(counts, scatter, 1e-4)
  z = np.concatenate([f[m] for f, _, m in batches]).astype(np.float64)
  y = np.concatenate([y[m] for _, y, m in batches])
  for c in range(3):
    assert counts[c] == np.sum(y == c)
    assert_close(means[c], z[y == c].mean(axis=0), rtol=reduction_rtol(40))
    assert_close(cov[c], np.cov(z[y == c].T) + 1e-4 * np.eye(d), rtol=1e-4)
  assert np.all(np.asarray(counts[3:]) == 0) and np.all(np.asarray(scatter[3:]) == 0)
  assert_close(cov[4], 1e-4 * np.eye(d), rtol=1e-6)  # no sample: the shrinkage alone


def test_logit_normalisation_divides_by_the_mean_of_the_tasks_norms():
  logits = jnp.asarray([[1.0, 2.0, 3.0, 4.0, 9.0]])
  seen = jnp.asarray([True, True, True, True, False])
  task = jnp.asarray([0, 0, 1, 1, 2])
  got = slca.normalised_logits(logits, seen, task, 3, 0.1)
  mean_norm = (np.hypot(1, 2) + np.hypot(3, 4)) / 2  # task 2 has no class seen: left out
  assert_close(got, np.asarray(logits) / (mean_norm + 1e-7) / 0.1, rtol=1e-6)
  grads = jax.grad(lambda x: slca.normalised_logits(x, seen, task, 3, 0.1).sum())(logits)
  assert np.all(np.isfinite(np.asarray(grads)))  # the empty task's sqrt(0) has no inf gradient


def test_slow_learner_rates_and_the_boundary_freezes_the_finished_tasks_head_columns():
  method, state, _ = tiny_methods.build(slca, SPEC, C, learning_rate=0.05,
                                        backbone_lr_scale=0.0, weight_decay=0.0)
  step = jax.jit(method.train_step)
  before = jax.tree.map(np.asarray, state["params"])
  state, scalars, _ = step(state, batch([0, 1, 0, 1, 0, 1, 0, 1]))
  after = jax.tree.map(np.asarray, state["params"])
  # backbone_lr_scale 0: the backbone does not move, the head does (columns of classes 0 and 1)
  for name in before:
    if name != "head":
      jax.tree.map(np.testing.assert_array_equal, before[name], after[name])
  moved = np.any(after["head"]["kernel"] != before["head"]["kernel"], axis=0)
  assert moved.tolist() == [True, True, False, False, False]
  assert int(scalars["task_classes"]) == 2 and int(state["n_boundaries"]) == 0

  state, _ = method.at_boundary(state, {})
  assert int(state["n_boundaries"]) == 1 and not np.any(np.asarray(state["current"]))
  frozen = np.asarray(state["params"]["head"]["kernel"])
  state, scalars, _ = step(state, batch([2, 3, 2, 3, 2, 3, 2, 3], seed=1))
  head = np.asarray(state["params"]["head"]["kernel"])
  np.testing.assert_array_equal(head[:, :2], frozen[:, :2])  # the finished task's columns
  assert np.all(np.any(head[:, 2:4] != frozen[:, 2:4], axis=0))
  assert int(scalars["task_classes"]) == 2  # the loss is over the new task's classes only
  assert np.asarray(state["class_task"])[:4].tolist() == [0, 0, 1, 1]


def test_backbone_moves_at_its_scaled_rate():
  """With SGD's first step (no momentum yet, no weight decay) an update is -rate * gradient: the
  backbone's is learning_rate * backbone_lr_scale, the head's learning_rate."""
  b = batch([0, 1, 0, 1])
  results = {}
  for scale in (0.01, 0.02):
    method, state, _ = tiny_methods.build(slca, SPEC, C, learning_rate=0.1,
                                          backbone_lr_scale=scale, weight_decay=0.0)
    before = jax.tree.map(np.asarray, state["params"])
    state, _, _ = jax.jit(method.train_step)(state, b)
    results[scale] = jax.tree.map(lambda a, x: np.asarray(x) - a, before, state["params"])
  embedding = [k for k in results[0.01] if k != "head"][0]
  for a, b2 in zip(jax.tree.leaves(results[0.01][embedding]),
                   jax.tree.leaves(results[0.02][embedding]), strict=True):
    assert_close(2 * a, b2, rtol=1e-4)
  assert_close(results[0.01]["head"]["kernel"], results[0.02]["head"]["kernel"], rtol=1e-4)


def separable_state(method, state, dim):
  """`state` with statistics of well-separated class Gaussians for classes 0-3 and a head that
  scores class 3 above every other class whatever the features (the recency bias CA corrects)."""
  means = np.zeros((C, dim), np.float32)
  for c in range(4):
    means[c, c] = 8.0
  counts = np.asarray([50, 50, 50, 50, 0], np.float32)
  scatter = np.stack([np.eye(dim, dtype=np.float32) * 0.25 * 49] * C)
  scatter[4] = 0
  head = {"kernel": np.zeros((dim, C), np.float32),
          "bias": np.asarray([0, 0, 0, 5.0, 0], np.float32)}
  return {**state, "counts": jnp.asarray(counts), "means": jnp.asarray(means),
          "scatter": jnp.asarray(scatter),
          "params": {**state["params"], "head": jax.tree.map(jnp.asarray, head)}}, means


@pytest.mark.parametrize("logit_norm", [0.1, 0.0])
def test_alignment_corrects_a_biased_head_on_a_copy(logit_norm):
  method, state, _ = tiny_methods.build(slca, SPEC, C, logit_norm_temperature=logit_norm,
                                        samples_per_class=64, alignment_epochs=5)
  state, means = separable_state(method, state, SPEC.width)
  read = jax.jit(method.eval_state)(state)
  head = read["params"]["head"]
  scores = means @ np.asarray(head["kernel"]) + np.asarray(head["bias"])
  assert np.argmax(scores[:4], axis=1).tolist() == [0, 1, 2, 3]
  assert np.all(np.isfinite(scores))
  # the slow learner's own head is untouched: CA serves prediction only (the authors' recall)
  np.testing.assert_array_equal(np.asarray(state["params"]["head"]["bias"]), [0, 0, 0, 5.0, 0])


def test_after_boundary_alignment_waits_for_a_boundary():
  method, state, _ = tiny_methods.build(slca, SPEC, C, alignment="after_boundary",
                                        samples_per_class=16, alignment_epochs=1)
  state, _ = separable_state(method, state, SPEC.width)
  ev = jax.jit(method.eval_state)
  np.testing.assert_array_equal(np.asarray(ev(state)["params"]["head"]["bias"]),
                                [0, 0, 0, 5.0, 0])
  state, _ = method.at_boundary(state, {})
  assert np.any(np.asarray(ev(state)["params"]["head"]["bias"]) != [0, 0, 0, 5.0, 0])


@pytest.mark.parametrize("key,value,match", [
    ("alignment", "always", r"unknown slca.alignment='always'"),
    ("alignment_epochs", 0, r"slca.alignment_epochs=0 must be an integer >= 1"),
    ("samples_per_class", 0, r"slca.samples_per_class=0 must be an integer >= 1"),
    ("backbone_lr_scale", -0.1, r"slca.backbone_lr_scale=-0.1 and"),
    ("covariance_shrinkage", 0.0, r"slca.covariance_shrinkage=0.0 must be > 0"),
    ("trainable", "prompts", r"slca.trainable='prompts'"),
])
def test_bad_slca_config_is_refused(key, value, match):
  config = tiny.get_config()
  config.method = "slca"
  validation.check_method(config)
  setattr(config.slca, key, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config)
