"""EMA (on DER++ and on RAR) against its authors' code (AlbinSou/online_ema, the codebase the
Online-LoRA paper's appendix names for its EMA rows): record what their temporal ensemble does on
a stream this project writes (docs/parity.md).

Two steps, in two environments, as scripts/parity/aml.py:

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/online_ema.py prepare --method ema_der_pp --out /tmp/ema-prep
    # 2. in a side venv with PyTorch and what their Avalanche imports (the commands in
    #    docs/parity.md, "Regenerate the recording"), on a checkout of their code (git clone
    #    https://github.com/AlbinSou/online_ema /tmp/online_ema; it carries the Avalanche 0.3.1 it
    #    runs on, in avalanchev3/):
    /tmp/ema-venv/bin/python scripts/parity/online_ema.py record --online_ema /tmp/online_ema \
        --prepared /tmp/ema-prep --out tests/fixtures/parity/online_ema_der_pp.npz

What their code is, and what of it can be shared (docs/parity.md): their main_noboundaries.py
trains Avalanche's `OnlineNaive` strategy on mini-batches of each task (`OnlineCLScenario`, task
boundaries on) with plugins: the EMA is `MeanEvaluation` (src/plugins/mean_evaluation.py, every
tensor of the state_dict, BatchNorm's running statistics included, moved after every training
iteration) with a `LambdaScheduler` (src/plugins/lambda_scheduler.py) that holds the momentum at
0.9 for a warm-up (`step_rampup`, toolkit/utils.py) and then at --lmb2 (0.99 in every config);
DER++ is `DERPlugin` (src/plugins/der.py, alpha 0.1 and beta 0.5 fixed in
src/online_factories.py) and RAR is their `er` strategy (`ConcatReplayPlugin`) with
--use_transforms and --nepochs 3 passes over each mini-batch. Their DER++ buffer is not a stream
reservoir: at a task's first mini-batch it takes that whole task's data (a class-balanced draw,
future batches of the task included) with the logits the model gives them then, randomly
cropped and flipped when replayed; no step of ours can match that, so the `ema_der_pp` recording
covers the moving average, with the replay off on both sides (their strategy without the DER
plugin; our run's buffer given no stores), and DER++'s replay is Mammoth's check
(scripts/parity/mammoth.py). Their RAR is another replay than ours too (Avalanche's
class-balanced reservoir, a replay batch as large as the batch concatenated to it, torchvision's
zero-padded crop), so the `ema_rar` recording (`--method ema_rar`) covers the moving average over
RAR's repeated passes: their `er` strategy without its `ConcatReplayPlugin` and with
--use_transforms off, making `PASSES` (3) training iterations of each mini-batch, the average
moved after each; ours with `repeats` 3, `augment` off and the buffer given no stores.

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [0, 1], the reduced ResNet-18 (their toolkit/resnet18.py at nf 20: every
tensor maps one to one) trained from scratch, plain SGD (their --optimizer SGD, no momentum, no
weight decay) at `LEARNING_RATE`, batch 10, the EMA's momentum 0.9 for the first `WARMUP` steps
then 0.99; `ema_rar`: 3 rehearsals a batch, augmentation off) and writes what aml.py's
`write_prepared` writes (manifest, inputs, our initial
weights in their layout, overrides) and `draws.json`: no item stored, no replay.

`record` imports their modules unchanged from the checkout (with the Avalanche it carries) and
drives what main_noboundaries.py drives, without their dataset machinery: each task of the
manifest as an Avalanche tensor dataset in the manifest's order, split by `OnlineCLScenario` into
mini-batches of 10 (no shuffle: the manifest's steps), `OnlineNaive` with one pass (`ema_rar`:
`train_passes` 3, each mini-batch trained three times in a row, as their --nepochs), SGD, their
`GradClippingPlugin(10000)`, `MeanEvaluation(0.99, replace=False, update_at='iteration')` and
`LambdaScheduler(..., 'momentum', num_warmup_iterations=WARMUP - 1.0, schedule_by='iteration',
start_value=0.9, scheduling_function=step_rampup, end_value=0.99)` as their `add_plugins` builds
them (their float warm-up keeps 0.9 while the iteration count is <= it: `WARMUP - 1.0` gives
WARMUP iterations at 0.9, ours `ema_warmup_steps`; with 3 passes theirs counts iterations, ours
batches: 3 x WARMUP - 1.0). Their model's head is their resnet18's plain
10-class linear layer: their `adapt_model` would put Avalanche's growing `IncrementalClassifier`
in its place, which masks the classes not yet seen (ours has one fixed head over every class).
A plugin of the driver records per iteration (per step, or per pass of a step) the loss and the
momentum the EMA moved with; at each
task end it records every test sample's logits from their EMA model (`running_model` in eval
mode, as their main evaluates it) and from the training model. Seeds fixed,
`torch.use_deterministic_algorithms(True)`, one thread; three more runs from the weights
perturbed at float32 rounding give their own drift (aml.py). torchvision, wandb and ray are
import-time stand-ins (`_StandIns`: PyPI's torchvision cannot load beside the CPU build of torch);
this run calls none of them. `torch.utils.data.dataset.T_co`, which their Avalanche imports and
PyTorch 2.13 dropped, is supplied before the import.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the shared parts of the parity drivers)
import mammoth  # noqa: E402 (their state_dict layout, the import-time stand-ins)

SEED = 0
STEPS_PER_TASK = 8  # the first 8 batches of 10 of each of the 5 tasks: 40 steps
NUM_CLASSES = 10
BATCH = 10
BUFFER = 200  # our buffer's slots (no item is stored: the draws file rejects every one)
# Plain SGD (their --optimizer SGD, momentum 0, weight decay 0 in every config). Their configs'
# rate, 0.1, makes this from-scratch run chaotic at the float level (as at AML's and Mammoth's):
# at 0.01 their own run from weights perturbed at float32 rounding drifts from itself by a median
# 2.4% over the 40 steps, at 0.001 by 6.3e-4, while the trained model's task-end logits still
# differ from the average's by 0.5 to 2.8 (docs/parity.md).
LEARNING_RATE = 0.001
WARMUP = 20  # steps at momentum 0.9, then 0.99: the switch inside the 40 steps
WARMUP_DECAY, EMA_DECAY = 0.9, 0.99  # their add_plugins' start_value, and --lmb2 in every config
CLIPPING = 10000  # their --clipping in every config (GradClippingPlugin)
METHODS = ("ema_der_pp", "ema_rar")
PASSES = 3  # RAR's rehearsals of each batch: their RAR config's --nepochs 3, ours `repeats`


def overrides(method: str = "ema_der_pp", learning_rate: float = LEARNING_RATE) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  p = f"{method}."
  out = {
      "method": method, "seed": SEED, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "unit", "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      p + "optimizer": "sgd", p + "learning_rate": learning_rate, p + "weight_decay": 0.0,
      p + "buffer_size": BUFFER, p + "trainable": "all",
      p + "ema_decay": EMA_DECAY, p + "ema_warmup_decay": WARMUP_DECAY,
      p + "ema_warmup_steps": WARMUP}
  if method == "ema_der_pp":
    # Each replay draw in a pass of its own: an empty draw then moves no BatchNorm statistic
    # (er.replay_forward), so the step is their replay-free step; draws of 1 keep those passes
    # cheap. alpha and beta: their src/online_factories.py's (their terms stay empty here).
    out.update({p + "replay_pass": "separate", p + "replay_batch": 1, p + "alpha": 0.1,
                p + "beta": 0.5})
  if method == "ema_rar":
    # Their passes over each mini-batch (OnlineNaive's train_passes, --nepochs) and ours
    # (`repeats`); augmentation off on both sides (their --use_transforms off). An empty draw
    # leaves its rows out of the joint pass's BatchNorm statistics (rar.py), so the rehearsal is
    # their replay-free pass.
    out.update({p + "repeats": PASSES, p + "augment": False})
  return out


def passes(settings: dict) -> int:
  """Training iterations a mini-batch makes in the recording's run: RAR's rehearsals, else 1."""
  return settings.get(f"{settings['method']}.repeats", 1)


def no_replay_draws(manifest: dict, draws_per_step: int = 2) -> dict:
  """A draws file (olora_jax/methods/replay.py) in which no item is stored and nothing replayed,
  for a method drawing `draws_per_step` times a step (DER++ 2, RAR 1)."""
  steps = manifest["steps"]
  out = {"format": "olora-jax replay draws v1",
         "source": "AlbinSou/online_ema (scripts/parity/online_ema.py): no replay",
         "stored_slot": [[-1] * len(s) for s in steps], "replayed_slots": [[] for _ in steps]}
  if draws_per_step == 2:
    out["second_replayed_slots"] = [[] for _ in steps]
  return out


def prepare(args) -> None:
  from olora_jax.models import resnet

  def weights_of(setup, state):
    return mammoth.their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS])

  aml.write_prepared(args.out, overrides(args.method, args.lr), STEPS_PER_TASK, weights_of)
  with open(os.path.join(args.out, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.out, "draws.json"), "w") as f:
    json.dump(no_replay_draws(manifest, 2 if args.method == "ema_der_pp" else 1), f)


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


class _StandIns(mammoth._StandIns):
  """mammoth.py's import-time stand-ins, for the packages their Avalanche imports at load time
  but this run never calls: torchvision (its datasets and transforms), wandb (a logger) and ray
  (their parallel evaluation)."""

  NAMES = ("torchvision", "wandb", "ray")


def record(args) -> None:
  """Runs their EMA on the prepared stream from the prepared weights, and aml.OWN_DRIFT_RUNS
  times from them perturbed at float32 rounding, and writes the recording."""
  prepared, out = os.path.abspath(args.prepared), os.path.abspath(args.out)
  checkout = os.path.abspath(args.online_ema)
  sys.meta_path.insert(0, _StandIns())
  sys.path[:0] = [checkout, os.path.join(checkout, "avalanchev3")]
  import platform
  import subprocess
  import typing

  import torch
  import torch.utils.data.dataset as torch_dataset

  if not hasattr(torch_dataset, "T_co"):  # their Avalanche imports it; torch 2.13 dropped it
    torch_dataset.T_co = typing.TypeVar("T_co", covariant=True)

  with open(os.path.join(prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(prepared, "overrides.json")) as f:
    settings = json.load(f)
  with open(os.path.join(prepared, "draws.json")) as f:
    draws = json.load(f)
  data = dict(np.load(os.path.join(prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(prepared, "weights.npz")))
  log, ema_logits, live_logits = run_theirs(manifest, settings, data, weights)
  own = [run_theirs(manifest, settings, data, aml.perturbed(weights, seed))
         for seed in range(1, aml.OWN_DRIFT_RUNS + 1)]
  commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
              if line.startswith("model name")), platform.processor())
  np.savez_compressed(
      out, manifest=json.dumps(manifest), draws=json.dumps(draws), overrides=json.dumps(settings),
      loss=np.array([s["loss"] for s in log], np.float32),  # one per iteration (pass)
      momentum=np.array([s["momentum"] for s in log], np.float64),
      task_end_logits=ema_logits, live_task_end_logits=live_logits,
      own_loss=np.array([[s["loss"] for s in own_log] for own_log, _, _ in own], np.float32),
      own_task_end_predictions=np.stack([z.argmax(-1) for _, z, _ in own]).astype(np.int8),
      own_logit_drift=np.stack([np.abs(z - ema_logits).max(axis=(1, 2)) for _, z, _ in own]),
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      perturbation=np.float64(aml.PERTURBATION),
      provenance=json.dumps({"repository": "AlbinSou/online_ema", "commit": commit,
                             "torch": torch.__version__, "numpy": np.__version__,
                             "python": sys.version.split()[0], "cpu": cpu}))
  accuracy = lambda logits: [float((z.argmax(1) == data["test_y"]).mean()) for z in logits]  # noqa: E731
  print(f"recorded {settings['method']}: {len(log)} iterations, final loss {log[-1]['loss']:.6f},"
        f" EMA task-end accuracies {accuracy(ema_logits)}, trained model's"
        f" {accuracy(live_logits)} -> {out}")


def run_theirs(manifest: dict, settings: dict, data: dict, weights: dict):
  """Their run (module docstring) from `weights`: (per-step log, task-end test logits of their EMA
  model and of the trained model, each (tasks, N, C) float32)."""
  import torch

  # Their modules and the Avalanche they carry, from the checkout.
  from avalanche.benchmarks.generators import dataset_benchmark
  from avalanche.benchmarks.scenarios.online_scenario import OnlineCLScenario
  from avalanche.benchmarks.utils import make_tensor_classification_dataset
  from avalanche.training import OnlineNaive
  from avalanche.training.plugins import EvaluationPlugin, SupervisedPlugin
  from src.plugins import LambdaScheduler, MeanEvaluation
  from toolkit.gradient_clipping import GradClippingPlugin
  from toolkit.resnet18 import resnet18
  from toolkit.utils import step_rampup

  aml.deterministic_torch(torch, SEED)
  p = f"{settings['method']}."
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  model = resnet18(NUM_CLASSES, input_size=(3, 32, 32))
  model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()},
                        strict=True)
  optimizer = torch.optim.SGD(model.parameters(), lr=settings[p + "learning_rate"], momentum=0.0,
                              weight_decay=settings[p + "weight_decay"])
  n_passes = passes(settings)
  warmup = settings[p + "ema_warmup_steps"] * n_passes  # ours counts batches, theirs iterations
  mean_evaluation = MeanEvaluation(settings[p + "ema_decay"], replace=False,
                                   update_at="iteration")
  scheduler = LambdaScheduler(mean_evaluation, "momentum", num_warmup_iterations=warmup - 1.0,
                              schedule_by="iteration",
                              start_value=settings[p + "ema_warmup_decay"],
                              scheduling_function=step_rampup, end_value=settings[p + "ema_decay"])
  log = []

  class Recorder(SupervisedPlugin):
    """The driver's: each iteration's loss and the momentum their EMA moved with."""

    def after_training_iteration(self, strategy, **kwargs):
      log.append({"loss": strategy.loss.item(), "momentum": float(mean_evaluation.momentum)})

  strategy = OnlineNaive(
      model, optimizer, torch.nn.CrossEntropyLoss(), train_passes=n_passes, train_mb_size=BATCH,
      eval_mb_size=BATCH, device=torch.device("cpu"),
      plugins=[GradClippingPlugin(clipgrad=CLIPPING), mean_evaluation, scheduler, Recorder()],
      evaluator=EvaluationPlugin(loggers=[]), eval_every=-1)

  steps, step_task = manifest["steps"], manifest["step_task"]
  tasks = sorted(set(step_task))

  def tensors(ids):
    rows = [row[i] for i in ids]
    x = torch.from_numpy(np.ascontiguousarray(data["train_x"][rows].transpose(0, 3, 1, 2)))
    return x, torch.from_numpy(data["train_y"][rows].astype(np.int64))

  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  test_y = torch.from_numpy(data["test_y"].astype(np.int64))
  train_sets = []
  for task in tasks:
    ids = [i for t, s in enumerate(steps) if step_task[t] == task for i in s]
    x, y = tensors(ids)
    train_sets.append(make_tensor_classification_dataset(
        x, y, targets=y, task_labels=torch.zeros(len(y), dtype=torch.long)))
  test_set = make_tensor_classification_dataset(
      test_x, test_y, targets=test_y, task_labels=torch.zeros(len(test_y), dtype=torch.long))
  benchmark = dataset_benchmark(train_sets, [test_set] * len(train_sets))

  def logits_of(net):
    net.eval()
    with torch.no_grad():
      return torch.cat([net(test_x[i:i + 128]) for i in range(0, len(test_x), 128)]).numpy()

  ema_logits, live_logits = [], []
  for experience in benchmark.train_stream:  # main_noboundaries.py's loop
    online = OnlineCLScenario(original_streams=benchmark.streams.values(), experiences=experience,
                              experience_size=BATCH, access_task_boundaries=True)
    strategy.train(online.train_stream, eval_streams=[], num_workers=0, drop_last=True)
    ema_logits.append(logits_of(mean_evaluation.running_model))
    live_logits.append(logits_of(strategy.model))
    strategy.model.train()
  assert len(log) == len(steps) * n_passes, (len(log), len(steps), n_passes)
  return (log, np.stack(ema_logits).astype(np.float32),
          np.stack(live_logits).astype(np.float32))


def main(argv=None) -> None:
  parser, _, p, _ = aml.driver_parser(__doc__, "online_ema", "AlbinSou/online_ema",
                                      "tests/fixtures/parity/online_ema_der_pp.npz")
  p.add_argument("--method", choices=METHODS, default="ema_der_pp")
  p.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD's learning rate (--lr)")
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})


if __name__ == "__main__":
  main()
