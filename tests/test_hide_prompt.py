"""HiDe-Prompt against NumPy and its paper: the contrastive regulariser of within-task prediction,
the prompt momentum, the task's prompt rows in training (only they move; a boundary copies them
to the next task's), the TII layer naming each image's task at test time, and the alignment of
the head (TAP) and the TII layer on every seen class's statistics, on copies; its config block is
checked before any compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_methods
from jax.extend import core as jax_core
from numerics import assert_close, vit_rtol

from configs import tiny
from olora_jax import validation
from olora_jax.methods import hide_prompt
from olora_jax.models.vit import ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 5
SHAPE = (16, 16, 3)
SMALL = dict(e_layers=(0,), prompt_length=2, pool_size=4, top_k=2, tap_epochs=5,
             tii_alignment_epochs=5, tap_samples_per_class=64, tii_samples_per_class=64,
             tap_learning_rate=0.05, tii_alignment_learning_rate=0.05, lr_reference_batch=0)


def batch(labels, seed=0):
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels, np.int32)
  images = rng.random((len(labels), *SHAPE)).astype(np.float32) + labels[:, None, None, None]
  return {"images": images, "labels": labels, "mask": np.ones(len(labels), bool)}


def test_contrastive_loss_is_the_authors_cross_entropy_over_prototypes_and_batch():
  rng = np.random.default_rng(0)
  features = rng.normal(size=(3, 4)).astype(np.float32)
  prototypes = rng.normal(size=(C, 4)).astype(np.float32)
  old = np.asarray([True, False, True, False, False])
  mask = np.asarray([True, True, False])
  got = hide_prompt.contrastive_loss(jnp.asarray(features), jnp.asarray(mask),
                                     jnp.asarray(prototypes), jnp.asarray(old), 0.8)
  z = np.concatenate([prototypes[old], features[mask]]).astype(np.float64)
  sim = z @ z.T / 0.8
  log_softmax = sim - np.log(np.sum(np.exp(sim - sim.max(1, keepdims=True)), axis=1,
                                    keepdims=True)) - sim.max(1, keepdims=True)
  assert_close(got, -np.mean(np.diag(log_softmax)), rtol=1e-5)


def test_prompt_momentum_mixes_the_earlier_tasks_prompts_into_the_live_one():
  e = jnp.asarray(np.arange(6 * 2, dtype=np.float32).reshape(6, 2))  # 3 tasks of top_k 2
  np.testing.assert_array_equal(hide_prompt.effective_prompts(e, jnp.asarray(0), 2, 0.1), e)
  got = np.asarray(hide_prompt.effective_prompts(e, jnp.asarray(2), 2, 0.1))
  mean = np.asarray(e)[:4].mean(axis=0)
  assert_close(got[4:], 0.9 * np.asarray(e)[4:] + 0.1 * mean, rtol=1e-6)
  np.testing.assert_array_equal(got[:4], np.asarray(e)[:4])


def test_a_task_trains_its_own_prompts_and_a_boundary_starts_the_next_from_them():
  method, state, _ = tiny_methods.build(hide_prompt, SPEC, C, **SMALL)
  step = jax.jit(method.train_step)
  before = np.asarray(state["params"]["prompt_pool"]["e_prompts"])
  state, scalars, _ = step(state, batch([0, 1, 0, 1]))
  after = np.asarray(state["params"]["prompt_pool"]["e_prompts"])
  moved = np.any((after != before).reshape(4, -1), axis=1)
  assert moved.tolist() == [True, True, False, False] and int(scalars["e_prompt"]) == 0
  assert np.all(np.isfinite([float(v) for v in scalars.values()]))
  state, _ = method.at_boundary(state, {})
  e = np.asarray(state["params"]["prompt_pool"]["e_prompts"])
  np.testing.assert_array_equal(e[2:], e[:2])  # task 1's prompts start as task 0's
  state, scalars, _ = step(state, batch([2, 3, 2, 3], seed=1))
  moved = np.any((np.asarray(state["params"]["prompt_pool"]["e_prompts"]) != e).reshape(4, -1),
                 axis=1)
  assert moved.tolist() == [False, False, True, True] and int(scalars["e_prompt"]) == 1
  assert np.asarray(state["class_task"])[:4].tolist() == [0, 0, 1, 1]
  assert float(scalars["contrastive"]) > 0  # against classes 0 and 1's prototypes now


def separable_state(state, dim):
  """`state` with classes 0-3 seen in tasks 0, 0, 1, 1, separable Gaussian statistics for both
  the prompted and the frozen features, and a head and TII layer biased towards class 3."""
  means = np.zeros((C, dim), np.float32)
  for c in range(4):
    means[c, c] = 8.0
  counts = np.asarray([50, 50, 50, 50, 0], np.float32)
  scatter = np.stack([np.eye(dim, dtype=np.float32) * 0.25 * 49] * C)
  scatter[4] = 0
  biased = {"kernel": jnp.zeros((dim, C)), "bias": jnp.asarray([0, 0, 0, 5.0, 0])}
  tii = {**state["params"]["tii"], "head": biased}
  return {**state, "counts": jnp.asarray(counts), "means": jnp.asarray(means),
          "scatter": jnp.asarray(scatter), "tii_means": jnp.asarray(means),
          "tii_scatter": jnp.asarray(scatter), "class_task": jnp.asarray([0, 0, 1, 1, 0]),
          "n_boundaries": jnp.asarray(1, jnp.int32),
          "params": {**state["params"], "head": biased, "tii": tii}}, means


def test_alignment_uses_every_seen_class_and_tii_names_the_task_on_a_copy():
  method, state, _ = tiny_methods.build(hide_prompt, SPEC, C, **SMALL)
  state, means = separable_state(state, SPEC.width)
  read = jax.jit(method.eval_state)(state)
  head = read["params"]["head"]
  scores = means @ np.asarray(head["kernel"]) + np.asarray(head["bias"])
  assert np.argmax(scores[:4], axis=1).tolist() == [0, 1, 2, 3]  # TAP: every seen class
  tii = hide_prompt.tii_logits(read["params"]["tii"], jnp.asarray(means[:4]))
  tasks = hide_prompt.task_of(tii, read["counts"] > 0, read["class_task"])
  assert np.asarray(tasks).tolist() == [0, 0, 1, 1]
  # class 4, never seen, is never named, whatever its score
  loud = tii.at[:, 4].set(100.0)
  assert np.asarray(hide_prompt.task_of(loud, read["counts"] > 0, read["class_task"])).tolist() \
      == [0, 0, 1, 1]
  # the state's own layers are untouched: the alignment serves prediction only
  np.testing.assert_array_equal(np.asarray(state["params"]["head"]["bias"]), [0, 0, 0, 5.0, 0])


def test_both_alignments_factor_their_covariances_in_one_cholesky():
  """Two Cholesky kernels in one program can each hold a thread of XLA:CPU's pool while waiting
  for the other (an evaluation hung so on 2 cores): eval_state factors both sets at once."""
  method, state, _ = tiny_methods.build(hide_prompt, SPEC, C, **SMALL)

  def count(jaxpr):
    return sum((eqn.primitive.name == "cholesky")
               + sum(count(sub) for sub in jax_core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)

  assert count(jax.make_jaxpr(method.eval_state)(state).jaxpr) == 1


def test_predict_takes_the_prompts_of_the_task_tii_names():
  method, state, model = tiny_methods.build(hide_prompt, SPEC, C, **SMALL)
  state = {**state, "counts": jnp.asarray([5.0, 5.0, 5.0, 5.0, 0.0]),
           "class_task": jnp.asarray([0, 0, 1, 1, 0]), "n_boundaries": jnp.asarray(1)}
  images = jnp.asarray(batch([0, 1, 2])["images"])
  frozen, params = state["frozen"], state["params"]
  # the TII layer scores class 2 (task 1) highest for every image
  tii = {**params["tii"], "head": {"kernel": jnp.zeros_like(params["tii"]["head"]["kernel"]),
                                   "bias": jnp.asarray([0, 0, 9.0, 0, 0])}}
  state = {**state, "params": {**params, "tii": tii}}
  got = np.asarray(jax.jit(method.predict)(state, images))
  e = hide_prompt.effective_prompts(params["prompt_pool"]["e_prompts"], jnp.asarray(1), 2, 0.01)

  def logits_with(task):
    idx = hide_prompt.task_rows(jnp.full((3,), task), 2)
    f = model.apply({"params": frozen}, images, pre_logits=True, prefixes={
        "encoderblock_0": {"key": e[idx][:, :, 0, 0].reshape(3, -1, SPEC.width),
                           "value": e[idx][:, :, 0, 1].reshape(3, -1, SPEC.width)}})
    return np.asarray(hide_prompt.linear(params["head"], f))[:, :4]

  expected = logits_with(1)
  assert_close(got[:, :4], expected, rtol=vit_rtol(SPEC), scale=np.abs(expected).max())
  assert not np.allclose(got[:, :4], logits_with(0), rtol=1e-3)
  assert np.all(got[:, 4] < -1e8)  # the class never seen is left out


@pytest.mark.parametrize("key,value,match", [
    ("align", "always", r"unknown hide_prompt.align='always'"),
    ("prompt_momentum", 1.0, r"hide_prompt.prompt_momentum=1.0 must be in \[0, 1\)"),
    ("tii_hidden_ratio", -1, r"hide_prompt.tii_hidden_ratio=-1 must be an integer >= 0"),
    ("tap_epochs", 0, r"hide_prompt.tap_epochs=0 must be an integer >= 1"),
    ("contrastive_temperature", 0.0, r"hide_prompt.contrastive_temperature=0.0 must be > 0"),
    ("e_layers", (3,), r"hide_prompt.e_layers=\(3,\) must be distinct block indices"),
])
def test_bad_hide_prompt_config_is_refused(key, value, match):
  config = tiny.get_config()
  config.method = "hide_prompt"
  config.hide_prompt.e_layers = (0,)
  validation.check_method(config)
  setattr(config.hide_prompt, key, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config)
