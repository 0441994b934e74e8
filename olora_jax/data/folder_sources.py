"""The benchmarks (or any labelled image collection) read from image files on disk, without
TensorFlow: `data.source='folder'`, with `data.data_dir` the dataset's folder.

`data.dataset` picks how the folder is read (docs/streams.md, "Your datasets on disk"):

- any dataset, with `train/<class>/*` and `test/<class>/*`: the two ImageFolder trees, as they
  are (the authors' ImageNet-R split, or PILOT's CUB-200); a folder holding both `train/` and
  `test/` is always read this way;
- `imagenet_r`, `imagenet_sketch` or a name of yours, with `<class>/*`: one ImageFolder tree,
  split by the project's seeded stratified split (`data.test_fraction`, `data.split_seed`);
- `caltech_birds2011`, with `CUB_200_2011/` (`images.txt`, `train_test_split.txt`,
  `images/<class>/*`): CUB's own split;
- `core50`, with `core50_128x128/s<k>/o<j>/C_kk_jj_fff.png`: train on sessions 1 2 4 5 6 8 9 11,
  test on 3 7 10, the session as domain (as the TFDS builder in data/core50.py);
- `cifar100`, with `cifar-100-python/` (the pickles `train` and `test`, `fine_labels`);
- `tiny_imagenet`, with tiny-imagenet-200/'s `train/<wnid>/images/*.JPEG`, `val/images/` and
  `val/val_annotations.txt`: train on train/, test on the labelled val/ (its test/ has no labels).

Classes are the sorted names of the class folders, as torchvision's `ImageFolder` numbers them
(its image extensions, its recursive walk, files in sorted order), so class indices match the
authors' code and PILOT's; CORe50's classes are its objects o1..o50 -> 0..49, CIFAR-100's the
pickles' `fine_labels`. Labels come from the paths (or the pickles), never from decoding images.

Record ids (the stream manifest's ids) index one list of examples per layout: an ImageFolder
tree's files in `ImageFolder` order (`ImageFolder(root).samples[i]`; a train/test pair: each tree
on its own), CUB's `images.txt` rows, CORe50's PNGs in session, object and frame order (s1..s11,
o1..o50), the rows of a CIFAR-100 pickle. The manifest also records every example's path
relative to the dataset's folder (`paths`), so another codebase can replay a stream from the files,
and its image digest (`digests`: the SHA-256 of each file's bytes, CIFAR-100's of its pixels;
data/digests.py), so a stream recorded on TFDS replays here and the reverse.

Images are decoded with PIL (converted to RGB, as `ImageFolder` does) in a thread pool. The first
run decodes every image once, which also checks each one (a truncated or unreadable file is named
before any compute), resizes it to the model's size and keeps the uint8 result in a cache
(`.olora_jax_cache/` next to the dataset's folder when that is writable, else
`~/.cache/olora_jax/images/`): later runs read the cache instead of the images. A cache belongs to
one list of files with their sizes and modification times, and to one image size; any change
makes a new one; the image digests are kept there too. `get_raw` (training augmentation) always
decodes the file itself. CIFAR-100's pickles are already small uint8 arrays and are not cached.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import pickle
import re

import numpy as np
from PIL import Image

from olora_jax import errors
from olora_jax.data import digests as digests_lib
from olora_jax.data.preprocess import resize_image
from olora_jax.data.splits import stratified_split

# torchvision.datasets.folder.IMG_EXTENSIONS: the files `ImageFolder` takes (case-insensitive).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Image files torchvision's ImageFolder (whose extensions the project keeps) does not read: left
# out as there, but each class folder that holds some says so.
UNREAD_EXTENSIONS = (".gif",)
CACHE_FORMAT = 2  # part of every cache key: bump when the cached pixels would change (2: 16-bit)
CACHE_DIR_NAME = ".olora_jax_cache"

# The 200 ImageNet classes (WordNet ids) that ImageNet-R covers, as listed by its authors
# (github.com/hendrycks/imagenet-r). Sorted: their
# class indices 0..199 (as an ImageFolder over the folders gives them).
IMAGENET_R_WNIDS = (
    "n01443537", "n01484850", "n01494475", "n01498041", "n01514859", "n01518878", "n01531178",
    "n01534433", "n01614925", "n01616318", "n01630670", "n01632777", "n01644373", "n01677366",
    "n01694178", "n01748264", "n01770393", "n01774750", "n01784675", "n01806143", "n01820546",
    "n01833805", "n01843383", "n01847000", "n01855672", "n01860187", "n01882714", "n01910747",
    "n01944390", "n01983481", "n01986214", "n02007558", "n02009912", "n02051845", "n02056570",
    "n02066245", "n02071294", "n02077923", "n02085620", "n02086240", "n02088094", "n02088238",
    "n02088364", "n02088466", "n02091032", "n02091134", "n02092339", "n02094433", "n02096585",
    "n02097298", "n02098286", "n02099601", "n02099712", "n02102318", "n02106030", "n02106166",
    "n02106550", "n02106662", "n02108089", "n02108915", "n02109525", "n02110185", "n02110341",
    "n02110958", "n02112018", "n02112137", "n02113023", "n02113624", "n02113799", "n02114367",
    "n02117135", "n02119022", "n02123045", "n02128385", "n02128757", "n02129165", "n02129604",
    "n02130308", "n02134084", "n02138441", "n02165456", "n02190166", "n02206856", "n02219486",
    "n02226429", "n02233338", "n02236044", "n02268443", "n02279972", "n02317335", "n02325366",
    "n02346627", "n02356798", "n02363005", "n02364673", "n02391049", "n02395406", "n02398521",
    "n02410509", "n02423022", "n02437616", "n02445715", "n02447366", "n02480495", "n02480855",
    "n02481823", "n02483362", "n02486410", "n02510455", "n02526121", "n02607072", "n02655020",
    "n02672831", "n02701002", "n02749479", "n02769748", "n02793495", "n02797295", "n02802426",
    "n02808440", "n02814860", "n02823750", "n02841315", "n02843684", "n02883205", "n02906734",
    "n02909870", "n02939185", "n02948072", "n02950826", "n02951358", "n02966193", "n02980441",
    "n02992529", "n03124170", "n03272010", "n03345487", "n03372029", "n03424325", "n03452741",
    "n03467068", "n03481172", "n03494278", "n03495258", "n03498962", "n03594945", "n03602883",
    "n03630383", "n03649909", "n03676483", "n03710193", "n03773504", "n03775071", "n03888257",
    "n03930630", "n03947888", "n04086273", "n04118538", "n04133789", "n04141076", "n04146614",
    "n04147183", "n04192698", "n04254680", "n04266014", "n04275548", "n04310018", "n04325704",
    "n04347754", "n04389033", "n04409515", "n04465501", "n04487394", "n04522168", "n04536866",
    "n04552348", "n04591713", "n07614500", "n07693725", "n07695742", "n07697313", "n07697537",
    "n07714571", "n07714990", "n07718472", "n07720875", "n07734744", "n07742313", "n07745940",
    "n07749582", "n07753275", "n07753592", "n07768694", "n07873807", "n07880968", "n07920052",
    "n09472597", "n09835506", "n10565667", "n12267677",
)

# CORe50's protocol (docs/streams.md): train on sessions 1 2 4 5 6 8 9 11, test on 3 7 10.
CORE50_TRAIN_SESSIONS = (1, 2, 4, 5, 6, 8, 9, 11)
CORE50_TEST_SESSIONS = (3, 7, 10)
CORE50_OBJECTS = 50
_CORE50_FRAME = re.compile(r"^C_(\d+)_(\d+)_(\d+)\.png$")

TINY_IMAGENET_CLASSES = 200

# The number of classes each benchmark has; a folder with another count is refused.
BENCHMARK_CLASSES = {"cifar100": 100, "imagenet_r": 200, "imagenet_sketch": 1000,
                     "caltech_birds2011": 200, "core50": CORE50_OBJECTS,
                     "tiny_imagenet": TINY_IMAGENET_CLASSES, "imagenet_a": 200, "vtab": 50,
                     "omnibenchmark": 300}


def _bad(message: str) -> errors.BadInput:
  return errors.BadInput(" ".join(message.split()))


def _some(names, shown: int = 4) -> str:
  """A few of `names`, sorted, for an error line."""
  names = sorted(names)
  return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown
                                     else "") if names else "none"


# ----------------------------------------------------------------------------------------------
# Listing: each layout -> one `Pool` of examples (paths and labels, nothing decoded).


@dataclasses.dataclass(frozen=True)
class Pool:
  """One list of examples: `paths` relative to `root` ('/'-separated), in record-id order, their
  `labels`, optional per-example int `metadata`; or, for CIFAR-100's pickles, `images` in memory
  (then `paths` is None)."""

  root: str
  paths: tuple[str, ...] | None
  labels: np.ndarray
  class_names: tuple[str, ...]
  metadata: dict = dataclasses.field(default_factory=dict)
  images: np.ndarray | None = None


def is_image_file(name: str) -> bool:
  return name.lower().endswith(IMAGE_EXTENSIONS)


def class_folders(root: str) -> list[str]:
  """The class folders of an ImageFolder tree, sorted (torchvision's `find_classes`)."""
  if not os.path.isdir(root):
    raise FileNotFoundError(f"data.data_dir: {root} is not a folder; give the dataset's folder")
  names = sorted(e.name for e in os.scandir(root) if e.is_dir())
  if not names:
    raise _bad(f"{root} holds no class folders; data.source='folder' reads an ImageFolder tree"
               f" ({root}/<class>/<image>, or train/ and test/ trees of those)")
  return names


def list_image_folder(root: str) -> Pool:
  """Every image of an ImageFolder tree, in `ImageFolder(root).samples` order."""
  classes = class_folders(root)
  paths, labels = [], []
  for label, name in enumerate(classes):
    count = len(paths)
    for folder, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
      rel = os.path.relpath(folder, root).replace(os.sep, "/")
      paths += [f"{rel}/{f}" for f in sorted(files) if is_image_file(f)]
      unread = [f for f in files if f.lower().endswith(UNREAD_EXTENSIONS)]
      if unread:
        logging.warning("%s: %d image(s) of a format the ImageFolder layout does not read (%s)"
                        " are left out, e.g. %s; convert them to PNG to use them", folder,
                        len(unread), ", ".join(UNREAD_EXTENSIONS), sorted(unread)[0])
    if len(paths) == count:
      raise _bad(f"class folder {os.path.join(root, name)} holds no image"
                 f" ({', '.join(IMAGE_EXTENSIONS)}); add its images or remove the folder")
    labels += [label] * (len(paths) - count)
  return Pool(root, tuple(paths), np.asarray(labels, np.int64), tuple(classes))


def list_train_test(root: str) -> tuple[Pool, Pool]:
  """The `train/` and `test/` trees of `root`, with the same classes in both."""
  train, test = (list_image_folder(os.path.join(root, split)) for split in ("train", "test"))
  if train.class_names != test.class_names:
    only_train = _some(set(train.class_names) - set(test.class_names))
    only_test = _some(set(test.class_names) - set(train.class_names))
    raise _bad(f"{root}/train and {root}/test have different class folders (only in train:"
               f" {only_train}; only in test: {only_test}); give both trees the same classes")
  # Paths relative to `root`, so the manifest says which tree each file is in.
  return tuple(dataclasses.replace(p, root=root, paths=tuple(f"{s}/{x}" for x in p.paths))
               for s, p in (("train", train), ("test", test)))


TINY_IMAGENET_VAL_TABLE = "val/val_annotations.txt"  # file, wnid, box: the validation labels


def list_tiny_imagenet(root: str) -> tuple[Pool, Pool]:
  """TinyImageNet's folder as its authors ship it (tiny-imagenet-200/): training images in
  `train/<wnid>/images/*.JPEG` (an ImageFolder tree, classes the sorted WordNet ids), the
  labelled validation images in `val/images/` with their classes in `val/val_annotations.txt`
  (tab separated: file, WordNet id, box), which is the test set; `test/` has no labels and is
  not read."""
  table = os.path.join(root, TINY_IMAGENET_VAL_TABLE)
  if not os.path.isfile(table):
    raise _bad(f"data.dataset='tiny_imagenet' reads {table}, which is missing; point"
               " data.data_dir at tiny-imagenet-200/ (train/, val/images/ and"
               " val/val_annotations.txt)")
  train = list_image_folder(os.path.join(root, "train"))
  index = {name: i for i, name in enumerate(train.class_names)}
  paths, labels = [], []
  with open(table) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      fields = line.rstrip("\n").split("\t")
      if len(fields) < 2 or fields[1] not in index:
        raise _bad(f"{table} line {number}: expected 'file<TAB>wnid<TAB>box' with a wnid of"
                   f" train/'s class folders, got {line.strip()[:60]!r}; restore the file from"
                   " the dataset's archive")
      paths.append(f"val/images/{fields[0]}")
      labels.append(index[fields[1]])
  missing = [p for p in paths if not os.path.isfile(os.path.join(root, p))]
  if missing:
    raise _bad(f"{table} names {len(missing)} image(s) missing from {root}/val/images (e.g."
               f" {missing[0]}); restore them from the dataset's archive")
  order = np.argsort(np.asarray(paths), kind="stable")  # record ids: the files in sorted order
  train = dataclasses.replace(train, root=root, paths=tuple(f"train/{x}" for x in train.paths))
  test = Pool(root, tuple(paths[i] for i in order), np.asarray(labels, np.int64)[order],
              train.class_names)
  return train, test


def find_cub_root(data_dir: str) -> str:
  """The `CUB_200_2011` folder in (or at) `data_dir`."""
  for root in (os.path.join(data_dir, "CUB_200_2011"), data_dir):
    if os.path.isfile(os.path.join(root, "images.txt")):
      return root
  raise FileNotFoundError(
      f"no CUB-200-2011 folder in data.data_dir={data_dir!r}: unpack CUB_200_2011.tgz there so"
      " that it holds CUB_200_2011/images.txt and CUB_200_2011/images/, or give train/ and"
      " test/ ImageFolder trees")


def _read_id_table(path: str, what: str) -> dict[int, str]:
  """`<image id> <value>` lines -> {id: value}."""
  table = {}
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      parts = line.split(maxsplit=1)
      if len(parts) != 2 or not parts[0].isdigit():
        raise _bad(f"{path} line {n} is not '<image id> <{what}>': {line.strip()!r}")
      table[int(parts[0])] = parts[1].strip()
  return table


def list_cub(data_dir: str) -> tuple[Pool, np.ndarray]:
  """CUB-200-2011's images in `images.txt` order, and whether each is a training image
  (`train_test_split.txt`). Classes: the sorted folder names under `images/`."""
  root = find_cub_root(data_dir)
  split_file = os.path.join(root, "train_test_split.txt")
  if not os.path.isfile(split_file):
    raise FileNotFoundError(
        f"{split_file} is missing: CUB's train/test split comes from it; restore it from"
        " CUB_200_2011.tgz")
  images = _read_id_table(os.path.join(root, "images.txt"), "path")
  split = _read_id_table(split_file, "is_training_image")
  ids = sorted(images)
  missing = [i for i in ids if split.get(i) not in ("0", "1")]
  if missing:
    raise _bad(f"{split_file} gives no 0/1 for image id(s) {missing[:5]} of images.txt;"
               " restore it from CUB_200_2011.tgz")
  paths = tuple(f"images/{images[i]}" for i in ids)
  classes = sorted({p.split("/")[1] for p in paths})
  index = {name: k for k, name in enumerate(classes)}
  labels = np.asarray([index[p.split("/")[1]] for p in paths], np.int64)
  is_train = np.asarray([split[i] == "1" for i in ids])
  return Pool(root, paths, labels, tuple(classes)), is_train


def find_core50_root(directory: str, flag: str = "data.data_dir") -> str:
  """The `core50_128x128` folder in (or at) `directory`."""
  for root in (os.path.join(directory, "core50_128x128"), directory):
    if os.path.isdir(os.path.join(root, "s1")):
      return root
  raise FileNotFoundError(
      f"no CORe50 folder in {flag}={directory!r}: unpack core50_128x128.zip there so that"
      " it holds core50_128x128/s1/o1/C_01_01_000.png")


def list_core50_session(root: str, session: int) -> list[tuple[str, int, int]]:
  """(path, label, frame) of every PNG of one session, objects o1..o50 in order."""
  session_dir = os.path.join(root, f"s{session}")
  if not os.path.isdir(session_dir):
    raise FileNotFoundError(f"CORe50 session folder {session_dir} is missing; re-unpack the zip")
  out = []
  for obj in range(1, CORE50_OBJECTS + 1):
    obj_dir = os.path.join(session_dir, f"o{obj}")
    if not os.path.isdir(obj_dir):
      raise FileNotFoundError(f"CORe50 object folder {obj_dir} is missing; re-unpack the zip")
    for name in sorted(os.listdir(obj_dir)):
      match = _CORE50_FRAME.match(name)
      if match is None:
        continue
      if (int(match[1]), int(match[2])) != (session, obj):
        raise ValueError(f"{obj_dir}/{name} does not belong to s{session}/o{obj}")
      out.append((os.path.join(obj_dir, name), obj - 1, int(match[3])))
  return out


def list_core50(data_dir: str) -> Pool:
  """Every PNG of sessions 1..11 (objects o1..o50, frames in order), with its `session`."""
  root = find_core50_root(data_dir)
  base = os.path.dirname(root)
  rows = [(path, label, session) for session in range(1, 12)
          for path, label, _ in list_core50_session(root, session)]
  return Pool(base, tuple(os.path.relpath(p, base).replace(os.sep, "/") for p, _, _ in rows),
              np.asarray([r[1] for r in rows], np.int64),
              tuple(f"o{k}" for k in range(1, CORE50_OBJECTS + 1)),
              metadata={"session": np.asarray([r[2] for r in rows], np.int64)})


def read_cifar100(data_dir: str) -> tuple[Pool, Pool]:
  """CIFAR-100's python pickles `train` and `test` (in `cifar-100-python/` or `data_dir`)."""
  for root in (os.path.join(data_dir, "cifar-100-python"), data_dir):
    if os.path.isfile(os.path.join(root, "train")):
      break
  else:
    raise FileNotFoundError(
        f"no CIFAR-100 pickles in data.data_dir={data_dir!r}: unpack cifar-100-python.tar.gz"
        " there so that it holds cifar-100-python/train and cifar-100-python/test")
  pools = []
  for split in ("train", "test"):
    path = os.path.join(root, split)
    try:
      with open(path, "rb") as f:
        table = pickle.load(f, encoding="bytes")
      data = np.asarray(table[b"data"], np.uint8)
      labels = np.asarray(table[b"fine_labels"], np.int64)
      images = data.reshape(len(data), 3, 32, 32).transpose(0, 2, 3, 1)
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as e:
      raise _bad(f"{path} is not a CIFAR-100 pickle with 'data' and 'fine_labels'"
                 f" ({errors.first_line(e)}); re-unpack cifar-100-python.tar.gz") from None
    if len(labels) != len(images):
      raise _bad(f"{path} holds {len(images)} images but {len(labels)} fine_labels")
    pools.append(Pool(root, None, labels, tuple(str(k) for k in range(100)),
                      images=np.ascontiguousarray(images)))
  return tuple(pools)


# ----------------------------------------------------------------------------------------------
# Decoding and the cache of resized images.


def decode(path: str) -> np.ndarray:
  """The image at `path` as (H, W, 3) uint8 RGB (PIL, as torchvision's loader). A 16-bit
  greyscale image (PNG, TIFF: PIL's modes 'I;16*' and 'I') keeps its top 8 bits; PIL's
  convert('RGB'), torchvision's loader, clips it to 255 and makes it white."""
  with Image.open(path) as image:
    if image.mode.startswith("I;16") or image.mode == "I":
      values = np.asarray(image).astype(np.int64)
      grey = (np.clip(values, 0, 65535) >> 8).astype(np.uint8)
      return np.repeat(grey[..., None], 3, axis=-1)
    return np.asarray(image.convert("RGB"))


def _decoded(path: str) -> np.ndarray:
  """`decode(path)`; a file PIL cannot read is refused in one line naming it."""
  try:
    return decode(path)
  except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
    raise _bad(f"cannot read the image {path} ({errors.first_line(e)}); replace or remove the"
               " file") from None


def cache_dirs(root: str) -> list[str]:
  """Where a cache may go, in order: next to the dataset's folder, then the user's cache."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return [os.path.join(os.path.dirname(os.path.abspath(root)), CACHE_DIR_NAME),
          os.path.join(base, "olora_jax", "images")]


def cache_key(pool: Pool, image_size: int | str) -> str:
  """A digest of the pool's files (relative path, size, modification time) and the image size
  (or, for the image digests, their kind)."""
  h = hashlib.sha256(f"{CACHE_FORMAT} {image_size} {os.path.abspath(pool.root)}\n".encode())
  for rel in pool.paths:
    try:
      st = os.stat(os.path.join(pool.root, rel))
    except OSError as e:  # e.g. a file CUB's images.txt lists but the folder lacks
      raise FileNotFoundError(f"{os.path.join(pool.root, rel)} cannot be read ({e.strerror});"
                              " restore the dataset's files") from None
    h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:20]


def _open_cached(paths: tuple[str, str], shape: tuple[int, ...]):
  images_path, sizes_path = paths
  if not (os.path.isfile(images_path) and os.path.isfile(sizes_path)):
    return None
  try:
    images = np.load(images_path, mmap_mode="r")
    sizes = np.load(sizes_path)
  except (OSError, ValueError):  # a damaged cache is rebuilt
    return None
  if images.shape != shape or images.dtype != np.uint8 or sizes.shape != (shape[0], 2):
    return None
  return images, sizes


def _writable_dir(path: str) -> bool:
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return False
  return os.access(path, os.W_OK)


def _cache_target(dirs: list[str]) -> tuple[str | None, bool]:
  """(the first writable cache folder or None, whether this call made it)."""
  for d in dirs:
    made = not os.path.isdir(d)
    if _writable_dir(d):
      return d, made
  return None, False


def _remove_if_empty(path: str) -> None:
  """Removes a cache folder this run made and left empty (a refused dataset writes nothing)."""
  with contextlib.suppress(OSError):
    os.rmdir(path)  # fails unless empty


_TEMP_NAME = re.compile(r"\.(\d+)\.tmp(\.sizes)?\.npy$")


def _remove_stale_temps(folder: str, key: str) -> None:
  """Removes the temporary files `{key}.{pid}.tmp*.npy` that a build killed before its end left
  (SIGKILL, power loss): those of a process that no longer runs."""
  try:
    names = os.listdir(folder)
  except OSError:
    return
  for name in names:
    found = _TEMP_NAME.search(name)
    if not (name.startswith(key + ".") and found and name[:found.start()] == key):
      continue
    try:
      os.kill(int(found.group(1)), 0)
      continue  # a live build (of another run) owns it
    except ProcessLookupError:
      pass
    except OSError:  # another user's live process
      continue
    with contextlib.suppress(OSError):
      os.remove(os.path.join(folder, name))


def _reserved_memmap(path: str, shape: tuple[int, ...]) -> np.ndarray:
  """A writable uint8 .npy memmap at `path` whose every byte is allocated on disk before the first
  is written: a sparse file on a full disk ends the process with SIGBUS at the first page the
  filesystem cannot back, while reserving the space fails here with ENOSPC."""
  del_me = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)  # sparse
  del del_me
  fd = os.open(path, os.O_RDWR)
  try:
    os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
  finally:
    os.close(fd)
  return np.load(path, mmap_mode="r+")


def resized_images(pool: Pool, image_size: int, num_workers: int,
                   name: str) -> tuple[np.ndarray, np.ndarray]:
  """((N, S, S, 3) uint8 images resized to `image_size`, (N, 2) stored heights and widths) of
  every file of `pool`: read from a cache, or decoded (each file checked) and cached."""
  n = len(pool.paths)
  shape = (n, image_size, image_size, 3)
  key = f"{name}-{cache_key(pool, image_size)}-{image_size}px"
  dirs = cache_dirs(pool.root)
  for d in dirs:
    _remove_stale_temps(d, key)
    found = _open_cached((os.path.join(d, f"{key}.npy"), os.path.join(d, f"{key}.sizes.npy")),
                         shape)
    if found is not None:
      logging.info("%s: %d images from the cache %s", name, n, d)
      return found
  target, made = _cache_target(dirs)
  tmp = None
  if target is None:
    logging.warning("%s: no writable cache folder (%s): the %d images are decoded on every run",
                    name, " or ".join(dirs), n)
    images = np.empty(shape, np.uint8)
  else:
    tmp = os.path.join(target, f"{key}.{os.getpid()}.tmp.npy")
    try:
      images = _reserved_memmap(tmp, shape)
    except OSError as e:
      raise _cache_failure(e, tmp, target if made else None,
                           f"{name}: cannot cache the {n} images resized to {image_size} px"
                           f" ({math.prod(shape) / 2**20:,.1f} MiB) in {target}",
                           "free that much space there") from e
  sizes = np.empty((n, 2), np.int64)

  def load(i):
    image = _decoded(os.path.join(pool.root, pool.paths[i]))
    images[i] = resize_image(image, image_size)
    sizes[i] = image.shape[:2]

  workers = concurrent.futures.ThreadPoolExecutor(max(1, num_workers))
  try:
    for _ in workers.map(load, range(n)):  # in order: the first bad file is the one named
      pass
    if tmp is not None:
      images.flush()
      del images
      # Atomic: a reader sees whole files (the images file last: its presence marks the cache).
      _save_cache_file(os.path.join(target, f"{key}.{os.getpid()}.tmp.sizes.npy"),
                       os.path.join(target, f"{key}.sizes.npy"), sizes,
                       f"{name}: cannot cache the images' sizes")
      os.replace(tmp, os.path.join(target, f"{key}.npy"))
      logging.info("%s: %d images decoded and cached in %s", name, n, target)
      return np.load(os.path.join(target, f"{key}.npy"), mmap_mode="r"), sizes
    return images, sizes
  finally:
    workers.shutdown(wait=True, cancel_futures=True)  # a bad file: the rest is not decoded
    if tmp is not None and os.path.exists(tmp):
      del images  # unmapped before its file goes
      os.remove(tmp)
      if made:
        _remove_if_empty(target)


def image_digests(pool: Pool, kind: str, num_workers: int, name: str) -> np.ndarray:
  """(N,) the digest (`digests`) of every example of `pool`: of each file's bytes, or of its
  decoded pixels; CIFAR-100's pickle rows are pixels. Kept in the cache folder (one small file
  per list of files and kind), so later runs read no image to compute them."""
  if pool.images is not None:
    if kind != digests_lib.PIXELS:
      raise ValueError(f"{name}: images held as arrays have pixel digests, not {kind!r}")
    return digests_lib.as_array(digests_lib.of_pixels(image) for image in pool.images)
  key = f"{name}-{cache_key(pool, kind)}.digests.npy"
  dirs = cache_dirs(pool.root)
  for d in dirs:
    _remove_stale_temps(d, key)
    path = os.path.join(d, key)
    if os.path.isfile(path):
      try:
        found = np.load(path)
      except (OSError, ValueError):  # a damaged file is computed again
        continue
      if found.shape == (len(pool.paths),) and found.dtype.kind == "U":
        return found

  def digest(rel):
    path = os.path.join(pool.root, rel)
    if kind == digests_lib.PIXELS:
      return digests_lib.of_pixels(_decoded(path))
    with open(path, "rb") as f:
      return digests_lib.of_bytes(f.read())

  with concurrent.futures.ThreadPoolExecutor(max(1, num_workers)) as workers:
    found = digests_lib.as_array(workers.map(digest, pool.paths))
  target, made = _cache_target(dirs)
  if target is not None:
    _save_cache_file(os.path.join(target, f"{key}.{os.getpid()}.tmp.npy"),
                     os.path.join(target, key), found, f"{name}: cannot keep the image digests",
                     target if made else None)
  return found


def _save_cache_file(tmp: str, path: str, array: np.ndarray, what: str,
                     made: str | None = None) -> None:
  """`np.save(path, array)` whole or not at all (to `tmp`, then an atomic rename). A
  failed write (a full disk: NumPy's short write carries no errno) leaves nothing behind (the
  temporary file, and the folder `made` when it is left empty) and is
  `errors.EnvironmentFailure` (exit 4) naming `path`."""
  try:
    np.save(tmp, array)
    os.replace(tmp, path)
  except OSError as e:
    raise _cache_failure(e, tmp, made, f"{what} in {path}") from e


def _cache_failure(e: OSError, tmp: str, made: str | None, what: str,
                   advice: str = "") -> errors.EnvironmentFailure:
  """A cache file that could not be written: its temporary file `tmp` removed (and the cache
  folder `made` when this run made it and it is left empty), and the one line (exit 4) of `what`
  failed, its storage cause and `advice` (by default, the cause's: errors.storage_advice)."""
  with contextlib.suppress(OSError):
    os.remove(tmp)
  if made:
    _remove_if_empty(made)
  cause = errors.storage_cause(e) or errors.first_line(e)
  return errors.EnvironmentFailure(
      f"{what} ({cause}); {advice or errors.storage_advice(cause, '')}, then run the same"
      " command")


# ----------------------------------------------------------------------------------------------
# The source.


class FolderSource:
  """Rows `record_ids` of a `Pool`: `get` returns the cached images at the model's size (CIFAR-100:
  the stored 32x32 images), `get_raw` the images as stored, decoded from their files. `digests`
  names each row's image (olora_jax/data/digests.py), `record_pool` is the pool itself: two
  sources with the same `record_pool` number one list of examples."""

  def __init__(self, name: str, split: str, pool: Pool, record_ids: np.ndarray,
               resized: np.ndarray | None, sizes: np.ndarray | None, num_workers: int,
               layout: str, seeded_split: bool = False, digests: np.ndarray | None = None,
               digest_kind: str | None = None):
    self.name, self.split, self._pool_data = name, split, pool
    self.record_ids = np.asarray(record_ids, np.int64)
    self.labels = pool.labels[self.record_ids]
    self.num_classes = len(pool.class_names)
    self.class_names = pool.class_names
    self.metadata = {k: v[self.record_ids] for k, v in pool.metadata.items()}
    self.domains = self.metadata.get("session")  # CORe50's sessions, as the TFDS source
    self.seeded_split = seeded_split
    self.version = f"{name}:folder-{layout}"  # the manifest's `source`
    self.paths = (None if pool.paths is None else
                  tuple(pool.paths[i] for i in self.record_ids))
    self.digest_kind = digest_kind
    self.digests = None if digests is None else digests[self.record_ids]
    self._resized = resized
    self._sizes = None if sizes is None else sizes[self.record_ids]
    self._rebuild = (name, pool, resized, sizes, num_workers, layout, seeded_split, digests,
                     digest_kind)
    self._workers = concurrent.futures.ThreadPoolExecutor(max(1, num_workers))

  @property
  def record_pool(self) -> Pool:
    return self._pool_data

  def with_records(self, record_ids: np.ndarray, split: str) -> FolderSource:
    """The rows `record_ids` of the same pool, as split `split` (a replayed manifest's sets)."""
    name, pool, resized, sizes, workers, layout, seeded, digests, kind = self._rebuild
    return FolderSource(name, split, pool, record_ids, resized, sizes, workers, layout, seeded,
                        digests, kind)

  def __len__(self) -> int:
    return len(self.record_ids)

  @property
  def raw_image_shape(self) -> tuple[int, ...] | None:
    """(H, W, 3) when every image of the split is stored at that size, else None."""
    if self._pool_data.images is not None:
      return tuple(self._pool_data.images.shape[1:])
    if not len(self._sizes) or np.any(self._sizes != self._sizes[0]):
      return None
    return (*(int(d) for d in self._sizes[0]), 3)

  def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, np.int64)
    rows = self.record_ids[ids]
    stored = self._resized if self._resized is not None else self._pool_data.images
    return np.asarray(stored[rows]), self.labels[ids]

  def get_raw(self, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    ids = np.asarray(ids, np.int64)
    if self._pool_data.images is not None:
      return list(self._pool_data.images[self.record_ids[ids]]), self.labels[ids]
    root = self._pool_data.root
    images = self._workers.map(lambda i: decode(os.path.join(root, self.paths[i])), ids)
    return list(images), self.labels[ids]


def _check_classes(name: str, data_dir: str, pool: Pool) -> None:
  """A benchmark's folder must have the benchmark's classes (its class indices are the paper's)."""
  expected = BENCHMARK_CLASSES.get(name)
  if name == "imagenet_r" and pool.class_names != IMAGENET_R_WNIDS:
    missing = _some(set(IMAGENET_R_WNIDS) - set(pool.class_names))
    extra = _some(set(pool.class_names) - set(IMAGENET_R_WNIDS))
    raise _bad(f"data.dataset='imagenet_r' but data.data_dir={data_dir!r} does not hold the 200"
               f" ImageNet-R class folders (missing {missing}, not ImageNet-R {extra}); point it"
               " at imagenet-r/ (or its train/ and test/), or name your dataset otherwise")
  if expected is not None and len(pool.class_names) != expected:
    raise _bad(f"data.dataset={name!r} has {expected} classes but data.data_dir={data_dir!r}"
               f" holds {len(pool.class_names)}; point it at the benchmark's folder, or name your"
               " dataset otherwise")


def load_folder_sources(data_config, image_size: int) -> tuple[FolderSource, FolderSource]:
  """(train, test) of `data_config.dataset` read from the folder `data_config.data_dir`."""
  c = data_config
  name, data_dir, workers = c.dataset, c.data_dir, c.num_workers
  if not data_dir:
    raise _bad("data.source='folder' needs data.data_dir=FOLDER, the dataset's folder on disk")
  if workers < 1:
    raise ValueError(f"data.num_workers={workers} must be >= 1")
  data_dir = os.path.expanduser(data_dir)
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"data.data_dir={data_dir!r} is not a folder; give the folder that"
                            " holds the dataset's images (docs/streams.md)")
  seeded = False
  if name == "tiny_imagenet":  # its test/ has no labels: the labelled val/ is the test set
    train_pool, test_pool = list_tiny_imagenet(data_dir)
    layout, split = "tiny_imagenet", None
  elif all(os.path.isdir(os.path.join(data_dir, s)) for s in ("train", "test")):
    train_pool, test_pool = list_train_test(data_dir)
    layout, split = "train-test", None
  elif name == "cifar100":
    train_pool, test_pool = read_cifar100(data_dir)
    layout, split = "pickles", None
  elif name == "caltech_birds2011":
    train_pool, is_train = list_cub(data_dir)
    test_pool, layout = train_pool, "cub"
    split = np.flatnonzero(is_train), np.flatnonzero(~is_train)
  elif name == "core50":
    train_pool = test_pool = list_core50(data_dir)
    layout, session = "core50", train_pool.metadata["session"]
    split = tuple(np.flatnonzero(np.isin(session, s))
                  for s in (CORE50_TRAIN_SESSIONS, CORE50_TEST_SESSIONS))
  else:  # one ImageFolder tree: the project's seeded stratified split
    train_pool = test_pool = list_image_folder(data_dir)
    layout, seeded = "split", True
    split = stratified_split(train_pool.labels, c.test_fraction, c.split_seed)
  _check_classes(name, data_dir, train_pool)

  def cached(pool):
    if pool.images is not None:
      return None, None
    return resized_images(pool, image_size, workers, name)

  kind = digests_lib.kind_of(name)
  train_resized, train_sizes = cached(train_pool)
  if split is None:  # two pools
    test_resized, test_sizes = cached(test_pool)
    train_ids, test_ids = np.arange(len(train_pool.labels)), np.arange(len(test_pool.labels))
    train_digests, test_digests = (image_digests(p, kind, workers, name)
                                   for p in (train_pool, test_pool))
  else:  # one pool, two sets of rows
    test_resized, test_sizes = train_resized, train_sizes
    train_ids, test_ids = split
    train_digests = test_digests = image_digests(train_pool, kind, workers, name)
  train = FolderSource(name, "train", train_pool, train_ids, train_resized, train_sizes, workers,
                       layout, seeded, train_digests, kind)
  test = FolderSource(name, "test", test_pool, test_ids, test_resized, test_sizes, workers,
                      layout, seeded, test_digests, kind)
  return train, test
