"""Replay: a given stream manifest, given initial weights, the authors' checkpoint layout, traces.

The end-to-end tests share two short runs of the tiny config (module-scoped): one built from the
seed without a trace, and one replaying the first run's stream manifest with tracing on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from numerics import assert_close
from safetensors.numpy import load_file, save_file
from test_pretrained import FIX, SPEC, np_vit_timm

from configs import tiny
from olora_jax import compute, pretrained, trainer
from olora_jax import trace as trace_lib
from olora_jax.data import manifest as manifest_lib
from olora_jax.data import sources
from olora_jax.data.streams import Stream
from olora_jax.evaluate import Evaluator
from olora_jax.learner import online_lora
from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import VisionTransformer, ViTSpec


def _small_config():
  config = tiny.get_config()
  config.model.image_size = 8
  config.learner.batch_size = 64
  config.learner.mean_threshold = 100.0  # plateaus fire whenever a peak was seen
  config.learner.var_threshold = 100.0
  config.eval.eval_every = 700
  config.eval.write_plots = False
  return config


def _run(workdir, **overrides):
  config = _small_config()
  for dotted, value in overrides.items():
    section, key = dotted.split("__")
    (config if section == "top" else config[section])[key] = value
  return trainer.train_and_evaluate(config, str(workdir), progress=False)


def _outputs(workdir):
  results = json.loads((workdir / "results.json").read_text())
  for key in compute.MEASUREMENT_KEYS:
    del results[key]
  return results, (workdir / "metrics.jsonl").read_text()


REPLAYED = {"trace__enabled": True, "top__export_online_lora": True, "top__checkpoint_every": 8}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("replay")
  _run(root / "seeded")
  _run(root / "replayed", data__stream_manifest=str(root / "seeded" / "stream_manifest.json"),
       **REPLAYED)
  return root / "seeded", root / "replayed"



def test_replaying_a_manifest_with_tracing_on_reproduces_the_run_exactly(runs):
  seeded, replayed = runs
  # The replayed run writes back the very manifest it read (same bytes, same hash) ...
  assert (replayed / "stream_manifest.json").read_bytes() == (
      seeded / "stream_manifest.json").read_bytes()
  # ... and tracing on changes nothing: every metric, every logged scalar is identical.
  assert _outputs(replayed) == _outputs(seeded)
  assert not (seeded / trace_lib.FILENAME).exists()


def test_trace_contents_agree_with_the_run(runs):
  seeded, replayed = runs
  z = dict(np.load(replayed / trace_lib.FILENAME))
  results = json.loads((replayed / "results.json").read_text())
  events = [json.loads(line) for line in (replayed / "metrics.jsonl").read_text().splitlines()]
  train = [e for e in events if e["event"] == "train"]
  n, k = results["n_steps"], _small_config().learner.buffer_size
  assert z["step"].tolist() == list(range(n))
  np.testing.assert_array_equal(z["window_value"], np.float32([e["window_value"] for e in train]))
  np.testing.assert_array_equal(z["reg"], np.float32([e["reg"] for e in train]))
  np.testing.assert_array_equal(z["window_mean"], np.float32([e["window_mean"] for e in train]))
  assert z["plateau_step"].tolist() == results["plateau_steps"] == np.flatnonzero(
      z["plateau"]).tolist()
  # The detector's armed state: armed at every plateau, disarmed by it, re-armed at the steps of
  # the `rearm` events (here each in the step that fires the next plateau).
  armed, fired, rearmed = z["armed"], z["plateau"], z["rearmed"]
  assert armed[fired].all() and armed[0]
  rearms = [e["step"] for e in events if e["event"] == "rearm"]
  assert rearms and rearms == np.flatnonzero(rearmed).tolist() == [
      t for t in range(1, n) if armed[t] and not (armed[t - 1] and not fired[t - 1])]
  assert z["buffer_ids"].shape == (n, k) and z["buffer_scores"].shape == (n, k)
  # Every buffered id is an example the stream had shown by then; scores are ranked.
  manifest = json.loads((replayed / "stream_manifest.json").read_text())
  shown = set()
  for step, ids in enumerate(z["buffer_ids"]):
    shown |= set(manifest["steps"][step])
    assert set(ids[ids >= 0].tolist()) <= shown
  full = z["buffer_ids"].min(axis=1) >= 0
  assert np.all(np.diff(z["buffer_scores"][full], axis=1) <= 0)
  p = len(results["plateau_steps"])
  assert p >= 1 and z["omega/encoderblock_0/query/lora_a"].shape == (p, 16, 4)
  assert z["merged_lora/encoderblock_0/value/lora_b"].shape == (p, 4, 16)


def test_exported_final_model_scores_what_the_run_scored(runs):
  """export_online_lora writes the final model in the authors' layout; imported back, it makes
  exactly the run's final test predictions (per-class correct counts)."""
  _, replayed = runs
  config = _small_config()
  config.data.stream_manifest = str(replayed / "stream_manifest.json")
  path = str(replayed / trainer.EXPORT_FILENAME)
  config.learner.initial_lora = path  # the method starts from the exported LoRA and frozen pair
  setup = trainer.Setup(config)
  c, spec = setup.config, setup.spec
  params = pretrained.load_pretrained(path, spec, setup.num_classes, require_head=True)
  state = setup.method.init(jax.random.key(0), params)
  evaluator = Evaluator(setup.test_source, spec.image_size, c.eval.batch_size, setup.num_classes,
                        setup.method.predict, False, mesh=setup.mesh,
                        input_scale=c.data.input_scale)
  counts = evaluator.all_counts(state, np.arange(setup.num_classes))
  events = [json.loads(line) for line in (replayed / "metrics.jsonl").read_text().splitlines()]
  last_end = [e for e in events if e["event"] == "task_end"][-1]
  assert counts.correct.tolist() == last_end["class_correct"]


def test_a_resumed_run_continues_its_trace(runs, tmp_path):
  """Back to the checkpoint at step 8 (the later ones and the results removed): the resumed run
  drops the trace's later steps, restores the buffer ids and writes the same trace again."""
  seeded, replayed = runs
  resumed = tmp_path / "resumed"
  shutil.copytree(replayed, resumed)
  (resumed / "results.json").unlink()
  for step in os.listdir(resumed / "checkpoints"):
    if step.isdigit() and int(step) > 8:
      shutil.rmtree(resumed / "checkpoints" / step)
  _run(resumed, data__stream_manifest=str(seeded / "stream_manifest.json"), **REPLAYED)
  want, got = np.load(replayed / trace_lib.FILENAME), np.load(resumed / trace_lib.FILENAME)
  assert sorted(want.files) == sorted(got.files)
  for k in want.files:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# --------------------------------------------------------------------------------------------
# Hand-written manifests.


@pytest.fixture(scope="module")
def digits():
  config = _small_config()
  return sources.load_sources(config.data, config.model.image_size)


def _hand_manifest(train):
  """Six steps, two tasks, classes 9 and 8 first then 0, ids in a chosen order."""
  ids = np.asarray(train.record_ids)
  by_class = {c: ids[train.labels == c] for c in (0, 8, 9)}
  steps = [by_class[9][:5].tolist(), by_class[8][:3].tolist() + by_class[9][5:7].tolist(),
           by_class[8][3:10].tolist(), by_class[0][:4].tolist(), by_class[0][4:6].tolist(),
           by_class[0][6:16][::-1].tolist()]
  return {"format": manifest_lib.FORMAT, "steps": steps, "step_task": [0, 0, 0, 1, 1, 1],
          "task_classes": [[8, 9], [0]]}


def test_hand_written_manifest_replays_exactly(digits, tmp_path):
  train, test = digits
  manifest = _hand_manifest(train)
  path = tmp_path / "hand.json"
  path.write_text(json.dumps(manifest))
  results = _run(tmp_path / "run", data__stream_manifest=str(path))
  written = json.loads((tmp_path / "run" / "stream_manifest.json").read_text())
  assert written["steps"] == manifest["steps"]
  assert written["task_end_steps"] == [2, 5] == results["task_end_steps"]
  assert written["step_labels"][1] == [8, 8, 8, 9, 9]
  assert results["n_steps"] == 6 and results["samples_seen"] == sum(map(len, manifest["steps"]))
  assert np.array(results["acc_matrix"]).shape == (2, 2)
  # The pipeline feeds exactly those examples, in that order.
  stream = manifest_lib.replay_stream(manifest, train, test, 64)
  assert [np.asarray(train.record_ids)[s].tolist() for s in stream.steps] == manifest["steps"]


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["steps"][2].append(10**9), r"1 example id\(s\) are not in the training split"),
    (lambda m: m["step_labels"][4].__setitem__(0, 3), "step 4's step_labels differ"),
    (lambda m: m["steps"][4].__setitem__(0, m["steps"][0][0]), "step 4's step_labels differ"),
    (lambda m: m["test"]["ids"].pop(), "test set differs"),
    (lambda m: m.__setitem__("task_end_steps", [1, 5]), "task_end_steps"),
    (lambda m: m.__setitem__("step_task", [0, 1, 0, 1, 1, 1]), "contiguous"),
    (lambda m: m.__setitem__("task_classes", [[9], [0]]), "holds classes"),
    (lambda m: m.__setitem__("format", "v0"), "format"),
    (lambda m: m.__setitem__("num_classes", 11), "num_classes=11"),
    (lambda m: m.__setitem__("source", "mnist_5k"), "set data.dataset"),
])
def test_tampered_or_foreign_manifest_is_refused(digits, edit, match):
  train, test = digits
  stream = manifest_lib.replay_stream(_hand_manifest(train), train, test, 64)
  # The complete manifest (labels, test set, ...) as a run writes it, then one edit.
  manifest = manifest_lib.stream_manifest(_small_config().data, 0, 64, stream, train, test,
                                          params={})
  edit(manifest)
  with pytest.raises(manifest_lib.ManifestError, match=match):
    manifest_lib.replay_stream(manifest, train, test, 64, "m.json")


@pytest.mark.parametrize("edit,says", [
    # An id past 64 bits: was "unexpected OverflowError ... (raised at manifest.py) ... please
    # report it" with an error log left in the temp directory.
    (lambda m: m["steps"][1].__setitem__(2, 10**30),
     "steps[1][2] is 1000000000000000000000000000000, outside the 64-bit integers"),
    (lambda m: m["step_task"].__setitem__(3, True), "step_task[3] is true, not an integer"),
    (lambda m: m["task_classes"][1].append(1.5), "task_classes[1][1] is 1.5, not an integer"),
    (lambda m: m.__setitem__("test", [1, 2]), "test is [1, 2], not an object"),
    (lambda m: m.__setitem__("test", {"ids": [1]}), "test lacks its field 'labels'"),
    (lambda m: m.__setitem__("step_paths", [["a.png"], [3]]), "step_paths[1][0] is 3, not a"
                                                               " string"),
    (lambda m: m.__setitem__("params", {"epochs": "2"}), "params.epochs is \"2\", not an"),
    (lambda m: m.__setitem__("step_labels", [[8]]), "step_labels must have one list per step"),
    (lambda m: m.__setitem__("task_domains", [0]), "task_domains has 1 entries for 2 tasks"),
    (lambda m: m.pop("task_classes"), "the required field 'task_classes' is missing"),
])
def test_a_manifest_off_its_schema_is_refused_naming_the_entry(digits, tmp_path, edit, says):
  """The one schema check of a manifest (`check_manifest`, docs/replay.md's table), on reading
  the file, before anything is computed from it: the file, the entry and its value."""
  train, test = digits
  manifest = _hand_manifest(train)
  edit(manifest)
  path = tmp_path / "m.json"
  path.write_text(json.dumps(manifest))
  with pytest.raises(manifest_lib.ManifestError) as raised:
    manifest_lib.read_manifest(str(path))
  assert str(raised.value).startswith(f"{path}: ") and says in str(raised.value)
  with pytest.raises(manifest_lib.ManifestError, match=re.escape(says)):  # given as a dict
    manifest_lib.replay_stream(manifest, train, test, 64, "m.json")


def test_a_manifest_id_past_64_bits_exits_2_leaving_no_error_log(digits, tmp_path,
                                                                 compilation_cache):
  train, _ = digits
  manifest = _hand_manifest(train)
  manifest["steps"][0][0] = 10**30
  path = tmp_path / "m.json"
  path.write_text(json.dumps(manifest))
  temp = tmp_path / "temp"
  temp.mkdir()
  done = subprocess.run(
      tiny_run.command(tmp_path / "run", f"--config.data.stream_manifest={path}"),
      cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=300,
      env={**tiny_run.env(compilation_cache), "TMPDIR": str(temp)})
  assert done.returncode == 2, done.stderr[-2000:]
  assert tiny_run.last_line(done.stderr).startswith(f"error: {path}: steps[0][0] is 10000")
  assert not list(temp.iterdir()) and not (tmp_path / "run").exists()


def test_manifest_errors_before_any_file(digits, tmp_path):
  train, _ = digits
  manifest = _hand_manifest(train)
  manifest["steps"][0] = list(range(5)) + [10**9]
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match="not in the training split"):
    _run(tmp_path / "run", data__stream_manifest=str(path))
  with pytest.raises(ValueError, match="batch_size"):
    _run(tmp_path / "run", data__stream_manifest=str(path), learner__batch_size=4)
  with pytest.raises(FileNotFoundError, match="stream_manifest"):
    _run(tmp_path / "run", data__stream_manifest=str(tmp_path / "missing.json"))
  assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# The trace's buffer ids follow the device buffer, for both buffer units.


@pytest.mark.parametrize("unit", ["sample", "batch"])
def test_trace_buffer_ids_name_the_buffered_examples(unit):
  spec = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=8)
  config = online_lora.LearnerConfig(rank=2, buffer_unit=unit)
  model = VisionTransformer(spec, 5)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
  frozen, head = online_lora.split_params(params)
  tx = online_lora.make_optimizer(1e-2)
  learner = online_lora.make_learner(model, tx, config)
  state = online_lora.init_train_state(jax.random.key(1), head, spec, config, tx)
  batch_size, k = 6, 3
  buf = online_lora.init_buffer(config, k, batch_size, (8, 8, 3))
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(40, 8, 8, 3)).astype(np.float32)
  labels = rng.integers(0, 5, 40)
  record_ids = np.arange(40) * 7 + 100  # ids differ from rows
  stream = Stream(steps=tuple(np.arange(40)[i:i + 6] for i in range(0, 40, 6)),
                  step_task=np.zeros(7, np.int64), task_classes=(np.arange(5),))
  tr = trace_lib.StepTrace("unused.npz", stream, record_ids, unit, k, batch_size)
  for step, rows in enumerate(stream.steps):
    n = len(rows)
    batch = {"images": np.zeros((batch_size, 8, 8, 3), np.float32),
             "labels": np.zeros(batch_size, np.int32), "mask": np.arange(batch_size) < n}
    batch["images"][:n], batch["labels"][:n] = images[rows], labels[rows]
    state, scalars, scores = learner.train_step(state, frozen, buf, batch)
    buf = learner.update_buffer(buf, batch, scores)
    tr.record_step(step, jax.device_get(scalars), None, scores, True)
    ids = tr.steps[-1]["buffer_ids"]
    rows_of = np.searchsorted(record_ids, np.where(ids >= 0, ids, record_ids[0]))
    if unit == "batch":
      np.testing.assert_array_equal(np.asarray(buf.valid), (ids >= 0).any(axis=1))
      np.testing.assert_array_equal(np.asarray(buf.mask), ids >= 0)
    else:
      np.testing.assert_array_equal(np.asarray(buf.valid), ids >= 0)
    held = (ids >= 0)
    np.testing.assert_array_equal(np.asarray(buf.labels)[held], labels[rows_of][held])
    np.testing.assert_array_equal(np.asarray(buf.images)[held], images[rows_of][held])


# --------------------------------------------------------------------------------------------
# The authors' checkpoint layout.


def _random_lora(spec, rank, seed):
  lora = lora_lib.init_lora(jax.random.key(seed), spec, rank)
  return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(seed + 1), x.shape),
                      lora)


@pytest.fixture(scope="module")
def authors_file(tmp_path_factory):
  """The timm fixture (real timm weights and logits) in the authors' layout, with a non-zero
  current LoRA and frozen pair, and a proj_3d the importer must ignore."""
  sd = load_file(str(FIX / "vit_tiny_timm.safetensors"))
  current, frozen = _random_lora(SPEC, 4, 10), _random_lora(SPEC, 4, 20)
  raw = {}
  for k, v in sd.items():
    raw["lora_vit." + k.replace("attn.qkv.", "attn.qkv.qkv.")] = v
  for i in range(SPEC.depth):
    for ours, t in (("query", "q"), ("value", "v")):
      pre = f"lora_vit.blocks.{i}.attn.qkv."
      for name, tree in (("linear_new_", current), ("linear_", frozen)):
        factors = tree[f"encoderblock_{i}"][ours]
        raw[pre + f"{name}a_{t}.weight"] = np.asarray(factors["lora_a"]).T.copy()  # (r, D)
        raw[pre + f"{name}b_{t}.weight"] = np.asarray(factors["lora_b"]).T.copy()  # (D, r)
  raw["proj_3d.weight"] = np.ones((3, 48), np.float32)
  path = tmp_path_factory.mktemp("authors") / "online_lora.safetensors"
  save_file(raw, str(path))
  return path, sd, current, frozen


def test_the_ignored_proj_3d_is_a_warning_the_user_sees_once(authors_file, caplog, monkeypatch):
  """docs/replay.md: the ignored keys are named where the user sees them (a warning: launch/run.py
  shows WARNING and above), once, though a replay reads the file as pretrained.path and as
  learner.initial_lora."""
  path = str(authors_file[0])
  monkeypatch.setattr(pretrained, "_WARNED", set())
  with caplog.at_level(logging.WARNING):
    pretrained.load_pretrained(path, SPEC, 10, require_head=True)
    pretrained.load_online_lora(path, SPEC, 4)
  warned = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "proj_3d" in r.getMessage()]
  assert warned == [f"{path}: ignored proj_3d.weight: the released code's proj_3d module is not"
                    " part of the classifier"]


def test_authors_layout_imports_with_the_numpy_reference_logits(authors_file, caplog):
  path, sd, current, frozen = authors_file
  assert pretrained.detect_format(str(path)) == "online_lora"
  params = pretrained.load_pretrained(str(path), SPEC, 10, require_head=True)
  lora, frozen_pair = pretrained.load_online_lora(str(path), SPEC, 4)
  x = np.load(FIX / "inputs_nhwc.npy")
  model = VisionTransformer(SPEC, 10)
  ours = np.asarray(model.apply({"params": params}, x,
                                lora=lora_lib.concat_adapters(lora, frozen_pair)))
  # The authors' wrapper adds x A^T B^T for the current LoRA and the frozen pair to q and v:
  # the same as a timm model with W_q += B A + B_old A_old (and v likewise), in float64.
  effective = dict(sd)
  d = SPEC.width
  for i in range(SPEC.depth):
    w = effective[f"blocks.{i}.attn.qkv.weight"].astype(np.float64).copy()
    for j, target in ((0, "query"), (2, "value")):
      for tree in (current, frozen):
        f = tree[f"encoderblock_{i}"][target]
        w[j * d:(j + 1) * d] += (np.asarray(f["lora_a"], np.float64)
                                 @ np.asarray(f["lora_b"], np.float64)).T
    effective[f"blocks.{i}.attn.qkv.weight"] = w
  _, reference = np_vit_timm(effective, x, SPEC.num_heads)
  assert_close(ours, reference, rtol=1e-5)
  # With the LoRA factors left out it is timm's own model, logits and all.
  assert_close(np.asarray(model.apply({"params": params}, x)), np.load(FIX / "logits.npy"),
               rtol=1e-5)


def test_authors_layout_round_trips_bit_for_bit(authors_file, tmp_path):
  path, _, _, _ = authors_file
  params = pretrained.load_pretrained(str(path), SPEC, 10, require_head=True)
  lora, frozen_pair = pretrained.load_online_lora(str(path), SPEC, 4)
  out = tmp_path / "exported.safetensors"
  pretrained.save_online_lora_safetensors(params, lora, str(out), frozen_lora=frozen_pair)
  original, exported = load_file(str(path)), load_file(str(out))
  original.pop("proj_3d.weight")  # not part of the classifier, not written back
  assert set(original) == set(exported)
  for k, v in original.items():
    assert exported[k].dtype == v.dtype and exported[k].shape == v.shape, k
    assert exported[k].tobytes() == v.tobytes(), k
  # And back again: every array of ours, bit for bit.
  params2 = pretrained.load_pretrained(str(out), SPEC, 10, require_head=True)
  lora2, frozen2 = pretrained.load_online_lora(str(out), SPEC, 4)
  for a, b in ((params, params2), (lora, lora2), (frozen_pair, frozen2)):
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def test_authors_layout_errors(authors_file, tmp_path):
  path, _, _, _ = authors_file
  with pytest.raises(pretrained.CheckpointError, match="rank 4 but learner.rank is 2"):
    pretrained.load_online_lora(str(path), SPEC, 2)
  with pytest.raises(pretrained.CheckpointError, match="not the authors' layout"):
    pretrained.load_online_lora(str(FIX / "vit_tiny_timm.safetensors"), SPEC, 4)
  with pytest.raises(pretrained.CheckpointError, match="set pretrained.format=online_lora"):
    pretrained.load_pretrained(str(path), SPEC, 10, fmt="timm")
  with pytest.raises(pretrained.CheckpointError, match="keep_head=True but the checkpoint head"):
    pretrained.load_pretrained(str(path), SPEC, 7, require_head=True)
  raw = load_file(str(path))
  raw.pop("lora_vit.blocks.1.attn.qkv.linear_b_v.weight")
  save_file(raw, str(tmp_path / "partial.safetensors"))
  with pytest.raises(pretrained.CheckpointError, match="incomplete LoRA"):
    pretrained.load_online_lora(str(tmp_path / "partial.safetensors"), SPEC, 4)


def test_a_run_starts_from_exported_weights(tmp_path):
  """Export a model with head, current LoRA and frozen pair; a reference-fidelity run started
  from that file (pretrained.keep_head, learner.initial_lora) computes the same step-0 logits."""
  config = _small_config()
  spec = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=8)
  model = VisionTransformer(spec, 10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
  params["head"]["kernel"] = jax.random.normal(jax.random.key(1), params["head"]["kernel"].shape)
  lora, pair = _random_lora(spec, 4, 30), _random_lora(spec, 4, 40)
  path = tmp_path / "from_authors.safetensors"
  pretrained.save_online_lora_safetensors(params, lora, str(path), frozen_lora=pair)
  x = np.random.default_rng(0).uniform(size=(3, 8, 8, 3)).astype(np.float32)
  want = jax.jit(model.apply)({"params": params}, x, lora=lora_lib.concat_adapters(lora, pair))

  config.fidelity = "reference"
  config.pretrained.path = str(path)
  config.pretrained.keep_head = True
  config.learner.initial_lora = str(path)
  setup = trainer.Setup(config)
  c = setup.config
  got_params = trainer.initial_params(setup, c, jax.random.key(5))
  got_lora, got_pair = pretrained.load_online_lora(c.learner.initial_lora, spec, c.learner.rank)
  backbone, _ = online_lora.split_params(got_params)
  method = setup.method  # Online-LoRA, started from learner.initial_lora
  run_state = method.init(jax.random.key(6), got_params)
  logits = np.asarray(method.predict(run_state, x))
  assert_close(logits, np.asarray(want), rtol=1e-5)  # the exported trees, another program
  # Bit for bit against the same jitted function on the exported trees themselves.
  original_backbone, original_head = online_lora.split_params(params)
  original = run_state["state"].replace(trainable={"lora": lora, "head": original_head})
  np.testing.assert_array_equal(logits, np.asarray(method.predict(
      {**run_state, "state": original,
       "frozen": {**original_backbone, online_lora.FROZEN_LORA: pair}}, x)))
  # The exact merge folds the frozen pair into the backbone: the same function.
  exact = online_lora.LearnerConfig(rank=4)
  frozen_exact = online_lora.init_frozen(backbone, spec, exact, got_pair)
  learner_exact = online_lora.make_learner(setup.model, online_lora.make_optimizer(1e-3), exact)
  state = run_state["state"]
  assert_close(np.asarray(learner_exact.predict(state, frozen_exact, x)), np.asarray(want),
               rtol=1e-5)

  config.pretrained.path = ""
  with pytest.raises(ValueError, match="keep_head=True needs a checkpoint"):
    trainer.Setup(config)
