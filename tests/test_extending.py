"""What a researcher extends: the public API, the examples, user datasets with domain ids,
domain streams evaluated per domain, explicit class orders, and rotated MNIST."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import ml_collections
import numpy as np
import pytest

import olora_jax
from configs import tiny
from olora_jax import evaluate, metrics, trainer
from olora_jax.data import sources, streams
from olora_jax.data.streams import EvaluationGroups

ROOT = Path(__file__).resolve().parents[1]


def load_file(path: Path, name: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_public_api_exports_documented_building_blocks():
  for name in olora_jax.__all__:
    doc = (getattr(olora_jax, name).__doc__ or "").strip()
    # A dataclass or NamedTuple without a docstring gets its signature as __doc__.
    assert len(doc) > 40 and not doc.startswith(f"{name}("), f"olora_jax.{name}: no docstring"


# ------------------------------------------------------------------------------------------
# The custom-loop example equals the trainer on the same user dataset.

LOOP = dict(n_tasks=5, batch_size=32, image_size=16, width=16, depth=1, pretrained=None,
            learning_rate=3e-3, mean_threshold=4.0, var_threshold=0.5, seed=0)


def loop_as_config() -> ml_collections.ConfigDict:
  """tiny.py with the example's settings and its arrays as a user dataset."""
  config = tiny.get_config()
  config.data.dataset = str(ROOT / "examples" / "custom_loop.py") + ":my_arrays"
  config.model.num_heads, config.model.mlp_dim = 4, 64
  config.eval.write_plots = False
  config.checkpoint_every = 0
  return config


def test_custom_loop_example_reproduces_the_trainer(tmp_path):
  example = load_file(ROOT / "examples" / "custom_loop.py", "custom_loop_example")
  lines = []
  got = example.run(*example.my_arrays(), log=lines.append, **LOOP)
  assert len(lines) == 6 and lines[-1].startswith("A_final")
  acc = got["acc_matrix"]
  assert acc.shape == (5, 5) and np.all((acc >= 0) & (acc <= 1))
  assert got["A_final"] == pytest.approx(metrics.a_final(acc))
  # The same algorithm through train_and_evaluate, the arrays given as 'file.py:function'.
  results = trainer.train_and_evaluate(loop_as_config(), str(tmp_path), progress=False)
  assert results["n_plateaus"] == got["n_plateaus"]
  np.testing.assert_allclose(results["acc_matrix"], acc, atol=1e-6)


# ------------------------------------------------------------------------------------------
# A user dataset with domains, from outside the package: a domain stream evaluated per domain.


@pytest.fixture(scope="module")
def domain_run(tmp_path_factory):
  module = load_file(ROOT / "examples" / "user_dataset" / "config.py", "user_dataset_config")
  config = module.get_config()
  # The example runs the demo's pretrained backbone (its docstring has the numbers); the
  # bookkeeping tested here is the same on the tiny random model, at a fraction of the time.
  config.model.update(tiny.get_config().model.to_dict())
  config.pretrained.path = ""
  config.checkpoint_every = 0
  config.eval.eval_every = 1  # an anytime point at every step, task ends included
  config.learner.batch_size = 128  # 32 steps
  workdir = str(tmp_path_factory.mktemp("user_dataset"))
  return trainer.train_and_evaluate(config, workdir, progress=False), workdir


def test_user_dataset_config_gives_a_per_domain_accuracy_matrix(domain_run):
  results, workdir = domain_run
  acc = np.asarray(results["acc_matrix"])
  assert acc.shape == (4, 4) and results["task_domains"] == [0, 1, 2, 3]
  # Every task has all 10 classes: grouped by class, every row would be the same.
  assert len({tuple(row) for row in acc.tolist()}) == 4
  # Forgetting per domain, by hand: best accuracy before the last domain minus the final one.
  hand = [max(acc[k, :3]) - acc[k, 3] for k in range(3)]
  np.testing.assert_allclose(results["forgetting_per_domain"], hand)
  assert results["forgetting"] == pytest.approx(np.mean(hand))
  assert "forgetting_per_domain" in results["metric_notes"]
  with open(os.path.join(workdir, "stream_manifest.json")) as f:
    manifest = json.load(f)
  assert manifest["task_domains"] == [0, 1, 2, 3]
  assert sorted(set(manifest["test"]["domains"])) == [0, 1, 2, 3]
  # Anytime accuracy covers the domains seen so far: at the end of domain j it is the mean of
  # the accuracies on domains 0..j weighted by their test sizes.
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    events = [json.loads(line) for line in f]
  anytime = {e["step"]: e["anytime_accuracy"] for e in events if e["event"] == "eval"}
  sizes = np.bincount(manifest["test"]["domains"])
  ends = [e for e in events if e["event"] == "task_end"]
  for j, end in enumerate(ends):
    column = np.asarray(end["task_accuracies"])
    expected = np.sum(column[: j + 1] * sizes[: j + 1]) / np.sum(sizes[: j + 1])
    assert anytime[end["step"]] == pytest.approx(expected)


def test_group_accuracies_by_domain_by_hand():
  # 2 domains x 3 classes of (correct, total) counts.
  correct = np.array([[1, 2, 0], [3, 0, 4]])
  total = np.array([[2, 2, 1], [4, 2, 4]])
  counts = evaluate.ClassCounts(correct.sum(0), total.sum(0), correct, total, np.array([5, 7]))
  by_domain = EvaluationGroups((np.arange(3), np.arange(3)), np.array([7, 5]))
  np.testing.assert_allclose(evaluate.group_accuracies(counts, by_domain), [7 / 10, 3 / 5])
  # Only classes {0, 1} count; domain 7 not seen yet.
  np.testing.assert_allclose(
      evaluate.group_accuracies(counts, by_domain, [0, 1], domains=np.array([5])),
      [np.nan, 3 / 4])
  assert counts.accuracy([0, 1], domains=np.array([7])) == pytest.approx(3 / 6)
  by_class = EvaluationGroups((np.array([0]), np.array([1, 2])), None)
  np.testing.assert_allclose(evaluate.group_accuracies(counts, by_class), [4 / 6, 6 / 9])


def test_forgetting_per_task_by_hand():
  acc = np.array([[0.9, 0.5, 0.4], [0.1, 0.8, 0.7], [0.0, 0.2, 0.6]])
  np.testing.assert_allclose(metrics.forgetting_per_task(acc), [0.9 - 0.4, 0.8 - 0.7])
  assert metrics.forgetting(acc) == pytest.approx(np.mean([0.5, 0.1]))
  assert metrics.forgetting_per_task(acc[:1, :1]).shape == (0,)


def test_a_domain_stream_manifest_replays_with_its_domains():
  from olora_jax.data import manifest as manifest_lib

  rng = np.random.default_rng(0)
  labels, domains = np.arange(60) % 3, np.arange(60) // 20
  images = rng.integers(0, 256, (60, 4, 4, 1)).astype(np.uint8)
  train, test = sources.split_arrays("toy", images, labels, domains, 0.25, 0)
  config = data_config(dataset="toy", scenario="domain")
  stream = streams.build_stream(config, train, 4, 0)
  manifest = manifest_lib.stream_manifest(config, 0, 4, stream, train, test)
  assert manifest["task_domains"] == [0, 1, 2] and len(manifest["test"]["domains"]) == len(test)
  replayed = manifest_lib.replay_stream(manifest, train, test, 4)
  assert replayed.task_domains.tolist() == [0, 1, 2] and replayed.sha256() == stream.sha256()
  assert replayed.evaluation_groups(test.domains).by_domain


def test_core50_style_test_domains_fall_back_to_class_groups():
  stream = streams.domain_incremental(np.array([0, 1, 0, 1]), np.array([1, 1, 2, 2]), [1, 2],
                                      2, 0)
  assert stream.evaluation_groups(np.array([3, 3, 7])).by_domain is False  # held-out sessions
  assert stream.evaluation_groups(np.array([1, 2])).by_domain is True
  assert stream.evaluation_groups(None).by_domain is False


# ------------------------------------------------------------------------------------------
# User datasets and class orders: accepted forms and one-line errors.


def data_config(**overrides) -> ml_collections.ConfigDict:
  config = tiny.get_config()
  for k, v in overrides.items():
    config.data[k] = v
  return config.data


def test_user_dataset_forms(tmp_path):
  (tmp_path / "ds.py").write_text(
      "import numpy as np\n"
      "def pool():\n"
      "  return np.zeros((40, 4, 4, 1), np.uint8), np.arange(40) % 4\n"
      "def splits():\n"
      "  x = np.zeros((8, 4, 4, 3), np.uint8)\n"
      "  return {'train': (x, np.arange(8) % 2), 'test': (x[:3], np.array([0, 1, 2]))}\n"
      "def bad():\n"
      "  return 'images'\n"
      "def broken():\n"
      "  return {}['x']\n")
  train, test = sources.load_sources(data_config(dataset=f"{tmp_path}/ds.py:pool"), 16)
  assert (len(train), len(test)) == (32, 8) and train.num_classes == 4
  assert train.seeded_split and sorted(np.concatenate([train.record_ids, test.record_ids])) == \
      list(range(40))
  train, test = sources.load_sources(data_config(dataset=f"{tmp_path}/ds.py:splits"), 16)
  assert (len(train), len(test), train.num_classes, test.num_classes) == (8, 3, 3, 3)
  with pytest.raises(ValueError, match="returned str; return"):
    sources.load_sources(data_config(dataset=f"{tmp_path}/ds.py:bad"), 16)
  with pytest.raises(ValueError, match=r"ds.py:broken' raised KeyError: 'x'; fix the function"):
    sources.load_sources(data_config(dataset=f"{tmp_path}/ds.py:broken"), 16)
  with pytest.raises(ValueError, match="has no function 'nope'"):
    sources.load_sources(data_config(dataset=f"{tmp_path}/ds.py:nope"), 16)
  with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
    sources.load_sources(data_config(dataset="no_such_module_xyz:load"), 16)
  with pytest.raises(FileNotFoundError, match="no file"):
    sources.load_sources(data_config(dataset=f"{tmp_path}/missing.py:load"), 16)


def test_explicit_class_order():
  labels = np.repeat(np.arange(6), 3)
  stream = streams.disjoint_class_incremental(labels, 3, 4, 0, [5, 0, 3, 1, 2, 4])
  assert [c.tolist() for c in stream.task_classes] == [[0, 5], [1, 3], [2, 4]]
  same = streams.disjoint_class_incremental(labels, 3, 4, 0, "5,0,3,1,2,4")
  assert same.sha256() == stream.sha256()
  with pytest.raises(ValueError, match="list every class exactly once"):
    streams.disjoint_class_incremental(labels, 3, 4, 0, [5, 0, 3, 1, 2, 2])
  with pytest.raises(ValueError, match="unknown data.class_order='sorted'"):
    streams.disjoint_class_incremental(labels, 3, 4, 0, "sorted")


def test_rotated_mnist_domains():
  images, labels = sources._load_mnist_5k()
  rotated, rotated_labels, domains = sources._load_rotated_mnist_5k()
  np.testing.assert_array_equal(rotated_labels, labels)
  assert np.bincount(domains).tolist() == [1000] * 5
  for d in range(5):  # all 10 classes in every domain
    assert len(np.unique(labels[domains == d])) == 10
  np.testing.assert_array_equal(rotated[domains == 0], images[domains == 0])
  # Domain 3 is 90 degrees counter-clockwise: exactly np.rot90.
  np.testing.assert_array_equal(rotated[domains == 3], np.rot90(images[domains == 3],
                                                                axes=(1, 2)))
  train, test = sources.split_arrays("r", rotated, labels, domains, 0.2, 0)
  assert np.bincount(test.domains).tolist() == np.bincount(domains[test.record_ids]).tolist()
  assert all(np.bincount(test.domains) >= 190)
