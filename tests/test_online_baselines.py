"""The online-continual-learning baselines of issue 51 against hand computations: ER-ACE's
asymmetric cross-entropy, LwF's distillation and teacher refresh, SCR's supervised contrastive
loss and nearest-class-mean rule, OnPro's prototype losses, each against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close
from test_methods import _np_log_softmax, batch, context, init_params

from configs import tiny
from olora_jax import validation
from olora_jax.methods import REGISTRY, er_ace, lwf, onpro, scr

# --------------------------------------------------------------------------------------------
# ER-ACE.


def test_er_ace_incoming_loss_against_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 6)).astype(np.float32)
  labels = np.array([3, 4, 3, 4, 0])
  mask = np.array([True, True, True, True, False])  # class 0 only on a padded item
  seen = np.array([True, True, False, True, False, False])  # 0, 1, 3 met before
  loss, seen_after = er_ace.asymmetric_ce(jnp.asarray(logits), jnp.asarray(labels),
                                          jnp.asarray(mask), jnp.asarray(seen))
  # In the softmax: the batch's classes 3, 4 and the never-seen 2, 5; out: 0 and 1 (seen before,
  # absent from the batch's valid items).
  kept = [2, 3, 4, 5]
  expected = np.mean([-_np_log_softmax(logits[i, kept])[kept.index(labels[i])] for i in range(4)])
  assert_close(float(loss), expected, rtol=1e-5)
  np.testing.assert_array_equal(seen_after, [True, True, False, True, True, False])
  # Not the full cross-entropy: the old classes' logits would be pushed down too.
  full = np.mean([-_np_log_softmax(logits[i])[labels[i]] for i in range(4)])
  assert abs(float(loss) - full) > 1e-2 * full


def test_er_ace_cosine_head_is_the_authors_dist_linear():
  """10 (x / (|x| + 1e-5)) . (w_c / (|w_c| + 1e-5)), no bias (their model.py distLinear); a zero
  feature row (padding) gives logits 0 and a finite gradient."""
  rng = np.random.default_rng(0)
  features = rng.normal(size=(3, 5)).astype(np.float32)
  features[2] = 0.0
  kernel = rng.normal(size=(5, 4)).astype(np.float32)
  logits = er_ace.common.cosine_logits(jnp.asarray(features), jnp.asarray(kernel),
                                       er_ace.COSINE_SCALE, er_ace.COSINE_EPS)
  x = features / (np.linalg.norm(features, axis=1, keepdims=True) + 1e-5)
  w = kernel / (np.linalg.norm(kernel, axis=0, keepdims=True) + 1e-5)
  assert_close(np.asarray(logits), 10 * x @ w, rtol=1e-5, scale=10.0)
  grad = jax.grad(lambda f: er_ace.common.cosine_logits(f, jnp.asarray(kernel), 10.0, 1e-5)
                  .sum())(jnp.asarray(features))
  assert np.isfinite(np.asarray(grad)).all()


def test_er_ace_step_replays_with_full_ce_and_tracks_the_classes_met():
  method = REGISTRY["er_ace"](context("er_ace", trainable="head", buffer_size=8, replay_batch=4))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  state, scalars, _ = step(state, batch(0, labels=[0, 1] * 4))
  assert float(scalars["ce_replay"]) == 0.0  # an empty buffer replays nothing
  np.testing.assert_array_equal(state["class_seen"], [True, True, False, False])
  head = state["params"]["head"]
  state, scalars, _ = step(state, batch(1, labels=[2, 3] * 4, valid=6))
  np.testing.assert_array_equal(state["class_seen"], [True] * 4)
  # The replayed samples (classes 0 and 1, all the buffer holds) carry the full CE: a nonzero
  # loss, and gradient reaching the old classes' head columns through them.
  assert float(scalars["ce_replay"]) > 0
  moved = np.abs(np.asarray(state["params"]["head"]["kernel"] - head["kernel"]))
  assert np.all(moved.max(axis=0) > 0)


# --------------------------------------------------------------------------------------------
# LwF.


def test_lwf_distillation_against_numpy():
  rng = np.random.default_rng(2)
  logits, teacher = rng.normal(size=(2, 5, 6)).astype(np.float32) * 3
  mask = np.array([True, True, True, False, True])
  kd = lwf.distillation(jnp.asarray(logits), jnp.asarray(teacher), jnp.asarray(mask), 2.0)
  target = np.exp(_np_log_softmax(teacher / 2.0))
  per_item = -(target * _np_log_softmax(logits / 2.0)).sum(axis=1)
  assert_close(float(kd), 4.0 * per_item[mask].mean(), rtol=1e-5)
  # The codebase's weighting by n refreshes, and the paper's lambda_o.
  ce, kd = jnp.float32(1.5), jnp.float32(0.5)
  for n, expected in ((0, 1.5), (1, 1.0), (3, 0.25 * 1.5 + 0.75 * 0.5)):
    assert_close(float(lwf.weighted_loss(ce, kd, jnp.int32(n), 0.0)), expected, rtol=1e-6)
  assert_close(float(lwf.weighted_loss(ce, kd, jnp.int32(0), 2.0)), 1.5, rtol=1e-6)
  assert_close(float(lwf.weighted_loss(ce, kd, jnp.int32(2), 2.0)), 2.5, rtol=1e-6)


def test_lwf_teacher_refreshes_every_period_and_at_a_boundary():
  method = REGISTRY["lwf"](context("lwf", trainable="head", learning_rate=1e-2, refresh_every=2))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  state, scalars, _ = step(state, batch(0))
  assert int(scalars["teacher_refreshes"]) == 0 and float(scalars["distillation"]) >= 0
  assert_close(float(scalars["loss"]), float(scalars["ce_current"]), rtol=1e-6)  # CE alone
  state, _, _ = step(state, batch(1))
  after_two = jax.tree.map(np.asarray, state["params"])
  assert bool(state["refresh_due"])  # the period's end: the next step takes the teacher
  state, scalars, _ = step(state, batch(2))
  assert int(scalars["teacher_refreshes"]) == 1
  jax.tree.map(np.testing.assert_array_equal, state["teacher"], after_two)
  assert_close(float(scalars["loss"]),
               0.5 * float(scalars["ce_current"]) + 0.5 * float(scalars["distillation"]),
               rtol=1e-6)
  # refresh_every 0: only the boundary switch refreshes, from the next step on.
  method = REGISTRY["lwf"](context("lwf", trainable="head", learning_rate=1e-2, refresh_every=0))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  for i in range(3):
    state, scalars, _ = step(state, batch(i))
  assert int(scalars["teacher_refreshes"]) == 0
  state, host = method.at_boundary(state, {})
  before = jax.tree.map(np.asarray, state["params"])
  state, scalars, _ = step(state, batch(3))
  assert int(scalars["teacher_refreshes"]) == 1 and not bool(state["refresh_due"])
  jax.tree.map(np.testing.assert_array_equal, state["teacher"], before)


@pytest.mark.parametrize("key, value, match", [
    ("er_ace.replay_batch", 30, r"er_ace.replay_batch=30 must be in \[1, er_ace.buffer_size=24\]"),
    ("lwf.refresh_every", -1, r"lwf.refresh_every=-1 must be an integer >= 0"),
    ("lwf.kd_weight", -0.5, r"lwf.kd_weight=-0.5 must be >= 0"),
    ("lwf.temperature", 0.0, r"lwf.temperature=0.0 must be > 0"),
    ("scr.temperature", -1.0, r"scr.temperature=-1.0 must be > 0"),
    ("onpro.mixup_p", 1.5, r"onpro.mixup_p=1.5 must be in \[0, 1\]"),
    ("onpro.proto_temperature", 0.0, r"onpro.proto_temperature=0.0 must be > 0"),
])
def test_bad_online_baseline_config_is_refused(key, value, match):
  config = tiny.get_config()
  section, _, leaf = key.rpartition(".")
  config.method = section
  config.er_ace.buffer_size = 24
  setattr(config[section], leaf, value)
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config)


# --------------------------------------------------------------------------------------------
# SCR.


def _np_supcon(z, labels, temperature):
  """Khosla et al.'s loss as the SCR authors compute it (every view an anchor, no self-contrast),
  transcribed: for each anchor the mean over its positives of the log-probability among all
  other items."""
  sim = z @ z.T / temperature
  m = len(labels)
  losses = []
  for i in range(m):
    others = [a for a in range(m) if a != i]
    log_norm = np.log(np.sum(np.exp(sim[i, others])))
    positives = [p for p in others if labels[p] == labels[i]]
    losses.append(-np.mean([sim[i, p] - log_norm for p in positives]))
  return float(np.mean(losses))


def test_scr_contrastive_loss_against_numpy():
  rng = np.random.default_rng(3)
  raw = rng.normal(size=(6, 5))
  z = raw / np.linalg.norm(raw, axis=1, keepdims=True)
  labels = np.array([0, 1, 0, 2, 2, 1])
  views = np.concatenate([z, np.roll(z, 1, axis=1)])  # two "views" of three classes
  view_labels = np.tile(labels, 2)
  loss = scr.supervised_contrastive_loss(jnp.asarray(views, jnp.float32),
                                         jnp.asarray(view_labels), jnp.ones(12, bool), 0.07)
  assert_close(float(loss), _np_supcon(views, view_labels, 0.07), rtol=1e-4)
  # A padded item is neither an anchor nor a contrast: as if it were not there.
  mask = np.ones(12, bool)
  mask[[5, 11]] = False
  masked = scr.supervised_contrastive_loss(jnp.asarray(views, jnp.float32),
                                           jnp.asarray(view_labels), jnp.asarray(mask), 0.07)
  assert_close(float(masked), _np_supcon(views[mask], view_labels[mask], 0.07), rtol=1e-4)


def test_scr_nearest_class_mean_against_numpy():
  rng = np.random.default_rng(4)
  stored, labels = rng.normal(size=(7, 5)), np.array([0, 0, 2, 2, 2, 1, 3])
  valid = np.array([True] * 6 + [False])  # class 3 only in an empty slot
  means, present = scr.class_means(jnp.asarray(stored, jnp.float32), jnp.asarray(labels),
                                   jnp.asarray(valid), 4)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  expected = np.stack([unit(unit(stored[(labels == c) & valid]).mean(0)) for c in range(3)])
  assert_close(np.asarray(means)[:3], expected, rtol=1e-5)
  np.testing.assert_array_equal(present, [True, True, True, False])
  queries = rng.normal(size=(4, 5))
  scores = np.asarray(scr.ncm_scores(jnp.asarray(queries, jnp.float32), means, present))
  distance = ((unit(queries)[:, None] - expected[None]) ** 2).sum(-1)
  assert_close(scores[:, :3], -distance, rtol=1e-5)
  assert np.all(scores[:, 3] < -1e8)  # absent from the buffer: never predicted


def test_scr_steps_only_with_a_memory_and_predicts_by_class_means():
  method = REGISTRY["scr"](context("scr", trainable="all", buffer_size=8, replay_batch=4,
                                   projection_dim=8, flip=False))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  params = jax.tree.map(np.asarray, state["params"])
  state, scalars, _ = step(state, batch(0, labels=[0, 1] * 4))
  assert int(scalars["replayed"]) == 0  # the first batch only enters the buffer
  jax.tree.map(np.testing.assert_array_equal, state["params"], params)
  state, scalars, _ = step(state, batch(1, labels=[2, 3] * 4))
  assert int(scalars["replayed"]) == 4 and np.isfinite(float(scalars["loss"]))
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.any(np.asarray(a) != b),
                                       state["params"], params))
  assert any(moved)
  view = method.eval_state(state)
  logits = np.asarray(method.predict(view, jnp.asarray(batch(2)["images"])))
  held = np.unique(np.asarray(state["buffer"].labels)[np.asarray(state["buffer"].valid)])
  assert np.all(np.isin(logits.argmax(-1), held))


def test_scr_augmentation_keeps_shape_range_and_is_seeded():
  images = jnp.asarray(batch(5)["images"])
  a = scr.augment(jax.random.key(0), images, "unit")
  assert a.shape == images.shape and float(a.min()) >= 0 and float(a.max()) <= 1
  np.testing.assert_array_equal(a, scr.augment(jax.random.key(0), images, "unit"))
  assert np.any(np.asarray(a) != np.asarray(images))
  signed = scr.augment(jax.random.key(0), 2 * images - 1, "signed")
  assert_close(signed, 2 * a - 1, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# OnPro.


def _np_ope(z1, z2, labels, temperature):
  """OnPro's OPE loss as the authors compute it, transcribed: class means of each view over the
  classes present, normalised, 2K prototypes; positive: the same class in the other view;
  denominator: every other prototype."""
  classes = sorted(set(labels.tolist()))
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  p1 = unit(np.stack([z1[labels == c].mean(0) for c in classes]))
  p2 = unit(np.stack([z2[labels == c].mean(0) for c in classes]))
  p, k = np.concatenate([p1, p2]), len(classes)
  sim = p @ p.T / temperature
  losses = []
  for i in range(2 * k):
    others = [j for j in range(2 * k) if j != i]
    losses.append(-(sim[i, (i + k) % (2 * k)] - np.log(np.exp(sim[i, others]).sum())))
  return float(np.mean(losses)), (p1, p2)


def test_onpro_prototype_loss_against_numpy():
  rng = np.random.default_rng(6)
  z1, z2 = rng.normal(size=(2, 7, 5))
  labels = np.array([0, 3, 3, 0, 1, 3, 2])
  mask = np.array([True] * 6 + [False])  # class 2 only on a padded item: no prototype
  loss, means, present = onpro.prototype_contrastive_loss(
      jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32), jnp.asarray(labels),
      jnp.asarray(mask), 5, 0.5)
  expected, _ = _np_ope(z1[:6], z2[:6], labels[:6], 0.5)
  assert_close(float(loss), expected, rtol=1e-5)
  np.testing.assert_array_equal(present, [True, True, False, True, False])
  raw = lambda z, c: z[:6][labels[:6] == c].mean(0)  # noqa: E731
  assert_close(np.asarray(means)[3], (raw(z1, 3) + raw(z2, 3)) / 2, rtol=1e-5)
  # APF's pair distribution: softmax over pairs of present classes of 1 / distance.
  probs = np.asarray(onpro.pair_probabilities(means, present))
  pairs = [(0, 1), (0, 3), (1, 3)]
  m = np.asarray(means)
  inv = np.array([1 / np.linalg.norm(m[a] - m[b]) for a, b in pairs])
  expected_p = np.exp(inv - inv.max()) / np.exp(inv - inv.max()).sum()
  assert_close(np.array([probs[a, b] for a, b in pairs]), expected_p, rtol=1e-5)
  assert_close(probs.sum(), 1.0, rtol=1e-5)


def test_onpro_step_trains_and_keeps_the_replay_prototypes():
  method = REGISTRY["onpro"](context("onpro", trainable="all", buffer_size=8, replay_batch=4,
                                     projection_dim=8, flip=False))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  state, scalars, _ = step(state, batch(0, labels=[0, 1] * 4))
  assert not bool(np.any(state["class_means_present"]))  # an empty buffer: no prototypes yet
  for i in range(1, 3):
    # The prototypes come from this step's replay draw, taken before the batch enters the buffer.
    held = set(np.asarray(state["buffer"].labels)[np.asarray(state["buffer"].valid)].tolist())
    state, scalars, _ = step(state, batch(i, labels=[2, 3] * 4))
  assert all(np.isfinite(float(v)) for v in scalars.values())
  assert set(np.flatnonzero(state["class_means_present"]).tolist()) <= held
  assert bool(np.any(state["class_means_present"]))
  logits = method.predict(state, jnp.asarray(batch(4)["images"]))
  assert logits.shape == (8, 4)


def test_onpro_classifier_learns_an_incoming_sample_only_once_stored():
  # The reading behind OnPro's lag on the demo (docs/methods/onpro.md): once the buffer holds
  # anything, the linear head's only loss is the CE on the APF-mixed replay draw, so the head's
  # step does not depend on the incoming batch; the contrastive terms see the batch (and move the
  # rest of the network) but never the head.
  method = REGISTRY["onpro"](context("onpro", trainable="all", buffer_size=8, replay_batch=4,
                                     projection_dim=8, flip=False))
  step = jax.jit(method.train_step)
  state = method.init(jax.random.key(0), init_params())
  state, _, _ = step(state, batch(0, labels=[0, 1] * 4))  # the buffer now holds classes 0, 1
  after = [step(state, batch(seed, labels=[2, 3] * 4)) for seed in (1, 2)]
  (state_1, scalars_1, _), (state_2, scalars_2, _) = after
  assert_close(float(scalars_1["ce"]), float(scalars_2["ce"]), rtol=1e-6)
  assert abs(float(scalars_1["ope_new"]) - float(scalars_2["ope_new"])) > 1e-6
  assert_close(state_1["params"]["head"]["kernel"], state_2["params"]["head"]["kernel"],
               rtol=1e-6)
  head_1, head_0 = state_1["params"]["head"]["kernel"], state["params"]["head"]["kernel"]
  assert np.abs(np.asarray(head_1) - np.asarray(head_0)).max() > 0  # it steps, on the replay
  assert np.abs(np.asarray(state_1["params"]["projection"]["kernel"])
                - np.asarray(state_2["params"]["projection"]["kernel"])).max() > 0
