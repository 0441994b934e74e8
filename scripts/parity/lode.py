"""LODE against its authors' code (liangyanshuo/Loss-Decoupling-for-Task-Agnostic-Continual-
Learning, a fork of an early aimagelab/mammoth): record what their LODE on DER++ does on a stream
this project writes (docs/parity.md). A 'step' check: their reservoir decisions and both replay
draws of every step are given to our run.

Two steps, in two environments, as scripts/parity/mammoth.py:

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/lode.py prepare --out /tmp/lode-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/lode-venv &&
    #    /tmp/lode-venv/bin/pip install torch==2.13.0 numpy), on a checkout of their code
    #    (git clone https://github.com/liangyanshuo/Loss-Decoupling-for-Task-Agnostic-\
    #    Continual-Learning /tmp/lode, the URL on one line):
    /tmp/lode-venv/bin/python scripts/parity/lode.py record --lode /tmp/lode \
        --prepared /tmp/lode-prep --out tests/fixtures/parity/lode.npz

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [0, 1], the reduced ResNet-18 trained from scratch, and their settings: batch
10, two replay draws of 10 a step, a 200-slot buffer, DER++'s alpha 0.2 and beta 0.5 and LODE's
C 1.0 and rho 0.1 (their utils/best_args.py, lode_derpp at buffer 500, the CIFAR-100 entry; the
Online-LoRA paper's values), plain SGD (their ContinualModel's optimiser) at `LEARNING_RATE`, the
batch and the two draws in three forward passes, and their classes-as-new rule
(`lode.new_classes='unseen'`)), cuts the seeded stream to its first `aml.STEPS_PER_TASK` steps of
each task and writes the files aml.py's `write_prepared` writes, the weights as their
`resnet18(10, nf=20)`'s state_dict.

`record` imports their modules unchanged from the checkout and drives what their training loop
(utils/training.py) drives for `--model lode_derpp`, without their dataset machinery: their
ResNet-18 at 20 filters (backbone/ResNet18.py, the reduced ResNet-18), their `LODEDerpp`
(models/lode_derpp.py) with its `Buffer` (utils/buffer.py) and its SGD, cross-entropy as the loss
(their datasets' `get_loss`), no transform (their buffer then applies the identity), `observe`
on each batch in the manifest's order (the inputs passed as both `inputs` and
`not_aug_inputs`), `end_task` at each task end (their task counter: old classes are the earlier
tasks', new ones the rest), then the backbone's logits on every test sample in eval mode. Their
`get_dataset`, called by LODEDerpp for the class and task counts, is given mammoth.py's stand-in
dataset (5 tasks of 2 classes). Wrapping the buffer's reservoir and their buffer module's NumPy
generator (no line of their code changes), it records per step the loss, each incoming item's
reservoir decision (the slot it ended in, -1 if rejected), both replay draws in their order (the
label term's, then the logit term's; buffer slots and record ids) and the buffer's record ids
after the step. Seeds fixed, `torch.use_deterministic_algorithms(True)`, one thread. As aml.py,
three more runs start from the weights perturbed at float32 rounding: their own drift.

Our DER++ draws the logit term's sample first, theirs the label term's: the draws file gives
each draw to the term that used it. The forward passes keep each code's order (theirs: batch,
label draw, logit draw; ours: batch, logit draw, label draw), which moves BatchNorm's running
statistics in another order: a difference in what the task-end logits are allowed, not in any
training loss.

Import-time stand-ins, outside their code: mammoth.py's (torchvision, their `datasets` registry),
ipdb, which their model and buffer import and never call, and their `models` package without
its registry (its __init__ imports every model file from the working directory; LODEDerpp is
imported from its own file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the shared parts of the parity drivers)
import mammoth  # noqa: E402 (the Mammoth driver: its stand-ins and dataset object)
import pcr  # noqa: E402 (the PCR driver: the commit and CPU it records)

METHOD = "lode"
SEED = 0
NUM_CLASSES = 10
BATCH = 10
MINIBATCH = 10  # each replay draw (--minibatch_size)
BUFFER = 200  # --buffer_size: fills at step 20 of the 40, then 20 steps of replacements
ALPHA, BETA = 0.2, 0.5  # their lode_derpp best arguments (buffer 500) and the paper's
C, RHO = 1.0, 0.1  # their lode_derpp best arguments (buffer 500, CIFAR-100) and the paper's
# Plain SGD at 0.001: mammoth.py's reason (their best arguments' 0.03 is chaotic at this size).
LEARNING_RATE = 0.001
NF = 20  # backbone/ResNet18.py's resnet18(nclasses, nf): the reduced ResNet-18 at 20 filters


def overrides(learning_rate: float = LEARNING_RATE) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  p = f"{METHOD}."
  return {
      "method": METHOD, "seed": SEED, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "unit", "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      p + "optimizer": "sgd", p + "learning_rate": learning_rate, p + "weight_decay": 0.0,
      p + "buffer_size": BUFFER, p + "replay_batch": MINIBATCH, p + "replay_pass": "separate",
      p + "alpha": ALPHA, p + "beta": BETA, p + "c": C, p + "rho": RHO,
      p + "new_classes": "unseen", p + "trainable": "all"}


def prepare(args) -> None:
  from olora_jax.models import resnet

  def weights_of(setup, state):
    return aml.their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS],
                                cosine=False)

  aml.write_prepared(args.out, overrides(args.lr), aml.STEPS_PER_TASK, weights_of)


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


class _StandIns(mammoth._StandIns):
  """mammoth.py's stand-ins, and ipdb."""

  NAMES = (*mammoth._StandIns.NAMES, "ipdb")


_ORIGINAL: dict = {}  # their buffer module's reservoir, before the first run wraps it


def run_theirs(manifest: dict, settings: dict, data: dict, weights: dict):
  """Their LODE run (module docstring) from `weights`: (per-step log, task-end test logits
  (tasks, N, C) float32)."""
  import torch
  import torch.nn.functional as F

  aml.deterministic_torch(torch, SEED)
  import models.lode_derpp as their_lode  # their package, from the checkout
  import utils.buffer as their_buffer
  from backbone.ResNet18 import resnet18

  p = f"{METHOD}."
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  run_args = argparse.Namespace(
      buffer_size=settings[p + "buffer_size"], minibatch_size=settings[p + "replay_batch"],
      alpha=settings[p + "alpha"], beta=settings[p + "beta"], rho=settings[p + "rho"],
      C=settings[p + "c"], lr=settings[p + "learning_rate"], batch_size=BATCH)
  net = resnet18(NUM_CLASSES, nf=NF)
  missing, unexpected = net.load_state_dict(
      {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}, strict=False)
  # Their network registers its stem and stages again as `_features` and its head as
  # `classifier`: the same modules, loaded under their first names.
  assert not unexpected and all(k.startswith(("_features.", "classifier.")) for k in missing)
  dataset = mammoth._Dataset()
  their_lode.get_dataset = lambda args: dataset  # the name LODEDerpp reads its counts from
  model = their_lode.LODEDerpp(net, F.cross_entropy, run_args, None)
  slot_ids = np.full(run_args.buffer_size, -1, np.int64)
  step_log: dict = {}

  class Random:
    """Their buffer module's np.random: each choice (a replay draw's slots) recorded."""

    def __getattr__(self, name):
      return getattr(np.random, name)

    def choice(self, *a, **kw):
      slots = np.random.choice(*a, **kw)
      step_log["draws"].append({"slots": slots.tolist(),
                                "ids": slot_ids[slots].tolist()})
      return slots

  class NumPy:
    """Their buffer module's `np`: NumPy, with `Random` as its generator module."""

    random = Random()

    def __getattr__(self, name):
      return getattr(np, name)

  their_buffer.np = NumPy()
  orig_reservoir = _ORIGINAL.setdefault("reservoir", their_buffer.reservoir)  # not a wrapper

  def reservoir(num_seen, size):  # each incoming item's reservoir decision, recorded
    index = orig_reservoir(num_seen, size)
    step_log["stored_slot"].append(int(index))
    if index >= 0:
      slot_ids[index] = step_log["ids"][len(step_log["stored_slot"]) - 1]
    return index

  their_buffer.reservoir = reservoir
  steps, step_task, log, task_logits = manifest["steps"], manifest["step_task"], [], []
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  model.net.train()
  for t, ids in enumerate(steps):
    rows = [row[i] for i in ids]
    x = torch.from_numpy(np.ascontiguousarray(data["train_x"][rows].transpose(0, 3, 1, 2)))
    y = torch.from_numpy(data["train_y"][rows].astype(np.int64))
    step_log = {"ids": list(ids), "stored_slot": [], "draws": []}
    step_log["loss"] = model.observe(x, y, x)
    if not step_log["draws"]:  # an empty buffer: their observe skips both draws
      step_log["draws"] = [{"slots": [], "ids": []}, {"slots": [], "ids": []}]
    step_log["task"] = model.task
    step_log["buffer_ids"] = slot_ids.tolist()
    del step_log["ids"]
    log.append(step_log)
    if t + 1 == len(steps) or step_task[t + 1] != step_task[t]:  # a task end
      model.end_task(dataset)
      model.net.eval()
      with torch.no_grad():
        task_logits.append(torch.cat([model(test_x[i:i + 128])
                                      for i in range(0, len(test_x), 128)]).numpy())
      model.net.train()
  return log, np.stack(task_logits).astype(np.float32)


def record(args) -> None:
  """Runs their LODE on the prepared stream from the prepared weights, and aml.OWN_DRIFT_RUNS
  times from them perturbed at float32 rounding, and writes the recording."""
  prepared, out = os.path.abspath(args.prepared), os.path.abspath(args.out)
  sys.meta_path.insert(0, _StandIns())
  checkout = os.path.abspath(args.lode)
  sys.path.insert(0, checkout)
  # Their `models` package without its registry (its __init__ imports every model file, from
  # the working directory): the package's folder, and the one name their utils/args.py imports.
  registry = types.ModuleType("models")
  registry.__path__ = [os.path.join(checkout, "models")]
  registry.get_all_models = lambda: []
  sys.modules["models"] = registry
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
  # Their draws in their order (the label term's, then the logit term's), each given to the
  # term of ours that uses it (ours: `replayed_slots` for the logit term).
  draws = {"format": "olora-jax replay draws v1",
           "source": "liangyanshuo/Loss-Decoupling-for-Task-Agnostic-Continual-Learning"
                     " lode_derpp (scripts/parity/lode.py record)",
           "stored_slot": [s["stored_slot"] for s in log],
           "replayed_slots": [s["draws"][1]["slots"] for s in log],
           "second_replayed_slots": [s["draws"][0]["slots"] for s in log]}
  replay_ids = np.full((len(log), 2, MINIBATCH), -1, np.int64)
  for t, s in enumerate(log):
    for j, drawn in enumerate(s["draws"]):
      replay_ids[t, j, :len(drawn["ids"])] = drawn["ids"]

  def same_decisions(a, b):
    return a["stored_slot"] == b["stored_slot"] and a["draws"] == b["draws"]

  np.savez_compressed(
      out, manifest=json.dumps(manifest), draws=json.dumps(draws), overrides=json.dumps(settings),
      loss=np.array([s["loss"] for s in log], np.float32),
      their_task=np.array([s["task"] for s in log], np.int8),
      buffer_ids=np.array([s["buffer_ids"] for s in log], np.int16),
      replay_ids=replay_ids.astype(np.int16), task_end_logits=logits,
      own_loss=np.array([[s["loss"] for s in own_log] for own_log, _ in own], np.float32),
      own_task_end_logits=np.stack([z for _, z in own]),
      own_decisions_same=np.bool_(all(same_decisions(a, b) for own_log, _ in own
                                      for a, b in zip(log, own_log, strict=True))),
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      perturbation=np.float64(aml.PERTURBATION), their_commit=pcr._commit(args.lode),
      versions=json.dumps({"torch": torch.__version__, "numpy": np.__version__,
                           "python": sys.version.split()[0], "cpu": pcr.cpu_model()}))
  print(f"recorded {METHOD}: {len(log)} steps, final loss {log[-1]['loss']:.6f}, task-end"
        f" accuracies {[(z.argmax(1) == data['test_y']).mean().round(4) for z in logits]}"
        f" -> {out}")


def main(argv=None) -> None:
  parser, _, p, _ = aml.driver_parser(
      __doc__, "lode", "liangyanshuo/Loss-Decoupling-for-Task-Agnostic-Continual-Learning",
      "tests/fixtures/parity/lode.npz")
  p.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD's learning rate (--lr)")
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})


if __name__ == "__main__":
  main()
