"""The stream manifest: what a run trains and tests on, in an exact, hashable record.

A manifest lists the example ids of every step (ids are each example's index in the original dataset
split: the TFDS record index, or the row of an embedded dataset), their labels, the true task of
every step and the task boundaries (evaluator only), each task's classes, Si-Blurry's disjoint
classes and home tasks, a domain stream's task domains, and the test set's ids and labels (and
domains, when the dataset has them), together with the parameters that produced them. A folder
source (`data.source='folder'`) also records each example's file, relative to the dataset's folder
(`step_paths`, `test.paths`), so another codebase can replay the stream from the files themselves.
TFDS and folder sources also record each example's image digest (`digest`, `step_digests`,
`test.digests`; olora_jax/data/digests.py), a name for the image that does not depend on the
source, so the manifest replays on another source of the dataset holding the same images.
It holds integers and strings only, so its canonical JSON encoding (sorted keys, no spaces) is the
same bytes on any machine; `manifest_sha256` is the SHA-256 of those bytes, and `write_manifest`
writes exactly those bytes, so `sha256sum stream_manifest.json` prints the `stream_manifest_sha256`
of results.json.

The manifest is also an input: `data.stream_manifest=PATH` replays the steps it lists instead of
building a stream from the seed (`read_manifest`, `replay_stream`). It may be one a run wrote, or
one written by hand or by another codebase in the same JSON (docs/replay.md lists every field and
which are required). Every id must exist in the configured dataset's training split, and every
label the manifest records must be the data's label for that id; the test set, the dataset name
and the class count, where given, must match the data too. A replayed run writes the same
manifest back (canonical bytes), so replaying a run's own manifest reproduces its
`stream_manifest_sha256` (a manifest without digests is written back without them).

A manifest recorded on another source of the dataset (TFDS and a folder, two folder layouts, two
TFDS versions) is first put in this source's terms by `translate_manifest`: each of its images is
found here by digest and label, the training and test sources are re-indexed to them, and the
replay goes on as above; images that are not here are refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import ml_collections
import numpy as np

from olora_jax.data import streams as streams_lib
from olora_jax.data.streams import Stream

FORMAT = "olora-jax stream manifest v1"


def stream_params(data_config: ml_collections.ConfigDict, seed: int, batch_size: int,
                  has_test_split: bool) -> dict:
  """The parameters that determine the stream (and only those, so the hash moves with them)."""
  c = data_config
  params = {"dataset": c.dataset, "scenario": c.scenario, "seed": seed, "batch_size": batch_size}
  if c.scenario == "disjoint":
    order = c.class_order
    params.update(n_tasks=c.n_tasks, class_order=order if isinstance(order, str) else _ints(order))
  elif c.scenario == "si_blurry":
    params.update(n_tasks=c.n_tasks, si_blurry_n=c.si_blurry_n, si_blurry_m=c.si_blurry_m)
  elif c.scenario == "domain" and c.dataset == "core50":  # other domain streams: sequential
    params.update(core50_order=c.core50_order)
  if not has_test_split:
    params.update(test_fraction=c.test_fraction, split_seed=c.split_seed)
  return params


def _ints(a) -> list:
  return np.asarray(a, np.int64).tolist()


def record_ids(source) -> np.ndarray:
  """Each row's id in the original dataset split, (N,) int64."""
  ids = source.record_ids if source.record_ids is not None else np.arange(len(source))
  return np.asarray(ids, np.int64)


def paths_of(source) -> tuple[str, ...] | None:
  """Each row's file relative to the dataset's folder (folder sources), or None."""
  paths = getattr(source, "paths", None)
  return None if paths is None else tuple(paths)


def _source_name(source) -> str:
  return getattr(source, "version", None) or source.name


def digests_of(source) -> np.ndarray | None:
  """Each row's image digest (TFDS and folder sources: olora_jax/data/digests.py), or None."""
  digests = getattr(source, "digests", None)
  return None if digests is None else np.asarray(digests)


def stream_manifest(data_config: ml_collections.ConfigDict, seed: int, batch_size: int,
                    stream: Stream, train_source, test_source, params: dict | None = None,
                    digests: bool = True) -> dict:
  """The manifest of `stream` over `train_source`, tested on `test_source`; `params` replaces the
  stream parameters read from the config (a replayed manifest keeps its own). With `digests`,
  sources that name their images (`digests_of`) add `digest`, `step_digests` and
  `test.digests`; a replayed manifest without them is written back without them."""
  train_ids, test_ids = record_ids(train_source), record_ids(test_source)
  if params is None:
    params = stream_params(data_config, seed, batch_size, not train_source.seeded_split)
  manifest = {
      "format": FORMAT,
      "source": _source_name(train_source),
      "params": params,
      "num_classes": int(train_source.num_classes),
      "steps": [_ints(train_ids[ids]) for ids in stream.steps],
      "step_labels": [_ints(train_source.labels[ids]) for ids in stream.steps],
      "step_task": _ints(stream.step_task),
      "task_end_steps": _ints(stream.task_end_steps()),
      "task_classes": [_ints(c) for c in stream.task_classes],
      "test": {"ids": _ints(test_ids), "labels": _ints(test_source.labels)},
  }
  train_paths, test_paths = paths_of(train_source), paths_of(test_source)
  if train_paths is not None:  # a folder source: each example's file, relative to the dataset
    manifest["step_paths"] = [[train_paths[i] for i in ids] for ids in stream.steps]
  if test_paths is not None:
    manifest["test"]["paths"] = list(test_paths)
  train_digests, test_digests = digests_of(train_source), digests_of(test_source)
  if digests and train_digests is not None and test_digests is not None:
    manifest["digest"] = train_source.digest_kind  # what names the images, on any source
    manifest["step_digests"] = [train_digests[ids].tolist() for ids in stream.steps]
    manifest["test"]["digests"] = test_digests.tolist()
  if stream.task_domains is not None:  # domain streams: each task's domain, each test domain
    manifest["task_domains"] = _ints(stream.task_domains)
  test_domains = getattr(test_source, "domains", None)
  if test_domains is not None:
    manifest["test"]["domains"] = _ints(test_domains)
  if stream.disjoint_classes is not None:
    manifest["si_blurry"] = {"disjoint_classes": _ints(stream.disjoint_classes),
                             "home_task": _ints(stream.home_task)}
  return manifest


def canonical_bytes(manifest: dict) -> bytes:
  return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_sha256(manifest: dict) -> str:
  """SHA-256 of the manifest's canonical JSON bytes (the `stream_manifest_sha256` of a run)."""
  return hashlib.sha256(canonical_bytes(manifest)).hexdigest()


def _holds(path: str, data: bytes) -> bool:
  if not (os.path.isfile(path) and os.path.getsize(path) == len(data)):
    return False
  with open(path, "rb") as f:
    return f.read() == data


def write_manifest(path: str, manifest: dict) -> str:
  """Writes the canonical bytes to `path` (atomically; not at all when the file already holds
  them, as on every resume) and returns their SHA-256."""
  data = canonical_bytes(manifest)
  if not _holds(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)  # a reader never sees half a manifest
  return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# Replay: a manifest file -> the Stream it lists.


class ManifestError(ValueError):
  """A stream manifest that cannot be replayed on the configured data (one line, with the fix)."""


def read_manifest(path: str) -> dict:
  """The manifest in `path`, checked against its schema (`check_manifest`) before anything is
  computed from it; FileNotFoundError / ManifestError (one line) otherwise."""
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"data.stream_manifest={path!r} does not exist; give the path of a stream_manifest.json")
  try:
    with open(path, "rb") as f:
      manifest = json.loads(f.read())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ManifestError(f"data.stream_manifest={path!r} is not valid JSON ({e}); give a stream"
                        " manifest file (docs/replay.md)") from None
  return check_manifest(manifest, path)


# The manifest's schema (docs/replay.md's table): field -> (required, type, what it holds). A
# type is INT (a JSON integer that fits 64 bits: ids, labels, classes and tasks are int64 here),
# STR, [type] (a list of them) or {field: (required, type, meaning)} (an object; other fields
# are kept as they are).
INT, STR = "int", "str"
INT64 = (-2**63, 2**63)
SCHEMA = {
    "format": (True, STR, f"the string {FORMAT!r}"),
    "steps": (True, [[INT]], "the example ids of each step's batch, a non-empty list of lists"
                             " of integers"),
    "step_task": (True, [INT], "the true task of each step, a list of integers"),
    "task_classes": (True, [[INT]], "the classes of each task, a list of lists of integers"),
    "task_end_steps": (False, [INT], "the last step of each task, a list of integers"),
    "step_labels": (False, [[INT]], "the label of every id of steps, a list of lists of"
                                    " integers"),
    "step_paths": (False, [[STR]], "the file of every id of steps, a list of lists of strings"),
    "step_digests": (False, [[STR]], "the image digest of every id of steps, a list of lists of"
                                     " strings"),
    "digest": (False, STR, "what the digests hash, a string"),
    "test": (False, {"ids": (True, [INT], "the test set's ids, a list of integers"),
                     "labels": (True, [INT], "the test set's labels, a list of integers"),
                     "paths": (False, [STR], "the test set's files, a list of strings"),
                     "digests": (False, [STR], "the test set's digests, a list of strings"),
                     "domains": (False, [INT], "the test set's domains, a list of integers")},
             "the test set, an object {\"ids\": [...], \"labels\": [...]}"),
    "source": (False, STR, "the dataset it was recorded on, a string"),
    "num_classes": (False, INT, "the dataset's class count, an integer"),
    "params": (False, {"epochs": (False, INT, "passes over the data, an integer")},
               "the stream's parameters, an object"),
    "si_blurry": (False, {"disjoint_classes": (True, [INT], "a list of integers"),
                          "home_task": (True, [INT], "a list of integers")},
                  "an object {\"disjoint_classes\": [...], \"home_task\": [...]}"),
    "task_domains": (False, [INT], "each task's domain, a list of integers"),
}
_KINDS = {INT: "an integer", STR: "a string"}


def _kind(kind) -> str:
  if isinstance(kind, list):
    inner = _kind(kind[0])
    return "a list of " + (inner.replace("a list of ", "lists of ", 1) if inner.startswith("a list")
                           else inner.split(" ", 1)[1] + "s")
  return _KINDS.get(kind, "an object") if not isinstance(kind, dict) else "an object"


def _shown(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _schema_problem(value, kind, at: str) -> str:
  """'' when `value` is of `kind` (SCHEMA's types), else where and what it is instead."""
  if kind == INT:
    if not isinstance(value, int) or isinstance(value, bool):
      return f"{at} is {_shown(value)}, not an integer"
    if not INT64[0] <= value < INT64[1]:
      return f"{at} is {value}, outside the 64-bit integers (ids, labels, classes, tasks)"
    return ""
  if kind == STR:
    return "" if isinstance(value, str) else f"{at} is {_shown(value)}, not a string"
  if isinstance(kind, list):
    if not isinstance(value, list):
      return f"{at} is {_shown(value)}, not {_kind(kind)}"
    for i, item in enumerate(value):
      found = _schema_problem(item, kind[0], f"{at}[{i}]")
      if found:
        return found
    return ""
  if not isinstance(value, dict):
    return f"{at} is {_shown(value)}, not an object"
  for field, (required, inner, _) in kind.items():
    if field in value:
      found = _schema_problem(value[field], inner, f"{at}.{field}")
      if found:
        return found
    elif required:
      return f"{at} lacks its field {field!r}"
  return ""


def check_manifest(manifest, path: str = "<manifest>") -> dict:
  """The one check of a manifest against its documented schema (SCHEMA, docs/replay.md): a JSON
  object with the required fields, each field of its type, every integer within 64 bits, one
  entry per step where a field gives one. Raises ManifestError naming the file, the entry and
  its value; returns `manifest`. Run before anything is computed from it (`read_manifest`), and
  by `replay_stream` and `translate_manifest` on the manifests they are given; what the data
  must agree with (ids in the split, labels, the test set) is theirs to check."""
  if not isinstance(manifest, dict):
    raise ManifestError(f"{path} must hold a JSON object, got {type(manifest).__name__}")
  if manifest.get("format") != FORMAT:
    raise ManifestError(f"{path}: format is {manifest.get('format')!r}, expected {FORMAT!r};"
                        " set \"format\" to it (docs/replay.md describes the fields)")
  for field, (required, kind, meaning) in SCHEMA.items():
    if field not in manifest:
      if required:
        raise ManifestError(f"{path}: the required field {field!r} is missing (docs/replay.md)")
      continue
    problem = _schema_problem(manifest[field], kind, field)
    if problem:
      raise ManifestError(f"{path}: {problem}; give {field} as {meaning} (docs/replay.md)")
  steps = manifest["steps"]
  if not steps:
    raise ManifestError(f"{path}: steps must be a non-empty list of lists of example ids")
  if len(manifest["step_task"]) != len(steps):
    raise ManifestError(f"{path}: step_task has {len(manifest['step_task'])} entries for"
                        f" {len(steps)} steps; give one task per step")
  for field in ("step_labels", "step_paths", "step_digests"):
    if field in manifest and len(manifest[field]) != len(steps):
      raise ManifestError(f"{path}: {field} must have one list per step ({len(steps)})")
  if "task_domains" in manifest and len(manifest["task_domains"]) != len(
      manifest["task_classes"]):
    raise ManifestError(f"{path}: task_domains has {len(manifest['task_domains'])} entries for"
                        f" {len(manifest['task_classes'])} tasks; give one domain id per task")
  return manifest


def _int_list(value) -> np.ndarray:
  """A list of integers `check_manifest` passed, as an (n,) int64 array."""
  return np.asarray(value, np.int64).reshape(-1)


def _step_ids(manifest: dict) -> list[np.ndarray]:
  """The manifest's `steps` (checked by `check_manifest`) as int64 arrays."""
  return [_int_list(ids) for ids in manifest["steps"]]


def _digest_lists(manifest: dict, step_ids: list[np.ndarray], path: str) -> list[list[str]]:
  """`step_digests` (of strings, one list per step: `check_manifest`), checked to hold one
  digest per id of `steps`."""
  recorded = manifest["step_digests"]
  if any(len(x) != len(ids) for x, ids in zip(recorded, step_ids, strict=True)):
    raise ManifestError(f"{path}: step_digests must hold one digest (a string) per id of steps")
  return recorded


def _rows_of(ids: np.ndarray, record_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Rows of `record_ids` holding each of `ids`, and the mask of ids found."""
  order = np.argsort(record_ids, kind="stable")
  pos = np.clip(np.searchsorted(record_ids[order], ids), 0, max(len(order) - 1, 0))
  found = record_ids[order][pos] == ids if len(order) else np.zeros(len(ids), bool)
  return order[pos], found


def replay_stream(manifest: dict, train_source, test_source, batch_size: int,
                  path: str = "<manifest>") -> Stream:
  """The Stream a manifest lists over `train_source` (rows of the source, not record ids).

  Required fields: `format`, `steps` (record ids per step), `step_task`, `task_classes`.
  Checked when present: `source`, `num_classes`, `step_labels`, `step_paths` (folder sources),
  `task_end_steps`, `test`; kept when present: `si_blurry`, `task_domains` (a domain stream,
  evaluated per domain).
  Raises ManifestError (one line) on a manifest its schema refuses (`check_manifest`) or on
  anything that does not fit the data or the batch size.
  """
  check_manifest(manifest, path)
  name = _source_name(train_source)
  if "source" in manifest and manifest["source"] != name:
    raise _foreign(manifest, name, path)
  num_classes = int(train_source.num_classes)
  if "num_classes" in manifest and manifest["num_classes"] != num_classes:
    raise ManifestError(f"{path}: num_classes={manifest['num_classes']} but the data has"
                        f" {num_classes} classes; it was recorded on other data")
  step_ids = _step_ids(manifest)
  for i, ids in enumerate(step_ids):
    if not 1 <= len(ids) <= batch_size:
      raise ManifestError(f"{path}: step {i} has {len(ids)} examples but learner.batch_size is"
                          f" {batch_size}; every step needs 1..batch_size ids (set"
                          " learner.batch_size to the manifest's batch size)")
  for i, ids in enumerate(step_ids):
    repeated, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
      raise ManifestError(
          f"{path}: step {i} lists example id {int(repeated[counts > 1][0])}"
          f" {int(counts.max())} times; a batch holds distinct examples: fix the manifest")
  flat = np.concatenate(step_ids)
  ids, counts = np.unique(flat, return_counts=True)
  passes = max(int((manifest.get("params") or {}).get("epochs", 1) or 1), 1)
  if counts.max() > passes:  # a stream sees each example once per pass over the data
    worst = int(ids[np.argmax(counts)])
    logging.warning(
        "%s: %d example id(s) occur in more steps than the stream's %d pass(es) over the data"
        " (id %d: %d times); replaying the steps as listed", path, int((counts > passes).sum()),
        passes, worst, int(counts.max()))
  train_ids = record_ids(train_source)
  rows, found = _rows_of(flat, train_ids)
  if not found.all():
    unknown = np.unique(flat[~found])
    raise ManifestError(
        f"{path}: {len(unknown)} example id(s) are not in the training split of"
        f" {name!r}: {unknown[:8].tolist()}{' ...' if len(unknown) > 8 else ''}; the manifest"
        " was recorded on other data or a different split (data.test_fraction, data.split_seed)")
  labels = np.asarray(train_source.labels, np.int64)[rows]
  offsets = np.cumsum([0] + [len(ids) for ids in step_ids])
  if "step_labels" in manifest:
    for i, x in enumerate(manifest["step_labels"]):
      if not np.array_equal(_int_list(x), labels[offsets[i]:offsets[i + 1]]):
        raise ManifestError(
            f"{path}: step {i}'s step_labels differ from the data's labels of its ids; the"
            " manifest was edited or recorded on other data: refusing to replay it")
  train_paths = paths_of(train_source)
  if "step_paths" in manifest and train_paths is not None:
    for i, x in enumerate(manifest["step_paths"]):
      if x != [train_paths[r] for r in rows[offsets[i]:offsets[i + 1]]]:
        raise ManifestError(
            f"{path}: step {i}'s step_paths differ from the files of its ids in data.data_dir;"
            " the manifest was recorded on another folder: refusing to replay it")
  train_digests = digests_of(train_source)
  if "step_digests" in manifest and train_digests is not None:
    recorded = _digest_lists(manifest, step_ids, path)
    for i, x in enumerate(recorded):
      if x != train_digests[rows[offsets[i]:offsets[i + 1]]].tolist():
        raise ManifestError(
            f"{path}: step {i}'s step_digests differ from the images of its ids in {name!r}; the"
            " images changed since the manifest was recorded: refusing to replay it")
  step_task = _int_list(manifest["step_task"])
  n_tasks = len(manifest["task_classes"])
  if n_tasks < 1 or step_task[0] != 0 or np.any(np.diff(step_task) < 0) or np.any(
      np.diff(step_task) > 1) or step_task[-1] != n_tasks - 1:
    raise ManifestError(f"{path}: step_task must run through the tasks 0..{n_tasks - 1} of"
                        " task_classes in order, each task a contiguous run of steps")
  task_classes = tuple(np.unique(_int_list(c)) for c in manifest["task_classes"])
  for t, classes in enumerate(task_classes):
    if len(classes) and (classes.min() < 0 or classes.max() >= num_classes):
      raise ManifestError(f"{path}: task_classes[{t}] names classes outside [0, {num_classes})")
  for i, t in enumerate(step_task):
    outside = np.setdiff1d(labels[offsets[i]:offsets[i + 1]], task_classes[t])
    if len(outside):
      raise ManifestError(f"{path}: step {i} (task {t}) holds classes {outside.tolist()} that"
                          f" task_classes[{t}] does not list; add them to the task's classes")
  extra = {}
  if "si_blurry" in manifest:
    extra = {"disjoint_classes": _int_list(manifest["si_blurry"]["disjoint_classes"]),
             "home_task": _int_list(manifest["si_blurry"]["home_task"])}
  if "task_domains" in manifest:  # a domain stream: evaluated per domain (docs/streams.md)
    extra["task_domains"] = _int_list(manifest["task_domains"])
  stream = Stream(steps=tuple(rows[offsets[i]:offsets[i + 1]] for i in range(len(step_ids))),
                  step_task=step_task, task_classes=task_classes, **extra)
  if "task_end_steps" in manifest and _int_list(manifest["task_end_steps"]).tolist() != (
          stream.task_end_steps().tolist()):
    raise ManifestError(f"{path}: task_end_steps {manifest['task_end_steps']} disagree with"
                        f" step_task (last step of each task: {stream.task_end_steps().tolist()})")
  if "test" in manifest:
    test = manifest["test"]
    test_ids, test_labels = _int_list(test["ids"]), _int_list(test["labels"])
    test_paths, test_digests = paths_of(test_source), digests_of(test_source)
    if not (np.array_equal(test_ids, record_ids(test_source))
            and np.array_equal(test_labels, np.asarray(test_source.labels, np.int64))
            and ("paths" not in test or test_paths is None
                 or test["paths"] == list(test_paths))
            and ("digests" not in test or test_digests is None
                 or test["digests"] == test_digests.tolist())):
      raise ManifestError(
          f"{path}: the manifest's test set differs from the test split of {name!r}; it was"
          " recorded with another split (data.test_fraction, data.split_seed) or other data")
  return stream


def _foreign(manifest: dict, name: str, path: str) -> ManifestError:
  return ManifestError(f"{path}: recorded on source {manifest['source']!r} but data.dataset"
                       f" loads {name!r}; set data.dataset (and data.source) to the manifest's"
                       " dataset")


# --------------------------------------------------------------------------------------------
# Replay on another source of the same dataset: the manifest's images found by their digests.


def _dataset_of(source_name: str) -> str:
  return str(source_name).split(":")[0]


def _candidates(sources: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
  """(record ids, digests, labels, paths or None) of the rows of `sources` (one record pool),
  in record-id order."""
  ids = np.concatenate([record_ids(s) for s in sources])
  digests = np.concatenate([digests_of(s) for s in sources])
  labels = np.concatenate([np.asarray(s.labels, np.int64) for s in sources])
  paths = [paths_of(s) for s in sources]
  paths = None if any(p is None for p in paths) else [x for p in paths for x in p]
  order = np.argsort(ids, kind="stable")
  return ids[order], digests[order], labels[order], (
      None if paths is None else [paths[i] for i in order])


def _pair(digests: list[str], labels: list[int | None], candidates, taken: set) -> np.ndarray:
  """For each wanted (digest, label), the position of an untaken candidate with that digest and
  label (repeated images: the k-th wanted one gets the k-th candidate), or -1."""
  _, cand_digests, cand_labels, _ = candidates
  index: dict[str, list[int]] = {}
  for pos, d in enumerate(cand_digests.tolist()):
    if pos not in taken:
      index.setdefault(d, []).append(pos)
  out = np.full(len(digests), -1, np.int64)
  for j, (d, label) in enumerate(zip(digests, labels, strict=True)):
    free = index.get(d, [])
    k = next((k for k, pos in enumerate(free)
              if label is None or int(cand_labels[pos]) == label), None)
    if k is not None:
      out[j] = free.pop(k)
  return out


def _unmatched(path: str, what: str, n_missing: int, n: int, example: str, digest: str,
               label, here: str, there: str, candidates, other=None) -> ManifestError:
  """The one line refusing images this source does not hold (or holds with other labels, or in
  its other split)."""
  hits = np.flatnonzero(candidates[1] == digest)
  relabelled = [h for h in hits if label is not None and int(candidates[2][h]) != label]
  if relabelled:
    at = _where(candidates, relabelled[0])
    return ManifestError(
        f"{path}: {n_missing} of the manifest's {n} {what} images are not in {here!r} with their"
        f" labels ({example} has label {label}; the same image is {at} with label"
        f" {int(candidates[2][relabelled[0]])}); the two sources number the classes otherwise:"
        " give the folder the benchmark's class folders (docs/streams.md)")
  hits = [] if other is None else np.flatnonzero(other[1] == digest)
  if len(hits):
    return ManifestError(
        f"{path}: {n_missing} of the manifest's {n} {what} images are in the other split of"
        f" {here!r} (e.g. {example}, here {_where(other, hits[0])}); it splits train and test"
        f" otherwise than {there!r}: replay it on data with the manifest's split (one tree for"
        " a seeded split)")
  return ManifestError(
      f"{path}: {n_missing} of the manifest's {n} {what} images are not in {here!r} (e.g."
      f" {example}, digest {digest}); its images differ from those of {there!r}, where it was"
      f" recorded: point data.data_dir at the same images, or replay it on {there!r}")


def _where(candidates, pos: int) -> str:
  ids, _, _, paths = candidates
  return paths[pos] if paths is not None else f"id {int(ids[pos])}"


def translate_manifest(manifest: dict, train_source, test_source,
                       path: str = "<manifest>") -> tuple[dict, object, object]:
  """`manifest`, recorded on another source of the dataset (TFDS, or a folder in another
  layout), in this source's terms: each of its images is found here by its digest and label.

  Returns (the manifest with this source's name, record ids and paths; the training source
  re-indexed to its training images; the test source re-indexed to its test images, in its
  order): the split is the manifest's, whatever this source's own. `replay_stream` then checks
  and replays it as usual. Raises ManifestError (one line) when the manifest records no digests,
  or when an image is not here (naming how many, and one)."""
  check_manifest(manifest, path)
  here, there = _source_name(train_source), manifest["source"]
  if _dataset_of(there) != _dataset_of(here):
    raise _foreign(manifest, here, path)
  kind = getattr(train_source, "digest_kind", None)
  if "step_digests" not in manifest or not isinstance(manifest.get("test"), dict) or (
      "digests" not in manifest["test"]):
    raise ManifestError(
        f"{path}: recorded on {there!r} but data.source and data.data_dir read {here!r}, and it"
        " records no image digests (step_digests, test.digests) to find its images here: replay"
        f" it on {there!r}, or record the stream again there (runs write the digests)")
  if digests_of(train_source) is None or digests_of(test_source) is None:
    raise ManifestError(
        f"{path}: recorded on {there!r}, but {here!r} does not compute image digests, so its"
        f" images cannot be found here: replay it on {there!r}")
  if manifest.get("digest") != kind:
    raise ManifestError(f"{path}: its digests are {manifest.get('digest')!r} but {here!r}"
                        f" computes {kind!r}; it was recorded on another dataset")
  step_ids = _step_ids(manifest)
  step_digests = _digest_lists(manifest, step_ids, path)
  step_labels = manifest.get("step_labels")
  if not (isinstance(step_labels, list) and len(step_labels) == len(step_ids) and all(
      isinstance(x, list) and len(x) == len(ids) for x, ids in zip(step_labels, step_ids,
                                                                   strict=True))):
    step_labels = [[None] * len(ids) for ids in step_ids]  # malformed: replay_stream says so
  step_paths = manifest.get("step_paths")
  # One (digest, label) per distinct training example of the manifest, in id order.
  examples: dict[int, tuple] = {}
  for i, ids in enumerate(step_ids):
    for j, example in enumerate(ids.tolist()):
      seen = examples.setdefault(example, (step_digests[i][j], step_labels[i][j], i, j))
      if seen[0] != step_digests[i][j]:
        raise ManifestError(f"{path}: example id {example} has two digests in step_digests;"
                            " fix the manifest")
  train_ids = sorted(examples)

  def name(i, j, example):
    if isinstance(step_paths, list) and i < len(step_paths) and j < len(step_paths[i]):
      return f"{step_paths[i][j]} (id {example})"
    return f"example id {example}"

  shared = getattr(train_source, "record_pool", None) is not None and (
      train_source.record_pool is getattr(test_source, "record_pool", None))
  pool = _candidates([train_source, test_source] if shared else [train_source])
  other = None if shared else _candidates([test_source])
  wanted = [examples[e] for e in train_ids]
  found = _pair([w[0] for w in wanted], [w[1] for w in wanted], pool, set())
  if (found < 0).any():
    miss = int(np.flatnonzero(found < 0)[0])
    d, label, i, j = wanted[miss]
    raise _unmatched(path, "training", int((found < 0).sum()), len(wanted),
                     name(i, j, train_ids[miss]), d, label, here, there, pool, other)
  here_of = dict(zip(train_ids, pool[0][found].tolist(), strict=True))
  test = manifest["test"]
  test_digests = test["digests"]
  test_labels = test["labels"]
  if len(test_labels) != len(test_digests):
    raise ManifestError(f"{path}: test.labels must give one label per test.digests entry")
  test_pool = pool if shared else other
  taken = set(found.tolist()) if shared else set()
  test_found = _pair(test_digests, test_labels, test_pool, taken)
  if (test_found < 0).any():
    miss = int(np.flatnonzero(test_found < 0)[0])
    paths = test.get("paths")
    example = (f"{paths[miss]}" if isinstance(paths, list) and miss < len(paths) else
               f"test example {miss}")
    raise _unmatched(path, "test", int((test_found < 0).sum()), len(test_digests), example,
                     test_digests[miss], test_labels[miss], here, there, test_pool,
                     None if shared else pool)
  new_train = train_source.with_records(np.asarray(sorted(here_of.values()), np.int64), "train")
  new_test = test_source.with_records(test_pool[0][test_found], "test")
  translated = {k: v for k, v in manifest.items() if k != "step_paths"}
  translated["source"] = here
  translated["steps"] = [[here_of[e] for e in ids.tolist()] for ids in step_ids]
  translated_test = {k: v for k, v in test.items() if k != "paths"}
  translated_test["ids"] = _ints(record_ids(new_test))
  if paths_of(new_train) is not None:
    where = dict(zip(record_ids(new_train).tolist(), paths_of(new_train), strict=True))
    translated["step_paths"] = [[where[e] for e in ids] for ids in translated["steps"]]
  if paths_of(new_test) is not None:
    translated_test["paths"] = list(paths_of(new_test))
  translated["test"] = translated_test
  return translated, new_train, new_test


def build_stream_and_manifest(data_config: ml_collections.ConfigDict, seed: int, batch_size: int,
                              train_source, test_source) -> tuple[Stream, dict, object, object]:
  """The run's stream, its manifest and its (train, test) sources: replayed from
  `data_config.stream_manifest` when set, else built from the seed (`streams.build_stream`).
  A manifest recorded on another source of the dataset replays on the images it names
  (`translate_manifest`): the sources returned are then re-indexed to them."""
  path = data_config.stream_manifest
  if not path:
    stream = streams_lib.build_stream(data_config, train_source, batch_size, seed)
    return stream, stream_manifest(data_config, seed, batch_size, stream, train_source,
                                   test_source), train_source, test_source
  given = read_manifest(path)
  replayed = given
  if "source" in given and given["source"] != _source_name(train_source):
    replayed, train_source, test_source = translate_manifest(given, train_source, test_source,
                                                             path)
    logging.info("replaying %s, recorded on %r, on %r: its %d training and %d test images found"
                 " here by their digests", path, given["source"], replayed["source"],
                 len(train_source), len(test_source))
  stream = replay_stream(replayed, train_source, test_source, batch_size, path)
  manifest = stream_manifest(data_config, seed, batch_size, stream, train_source, test_source,
                             params=given.get("params", {}), digests="step_digests" in given)
  logging.info("replaying %s: %d steps, %d tasks; the complete manifest's SHA-256 is %s%s", path,
               len(stream.steps), stream.n_tasks, manifest_sha256(manifest),
               " (the file's own canonical hash)" if manifest == given else "")
  return stream, manifest, train_source, test_source
