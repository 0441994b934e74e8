"""DER++ against its authors' code (aimagelab/mammoth): record what their DER++ does on a stream
this project writes (docs/parity.md).

Two steps, in two environments, as scripts/parity/aml.py:

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/mammoth.py prepare --out /tmp/mammoth-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/mammoth-venv &&
    #    /tmp/mammoth-venv/bin/pip install torch==2.13.0 numpy kornia pyyaml tqdm pillow requests
    #    huggingface_hub safetensors && /tmp/mammoth-venv/bin/pip install --no-deps timm==0.9.8),
    #    on a checkout of their code (git clone https://github.com/aimagelab/mammoth /tmp/mammoth):
    /tmp/mammoth-venv/bin/python scripts/parity/mammoth.py record --mammoth /tmp/mammoth \
        --prepared /tmp/mammoth-prep --out tests/fixtures/parity/mammoth_der_pp.npz

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [0, 1] (torchvision's ToTensor, their seq-mnist's range), the reduced
ResNet-18 trained from scratch, and their settings: batch 10, two replay draws of 10 a step, a
200-slot buffer, alpha 0.2 and beta 1.0 (utils/best_args.py, seq-mnist, buffer 200), plain SGD at
`LEARNING_RATE` (below), the batch and the two draws in three forward passes), cuts the seeded
stream to its first `STEPS_PER_TASK` steps of each task and writes the files aml.py's
`write_prepared` writes: `manifest.json`, `inputs.npz` (float32 NHWC model inputs, exactly what
our pipeline feeds), `weights.npz` (our run's initial state as their `reduced-resnet18`
backbone's state_dict: every tensor maps one to one) and `overrides.json`.

`record` imports their modules unchanged from the checkout and drives what their training loop
(utils/training.py) drives for `--model derpp`, without their dataset machinery: their
`reduced-resnet18` backbone (backbone/ResNetBlock.py, 20 filters), their `Derpp` class
(models/derpp.py) with its `Buffer` (utils/buffer.py) and their default optimiser (SGD, no
momentum, no weight decay), cross-entropy as the loss (their datasets' `get_loss`), no transform
(their buffer then applies the identity: no augmentation), `meta_begin_task` / `meta_observe` /
`meta_end_task` around each task's batches in the manifest's order (the inputs passed as both
`inputs` and `not_aug_inputs`), and at each task end the backbone's logits on every test sample
in eval mode (their `evaluate` before its class masking). A stand-in for their dataset object
carries the class and task counts their `ContinualModel` reads. Wrapping the buffer's and the
loss's callables (no line of their code changes), it records per step the loss and its three
terms (incoming CE, logit MSE, replay CE), each incoming item's reservoir decision (the slot it
ended in, -1 if rejected), both replay draws (buffer slots and record ids), and the buffer's
record ids after the step. Seeds fixed, `torch.use_deterministic_algorithms(True)`, one thread.
As aml.py, three more runs start from the weights perturbed at float32 rounding: their own
drift, the scale of the tolerances.

Two import-time stand-ins, outside their code (`_StandIns`): torchvision (PyPI's wheels cannot
load beside the CPU build of torch) and their `datasets` registry (it imports every dataset
file); their DER++ path imports both and calls neither here. timm, which their backbone package
imports (backbone/vit.py), is installed without its torchvision dependency.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the shared parts of the parity drivers)

METHOD = "der_pp"
SEED = 0
STEPS_PER_TASK = 8  # the first 8 batches of 10 of each of the 5 tasks: 40 steps
NUM_CLASSES, N_TASKS = 10, 5
BATCH = 10  # their --batch_size for seq-mnist (utils/best_args.py)
MINIBATCH = 10  # each replay draw (--minibatch_size; their seq-mnist buffer-500 entry's 10)
BUFFER = 200  # --buffer_size: fills at step 20 of the 40, then 20 steps of replacements
ALPHA, BETA = 0.2, 1.0  # their seq-mnist buffer-200 entry (utils/best_args.py)
# Plain SGD (their default optimiser) at a rate where the run is not chaotic: at 0.01, the
# smallest rate of their best arguments (0.01 to 0.3), their own run from weights perturbed at
# float32 rounding drifts from itself by a median 2.2% over the 40 steps; at 0.001 by 8.6e-4
# (docs/parity.md).
LEARNING_RATE = 0.001


def overrides(learning_rate: float = LEARNING_RATE) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  p = f"{METHOD}."
  return {
      "method": METHOD, "seed": SEED, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "unit", "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      p + "optimizer": "sgd", p + "learning_rate": learning_rate, p + "weight_decay": 0.0,
      p + "buffer_size": BUFFER, p + "replay_batch": MINIBATCH, p + "replay_pass": "separate",
      p + "alpha": ALPHA, p + "beta": BETA, p + "trainable": "all"}


def their_state_dict(params: dict, batch_stats: dict) -> dict[str, np.ndarray]:
  """aml.py's mapping (their ResNet18 and Mammoth's share every name but the head's) with the head
  under Mammoth's name, `classifier`."""
  out = aml.their_state_dict(params, batch_stats, cosine=False)
  return {k.replace("linear.", "classifier.", 1) if k.startswith("linear.") else k: v
          for k, v in out.items()}


def prepare(args) -> None:
  from olora_jax.models import resnet

  def weights_of(setup, state):
    return their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS])

  aml.write_prepared(args.out, overrides(args.lr), STEPS_PER_TASK, weights_of)


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Import-time stand-ins for two packages their DER++ path imports but never calls here:
  torchvision (PyPI's wheels link CUDA libraries the CPU build of torch lacks, so the real one
  cannot load; their code imports it for dataset transforms and augmentation, and this run passes
  no transform) and their `datasets` registry (its __init__ imports every dataset file, with their
  downloaders' dependencies, and chdirs to the checkout; their ContinualModel reads a dataset only
  through the object the driver passes). Every attribute of a stand-in is a MagicMock, so a call
  into one would show in the recording as nonsense, not pass silently as a real computation."""

  NAMES = ("torchvision", "datasets")

  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in self.NAMES:
      return importlib.machinery.ModuleSpec(name, self, is_package=True)
    return None

  def create_module(self, spec):
    from unittest import mock

    module = types.ModuleType(spec.name)
    module.__path__ = []
    module.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")
    return module

  def exec_module(self, module):
    pass


class _Dataset:
  """What their ContinualModel reads of a dataset object: the class and task counts, the
  setting, and the class offsets of a task (tasks of 2 classes in label order)."""

  N_CLASSES, N_TASKS, SETTING = NUM_CLASSES, N_TASKS, "class-il"
  N_CLASSES_PER_TASK = NUM_CLASSES // N_TASKS

  def get_offsets(self, task):
    return task * self.N_CLASSES_PER_TASK, (task + 1) * self.N_CLASSES_PER_TASK


def record(args) -> None:
  """Runs their DER++ on the prepared stream from the prepared weights, and aml.OWN_DRIFT_RUNS
  times from them perturbed at float32 rounding, and writes the recording."""
  prepared, out = os.path.abspath(args.prepared), os.path.abspath(args.out)
  sys.meta_path.insert(0, _StandIns())
  sys.path.insert(0, os.path.abspath(args.mammoth))
  import torch

  with open(os.path.join(prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(prepared, "overrides.json")) as f:
    settings = json.load(f)
  data = dict(np.load(os.path.join(prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(prepared, "weights.npz")))
  log, logits = run_theirs(manifest, settings, data, weights)
  own = [run_theirs(manifest, settings, data, aml.perturbed(weights, seed))
         for seed in range(1, aml.OWN_DRIFT_RUNS + 1)]
  draws = {"format": "olora-jax replay draws v1",
           "source": "aimagelab/mammoth derpp (scripts/parity/mammoth.py record)",
           "stored_slot": [s["stored_slot"] for s in log],
           "replayed_slots": [s["draws"][0]["slots"] for s in log],
           "second_replayed_slots": [s["draws"][1]["slots"] for s in log]}
  replay_ids = np.full((len(log), 2, MINIBATCH), -1, np.int64)
  for t, s in enumerate(log):
    for j, drawn in enumerate(s["draws"]):
      replay_ids[t, j, :len(drawn["ids"])] = drawn["ids"]
  terms = {k: np.array([s[k] for s in log], np.float32)
           for k in ("loss", "ce_current", "logit_mse", "ce_replay")}

  def same_decisions(a, b):
    return a["stored_slot"] == b["stored_slot"] and a["draws"] == b["draws"]

  np.savez_compressed(
      out, manifest=json.dumps(manifest), draws=json.dumps(draws), overrides=json.dumps(settings),
      **terms, buffer_ids=np.array([s["buffer_ids"] for s in log], np.int16),
      replay_ids=replay_ids.astype(np.int16), task_end_logits=logits,
      own_loss=np.array([[s["loss"] for s in own_log] for own_log, _ in own], np.float32),
      own_task_end_predictions=np.stack([z.argmax(-1) for _, z in own]).astype(np.int8),
      own_logit_drift=np.stack([np.abs(z - logits).max(axis=(1, 2)) for _, z in own]),
      own_decisions_same=np.bool_(all(same_decisions(a, b) for own_log, _ in own
                                      for a, b in zip(log, own_log, strict=True))),
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      perturbation=np.float64(aml.PERTURBATION),
      versions=json.dumps({"torch": torch.__version__, "numpy": np.__version__,
                           "python": sys.version.split()[0]}))
  print(f"recorded {METHOD}: {len(log)} steps, final loss {log[-1]['loss']:.6f}, task-end"
        f" accuracies {[(z.argmax(1) == data['test_y']).mean().round(4) for z in logits]}"
        f" -> {out}")


def run_theirs(manifest: dict, settings: dict, data: dict, weights: dict):
  """Their DER++ run (module docstring) from `weights`: (per-step log, task-end test logits
  (tasks, N, C) float32)."""

  import torch
  import torch.nn.functional as F
  from backbone.ResNetBlock import reduced_resnet18  # their package, from the checkout
  from models.derpp import Derpp

  aml.deterministic_torch(torch, SEED)
  p = f"{METHOD}."
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  # Their parser's arguments, for what Derpp and ContinualModel read.
  run_args = argparse.Namespace(
      buffer_size=settings[p + "buffer_size"], minibatch_size=settings[p + "replay_batch"],
      alpha=settings[p + "alpha"], beta=settings[p + "beta"], lr=settings[p + "learning_rate"],
      optimizer="sgd", optim_wd=0.0, optim_mom=0.0, optim_nesterov=False, label_perc=1,
      nowand=1, batch_size=BATCH)
  net = reduced_resnet18(NUM_CLASSES)
  net.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()},
                      strict=True)
  step_log: dict = {}

  def loss(outputs, labels):  # their datasets' get_loss(): cross-entropy; recorded
    value = F.cross_entropy(outputs, labels)
    step_log["ce_current" if "ce_current" not in step_log else "ce_replay"] = value.item()
    return value

  orig_mse = F.mse_loss

  def mse_loss(*a, **kw):  # the logit term's value, recorded (models/derpp.py calls F.mse_loss)
    value = orig_mse(*a, **kw)
    step_log["logit_mse"] = value.item()
    return value

  dataset = _Dataset()
  model = Derpp(net, loss, run_args, None, dataset=dataset)
  buffer, cap = model.buffer, run_args.buffer_size
  slot_ids = np.full(cap, -1, np.int64)
  orig_select, orig_get, orig_add = buffer.sample_selection_fn, buffer.get_data, buffer.add_data

  def select(num_seen, **kw):  # each incoming item's reservoir decision, recorded
    index = orig_select(num_seen, **kw)
    step_log["stored_slot"].append(int(index))
    return index

  def get_data(size, **kw):  # each replay draw's slots, recorded
    choice, *rest = orig_get(size, return_index=True, **kw)
    slots = choice.tolist()
    step_log["draws"].append({"slots": slots, "ids": slot_ids[slots].tolist()})
    return tuple(rest)

  def add_data(**kw):
    before = len(step_log["stored_slot"])
    result = orig_add(**kw)
    for i, slot in enumerate(step_log["stored_slot"][before:]):
      if slot >= 0:
        slot_ids[slot] = step_log["ids"][i]
    return result

  buffer.sample_selection_fn, buffer.get_data, buffer.add_data = select, get_data, add_data
  F.mse_loss = mse_loss
  try:
    steps, step_task, log, task_logits = manifest["steps"], manifest["step_task"], [], []
    test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
    model.net.train()
    for t, ids in enumerate(steps):
      if t == 0 or step_task[t] != step_task[t - 1]:  # a task start: utils/training.py's
        model.meta_begin_task(dataset)
      rows = [row[i] for i in ids]
      x = torch.from_numpy(np.ascontiguousarray(data["train_x"][rows].transpose(0, 3, 1, 2)))
      y = torch.from_numpy(data["train_y"][rows].astype(np.int64))
      step_log = {"ids": list(ids), "stored_slot": [], "draws": [], "ce_replay": 0.0,
                  "logit_mse": 0.0}
      step_log["loss"] = model.meta_observe(x, y, x, epoch=0)
      if not step_log["draws"]:  # an empty buffer: their observe skips both draws
        step_log["draws"] = [{"slots": [], "ids": []}, {"slots": [], "ids": []}]
      step_log["buffer_ids"] = slot_ids.tolist()
      del step_log["ids"]
      log.append(step_log)
      if t + 1 == len(steps) or step_task[t + 1] != step_task[t]:  # a task end
        model.meta_end_task(dataset)
        model.net.eval()
        with torch.no_grad():
          task_logits.append(torch.cat([model(test_x[i:i + 128])
                                        for i in range(0, len(test_x), 128)]).numpy())
        model.net.train()
  finally:
    F.mse_loss = orig_mse
  return log, np.stack(task_logits).astype(np.float32)


def main(argv=None) -> None:
  parser, _, p, _ = aml.driver_parser(__doc__, "mammoth", "aimagelab/mammoth",
                                      "tests/fixtures/parity/mammoth_der_pp.npz")
  p.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD's learning rate (--lr)")
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})

if __name__ == "__main__":
  main()
