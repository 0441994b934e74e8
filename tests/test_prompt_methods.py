"""DualPrompt and CODA-Prompt, the prefix-tuning prompt methods, against hand computations: the
ViT's per-block key/value prefixes, the key match, which parts train before and after a boundary
(the counter in the state), CODA-Prompt's frozen blocks and Gram-Schmidt initialisation, and the
config checks. (End to end, resume and one trace: tests/test_methods_run.py.)

Prefix-tuning adds key/value positions to attention, so prompts of zero value are NOT neutral (a
zero key prefix still takes softmax mass from the image tokens); what the reading implies, and
what is tested, is that no prefix (None, or no entry for a block) is the frozen model bit for bit,
and that a prefix is exactly attention over [prefix; tokens]."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, vit_rtol

from configs import tiny
from olora_jax import validation
from olora_jax.methods import REGISTRY, base, coda_prompt, common, dualprompt, mvp, prompt_pool
from olora_jax.models.vit import VisionTransformer, ViTSpec

SPEC = ViTSpec(width=16, depth=2, num_heads=2, mlp_dim=32, patch_size=4, image_size=8)
C = 4
SHAPE = (8, 8, 3)
DUAL = dict(g_layers=(0,), e_layers=(0, 1), g_prompt_length=2, prompt_length=3, pool_size=4,
            top_k=1)
CODA = dict(layers=(0, 1), pool_size=8, n_tasks=4, prompt_length=4, ortho_weight=0.1)


def context(method: str, **block) -> base.Context:
  config = tiny.get_config()
  config.method = method
  config.model.depth = SPEC.depth
  for key, value in block.items():
    config[method][key] = value
  return base.Context(config=config, model=VisionTransformer(SPEC, C), spec=SPEC, num_classes=C,
                      batch_size=6, image_shape=SHAPE)


@pytest.fixture(scope="module")
def params():
  model = VisionTransformer(SPEC, C)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, *SHAPE)))["params"]
  rng = np.random.default_rng(1)  # non-trivial head and biases: mistakes show in the logits
  return jax.tree.map(lambda p: p + 0.1 * rng.standard_normal(p.shape, np.float32), params)


def batch(seed, n=6):
  rng = np.random.default_rng(seed)
  return {"images": rng.uniform(0, 1, (n, *SHAPE)).astype(np.float32),
          "labels": rng.integers(0, C, n).astype(np.int32), "mask": np.ones(n, bool)}


def assert_orthogonal(a, b):
  """Rows of a (unit) orthogonal to rows of b, to float32 tolerance scaled by b's norms."""
  scale = np.linalg.norm(a, axis=1)[:, None] * np.linalg.norm(b, axis=1)[None, :]
  assert np.all(np.abs(a @ b.T) <= 1e-5 * scale)


def pool_of(state):
  return jax.tree.map(np.asarray, state["params"]["prompt_pool"])


# --------------------------------------------------------------------------------------------
# The ViT's prefixes.


def test_no_prefix_is_the_frozen_model_bit_for_bit(params):
  model, images = VisionTransformer(SPEC, C), batch(0)["images"]
  plain = np.asarray(model.apply({"params": params}, images))
  for prefixes in (None, {}):
    np.testing.assert_array_equal(
        np.asarray(model.apply({"params": params}, images, prefixes=prefixes)), plain)
  # A prefix on block 1 only leaves block 0's output alone: compare the pre-block-1 activations
  # through a model of depth 1 (the same weights).
  shallow = VisionTransformer(dataclasses.replace(SPEC, depth=1), C)
  p1 = {k: v for k, v in params.items() if k != "encoderblock_1"}
  prefix = {"encoderblock_1": {"key": jnp.ones((6, 2, 16)), "value": jnp.ones((6, 2, 16))}}
  np.testing.assert_array_equal(
      np.asarray(shallow.apply({"params": p1}, images, prefixes=prefix)),
      np.asarray(shallow.apply({"params": p1}, images)))


def test_a_prefix_is_attention_over_prefix_then_tokens(params):
  """The attention module with a prefix against NumPy: softmax(q [Pk; K]^T / sqrt(d)) [Pv; V]."""
  from olora_jax.models.vit import Attention

  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, 5, 16)).astype(np.float32)
  prefix = {n: rng.standard_normal((2, 3, 16)).astype(np.float32) for n in ("key", "value")}
  attn = Attention(num_heads=2)
  w = params["encoderblock_0"]["attn"]
  out = np.asarray(attn.apply({"params": w}, x, None, prefix))

  def proj(name, y):
    return y @ np.asarray(w[name]["kernel"]) + np.asarray(w[name]["bias"])

  q, k, v = (proj(n, x).reshape(2, 5, 2, 8) for n in ("query", "key", "value"))
  k = np.concatenate([prefix["key"].reshape(2, 3, 2, 8), k], axis=1)
  v = np.concatenate([prefix["value"].reshape(2, 3, 2, 8), v], axis=1)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = proj("out", np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(2, 5, 16))
  assert_close(out, expected, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# DualPrompt.


def test_dualprompt_test_time_match_picks_the_nearest_key():
  rng = np.random.default_rng(4)
  queries = rng.standard_normal((3, 16)).astype(np.float32)
  keys = rng.standard_normal((4, 16)).astype(np.float32)
  keys[[2, 0, 3]] = 5.0 * queries + 0.01 * rng.standard_normal((3, 16))  # image b -> key 2, 0, 3
  idx = prompt_pool.select(prompt_pool.key_distance(jnp.asarray(queries), jnp.asarray(keys)), 1)
  np.testing.assert_array_equal(np.asarray(idx)[:, 0], [2, 0, 3])


def test_dualprompt_trains_the_e_prompt_of_the_boundary_counter(params):
  """Before a boundary only E-prompt 0 (and its key) of the pool moves; `at_boundary` moves the
  counter, copies E-prompt 0 into E-prompt 1 and resets Adam; then only E-prompt 1 moves. The
  G-prompt and the head train throughout."""
  method = REGISTRY["dualprompt"](context("dualprompt", **DUAL))
  step = jax.jit(method.train_step)
  state = jax.jit(method.init)(jax.random.key(1), params)
  assert int(state["n_boundaries"]) == 0
  start = pool_of(state)
  state, scalars, _ = step(state, batch(6))
  state, scalars, _ = step(state, batch(7))
  assert int(scalars["e_prompt"]) == 0
  after = pool_of(state)
  for part in ("e_prompts", "keys"):
    assert not np.array_equal(after[part][0], start[part][0])
    np.testing.assert_array_equal(after[part][1:], start[part][1:])
  assert not np.array_equal(after["g_prompts"], start["g_prompts"])

  state, host = method.at_boundary(state, {"kept": 1})
  assert host == {"kept": 1} and int(state["n_boundaries"]) == 1
  copied = pool_of(state)
  np.testing.assert_array_equal(copied["e_prompts"][1], after["e_prompts"][0])
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state["opt_state"])
             if np.asarray(x).ndim > 0)  # Adam's moments start again at 0
  head = np.asarray(state["params"]["head"]["kernel"])
  state, scalars, _ = step(state, batch(8))
  assert int(scalars["e_prompt"]) == 1
  later = pool_of(state)
  for part in ("e_prompts", "keys"):
    np.testing.assert_array_equal(later[part][[0, 2, 3]], copied[part][[0, 2, 3]])
    assert not np.array_equal(later[part][1], copied[part][1])
  assert not np.array_equal(np.asarray(state["params"]["head"]["kernel"]), head)
  for _ in range(2):
    state, _ = method.at_boundary(state, {})
  assert int(step(state, batch(9))[1]["e_prompt"]) == DUAL["pool_size"] - 1  # task 3, the last
  state, _ = method.at_boundary(state, {})  # task 4: past the pool, free key selection
  assert int(state["n_boundaries"]) == 4
  assert int(step(state, batch(9))[1]["e_prompt"]) == -1


def test_dualprompt_learning_rate_is_scaled_to_the_batch(params):
  """The authors' linear scaling, learning_rate * B / 256: 5e-3 gives 3.125e-4 at batch 16 and
  1.25e-3 at 64; lr_reference_batch=0 leaves it unscaled. Adam's first update of a weight is
  lr * g / (|g| + 1e-8), so the head bias's largest move in the first step is the rate."""
  block = dualprompt.config()
  assert (block.learning_rate, block.lr_reference_batch) == (5e-3, 256)
  assert dualprompt.learning_rate(block, 16) == pytest.approx(3.125e-4, rel=1e-12)
  assert dualprompt.learning_rate(block, 64) == pytest.approx(1.25e-3, rel=1e-12)
  block.lr_reference_batch = 0
  assert dualprompt.learning_rate(block, 16) == 5e-3
  for batch_size, rate in ((16, 3.125e-4), (64, 1.25e-3)):
    ctx = dataclasses.replace(context("dualprompt", **DUAL), batch_size=batch_size)
    method = REGISTRY["dualprompt"](ctx)
    state = jax.jit(method.init)(jax.random.key(1), params)
    bias = np.asarray(state["params"]["head"]["bias"])
    stepped, _, _ = jax.jit(method.train_step)(state, batch(6))
    moved = np.abs(np.asarray(stepped["params"]["head"]["bias"]) - bias)
    assert_close(moved.max(), rate, rtol=1e-4)


def test_dualprompt_predict_uses_the_matched_e_prompt_among_the_trained(params):
  """Keys set to the images' own queries. Task-free (no boundary) only E-prompt 0 trains: every
  test image takes it, even one whose query lies on another key. Once those keys count as
  trained, predict's logits are those of forcing E-prompt i on image i. A boundary signalled
  right before an evaluation adds a key no step has trained: not a candidate until a step
  trains it."""
  method = REGISTRY["dualprompt"](context("dualprompt", **DUAL))
  step, predict = jax.jit(method.train_step), jax.jit(method.predict)
  state = jax.jit(method.init)(jax.random.key(1), params)
  state, _, _ = step(state, batch(6))
  np.testing.assert_array_equal(state["selection_count"], [6, 0, 0, 0])
  images = batch(5, n=3)["images"]
  model = VisionTransformer(SPEC, C)
  queries = model.apply({"params": params}, images, pre_logits=True)
  pool = state["params"]["prompt_pool"]
  pool["keys"] = pool["keys"].at[jnp.array([3, 1, 2])].set(queries)
  pool["e_prompts"] = jax.random.normal(jax.random.key(2), pool["e_prompts"].shape)

  @jax.jit
  def forced(idx):
    prefixes = dualprompt.prefixes(pool, idx[:, None], DUAL["g_layers"], DUAL["e_layers"])
    return model.apply({"params": {**state["frozen"], "head": state["params"]["head"]}}, images,
                       prefixes=prefixes)

  assert_close(predict(state, images), forced(jnp.array([0, 0, 0])), rtol=vit_rtol(SPEC))
  matched = np.asarray(predict({**state, "selection_count": jnp.ones(4)}, images))
  assert_close(matched, forced(jnp.array([3, 1, 2])), rtol=vit_rtol(SPEC))
  assert np.abs(matched - np.asarray(forced(jnp.array([0, 0, 0])))).max() > 1e-3
  state, _ = method.at_boundary(state, {})  # E-prompt 1 starts; key 1 has not trained
  assert_close(predict(state, images), forced(jnp.array([0, 0, 0])), rtol=vit_rtol(SPEC))
  state, _, _ = step(state, batch(7))
  np.testing.assert_array_equal(state["selection_count"], [6, 6, 0, 0])


# --------------------------------------------------------------------------------------------
# CODA-Prompt.


def test_coda_weights_are_the_cosine_of_the_attended_query_with_its_key():
  rng = np.random.default_rng(10)
  pool = {"keys": rng.standard_normal((8, 2, 16)).astype(np.float32),
          "attention": rng.standard_normal((8, 2, 16)).astype(np.float32)}
  queries = rng.standard_normal((3, 16)).astype(np.float32)
  active = np.arange(8) < 4
  alpha = np.asarray(coda_prompt.weights(jax.tree.map(jnp.asarray, pool), jnp.asarray(queries),
                                         jnp.asarray(active)))
  attended = queries[:, None, None, :] * pool["attention"][None]
  cos = np.sum(attended * pool["keys"][None], -1) / (
      np.linalg.norm(attended, axis=-1) * np.linalg.norm(pool["keys"], axis=-1)[None])
  assert_close(alpha[:, :4], cos[:, :4])
  np.testing.assert_array_equal(alpha[:, 4:], 0.0)  # components of later blocks are absent
  # A query matching one component's key (attention all ones) weighs that component most.
  pool["attention"][:] = 1.0
  pool["keys"][5, 0] = queries[1]
  alpha = coda_prompt.weights(jax.tree.map(jnp.asarray, pool), jnp.asarray(queries),
                              jnp.ones(8, bool))
  assert int(np.argmax(np.asarray(alpha)[1, :, 0])) == 5
  assert_close(np.asarray(alpha)[1, 5, 0], 1.0)


def test_coda_gram_schmidt_block_is_orthonormal_and_orthogonal_to_the_earlier_ones():
  rng = np.random.default_rng(11)
  rows = np.zeros((9, 16), np.float32)
  rows[:3] = rng.standard_normal((3, 16))  # trained earlier components: not orthonormal
  out = np.asarray(coda_prompt.orthonormal_block(jnp.asarray(rows), jax.random.key(0), 3, 3))
  np.testing.assert_array_equal(out[:3], rows[:3])
  np.testing.assert_array_equal(out[6:], 0.0)
  new = out[3:6]
  assert_close(new @ new.T, np.eye(3), rtol=1e-5)
  assert_orthogonal(new, rows[:3])


def test_coda_only_the_current_block_trains(params):
  """Block 0 trains first; after a boundary block 1 starts orthogonal to block 0, block 0's
  gradients are exactly 0 (stop_gradient) and it does not move; blocks 2, 3 stay 0."""
  method = REGISTRY["coda_prompt"](context("coda_prompt", **CODA))
  step = jax.jit(method.train_step)
  state = jax.jit(method.init)(jax.random.key(1), params)
  start = pool_of(state)
  for name in coda_prompt.ENTRIES:
    np.testing.assert_array_equal(start[name][2:], 0.0)  # block 0 only, 2 components
  state, scalars, _ = step(state, batch(12))
  assert int(scalars["block"]) == 0 and float(scalars["ortho_loss"]) >= 0
  trained = pool_of(state)
  for name in coda_prompt.ENTRIES:
    assert not np.array_equal(trained[name][:2], start[name][:2])
    np.testing.assert_array_equal(trained[name][2:], 0.0)

  state, _ = method.at_boundary(state, {})
  assert int(state["n_boundaries"]) == 1
  grown = pool_of(state)
  for name in coda_prompt.ENTRIES:
    np.testing.assert_array_equal(grown[name][:2], trained[name][:2])
    flat = np.moveaxis(grown[name].reshape(8, 2, -1), 1, 0)  # (layers, M, d)
    for layer in flat:
      assert_orthogonal(layer[2:4], layer[:2])
    np.testing.assert_array_equal(grown[name][4:], 0.0)

  # The gradient of the loss with respect to the pool: 0 on block 0, non-zero on block 1.
  b = batch(13)
  model = VisionTransformer(SPEC, C)
  queries = model.apply({"params": params}, b["images"], pre_logits=True)

  def loss(pool):
    frozen, active = coda_prompt.frozen_and_active(jnp.int32(1), 8, 2)
    pool = coda_prompt.freeze_earlier(pool, frozen)
    alpha = coda_prompt.weights(pool, queries, active)
    logits = model.apply({"params": params}, b["images"],
                         prefixes=coda_prompt.prefixes(pool, alpha, CODA["layers"]))
    ce = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(6), b["labels"]])
    return ce + coda_prompt.ortho_loss(pool, active)

  grads = jax.jit(jax.grad(loss))(state["params"]["prompt_pool"])
  for name in coda_prompt.ENTRIES:
    g = np.asarray(grads[name])
    np.testing.assert_array_equal(g[:2], 0.0)
    assert np.abs(g[2:4]).max() > 0
    np.testing.assert_array_equal(g[4:], 0.0)

  state, scalars, _ = step(state, b)
  assert int(scalars["block"]) == 1
  later = pool_of(state)
  for name in coda_prompt.ENTRIES:
    np.testing.assert_array_equal(later[name][:2], grown[name][:2])
    assert not np.array_equal(later[name][2:4], grown[name][2:4])
    np.testing.assert_array_equal(later[name][4:], 0.0)


def test_coda_task_mask_takes_the_ce_over_the_classes_seen_since_the_last_boundary(params):
  """train_mask='task': the CE of a step is the CE over the classes its task has shown so far
  (this batch's included), and a boundary empties that set; the default keeps no such set."""
  assert "task_classes" not in REGISTRY["coda_prompt"](context("coda_prompt", **CODA)).init(
      jax.random.key(0), params)
  method = REGISTRY["coda_prompt"](context("coda_prompt", **CODA, train_mask="task"))
  state = method.init(jax.random.key(0), params)
  b = {**batch(0), "labels": np.array([0, 0, 1, 0, 1, 1], np.int32)}
  state, scalars, _ = method.train_step(state, b)
  np.testing.assert_array_equal(state["task_classes"], [True, True, False, False])
  state, _ = method.at_boundary(state, {})
  np.testing.assert_array_equal(state["task_classes"], [False] * 4)
  b = {**batch(1), "labels": np.array([2, 2, 2, 2, 2, 2], np.int32)}
  state, scalars, _ = method.train_step(state, b)
  assert abs(float(scalars["ce"])) < 1e-6  # class 2 alone in the softmax (over all 4: > 0)
  np.testing.assert_array_equal(state["task_classes"], [False, False, True, False])


def test_coda_block_size_is_the_pool_over_the_settings_tasks(params):
  """One block of pool_size // n_tasks components per task (the authors' pool / tasks): 20 and
  10 of a pool of 100 for 5 and 10 tasks. n_tasks 0 takes the setting's data.n_tasks; past that
  many tasks the last block keeps training (it does not grow)."""
  assert [coda_prompt.block_size(100, n) for n in (5, 10, 3)] == [20, 10, 33]
  assert coda_prompt.block_size(60, 5) == 12  # the demo's pool on its 5 tasks
  assert coda_prompt.config().n_tasks == 0
  for n_tasks, size in ((5, 2), (10, 1)):
    ctx = context("coda_prompt", **{**CODA, "pool_size": 10, "n_tasks": 0})
    ctx.config.data.n_tasks = n_tasks
    method = REGISTRY["coda_prompt"](ctx)
    state = jax.jit(method.init)(jax.random.key(1), params)

    def used(state):  # components not zero (in use or trained), per layer and entry
      return {int(np.sum(np.any(np.asarray(x).reshape(10, 2, -1) != 0, axis=-1), axis=0)[0])
              for x in state["params"]["prompt_pool"].values()}

    assert used(state) == {size}
    state, _ = method.at_boundary(state, {})
    assert used(state) == {2 * size}
    for _ in range(n_tasks):  # past the last task: still n_tasks blocks
      state, _ = method.at_boundary(state, {})
    assert used(state) == {n_tasks * size} and int(state["n_boundaries"]) == n_tasks + 1


def test_coda_evaluates_only_the_blocks_that_trained(params):
  """A boundary signalled right before an evaluation starts block 1 (orthonormal draws, never
  trained): the evaluation still reads block 0 alone, as the authors' code evaluates the
  components of the tasks trained so far; block 1 joins once a step trained it."""
  method = REGISTRY["coda_prompt"](context("coda_prompt", **CODA))
  step, predict = jax.jit(method.train_step), jax.jit(method.predict)
  state = jax.jit(method.init)(jax.random.key(1), params)
  images = batch(14)["images"]
  state, _, _ = step(state, batch(12))
  assert int(state["trained_blocks"]) == 1
  before = np.asarray(predict(state, images))
  state, _ = method.at_boundary(state, {})
  np.testing.assert_array_equal(np.asarray(predict(state, images)), before)
  state, _, _ = step(state, batch(13))
  assert int(state["trained_blocks"]) == 2
  model = VisionTransformer(SPEC, C)
  queries = model.apply({"params": params}, images, pre_logits=True)
  pool = state["params"]["prompt_pool"]
  alpha = coda_prompt.weights(pool, queries, jnp.arange(8) < 4)  # blocks 0 and 1, by hand
  expected = model.apply({"params": {**state["frozen"], "head": state["params"]["head"]}}, images,
                         prefixes=coda_prompt.prefixes(pool, alpha, CODA["layers"]))
  assert_close(predict(state, images), expected, rtol=1e-5)


def test_coda_ortho_loss_is_zero_on_orthonormal_components_and_counts_those_in_use():
  eye = jnp.eye(4, 16)[:, None, :]  # 4 orthonormal components, one layer
  pool = {"keys": eye, "attention": eye, "prompts": eye.reshape(4, 1, 2, 8)}
  assert float(coda_prompt.ortho_loss(pool, jnp.ones(4, bool))) == 0.0
  doubled = jax.tree.map(lambda x: 2 * x, pool)  # T T^T - I = 3 I on the 2 in use, 3 times
  assert_close(coda_prompt.ortho_loss(doubled, jnp.arange(4) < 2), 3 * (2 * 9) / 4)


# --------------------------------------------------------------------------------------------
# L2P and MVP: the key-selected pools.


def test_mvp_default_query_is_the_class_token_after_the_block_before_the_last(params):
  """MVP's default query, as the authors' script runs their code: the prompt-free class token
  after blocks 0 .. depth - 2, with no LayerNorm; here (depth 2) after block 0, as a 1-block
  model with the same weights computes it. Default gamma: the authors' 1.0."""
  block = mvp.config()
  assert (block.query, block.gamma) == ("penultimate", 1.0)
  apply = common.make_apply(VisionTransformer(SPEC, C))
  images = batch(3)["images"]
  query = np.asarray(prompt_pool.query(apply, params, images, "penultimate", SPEC.depth))
  shallow = VisionTransformer(dataclasses.replace(SPEC, depth=1), C)
  first = {k: v for k, v in params.items() if k != "encoderblock_1"}
  assert_close(query, shallow.apply({"params": first}, images, pre_logits=True,
                                    final_norm=False), rtol=vit_rtol(SPEC))
  last = np.asarray(prompt_pool.query(apply, params, images, "last"))
  assert np.abs(query - last).max() > 1e-3
  with pytest.raises(ValueError, match="depth >= 2"):
    prompt_pool.query(apply, params, images, "penultimate", 1)


@pytest.mark.parametrize("name", ["l2p", "mvp"])
def test_key_selected_pools_never_select_a_key_no_step_trained(params, name):
  """The state counts each key's selections in training (those of the valid images); at
  evaluation only counted keys are candidates. Images whose queries lie on keys 1-3 take key 0
  while only key 0 has trained (their logits are those of a pool whose prompts, and masks, all
  equal entry 0's), and their own keys once those count as trained."""
  method = REGISTRY[name](context(name, pool_size=4, prompt_length=2, top_k=1))
  step, predict = jax.jit(method.train_step), jax.jit(method.predict)
  state = jax.jit(method.init)(jax.random.key(1), params)
  data = {**batch(6), "mask": np.array([True] * 5 + [False])}
  state, _, extras = step(state, data)
  np.testing.assert_array_equal(
      state["selection_count"], np.bincount(np.asarray(extras["prompt_idx"])[:5, 0], minlength=4))

  images = batch(5, n=3)["images"]
  where = "penultimate" if name == "mvp" else "last_norm"
  queries = prompt_pool.query(common.make_apply(VisionTransformer(SPEC, C)), state["frozen"],
                              images, where, SPEC.depth)
  pool = dict(state["params"]["prompt_pool"])
  pool["keys"] = pool["keys"].at[jnp.array([3, 1, 2])].set(queries)
  pool["prompts"] = jax.random.normal(jax.random.key(2), pool["prompts"].shape)
  if name == "mvp":
    pool["masks"] = jax.random.normal(jax.random.key(3), pool["masks"].shape)
  state = {**state, "params": {**state["params"], "prompt_pool": pool}}
  first = {**state, "params": {**state["params"], "prompt_pool": {
      k: (v if k == "keys" else jnp.broadcast_to(v[:1], v.shape)) for k, v in pool.items()}}}
  only_first = {**state, "selection_count": jnp.array([5.0, 0, 0, 0])}
  assert_close(predict(only_first, images), predict(first, images), rtol=vit_rtol(SPEC))
  all_trained = {**state, "selection_count": jnp.ones(4)}
  assert np.abs(np.asarray(predict(all_trained, images))
                - np.asarray(predict(first, images))).max() > 1e-3


# --------------------------------------------------------------------------------------------
# Config checks.


@pytest.mark.parametrize("key, value, match", [
    ("dualprompt.e_layers", (2, 3, 4), r"dualprompt.e_layers=\(2, 3, 4\) must be distinct block"
                                       r" indices in \[0, model.depth=1\)"),
    ("dualprompt.g_prompt_length", 0, r"dualprompt.g_prompt_length=0 must be >= 1"),
    ("dualprompt.top_k", 11, r"dualprompt.top_k=11 must be in \[1, dualprompt.pool_size\]"),
    ("dualprompt.lr_reference_batch", -1, r"dualprompt.lr_reference_batch=-1 must be an"
                                          r" integer >= 0"),
    ("coda_prompt.n_tasks", 9, r"coda_prompt.pool_size=8 must be >= the number of tasks 9"),
    ("coda_prompt.n_tasks", -1, r"coda_prompt.n_tasks=-1 must be an integer >= 0"),
    ("coda_prompt.prompt_length", 3, r"coda_prompt.prompt_length=3 must be even"),
    ("coda_prompt.ortho_weight", -1.0, r"coda_prompt.ortho_weight=-1.0 must be >= 0"),
    ("coda_prompt.pool_size", 32, r"coda_prompt.pool_size=32 must be <= model.width=16"),
    ("coda_prompt.train_mask", "seen", r"coda_prompt.train_mask='seen' must be 'none'"),
    ("dualprompt.train_mask", "all", r"dualprompt.train_mask='all' must be 'none'"),
])
def test_bad_prompt_method_config_is_refused(key, value, match):
  config = tiny.get_config()
  config.dualprompt.update(g_layers=(0,), e_layers=(0,))
  config.coda_prompt.update(layers=(0,), pool_size=8, n_tasks=4)
  section, _, leaf = key.rpartition(".")
  config.method = section
  setattr(config[section], leaf, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config)


def test_prompt_method_configs_for_a_shallow_model_pass():
  config = tiny.get_config()
  config.dualprompt.update(g_layers=(0,), e_layers=(0,))
  config.coda_prompt.update(layers=(0,), pool_size=8, n_tasks=4)
  for method in ("dualprompt", "coda_prompt"):
    config.method = method
    validation.check_method(config)
