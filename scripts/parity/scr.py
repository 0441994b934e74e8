"""SCR against its authors' code (RaptorMai/online-continual-learning): five seeds of their run and
five of ours on a stream this project writes, compared by their task-end accuracies
(docs/parity.md). A 'seeds' check: their augmentation's random draws cannot be given to our run.

The steps, in two environments:

    # 1. in this project's venv: the stream, its inputs, our initial weights of each seed in their
    #    layout, and our five runs' task-end accuracies
    .venv/bin/python scripts/parity/scr.py prepare --out /tmp/scr-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/scr-venv &&
    #    /tmp/scr-venv/bin/pip install torch==2.13.0 numpy kornia==0.4.1 pillow), on a checkout
    #    of their code (git clone https://github.com/RaptorMai/online-continual-learning /tmp/ocl):
    /tmp/scr-venv/bin/python scripts/parity/scr.py record --ocl /tmp/ocl --prepared /tmp/scr-prep \
        --out tests/fixtures/parity/ocl_scr.npz
    # 3. (tests/test_parity_scr.py does this) our runs of some seeds again, live, in one process:
    .venv/bin/python scripts/parity/scr.py live --manifest /tmp/scr-prep/manifest.json \
        --seeds 0 1 --out /tmp/scr-live.npz

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [0, 1] (their loader's ToTensor), the reduced ResNet-18 trained from scratch,
and their SCR settings: plain SGD at 0.1, batch 10, 10 replayed (their parser's --eps_mem_batch),
temperature 0.07, the horizontal flip on, a buffer of `MEM_SIZE`), cuts the seeded stream to its
first `aml.STEPS_PER_TASK` steps of each task and writes `manifest.json`, `inputs.npz` (the model
inputs of every training and test record, float32 NHWC, exactly what our pipeline feeds),
`weights_<seed>.npz` (our run's initial state for each of `SEEDS`, as their SupConResNet's
state_dict) and `overrides.json`; then it runs our CLI (launch/run.py) once per seed on that
stream and writes `ours.npz`: each seed's per-step losses and per-class test accuracies at each
task end (from the exported NCM logits).

`record` imports their modules unchanged from the checkout and, for each seed, builds what their
general_main.py builds for `--agent SCR` (SupConResNet with the MLP head, SGD, the agent
SupContrastReplay with the reservoir update and random retrieval), loads our initial weights of
that seed strict, and feeds the stream's batches in the manifest's order, one call of their
`train_learner` per batch (their per-task loader then shuffles within the batch of 10 only); at
each task end it calls their `evaluate` (the nearest class mean over the buffer) with one test
loader per class, which gives the per-class accuracies. It writes their accuracies beside ours
(from `ours.npz`) and both sides' losses. Seeds: torch, NumPy and random at the seed.

Two compatibility shims, outside their code: kornia 0.4.1 (their pinned version) calls
`torch.solve`, which PyTorch 2 removed (the driver supplies it from `torch.linalg.solve`); their
setup_elements imports torchvision for `transforms.ToTensor` (PyPI's torchvision 0.28 does not
load its operators against PyTorch 2.13's CPU build), so the driver supplies a stand-in whose
ToTensor turns an HWC float array into a CHW tensor, as torchvision's does, and whose
`datasets`/`models` are never called. The driver imports their utils.name_match first, as their
experiment/run.py does (agents.scr first is a circular import), and wraps the agent's `criterion`
to record each step's loss. Matplotlib, scikit-image, pandas, psutil and PyYAML are imported by
their modules, not used by SCR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the AML driver: the stream's cut, the ResNet's state_dict mapping)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = (0, 1, 2, 3, 4)  # each side's five runs: our initial weights and both sides' draws
BATCH = 10  # their --batch (general_main.py)
EPS_MEM_BATCH = 10  # their --eps_mem_batch parser default (their CIFAR-100 README command: 100)
MEM_SIZE = 100  # their --mem_size; 10 per class: the buffer fills at step 10 of 40
LEARNING_RATE = 0.1  # their --learning_rate (SGD), config_CVPR/agent/scr
TEMPERATURE = 0.07  # their --temp
NUM_CLASSES = 10
FEATURES = 160  # the reduced ResNet-18's pooled width (nf 20 x 8): their SupConResNet's dim_in
THEIR_ENCODER_CLASSES = 100  # SupConResNet builds Reduced_ResNet18(100); SCR never reads its head


def overrides(seed: int = 0) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  return {
      "method": "scr", "seed": seed, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "unit",  # their ToTensor: pixels / 255
      "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      "scr.optimizer": "sgd", "scr.learning_rate": LEARNING_RATE, "scr.weight_decay": 0.0,
      "scr.buffer_size": MEM_SIZE, "scr.replay_batch": EPS_MEM_BATCH,
      "scr.temperature": TEMPERATURE, "scr.flip": True, "scr.trainable": "all"}


def cli(settings: dict, manifest: str, workdir: str) -> list[str]:
  """The launch/run.py command of one seed's run on the prepared stream."""
  return [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--config",
          os.path.join(ROOT, "configs", "demo.py"), "--workdir", workdir,
          *aml.command_line(settings), f"--config.data.stream_manifest={manifest}",
          "--config.eval.write_plots=False", "--config.checkpoint_every=0"]


def class_accuracies(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """Each class's test accuracy (C,) from the test logits (N, C)."""
  right = logits.argmax(-1) == labels
  return np.array([right[labels == c].mean() for c in range(NUM_CLASSES)])


def read_run(workdir: str, labels: np.ndarray, n_tasks: int) -> tuple[np.ndarray, np.ndarray]:
  """One run of ours: (per-step losses (T,), per-class accuracies at each task end (tasks, C))."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(x) for x in f]
  loss = np.array([x["loss"] for x in lines if x.get("event") == "train"], np.float32)
  accuracies = [class_accuracies(np.load(os.path.join(workdir, "export", f"task_{j}.npz"))
                                 ["logits"], labels) for j in range(n_tasks)]
  return loss, np.stack(accuracies)


def run_live(seeds, manifest: str) -> dict[str, np.ndarray]:
  """Our runs of `seeds` on the prepared stream `manifest` (a path), in this process: {loss (S, T):
  each step's loss; class_accuracy (S, tasks, C): each class's test accuracy at each task end;
  at each task end, from the state the evaluation reads, buffer_features (S, tasks, K, D): the
  network's pooled features of the buffer's K slots in evaluation mode (as their `evaluate`
  computes them, a batch at a time), buffer_labels and buffer_valid (S, tasks, K), and means
  (S, tasks, C, D) and present (S, tasks, C): the class means `eval_state` computed}. What the
  CLI run of each seed computes (`cli`: the same Setup from `overrides`, initial state, train
  step, `eval_state` and raw test logits at each task end, as eval.export writes them), without
  a workdir, and with one compiled train step shared by the seeds: a seed sets only the initial
  state (weights and the state's key) on a replayed stream, so one Setup serves them all."""
  import jax

  from olora_jax import compute, evaluate, run_control, sharding, trainer
  from olora_jax.methods import common, replay
  from olora_jax.models import resnet

  setup = trainer.Setup(aml.demo_config({**overrides(), "data.stream_manifest": manifest}))
  c, method = setup.config, setup.method
  assert method.after_step is None and method.at_boundary is None  # no host hook to replay
  evaluator = evaluate.Evaluator(setup.test_source, setup.spec.image_size, c.eval.batch_size,
                                 setup.num_classes, method.predict, c.eval.mask_unseen_logits,
                                 mesh=setup.mesh, input_scale=c.data.input_scale,
                                 preprocess=c.data.preprocess,
                                 predict_chunk=c.eval.predict_chunk)
  ends, labels = set(setup.stream.task_end_steps().tolist()), setup.test_source.labels
  apply = common.make_apply(setup.model)
  # The trainer's compiled step (as `_train_loop` jits it): method.train_step is plain Python,
  # which called as it is ran op by op, compiling each of its scans anew at every step.
  train_step = run_control.make_guarded_step(method.train_step)

  @jax.jit
  def buffer_features(state):
    with resnet.running_statistics():  # traced here: the evaluation mode's BatchNorm
      params = {k: v for k, v in state["params"].items() if k != "projection"}
      return apply(state["frozen"], params,
                   replay.decode(state["buffer"].images, c.data.input_scale), pre_logits=True)

  out = {k: [] for k in ("loss", "class_accuracy", "buffer_features", "buffer_labels",
                         "buffer_valid", "means", "present")}
  for seed in seeds:
    state = trainer.run_initial_state(setup, np.uint32(seed), None)
    # Placed as the trainer's `_start` places it, so the step compiles once, not again for the
    # mesh shardings its own outputs carry.
    state = sharding.place_state(state, sharding.state_shardings(state, setup.mesh))
    run = {k: [] for k in out}
    for step, batch in trainer._batches(setup, 0, compute.Ledger({})):
      state, scalars, _ = train_step(state, batch)
      run["loss"].append(float(scalars["loss"]))
      if step in ends:
        evaluated = method.eval_state(state)
        logits = evaluator.logits(evaluated, np.arange(len(setup.test_source)))
        run["class_accuracy"].append(class_accuracies(logits, labels))
        run["buffer_features"].append(np.asarray(buffer_features(state)))
        run["buffer_labels"].append(np.asarray(state["buffer"].labels))
        run["buffer_valid"].append(np.asarray(state["buffer"].valid))
        run["means"].append(np.asarray(evaluated["means"]))
        run["present"].append(np.asarray(evaluated["present"]))
    for k, v in run.items():
      out[k].append(np.array(v, np.float32) if k == "loss" else np.stack(v))
  return {k: np.stack(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------
# prepare (this project's venv)


def their_state_dict(params: dict, batch_stats: dict) -> dict[str, np.ndarray]:
  """Our reduced ResNet-18 and projection head under the names and layouts of their
  SupConResNet: the network as AML's ResNet18 (aml.their_state_dict) under `encoder.`, its unused
  100-class linear layer zero, the head's Linear/ReLU/Linear as head.0 / head.2 (kernels (in,
  out) -> weight (out, in))."""
  encoder = aml.their_state_dict({**params, "head": {"kernel": np.zeros(
      (FEATURES, THEIR_ENCODER_CLASSES), np.float32), "bias": np.zeros(
          THEIR_ENCODER_CLASSES, np.float32)}}, batch_stats, cosine=False)
  out = {f"encoder.{k}": v for k, v in encoder.items()}
  head = params["projection"]
  for name, layer in (("head.0", "hidden"), ("head.2", "out")):
    out[f"{name}.weight"] = np.ascontiguousarray(np.asarray(head[layer]["kernel"]).T)
    out[f"{name}.bias"] = np.asarray(head[layer]["bias"])
  return out


def prepare(args) -> None:
  import jax

  from olora_jax import trainer
  from olora_jax.models import resnet

  def setup_of(settings):
    return trainer.Setup(aml.demo_config(settings))

  os.makedirs(args.out, exist_ok=True)
  setup = setup_of(overrides())
  manifest = aml.cut_manifest(setup.manifest, aml.STEPS_PER_TASK)
  manifest_path = os.path.join(args.out, "manifest.json")
  with open(manifest_path, "w") as f:
    json.dump(manifest, f)
  train_ids, test_ids = aml.write_inputs(setup, manifest, os.path.join(args.out, "inputs.npz"))
  with np.load(os.path.join(args.out, "inputs.npz")) as z:
    test_y = z["test_y"]
  with open(os.path.join(args.out, "overrides.json"), "w") as f:
    json.dump(overrides(), f)
  n_tasks = len(set(manifest["step_task"]))
  losses, accuracies = [], []
  for seed in SEEDS:
    settings = {**overrides(seed), "data.stream_manifest": manifest_path}
    state = jax.device_get(trainer.run_initial_state(setup_of(settings), np.uint32(seed), None))
    np.savez(os.path.join(args.out, f"weights_{seed}.npz"),
             **their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS]))
    workdir = os.path.join(args.out, f"ours_{seed}")
    subprocess.run(cli(overrides(seed), manifest_path, workdir), check=True, cwd=ROOT)
    loss, accuracy = read_run(workdir, test_y, n_tasks)
    losses.append(loss)
    accuracies.append(accuracy)
    print(f"ours, seed {seed}: task-end accuracy on the seen classes"
          f" {seen_accuracy(accuracy, manifest).round(4).tolist()}")
  np.savez(os.path.join(args.out, "ours.npz"), loss=np.stack(losses),
           class_accuracy=np.stack(accuracies))
  print(f"prepared scr: {len(manifest['steps'])} steps, {len(train_ids)} training and"
        f" {len(test_ids)} test records, {len(SEEDS)} seeds -> {args.out}")


def seen_accuracy(class_accuracy: np.ndarray, manifest: dict) -> np.ndarray:
  """The mean accuracy over the classes seen by each task end (tasks,), from per-class
  accuracies (..., tasks, C): the classes of tasks 0..j, each class weighted equally."""
  out = []
  for j in range(class_accuracy.shape[-2]):
    seen = sorted({c for t in range(j + 1) for c in manifest["task_classes"][t]})
    out.append(class_accuracy[..., j, seen].mean(-1))
  return np.stack(out, -1)


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


def _compatibility_shims() -> None:
  """The module docstring's shims: `torch.solve` for kornia 0.4.1, and a torchvision stand-in."""
  import collections

  import torch

  solved = collections.namedtuple("solved", "solution LU")
  torch.solve = lambda b, a: solved(torch.linalg.solve(a, b), torch.linalg.lu_factor(a)[0])

  class ToTensor:
    """torchvision's ToTensor on a float HWC array: the CHW tensor, values unchanged."""

    def __call__(self, picture):
      return torch.from_numpy(np.ascontiguousarray(np.asarray(picture).transpose(2, 0, 1)))

  class Compose:
    def __init__(self, transforms):
      self.transforms = transforms

    def __call__(self, x):
      for t in self.transforms:
        x = t(x)
      return x

  vision = types.ModuleType("torchvision")
  vision.transforms = types.SimpleNamespace(Compose=Compose, ToTensor=ToTensor)
  vision.datasets = types.ModuleType("torchvision.datasets")
  vision.models = types.ModuleType("torchvision.models")
  sys.modules.update({"torchvision": vision, "torchvision.transforms": vision.transforms,
                      "torchvision.datasets": vision.datasets,
                      "torchvision.models": vision.models})


def their_params(seed: int) -> argparse.Namespace:
  """What their general_main.py's parser gives SCR's agent and buffer at these settings."""
  return argparse.Namespace(
      agent="SCR", data="cifar100",  # their 32 px CIFAR entry: input size (3, 32, 32), ToTensor
      seed=seed, cuda=False, epoch=1, batch=BATCH, verbose=False, mem_size=MEM_SIZE,
      eps_mem_batch=EPS_MEM_BATCH, mem_iters=1, update="random", retrieve="random",
      buffer_tracker=False, error_analysis=False, temp=TEMPERATURE, head="mlp",
      learning_rate=LEARNING_RATE, weight_decay=0.0, optimizer="SGD",
      trick={"labels_trick": False, "separated_softmax": False, "kd_trick": False,
             "kd_trick_star": False, "review_trick": False, "ncm_trick": False})


def run_theirs(manifest: dict, data: dict, weights: dict, seed: int):
  """One seed of their run (module docstring): (per-step losses (T,), per-class accuracies at
  each task end (tasks, C))."""
  import contextlib
  import io
  import random

  import torch

  # Their package, from the checkout. utils.name_match first, as their experiment/run.py imports
  # it: agents.scr imported first is a circular import.
  import utils.name_match  # noqa: F401
  from agents.scr import SupContrastReplay
  from utils.setup_elements import setup_architecture, setup_opt

  torch.set_num_threads(1)
  random.seed(seed)
  np.random.seed(seed)
  torch.manual_seed(seed)
  params = their_params(seed)
  model = setup_architecture(params)
  model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()},
                        strict=True)
  opt = setup_opt(params.optimizer, model, params.learning_rate, params.weight_decay)
  with contextlib.redirect_stdout(io.StringIO()):  # their Buffer prints its size
    agent = SupContrastReplay(model, opt, params)
  losses = []
  criterion = agent.criterion

  def recorded(features, labels):
    loss = criterion(features, labels)
    losses.append(loss.item())
    return loss

  agent.criterion = recorded  # SCR's loss, recorded as it is computed
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  test_x = np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2))
  loaders = [torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
      torch.from_numpy(test_x[data["test_y"] == c]),
      torch.from_numpy(data["test_y"][data["test_y"] == c].astype(np.int64))),
      batch_size=len(test_x)) for c in range(NUM_CLASSES)]
  steps, step_task, accuracies = manifest["steps"], manifest["step_task"], []
  for t, ids in enumerate(steps):
    rows = [row[i] for i in ids]
    n_before = len(losses)
    agent.train_learner(data["train_x"][rows], data["train_y"][rows].astype(np.int64))
    if len(losses) == n_before:  # no step: their memory was empty
      losses.append(np.nan)
    if t + 1 == len(steps) or step_task[t + 1] != step_task[t]:  # a task end
      with contextlib.redirect_stdout(io.StringIO()):  # evaluate prints its accuracies
        accuracies.append(agent.evaluate(loaders))
  return np.array(losses, np.float32), np.stack(accuracies)


def record(args) -> None:
  """Runs their code for each of SEEDS from our initial weights of that seed, and writes their
  and our (prepared) losses and accuracies."""
  import torch

  _compatibility_shims()
  sys.path.insert(0, os.path.abspath(args.ocl))
  with open(os.path.join(args.prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.prepared, "overrides.json")) as f:
    settings = json.load(f)
  data = dict(np.load(os.path.join(args.prepared, "inputs.npz")))
  ours = dict(np.load(os.path.join(args.prepared, "ours.npz")))
  losses, accuracies = [], []
  for seed in SEEDS:
    weights = dict(np.load(os.path.join(args.prepared, f"weights_{seed}.npz")))
    loss, accuracy = run_theirs(manifest, data, weights, seed)
    losses.append(loss)
    accuracies.append(accuracy)
    print(f"theirs, seed {seed}: task-end accuracy on the seen classes"
          f" {seen_accuracy(accuracy, manifest).round(4).tolist()}")
  theirs = np.stack(accuracies)
  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), overrides=json.dumps(settings),
      seeds=np.array(SEEDS), test_labels=data["test_y"].astype(np.int64),
      loss=np.stack(losses), class_accuracy=theirs,
      our_loss=ours["loss"], our_class_accuracy=ours["class_accuracy"],
      versions=json.dumps({"torch": torch.__version__, "numpy": np.__version__,
                           "python": sys.version.split()[0]}))
  for name, acc in (("theirs", theirs), ("ours", ours["class_accuracy"])):
    seen = seen_accuracy(acc, manifest)
    print(f"{name}: seen-class accuracy at each task end, mean {seen.mean(0).round(4).tolist()}"
          f" std {seen.std(0, ddof=1).round(4).tolist()}")


def live(args) -> None:
  """`live`: our runs of --seeds on the stream of --manifest (`run_live`), written to --out
  (.npz: seeds and `run_live`'s arrays); tests/test_parity_scr.py runs it."""
  np.savez(args.out, seeds=np.array(args.seeds), **run_live(args.seeds, args.manifest))


def main(argv=None) -> None:
  parser, sub, _, _ = aml.driver_parser(__doc__, "ocl", "RaptorMai/online-continual-learning",
                                        "tests/fixtures/parity/ocl_scr.npz",
                                        "stream, inputs, weights, our runs")
  p = sub.add_parser("live", help="in this project's venv: our runs of some seeds, in one process")
  p.add_argument("--manifest", required=True, help="the stream (a recording's manifest.json)")
  p.add_argument("--seeds", type=int, nargs="+", required=True)
  p.add_argument("--out", required=True, help="where to write their losses and accuracies (.npz)")
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record, "live": live})

if __name__ == "__main__":
  main()
