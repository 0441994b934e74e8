"""SimpleCIL, its APER first phase and SLCA against LAMDA-CL/LAMDA-PILOT (the toolbox of
SimpleCIL's authors), from committed recordings.

tests/fixtures/parity/pilot_{simplecil,aper,slca}.npz were recorded by scripts/parity/pilot.py
from their code, unmodified: their `models/simplecil.py`, `models/aper_finetune.py` and
`models/slca.py` learners, driven task by task on a 50-step stream of the demo's MNIST digits (5
tasks of 10 batches of 16; 250 test images) with the demo's tiny pretrained ViT as a timm
VisionTransformer, from our run's initial weights (docs/parity.md). Each recording holds, at
each task end, their classifier's rows (the class prototypes) and every test sample's logits; for
APER also each first-phase step's loss and a fingerprint of the adapted ViT's update
(`pilot.update_fingerprint`); for SLCA each slow-learner step's loss (no prototypes); and three
more runs of their code from the same weights perturbed at float32 rounding
(x (1 + 1e-7 N(0, 1))): how far their run moves from itself.

Here, no PyTorch: our CLI runs the same stream with the recording's overrides, and its task-end
exports (logits and the prototypes' sums and counts) and per-step losses are compared with theirs.
Nothing is random in either run (SimpleCIL trains nothing; APER's first phase and SLCA's slow
learner are SGD over the stream's batches in order, from the same heads), so the check is step for
step, to float rounding. SLCA's classifier alignment draws from the class Gaussians, and those
draws are not shared: its task ends after the first are not compared here.

Tolerances (2-core AMD EPYC; their recording on the same CPU): nothing here is chaotic, so each
comparison is held at `DRIFT_FACTOR` times their own largest drift, measured: the cosine logits
(ours x temperature against their sigma 1 cosine) at most 8.3e-7 from theirs, their own drift
1.0e-6 (SimpleCIL; APER's later-class prototypes the same order); the prototypes (class means of
features of norm up to 3.4) at most 6.0e-7 (absolute), their own 1.2e-6; APER's first-phase
losses at most 9.1e-8 relative, their own 1.6e-7; SLCA's 50 slow-learner losses at most 2.1e-7
relative, their own 2.0e-7; the update's fingerprint (norm and a fixed projection per tensor) at
most 9.5e-7 of the largest, their own 3.8e-6. Predictions: identical
at every task end (SimpleCIL; their smallest top-2 margin, 8.8e-5, is far above the tolerance).

The one difference that is not rounding is a stated reading (docs/methods/simplecil.md): APER's
prototypes of the first task's classes. Their code re-embeds the whole first task with the final
adapted model; online, the stream is not seen again, so ours embeds each sample with the adapted
model as it stood when the sample arrived. Their prototypes' adapted half of those classes
differs from ours (by up to 1.2, measured), and re-embedding the first task with our final adapted
model gives theirs to 1e-6 (measured once, docs/parity.md); everything else is compared as above.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import olora_jax
from configs import demo
from olora_jax import pretrained

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
import aml  # noqa: E402 (its command_line)
import pilot  # noqa: E402 (the driver: update_fingerprint)

DRIFT_FACTOR = 4.0  # of their own largest drift: float rounding, summation order across CPUs
# Our SimpleCIL's logits are cos / temperature (its default), theirs cos x sigma (1).
TEMPERATURE = demo.get_config().simplecil.temperature


def recording(method: str) -> dict:
  with np.load(FIXTURES / f"pilot_{method}.npz") as z:
    out = {k: z[k] for k in z.files}
  for key in ("manifest", "overrides", "theirs"):
    out[key] = json.loads(str(out[key]))
  return out


@pytest.fixture(scope="module")
def our_runs(tmp_path_factory):
  """launch/run.py on each recording's stream with its overrides, the three runs started together
  (each is mostly a single-threaded compile: side by side on 2 cores they take less wall time
  than one after another); {method: (its folder, its exit status, its stderr's end)}."""
  started = {}
  for method in pilot.METHODS:
    rec, tmp_path = recording(method), tmp_path_factory.mktemp(method)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(rec["manifest"]))
    workdir = tmp_path / "run"
    started[method] = workdir, subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "run.py"), "--config", str(ROOT / "configs" /
         "demo.py"), "--workdir", str(workdir), *aml.command_line(rec["overrides"]),
         f"--config.data.stream_manifest={manifest}", "--config.eval.write_plots=False",
         "--config.checkpoint_every=0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, cwd=ROOT)
  runs = {}
  for method, (workdir, process) in started.items():
    _, stderr = process.communicate()
    runs[method] = (workdir, process.returncode, stderr[-2000:])
  return runs


def finished(our_runs: dict, method: str) -> Path:
  workdir, returncode, stderr = our_runs[method]
  assert returncode == 0, stderr
  return workdir


def task_ends(rec: dict, workdir: Path):
  """Per task end: (j, classes seen n, our export, their logits (N, n), their prototypes (n, D))."""
  for j, logits in enumerate(rec["task_end_logits"]):
    n = int((~np.isnan(logits[0])).sum())
    export = np.load(workdir / "export" / f"task_{j}.npz")
    np.testing.assert_array_equal(export["record_ids"], rec["test_ids"])
    assert list(export["seen_classes"]) == list(range(n))
    yield j, n, export, logits[:, :n], rec["prototypes"][j][:n] if "prototypes" in rec else None


def assert_losses_match(ours: np.ndarray, rec: dict) -> None:
  """Our per-step losses against theirs, within DRIFT_FACTOR times their own largest relative
  drift (at least one float32 ulp)."""
  theirs, own = rec["loss"].astype(np.float64), rec["own_loss"].astype(np.float64)
  assert len(ours) == len(theirs)
  own_drift = max((np.abs(own - theirs) / theirs).max(), 2 ** -23)
  drift = np.abs(ours - theirs) / theirs
  assert drift.max() <= DRIFT_FACTOR * own_drift, (drift, own_drift)


def prototypes(export) -> np.ndarray:
  return export["params/sums"] / np.maximum(export["params/counts"], 1.0)[:, None]


def test_simplecil_matches_their_simplecil(our_runs):
  """Prototypes, cosine logits and predictions at each task end within float rounding."""
  rec = recording("simplecil")
  workdir = finished(our_runs, "simplecil")
  assert (rec["sigma"] == 1.0).all()  # their CosineLinear's scale, never trained by SimpleCIL
  for j, n, export, theirs, their_prototypes in task_ends(rec, workdir):
    own_logit = rec["own_logit_drift"][:, j].max()
    own_prototype = rec["own_prototype_drift"][:, j].max()
    assert np.abs(prototypes(export)[:n] - their_prototypes).max() <= DRIFT_FACTOR * own_prototype
    ours = export["logits"][:, :n] * TEMPERATURE
    assert np.abs(ours - theirs).max() <= DRIFT_FACTOR * own_logit, j
    top2 = np.sort(theirs, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * DRIFT_FACTOR * own_logit  # no near-tie
    np.testing.assert_array_equal(ours.argmax(1), theirs.argmax(1))


def test_aper_first_phase_matches_their_aper_finetune(our_runs):
  """APER (first_phase='all'): the first phase's losses and update, the pretrained half of every
  prototype and the adapted half of every class after the first task, within float rounding; the
  first task's adapted half differs, as our online reading states (module docstring)."""
  rec = recording("aper")
  workdir = finished(our_runs, "aper")
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [x for x in lines if x.get("event") == "train"]
  phase = len(rec["loss"])  # their one epoch over the first task's batches
  assert [x["adapting"] for x in train[:phase + 1]] == [1] * phase + [0]
  assert_losses_match(np.array([x["loss"] for x in train[:phase]]), rec)
  # The adapted ViT's update over the phase, against theirs (fingerprints, pilot.py).
  export = np.load(workdir / "export" / "task_0.npz")
  prefix = "params/params/"
  tree: dict = {}
  for key in export.files:
    if key.startswith(prefix) and "/head/" not in key:
      *path, leaf = key[len(prefix):].split("/")
      node = tree
      for part in path:
        node = node.setdefault(part, {})
      node[leaf] = export[key]
  adapted = pretrained._ours_to_timm(tree)
  assert sorted(adapted) == list(rec["adapted_keys"])
  initial = safetensors.numpy.load_file(str(Path(olora_jax.__file__).parent / "assets" /
                                            "vit_tiny_digits.safetensors"))
  ours_update = pilot.update_fingerprint(adapted, initial)
  scale = np.abs(rec["adapted_update"]).max(axis=0)  # per column: the largest norm, projection
  own_update = (np.abs(rec["own_adapted_update"] - rec["adapted_update"]) / scale).max()
  update_drift = (np.abs(ours_update - rec["adapted_update"]) / scale).max()
  assert update_drift <= DRIFT_FACTOR * max(own_update, 1e-7), (update_drift, own_update)
  first = rec["manifest"]["task_classes"][0]
  width = adapted["norm.weight"].shape[0]
  for j, n, export, _, their_prototypes in task_ends(rec, workdir):
    gap = np.abs(prototypes(export)[:n] - their_prototypes)
    tolerance = DRIFT_FACTOR * rec["own_prototype_drift"][:, j].max()
    assert gap[:, :width].max() <= tolerance, j  # the pretrained half: SimpleCIL's prototypes
    assert gap[len(first):, width:].max(initial=0.0) <= tolerance, j  # later classes' adapted
    assert gap[:len(first), width:].max() > 0.1  # the first task's: the stated online reading


def test_slca_slow_learner_matches_their_slca(our_runs):
  """SLCA: the slow learner's loss at every step of the 5 tasks (their new optimiser, new head
  and frozen earlier heads at each task) and the first task end's logits (no alignment yet)
  within float rounding. The later task ends are aligned on features drawn from the class
  Gaussians, which the two runs draw apart (and from statistics read differently: module
  docstring of olora_jax/methods/slca.py), so they are not compared here (docs/parity.md)."""
  rec = recording("slca")
  workdir = finished(our_runs, "slca")
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert len(rec["loss"]) == len(rec["manifest"]["steps"])  # every step of the 5 tasks
  assert_losses_match(np.array([x["loss"] for x in lines if x.get("event") == "train"]), rec)
  j, n, export, logits, _ = next(task_ends(rec, workdir))
  assert np.abs(export["logits"][:, :n] - logits).max() <= DRIFT_FACTOR * rec["own_logit_drift"][
      :, j].max()
  np.testing.assert_array_equal(export["logits"][:, :n].argmax(1), logits.argmax(1))
