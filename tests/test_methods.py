"""The baselines' parts against hand computations: replay buffer policies, AGEM's projection,
EWC++'s running Fisher, MIR's retrieval, DER++'s stored logits, PCR's and LODE's losses against
NumPy, EMA's average by hand, RAR's augmentation, the trainable split."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, reduction_rtol

from configs import tiny
from olora_jax import methods, validation
from olora_jax.data import streams
from olora_jax.methods import (
    REGISTRY,
    agem,
    base,
    common,
    ewc_pp,
    finetune,
    lode,
    mir,
    mvp,
    pcr,
    prompt_pool,
    rar,
    replay,
)
from olora_jax.models.vit import VisionTransformer, ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 4
SHAPE = (16, 16, 3)


def context(method: str, **block) -> base.Context:
  config = tiny.get_config()
  config.method = method
  config.data.input_scale = "unit"
  for key, value in block.items():
    config[method][key] = value
  return base.Context(config=config, model=VisionTransformer(SPEC, C), spec=SPEC, num_classes=C,
                      batch_size=8, image_shape=SHAPE)


def init_params(seed=0):
  model = VisionTransformer(SPEC, C)
  # Jitted: an eager Flax init takes seconds.
  params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, *SHAPE)))["params"]
  params["head"] = jax.tree.map(
      lambda p: 0.3 * jax.random.normal(jax.random.key(seed + 1), p.shape), params["head"])
  return params


def batch(seed, n=8, valid=None, labels=None):
  """Images that are exact k/255 pixels (as the input pipeline makes them)."""
  rng = np.random.default_rng(seed)
  pixels = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
  mask = np.ones(n, bool) if valid is None else np.arange(n) < valid
  labels = rng.integers(0, C, n).astype(np.int32) if labels is None else np.asarray(
      labels, np.int32)
  return {"images": pixels.astype(np.float32) / 255.0, "labels": labels, "mask": mask}


# --------------------------------------------------------------------------------------------
# Buffers.


def test_uint8_storage_is_exact_for_both_input_scales():
  pixels = jnp.arange(256, dtype=jnp.uint8).reshape(1, 16, 16, 1).repeat(3, -1)
  for scale in ("unit", "signed"):
    x = replay.decode(pixels, scale)
    np.testing.assert_array_equal(replay.encode(x, scale), pixels)


def test_reservoir_keeps_each_sample_with_probability_capacity_over_seen():
  k, n, b, trials = 10, 100, 10, 600
  ids = np.arange(n, dtype=np.int32)

  def run(key):
    buf = replay.init(k, (1, 1, 3))
    for s in range(n // b):  # 10 batches; every other one padded with 2 sentinel items
      items = {"images": jnp.zeros((b + 2, 1, 1, 3)),
               "labels": jnp.concatenate([ids[s * b:(s + 1) * b], jnp.full(2, -1, jnp.int32)]),
               "mask": jnp.arange(b + 2) < b}
      buf = replay.reservoir_update(buf, items, jax.random.fold_in(key, s), "unit")
    return buf

  bufs = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(0), trials))
  assert bool(jnp.all(bufs.valid)) and bool(jnp.all(bufs.n_seen == n))
  assert not bool(jnp.any(bufs.labels == -1))  # padding never enters
  kept = np.zeros(n)
  for labels in np.asarray(bufs.labels):
    assert len(set(labels.tolist())) == k  # no sample twice
    kept[labels] += 1
  freq = kept / trials
  tol = 5 * np.sqrt(k / n * (1 - k / n) / trials)
  assert np.max(np.abs(freq - k / n)) < tol, freq
  # Early and late samples alike (a policy that favours recent samples fails here).
  assert abs(freq[: n // 2].mean() - freq[n // 2:].mean()) < tol / 3


def test_class_balanced_buffer_stays_balanced_and_never_holds_padding():
  k = 12
  buf, seen = replay.init(k, SHAPE), jnp.zeros(C, bool)
  update = jax.jit(replay.class_balanced_update, static_argnums=(4,))
  for step in range(16):  # class-incremental: 4 batches of class 0, then 1, 2, 3
    cls = step // 4
    b = batch(step, valid=6, labels=[cls] * 6 + [3, 3])  # 2 padded items labelled 3
    buf, seen = update(buf, seen, b, jax.random.key(step), "unit")
    counts = np.bincount(np.asarray(buf.labels)[np.asarray(buf.valid)], minlength=C)
    if step < 12:
      assert counts[3] == 0  # the padded class-3 items never entered
    present = counts[: cls + 1]
    if bool(jnp.all(buf.valid)):
      assert present.max() - present.min() <= 1, (step, counts)
  assert counts.sum() == k and counts.tolist() == [3, 3, 3, 3]


def test_sample_draws_distinct_valid_slots_only():
  buf = replay.init(6, SHAPE)
  buf = buf.replace(valid=jnp.array([True, False, True, True, False, False]),
                    labels=jnp.arange(6, dtype=jnp.int32))
  for seed in range(5):
    out = replay.sample(buf, jax.random.key(seed), 4, "unit")
    idx, mask = np.asarray(out["index"]), np.asarray(out["mask"])
    assert sorted(idx[mask].tolist()) == [0, 2, 3] and mask.sum() == 3
    assert len(set(idx.tolist())) == 4


# --------------------------------------------------------------------------------------------
# AGEM, EWC++, MIR, DER++.


def test_agem_projection():
  rng = np.random.default_rng(0)
  tree = lambda: {"a": jnp.asarray(rng.normal(size=(3, 4))), "b": jnp.asarray(rng.normal(size=5))}  # noqa: E731
  for _ in range(20):
    g, ref = tree(), tree()
    projected, dot = agem.project(g, ref)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    terms = np.abs(flat(g) * flat(ref)).sum()  # a dot of random vectors may cancel to near 0
    assert_close(dot, flat(g) @ flat(ref), rtol=reduction_rtol(17), scale=terms)
    if dot >= 0:  # already compatible: the plain gradient
      jax.tree.map(np.testing.assert_array_equal, projected, g)
    else:
      assert flat(projected) @ flat(ref) >= -1e-5 * np.linalg.norm(flat(ref)) ** 2
      # Two dots in a chain (the projection's, then this one): zero up to their rounding.
      norms = np.linalg.norm(flat(g)) * np.linalg.norm(flat(ref)) + np.linalg.norm(flat(ref)) ** 2
      assert_close(flat(projected) @ flat(ref), 0.0, rtol=reduction_rtol(2 * 17), scale=norms)


def test_ewc_pp_fisher_is_the_running_average_of_squared_gradients():
  alpha, every = 0.9, 2
  ctx = context("ewc_pp", trainable="head", fisher_every=every, alpha=alpha, reg_lambda=5.0,
                learning_rate=1e-2)
  method = ewc_pp.build(ctx)
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  apply = common.make_apply(ctx.model)
  fisher = jax.tree.map(jnp.zeros_like, state["params"])
  acc = jax.tree.map(jnp.zeros_like, fisher)

  @jax.jit
  def ce_grad(params, frozen, b):
    return jax.grad(lambda p: common.masked_mean(common.per_example_ce(
        apply(frozen, p, b["images"]), b["labels"]), b["mask"]))(params)

  for t in range(5):
    b = batch(t)
    g = ce_grad(state["params"], state["frozen"], b)
    acc = jax.tree.map(lambda a, x: a + x ** 2, acc, g)
    state, _, _ = step(state, b)
    if (t + 1) % every == 0:  # by hand: F = alpha * mean g^2 over the period + (1 - alpha) F
      fisher = jax.tree.map(lambda f, a: alpha * a / every + (1 - alpha) * f, fisher, acc)
      acc = jax.tree.map(jnp.zeros_like, acc)
      jax.tree.map(np.testing.assert_array_equal, state["anchor"], state["params"])
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-5), state["fisher"], fisher)
  assert float(sum(jnp.sum(f) for f in jax.tree.leaves(fisher))) > 0


def test_ewc_pp_consolidates_at_boundaries_with_the_window_counted_from_them():
  """consolidate='boundary', fisher_window='task', fisher_of='loss' (the online-continual-learning
  code's steps): the running Fisher updates at the top of every step i since the last boundary
  with (i + 1) % every == 0 from the squared gradients of the whole loss accumulated since the
  previous update (kept across a boundary); the anchor and the penalty's normalised Fisher move
  only when the boundary switch calls `at_boundary`, which restarts the count."""
  alpha, every, reg_lambda = 0.9, 3, 50.0
  ctx = context("ewc_pp", trainable="head", fisher_every=every, alpha=alpha,
                reg_lambda=reg_lambda, learning_rate=1e-2, consolidate="boundary",
                fisher_of="loss", fisher_window="task")
  method = ewc_pp.build(ctx)
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  apply = common.make_apply(ctx.model)

  @jax.jit
  def loss_grad(params, frozen, anchor, weight, b):
    def loss(p):
      ce = common.masked_mean(common.per_example_ce(apply(frozen, p, b["images"]), b["labels"]),
                              b["mask"])
      return ce + ewc_pp.penalty_and_grad(p, anchor, weight, reg_lambda, "none")[0]
    return jax.grad(loss)(params)

  fisher = jax.tree.map(jnp.zeros_like, state["params"])
  acc, weight = jax.tree.map(jnp.zeros_like, fisher), jax.tree.map(jnp.zeros_like, fisher)
  anchor, i, penalties = state["params"], 0, []
  for t in range(10):
    if t == 4:  # a boundary after 4 steps: the anchor and the normalised Fisher move
      state, _ = method.at_boundary(state, {})
      anchor, weight, i = state["params"], ewc_pp.normalise(fisher, "min_max"), 0
      jax.tree.map(np.testing.assert_array_equal, state["anchor"], state["params"])
    if (i + 1) % every == 0:  # by hand, at the top of step i
      fisher = jax.tree.map(lambda f, a: alpha * a / every + (1 - alpha) * f, fisher, acc)
      acc = jax.tree.map(jnp.zeros_like, acc)
    g = loss_grad(state["params"], state["frozen"], anchor, weight, batch(t))
    acc = jax.tree.map(lambda a, x: a + x ** 2, acc, g)
    state, scalars, _ = step(state, batch(t))
    penalties.append(float(scalars["ewc_penalty"]))
    i += 1
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-5), state["fisher"], fisher)
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-5), state["penalty_fisher"], weight)
    jax.tree.map(np.testing.assert_array_equal, state["anchor"], anchor)
  # No penalty before the boundary, nor at its first step (at the anchor); one after.
  assert penalties[:5] == [0.0] * 5 and min(penalties[5:]) > 0


def test_ewc_pp_penalty_uses_the_min_max_normalised_fisher():
  # A constructed problem: two leaves, Fisher entries from 0.01 to 0.05 (min 0.01, max 0.05).
  fisher = {"a": jnp.array([0.01, 0.03]), "b": jnp.array([[0.05, 0.02]])}
  params = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[0.5, -1.0]])}
  anchor = {"a": jnp.array([0.0, 1.0]), "b": jnp.array([[0.0, 0.0]])}
  # By hand: F~ = (F - 0.01) / 0.04 = [0, 0.5], [[1, 0.25]]; diffs [1, 1], [[0.5, -1]];
  # lambda * sum F~ d^2 = 100 * (0 + 0.5 + 0.25 + 0.25) = 100.
  penalty, grads = ewc_pp.penalty_and_grad(params, anchor, fisher, 100.0, "min_max")
  assert_close(float(penalty), 100.0, rtol=1e-6)
  assert_close(np.asarray(grads["b"]), np.array([[100.0, -50.0]]), rtol=1e-6)  # 2 lambda F~ d
  raw, _ = ewc_pp.penalty_and_grad(params, anchor, fisher, 100.0, "none")
  assert_close(float(raw), 100.0 * (0.01 + 0.03 + 0.05 * 0.25 + 0.02), rtol=1e-6)
  # In a train step the penalty (anchor and Fisher set at step 3) changes step 5's update.
  def run(reg_lambda, mode="min_max"):
    method = ewc_pp.build(context("ewc_pp", trainable="head", fisher_every=3, learning_rate=1e-2,
                                  reg_lambda=reg_lambda, fisher_normalisation=mode))
    step = jax.jit(method.train_step)
    state = method.init(jax.random.key(0), init_params())
    for t in range(5):
      state, scalars, _ = step(state, batch(t))
    return state, scalars

  state, scalars = run(100.0)
  free, free_scalars = run(0.0)
  assert float(scalars["ewc_penalty"]) > 0 and float(free_scalars["ewc_penalty"]) == 0
  change = lambda s: np.abs(np.asarray(s["params"]["head"]["kernel"]) -  # noqa: E731
                            np.asarray(s["anchor"]["head"]["kernel"])).sum()
  assert change(state) < 0.95 * change(free)  # pulled back towards the anchor
  raw, _ = run(100.0, "none")
  assert change(state) < change(raw) < change(free)  # the raw Fisher at lambda 100 acts less


def test_mir_retrieves_the_candidates_whose_loss_rises_most():
  ctx = context("mir", trainable="head")
  apply = common.make_apply(ctx.model)
  params, frozen = common.split_trainable(init_params(), "head", jax.random.key(0), SPEC, 2)
  b, cand = batch(1), batch(2, n=8, valid=7)
  lr = 0.5  # a large virtual step so the rises differ clearly
  rise = np.asarray(jax.jit(mir.interference, static_argnums=(0,))(apply, params, frozen, b,
                                                                    cand, lr))
  ce = jax.jit(lambda p, x, y: common.per_example_ce(apply(frozen, p, x), y))
  # The loop: one candidate at a time, the virtual step taken by hand.
  grads = jax.grad(lambda p: common.masked_mean(
      common.per_example_ce(apply(frozen, p, b["images"]), b["labels"]), b["mask"]))(params)
  virtual = jax.tree.map(lambda p, g: p - lr * g, params, grads)
  expected, losses = [], []
  for i in range(7):
    x, y = cand["images"][i:i + 1], cand["labels"][i:i + 1]
    after, before = ce(virtual, x, y)[0], ce(params, x, y)[0]
    expected.append(float(after - before))
    losses.append(float(before))
  # A rise is a difference of two losses: its rounding is the losses' (the atol's scale).
  assert_close(rise[:7], expected, rtol=1e-4, scale=max(losses))
  assert rise[7] == -np.inf  # the padded candidate is never retrieved
  _, top = jax.lax.top_k(jnp.asarray(rise), 3)
  assert sorted(np.asarray(top).tolist()) == sorted(np.argsort(expected)[-3:].tolist())


def test_der_pp_stores_insertion_logits_and_distils_towards_them():
  ctx = context("der_pp", trainable="head", buffer_size=8, replay_batch=8, learning_rate=0.05)
  method = REGISTRY["der_pp"](ctx)
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  b1 = batch(1)
  logits_at_insertion = method.predict(state, b1["images"])
  state, _, _ = step(state, b1)  # the empty buffer takes all 8 samples with these logits
  buf = state["buffer"]
  assert bool(jnp.all(buf.valid))
  order = np.asarray(buf.labels)  # slot i holds batch item i while the buffer fills
  np.testing.assert_array_equal(order, b1["labels"])
  assert_close(buf.logits, logits_at_insertion, rtol=1e-5)  # same logits, another program
  # The model has moved: the stored logits are not today's logits.
  now = method.predict(state, replay.decode(buf.images, "unit"))
  assert float(jnp.max(jnp.abs(now - buf.logits))) > 1e-3
  # A known target: the logit term of the next step is the MSE to what is stored.
  target = jnp.asarray(np.random.default_rng(0).normal(size=buf.logits.shape), jnp.float32)
  state["buffer"] = buf.replace(logits=target)
  expected = float(jnp.mean(jnp.square(now - target)))  # all 8 slots are replayed
  _, scalars, _ = step(state, batch(2, valid=0))  # no real item: only the replay terms
  assert_close(scalars["logit_mse"], expected, rtol=1e-5)


def _np_log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _np_proxy_supcon(features, proxies, labels, temperature):
  """The PCR authors' loss, transcribed: supervised contrastive loss in 'proxy' mode. Anchors are
  the normalised features, contrasts the normalised proxy of each sample's label (one per
  sample), positives the samples of the anchor's class; no self-contrast masking."""
  anchor = features / (np.linalg.norm(features, axis=1, keepdims=True) + 1e-6)
  contrast = proxies / (np.linalg.norm(proxies, axis=1, keepdims=True) + 1e-6)
  logits = anchor @ contrast.T / temperature
  logits = logits - logits.max(axis=1, keepdims=True)
  positives = (labels[:, None] == labels[None, :]).astype(np.float64)
  log_prob = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  return float(np.mean(-(positives * log_prob).sum(axis=1) / positives.sum(axis=1)))


def test_pcr_loss_against_numpy():
  rng = np.random.default_rng(0)
  features, kernel = rng.normal(size=(7, 5)), rng.normal(size=(5, C))
  labels = np.array([0, 2, 2, 0, 1, 2, 3])
  mask = np.array([True] * 6 + [False])  # class 3 only on a padded item
  temperature = 0.09
  logits = pcr.cosine_logits(jnp.asarray(features, jnp.float32),
                             {"kernel": jnp.asarray(kernel, jnp.float32)}, temperature)
  f = features / np.linalg.norm(features, axis=1, keepdims=True)
  w = kernel / np.linalg.norm(kernel, axis=0, keepdims=True)
  assert_close(logits, f @ w / temperature, rtol=1e-5)  # cosines near 0: max|logit| scales
  loss = float(pcr.proxy_contrastive_loss(logits, jnp.asarray(labels), jnp.asarray(mask)))
  # The authors' formula on the valid items: class 2 three times, class 0 twice, class 1 once.
  expected = _np_proxy_supcon(features[:6], kernel.T[labels[:6]], labels[:6], temperature)
  assert_close(loss, expected, rtol=1e-4)
  # Not the one-proxy-per-class softmax (each class present counted once).
  present = [0, 1, 2]
  once = np.mean([-_np_log_softmax((f[i] @ w / temperature)[present])[present.index(labels[i])]
                  for i in range(6)])
  assert abs(loss - once) > 1e-2 * abs(once)


def test_pcr_gradient_is_finite_with_a_zero_feature_row():
  # A random Swin maps a padded all-zero image to exactly zero features: the masked row must
  # score 0 and leave the gradient what it is without the row (not 0 * NaN).
  rng = np.random.default_rng(1)
  features = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32).at[4].set(0.0)
  kernel = jnp.asarray(rng.normal(size=(6, C)), jnp.float32)
  labels, mask = jnp.array([0, 1, 2, 1, 3]), jnp.array([True] * 4 + [False])

  def loss(f, k, n):
    return pcr.proxy_contrastive_loss(pcr.cosine_logits(f, {"kernel": k}, 0.09), labels[:n],
                                      mask[:n])

  assert np.all(np.asarray(pcr.cosine_logits(features, {"kernel": kernel}, 0.09)[4]) == 0)
  grads = jax.grad(loss, argnums=(0, 1))(features, kernel, 5)
  without = jax.grad(loss, argnums=(0, 1))(features[:4], kernel, 4)
  assert np.all(np.asarray(grads[0][4]) == 0)
  assert_close(grads[0][:4], without[0], rtol=1e-5)
  assert_close(grads[1], without[1], rtol=1e-5)


def test_pcr_replays_only_after_the_warmup():
  ctx = context("pcr", trainable="head", buffer_size=16, replay_batch=4, warmup_batches=2)
  method = REGISTRY["pcr"](ctx)
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  replayed = []
  for t in range(4):
    state, scalars, _ = step(state, batch(t))
    replayed.append(int(scalars["replayed"]))
  assert replayed == [0, 0, 4, 4]


@pytest.mark.parametrize("name", ["der_pp", "lode", "ema_der_pp"])
@pytest.mark.parametrize("n", [4, 8])
def test_replay_batch_follows_the_learners_batch(name, n):
  # replay_batch = 0 (the default of these three): each replay draw has the learner's batch size,
  # so the step's one forward pass sees n current + 2 n replayed images.
  ctx = dataclasses.replace(context(name, trainable="head", buffer_size=16), batch_size=n)
  assert ctx.config[name].replay_batch == common.AS_LEARNER_BATCH
  assert common.replay_batch(ctx, ctx.config[name]) == n
  method = REGISTRY[name](ctx)
  state = method.init(jax.random.key(0), init_params())
  jaxpr = str(jax.make_jaxpr(method.train_step)(state, batch(0, n=n)))
  assert f"f32[{3 * n},16,16,3]" in jaxpr and f"f32[{n + 2 * 10},16,16,3]" not in jaxpr
  # A set value is used as is; PCR (10 by default, its codebase's eps_mem_batch) replays that many.
  pcr_ctx = context("pcr", trainable="head", buffer_size=16, warmup_batches=0)
  assert common.replay_batch(pcr_ctx, pcr_ctx.config.pcr) == 10
  ctx0 = dataclasses.replace(context("pcr", trainable="head", buffer_size=16, warmup_batches=0,
                                     replay_batch=0), batch_size=n)
  pcr_method = REGISTRY["pcr"](ctx0)
  step = jax.jit(pcr_method.train_step)
  state = pcr_method.init(jax.random.key(0), init_params())
  replayed = []
  for t in range(2):
    state, scalars, _ = step(state, batch(t, n=n))
    replayed.append(int(scalars["replayed"]))
  assert replayed == [0, n]


def test_lode_loss_against_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(5, 6)).astype(np.float32)
  labels = np.array([3, 4, 3, 4, 0])
  mask = np.array([True, True, True, True, False])  # the padded item's class 0 is not new
  seen = np.array([True, True, False, True, False, False])  # 0, 1 seen before; 3 again now
  c, rho = 1.5, 0.1
  loss, terms = lode.decoupled_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask),
                                    jnp.asarray(seen), c, rho)
  new, old = [3, 4], [0, 1]  # old: seen before and absent from this batch
  lse = lambda x: np.log(np.exp(x).sum())  # noqa: E731
  intra = np.mean([-_np_log_softmax(logits[i, new])[new.index(labels[i])] for i in range(4)])
  inter = np.mean([-(lse(logits[i, new]) - np.logaddexp(lse(logits[i, new]),
                                                        lse(logits[i, old]))) for i in range(4)])
  expected = c * intra + rho * len(new) / len(old) * inter
  assert_close(loss, expected, rtol=1e-5)
  assert_close(terms["lode_inter"], inter, rtol=1e-5)
  assert int(terms["old_classes"]) == 2
  # No old class yet (the stream's first classes): plain CE over all classes.
  first, _ = lode.decoupled_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask),
                                 jnp.zeros(6, bool), c, rho)
  ce = np.mean([-_np_log_softmax(logits[i])[labels[i]] for i in range(4)])
  assert_close(first, ce, rtol=1e-5)


def test_lode_learns_the_seen_classes_from_the_stream():
  method = REGISTRY["lode"](context("lode", trainable="head", buffer_size=8, replay_batch=4))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  state, scalars, _ = step(state, batch(0, labels=[0, 1] * 4))
  assert int(scalars["old_classes"]) == 0
  state, scalars, _ = step(state, batch(1, labels=[2, 3] * 4, valid=6))
  assert int(scalars["old_classes"]) == 2
  np.testing.assert_array_equal(state["class_seen"], [True] * 4)


def test_ema_weights_are_the_hand_computed_average():
  name = "ema_der_pp"  # the wrapper is shared with ema_rar (its rehearsals: the test below)
  warmup, warm_decay, decay = 2, 0.5, 0.9
  method = REGISTRY[name](context(name, trainable="head", buffer_size=8, replay_batch=4,
                                  learning_rate=0.05, ema_warmup_steps=warmup,
                                  ema_warmup_decay=warm_decay, ema_decay=decay))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  expected = jax.tree.map(np.array, state["params"])
  for t in range(4):
    state, _, _ = step(state, batch(t))
    lam = warm_decay if t + 1 <= warmup else decay
    expected = jax.tree.map(lambda e, p, lam=lam: lam * e + (1 - lam) * np.asarray(p), expected,
                            state["params"])
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-6), state["ema_params"], expected)
  # The evaluator reads the average, not the trained weights.
  images, predict = batch(9)["images"], jax.jit(method.predict)
  averaged = predict({**state, "params": state["ema_params"]}, images)
  np.testing.assert_array_equal(predict(state, images), averaged)
  assert not np.allclose(averaged, predict({**state, "ema_params": state["params"]}, images))


def test_ema_rar_moves_the_average_after_each_rehearsal():
  """EMA (RAR): the average moves after every rehearsal of a batch (the EMA authors' code moves
  it after every training iteration, and RAR's passes are iterations), each with the lambda of
  the batch's step. Rehearsal r draws with the step's key folded with r, so a run of r + 1
  repeats from the same state ends at the weights rehearsal r of the 3-repeat run reached."""
  name, repeats = "ema_rar", 3
  warmup, warm_decay, decay = 1, 0.5, 0.9
  keys = dict(trainable="head", buffer_size=8, replay_batch=4, learning_rate=0.05,
              ema_warmup_steps=warmup, ema_warmup_decay=warm_decay, ema_decay=decay)
  steps = {r: jax.jit(REGISTRY[name](context(name, repeats=r, **keys)).train_step)
           for r in range(1, repeats + 1)}
  method = REGISTRY[name](context(name, repeats=repeats, **keys))
  state = method.init(jax.random.key(0), init_params())
  expected = jax.tree.map(np.array, state["params"])
  for t in range(3):
    lam = warm_decay if t + 1 <= warmup else decay
    for r in range(1, repeats + 1):  # the weights after each rehearsal of batch t
      weights = steps[r](state, batch(t))[0]["params"]
      expected = jax.tree.map(lambda e, p, lam=lam: lam * e + (1 - lam) * np.asarray(p),
                              expected, weights)
    state, _, _ = steps[repeats](state, batch(t))
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-5), state["ema_params"], expected)
  assert int(state["step"]) == 3  # RAR's repeats count as one step per batch


def test_ema_rar_augment_off_trains_on_the_images_as_given():
  """`augment=False` (the parity check's: their --use_transforms off): a rehearsal trains on the
  batch as given, so the step no longer depends on the run's key (the first batch: an empty
  buffer, nothing replayed); with the default it does (each rehearsal shifts and flips). Each
  rehearsal's loss is logged, the last as `loss`."""
  name = "ema_rar"
  keys = dict(trainable="head", buffer_size=8, replay_batch=4, learning_rate=0.05, repeats=2)
  for augment in (False, True):
    method = REGISTRY[name](context(name, augment=augment, **keys))
    step = jax.jit(method.train_step)
    state = method.init(jax.random.key(0), init_params())
    (a, scalars, _), (b, _, _) = (step({**state, "key": jax.random.key(k)}, batch(0))
                                  for k in (1, 2))
    same = jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a["params"],
                                        b["params"]))
    assert all(same) == (not augment), augment
    assert float(scalars["loss"]) == float(scalars["loss_rehearsal1"])
    assert float(scalars["loss_rehearsal0"]) != float(scalars["loss_rehearsal1"])


def test_rar_augment_flips_and_shifts_within_the_image():
  images = jnp.asarray(np.random.default_rng(0).random((32, 16, 16, 3)), jnp.float32)
  out = np.asarray(rar.augment(jax.random.key(0), images))
  assert out.shape == images.shape
  pad, x = 2, np.asarray(images)
  for i in range(32):  # each output is one of the flipped/unflipped edge-padded shifts
    found = False
    for im in (x[i], x[i, :, ::-1]):
      padded = np.pad(im, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
      found |= any(np.array_equal(out[i], padded[dy:dy + 16, dx:dx + 16])
                   for dy in range(2 * pad + 1) for dx in range(2 * pad + 1))
    assert found
  assert sum(not np.array_equal(out[i], x[i]) for i in range(32)) > 16
  # flip=False (digits): shifts only.
  unflipped = np.asarray(rar.augment(jax.random.key(0), images, flip=False))
  for i in range(32):
    padded = np.pad(x[i], ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    assert any(np.array_equal(unflipped[i], padded[dy:dy + 16, dx:dx + 16])
               for dy in range(2 * pad + 1) for dx in range(2 * pad + 1))


# --------------------------------------------------------------------------------------------
# What each method trains; config checks; the i.i.d. order.


@pytest.mark.parametrize("mode, moved", [("all", {"head", "embedding"}), ("head", {"head"}),
                                         ("lora", {"head", "lora"})])
def test_trainable_split(mode, moved):
  method = REGISTRY["finetune"](context("finetune", trainable=mode, learning_rate=1e-2))
  state = method.init(jax.random.key(0), init_params())
  before = jax.tree.map(np.array, {**state["frozen"], **state["params"]})
  state, _, _ = jax.jit(method.train_step)(state, batch(0))
  after = {**state["frozen"], **state["params"]}
  changed = {k for k in after if any(
      not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[k]),
                                               jax.tree.leaves(after[k]), strict=True))}
  assert moved <= changed
  if mode != "all":
    assert changed == moved  # the frozen backbone is bit-identical


@pytest.mark.parametrize("key, value, match", [
    ("method", "ewc", r"unknown method='ewc'"),
    ("er.replay_batch", 600, r"er.replay_batch=600 must be in \[1, er.buffer_size=500\]"),
    ("mir.n_candidates", 5, r"mir.n_candidates=5 must be in"),
    ("agem.trainable", "backbone", r"unknown agem.trainable='backbone'"),
    ("ewc_pp.alpha", 1.5, r"ewc_pp.alpha=1.5 must be in \[0, 1.0\]"),
    ("ewc_pp.fisher_normalisation", "max", r"unknown ewc_pp.fisher_normalisation='max'"),
    ("ewc_pp.consolidate", "task", r"unknown ewc_pp.consolidate='task'"),
    ("ewc_pp.fisher_of", "grad", r"unknown ewc_pp.fisher_of='grad'"),
    ("ewc_pp.fisher_window", "batch", r"unknown ewc_pp.fisher_window='batch'"),
    ("gdumb.min_learning_rate", 1e-2, r"gdumb.min_learning_rate=0.01 must be in"),
    ("l2p.trainable", "all", r"l2p.trainable='all': 'prompts' .* use prompts$"),
    ("er.trainable", "prompts", r"er.trainable='prompts': .* use all, head or lora$"),
    ("l2p.top_k", 11, r"l2p.top_k=11 must be in \[1, l2p.pool_size\]"),
    ("mvp.top_k", 10, r"mvp.top_k=10 must be in \[1, mvp.pool_size - 1\]"),
    ("mvp.margin", 0.0, r"mvp.margin=0.0 must be > 0"),
    ("mvp.alpha", 1.5, r"mvp.alpha=1.5 must be in \[0, 1.0\]"),
    ("mvp.key_init", "zeros", r"unknown mvp.key_init='zeros'"),
    ("mvp.updates_per_batch", 0, r"mvp.updates_per_batch=0 must be an integer >= 1"),
    ("mvp.query", "cls", r"unknown mvp.query='cls'; use 'penultimate' .*"),
    ("mvp.query", "penultimate", r"mvp.query='penultimate' .* needs model.depth >= 2; use"
                                 r" 'last' on a one-block model"),
    ("iid.schedule", "step", r"unknown iid.schedule='step'"),
    ("pcr.temperature", 0.0, r"pcr.temperature=0.0 must be > 0"),
    ("lode.rho", -0.1, r"lode.rho=-0.1 must be >= 0"),
    ("ema_der_pp.ema_decay", 1.0, r"ema_der_pp.ema_decay=1.0 must be in \[0, 1\)"),
    ("ema_rar.repeats", 0, r"ema_rar.repeats=0 must be >= 1"),
])
def test_bad_method_config_is_refused(key, value, match):
  config = tiny.get_config()
  config.mvp.query = "last"  # the tiny ViT has one block: none before the last
  section, _, leaf = key.rpartition(".")
  if section:  # a value in the block of the method that runs
    config.method = section
  setattr(config[section] if section else config, leaf, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config)


def test_iid_order_keeps_the_samples_and_the_task_end_points():
  labels = np.repeat(np.arange(6), 20)
  stream = streams.disjoint_class_incremental(labels, 3, 16, seed=0)
  iid = streams.iid_order(stream, 16, seed=0)
  assert sorted(np.concatenate(iid.steps).tolist()) == list(range(120))
  assert [len(s) for s in iid.steps[:-1]] == [16] * (len(iid.steps) - 1)
  sizes = np.cumsum([len(s) for s in iid.steps])
  # A task ends at the last step whose final sample lies in its share (positions < 40, 80, 120).
  assert sizes[iid.task_end_steps()].tolist() == [32, 80, 120]
  first_task = np.concatenate(iid.steps[:2])
  assert len(set(labels[first_task].tolist())) > 2  # classes of every task are mixed in
  # Three epochs: each a fresh shuffle of every sample, the first the one-epoch order; the task
  # ends at the same fractions of the 360 samples (positions < 120, 240, 360).
  three = streams.iid_order(stream, 16, seed=0, epochs=3)
  ids = np.concatenate(three.steps)
  assert len(ids) == 360 and np.array_equal(ids[:120], np.concatenate(iid.steps))
  assert all(sorted(ids[e * 120:(e + 1) * 120].tolist()) == list(range(120)) for e in range(3))
  assert not np.array_equal(ids[120:240], ids[:120])
  sizes = np.cumsum([len(s) for s in three.steps])
  assert sizes[three.task_end_steps()].tolist() == [112, 240, 360]


# --------------------------------------------------------------------------------------------
# Prompt methods.


def test_l2p_selects_prompts_from_the_image_alone():
  """The selection is a function of each image: other labels, another batch order or the image
  on its own select the same prompts; and it does depend on the image."""
  ctx = context("l2p", pool_size=6, prompt_length=2, top_k=2)
  method = REGISTRY["l2p"](ctx)
  state = method.init(jax.random.key(0), init_params())
  step = jax.jit(method.train_step)
  b = batch(0)
  trained, _, extras = step(state, b)
  idx = np.asarray(extras["prompt_idx"])
  for part in ("keys", "prompts"):  # trained: the pool and the head; the backbone stays frozen
    assert not np.array_equal(trained["params"]["prompt_pool"][part],
                              state["params"]["prompt_pool"][part])
  assert not np.array_equal(trained["params"]["head"]["kernel"], state["params"]["head"]["kernel"])
  assert all(np.array_equal(x, y) for x, y in zip(
      jax.tree.leaves(trained["frozen"]), jax.tree.leaves(state["frozen"]), strict=True))
  assert idx.shape == (8, 2) and len({tuple(row) for row in idx}) > 1
  relabelled = {**b, "labels": (b["labels"] + 1) % C}
  np.testing.assert_array_equal(step(state, relabelled)[2]["prompt_idx"], idx)
  order = np.random.default_rng(1).permutation(8)
  shuffled = {k: v[order] for k, v in b.items()}
  np.testing.assert_array_equal(step(state, shuffled)[2]["prompt_idx"], idx[order])
  apply = common.make_apply(ctx.model)

  @jax.jit
  def select_alone(image):  # one image as a batch of its own
    query = prompt_pool.query(apply, state["frozen"], image[None])
    return prompt_pool.select(
        prompt_pool.key_distance(query, state["params"]["prompt_pool"]["keys"]), 2)[0]

  for i in range(8):
    np.testing.assert_array_equal(select_alone(b["images"][i]), idx[i])
  with pytest.raises(ValueError, match="task-free"):
    method.train_step(state, {**b, "task_id": np.zeros(8, np.int32)})


def _cosine(a, b):
  return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _ce(logits, labels):
  logits = logits - logits.max(-1, keepdims=True)
  return np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(labels)), labels]


def test_mvp_mask_and_losses_against_numpy():
  """On a hand-made batch (3 valid images + 1 padded, D=3, C=4, pool of 3, 2 keys each): the
  instance mask, the focal/scaled loss with gradients taken by finite differences in float64,
  and the contrastive key loss, all from the definitions in docs/methods/mvp.md."""
  f = np.array([[1.0, 0.5, -0.2], [-0.3, 0.8, 0.4], [0.2, -0.6, 0.9], [5.0, 5.0, 5.0]])
  kernel = np.array([[0.4, -0.2, 0.1, 0.3], [-0.5, 0.6, 0.2, -0.1], [0.3, 0.1, -0.4, 0.5]])
  bias = np.array([0.1, -0.2, 0.05, 0.0])
  labels, valid = np.array([0, 2, 2, 1]), np.array([True, True, True, False])
  masks = np.array([[-1.0, 0.5, 2.0, -0.3], [0.8, -1.5, 0.1, 1.2], [0.0, 0.3, -0.7, -2.0]])
  idx = np.array([[0, 2], [1, 0], [2, 1], [1, 2]])
  keys = np.array([[0.9, 0.1, -0.3], [-0.2, 0.7, 0.5], [0.4, -0.8, 0.2]])
  queries = np.array([[1.0, 0.2, -0.1], [0.1, 1.0, 0.3], [0.3, -0.5, 0.6], [1.0, 1.0, 1.0]])
  weight = np.array([1.0, 4.0, 2.0])
  gamma, margin, alpha = 2.0, 0.5, 0.5

  mask = 2.0 / (1.0 + np.exp(-masks[idx].mean(1)))
  assert_close(mvp.instance_mask(jnp.asarray(masks, jnp.float32), idx), mask)

  def sample_ce(w):  # CE of each image with head kernel w, on the masked logits
    return _ce((f @ w + bias) * mask, labels)

  def grad_column(fn, b):  # d fn / d kernel[:, labels[b]], central differences
    out = np.zeros(3)
    for d in range(3):
      step = np.zeros_like(kernel)
      step[d, labels[b]] = 1e-6
      out[d] = (fn(kernel + step) - fn(kernel - step)) / 2e-6
    return out

  dissimilarity = np.array([
      1.0 - _cosine(grad_column(lambda w, b=b: sample_ce(w)[b], b),
                    grad_column(lambda w: sample_ce(w)[valid].mean(), b)) for b in range(4)])
  scale = 1.0 - _cosine(kernel.T[labels], f) + margin
  ce = _ce(((f / scale[:, None]) @ kernel + bias) * mask, labels)
  expected = np.sum((ce * ((1 - alpha) + alpha * dissimilarity ** gamma))[valid]) / 3
  head = {"kernel": jnp.asarray(kernel, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)}
  loss, terms = mvp.focal_scaled_loss(jnp.asarray(f, jnp.float32), head,
                                      jnp.asarray(mask, jnp.float32), labels, valid, gamma,
                                      margin, alpha)
  assert_close(loss, expected, rtol=1e-4)
  assert_close(terms["grad_dissimilarity"], dissimilarity[valid].mean(), rtol=1e-4)

  distance = 1.0 - _cosine(queries[:, None], keys[None])
  key_distance = 1.0 - _cosine(keys[:, None], keys[None])
  per_key = np.zeros((4, 2))
  for b in range(4):
    for n, s in enumerate(idx[b]):
      others = np.mean([np.exp(key_distance[s, j] / weight[s]) for j in range(3) if j != s])
      per_key[b, n] = -np.log(others / (others + np.exp(distance[b, s] / weight[s])))
  key_loss = mvp.contrastive_key_loss(jnp.asarray(distance, jnp.float32),
                                      jnp.asarray(weight, jnp.float32), idx,
                                      jnp.asarray(keys, jnp.float32), valid)
  assert_close(key_loss, per_key.mean(1)[valid].mean())


def test_mvp_authors_readings_as_keys():
  """Readings of MVP's code, each a key: keys drawn standard normal, the query read before the
  final LayerNorm ('last'; the LayerNorm of it is 'last_norm', L2P's query), and several updates
  on one batch (equal to that many single updates, counted as one stream step). The default
  query, after the block before the last, needs two blocks: tests/test_prompt_methods.py."""
  params = init_params()
  uniform = mvp.build(context("mvp", pool_size=40)).init(jax.random.key(0), params)
  normal = mvp.build(context("mvp", pool_size=40, key_init="normal")).init(
      jax.random.key(0), params)
  keys = np.asarray(normal["params"]["prompt_pool"]["keys"])
  assert np.abs(np.asarray(uniform["params"]["prompt_pool"]["keys"])).max() <= 1.0
  assert 0.8 < keys.std() < 1.2 and np.abs(keys).max() > 1.5  # 640 N(0, 1) draws

  apply = common.make_apply(VisionTransformer(SPEC, C))
  images = jnp.asarray(batch(1)["images"])
  after = np.asarray(prompt_pool.query(apply, params, images), np.float64)
  before = np.asarray(prompt_pool.query(apply, params, images, "last"), np.float64)
  norm = params["encoder_norm"]
  centred = before - before.mean(-1, keepdims=True)
  normalised = centred / np.sqrt(np.mean(centred ** 2, -1, keepdims=True) + 1e-6)
  assert_close(normalised * np.asarray(norm["scale"]) + np.asarray(norm["bias"]), after,
               rtol=1e-4)
  assert not np.allclose(before, after)

  once = mvp.build(context("mvp", query="last"))
  twice = mvp.build(context("mvp", query="last", updates_per_batch=2))
  state = once.init(jax.random.key(0), params)
  data = batch(2)
  stepped, _, _ = jax.jit(once.train_step)(jax.tree.map(jnp.array, state), data)
  stepped, _, _ = jax.jit(once.train_step)(stepped, data)
  both, scalars, report = jax.jit(twice.train_step)(jax.tree.map(jnp.array, state), data)
  assert int(both["step"]) == int(state["step"]) + 1 and int(stepped["step"]) == 2
  for a, b in zip(jax.tree.leaves(both["params"]), jax.tree.leaves(stepped["params"]),
                  strict=True):
    assert_close(a, b, rtol=1e-5)
  np.testing.assert_array_equal(both["selection_count"], stepped["selection_count"])


def test_iid_cosine_schedule_spans_the_iid_orders_steps():
  """iid.schedule='cosine' decays from the learning rate to 0 over exactly the steps iid_order
  makes of the stream (epochs x samples / batch, rounded up); 'constant' is the rate itself."""
  labels = np.repeat(np.arange(4), 25)  # 100 samples
  stream = streams.disjoint_class_incremental(labels, 2, 8, seed=0)
  steps = len(streams.iid_order(stream, 8, seed=0, epochs=3).steps)
  ctx = dataclasses.replace(context("iid", epochs=3, schedule="cosine", learning_rate=1e-3),
                            stream_samples=stream.n_samples)
  rate = finetune.iid_learning_rate(ctx, ctx.config.iid)
  assert steps == 38 and float(rate(0)) == pytest.approx(1e-3, rel=1e-6)
  assert float(rate(steps // 2)) == pytest.approx(5e-4, rel=0.05)
  assert float(rate(steps)) == pytest.approx(0.0, abs=1e-12) and float(rate(steps - 1)) > 0
  constant = context("iid", learning_rate=1e-3)
  assert finetune.iid_learning_rate(constant, constant.config.iid) == 1e-3


def test_overrides_of_blocks_the_method_does_not_read_are_named():
  keys = ["seed", "learner.rank", "er.buffer_size", "inflora.learning_rate", "iid.epochs"]
  assert methods.unread_overrides("er", keys) == ["inflora.learning_rate", "iid.epochs"]
  # Online-LoRA reads `learner`: every method block is another's.
  assert methods.unread_overrides("online_lora", keys) == ["er.buffer_size",
                                                           "inflora.learning_rate", "iid.epochs"]
  with pytest.raises(ValueError, match="unknown method"):
    methods.unread_overrides("nope", keys)


def test_der_pp_three_passes_compute_the_joint_pass_on_a_vit():
  # replay_pass='separate' (Mammoth's three forward passes) on a model without BatchNorm: the
  # same losses, parameters and stored logits as the default one joint pass, to float rounding.
  runs = {}
  for mode in ("joint", "separate"):
    ctx = context("der_pp", trainable="head", buffer_size=8, replay_batch=4, replay_pass=mode,
                  optimizer="sgd", learning_rate=0.1)
    method = REGISTRY["der_pp"](ctx)
    step = jax.jit(method.train_step)
    state = method.init(jax.random.key(0), init_params())
    losses = []
    for t in range(3):
      state, scalars, _ = step(state, batch(t))
      losses.append(float(scalars["loss"]))
    runs[mode] = (losses, state)
  (joint, a), (separate, b) = runs["joint"], runs["separate"]
  assert_close(separate, joint, rtol=1e-5)
  assert_close(b["buffer"].logits, a["buffer"].logits, rtol=1e-5)
  assert_close(b["params"]["head"]["kernel"], a["params"]["head"]["kernel"], rtol=1e-5)
