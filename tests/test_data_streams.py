"""Tests of the scenarios (olora_jax/data/streams.py), the stream manifest and the input pipeline,
on synthetic label arrays: class coverage, disjointness, Si-Blurry's N and M, CORe50 session
order, one pass over the data, seeded determinism, and a golden manifest hash."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from configs import common
from olora_jax.data import manifest as manifest_lib
from olora_jax.data import streams
from olora_jax.data.pipeline import InputPipeline
from olora_jax.data.preprocess import augment_images, random_crop_box
from olora_jax.data.sources import Source


def _labels(num_classes=20, per_class=30, seed=0):
  labels = np.repeat(np.arange(num_classes), per_class)
  return np.random.default_rng(seed).permutation(labels)


def _all_ids(stream):
  return np.concatenate(stream.steps)


def _assert_one_pass(stream, n):
  ids = _all_ids(stream)
  assert len(ids) == len(np.unique(ids)), "an example appears twice in one pass"
  assert np.array_equal(np.sort(ids), np.arange(n)), "not every example is used once"


def _assert_well_formed(stream, labels, batch_size):
  assert all(1 <= len(s) <= batch_size for s in stream.steps)
  assert np.all(np.diff(stream.step_task) >= 0), "tasks must come in order"
  for ids, task in zip(stream.steps, stream.step_task, strict=True):
    assert np.isin(labels[ids], stream.task_classes[task]).all()


@pytest.mark.parametrize("class_order", ["label", "seeded"])
def test_disjoint_covers_every_class_and_tasks_share_none(class_order):
  labels = _labels()
  stream = streams.disjoint_class_incremental(labels, 5, 16, seed=3, class_order=class_order)
  _assert_one_pass(stream, len(labels))
  _assert_well_formed(stream, labels, 16)
  assert np.array_equal(np.sort(np.concatenate(stream.task_classes)), np.arange(20))
  for t, ids in enumerate(stream.steps):
    seen = set(labels[ids].tolist())
    others = set(np.concatenate([c for u, c in enumerate(stream.task_classes)
                                 if u != stream.step_task[t]]).tolist())
    assert not seen & others
  assert [len(c) for c in stream.task_classes] == [4] * 5
  if class_order == "label":
    assert np.array_equal(stream.task_classes[0], [0, 1, 2, 3])


def test_disjoint_keeps_classes_without_samples_in_their_task():
  labels = np.repeat([0, 1, 3], 5)  # class 2 has no training sample (e.g. small mock data)
  stream = streams.disjoint_class_incremental(labels, 2, 4, 0, num_classes=4)
  assert [c.tolist() for c in stream.task_classes] == [[0, 1], [2, 3]]
  with pytest.raises(ValueError, match="divide the 4 classes"):
    streams.disjoint_class_incremental(labels, 3, 4, 0, num_classes=4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_si_blurry_n_and_m_hold(seed):
  labels = _labels(num_classes=40, per_class=25, seed=seed)
  n_percent, m_percent, n_tasks = 50.0, 10.0, 5
  stream = streams.si_blurry(labels, n_tasks, n_percent, m_percent, 8, seed, num_classes=40)
  _assert_one_pass(stream, len(labels))
  _assert_well_formed(stream, labels, 8)
  disjoint = stream.disjoint_classes
  assert len(disjoint) == 20  # N = 50% of 40 classes
  sample_task = np.empty(len(labels), np.int64)
  for ids, task in zip(stream.steps, stream.step_task, strict=True):
    sample_task[ids] = task
  # Disjoint classes: every sample in the class's home task, and in no other task's class list.
  for c in disjoint:
    tasks = np.unique(sample_task[labels == c])
    assert tasks.tolist() == [stream.home_task[c]]
    assert sum(c in tc for tc in stream.task_classes) == 1
  # Blurry classes: exactly M% of their samples left their home task, each to another task.
  blurry = np.isin(labels, disjoint, invert=True)
  moved = blurry & (sample_task != stream.home_task[labels])
  assert moved.sum() == round(0.10 * blurry.sum())
  assert not (~blurry & (sample_task != stream.home_task[labels])).any()
  # Every task holds >= 1 disjoint and >= 1 blurry home class; counts are random.
  for t in range(n_tasks):
    home = np.flatnonzero(stream.home_task == t)
    assert np.isin(home, disjoint).any() and (~np.isin(home, disjoint)).any()


def test_si_blurry_is_seeded():
  labels = _labels(num_classes=40, per_class=25)
  make = lambda seed: streams.si_blurry(labels, 5, 50.0, 10.0, 8, seed)
  a, b, c = make(0), make(0), make(1)
  assert a.sha256() == b.sha256()
  assert a.sha256() != c.sha256()
  assert not np.array_equal(a.disjoint_classes, c.disjoint_classes)
  sizes = {tuple(np.bincount(make(s).home_task, minlength=5)) for s in range(6)}
  assert len(sizes) > 1, "the number of classes per task should vary with the seed"


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_tasks=1), "must be >= 2"),
    (dict(disjoint_percent=150.0), "si_blurry_n=150.0 is a percentage"),
    (dict(blurry_percent=-1.0), "si_blurry_m=-1.0 is a percentage"),
    (dict(n_tasks=30), "every task needs one"),
])
def test_si_blurry_bad_inputs(kwargs, match):
  args = dict(n_tasks=5, disjoint_percent=50.0, blurry_percent=10.0)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    streams.si_blurry(_labels(), batch_size=8, seed=0, **args)


def test_domain_incremental_sessions_in_order():
  rng = np.random.default_rng(0)
  sessions = rng.permutation(np.repeat([1, 2, 4, 5, 6, 8, 9, 11], 12))
  labels = rng.integers(0, 5, len(sessions))
  order = [1, 2, 4, 5, 6, 8, 9, 11]
  stream = streams.domain_incremental(labels, sessions, order, 5, seed=0)
  _assert_one_pass(stream, len(labels))
  assert stream.n_tasks == 8
  step_sessions = [np.unique(sessions[ids]).tolist() for ids in stream.steps]
  assert all(len(s) == 1 for s in step_sessions)
  assert [s[0] for s in step_sessions] == sorted(s[0] for s in step_sessions)
  assert [order[t] for t in stream.step_task] == [s[0] for s in step_sessions]
  shuffled = streams.domain_incremental(labels, sessions, order, 5, 0, order="shuffled")
  _assert_one_pass(shuffled, len(labels))
  assert shuffled.n_tasks == 1
  assert len(np.unique(sessions[shuffled.steps[0]])) > 1
  with pytest.raises(ValueError, match="core50_order='random'"):
    streams.domain_incremental(labels, sessions, order, 5, 0, order="random")
  with pytest.raises(ValueError, match=r"domains \[3\] have no training examples"):
    streams.domain_incremental(labels, sessions, [1, 3], 5, 0)


def _source(labels):
  images = (np.arange(len(labels))[:, None, None, None] % 251).astype(np.uint8)
  images = np.broadcast_to(images, (len(labels), 6, 6, 3)).copy()
  return Source("synthetic", "train", images, np.asarray(labels), int(np.max(labels)) + 1)


def _data_config(**overrides):
  c = common.get_config().data
  c.unlock()
  c.update(overrides)
  return c


def test_manifest_hash_is_stable_and_sensitive(tmp_path):
  labels = _labels()
  train, test = _source(labels), _source(labels[:50])
  data = _data_config(dataset="synthetic", scenario="si_blurry", n_tasks=4)

  def manifest(seed, data=data):
    stream = streams.build_stream(data, train, 16, seed)
    return manifest_lib.stream_manifest(data, seed, 16, stream, train, test)

  m = manifest(7)
  # Golden value: the same config and seed give this hash on any machine (numpy's PCG64 and the
  # canonical JSON encoding are platform independent).
  assert manifest_lib.manifest_sha256(m) == GOLDEN_SI_BLURRY_SHA256
  assert manifest_lib.manifest_sha256(manifest(7)) == GOLDEN_SI_BLURRY_SHA256
  assert manifest_lib.manifest_sha256(manifest(8)) != GOLDEN_SI_BLURRY_SHA256
  other = _data_config(dataset="synthetic", scenario="si_blurry", n_tasks=4, si_blurry_m=20.0)
  assert manifest_lib.manifest_sha256(manifest(7, other)) != GOLDEN_SI_BLURRY_SHA256
  path = tmp_path / "stream_manifest.json"
  assert manifest_lib.write_manifest(str(path), m) == GOLDEN_SI_BLURRY_SHA256
  import hashlib
  import json
  assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN_SI_BLURRY_SHA256
  loaded = json.loads(path.read_text())
  assert loaded["task_end_steps"] == streams.build_stream(data, train, 16, 7).task_end_steps(
      ).tolist()
  assert sum(len(s) for s in loaded["steps"]) == len(labels)
  assert loaded["params"]["si_blurry_m"] == 10.0 and "class_order" not in loaded["params"]


GOLDEN_SI_BLURRY_SHA256 = "5020ae86df7958286fae4ca6bfc485777bd5e2525c0b61f2ec770f65179ae069"


def test_crop_box_in_bounds_and_augment_deterministic():
  rng = np.random.default_rng(0)
  for h, w in [(5, 50), (50, 5), (32, 32), (7, 9)]:
    for _ in range(50):
      top, left, bh, bw = random_crop_box(h, w, rng)
      assert 0 <= top and top + bh <= h and 0 <= left and left + bw <= w and bh > 0 and bw > 0
  images = [np.random.default_rng(i).integers(0, 255, (20, 30, 3), dtype=np.uint8)
            for i in range(4)] + [np.zeros((9, 9, 1), np.uint8)]
  a = augment_images(images, 16, "crop_flip", np.random.default_rng(5))
  b = augment_images(images, 16, "crop_flip", np.random.default_rng(5))
  c = augment_images(images, 16, "crop_flip", np.random.default_rng(6))
  assert a.shape == (5, 16, 16, 3) and a.dtype == np.uint8
  assert np.array_equal(a, b) and not np.array_equal(a, c)
  with pytest.raises(ValueError, match="data.augment='jitter'"):
    augment_images(images, 16, "jitter", rng)


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_pipeline_yields_the_stream_in_order(augment):
  labels = _labels(num_classes=4, per_class=10)
  source = _source(labels)
  stream = streams.disjoint_class_incremental(labels, 2, 8, 0)
  pipe = InputPipeline(source, stream, 8, 12, augment=augment, seed=1, prefetch=3)
  batches = list(pipe)
  assert len(batches) == len(stream.steps)
  for step, batch in enumerate(batches):
    n = len(stream.steps[step])
    assert batch["images"].shape == (8, 12, 12, 3) and batch["mask"].sum() == n
    assert np.array_equal(batch["labels"][:n], labels[stream.steps[step]])
    assert np.array_equal(batch["images"], pipe.batch(step)["images"])  # deterministic
  # `place` (the loop's copy to the devices) runs in the preparing threads, one batch each, and
  # the placed batches still come in stream order, from any start.
  threads = set()

  def place(batch):
    threads.add(threading.current_thread())
    return ("placed", batch)

  placed = list(pipe.iterate(2, place))
  assert len(placed) == len(stream.steps) - 2 and threading.main_thread() not in threads
  for step, (tag, batch) in enumerate(placed, start=2):
    assert tag == "placed" and np.array_equal(batch["images"], batches[step]["images"])
  with pytest.raises(ValueError, match="data.prefetch=0"):
    InputPipeline(source, stream, 8, 12, prefetch=0)


def test_task_il_is_defined_where_every_class_is_in_one_task():
  """Task-IL's class -> task map (`protocol.task_il_map`): a disjoint stream's classes each in
  their task (a class without samples stays in its task); Si-Blurry with moved blurry samples
  and domain streams have none (a class in several tasks, or shared domains)."""
  from olora_jax import protocol

  labels = np.repeat([0, 1, 3], 5)  # class 2 has no training sample
  disjoint = streams.disjoint_class_incremental(labels, 2, 4, 0, num_classes=4)
  test = Source("toy", "test", np.zeros((5, 2, 2, 3), np.uint8), np.arange(5), 5)
  np.testing.assert_array_equal(disjoint.task_of_class(5), [0, 0, 1, 1, -1])  # 4: in no task
  np.testing.assert_array_equal(protocol.task_il_map(disjoint, test, 5, "disjoint"),
                                [0, 0, 1, 1, -1])
  blurry = streams.si_blurry(_labels(num_classes=40, per_class=25), 5, 50.0, 10.0, 8, 0,
                             num_classes=40)
  assert blurry.task_of_class(40) is None
  rng = np.random.default_rng(0)
  sessions = np.repeat([1, 2], 10)
  domain = streams.domain_incremental(rng.permutation(np.arange(20) % 5), sessions, [1, 2], 5, 0)
  assert domain.task_of_class(5) is None
  shuffled = streams.domain_incremental(np.arange(20) % 5, sessions, [1, 2], 5, 0,
                                        order="shuffled")  # one task: defined, but not Task-IL
  assert shuffled.task_of_class(5) is not None
  assert protocol.task_il_map(shuffled, test, 5, "domain") is None
