"""Tests of `olora_jax.evaluate`: the jitted, padded, masked evaluator against plain NumPy on a
tiny ViT; it never changes the learner's state and compiles once."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from olora_jax import evaluate
from olora_jax.data.preprocess import to_model_input, to_model_levels
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


@pytest.mark.parametrize("mask_unseen", [False, True])
def test_task_il_counts_equal_numpy_in_the_same_program(setup, mask_unseen):
  """Task-IL: each example's logits masked to its task's classes (whatever the seen-class
  mask), counted by the same compiled program as the class-incremental counts, which stay what
  an evaluator without Task-IL counts."""
  source, learner, state, frozen, logits = setup
  task_of_class = np.array([0, 0, 1, 1, 2, 2])
  seen = np.array([0, 2, 3])
  ev = evaluate.Evaluator(source, 16, 8, C, _predict(learner), mask_unseen_logits=mask_unseen,
                          task_of_class=task_of_class)
  plain = evaluate.Evaluator(source, 16, 8, C, _predict(learner), mask_unseen_logits=mask_unseen)
  traces = evaluate.TRACE_COUNTS["count"]
  counts = ev.all_counts((state, frozen), seen)
  anytime = ev.seen_counts((state, frozen), seen)
  assert evaluate.TRACE_COUNTS["count"] == traces + 1  # one program serves both counts
  want = plain.all_counts((state, frozen), seen)
  np.testing.assert_array_equal(counts.correct, want.correct)
  np.testing.assert_array_equal(counts.total, want.total)
  assert want.task_il_correct is None and np.isnan(want.task_il_accuracy())
  labels = source.labels
  same_task = task_of_class[None, :] == task_of_class[labels][:, None]
  hits = np.where(same_task, logits, -np.inf).argmax(-1) == labels
  np.testing.assert_array_equal(
      counts.task_il_correct, np.bincount(labels, weights=hits, minlength=C).astype(np.int64))
  tasks = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
  for acc, cls in zip(counts.task_il_accuracies(tasks), tasks, strict=True):
    assert acc == pytest.approx(hits[np.isin(labels, cls)].mean())
  keep = np.isin(labels, seen)
  assert anytime.task_il_accuracy(seen) == pytest.approx(hits[keep].mean())
  # The task mask alone: an unseen task is still predicted among its own classes.
  assert counts.task_il_correct[[1, 4]].sum() > 0
  # Task-IL is at least the class-incremental accuracy without the seen mask (fewer rivals).
  unmasked = plain.all_counts((state, frozen), np.arange(C))
  assert counts.task_il_correct.sum() >= unmasked.correct.sum()
  with pytest.raises(ValueError, match="one task id per class"):
    evaluate.Evaluator(source, 16, 8, C, _predict(learner), task_of_class=[0, 1])


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


class _CountingSource:
  """A test source that counts the images it is asked to decode."""

  def __init__(self, source):
    self.source, self.labels, self.num_classes, self.decoded = (
        source, source.labels, source.num_classes, 0)

  def __len__(self):
    return len(self.source)

  def get(self, ids):
    self.decoded += len(ids)
    return self.source.get(ids)


@pytest.mark.parametrize("preprocess", ["host", "device"])
def test_the_cached_test_set_gives_the_uncached_counts_and_is_decoded_once(
    setup, monkeypatch, preprocess):
  """The test set decoded once at the model's resolution (uint8, on the device or the host)
  counts as the evaluator that reads and resizes every batch at every evaluation ('none')."""
  source, learner, state, frozen, logits = setup
  seen = np.array([0, 2, 3])
  counts = {}
  if preprocess == "device":  # the cache is built by the device resize, never by PIL
    monkeypatch.setattr(evaluate, "decode_levels", lambda *args: pytest.fail("PIL build"))
  for where in evaluate.CACHE_WHERE:
    monkeypatch.setattr(evaluate, "cache_placement", lambda *args, where=where: where)
    counting = _CountingSource(source)
    ev = evaluate.Evaluator(counting, 16, 8, C, _predict(learner), preprocess=preprocess)
    assert ev.cached == where
    decoded = counting.decoded
    if where != "none":
      assert ev._levels.dtype == np.uint8 and ev._levels.shape == (37, 16, 16, 1)
      assert isinstance(ev._levels, jax.Array) == (where == "device")
      np.testing.assert_array_equal(np.asarray(ev._levels), to_model_levels(source.images, 16))
      # Built reading every test image once (and the first one or two more times for its shape).
      assert 37 <= decoded <= 39
    counts[where] = [ev.all_counts((state, frozen), seen), ev.seen_counts((state, frozen), seen)]
    # An evaluation from the cache decodes nothing; without it, every test image again.
    assert counting.decoded - decoded == (0 if where != "none" else 37 + np.isin(
        source.labels, seen).sum())
  for where in ("device", "host"):
    for got, want in zip(counts[where], counts["none"], strict=True):
      np.testing.assert_array_equal(got.correct, want.correct)
      np.testing.assert_array_equal(got.total, want.total)
  want, _ = numpy_counts(logits, source.labels, np.arange(37), np.ones(C, bool))
  np.testing.assert_array_equal(counts["device"][0].correct, want)


def test_the_cache_goes_where_it_fits(setup, monkeypatch):
  source = setup[0]  # 37 images of 16 x 16 x 1 at the model's input: 9,472 bytes
  mesh = evaluate.sharding.make_mesh()
  for device_bytes, host_bytes, where in ((10**9, 10**9, "device"), (10**4, 10**9, "host"),
                                          (10**4, 10**4, "none")):
    monkeypatch.setattr(evaluate.compute_lib, "device_memory_bytes", lambda b=device_bytes: b)
    monkeypatch.setattr(evaluate.compute_lib, "host_memory_bytes", lambda b=host_bytes: b)
    assert evaluate.cache_placement(source, 16, mesh) == where


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
                      lambda *a: calls.append(a[3:5]) or original(*a))
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
  for chunk in (3, -2):
    with pytest.raises(ValueError, match=f"eval.predict_chunk={chunk} must be 0 .* divide the 8"):
      evaluate.Evaluator(source, 16, 8, C, _predict(learner), predict_chunk=chunk)


def test_predict_chunk_minus_one_is_picked_by_the_backend():
  resolve = evaluate.resolve_predict_chunk
  assert resolve(-1, 256, 1, "cpu") == 64  # pieces of 64 on a CPU
  assert resolve(-1, 256, 2, "cpu") == 64 and resolve(-1, 96, 1, "cpu") == 0  # 64 must divide
  assert resolve(-1, 256, 1, "gpu") == resolve(-1, 256, 1, "tpu") == 0  # one pass
  assert resolve(0, 256, 1, "cpu") == 0 and resolve(32, 256, 1, "gpu") == 32  # as given
  evaluate.check_predict_chunk(-1, 96, 1)
  with pytest.raises(ValueError, match=r"eval.predict_chunk=-2 must be 0 .*-1 \(picked by"):
    evaluate.check_predict_chunk(-2, 96, 1)


def test_a_padded_last_batch_gives_the_counts_of_unpadded_batches(setup):
  """37 test images in one unpadded batch, and in batches of 8 and 16 whose last is padded (3
  and 11 masked rows): the same counts (the padding rows never count, and no image's prediction
  depends on the batch it is in). In pieces of 4, the last batch of 16 holds 5 images: its last
  two pieces are padding alone and skip the model."""
  source, learner, state, frozen, _ = setup
  seen = np.array([0, 1, 3])
  whole = evaluate.Evaluator(source, 16, 37, C, _predict(learner), mask_unseen_logits=True)
  assert whole.cached == "device"  # the test set's uint8 levels on the device, gathered there
  unpadded = whole.all_counts((state, frozen), seen)
  assert unpadded.total.sum() == 37
  for batch_size, chunk in ((8, 0), (16, 0), (16, 4)):
    padded = evaluate.Evaluator(source, 16, batch_size, C, _predict(learner),
                                mask_unseen_logits=True,
                                predict_chunk=chunk).all_counts((state, frozen), seen)
    np.testing.assert_array_equal(padded.correct, unpadded.correct)
    np.testing.assert_array_equal(padded.total, unpadded.total)


def test_fit_batch_halves_until_the_program_fits():
  needed = {1024: 900, 512: 450, 256: 225, 128: 112}.__getitem__  # bytes for a batch
  assert evaluate.fit_batch(1024, needed, 1000, 64) == 1024  # fits 90% of 1000
  assert evaluate.fit_batch(1024, needed, 600, 64) == 512
  assert evaluate.fit_batch(1024, needed, 200, 64) == 128
  assert evaluate.fit_batch(1024, needed, 10, 128) == 128  # never below a device's chunk
  assert evaluate.fit_batch(192, lambda b: b, 100, 64) == 64  # multiples of the step


def test_an_evaluation_batch_too_large_for_the_device_is_lowered(setup, monkeypatch, caplog):
  """Where the device reports too little free memory for eval.batch_size's program, the first
  evaluation halves the batch (each size compiled ahead of time, the last one kept for every
  later evaluation) and says so; the counts are those of the batch asked for."""
  source, learner, state, frozen, _ = setup
  want = evaluate.Evaluator(source, 16, 16, C, _predict(learner)).all_counts((state, frozen), [0])
  monkeypatch.setattr(evaluate, "free_device_bytes", lambda: 1)  # nothing fits
  ev = evaluate.Evaluator(source, 16, 16, C, _predict(learner), predict_chunk=8)
  traces = evaluate.TRACE_COUNTS["count"]
  with caplog.at_level("WARNING"):
    got = ev.all_counts((state, frozen), [0])
  assert ev.batch_size == 8 and "evaluating in batches of 8" in caplog.text
  np.testing.assert_array_equal(got.correct, want.correct)
  np.testing.assert_array_equal(got.total, want.total)
  ev.all_counts((state, frozen), [0, 1])
  assert evaluate.TRACE_COUNTS["count"] == traces + 2  # batches of 16 and of 8, each once
  # With Task-IL, the programs tried carry its arguments too: the same counts in smaller batches.
  tasks = np.array([0, 0, 1, 1, 2, 2])
  want = evaluate.Evaluator(source, 16, 16, C, _predict(learner), task_of_class=tasks,
                            predict_chunk=8)
  ev = evaluate.Evaluator(source, 16, 16, C, _predict(learner), task_of_class=tasks,
                          predict_chunk=8)
  monkeypatch.setattr(evaluate, "free_device_bytes", lambda: None)
  want = want.all_counts((state, frozen), [0])
  monkeypatch.setattr(evaluate, "free_device_bytes", lambda: 1)
  got = ev.all_counts((state, frozen), [0])
  assert ev.batch_size == 8
  np.testing.assert_array_equal(got.task_il_correct, want.task_il_correct)
  np.testing.assert_array_equal(got.correct, want.correct)
