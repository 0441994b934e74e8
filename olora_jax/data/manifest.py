"""The stream manifest: what a run trains and tests on, in an exact, hashable record.

A manifest lists the example ids of every step (ids are each example's index in the original
dataset split: the TFDS record index, or the row of an embedded dataset), their labels, the true
task of every step and the task boundaries (evaluator only), each task's classes, Si-Blurry's
disjoint classes and home tasks, a domain stream's task domains, and the test set's ids and labels
(and domains, when the dataset has them), together with the parameters
that produced them. It holds integers and strings only, so its canonical JSON encoding (sorted
keys, no spaces) is the same bytes on any machine; `manifest_sha256` is the SHA-256 of those bytes,
and `write_manifest` writes exactly those bytes, so `sha256sum stream_manifest.json` prints the
`stream_manifest_sha256` of results.json.
"""

from __future__ import annotations

import hashlib
import json
import os

import ml_collections
import numpy as np

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


def stream_manifest(data_config: ml_collections.ConfigDict, seed: int, batch_size: int,
                    stream: Stream, train_source, test_source) -> dict:
  """The manifest of `stream` over `train_source`, tested on `test_source`."""
  train_ids = np.asarray(train_source.record_ids if train_source.record_ids is not None
                         else np.arange(len(train_source)), np.int64)
  test_ids = np.asarray(test_source.record_ids if test_source.record_ids is not None
                        else np.arange(len(test_source)), np.int64)
  manifest = {
      "format": FORMAT,
      "source": getattr(train_source, "version", None) or train_source.name,
      "params": stream_params(data_config, seed, batch_size, not train_source.seeded_split),
      "num_classes": int(train_source.num_classes),
      "steps": [_ints(train_ids[ids]) for ids in stream.steps],
      "step_labels": [_ints(train_source.labels[ids]) for ids in stream.steps],
      "step_task": _ints(stream.step_task),
      "task_end_steps": _ints(stream.task_end_steps()),
      "task_classes": [_ints(c) for c in stream.task_classes],
      "test": {"ids": _ints(test_ids), "labels": _ints(test_source.labels)},
  }
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
