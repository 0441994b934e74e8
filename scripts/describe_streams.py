"""Prints a Markdown table of the streams that benchmark configs build: tasks, classes and samples
per task, steps, and the stream manifest's SHA-256. Reads only labels (no model, no checkpoint).

On prepared data:

    .venv/bin/python scripts/describe_streams.py --data_dir DIR \
        configs/split_cifar100.py configs/core50.py

Without data, on TFDS mock data (random labels: the shape of each stream, not its real sizes) and
a generated CORe50-layout folder with `--core50_frames` frames per object and session:

    .venv/bin/python scripts/describe_streams.py --mock_examples 2000 --core50_frames 2 configs/*.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from PIL import Image  # noqa: E402

from olora_jax.data import core50, manifest, sources, streams  # noqa: E402


def load_config(path: str):
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def write_core50(root: str, frames: int) -> None:
  rng = np.random.default_rng(0)
  for s in range(1, 12):
    for o in range(1, core50.NUM_OBJECTS + 1):
      folder = pathlib.Path(root, "core50_128x128", f"s{s}", f"o{o}")
      folder.mkdir(parents=True, exist_ok=True)
      for f in range(frames):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)).save(
            folder / f"C_{s:02d}_{o:02d}_{f:03d}.png")


def _span(values) -> str:
  values = np.asarray(values)
  if values.min() == values.max():
    return f"{values.min()} each"
  return f"{values.min()}-{values.max()} ({', '.join(map(str, values))})"


def describe(config) -> str:
  train, test = sources.load_sources(config.data, 8)
  stream = streams.build_stream(config.data, train, config.learner.batch_size, config.seed)
  m = manifest.stream_manifest(config.data, config.seed, config.learner.batch_size, stream, train,
                               test)
  classes = [len(c) for c in stream.task_classes]
  return (f"{config.data.dataset} | {config.data.scenario} | {stream.n_tasks} | {_span(classes)} |"
          f" {_span(stream.task_sizes())} | {len(stream.steps)} | {len(test)} |"
          f" `{manifest.manifest_sha256(m)[:16]}`")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("configs", nargs="+")
  parser.add_argument("--data_dir", default="")
  parser.add_argument("--mock_examples", type=int, default=0,
                      help="> 0: TFDS datasets are tfds.testing.mock_data with this many records")
  parser.add_argument("--core50_frames", type=int, default=0,
                      help="> 0: CORe50 is built from a generated folder with this many frames")
  args = parser.parse_args()
  tmp = tempfile.mkdtemp()
  core50_dir = args.data_dir
  if args.core50_frames > 0:
    write_core50(f"{tmp}/manual", args.core50_frames)
    core50.build(f"{tmp}/manual", f"{tmp}/tfds")
    core50_dir = f"{tmp}/tfds"
  print("| config | dataset | scenario | tasks | classes per task | samples per task | steps |"
        " test samples | manifest sha256 |")
  print("|---|---|---|---|---|---|---|---|---|")
  for path in args.configs:
    config = load_config(path)
    if config.data.dataset in sources.EMBEDDED_DATASETS:
      mock = contextlib.nullcontext()
    elif config.data.dataset == "core50":
      config.data.data_dir, mock = core50_dir, contextlib.nullcontext()
    else:
      config.data.data_dir = args.data_dir
      mock = (tfds.testing.mock_data(num_examples=args.mock_examples) if args.mock_examples > 0
              else contextlib.nullcontext())
    with mock:
      print(f"| {pathlib.Path(path).stem} | {describe(config)} |", flush=True)


if __name__ == "__main__":
  main()
