"""data.preprocess='device' (olora_jax/data/device_preprocess.py): the host ships uint8 images at
their stored size, the device resizes, crops, flips and scales them.

Tolerance: none. The device resize is Pillow's BILINEAR resize pass for pass in integer arithmetic
(its fixed-point weights are ratios of small integers, rounded exactly as PIL rounds them), and
the uint8 -> float step is the host's own NumPy computation in a table, so a device batch must
equal the host path's batch bit for bit: every comparison below is exact equality. (Float
weights instead of PIL's fixed point put 1-10% of the pixels one level, 1/255, off wherever a
weighted sum lands on a half level, which rational scales such as 64 -> 224 make common.)
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import tiny_run
from PIL import Image

from olora_jax import evaluate, trainer
from olora_jax.data import device_preprocess, streams
from olora_jax.data.pipeline import InputPipeline, device_image_shape
from olora_jax.data.preprocess import crop_flip_draw
from olora_jax.data.sources import Source


def _source(shape, n=40, num_classes=4, seed=0):
  """Random pixels, plus smooth ramps and flat areas (exact ties in the resize) in half."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
  h, w = shape[:2]
  ramp = (np.add.outer(np.arange(h) * 7, np.arange(w) * 3) % 256).astype(np.uint8)
  images[: n // 4] = ramp[None, :, :, None]
  images[n // 4: n // 2] = (images[n // 4: n // 2] // 64) * 64
  labels = np.repeat(np.arange(num_classes), n // num_classes)
  return Source("synthetic", "train", images, labels, num_classes)


CASES = [  # (stored shape, image_size): grey and RGB, upsampling and downsampling, non-square
    ((28, 28, 1), 32), ((28, 28, 1), 16), ((8, 8, 1), 16), ((8, 8, 1), 224),
    ((20, 30, 3), 24), ((40, 36, 3), 16), ((28, 28, 3), 28),
]


@pytest.mark.parametrize("input_scale", ["unit", "signed"])
@pytest.mark.parametrize("augment", ["none", "crop_flip"])
@pytest.mark.parametrize("shape,size", CASES, ids=[f"{s[0]}x{s[1]}x{s[2]}to{t}" for s, t in CASES])
def test_device_batches_equal_the_host_batches(shape, size, augment, input_scale):
  source = _source(shape)
  stream = streams.disjoint_class_incremental(source.labels, 2, 8, 0)  # 8-batches, some padded
  kwargs = dict(augment=augment, seed=3, input_scale=input_scale)
  host = InputPipeline(source, stream, 8, size, **kwargs)
  device = InputPipeline(source, stream, 8, size, preprocess="device", **kwargs)
  padded = 0
  for step in range(len(stream.steps)):
    want, shipped = host.batch(step), device.batch(step)
    assert shipped["images"].dtype == np.uint8 and shipped["images"].shape[1:] == shape
    got = device.on_device(shipped)
    assert sorted(got) == sorted(want)  # the methods see the batch they always saw
    for key in want:
      np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=f"{key} {step}")
    assert np.asarray(got["images"]).dtype == np.float32
    padded += int((~want["mask"]).sum())
  assert padded > 0  # padding rows (zero images, even with 'signed') were compared too


def test_resize_is_pillow_on_random_crops_and_both_pass_orders():
  """Crops whose height shrinks more than twice the width (Pillow runs the vertical pass first)
  and the others, down and up, grey and RGB."""
  rng = np.random.default_rng(0)
  for shape, size in [((28, 28, 1), 16), ((28, 28, 1), 24), ((40, 30, 3), 12), ((9, 13, 3), 32)]:
    images = rng.integers(0, 256, (32, *shape), dtype=np.uint8)
    draws = [crop_flip_draw(*shape[:2], rng) for _ in images]
    boxes = np.array([box for box, _ in draws] + [(0, 0, shape[0] // 3 + 1, shape[1])], np.int32)
    images = np.concatenate([images, images[:1]])
    levels = np.asarray(jax.jit(device_preprocess.preprocess_images, static_argnums=2)(
        images, np.ones(len(images), bool), size, boxes=boxes)) * 255.0
    orders = set()
    for image, (top, left, h, w), got in zip(images, boxes, levels, strict=True):
      crop = image[top:top + h, left:left + w]
      pil = Image.fromarray(crop[..., 0] if shape[-1] == 1 else crop)
      want = np.asarray(pil.resize((size, size), Image.BILINEAR)).reshape(size, size, -1)
      np.testing.assert_array_equal(np.round(got[..., : shape[-1]]), want)
      orders.add(bool(device_preprocess.vertical_first(h, w, size)))
    assert orders == {True, False} or shape[0] < size


def test_evaluator_keeps_uint8_and_counts_as_the_host_path():
  source = _source((28, 28, 1), n=60, num_classes=3)
  w = np.random.default_rng(1).normal(size=(16 * 16 * 3, 3)).astype(np.float32)

  def predict(state, images):
    return images.reshape(len(images), -1) @ state

  host = evaluate.Evaluator(source, 16, 16, 3, predict)
  device = evaluate.Evaluator(source, 16, 16, 3, predict, preprocess="device")
  for ev in (host, device):  # both keep the test set as uint8 levels at the model's input
    assert np.asarray(ev._levels).dtype == np.uint8 and ev._levels.shape == (60, 16, 16, 1)
  # PIL's levels (host) and the device resize's (device) are the same, bit for bit.
  np.testing.assert_array_equal(np.asarray(device._levels), np.asarray(host._levels))
  ids = np.arange(50)  # 4 batches, the last one padded
  want, got = host.counts(w, ids, np.arange(3)), device.counts(w, ids, np.arange(3))
  np.testing.assert_array_equal(got.correct, want.correct)
  np.testing.assert_array_equal(got.total, want.total)
  with pytest.raises(ValueError, match=r"unknown data.preprocess='gpu'"):
    evaluate.Evaluator(source, 16, 16, 3, predict, preprocess="gpu")


CACHE_CASES = [  # (stored shape, 32 px): grey and RGB, up, down (both pass orders), unchanged
    ((8, 8, 1), 32), ((28, 20, 3), 32), ((36, 40, 1), 32), ((90, 40, 3), 32), ((32, 32, 3), 32)]


@pytest.mark.parametrize("shape,size", CACHE_CASES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}to{t}" for s, t in CACHE_CASES])
def test_the_test_set_cache_built_on_the_device_is_the_pil_cache(shape, size):
  """The evaluator's test-set cache with data.preprocess='device': the device resize, chunk by
  chunk (the last one padded), into the device cache or the host one, equals PIL's levels."""
  source = _source(shape, n=38, num_classes=2)
  want = evaluate.decode_levels(source, size)
  mesh = evaluate.sharding.make_mesh()
  assert evaluate.resizes_on_device(source, size)
  for where, chunk in (("device", 8), ("host", 8), ("device", 0)):  # 0: one chunk of 38
    got = evaluate.decode_levels_on_device(source, size, mesh, where, chunk)
    assert isinstance(got, jax.Array) == (where == "device")
    assert got.dtype == np.uint8 and got.shape == (38, size, size, shape[-1])
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{where} {chunk}")


class _ShrinksLater(Source):
  """Its `get` returns a smaller image size for the rows from 6 on."""

  def get(self, ids):
    images, labels = super().get(ids)
    return (images[:, :-1] if ids[-1] >= 6 else images), labels


def test_a_test_image_of_another_size_in_the_device_build_is_a_clear_error():
  good = _source((8, 8, 1))
  source = _ShrinksLater(good.name, "test", good.images, good.labels, good.num_classes)
  with pytest.raises(ValueError, match=r"test images 6\.\.11 of data.dataset='synthetic' are"
                     r" uint8 \(7, 8, 1\), not uint8 \(8, 8, 1\) .* data.preprocess='host'"):
    evaluate.decode_levels_on_device(source, 16, evaluate.sharding.make_mesh(), "host", 6)


def test_images_too_large_for_the_device_resize_are_cached_with_pil():
  """Beyond the device resize's sizes (`check_sizes`) the cache is built on the host, by PIL."""
  source = _source((2000, 2000, 1), n=2, num_classes=2)
  assert not evaluate.resizes_on_device(source, 32)
  ev = evaluate.Evaluator(source, 32, 2, 2, lambda state, x: x[:, 0, 0, :2], preprocess="device")
  assert ev.cached == "device"
  np.testing.assert_array_equal(np.asarray(ev._levels), evaluate.decode_levels(source, 32))


class _MixedSizes:
  """A user source whose stored images differ in size (as a folder of photographs)."""

  name, split, num_classes = "photos", "train", 2

  def __init__(self):
    self.labels = np.array([0, 1, 0, 1])
    self._images = [np.zeros((10 + i, 12, 3), np.uint8) for i in range(4)]

  def __len__(self):
    return 4

  def get_raw(self, ids):
    return [self._images[i] for i in ids], self.labels[ids]

  def get(self, ids):
    return np.zeros((len(ids), 16, 16, 3), np.uint8), self.labels[ids]


def test_a_source_without_one_stored_size_is_refused_at_setup():
  source = _MixedSizes()
  stream = streams.disjoint_class_incremental(source.labels, 1, 2, 0)
  with pytest.raises(ValueError, match=r"raw training images of data.dataset='photos' \(train"
                     r" split\) do not share one stored size .*use data.preprocess='host'"):
    InputPipeline(source, stream, 2, 16, augment="crop_flip", preprocess="device")
  # augment 'none' ships what `get` returns (TFDS: resized at load): one size, accepted.
  assert device_image_shape(source, "none") == (16, 16, 3)
  InputPipeline(source, stream, 2, 16, augment="none", preprocess="device")
  with pytest.raises(ValueError, match=r"unknown data.preprocess='cpu'"):
    InputPipeline(source, stream, 2, 16, preprocess="cpu")


class _Inconsistent(Source):
  """Claims one stored size, but one of its images is larger."""

  def get_raw(self, ids):
    raw, labels = super().get_raw(ids)
    odd = np.zeros((9, 8, 1), np.uint8)
    return [odd if i == 5 else im for i, im in zip(ids, raw, strict=True)], labels


def test_an_image_of_another_size_mid_stream_is_a_clear_error():
  good = _source((8, 8, 1))
  source = _Inconsistent(good.name, good.split, good.images, good.labels, good.num_classes)
  stream = streams.disjoint_class_incremental(source.labels, 2, 8, 0)
  pipe = InputPipeline(source, stream, 8, 16, augment="crop_flip", preprocess="device")
  step = next(i for i, ids in enumerate(stream.steps) if 5 in ids)
  pipe.batch(step - 1 if step else step + 1)
  with pytest.raises(ValueError, match=rf"stream step {step} holds an image of shape \(9, 8, 1\),"
                     r" not the \(8, 8, 1\) .* use data.preprocess='host'"):
    pipe.batch(step)


def _config(preprocess):
  c = tiny_run.config()
  c.data.augment = "crop_flip"
  c.data.preprocess = preprocess
  c.checkpoint_every, c.max_to_keep = 10, 10  # every checkpoint stays: resume from a middle one
  return c


def test_a_device_run_resumed_mid_stream_equals_the_uninterrupted_run_and_the_host_run(
    tmp_path):
  """The tiny stream with crop_flip (8x8 digits up to 16x16): device preprocessing end to end,
  resumed from checkpoint 20 of 46, ends as the uninterrupted run, and as the host path's run."""
  device, resumed, host = tmp_path / "device", tmp_path / "resumed", tmp_path / "host"
  trainer.train_and_evaluate(_config("device"), str(device), progress=False)
  assert json.loads((device / "config.json").read_text())["data"]["preprocess"] == "device"
  shutil.copytree(device, resumed)
  (resumed / "results.json").unlink()
  for step in os.listdir(resumed / "checkpoints"):
    if step.isdigit() and int(step) > 20:
      shutil.rmtree(resumed / "checkpoints" / step)
  trainer.train_and_evaluate(_config("device"), str(resumed), progress=False)
  tiny_run.assert_same_run(resumed, device)
  trainer.train_and_evaluate(_config("host"), str(host), progress=False)
  tiny_run.assert_same_run(host, device)  # the same inputs, so the same run, bit for bit
