"""The host input path alone, with no device work (launch/bench.py --suite accelerator's
`host` part): can the host feed the device?

    run_host   the stream setting's input pipeline with data.preprocess 'host' and 'device', and
               the folder source's JPEG decode and resize, each as images/s, per core, steps/s
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from olora_jax import trainer
from olora_jax.benchmarks.stream import stream_config

# The host input path alone (no device work): can the host feed the device?
HOST = {"images": 3200, "jpegs": 256}  # the defaults of --host_images and --host_jpegs
JPEG_SIDES = (300, 600)  # ImageNet-R-like stored sizes (px), each side drawn in this range
JPEG_QUALITY = 90


def _cores() -> int:
  """The CPU cores this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _rate(images: int, seconds: float, threads: int, batch_size: int) -> dict:
  """A host rate: images/s, per core used (the threads, at most the cores there are), and the
  train steps/s of `batch_size` images it can feed."""
  cores = min(threads, _cores())
  return {"images": images, "seconds": seconds, "threads": threads, "cores_used": cores,
          "images_per_s": images / seconds, "images_per_s_per_core": images / seconds / cores,
          "steps_per_s": images / seconds / batch_size}


def _pipeline_rate(args: argparse.Namespace, preprocess: str) -> dict:
  """The stream setting's input pipeline as trainer.Setup builds it with `data.preprocess`, on
  `--host_images` synthetic CIFAR-sized images: every batch pulled from its threads (after one
  batch of warm-up), nothing placed on the device."""
  from olora_jax.data import synthetic

  config = stream_config(args)
  config.data.dataset = synthetic.name(args.host_images, args.stream_classes,
                                       args.stream_classes)
  config.data.preprocess = preprocess
  pipeline = trainer.Setup(config).pipeline
  pipeline.batch(0)
  start = time.perf_counter()
  images = sum(int(batch["mask"].sum()) for batch in pipeline.iterate(0))
  return _rate(images, time.perf_counter() - start, pipeline.threads, pipeline.batch_size)


def _write_jpegs(root: str, n: int, seed: int = 0) -> dict:
  """`n` JPEGs (quality JPEG_QUALITY) of JPEG_SIDES-sized random smooth colour fields with
  pixel-level texture, in one class folder of `root`: their mean size in pixels and bytes."""
  import numpy as np
  from PIL import Image

  rng = np.random.default_rng(seed)
  os.makedirs(os.path.join(root, "class0"))
  sides, sizes = [], []
  for i in range(n):
    height, width = (int(x) for x in rng.integers(JPEG_SIDES[0], JPEG_SIDES[1] + 1, 2))
    field = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    smooth = np.asarray(field.resize((width, height), Image.BICUBIC), np.int16)
    texture = rng.integers(-12, 13, (height, width, 1), dtype=np.int16)
    path = os.path.join(root, "class0", f"{i:05d}.jpg")
    Image.fromarray(np.clip(smooth + texture, 0, 255).astype(np.uint8)).save(
        path, quality=JPEG_QUALITY)
    sides.append((height, width))
    sizes.append(os.path.getsize(path))
  return {"mean_height": float(np.mean([h for h, _ in sides])),
          "mean_width": float(np.mean([w for _, w in sides])),
          "mean_kib": float(np.mean(sizes)) / 1024, "quality": JPEG_QUALITY}


def _jpeg_rates(args: argparse.Namespace, image_size: int, batch_size: int,
                workers: int) -> dict:
  """The folder source's first read of a dataset (folder_sources.resized_images: PIL decode,
  resize to `image_size`, written to its cache) of `--host_jpegs` JPEGs just written (in the
  page cache: no disk read), on one thread and on `workers` (data.num_workers)."""
  from olora_jax.data import folder_sources

  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "jpegs")
    out["files"] = _write_jpegs(root, args.host_jpegs)
    pool = folder_sources.list_image_folder(root)
    cache = folder_sources.cache_dirs(root)[0]  # in `tmp`: writable
    for key, threads in (("jpeg_one_thread", 1), ("jpeg_all_threads", workers)):
      start = time.perf_counter()
      folder_sources.resized_images(pool, image_size, threads, "bench")
      out[key] = _rate(len(pool.paths), time.perf_counter() - start, threads, batch_size)
      shutil.rmtree(cache)  # the next read decodes again
  return out


def run_host(args: argparse.Namespace) -> dict:
  """The host input path of the stream's setting, without the device: its pipeline with
  data.preprocess 'host' (CIFAR-sized uint8 resized to the model's input here) and 'device' (the
  host only gathers uint8), and JPEG decoding and resizing at ImageNet-R-like sizes."""
  from olora_jax.data import synthetic

  config = stream_config(args)
  image_size, batch_size = config.model.image_size, config.learner.batch_size
  report = {"cores": _cores(), "image_size": image_size, "batch_size": batch_size,
            "stored_image_size": synthetic.IMAGE_SHAPE[0], "pipeline_host": None,
            "pipeline_device": None, "jpeg_one_thread": None, "jpeg_all_threads": None,
            "jpeg_files": None}
  if args.host_images:
    for preprocess in ("host", "device"):
      report[f"pipeline_{preprocess}"] = _pipeline_rate(args, preprocess)
  if args.host_jpegs:
    rates = _jpeg_rates(args, image_size, batch_size, config.data.num_workers)
    report["jpeg_files"] = rates.pop("files")
    report.update(rates)
  return report
