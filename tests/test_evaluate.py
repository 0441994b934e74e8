"""Tests of `olora_jax.evaluate`: the jitted, padded, masked evaluator against plain NumPy on a
tiny ViT; it never changes the learner's state and compiles once."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from olora_jax import evaluate
from olora_jax.data.preprocess import to_model_input
from olora_jax.data.sources import Source
from olora_jax.learner import online_lora
from olora_jax.models.vit import VisionTransformer, ViTSpec

SPEC = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 6  # class 5 has no test example: a class never tested


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  n = 37  # not a multiple of the batch size: the last batch is padded and masked
  labels = rng.integers(0, C - 1, n)
  # Noise whose brightness grows with the label, so the random model's predictions vary.
  scale = (labels[:, None, None, None] + rng.uniform(0, 1.5, (n, 1, 1, 1))) / C
  images = (rng.integers(0, 256, (n, 8, 8, 1)) * scale).astype(np.uint8)
  source = Source("toy", "test", images, labels, C)
  model = VisionTransformer(SPEC, C)
  # jitted init and apply: several times faster than Flax's op-by-op eager execution.
  params = jax.jit(model.init)(jax.random.key(1), np.zeros((1, 16, 16, 3), np.float32))["params"]
  # The head (zeros at init) is a least-squares fit of one-hot labels on the random backbone's
  # features, so predictions vary across classes and some are right: masking then matters.
  x = to_model_input(images, 16)
  identity = {"kernel": np.eye(16, dtype=np.float32), "bias": np.zeros(16, np.float32)}
  feats = np.asarray(jax.jit(VisionTransformer(SPEC, 16).apply)(
      {"params": {**params, "head": identity}}, x), np.float64)  # (n, 16) pre-logits
  mean = feats.mean(0)
  centred = feats - mean
  gram = centred.T @ centred
  ridge = 1e-3 * np.trace(gram) / 16 * np.eye(16)  # keeps the head well conditioned
  kernel = np.linalg.solve(gram + ridge, centred.T @ (np.eye(C)[labels] - 1.0 / C))
  params["head"] = {"kernel": kernel.astype(np.float32),
                    "bias": (-mean @ kernel).astype(np.float32)}
  frozen, head = online_lora.split_params(params)
  tx = online_lora.make_optimizer(1e-3)
  config = online_lora.LearnerConfig(rank=2)
  learner = online_lora.make_learner(model, tx, config)
  state = online_lora.init_train_state(jax.random.key(2), head, SPEC, config, tx)
  # Reference logits: one unbatched, unpadded call outside the evaluator.
  logits = np.asarray(jax.jit(model.apply)({"params": params}, x))
  top2 = np.sort(logits, axis=-1)[:, -2:]
  assert np.min(top2[:, 1] - top2[:, 0]) > 1e-4  # argmax is well defined under float noise
  return source, learner, state, frozen, logits


def _predict(learner):
  """The evaluator takes one state pytree: here the learner's (state, frozen) pair."""
  return lambda model, images: learner.predict(*model, images)


def numpy_counts(logits, labels, ids, allowed):
  masked = np.where(allowed[None], logits[ids], -np.inf)
  hits = masked.argmax(-1) == labels[ids]
  return (np.bincount(labels[ids], weights=hits, minlength=C).astype(np.int64),
          np.bincount(labels[ids], minlength=C).astype(np.int64))


@pytest.mark.parametrize("mask_unseen", [False, True])
def test_counts_equal_numpy(setup, mask_unseen):
  source, learner, state, frozen, logits = setup
  ev = evaluate.Evaluator(source, 16, 8, C, _predict(learner), mask_unseen_logits=mask_unseen)
  seen = np.array([0, 2, 3])
  allowed = np.isin(np.arange(C), seen) if mask_unseen else np.ones(C, bool)

  counts = ev.all_counts((state, frozen), seen)
  ref_correct, ref_total = numpy_counts(logits, source.labels, np.arange(37), allowed)
  np.testing.assert_array_equal(counts.correct, ref_correct)
  np.testing.assert_array_equal(counts.total, ref_total)
  assert counts.total[5] == 0 and np.isnan(counts.class_accuracy()[5])

  ids = np.flatnonzero(np.isin(source.labels, seen))
  anytime = ev.seen_counts((state, frozen), seen)
  ref_correct, ref_total = numpy_counts(logits, source.labels, ids, allowed)
  np.testing.assert_array_equal(anytime.correct, ref_correct)
  np.testing.assert_array_equal(anytime.total, ref_total)
  ref_acc = np.mean(np.where(allowed[None], logits[ids], -np.inf).argmax(-1) == source.labels[ids])
  assert anytime.accuracy(seen) == pytest.approx(ref_acc)
  tasks = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
  pred = np.where(allowed[None], logits, -np.inf).argmax(-1)
  for task_acc, cls in zip(counts.task_accuracies(tasks), tasks, strict=True):
    sel = np.isin(source.labels, cls)
    assert task_acc == pytest.approx(np.mean(pred[sel] == source.labels[sel]))
  if mask_unseen:  # nothing outside the seen classes can be predicted, so unseen tasks score 0
    assert counts.correct[[1, 4]].sum() == 0
  else:  # ... which the unmasked model does predict right on this data (the mask matters)
    assert counts.correct[[1, 4]].sum() > 0


def _host_copy(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.array(x)


def test_never_changes_state_and_compiles_once(setup):
  source, learner, state, frozen, _ = setup
  before = jax.tree.map(_host_copy, (state, frozen))
  ev = evaluate.Evaluator(source, 16, 8, C, _predict(learner), mask_unseen_logits=True)
  traces = evaluate.TRACE_COUNTS["count"]
  for seen in (np.array([0]), np.array([0, 1, 2]), np.arange(C)):
    ev.seen_counts((state, frozen), seen)  # a different number of ids and class mask each time
    ev.all_counts((state, frozen), seen)
  assert evaluate.TRACE_COUNTS["count"] == traces + 1
  after = jax.tree.map(_host_copy, (state, frozen))  # would raise if a buffer had been donated
  jax.tree.map(np.testing.assert_array_equal, before, after)


def test_uncached_path_gives_the_same_counts(setup, monkeypatch):
  source, learner, state, frozen, _ = setup
  cached = evaluate.Evaluator(source, 16, 8, C, _predict(learner)).all_counts(
      (state, frozen), [0])
  monkeypatch.setattr(evaluate, "CACHE_BYTES", 0)  # preprocess batch by batch instead
  ev = evaluate.Evaluator(source, 16, 8, C, _predict(learner))
  assert ev._inputs is None
  counts = ev.all_counts((state, frozen), [0])
  np.testing.assert_array_equal(counts.correct, cached.correct)


@pytest.mark.parametrize("n_shards", [1, 2])
def test_predictions_in_pieces_keep_every_row_in_place(n_shards):
  # A per-row function of the images (and the state): any row moved or mixed would show.
  images = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
  predict = lambda state, x: x * state + x.sum(-1, keepdims=True)  # noqa: E731
  whole = np.asarray(predict(2.0, images))
  for chunk in (1, 2, 3, 4, 6, 12):  # divisors of a shard's rows; 12 is one pass at 2 shards
    got = jax.jit(lambda s, x, c=chunk: evaluate.predict_in_pieces(predict, s, x, c, n_shards))(
        2.0, images)
    np.testing.assert_array_equal(np.asarray(got), whole)


def test_predictions_in_pieces_give_the_same_counts(setup, monkeypatch):
  source, learner, state, frozen, _ = setup
  whole = evaluate.Evaluator(source, 16, 8, C, _predict(learner)).all_counts((state, frozen), [0])
  traced = jax.make_jaxpr(lambda s, x: evaluate.predict_in_pieces(_predict(learner), s, x, 2))(
      (state, frozen), np.zeros((8, 16, 16, 3), np.float32))
  assert "scan" in str(traced)  # really split: four pieces of two images
  calls = []  # what the evaluator's count function asks for when traced
  original = evaluate.predict_in_pieces
  monkeypatch.setattr(evaluate, "predict_in_pieces",
                      lambda *a: calls.append(a[3:]) or original(*a))
  pieces = evaluate.Evaluator(source, 16, 8, C, _predict(learner), predict_chunk=2)
  counts = pieces.all_counts((state, frozen), [0])
  assert calls == [(2, 1)]
  np.testing.assert_array_equal(counts.correct, whole.correct)
  np.testing.assert_array_equal(counts.total, whole.total)


def test_bad_arguments(setup):
  source, learner, *_ = setup
  with pytest.raises(ValueError, match="eval.batch_size"):
    evaluate.Evaluator(source, 16, 0, C, _predict(learner))
  with pytest.raises(ValueError, match="num_classes"):
    evaluate.Evaluator(source, 16, 8, 3, _predict(learner))
  for chunk in (3, -1):
    with pytest.raises(ValueError, match=f"eval.predict_chunk={chunk} must be 0 .* divide the 8"):
      evaluate.Evaluator(source, 16, 8, C, _predict(learner), predict_chunk=chunk)
