"""PCR against its authors' code (FelixHuiweiLin/PCR, a fork of RaptorMai/online-continual-
learning): record what their run does on a stream this project writes (docs/parity.md). A 'step'
check: their reservoir decisions and replay draws are given to our run.

Two steps, in two environments:

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/pcr.py prepare --out /tmp/pcr-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/pcr-venv &&
    #    /tmp/pcr-venv/bin/pip install torch==2.13.0 numpy kornia==0.4.1 pillow pandas psutil \
    #    pyyaml scipy matplotlib scikit-image), on a checkout of their code
    #    (git clone https://github.com/FelixHuiweiLin/PCR /tmp/PCR):
    /tmp/pcr-venv/bin/python scripts/parity/pcr.py record --pcr /tmp/PCR --prepared /tmp/pcr-prep \
        --out tests/fixtures/parity/pcr.npz

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [0, 1] (their loader's ToTensor), the reduced ResNet-18 trained from scratch,
and their settings: plain SGD (their parser's optimizer) at `LEARNING_RATE`, batch 10, 10
replayed (--eps_mem_batch), temperature 0.09 (--pcr_temp), `MEM_SIZE` slots, replay from the
first step whose buffer holds anything (their random retrieval reads no warm-up), the batch and
the replayed samples in two forward passes (`pcr.replay_pass='separate'`) and no step while
nothing is replayed (`pcr.train_alone=False`)), cuts the seeded stream to its first
`aml.STEPS_PER_TASK` steps of each task and writes what scripts/parity/aml.py's
`write_prepared` writes, the weights as their PCR model's state_dict (`their_state_dict`).

`record` imports their modules unchanged from the checkout and builds what their general_main.py
builds for `--agent PCR --data cifar10` (Reduced_ResNet18 with its cosine proxy layer, 10
classes, input 3 x 32 x 32; SGD; the agent ProxyContrastiveReplay with the reservoir update and
random retrieval), loads our initial weights strict, and feeds the stream's batches in the
manifest's order, one call of their `train_learner` per batch (their loader shuffles within the
batch of 10). Their augmentation of the batch and of the replayed samples
(`transforms_aug['cifar10']`: random resized crops, flips, colour jitter, grayscale, by PIL
from torch's generator) is replaced by the identity: our port leaves the augmentation out
(olora_jax/methods/pcr.py), so the identity is the setting the two codes share. Each of their
views is then the image itself, twice: every sample is an anchor twice and every proxy counts
twice, so their loss is ours + log 2 exactly (the same gradient), and BatchNorm's batch
statistics over the doubled pass are the single pass's (the running variance's unbiased factor
moves from n/(n-1) to 2n/(2n-1), n the pass's rows times the map's size: at most 3.1e-3
relative at the last stage's 4 x 4 maps, a part of what the task-end logits are allowed).

Wrapping the instance's buffer (no line of their code changes), it records per step the loss
(their contrastive term: `SupConLoss` in their agents.pcr module is a subclass that keeps each
value; a step with an empty memory computes none, and its loss is their 0 * CE, 0), the replay
draw (buffer slots, from their retrieval's indices), each incoming item's reservoir decision (the
slot it ended in, -1 if rejected; an item is told from the others by its pixels, which their
buffer stores exactly) and the buffer's record ids after the step; at each task end every test
sample's logits (their `pcrForward` in eval mode, as their `evaluate` computes them before it
masks the unseen classes). Then `aml.OWN_DRIFT_RUNS` more runs of their code from the weights
perturbed at float32 rounding (`aml.perturbed`): how far their run drifts from itself, the scale
of the tolerances. Seeds fixed, `torch.use_deterministic_algorithms(True)`, one thread.

Shims, outside their code: scripts/parity/scr.py's (`torch.solve` for kornia 0.4.1, which their
SCR agent imports; a torchvision stand-in whose ToTensor turns the HWC float array into the CHW
tensor), and the names their setup_elements builds its augmentations from at import, as
stand-ins that refuse to be called (the identity replaces them before any step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the AML driver: the stream's cut, the ResNet's state_dict mapping)
import scr  # noqa: E402 (the SCR driver: the shims for their codebase's imports)

SEED = 0  # the stream's, our initial weights' and their run's seeds
BATCH = 10  # their --batch
EPS_MEM_BATCH = 10  # their --eps_mem_batch
MEM_SIZE = 100  # their --mem_size (README: 200 for CIFAR-10); 10 per class: full at step 10 of 40
# SGD's learning rate (their parser's --learning_rate default is 0.1). At 0.01 this run is
# already chaotic: their own run from weights perturbed at float32 rounding drifts from itself by
# a median 0.66% (at most 1.9%) over the 40 steps and changes up to 106 of the 250 task-end
# predictions; at 0.001 by a median 2.2e-4, at most 3 predictions (docs/parity.md).
LEARNING_RATE = 0.001
TEMPERATURE = 0.09  # their --pcr_temp (and cosLinear's scale)
NUM_CLASSES = 10
THEIR_DATA = "cifar10"  # their 32 px entry with 10 classes: input (3, 32, 32), ToTensor


def overrides(learning_rate: float = LEARNING_RATE) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  return {
      "method": "pcr", "seed": SEED, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "unit",  # their ToTensor: pixels / 255
      "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      "pcr.optimizer": "sgd", "pcr.learning_rate": learning_rate, "pcr.weight_decay": 0.0,
      "pcr.buffer_size": MEM_SIZE, "pcr.replay_batch": EPS_MEM_BATCH,
      "pcr.temperature": TEMPERATURE, "pcr.warmup_batches": 0, "pcr.replay_pass": "separate",
      "pcr.train_alone": False, "pcr.trainable": "all"}


# ------------------------------------------------------------------------------------------------
# prepare (this project's venv)


def their_state_dict(params: dict, batch_stats: dict) -> dict[str, np.ndarray]:
  """Our reduced ResNet-18 and proxy head under the names and layouts of their Reduced_ResNet18:
  the network as AML's ResNet18 (aml.their_state_dict), the proxies (our head's kernel (D, C))
  as pcrLinear.L.weight (C, D), their linear classifier (which PCR never reads) zero."""
  kernel = np.asarray(params["head"]["kernel"])
  out = aml.their_state_dict({**params, "head": {"kernel": np.zeros_like(kernel),
                                                 "bias": np.zeros(kernel.shape[1], np.float32)}},
                             batch_stats, cosine=False)
  out["pcrLinear.L.weight"] = np.ascontiguousarray(kernel.T)
  return out


def prepare(args) -> None:
  from olora_jax.models import resnet

  def weights_of(setup, state):
    return their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS])

  aml.write_prepared(args.out, overrides(args.lr), aml.STEPS_PER_TASK, weights_of)


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


def _shims() -> None:
  """The module docstring's shims: scr.py's, and the augmentations' names as stand-ins."""
  scr._compatibility_shims()

  class Unshared:
    """An augmentation of their setup_elements: built at import, never called here."""

    def __init__(self, *args, **kwargs):
      pass

    def __call__(self, x):
      raise RuntimeError("their augmentation runs only with a real torchvision")

  transforms = sys.modules["torchvision"].transforms
  for name in ("ToPILImage", "RandomResizedCrop", "RandomHorizontalFlip", "RandomApply",
               "ColorJitter", "RandomGrayscale", "RandomCrop", "Normalize"):
    setattr(transforms, name, Unshared)


def their_params(learning_rate: float) -> argparse.Namespace:
  """What their general_main.py's parser gives PCR's agent and buffer at these settings."""
  return argparse.Namespace(
      agent="PCR", data=THEIR_DATA, seed=SEED, cuda=False, epoch=1, batch=BATCH, verbose=False,
      mem_size=MEM_SIZE, eps_mem_batch=EPS_MEM_BATCH, mem_iters=1, update="random",
      retrieve="random", buffer_tracker=False, error_analysis=False, pcr_temp=TEMPERATURE,
      pcr_type="proxy", learning_rate=learning_rate, weight_decay=0.0, optimizer="SGD",
      trick={"labels_trick": False, "separated_softmax": False, "kd_trick": False,
             "kd_trick_star": False, "review_trick": False, "ncm_trick": False})


def run_theirs(manifest: dict, data: dict, weights: dict, learning_rate: float):
  """Their run (module docstring) from `weights`: (per-step log, task-end test logits (tasks, N,
  C) float32)."""
  import contextlib
  import importlib
  import io

  import torch

  # Their package, from the checkout; utils.name_match first, as their experiment/run.py does
  # (agents.pcr first is a circular import).
  importlib.import_module("utils.name_match")
  import agents.pcr as their_pcr
  import utils.setup_elements as elements
  from utils.loss import SupConLoss

  aml.deterministic_torch(torch, SEED)
  elements.transforms_aug[THEIR_DATA] = lambda x: x  # the identity (module docstring)
  params = their_params(learning_rate)
  model = elements.setup_architecture(params)
  model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()},
                        strict=True)
  opt = elements.setup_opt(params.optimizer, model, params.learning_rate, params.weight_decay)
  with contextlib.redirect_stdout(io.StringIO()):  # their Buffer prints its size
    agent = their_pcr.ProxyContrastiveReplay(model, opt, params)
  buffer = agent.buffer

  step_log: dict = {}

  class Recorded(SupConLoss):
    def forward(self, *args, **kwargs):
      loss = super().forward(*args, **kwargs)
      step_log["loss"] = loss.item()
      return loss

  their_pcr.SupConLoss = Recorded  # the name their train_learner builds its loss from

  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  slot_ids = np.full(MEM_SIZE, -1, np.int64)
  orig_retrieve, orig_update = buffer.retrieve, buffer.update
  step_ids: list = []

  def retrieve(**kwargs):
    out = orig_retrieve(**kwargs)
    step_log["replay_slots"] = out[5].tolist()
    step_log["replay_ids"] = [int(slot_ids[s]) for s in out[5].tolist()]
    return out

  def update(x, y, logits, features, **kwargs):
    start = buffer.current_index
    written = orig_update(x, y, logits, features, **kwargs)
    slots = sorted(set(range(start, buffer.current_index)) | set(written or []))
    items = torch.from_numpy(np.ascontiguousarray(
        data["train_x"][[row[i] for i in step_ids]].transpose(0, 3, 1, 2)))
    stored = [-1] * len(step_ids)
    for s in slots:
      match = [j for j in range(len(step_ids)) if torch.equal(buffer.buffer_img[s], items[j])]
      assert len(match) == 1, (s, match)  # every item's pixels tell it apart
      stored[match[0]] = s
      slot_ids[s] = step_ids[match[0]]
    step_log["stored_slot"] = stored
    step_log["buffer_ids"] = slot_ids.tolist()
    return written

  buffer.retrieve, buffer.update = retrieve, update

  steps, step_task, log, task_logits = manifest["steps"], manifest["step_task"], [], []
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  for t, ids in enumerate(steps):
    step_ids[:] = ids
    rows = [row[i] for i in ids]
    step_log = {"loss": 0.0, "replay_slots": [], "replay_ids": []}  # 0 * CE: no memory yet
    agent.train_learner(data["train_x"][rows], data["train_y"][rows].astype(np.int64))
    log.append(step_log)
    if t + 1 == len(steps) or step_task[t + 1] != step_task[t]:  # a task end
      model.eval()
      with torch.no_grad():
        task_logits.append(torch.cat([model.pcrForward(test_x[i:i + 128])[0]
                                      for i in range(0, len(test_x), 128)]).numpy())
      model.train()
  return log, np.stack(task_logits).astype(np.float32)


def _commit(path: str) -> str:
  return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=True).stdout.strip()


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def record(args) -> None:
  """Runs their code on the prepared stream from the prepared weights, and aml.OWN_DRIFT_RUNS
  times from them perturbed at float32 rounding, and writes the recording."""
  import torch

  _shims()
  sys.path.insert(0, os.path.abspath(args.pcr))
  with open(os.path.join(args.prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.prepared, "overrides.json")) as f:
    settings = json.load(f)
  data = dict(np.load(os.path.join(args.prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(args.prepared, "weights.npz")))
  lr = settings["pcr.learning_rate"]
  log, logits = run_theirs(manifest, data, weights, lr)
  own = [run_theirs(manifest, data, aml.perturbed(weights, seed), lr)
         for seed in range(1, aml.OWN_DRIFT_RUNS + 1)]
  draws = {"format": "olora-jax replay draws v1",
           "source": "FelixHuiweiLin/PCR (scripts/parity/pcr.py record)",
           "stored_slot": [s["stored_slot"] for s in log],
           "replayed_slots": [s["replay_slots"] for s in log]}
  replay = np.full((len(log), EPS_MEM_BATCH), -1, np.int64)
  for t, s in enumerate(log):
    replay[t, :len(s["replay_ids"])] = s["replay_ids"]
  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), draws=json.dumps(draws),
      overrides=json.dumps(settings), loss=np.array([s["loss"] for s in log], np.float32),
      buffer_ids=np.array([s["buffer_ids"] for s in log], np.int16),
      replay_ids=replay.astype(np.int16), task_end_logits=logits,
      own_loss=np.array([[s["loss"] for s in own_log] for own_log, _ in own], np.float32),
      own_task_end_logits=np.stack([z for _, z in own]),
      own_decisions_same=np.bool_(all(
          a["buffer_ids"] == b["buffer_ids"] and a["replay_ids"] == b["replay_ids"]
          for own_log, _ in own for a, b in zip(log, own_log, strict=True))),
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      perturbation=np.float64(aml.PERTURBATION), their_commit=_commit(args.pcr),
      versions=json.dumps({"torch": torch.__version__, "numpy": np.__version__,
                           "python": sys.version.split()[0], "cpu": cpu_model()}))
  seen = sorted({c for t in manifest["task_classes"] for c in t})
  print(f"recorded pcr: {len(log)} steps, final loss {log[-1]['loss']:.6f}, task-end"
        f" accuracies {[(z[:, seen].argmax(1) == data['test_y']).mean().round(4) for z in logits]}"
        f" -> {args.out}")


def main(argv=None) -> None:
  parser, _, p, _ = aml.driver_parser(__doc__, "pcr", "FelixHuiweiLin/PCR",
                                      "tests/fixtures/parity/pcr.npz")
  p.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD's learning rate (their"
                 " --learning_rate; their default 0.1)")
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})


if __name__ == "__main__":
  main()
