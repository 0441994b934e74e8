"""CODA-Prompt and DualPrompt against GT-RIPL/CODA-Prompt (the CODA-Prompt authors' code, which
holds their DualPrompt too), from committed recordings.

tests/fixtures/parity/coda_prompt.npz and coda_prompt_dualprompt.npz were recorded by
scripts/parity/coda_prompt.py from that code, unmodified, on a 40-step stream of the demo's
MNIST digits (5 tasks of 8 batches of 16; 250 test images) from our run's initial state, at
their settings: Adam at 1e-3, a new prompt block (CODA-Prompt: 12 components; DualPrompt: the
task's E-prompt) and a new optimiser at each task, the cross-entropy over the current task's
classes. CODA-Prompt runs on the demo's pretrained 2-block ViT; DualPrompt, whose code puts its
G-prompts on blocks 0-1 and its E-prompts from block 2 on, on a 3-block ViT of the same sizes
from our seed (docs/parity.md). Each recording holds their per-step losses (CE and prompt loss
apart) and the classes each step's CE ran over, every test sample's logits and the head at each
task end, the prompts at the last, and three more runs of their code from the same weights
perturbed at float32 rounding (x (1 + 1e-7 N(0, 1))): their own drift.

Here, no PyTorch: our CLI replays the stream with the recording's overrides and its losses,
task-end logits, predictions, head and prompts are compared with theirs. Nothing random is left
to share: the initial state is ours on both sides, and each new CODA-Prompt block their run took
from our `init_block` on its own pool (DualPrompt draws nothing after its start), so the replay
cannot tell our init from theirs: `test_our_new_block_init_has_the_properties_of_their_gram_schmidt`
checks it in NumPy instead.

Tolerances, from the measured differences (2-core AMD EPYC, XLA at the session's level 0 and at
its default level; their recordings on the same CPU, one thread), CODA-Prompt / DualPrompt:
- CE per step, relative: measured at most 2.6e-6 / 6.6e-7 (their own drift 2.9e-7 / 3.1e-7:
  PyTorch's and XLA's float32 sums in other orders, growing over the 40 Adam steps);
  `CE_RTOL` 2e-5;
- the loss, relative: the same as the CE for CODA-Prompt (no prompt loss), at most 6.9e-6 for
  DualPrompt, whose loss is mostly its key loss 16 x sum(1 - cos), a difference of cosines near
  1; `LOSS_RTOL` 1e-4;
- the task-end logits, relative to the largest: measured at most 4.0e-6 / 7.1e-6; `LOGIT_RTOL`
  5e-5;
- the head and the prompts, relative to each array's largest: measured at most 1.6e-5 / 2.0e-4
  (DualPrompt's G-prompts, whose Adam steps on near-zero gradients are as noisy in their own
  run: their own drift 3.8e-4); within `PARAM_RTOL` 2e-4 or three times their own drift;
- every prediction the same (measured: all 1,250 of each) unless their two best logits are
  within `TIE`.
A real difference moves far more: CODA-Prompt's CE over every class (its default
`train_mask='none'`) gives 3.2 to 4.0 times their losses from the first step and 168 of 250 final
predictions that differ; DualPrompt's gives losses 9% to 27% off and 64 to 105 differing
predictions per task end; its E-prompts started as copies of the previous task's (its default
`init_from_previous=True`) leave the E-prompts 1.6 (relative) and the logits 3e-3 to 1e-2 off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
RECORDINGS = {"coda_prompt": "coda_prompt.npz", "dualprompt": "coda_prompt_dualprompt.npz"}
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
import coda_prompt  # noqa: E402 (the driver: its settings as command-line overrides)

CE_RTOL = 2e-5
LOSS_RTOL = 1e-4
LOGIT_RTOL = 5e-5
PARAM_RTOL = 2e-4
TIE = 1e-4


def recording(method: str) -> dict:
  with np.load(FIXTURES / RECORDINGS[method]) as z:
    out = {k: z[k] for k in z.files}
  for key in ("manifest", "overrides", "run"):
    out[key] = json.loads(str(out[key]))
  return out


@pytest.mark.parametrize("method", RECORDINGS)
def test_their_ce_runs_over_the_classes_seen_since_the_last_boundary(method):
  """Their mask (the classes of the current task, by index) is, at every step of this stream, our
  `train_mask='task'` (the classes seen since the last boundary)."""
  rec = recording(method)
  manifest, seen, task = rec["manifest"], set(), 0
  for t, labels in enumerate(manifest["step_labels"]):
    if manifest["step_task"][t] != task:
      seen, task = set(), manifest["step_task"][t]
    seen |= set(labels)
    assert sorted(seen) == rec["ce_classes"][t].tolist(), t
  np.testing.assert_allclose(rec["ce"] + rec["prompt_loss"], rec["loss"], rtol=1e-6)
  if method == "coda_prompt":
    np.testing.assert_array_equal(rec["prompt_loss"], 0.0)  # ortho_weight 0: no prompt loss


@pytest.mark.parametrize("method", RECORDINGS)
def test_our_cli_run_matches_their_run(method, tmp_path):
  """launch/run.py on their stream with their settings: losses, task-end logits, predictions,
  head and prompts within the module docstring's tolerances."""
  rec = recording(method)
  manifest = tmp_path / "manifest.json"
  manifest.write_text(json.dumps(rec["manifest"]))
  workdir = tmp_path / "run"
  done = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "run.py"), "--config", str(ROOT / "configs" /
       "demo.py"), "--workdir", str(workdir), *coda_prompt.command_line(rec["overrides"]),
       f"--config.data.stream_manifest={manifest}", "--config.eval.write_plots=False",
       "--config.checkpoint_every=0"], capture_output=True, text=True, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-2000:]
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [x for x in lines if x.get("event") == "train"]
  assert len(train) == len(rec["loss"]) == len(rec["manifest"]["steps"])
  np.testing.assert_allclose([x["loss"] for x in train], rec["loss"], rtol=LOSS_RTOL)
  np.testing.assert_allclose([x["ce"] for x in train], rec["ce"], rtol=CE_RTOL)
  # the prompt block each step trained: task t's (the oracle's boundaries)
  trained = [x["block"] if method == "coda_prompt" else x["e_prompt"] for x in train]
  assert trained == rec["manifest"]["step_task"]

  def close(a, b, rtol, what):
    assert np.abs(a - b).max() <= rtol * np.abs(b).max(), (what, np.abs(a - b).max())

  for j, theirs in enumerate(rec["task_end_logits"]):
    export = np.load(workdir / "export" / f"task_{j}.npz")
    np.testing.assert_array_equal(export["record_ids"], rec["test_ids"])
    close(export["logits"], theirs, LOGIT_RTOL, f"logits at task end {j}")
    param_rtol = max(PARAM_RTOL, 3 * rec["own_param_drift"][:, j].max())
    close(export["params/head/kernel"], rec["task_end_head_kernel"][j], param_rtol, f"head {j}")
    close(export["params/head/bias"], rec["task_end_head_bias"][j], param_rtol, f"bias {j}")
    seen = export["seen_classes"]  # their evaluation: the logits of the classes so far
    np.testing.assert_array_equal(seen, np.arange(2 * (j + 1)))
    differ = export["logits"][:, seen].argmax(1) != theirs[:, seen].argmax(1)
    top2 = np.sort(theirs[:, seen], axis=1)[:, -2:]
    assert (top2[differ, 1] - top2[differ, 0] < TIE).all(), (j, int(differ.sum()))
  for name in [k for k in rec if k.startswith("final_")]:
    ours = export[f"params/prompt_pool/{name[len('final_'):]}"]
    close(ours, rec[name], param_rtol, name)


def test_our_new_block_init_has_the_properties_of_their_gram_schmidt():
  """What their run took from our `init_block` at each boundary (module docstring) has the
  properties their Gram-Schmidt gives a new block, checked in NumPy on every layer and entry of a
  pool whose earlier block was trained (not orthonormal): each new component, flattened (their
  `gram_schmidt` views a prompt (Lp, D) as one vector), has norm 1 and is orthogonal to the other
  new ones and to the earlier components; the earlier components and the later, unused blocks
  are left as they were. (Theirs subtracts the projection on each earlier component in turn,
  which is orthogonal to their span where they are orthogonal to each other; ours is orthogonal
  to the span also where training left them not quite so.) Without the orthogonalisation the
  new components are random directions, far from orthogonal (0.72 off, measured)."""
  import jax
  import jax.numpy as jnp

  from olora_jax.methods import coda_prompt as method

  rng = np.random.default_rng(3)
  m, layers, length, width, start, size = 8, 2, 4, 6, 3, 3
  pool = {"keys": np.zeros((m, layers, width), np.float32),
          "attention": np.zeros((m, layers, width), np.float32),
          "prompts": np.zeros((m, layers, length, width), np.float32)}
  for x in pool.values():
    x[:start] = rng.standard_normal(x[:start].shape)  # block 0 as training left it
  out = jax.device_get(method.init_block(jax.tree.map(jnp.asarray, pool), jax.random.key(5),
                                         start, size))
  for name, x in pool.items():
    np.testing.assert_array_equal(out[name][:start], x[:start])
    np.testing.assert_array_equal(out[name][start + size:], x[start + size:])
    for layer in range(layers):
      new = out[name][start:start + size, layer].reshape(size, -1).astype(np.float64)
      earlier = x[:start, layer].reshape(start, -1).astype(np.float64)
      np.testing.assert_allclose(new @ new.T, np.eye(size), atol=1e-5, err_msg=name)
      basis = np.linalg.qr(earlier.T)[0]  # the span of the earlier components
      np.testing.assert_allclose(new @ basis, 0.0, atol=1e-5, err_msg=name)
