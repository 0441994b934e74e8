"""Tests of the folder source (olora_jax/data/folder_sources.py, `data.source='folder'`) on
generated trees with the benchmarks' real layouts: ImageNet-R's 200 WordNet-id folders (one tree,
and the authors' train/ and test/ trees), CUB-200-2011 with images.txt and train_test_split.txt,
CORe50's sessions, CIFAR-100's pickles; the cache of resized images; bad input; and a run through
launch/run.py killed with SIGKILL and resumed."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest
import tiny_run
from data_fixtures import write_core50_folder
from PIL import Image

from configs import common
from olora_jax import errors
from olora_jax.data import folder_sources, manifest, sources, splits, streams
from olora_jax.data.preprocess import resize_image

WNIDS = folder_sources.IMAGENET_R_WNIDS  # the 200 ImageNet-R classes, sorted
SIZE = 16


def _data_config(**overrides):
  c = common.get_config().data
  c.source = "folder"
  for k, v in overrides.items():
    c[k] = v
  return c


def _write_jpegs(folder: str, names, rng, shape=(10, 12)) -> None:
  os.makedirs(folder, exist_ok=True)
  for name in names:
    pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(os.path.join(folder, name), quality=90)


def _imagenet_r(root: str, per_class: int = 3) -> str:
  """imagenet-r/<wnid>/<name>.jpg, names in the dataset's style, `per_class` per class."""
  rng = np.random.default_rng(0)
  for k, wnid in enumerate(WNIDS):
    _write_jpegs(os.path.join(root, wnid), [f"{kind}_{k}.jpg" for kind in
                                            ("art", "cartoon", "sketch", "toy", "tattoo")
                                            [:per_class]], rng, (8 + k % 3, 9))
  return root


@pytest.fixture(scope="module")
def imagenet_r(tmp_path_factory):
  return _imagenet_r(str(tmp_path_factory.mktemp("inr") / "imagenet-r"))


@pytest.fixture(scope="module")
def imagenet_r_split(tmp_path_factory, imagenet_r):
  """The authors' layout: imagenet-r/train/<wnid> and imagenet-r/test/<wnid>, moved once."""
  root = str(tmp_path_factory.mktemp("inr_split") / "imagenet-r")
  for wnid in WNIDS:
    files = sorted(os.listdir(os.path.join(imagenet_r, wnid)))
    for split, names in (("train", files[1:]), ("test", files[:1])):
      os.makedirs(os.path.join(root, split, wnid))
      for name in names:
        shutil.copy(os.path.join(imagenet_r, wnid, name), os.path.join(root, split, wnid, name))
  return root


def _image_folder_samples(root: str) -> list[tuple[str, int]]:
  """torchvision's ImageFolder(root).samples, written out: sorted class folders, a sorted
  recursive walk of each, files sorted."""
  classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
  samples = []
  for label, name in enumerate(classes):
    for folder, _, files in sorted(os.walk(os.path.join(root, name))):
      samples += [(os.path.relpath(os.path.join(folder, f), root), label) for f in sorted(files)
                  if f.lower().endswith(folder_sources.IMAGE_EXTENSIONS)]
  return samples


def test_image_folder_classes_and_record_ids_are_torchvisions(imagenet_r):
  train, test = sources.load_sources(_data_config(dataset="imagenet_r", data_dir=imagenet_r),
                                     SIZE)
  samples = _image_folder_samples(imagenet_r)
  assert train.num_classes == test.num_classes == 200
  assert train.class_names == WNIDS
  for source in (train, test):  # record id i is ImageFolder's sample i
    assert list(source.paths) == [samples[i][0] for i in source.record_ids]
    assert source.labels.tolist() == [samples[i][1] for i in source.record_ids]
  # One tree: the project's seeded stratified split, 20% of every class.
  labels = np.array([label for _, label in samples])
  train_ids, test_ids = splits.stratified_split(labels, 0.2, 0)
  assert train.record_ids.tolist() == train_ids.tolist()
  assert test.record_ids.tolist() == test_ids.tolist()
  assert train.seeded_split and test.seeded_split
  assert np.bincount(test.labels).tolist() == [1] * 200  # round(0.2 * 3) = 1 per class
  other, _ = sources.load_sources(
      _data_config(dataset="imagenet_r", data_dir=imagenet_r, split_seed=1), SIZE)
  assert other.record_ids.tolist() != train.record_ids.tolist()
  # Images: decoded (RGB) and resized as the TFDS source resizes them; raw at the stored size.
  images, labels = train.get(np.array([0, 5]))
  assert images.shape == (2, SIZE, SIZE, 3) and images.dtype == np.uint8
  for image, path in zip(images, [train.paths[0], train.paths[5]], strict=True):
    stored = np.asarray(Image.open(os.path.join(imagenet_r, path)).convert("RGB"))
    assert np.array_equal(image, resize_image(stored, SIZE))
  raw, _ = train.get_raw(np.array([0]))
  assert raw[0].shape[2] == 3 and raw[0].shape[:2] == Image.open(
      os.path.join(imagenet_r, train.paths[0])).size[::-1]
  assert train.raw_image_shape is None  # the generated images have two heights


def test_authors_train_test_trees_are_used_as_they_are(imagenet_r_split):
  train, test = sources.load_sources(
      _data_config(dataset="imagenet_r", data_dir=imagenet_r_split), SIZE)
  assert not train.seeded_split
  for split, source in (("train", train), ("test", test)):
    samples = _image_folder_samples(os.path.join(imagenet_r_split, split))
    assert source.record_ids.tolist() == list(range(len(samples)))
    assert list(source.paths) == [f"{split}/{p}" for p, _ in samples]
    assert source.labels.tolist() == [label for _, label in samples]
  assert (len(train), len(test)) == (400, 200)


def test_cache_serves_a_second_run_without_decoding(tmp_path, monkeypatch):
  root = _imagenet_r(str(tmp_path / "imagenet-r"), per_class=2)
  config = _data_config(dataset="imagenet_r", data_dir=root)
  first, first_test = sources.load_sources(config, SIZE)
  cache = tmp_path / folder_sources.CACHE_DIR_NAME
  names = sorted(p.name for p in cache.iterdir())  # images, their sizes, the image digests
  assert sorted(n.split(".", 1)[1] for n in names) == ["digests.npy", "npy", "sizes.npy"], names
  all_ids = np.arange(len(first))
  expected = first.get(all_ids)[0]

  def no_decoding(path):
    raise AssertionError(f"{path} was decoded although the cache holds it")

  monkeypatch.setattr(folder_sources, "decode", no_decoding)
  second, second_test = sources.load_sources(config, SIZE)
  assert np.array_equal(second.get(all_ids)[0], expected)
  stream = streams.build_stream(config, first, 32, 0)
  made = [manifest.stream_manifest(config, 0, 32, stream, a, b)
          for a, b in ((first, first_test), (second, second_test))]
  assert made[0] == made[1]
  assert made[0]["step_paths"][0] == [first.paths[i] for i in stream.steps[0]]
  assert made[0]["source"] == "imagenet_r:folder-split"
  replayed = manifest.replay_stream(made[0], second, second_test, 32)
  assert all(np.array_equal(a, b) for a, b in zip(replayed.steps, stream.steps, strict=True))
  # A changed file is a new cache (its size and modification time are part of the key).
  monkeypatch.undo()
  path = os.path.join(root, first.paths[0])
  Image.fromarray(np.zeros((7, 7, 3), np.uint8)).save(path)
  third, _ = sources.load_sources(config, SIZE)
  assert len(list(cache.iterdir())) == 6
  assert third.digests[0] != first.digests[0] and np.array_equal(third.digests[1:],
                                                                 first.digests[1:])
  assert np.array_equal(third.get(np.array([0]))[0][0], np.zeros((SIZE, SIZE, 3), np.uint8))
  # The manifest names the files: one recorded on another folder is refused.
  edited = json.loads(json.dumps(made[0]))
  edited["step_paths"][0][0] = "n00000000/other.jpg"
  with pytest.raises(manifest.ManifestError, match="step 0's step_paths differ"):
    manifest.replay_stream(edited, second, second_test, 32)


def test_a_full_disk_fails_the_cache_build_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
  """The cache's space is reserved before the first image is written (a sparse memmap on a full
  disk ended the process with SIGBUS): ENOSPC is an environment failure (exit 4) naming the
  folder and the size, with no temporary file and no cache folder left."""
  root = _imagenet_r(str(tmp_path / "imagenet-r"), per_class=2)
  config = _data_config(dataset="imagenet_r", data_dir=root)

  def full(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "posix_fallocate", full)
  with pytest.raises(errors.EnvironmentFailure, match=r"cannot cache the 400 images resized to"
                     r" 16 px \(0\.3 MiB\) in .* \(No space left on device\); free"):
    sources.load_sources(config, SIZE)
  assert not (tmp_path / folder_sources.CACHE_DIR_NAME).exists()


def test_a_full_disk_while_the_digests_are_kept_is_exit_4_naming_the_file(tmp_path, monkeypatch):
  """np.save on a full disk raises an OSError without errno ('<n> requested and <m> written'):
  still a storage failure (exit 4) naming the file, with no temporary file left."""
  root = _imagenet_r(str(tmp_path / "imagenet-r"), per_class=2)
  config = _data_config(dataset="imagenet_r", data_dir=root)
  save = np.save

  def short_write(file, array, *args, **kwargs):
    if ".digests." not in str(file):
      return save(file, array, *args, **kwargs)
    with open(file, "wb") as f:
      f.write(b"\x93NUMPY" + bytes(249))  # what reached the disk
    raise OSError("500 requested and 255 written")

  monkeypatch.setattr(np, "save", short_write)
  cache = tmp_path / folder_sources.CACHE_DIR_NAME
  with pytest.raises(errors.EnvironmentFailure, match=(
      rf"imagenet_r: cannot keep the image digests in {re.escape(str(cache))}/imagenet_r-\w+"
      r"\.digests\.npy \(No space left on device \(a short write\)\); free space on that"
      r" disk, then run the same command")) as e:
    sources.load_sources(config, SIZE)
  assert e.value.exit_code == errors.EXIT_ENVIRONMENT
  assert not [p.name for p in cache.iterdir() if ".tmp" in p.name or "digests" in p.name]


def test_temporary_files_of_a_killed_cache_build_are_removed_by_the_next_run(tmp_path):
  root = _imagenet_r(str(tmp_path / "imagenet-r"), per_class=2)
  config = _data_config(dataset="imagenet_r", data_dir=root)
  sources.load_sources(config, SIZE)
  cache = tmp_path / folder_sources.CACHE_DIR_NAME
  built = sorted(p.name for p in cache.iterdir())
  images = next(n for n in built if n.endswith("px.npy"))[:-len(".npy")]
  digests = next(n for n in built if n.endswith(".digests.npy"))
  dead = 2**22 + 1  # above Linux's default pid_max: no such process
  stale = [f"{images}.{dead}.tmp.npy", f"{images}.{dead}.tmp.sizes.npy",
           f"{digests}.{dead}.tmp.npy"]
  live = f"{images}.{os.getpid()}.tmp.npy"  # a build still running (this process)
  for name in (*stale, live):
    (cache / name).write_bytes(b"x")
  sources.load_sources(config, SIZE)
  assert sorted(p.name for p in cache.iterdir()) == sorted([*built, live])


def test_cache_goes_to_the_users_cache_when_the_data_folder_is_read_only(tmp_path, monkeypatch,
                                                                         caplog):
  root = tmp_path / "data" / "pets"
  rng = np.random.default_rng(0)
  for name in ("cat", "dog"):
    _write_jpegs(str(root / name), ["0.jpg", "1.jpg"], rng)
  beside = str(tmp_path / "data" / folder_sources.CACHE_DIR_NAME)
  writable = folder_sources._writable_dir
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home_cache"))
  monkeypatch.setattr(folder_sources, "_writable_dir", lambda d: d != beside and writable(d))
  config = _data_config(dataset="pets", data_dir=str(root))
  train, _ = sources.load_sources(config, SIZE)
  assert len(os.listdir(tmp_path / "home_cache" / "olora_jax" / "images")) == 3
  assert not os.path.exists(beside)
  # Nowhere writable: decoded into memory on every run, with a warning; the same images.
  monkeypatch.setattr(folder_sources, "_writable_dir", lambda d: False)
  shutil.rmtree(tmp_path / "home_cache")
  again, _ = sources.load_sources(config, SIZE)
  assert "no writable cache folder" in caplog.text
  ids = np.arange(len(train))
  assert np.array_equal(again.get(ids)[0], train.get(ids)[0])


def _cub(root: str, n_classes: int = 200, per_class: int = 2) -> str:
  """CUB_200_2011/ with images/<NNN.Name>/*.jpg, images.txt and train_test_split.txt."""
  base = os.path.join(root, "CUB_200_2011")
  rng = np.random.default_rng(1)
  lines, split = [], []
  for k in range(1, n_classes + 1):
    folder = f"{k:03d}.Bird_{k}"
    names = [f"Bird_{k}_{j:04d}_{100 + j}.jpg" for j in range(per_class)]
    _write_jpegs(os.path.join(base, "images", folder), names, rng, (6, 6))
    lines += [f"{folder}/{name}" for name in names]
  # images.txt as shipped: ids 1..N in folder order; every third image is a test image.
  with open(os.path.join(base, "images.txt"), "w") as f:
    f.writelines(f"{i} {p}\n" for i, p in enumerate(lines, 1))
  split = [int(i % 3 != 0) for i in range(1, len(lines) + 1)]
  with open(os.path.join(base, "train_test_split.txt"), "w") as f:
    f.writelines(f"{i} {s}\n" for i, s in enumerate(split, 1))
  return root


@pytest.fixture(scope="module")
def cub(tmp_path_factory):
  return _cub(str(tmp_path_factory.mktemp("cub")))


def test_cub_follows_its_split_file(cub):
  root = cub
  train, test = sources.load_sources(_data_config(dataset="caltech_birds2011", data_dir=root),
                                     SIZE)
  assert train.num_classes == 200 and train.class_names[0] == "001.Bird_1"
  ids = np.arange(1, 401)  # images.txt ids; record id = id - 1
  assert train.record_ids.tolist() == (ids[ids % 3 != 0] - 1).tolist()
  assert test.record_ids.tolist() == (ids[ids % 3 == 0] - 1).tolist()
  assert train.labels.tolist() == ((ids[ids % 3 != 0] - 1) // 2).tolist()
  assert test.paths[0] == "images/002.Bird_2/Bird_2_0000_100.jpg"  # id 3
  assert train.raw_image_shape == (6, 6, 3) and not train.seeded_split


@pytest.fixture(scope="module")
def core50(tmp_path_factory):
  return write_core50_folder(str(tmp_path_factory.mktemp("core50")), frames=1, size=4)


def test_core50_sessions_are_the_domains(core50):
  root = core50
  config = _data_config(dataset="core50", data_dir=root, scenario="domain",
                        core50_order="sequential")
  train, test = sources.load_sources(config, SIZE)
  assert train.num_classes == 50 and train.raw_image_shape == (4, 4, 3)
  assert np.unique(train.domains).tolist() == list(folder_sources.CORE50_TRAIN_SESSIONS)
  assert np.unique(test.domains).tolist() == list(folder_sources.CORE50_TEST_SESSIONS)
  assert np.array_equal(train.metadata["session"], train.domains)
  assert train.paths[0] == "core50_128x128/s1/o1/C_01_01_000.png"
  assert train.paths[50] == "core50_128x128/s2/o1/C_02_01_000.png"  # s3 is a test session
  assert test.paths[0] == "core50_128x128/s3/o1/C_03_01_000.png"
  assert train.labels[:50].tolist() == list(range(50))
  stream = streams.build_stream(config, train, 16, 0)  # one task per session, in order
  assert stream.task_domains.tolist() == list(folder_sources.CORE50_TRAIN_SESSIONS)


def _cifar100(root, sizes=(("train", 300), ("test", 100))) -> dict:
  """cifar-100-python/train and /test as the python pickles hold them; returns what they hold."""
  base = root / "cifar-100-python"
  base.mkdir()
  rng = np.random.default_rng(2)
  stored = {}
  for split, n in sizes:
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = (np.arange(n) % 100).tolist()
    table = {b"data": images.transpose(0, 3, 1, 2).reshape(n, 3072), b"fine_labels": labels,
             b"coarse_labels": [0] * n, b"filenames": [b"x.png"] * n}
    with open(base / split, "wb") as f:
      pickle.dump(table, f)
    stored[split] = images, labels
  return stored


def test_cifar100_pickles(tmp_path):
  stored = _cifar100(tmp_path)
  train, test = sources.load_sources(_data_config(dataset="cifar100", data_dir=str(tmp_path)),
                                     SIZE)
  for source, split in ((train, "train"), (test, "test")):
    images, labels = source.get(np.arange(len(source)))
    assert np.array_equal(images, stored[split][0])  # rows in pickle order, HWC
    assert source.labels.tolist() == stored[split][1]
    assert source.record_ids.tolist() == list(range(len(source)))
  assert train.num_classes == 100 and train.raw_image_shape == (32, 32, 3)
  assert train.paths is None  # the id is the pickle's row
  assert not (tmp_path / folder_sources.CACHE_DIR_NAME).exists()


BENCHMARKS = {  # config -> the fixture of its dataset's folder
    "split_cifar100": "cifar", "si_blurry_cifar100": "cifar", "split_cub200": "cub",
    "split_imagenet_r": "imagenet_r_split", "si_blurry_imagenet_r": "imagenet_r",
    "split_imagenet_s": "sketch", "split_imagenet_s20": "sketch", "si_blurry_imagenet_s": "sketch",
    "core50": "core50"}


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
  root = tmp_path_factory.mktemp("cifar")
  _cifar100(root, (("train", 300), ("test", 100)))
  return str(root)


@pytest.fixture(scope="module")
def sketch(tmp_path_factory):
  """sketch/<wnid>/*.JPEG: 1000 class folders (WordNet-id-like names), two images each."""
  root = tmp_path_factory.mktemp("sketch") / "sketch"
  rng = np.random.default_rng(3)
  for k in range(1000):
    _write_jpegs(str(root / f"n{1440764 + 7919 * k:08d}"), ["sketch_0.JPEG", "sketch_1.JPEG"],
                 rng, (4, 4))
  return str(root)


@pytest.mark.parametrize("setting", sorted(BENCHMARKS))
def test_every_benchmark_config_reads_its_folder(setting, request):
  """`--config.data.source=folder` and the folder: the setting's sources and stream, no TFDS."""
  config = __import__(f"configs.{setting}", fromlist=["get_config"]).get_config()
  config.data.source = "folder"
  config.data.data_dir = request.getfixturevalue(BENCHMARKS[setting])
  train, test = sources.load_sources(config.data, SIZE)
  assert train.num_classes == folder_sources.BENCHMARK_CLASSES[config.data.dataset]
  assert train.version.startswith(f"{config.data.dataset}:folder-")
  stream = streams.build_stream(config.data, train, config.learner.batch_size, config.seed)
  made = manifest.stream_manifest(config.data, config.seed, config.learner.batch_size, stream,
                                  train, test)
  assert sum(len(ids) for ids in stream.steps) == len(train)
  assert ("step_paths" in made) == (config.data.dataset != "cifar100")


def _refused(match: str, **overrides) -> None:
  with pytest.raises((errors.BadInput, FileNotFoundError, ValueError)) as raised:
    sources.load_sources(_data_config(**overrides), SIZE)
  assert "\n" not in str(raised.value)
  assert re.search(match, str(raised.value)), str(raised.value)


def test_bad_folders_are_refused_in_one_line(tmp_path):
  flat = tmp_path / "flat"
  _write_jpegs(str(flat), ["a.jpg"], np.random.default_rng(0))
  _refused(r"flat holds no class folders", dataset="mine", data_dir=str(flat))
  empty = tmp_path / "empty"
  _write_jpegs(str(empty / "cat"), ["a.jpg"], np.random.default_rng(0))
  (empty / "dog").mkdir()
  (empty / "dog" / "notes.txt").write_text("no image here")
  _refused(r"class folder .*empty/dog holds no image", dataset="mine", data_dir=str(empty))
  pair = tmp_path / "pair"
  for split, classes in (("train", ("cat", "dog", "owl")), ("test", ("cat", "dog", "yak"))):
    for name in classes:
      _write_jpegs(str(pair / split / name), ["a.jpg"], np.random.default_rng(0))
  _refused(r"different class folders \(only in train: owl; only in test: yak\)",
           dataset="mine", data_dir=str(pair))
  cub = _cub(str(tmp_path / "cub"), n_classes=2, per_class=1)
  os.remove(os.path.join(cub, "CUB_200_2011", "train_test_split.txt"))
  _refused(r"train_test_split.txt is missing", dataset="caltech_birds2011", data_dir=cub)
  _refused(r"data.dataset='imagenet_r' but .* does not hold the 200 ImageNet-R class folders"
           r" \(missing n01443537, n01484850, n01494475, n01498041 and 196 more, not ImageNet-R"
           r" cat, dog, owl\)", dataset="imagenet_r", data_dir=str(pair / "train"))
  _refused(r"data.source='folder' needs data.data_dir", dataset="mine", data_dir="")
  _refused(r"unknown data.source='disk'", dataset="mine", source="disk")
  _refused(r"data.dataset='mnist_5k' is loaded by the project", dataset="mnist_5k")


def test_truncated_image_is_named_and_refused_before_compute(tmp_path):
  """Through launch/run.py: exit 2, one line naming the file, nothing in the workdir, no cache."""
  root = tmp_path / "pets"
  rng = np.random.default_rng(0)
  for name in ("cat", "dog"):
    _write_jpegs(str(root / name), [f"{k}.jpg" for k in range(3)], rng, (20, 20))
  bad = root / "dog" / "1.jpg"
  bad.write_bytes(bad.read_bytes()[:200])  # cut short
  workdir = tmp_path / "run"
  done = subprocess.run(tiny_run.command(workdir, "--config.data.dataset=pets",
                                         "--config.data.source=folder",
                                         f"--config.data.data_dir={root}"),
                        cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == errors.EXIT_BAD_INPUT, done.stderr[-2000:]
  line = tiny_run.last_line(done.stderr)
  assert line.startswith(f"error: cannot read the image {bad} (OSError:"), line
  assert not workdir.exists() or not any(workdir.iterdir())
  assert not (tmp_path / folder_sources.CACHE_DIR_NAME).exists()  # no cache folder, no half cache


def _digits_folder(root: str) -> str:
  """scikit-learn's 1,797 digits as a 10-class ImageFolder tree of 8x8 PNGs (the tiny run's
  data, so its programs are the compiled ones of the session's tiny runs)."""
  train, test = sources.load_source("sklearn_digits", "train"), sources.load_source(
      "sklearn_digits", "test")
  for source in (train, test):
    for row, image, label in zip(source.record_ids, source.images, source.labels, strict=True):
      os.makedirs(os.path.join(root, str(label)), exist_ok=True)
      Image.fromarray(image[..., 0]).save(os.path.join(root, str(label), f"{row:04d}.png"))
  return root


def test_run_from_a_folder_resumes_after_sigkill_identical(tmp_path, compilation_cache):
  root = _digits_folder(str(tmp_path / "digits"))
  extra = ("--config.data.dataset=digits", "--config.data.source=folder",
           f"--config.data.data_dir={root}")
  reference = tmp_path / "reference"
  done = subprocess.run(tiny_run.command(reference, *extra), cwd=tiny_run.ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=tiny_run.env(compilation_cache))
  assert done.returncode == 0, done.stderr[-2000:]
  assert (tmp_path / folder_sources.CACHE_DIR_NAME).is_dir()  # the first run made the cache
  workdir = tmp_path / "run"  # from the cache, killed, then resumed
  killed = tiny_run.stop_after_checkpoint(workdir, 8, signal.SIGKILL, compilation_cache, *extra)
  assert killed.returncode == -signal.SIGKILL
  assert 8 <= tiny_run.steps(workdir)[-1] < tiny_run.N_STEPS
  done = subprocess.run(tiny_run.command(workdir, *extra), cwd=tiny_run.ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=tiny_run.env(compilation_cache))
  assert done.returncode == 0, done.stderr[-2000:]
  tiny_run.assert_same_run(workdir, reference)
  made = (reference / "stream_manifest.json").read_bytes()
  assert (workdir / "stream_manifest.json").read_bytes() == made
  recorded = json.loads(made)
  assert recorded["source"] == "digits:folder-split"
  assert len(recorded["step_paths"]) == tiny_run.N_STEPS
  assert recorded["test"]["paths"][0].startswith("0/")  # test ids index the same tree


def test_tfds_preparation_names_what_it_needs(tmp_path, monkeypatch):
  from olora_jax.data import core50, tfds_sources  # TFDS only here

  with pytest.raises(FileNotFoundError) as raised:
    tfds_sources.open_data_source("imagenet_r", "test", str(tmp_path))
  assert tfds_sources.TFDS_BUILD_INSTALL in str(raised.value)
  assert "--config.data.source=folder" in str(raised.value)
  real = core50.importlib.util.find_spec
  monkeypatch.setattr(core50.importlib.util, "find_spec",
                      lambda name, *a: None if name == "array_record" else real(name, *a))
  with pytest.raises(ModuleNotFoundError, match=r"needs the package array_record: `pip install"
                     r" array_record`"):
    core50.build(str(tmp_path), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_16_bit_images_keep_their_top_8_bits_and_gifs_are_named_when_left_out(tmp_path, caplog):
  grey = (np.arange(64).reshape(8, 8) * 1000).astype(np.uint16)  # 0 .. 63,000
  Image.fromarray(grey).save(tmp_path / "g16.png")
  decoded = folder_sources.decode(str(tmp_path / "g16.png"))
  assert decoded.shape == (8, 8, 3) and decoded.dtype == np.uint8
  assert np.array_equal(decoded[..., 0], grey >> 8)  # not clipped to white by convert('RGB')
  root = tmp_path / "pets"
  _write_jpegs(str(root / "cat"), ["0.jpg", "1.jpg"], np.random.default_rng(0))
  Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "cat" / "2.gif")
  with caplog.at_level("WARNING"):
    pool = folder_sources.list_image_folder(str(root))
  assert pool.paths == ("cat/0.jpg", "cat/1.jpg")  # as torchvision's ImageFolder
  assert any("1 image(s) of a format the ImageFolder layout does not read (.gif) are left out,"
             " e.g. 2.gif; convert them to PNG" in r.getMessage() for r in caplog.records)
