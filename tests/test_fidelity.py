"""The `fidelity` switch: every difference between the paper and the released code, pinned.

Each test builds a tiny ViT (width 16, one block, 8x8 images) and checks one row of the table in
docs/fidelity.md against a hand computation, in both directions where the row has two behaviours.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import assert_close

from configs import tiny
from olora_jax import fidelity
from olora_jax.data import preprocess
from olora_jax.learner import buffer as buffer_lib
from olora_jax.learner import online_lora
from olora_jax.learner import plateau as plateau_lib
from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import VisionTransformer, ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=8)
NUM_CLASSES = 5
RANK = 2


@functools.cache
def _model_and_params(seed: int = 0):  # callers must not mutate the returned tree
  model = VisionTransformer(SPEC, NUM_CLASSES)
  key_init, key_head = jax.random.split(jax.random.key(seed))
  params = model.init(key_init, jnp.zeros((1, 8, 8, 3)))["params"]
  # The head starts at zero in a run; a random head makes every LoRA gradient non-trivial.
  params["head"]["kernel"] = jax.random.normal(key_head, params["head"]["kernel"].shape)
  return model, params


def _random_lora(seed: int, scale: float = 0.3) -> dict:
  tree = lora_lib.init_lora(jax.random.key(seed), SPEC, RANK)
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  return jax.tree.unflatten(
      treedef, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)])


def _batch(seed: int, n: int = 4, n_real: int | None = None) -> dict:
  rng = np.random.default_rng(seed)
  n_real = n if n_real is None else n_real
  return {"images": jnp.asarray(rng.uniform(size=(n, 8, 8, 3)), jnp.float32),
          "labels": jnp.asarray(rng.integers(0, NUM_CLASSES, n), jnp.int32),
          "mask": jnp.asarray(np.arange(n) < n_real)}


@functools.cache
def _cached_learner(sgd: bool, learner_items: tuple):
  """One jitted learner per configuration, shared by the tests (compiling dominates the time)."""
  model, _ = _model_and_params()
  config = online_lora.LearnerConfig(rank=RANK, **dict(learner_items))
  tx = optax.sgd(1.0) if sgd else online_lora.make_optimizer(1e-2)
  return model, config, tx, online_lora.make_learner(model, tx, config)


def _setup(sgd: bool = False, **learner_kwargs):
  model, config, tx, learner = _cached_learner(sgd, tuple(sorted(learner_kwargs.items())))
  _, params = _model_and_params()
  backbone, head = online_lora.split_params(_copy(params))  # consolidate donates `frozen`
  frozen = online_lora.init_frozen(backbone, SPEC, config)
  state = online_lora.init_train_state(jax.random.key(1), head, SPEC, config, tx)
  return model, config, learner, state, frozen


def _batch_buffer(entries: list[dict]) -> buffer_lib.BatchBuffer:
  return buffer_lib.BatchBuffer(
      images=jnp.stack([e["images"] for e in entries]),
      labels=jnp.stack([e["labels"] for e in entries]),
      mask=jnp.stack([e["mask"] for e in entries]),
      valid=jnp.ones((len(entries),), bool))


def _with_lora(state, lora):
  return state.replace(trainable={**state.trainable, "lora": lora})


def _copy(tree):
  return jax.tree.map(jnp.array, tree)


def _zero_lora():
  return lora_lib.zeros_like_lora(SPEC, RANK)


# --- resolution of the switch ------------------------------------------------------------------


def test_resolve_sets_every_key_from_fidelity_and_keeps_overrides():
  config = tiny.get_config()
  paper = fidelity.resolve(config)
  assert paper.learner.buffer_unit == "sample" and paper.learner.merge == "exact"
  assert paper.learner.reset_opt_state_at_merge is True
  assert config.learner.buffer_unit is None  # the input is not modified
  config.fidelity = "reference"
  ref = fidelity.resolve(config)
  for (section, key), defaults in fidelity.FIDELITY_DEFAULTS.items():
    assert ref[section][key] == defaults["reference"], key
    assert paper[section][key] == defaults["paper"], key
  # One key flipped on its own; resolving twice changes nothing.
  config.fidelity = "paper"
  config.learner.merge = "factor_sum"
  flipped = fidelity.resolve(fidelity.resolve(config))
  assert flipped.learner.merge == "factor_sum" and flipped.learner.buffer_unit == "sample"
  record = fidelity.fidelity_record(config)
  assert set(record) == {"fidelity", "learner.allow_dead_lora", *fidelity.fidelity_keys()}


@pytest.mark.parametrize("key,value,match", [
    ("fidelity", "released", "unknown fidelity"),
    ("learner.merge", "sum", "unknown learner.merge"),
    ("learner.buffer_unit", "batches", "unknown learner.buffer_unit"),
    ("data.input_scale", "imagenet", "unknown data.input_scale"),
    ("data.core50_order", "random", "unknown data.core50_order"),
])
def test_resolve_refuses_bad_values(key, value, match):
  config = tiny.get_config()
  section, _, name = key.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(ValueError, match=match):
    fidelity.resolve(config)


def test_dead_lora_combination_is_refused_unless_overridden():
  config = tiny.get_config()
  config.learner.new_lora_init = "zeros"  # paper resets the optimizer state at a merge
  with pytest.raises(ValueError, match="never learns"):
    fidelity.resolve(config)
  config.learner.allow_dead_lora = True
  assert fidelity.resolve(config).learner.new_lora_init == "zeros"
  # Keeping the optimizer state (the released code) is fine without the override.
  config.learner.allow_dead_lora = False
  config.learner.reset_opt_state_at_merge = False
  fidelity.resolve(config)


def test_learner_config_refuses_unknown_values():
  with pytest.raises(ValueError, match="learner.importance"):
    online_lora.LearnerConfig(importance="ewc")


# --- merge ---------------------------------------------------------------------------------------


def test_reference_merge_sums_factors_and_jumps_at_the_second_merge():
  model, config, learner, state, frozen = _setup(merge="factor_sum", new_lora_init="zeros",
                                                 reset_opt_state_at_merge=False)
  images = _batch(7)["images"]
  buf = online_lora.init_buffer(config, 4, 4, (8, 8, 3))
  lora1, lora2 = _random_lora(1), _random_lora(2)

  state = _with_lora(state, _copy(lora1))
  before1 = learner.predict(state, frozen, images)
  state, frozen = learner.consolidate(state, frozen, buf)
  after1 = learner.predict(state, frozen, images)
  assert_close(after1, before1)  # A = B = 0 now: no jump yet
  jax.tree.map(np.testing.assert_array_equal, frozen[online_lora.FROZEN_LORA], lora1)

  state = _with_lora(state, _copy(lora2))
  before2 = learner.predict(state, frozen, images)
  state, frozen = learner.consolidate(state, frozen, buf)
  after2 = learner.predict(state, frozen, images)

  summed = jax.tree.map(jnp.add, lora1, lora2)
  jax.tree.map(assert_close,
               frozen[online_lora.FROZEN_LORA], summed)
  # The frozen delta is (A1 + A2)(B1 + B2) in our (in, out) layout, i.e. (B1+B2)(A1+A2).
  _, params = _model_and_params()
  backbone, _ = online_lora.split_params(params)
  expected_frozen = lora_lib.merge_into_backbone(backbone, summed)
  expected = jax.jit(model.apply)(
      {"params": {**expected_frozen, "head": state.trainable["head"]}}, images)
  assert_close(after2, expected)
  # ... which is not B1 A1 + B2 A2: the function jumps at the second merge.
  assert float(jnp.max(jnp.abs(after2 - before2))) > 1e-2


def test_paper_merge_folds_exactly_and_never_jumps():
  model, config, learner, state, frozen = _setup()
  images = _batch(7)["images"]
  buf = buffer_lib.init_buffer(4, (8, 8, 3))  # the shape of the other paper-mode tests
  _, params = _model_and_params()
  backbone, _ = online_lora.split_params(params)
  assert online_lora.FROZEN_LORA not in frozen
  lora1, lora2 = _random_lora(1), _random_lora(2)
  for lora in (lora1, lora2):
    state = _with_lora(state, _copy(lora))
    before = learner.predict(state, frozen, images)
    state, frozen = learner.consolidate(state, frozen, buf)
    after = learner.predict(state, frozen, images)
    assert_close(after, before)
  q1 = lora1["encoderblock_0"]["query"]
  q2 = lora2["encoderblock_0"]["query"]
  assert_close(
      frozen["encoderblock_0"]["attn"]["query"]["kernel"],
      backbone["encoderblock_0"]["attn"]["query"]["kernel"]
      + q1["lora_a"] @ q1["lora_b"] + q2["lora_a"] @ q2["lora_b"])


# --- new LoRA init and optimizer state ------------------------------------------------------------


@pytest.mark.parametrize("reset", [False, True])
def test_zero_init_learns_only_through_kept_optimizer_state(reset):
  model, config, learner, state, frozen = _setup(new_lora_init="zeros",
                                                 reset_opt_state_at_merge=reset)
  buf = buffer_lib.init_buffer(2, (8, 8, 3))
  for i in range(3):  # build Adam moments on the first LoRA
    batch = _batch(i)
    state, _, scores = learner.train_step(state, frozen, buf, batch)
    buf = learner.update_buffer(buf, batch, scores)
  state, frozen = learner.consolidate(state, frozen, buf)
  assert all(not np.any(x) for x in jax.tree.leaves(state.trainable["lora"]))
  for i in range(3):
    batch = _batch(10 + i)
    state, _, scores = learner.train_step(state, frozen, buf, batch)
    buf = learner.update_buffer(buf, batch, scores)
  moved = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(state.trainable["lora"]))
  if reset:
    assert moved == 0.0  # zero gradients and fresh Adam state: stuck at exactly zero
  else:
    assert moved > 0.0  # the kept first and second moments move it off zero


# --- importance -----------------------------------------------------------------------------------


def test_reference_importance_is_one_flat_softmax_gradient_of_entry_zero():
  model, config, learner, state, frozen = _setup(buffer_unit="batch", importance="flat_softmax")
  lora = _random_lora(3)
  state = _with_lora(state, _copy(lora))
  entry0, entry1 = _batch(20, n=4, n_real=3), _batch(21, n=4)
  head = state.trainable["head"]

  # Hand computation: d log softmax(z)_j / dz = onehot(j) - softmax(z), pulled back through
  # the logits of entry 0's three real items with a VJP.
  def logits_fn(lora_tree):
    params = {**frozen, "head": head}
    return model.apply({"params": params}, entry0["images"][:3], lora=lora_tree)  # (3, C)

  z, vjp = jax.vjp(jax.jit(logits_fn), lora)
  flat = np.asarray(z).reshape(-1)
  j = int(np.argmax(flat))
  p = np.exp(flat - flat.max())
  p /= p.sum()
  cot = (np.eye(flat.size)[j] - p).reshape(z.shape).astype(np.float32)
  (grad,) = vjp(jnp.asarray(cot))
  expected = jax.tree.map(jnp.square, grad)

  for other in (entry1, _batch(22, n=4)):  # entry 1 plays no part
    new_state, _ = learner.consolidate(_copy(state), _copy(frozen), _batch_buffer([entry0, other]))
    # Another program's backward pass: a squared gradient near 0 is off by the rounding of the
    # leaf's largest ones (assert_close's atol), not by its own magnitude.
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-4), new_state.omega,
                 expected)  # first plateau: Omega_1 = g_1
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(new_state.omega))


def test_paper_importance_is_the_mean_per_sample_fisher_with_true_labels():
  model, config, learner, state, frozen = _setup()
  lora = _random_lora(4)
  state = _with_lora(state, _copy(lora))
  items = _batch(30, n=3)
  buf = buffer_lib.HardBuffer(images=jnp.concatenate([items["images"], jnp.ones((1, 8, 8, 3))]),
                              labels=jnp.concatenate([items["labels"], jnp.array([1])]),
                              valid=jnp.array([True, True, True, False]))
  head = state.trainable["head"]

  def log_lik(lora_tree, image, label):
    params = {**frozen, "head": head}
    logits = model.apply({"params": params}, image[None], lora=lora_tree)[0]
    return jax.nn.log_softmax(logits)[label]

  grad_fn = jax.jit(jax.grad(log_lik))
  squares = [jax.tree.map(jnp.square, grad_fn(lora, items["images"][i], items["labels"][i]))
             for i in range(3)]
  expected = jax.tree.map(lambda *g: sum(g) / 3.0, *squares)
  new_state, _ = learner.consolidate(state, frozen, buf)
  jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-4), new_state.omega, expected)


def test_empty_buffer_plateau_gives_zero_importance_in_both_modes():
  for kwargs in ({}, dict(buffer_unit="batch", importance="flat_softmax")):
    _, config, learner, state, frozen = _setup(**kwargs)
    state = _with_lora(state, _random_lora(5))
    buf = online_lora.init_buffer(config, 4 if config.buffer_unit == "sample" else 2, 4,
                                  (8, 8, 3))  # the shapes of the importance tests
    new_state, _ = learner.consolidate(state, frozen, buf)
    assert all(not np.any(x) for x in jax.tree.leaves(new_state.omega))
    assert int(new_state.n_plateaus) == 1  # it still counts in the running mean


# --- loss window value and the single concatenated pass -------------------------------------------


@pytest.mark.parametrize("window_value", ["sum", "mean"])
def test_window_value_and_one_concatenated_pass_equal_separate_passes(window_value):
  # SGD with lr 1: the update is minus the gradient, so the gradient is checked too.
  model, config, learner, state, frozen = _setup(
      sgd=True, buffer_unit="batch", window_value=window_value)
  state = _with_lora(state, _random_lora(6))
  current = _batch(40, n=4, n_real=3)
  entries = [_batch(41, n=4), _batch(42, n=4, n_real=2)]
  buf = _batch_buffer(entries + [_batch(43, n=4)])
  buf = buf.replace(valid=jnp.array([True, True, False]))  # the third entry is still empty
  head, lora = state.trainable["head"], state.trainable["lora"]

  def ce(trainable, b):
    params = {**frozen, "head": trainable["head"]}
    logits = model.apply({"params": params}, b["images"], lora=trainable["lora"])
    per = optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"])
    return per, jnp.sum(per * b["mask"]) / jnp.sum(b["mask"])

  def separate_objective(trainable):
    ce_current = ce(trainable, current)[1]
    if window_value == "sum":
      return ce_current + sum(ce(trainable, e)[1] for e in entries)
    per = jnp.concatenate([ce(trainable, e)[0] for e in entries])
    mask = jnp.concatenate([e["mask"] for e in entries])
    return ce_current + jnp.sum(per * mask) / jnp.sum(mask)

  trainable = {"lora": lora, "head": head}
  expected_value, expected_grad = jax.jit(jax.value_and_grad(separate_objective))(trainable)
  expected_scores = [jax.jit(ce)(trainable, b)[1] for b in [current, *entries]]
  old = _copy(trainable)
  new_state, scalars, scores = learner.train_step(state, frozen, buf, current)
  assert_close(scalars["window_value"], expected_value)
  assert_close(scores[:3], expected_scores)  # (1 + K,) batch means
  step = jax.tree.map(lambda a, b: a - b, old, new_state.trainable)
  jax.tree.map(assert_close, step, expected_grad)


def test_batch_buffer_keeps_the_hardest_batches_later_wins_ties():
  buf = buffer_lib.init_batch_buffer(2, 4, (8, 8, 3))
  b = [_batch(50 + i) for i in range(4)]
  buf = buffer_lib.update_batch_buffer(buf, b[0], jnp.array([1.0, -5.0, -5.0]))
  assert buf.valid.tolist() == [True, False]
  buf = buffer_lib.update_batch_buffer(buf, b[1], jnp.array([2.0, 1.0, 0.0]))
  np.testing.assert_array_equal(buf.labels, jnp.stack([b[1]["labels"], b[0]["labels"]]))
  buf = buffer_lib.update_batch_buffer(buf, b[2], jnp.array([2.0, 2.0, 0.5]))  # tie: b[1] later
  np.testing.assert_array_equal(buf.labels, jnp.stack([b[1]["labels"], b[2]["labels"]]))
  empty = {**b[3], "mask": jnp.zeros((4,), bool)}  # an all-padding batch is never kept
  buf = buffer_lib.update_batch_buffer(buf, empty, jnp.array([9.0, 1.0, 1.0]))
  assert buf.valid.tolist() == [True, True]


# --- plateau check on a partial window ------------------------------------------------------------


def test_reference_plateau_fires_on_a_partial_window_paper_waits_for_a_full_one():
  values = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]

  def fired_steps(partial):
    config = plateau_lib.PlateauConfig(window=5, mean_threshold=1.0, var_threshold=0.1,
                                       check_partial_window=partial)
    state, out = plateau_lib.init(), []
    for step, v in enumerate(values):
      state, stats = plateau_lib.update(state, v, config)
      if stats.fired:
        out.append(step)
    return out

  assert fired_steps(True) == [0]  # from step 1 (index 0) on a one-value window
  assert fired_steps(False) == [4]  # the first full window


# --- the learner is task-free ---------------------------------------------------------------------


def test_learner_interface_cannot_receive_task_ids_or_boundaries():
  _, config, learner, state, frozen = _setup(buffer_unit="batch")
  for fn in learner:
    params = inspect.signature(fn).parameters
    assert not any("task" in name or "boundar" in name for name in params), params
  buf = online_lora.init_buffer(config, 2, 4, (8, 8, 3))
  batch = {**_batch(60), "task_id": jnp.int32(1)}
  with pytest.raises(ValueError, match="task-free"):
    learner.train_step(state, frozen, buf, batch)
  with pytest.raises(ValueError, match="task-free"):
    learner.update_buffer(buf, batch, jnp.zeros((3,)))
  with pytest.raises(ValueError, match="needs a BatchBuffer"):
    learner.train_step(state, frozen, buffer_lib.init_buffer(2, (8, 8, 3)), _batch(60))


# --- input scaling -----------------------------------------------------------------------------


def test_input_scale_unit_and_signed():
  images = np.array([0, 51, 255], np.uint8).reshape(1, 1, 3, 1).repeat(3, axis=1)  # (1, 3, 3, 1)
  unit = preprocess.to_model_input(images, 3, "unit")
  signed = preprocess.to_model_input(images, 3, "signed")
  np.testing.assert_allclose(unit[0, 0, :, 0], [0.0, 0.2, 1.0], atol=1e-7)
  np.testing.assert_allclose(signed[0, 0, :, 0], [-1.0, -0.6, 1.0], atol=1e-6)
  with pytest.raises(ValueError, match="data.input_scale"):
    preprocess.to_model_input(images, 3, "imagenet")
