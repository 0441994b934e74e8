"""The online-continual-learning baselines of issue 51 against hand computations: ER-ACE's
asymmetric cross-entropy, LwF's distillation and teacher refresh, SCR's supervised contrastive
loss and nearest-class-mean rule, OnPro's prototype losses, each against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
from numerics import assert_close
from test_methods import _np_log_softmax, batch, context, init_params

from olora_jax.methods import REGISTRY, er_ace

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
