"""A stream manifest recorded on one source replays on another holding the same images
(olora_jax/data/manifest.py: `translate_manifest`, olora_jax/data/digests.py).

CORe50 is read twice from one generated folder: through TFDS (our builder writes the PNGs into
array_record files, nothing downloaded) and as a folder (`data.source=folder`); the two number
their records differently (TFDS shuffles them). CIFAR-100 is read from its pickles and from a
train/ and test/ tree of PNGs holding the same pixels. Old manifests, without digests, replay as
before; other images are refused in one line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tiny_run
from data_fixtures import no_network, write_core50_folder  # noqa: F401
from PIL import Image

from configs import common
from olora_jax import trainer
from olora_jax.data import digests, manifest, sources

pytestmark = pytest.mark.usefixtures("no_network")
SIZE = 16
DIGEST_FIELDS = ("digest", "step_digests")


def _data(root: str, source: str, **overrides):
  c = common.get_config().data
  c.update({"dataset": "core50", "scenario": "domain", "core50_order": "sequential",
            "num_workers": 2, "source": source, "data_dir": root, **overrides})
  return c


@pytest.fixture(scope="module")
def core50(tmp_path_factory):
  """{'folder': the CORe50 folder, 'tfds': the TFDS dataset our builder made from it}."""
  from olora_jax.data import core50 as builder  # TFDS only here

  root = tmp_path_factory.mktemp("core50")
  folder = write_core50_folder(str(root / "manual"), frames=1, size=4)
  builder.build(folder, str(root / "tfds"))
  return {"folder": folder, "tfds": str(root / "tfds")}


def _replay(m: dict, tmp_path, config, name="m.json"):
  """(stream, written manifest, train, test) of replaying `m` with data `config`."""
  path = tmp_path / name
  path.write_text(json.dumps(m))
  config.stream_manifest = str(path)
  train, test = sources.load_sources(config, SIZE)
  return manifest.build_stream_and_manifest(config, 0, 16, train, test)


def _same_batches(a, b, get: str = "get") -> None:
  """Streams (stream, train, test) `a` and `b` feed the same images and labels at every step,
  and test on the same images, labels and domains in the same order (`get`: at the model's size;
  `get_raw`: as stored)."""
  (sa, ta, ea), (sb, tb, eb) = a, b
  assert len(sa.steps) == len(sb.steps) and np.array_equal(sa.step_task, sb.step_task)
  pairs = [(getattr(ta, get)(x), getattr(tb, get)(y))
           for x, y in zip(sa.steps, sb.steps, strict=True)]
  everything = np.arange(len(ea))
  assert len(ea) == len(eb)
  pairs.append((getattr(ea, get)(everything), getattr(eb, get)(everything)))
  for (images_a, labels_a), (images_b, labels_b) in pairs:
    assert np.array_equal(labels_a, labels_b)
    assert len(images_a) == len(images_b)
    assert all(np.array_equal(u, v) for u, v in zip(images_a, images_b, strict=True))
  assert (ea.domains is None and eb.domains is None) or np.array_equal(ea.domains, eb.domains)


def test_a_stream_replays_on_the_other_source_both_ways(core50, tmp_path):
  """TFDS -> folder -> TFDS, and folder -> TFDS: the same batches, the digests kept, and the way
  back writes the first manifest's very bytes."""
  tfds_data, folder_data = _data(core50["tfds"], "tfds"), _data(core50["folder"], "folder")
  tfds_train, tfds_test = sources.load_sources(tfds_data, SIZE)
  stream, recorded, _, _ = manifest.build_stream_and_manifest(tfds_data, 0, 16, tfds_train,
                                                             tfds_test)
  assert recorded["source"] == "core50:1.0.0" and recorded["digest"] == digests.FILE
  # A TFDS digest is the SHA-256 of the very file the builder stored.
  first = recorded["step_digests"][0][0]
  with open(os.path.join(core50["folder"], _path_of(folder_data, first)), "rb") as f:
    assert digests.of_bytes(f.read()) == first
  there, on_folder, folder_train, folder_test = _replay(recorded, tmp_path, folder_data)
  assert on_folder["source"] == "core50:folder-core50"
  assert on_folder["steps"] != recorded["steps"]  # the folder numbers its files otherwise
  for key in ("step_digests", "step_labels", "step_task", "task_classes", "params"):
    assert on_folder[key] == recorded[key]
  assert on_folder["test"]["digests"] == recorded["test"]["digests"]
  assert on_folder["step_paths"][0][0] == _path_of(folder_data, first)
  _same_batches((stream, tfds_train, tfds_test), (there, folder_train, folder_test))
  back, on_tfds, _, _ = _replay(on_folder, tmp_path, _data(core50["tfds"], "tfds"), "f.json")
  assert manifest.canonical_bytes(on_tfds) == manifest.canonical_bytes(recorded)
  # Recorded on the folder, replayed on TFDS.
  folder_train, folder_test = sources.load_sources(_data(core50["folder"], "folder"), SIZE)
  own, from_folder, _, _ = manifest.build_stream_and_manifest(
      _data(core50["folder"], "folder"), 1, 16, folder_train, folder_test)
  assert from_folder["steps"] != on_folder["steps"]  # another seed, another stream
  replayed, _, tfds_train, tfds_test = _replay(from_folder, tmp_path, _data(core50["tfds"], "tfds"),
                                               "g.json")
  _same_batches((own, folder_train, folder_test), (replayed, tfds_train, tfds_test))


def _path_of(folder_data, digest: str) -> str:
  train, _ = sources.load_sources(folder_data, SIZE)
  return train.paths[int(np.flatnonzero(train.digests == digest)[0])]


def test_replayed_runs_on_the_other_source_give_the_same_results(core50, tmp_path):
  """Recorded on TFDS, replayed on the folder, that run's manifest replayed on TFDS: one
  results.json and metrics.jsonl (but for the stream's own ids), and the first manifest's bytes."""
  config = tiny_run.config()
  config.eval.eval_every = 8
  config.checkpoint_every = 0

  def run(workdir, source, manifest_path=""):
    c = config.copy_and_resolve_references()
    c.data.update(dataset="core50", scenario="domain", core50_order="sequential", source=source,
                  data_dir=core50[source], stream_manifest=manifest_path)
    trainer.train_and_evaluate(c, str(workdir), progress=False)
    return tiny_run.results(workdir), (workdir / "metrics.jsonl").read_bytes()

  tfds_run = run(tmp_path / "tfds", "tfds")
  folder_run = run(tmp_path / "folder", "folder", str(tmp_path / "tfds" / "stream_manifest.json"))
  back_run = run(tmp_path / "back", "tfds", str(tmp_path / "folder" / "stream_manifest.json"))
  # The stream's hashes name record ids, which differ between the sources; nothing else does.
  stream_keys = ("stream_sha256", "stream_manifest_sha256")
  strip = lambda r: {k: v for k, v in r.items() if k not in stream_keys}  # noqa: E731
  assert strip(folder_run[0]) == strip(tfds_run[0]) and folder_run[1] == tfds_run[1]
  assert back_run == tfds_run
  assert tfds_run[0]["n_steps"] == 16 and len(tfds_run[0]["acc_matrix"]) == 8
  assert ((tmp_path / "back" / "stream_manifest.json").read_bytes()
          == (tmp_path / "tfds" / "stream_manifest.json").read_bytes())


def _recorded_on_tfds(core50):
  data = _data(core50["tfds"], "tfds")
  train, test = sources.load_sources(data, SIZE)
  return manifest.build_stream_and_manifest(data, 0, 16, train, test)[1]


def test_other_images_are_refused_in_one_line(core50, tmp_path):
  recorded = _recorded_on_tfds(core50)
  other = str(tmp_path / "other")
  shutil.copytree(core50["folder"], other)
  changed = "core50_128x128/s4/o7/C_04_07_000.png"  # a training image: session 4
  Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(os.path.join(other, changed))
  for edit, match in (
      (None, r"m.json: 1 of the manifest's 400 training images are not in"
             r" 'core50:folder-core50' \(e.g. example id \d+, digest [0-9a-f]{32}\); its images"
             r" differ from those of 'core50:1.0.0', where it was recorded: point data.data_dir"
             r" at the same images, or replay it on 'core50:1.0.0'"),
      ("labels", r"1 of the manifest's 400 training images are not in 'core50:folder-core50'"
                 r" with their labels \(example id \d+ has label \d+; the same image is"
                 r" core50_128x128/s1/o\d+/C_01_\d+_000.png with label \d+\); the two sources"
                 r" number the classes otherwise"),
      ("old", r"records no image digests \(step_digests, test.digests\) to find its images"
              r" here: replay it on 'core50:1.0.0', or record the stream again there")):
    m = json.loads(json.dumps(recorded))
    data = _data(other if edit is None else core50["folder"], "folder")
    if edit == "labels":  # one training image's label changed (a class numbered otherwise)
      m["step_labels"][0][0] = (m["step_labels"][0][0] + 1) % 50
    elif edit == "old":
      for key in DIGEST_FIELDS:
        del m[key]
      del m["test"]["digests"]
    with pytest.raises(manifest.ManifestError, match=match) as raised:
      _replay(m, tmp_path, data)
    assert "\n" not in str(raised.value)


def test_a_changed_image_is_refused_on_the_same_source(core50, tmp_path):
  data = _data(core50["folder"], "folder")
  train, test = sources.load_sources(data, SIZE)
  recorded = manifest.build_stream_and_manifest(data, 0, 16, train, test)[1]
  recorded["step_digests"][2][1] = "0" * 32
  with pytest.raises(manifest.ManifestError, match=r"step 2's step_digests differ from the"
                     r" images of its ids in 'core50:folder-core50'; the images changed"):
    _replay(recorded, tmp_path, _data(core50["folder"], "folder"))


@pytest.mark.parametrize("source", ["tfds", "folder"])
def test_old_manifests_replay_as_before(core50, tmp_path, source):
  """A manifest without digests (as runs wrote them before) replays on its source, and the run
  writes it back byte for byte: its hash is kept."""
  data = _data(core50[source], source)
  train, test = sources.load_sources(data, SIZE)
  stream, recorded, _, _ = manifest.build_stream_and_manifest(data, 0, 16, train, test)
  old = {k: v for k, v in recorded.items() if k not in DIGEST_FIELDS}
  old["test"] = {k: v for k, v in recorded["test"].items() if k != "digests"}
  replayed, written, train_after, _ = _replay(old, tmp_path, _data(core50[source], source))
  assert manifest.canonical_bytes(written) == manifest.canonical_bytes(old)
  assert train_after is not None and len(train_after) == len(train)
  assert all(np.array_equal(a, b) for a, b in zip(replayed.steps, stream.steps, strict=True))
  # And a new one replays on its source as it is, digests and all.
  again = _replay(recorded, tmp_path, _data(core50[source], source), "new.json")[1]
  assert manifest.canonical_bytes(again) == manifest.canonical_bytes(recorded)


def test_cifar100_pickles_and_a_png_tree_share_pixel_digests(tmp_path):
  """CIFAR-100's digests are of pixels: its pickles and PNG files of the same pixels (here a
  train/ and test/ tree) name the same images, so a stream moves from one to the other."""
  from test_data_folder import _cifar100

  pickles = tmp_path / "pickles"
  pickles.mkdir()
  stored = _cifar100(pickles, (("train", 200), ("test", 100)))
  tree = tmp_path / "tree"
  order = np.random.default_rng(0).permutation(200)  # the files listed in another order
  for split, (images, labels) in stored.items():
    rows = order if split == "train" else range(len(labels))
    for row in rows:
      folder = tree / split / f"{labels[row]:03d}"
      folder.mkdir(parents=True, exist_ok=True)
      Image.fromarray(images[row]).save(folder / f"img{int(row):05d}.png")
  config = lambda root: _data(str(root), "folder", dataset="cifar100", scenario="disjoint",  # noqa: E731
                              n_tasks=4)
  train, test = sources.load_sources(config(pickles), SIZE)
  assert train.digest_kind == digests.PIXELS
  assert train.digests[3] == digests.of_pixels(stored["train"][0][3])
  stream, recorded, _, _ = manifest.build_stream_and_manifest(config(pickles), 0, 16, train, test)
  replayed, written, tree_train, tree_test = _replay(recorded, tmp_path, config(tree))
  assert written["source"] == "cifar100:folder-train-test"
  assert written["step_paths"][0][0].startswith("train/")
  # The pickles' `get` serves the stored 32x32 arrays, the tree's its resized cache: compare the
  # images as stored.
  _same_batches((stream, train, test), (replayed, tree_train, tree_test), "get_raw")


def test_a_seeded_split_moves_to_train_and_test_trees_only_where_they_agree(tmp_path):
  """One tree (the seeded split) and train/ and test/ trees of the same files are two layouts of
  one dataset: a stream recorded on the trees replays on the one tree with the trees' split; one
  recorded on the one tree needs images the trees hold as test images, and is refused."""
  from test_data_folder import _write_jpegs

  flat, trees = tmp_path / "flat" / "pets", tmp_path / "trees" / "pets"
  rng = np.random.default_rng(5)
  for name in ("cat", "dog", "owl"):
    _write_jpegs(str(flat / name), [f"{k}.jpg" for k in range(5)], rng, (6, 6))
    for split, names in (("train", ["0.jpg", "1.jpg", "2.jpg"]), ("test", ["3.jpg", "4.jpg"])):
      os.makedirs(trees / split / name)
      for n in names:
        shutil.copy(flat / name / n, trees / split / name / n)
  config = lambda root: _data(str(root), "folder", dataset="pets", scenario="disjoint",  # noqa: E731
                              n_tasks=3, test_fraction=0.2)
  train, test = sources.load_sources(config(trees), SIZE)
  stream, recorded, _, _ = manifest.build_stream_and_manifest(config(trees), 0, 4, train, test)
  assert recorded["source"] == "pets:folder-train-test"
  replayed, written, flat_train, flat_test = _replay(recorded, tmp_path, config(flat))
  assert written["source"] == "pets:folder-split"
  assert sorted(flat_test.paths) == sorted(p.split("/", 1)[1] for p in test.paths)
  assert len(flat_train) == 9  # the trees' split, not the seeded one (4 of 5 per class)
  _same_batches((stream, train, test), (replayed, flat_train, flat_test))
  flat_train, flat_test = sources.load_sources(config(flat), SIZE)
  on_flat = manifest.build_stream_and_manifest(config(flat), 0, 4, flat_train, flat_test)[1]
  with pytest.raises(manifest.ManifestError, match=r"[1-9] of the manifest's 12 training images"
                     r" are in the other split of 'pets:folder-train-test' \(e.g. \w+/\d.jpg"
                     r" \(id \d+\), here test/\w+/\d.jpg\); it splits train and test otherwise"):
    _replay(on_flat, tmp_path, config(trees), "flat.json")


def test_tfds_pixel_digests_are_the_files_pixel_digests(core50):
  """The pixel kind read from TFDS records (the stored PNG decoded) equals the folder's (PIL)."""
  from olora_jax.data import folder_sources, tfds_sources

  ds = tfds_sources.open_data_source("core50", "test", core50["tfds"])
  columns = tfds_sources.read_columns(ds, ("session",), 2, digests.PIXELS)
  pool = folder_sources.list_core50(core50["folder"])
  by_file = folder_sources.image_digests(pool, digests.PIXELS, 2, "core50")
  assert len(set(columns["digest"].tolist())) == len(columns["digest"]) == 150
  assert set(columns["digest"].tolist()) <= set(by_file.tolist())
  # The cache names each digest column by its kind: the file digests are not served for pixels.
  files = tfds_sources.read_columns(ds, ("session",), 2, digests.FILE)["digest"]
  assert set(files.tolist()) <= set(folder_sources.image_digests(pool, digests.FILE, 2,
                                                                 "core50").tolist())
  again = tfds_sources.read_columns(ds, ("session",), 2, digests.PIXELS)["digest"]
  assert np.array_equal(again, columns["digest"])
