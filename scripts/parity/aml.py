"""ER and ER-ACE against their authors' code (pclucas14/AML): record what their run does on a
stream this project writes (docs/parity.md).

Two steps, in two environments:

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/aml.py prepare --method er_ace --out /tmp/aml-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/aml-venv &&
    #    /tmp/aml-venv/bin/pip install torch==2.13.0 numpy pandas kornia fvcore), on a checkout of
    #    their code (git clone https://github.com/pclucas14/AML /tmp/AML):
    /tmp/aml-venv/bin/python scripts/parity/aml.py record --aml /tmp/AML --prepared /tmp/aml-prep \
        --out tests/fixtures/parity/aml_er_ace.npz

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [-1, 1], the reduced ResNet-18 trained from scratch, and the authors' settings:
batch 10, 10 replayed, 20 slots per class, plain SGD at `LEARNING_RATE` (0.001, the smallest of
their grid; below), the replayed samples in a forward pass of their own), cuts the seeded stream
to its first `STEPS_PER_TASK` steps of each task and writes: `manifest.json` (our stream
manifest), `inputs.npz` (the model inputs of every training and test record, float32 NHWC,
exactly what our pipeline feeds), `weights.npz` (our run's initial state, the same seed, as their
model's state_dict: every tensor maps one to one) and `overrides.json`.

`record` imports their modules unchanged from the checkout and runs what their main.py runs for
`--method er|er_ace` (their `ResNet18(nf=20, dist_linear=...)`, the method class, SGD, `observe`
on each batch, `predict` in eval mode at each task end) with these settings, the stream's batches
in the manifest's order, the weights loaded strict, and their training transform for
`use_augs=0` (the identity). Their ER runs with `task_free=1` (replay from the first step, from
the whole buffer), the mode their ER-ACE forces. Each batch also carries its record ids as one
more field (`inc_data['id']`): their buffer stores every field of a batch, so its slots name
their records; nothing they compute reads it. Wrapping the instance's methods (no line of their
code changes), it records per step the loss (and its incoming and replay terms), the replay
draw (record ids and buffer slots), each incoming item's reservoir decision (the slot it ended
in, -1 if rejected) and the buffer's ids after the step; at each task end every test sample's
logits. Seeds fixed, `torch.use_deterministic_algorithms(True)`, one thread.

Two compatibility shims, outside their code: their code imports `collections.Iterable`, which
Python 3.10 removed (the driver aliases `collections.abc.Iterable` before importing), and their
Logger (wandb, an output folder) is replaced by an object with their `register_name`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

SEED = 0  # the stream's, our initial weights' and their run's seeds
STEPS_PER_TASK = 8  # the parity stream: the first 8 batches of 10 of each of the 5 tasks
MEM_PER_CLASS = 20  # their --mem_size default; main.py multiplies it by the number of classes
NUM_CLASSES = 10
# SGD's learning rate: the smallest of their grid (sweeps/hparam_search: 0.1, 0.01, 0.001; their
# best-args table picks 0.001 in some settings). At their default 0.1, and at 0.01, this run is
# chaotic: their own run from weights perturbed at float32 rounding differs from itself by O(1)
# within ten steps, so only the first steps would compare (docs/parity.md).
LEARNING_RATE = 0.001
BATCH = 10  # their --batch_size and --buffer_batch_size defaults
NF = 20  # their --nf default; ours is fixed at 20 (olora_jax/models/resnet.py)


def overrides(method: str, learning_rate: float = LEARNING_RATE) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  return {
      "method": method, "seed": SEED, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "signed",  # their CIFAR loader's (x / 255 - 0.5) * 2
      "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      f"{method}.optimizer": "sgd", f"{method}.learning_rate": learning_rate,
      f"{method}.weight_decay": 0.0, f"{method}.buffer_size": MEM_PER_CLASS * NUM_CLASSES,
      f"{method}.replay_batch": BATCH, f"{method}.replay_pass": "separate",
      f"{method}.trainable": "all"}


def command_line(settings: dict) -> list[str]:
  """`settings` as launch/run.py's --config.KEY=VALUE arguments."""
  return [f"--config.{k}={v}" for k, v in settings.items()]


# ------------------------------------------------------------------------------------------------
# prepare (this project's venv)


def their_state_dict(params: dict, batch_stats: dict, cosine: bool) -> dict[str, np.ndarray]:
  """Our reduced ResNet-18's weights and running statistics under the names and layouts of their
  model.py's ResNet18: conv kernels HWIO -> OIHW, BatchNorm scale/bias/mean/var ->
  weight/bias/running_mean/running_var, stage s block b -> layer{s+1}.{b}, the shortcut's conv and
  BN -> shortcut.0 / shortcut.1, the head (D, C) -> linear.weight (C, D) (linear.L.weight for
  their cosine distLinear, which has no bias)."""
  out = {}

  def bn(name, ours, stats):
    out.update({f"{name}.weight": ours["scale"], f"{name}.bias": ours["bias"],
                f"{name}.running_mean": stats["mean"], f"{name}.running_var": stats["var"],
                f"{name}.num_batches_tracked": np.zeros((), np.int64)})

  def conv(name, kernel):
    out[f"{name}.weight"] = np.transpose(kernel, (3, 2, 0, 1))

  conv("conv1", params["stem"]["conv"]["kernel"])
  bn("bn1", params["stem"]["bn"], batch_stats["stem"]["bn"])
  for key, block in params.items():
    if not key.startswith("stage"):
      continue
    stage, b = (int(x) for x in key[len("stage"):].split("_block"))
    name, stats = f"layer{stage + 1}.{b}", batch_stats[key]
    for i in (1, 2):
      conv(f"{name}.conv{i}", block[f"conv{i}"]["kernel"])
      bn(f"{name}.bn{i}", block[f"bn{i}"], stats[f"bn{i}"])
    if "shortcut" in block:
      conv(f"{name}.shortcut.0", block["shortcut"]["conv"]["kernel"])
      bn(f"{name}.shortcut.1", block["shortcut"]["bn"], stats["shortcut"]["bn"])
  if cosine:
    out["linear.L.weight"] = params["head"]["kernel"].T
  else:
    out["linear.weight"], out["linear.bias"] = params["head"]["kernel"].T, params["head"]["bias"]
  return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


def cut_manifest(manifest: dict, steps_per_task: int) -> dict:
  """The manifest's first `steps_per_task` steps of each task (the four required fields, the
  labels, the test set and the source)."""
  keep = [i for i, t in enumerate(manifest["step_task"])
          if i - manifest["step_task"].index(t) < steps_per_task]
  cut = {k: manifest[k] for k in ("format", "task_classes", "test", "source", "num_classes")
         if k in manifest}
  for key in ("steps", "step_task", "step_labels"):
    cut[key] = [manifest[key][i] for i in keep]
  cut["params"] = {**manifest.get("params", {}), "cut": f"first {steps_per_task} steps a task"}
  return cut


def demo_config(settings: dict):
  """configs/demo.py's config with `settings` ({dotted key: value}) set, as the command line's
  --config.KEY=VALUE would."""
  from configs import demo

  config = demo.get_config()
  for key, value in settings.items():
    section, _, leaf = key.rpartition(".")
    setattr(config[section] if section else config, leaf, value)
  return config


def write_inputs(setup, manifest: dict, path: str) -> tuple[np.ndarray, np.ndarray]:
  """Writes `path` (.npz): the model inputs of every record `manifest`'s stream and test set name,
  as our pipeline makes them (to_model_input of the source's uint8 images, float32 NHWC):
  train_ids/train_x/train_y (the stream's records, sorted by id), test_ids/test_x/test_y (the
  manifest's order). Returns (train_ids, test_ids)."""
  from olora_jax.data import manifest as manifest_lib
  from olora_jax.data.preprocess import to_model_input

  def inputs(source, ids):
    row = {int(r): i for i, r in enumerate(manifest_lib.record_ids(source))}
    images, labels = source.get(np.array([row[int(i)] for i in ids], np.int64))
    return to_model_input(images, setup.spec.image_size, setup.config.data.input_scale), labels

  train_ids = np.array(sorted({i for step in manifest["steps"] for i in step}), np.int64)
  train_x, train_y = inputs(setup.train_source, train_ids)
  test_ids = np.asarray(manifest["test"]["ids"], np.int64)
  test_x, test_y = inputs(setup.test_source, test_ids)
  np.savez(path, train_ids=train_ids, train_x=train_x, train_y=train_y, test_ids=test_ids,
           test_x=test_x, test_y=test_y)
  return train_ids, test_ids


def prepare(args) -> None:
  from olora_jax.models import resnet

  def weights_of(setup, state):
    cosine = args.method == "er_ace" and setup.config.er_ace.head == "cosine"
    return their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS], cosine)

  write_prepared(args.out, overrides(args.method, args.lr), STEPS_PER_TASK, weights_of)


def write_prepared(out: str, settings: dict, steps_per_task: int, weights_of) -> None:
  """Writes the prepared files (module docstring) of the run configs/demo.py with `settings`
  makes, its stream cut to `steps_per_task` steps a task; `weights_of(setup, initial state) ->
  {name: array}` is our initial state in their layout. The parity drivers of other codebases
  (scripts/parity/) share it."""
  import jax

  from olora_jax import trainer

  setup = trainer.Setup(demo_config(settings))
  os.makedirs(out, exist_ok=True)
  manifest = cut_manifest(setup.manifest, steps_per_task)
  with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  train_ids, test_ids = write_inputs(setup, manifest, os.path.join(out, "inputs.npz"))
  # Our run's initial state (the same seed, the same programs as launch/run.py's).
  state = jax.device_get(trainer.run_initial_state(setup, np.uint32(settings["seed"]), None))
  weights = weights_of(setup, state)
  np.savez(os.path.join(out, "weights.npz"), **weights)
  with open(os.path.join(out, "overrides.json"), "w") as f:
    json.dump(settings, f)
  print(f"prepared {settings['method']}: {len(manifest['steps'])} steps, {len(train_ids)}"
        f" training and {len(test_ids)} test records, {len(weights)} tensors -> {out}")


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


class _Logger:
  """Their Logger's one method the methods call (register_name); no wandb, no output folder."""

  def register_name(self, name):
    pass


PERTURBATION = 1e-7  # the own-drift runs: each weight times (1 + 1e-7 N(0, 1)), float32 rounding
OWN_DRIFT_RUNS = 3  # how many, each from its own perturbation


def perturbed(weights: dict, seed: int, scale: float = PERTURBATION) -> dict:
  """The learnable float weights times (1 + scale * N(0, 1)) (drawn from `seed`; running
  statistics and counters kept): another start as close to the first as float32 rounding."""
  rng = np.random.default_rng(seed)
  return {k: (v * (1 + scale * rng.standard_normal(v.shape))).astype(np.float32)
          if v.dtype == np.float32 and "running" not in k else v for k, v in weights.items()}


def record(args) -> None:
  """Runs their code on the prepared stream from the prepared weights, and OWN_DRIFT_RUNS times
  from them perturbed at float32 rounding (`perturbed`: how far their run drifts from itself, the
  scale of the tolerances), and writes the recording."""
  import collections
  import collections.abc

  import torch

  collections.Iterable = collections.abc.Iterable  # their `from collections import Iterable`
  sys.path.insert(0, os.path.abspath(args.aml))
  with open(os.path.join(args.prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.prepared, "overrides.json")) as f:
    settings = json.load(f)
  data = dict(np.load(os.path.join(args.prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(args.prepared, "weights.npz")))
  log, logits = run_theirs(manifest, settings, data, weights)
  own = [run_theirs(manifest, settings, data, perturbed(weights, seed))
         for seed in range(1, OWN_DRIFT_RUNS + 1)]
  method = settings["method"]
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  draws = {"format": "olora-jax replay draws v1",
           "source": f"pclucas14/AML {method} (scripts/parity/aml.py record)",
           "stored_slot": [s["stored_slot"] for s in log],
           "replayed_slots": [s["replay_slots"] for s in log]}
  replay = np.full((len(log), BATCH), -1, np.int64)
  for t, s in enumerate(log):
    replay[t, :len(s["replay_ids"])] = s["replay_ids"]
  seen_rule = ace_rule_differences(manifest["steps"], data, row) if method == "er_ace" else 0
  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), draws=json.dumps(draws),
      overrides=json.dumps(settings), loss=np.array([s["loss"] for s in log], np.float32),
      inc_loss=np.array([s["inc_loss"] for s in log], np.float32),
      re_loss=np.array([s["re_loss"] for s in log], np.float32),
      buffer_ids=np.array([s["buffer_ids"] for s in log], np.int16),
      replay_ids=replay.astype(np.int16), task_end_logits=logits,
      own_loss=np.array([[s["loss"] for s in own_log] for own_log, _ in own], np.float32),
      own_task_end_predictions=np.stack([z.argmax(-1) for _, z in own]).astype(np.int8),
      own_logit_drift=np.stack([np.abs(z - logits).max(axis=(1, 2)) for _, z in own]),
      own_decisions_same=np.bool_(all(
          a["buffer_ids"] == b["buffer_ids"] and a["replay_ids"] == b["replay_ids"]
          for own_log, _ in own for a, b in zip(log, own_log, strict=True))),
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      ace_rule_differences=np.int64(seen_rule), perturbation=np.float64(PERTURBATION),
      versions=json.dumps({"torch": torch.__version__, "numpy": np.__version__,
                           "python": sys.version.split()[0]}))
  print(f"recorded {method}: {len(log)} steps, final loss {log[-1]['loss']:.6f}, task-end"
        f" accuracies {[(z.argmax(1) == data['test_y']).mean().round(4) for z in logits]}"
        f" -> {args.out}")


def run_theirs(manifest: dict, settings: dict, data: dict, weights: dict):
  """Their main.py's run (module docstring) from `weights`: (per-step log, task-end test logits
  (tasks, N, C) float32)."""

  import torch
  from methods import METHODS  # their package, from the checkout
  from model import ResNet18

  deterministic_torch(torch, SEED)
  method = settings["method"]
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  weights = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
  cosine = "linear.L.weight" in weights
  # Their main.py's arguments, for what the two method classes read.
  run_args = argparse.Namespace(
      method=method, lr=settings[f"{method}.learning_rate"], batch_size=BATCH,
      buffer_batch_size=BATCH, n_iters=1, task_free=1, use_augs=0, dataset="mnist_5k",
      n_classes=NUM_CLASSES,
      mem_size=MEM_PER_CLASS * NUM_CLASSES,  # main.py: args.mem_size * args.n_classes
      input_size=(3, 32, 32), nf=NF)
  model = ResNet18(NUM_CLASSES, nf=NF, input_size=run_args.input_size, dist_linear=cosine)
  model.load_state_dict(weights, strict=True)
  model.train()
  agent = METHODS[method](model, _Logger(), torch.nn.Identity(), run_args)
  buffer, cap = agent.buffer, run_args.mem_size

  def ids_in_buffer():
    out = np.full(cap, -1, np.int64)
    if hasattr(buffer, "bid"):
      out[:buffer.current_index] = buffer.bid[:buffer.current_index].numpy()
    return out

  step_log: dict = {}
  orig_inc, orig_re, orig_update = agent.process_inc, agent.process_re, agent.update
  orig_sample, orig_add = buffer.sample, buffer.add

  def process_inc(data):
    loss = orig_inc(data)
    step_log["inc_loss"] = loss.item()
    if method == "er_ace":
      step_log["seen_so_far"] = agent.seen_so_far.tolist()
    return loss

  def process_re(data):
    loss = orig_re(data)
    step_log["re_loss"] = loss.item()
    return loss

  def update(loss):
    step_log["loss"] = loss.item()
    return orig_update(loss)

  def sample(**kwargs):
    drawn = orig_sample(**kwargs)
    before = ids_in_buffer()
    slot_of = {int(v): s for s, v in enumerate(before) if v >= 0}
    step_log["replay_ids"] = drawn["id"].tolist()
    step_log["replay_slots"] = [slot_of[int(v)] for v in drawn["id"].tolist()]
    return drawn

  def add(batch):
    out = orig_add(batch)
    after = ids_in_buffer()
    slot_of = {int(v): s for s, v in enumerate(after) if v >= 0}
    step_log["stored_slot"] = [slot_of.get(int(v), -1) for v in batch["id"].tolist()]
    step_log["buffer_ids"] = after.tolist()
    return out

  agent.process_inc, agent.process_re, agent.update = process_inc, process_re, update
  buffer.sample, buffer.add = sample, add

  steps, log = manifest["steps"], []
  step_task = manifest["step_task"]
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  task_logits = []
  for t, ids in enumerate(steps):
    rows = [row[i] for i in ids]
    x = torch.from_numpy(np.ascontiguousarray(data["train_x"][rows].transpose(0, 3, 1, 2)))
    y = torch.from_numpy(data["train_y"][rows].astype(np.int64))
    step_log = {"inc_loss": None, "re_loss": 0.0, "replay_ids": [], "replay_slots": []}
    agent.observe({"x": x, "y": y, "t": step_task[t], "id": torch.tensor(ids)})
    log.append(step_log)
    if t + 1 == len(steps) or step_task[t + 1] != step_task[t]:  # a task end: main.py's eval
      agent.eval()
      with torch.no_grad():
        task_logits.append(torch.cat([agent.predict(test_x[i:i + 128])
                                      for i in range(0, len(test_x), 128)]).numpy())
      agent.train()

  return log, np.stack(task_logits).astype(np.float32)


def ace_rule_differences(steps: list, data, row: dict) -> int:
  """How many steps' incoming softmax their index rule (the batch's classes and every class from
  the largest seen index on) and ours (the batch's classes and the classes never seen) would
  restrict to different classes: 0 means ACE's masks agree at every step of the stream."""
  differ, seen = 0, set()
  for ids in steps:
    present = {int(data["train_y"][row[i]]) for i in ids}
    seen_after = seen | present
    theirs = present | set(range(max(seen_after), NUM_CLASSES))
    ours = present | (set(range(NUM_CLASSES)) - seen_after)
    differ += theirs != ours
    seen = seen_after
  return differ


# ------------------------------------------------------------------------------------------------
# What every parity driver of scripts/parity/ shares: their runs' determinism, and the command line.

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def deterministic_torch(torch, seed: int) -> None:
  """Their run made deterministic: torch's deterministic algorithms, one thread, and Python's,
  NumPy's and torch's generators seeded with `seed` (in that order)."""
  import random

  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  random.seed(seed)
  np.random.seed(seed)
  torch.manual_seed(seed)


def driver_parser(doc: str, checkout: str, repository: str, example: str,
                  prepare_help: str = "stream, inputs, weights"):
  """A driver's command line: (parser, its subparsers, `prepare`'s, `record`'s). `prepare` takes
  --out; `record` takes --CHECKOUT (a checkout of github.com/`repository`), --prepared and --out
  (`example`, a recording's path); a driver adds its own flags to either."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("prepare", help=f"in this project's venv: {prepare_help}")
  p.add_argument("--out", required=True, help="folder for the prepared files")
  r = sub.add_parser("record", help="in a side venv with torch: run their code, record it")
  r.add_argument(f"--{checkout}", required=True, help=f"a checkout of github.com/{repository}")
  r.add_argument("--prepared", required=True, help="the folder `prepare` wrote")
  r.add_argument("--out", required=True, help=f"the recording (.npz), e.g. {example}")
  return parser, sub, p, r


def run_command(args, commands: dict) -> None:
  """Runs `args.command`: `record` in the side venv as it is; any other (`prepare`, ...) in this
  project's venv, with the project importable."""
  if args.command != "record":
    sys.path.insert(0, PROJECT)
  commands[args.command](args)


def main(argv=None) -> None:
  parser, _, p, _ = driver_parser(__doc__, "aml", "pclucas14/AML",
                                  "tests/fixtures/parity/aml_er.npz")
  p.add_argument("--method", choices=("er", "er_ace"), required=True)
  p.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD's learning rate (their"
                 " --lr; their grid: 0.1, 0.01, 0.001)")
  run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})


if __name__ == "__main__":
  main()
