"""Runs the authors' released Online-LoRA code on a stream this project writes, and records what
it decided, step by step: the parity fixture of `reference` fidelity (docs/parity-online-lora.md).

Two stages, each in its own environment:

    # 1. Ours (the project's venv): the stream manifest, the initial weights in the authors'
    #    layout, and the model inputs of every training step and test example.
    .venv/bin/python scripts/parity/online_lora.py prepare \
        --fixture tests/fixtures/parity/online_lora --inputs /tmp/olora_parity_inputs.npz

    # 2. Theirs (a side venv with PyTorch; never this project's): their loop on those batches.
    python3.11 -m venv /tmp/side-venv
    /tmp/side-venv/bin/pip install torch==2.13.0 numpy safetensors pillow
    /tmp/side-venv/bin/pip install --no-deps timm==0.9.12
    git clone <a checkout of Christina200/Online-LoRA-official> /tmp/Online-LoRA-official
    /tmp/side-venv/bin/python scripts/parity/online_lora.py record \
        --authors /tmp/Online-LoRA-official --fixture tests/fixtures/parity/online_lora \
        --inputs /tmp/olora_parity_inputs.npz

`prepare` builds the stream of configs/demo.py in `reference` fidelity (250 steps of 16 MNIST
digits, 5 tasks; `--set KEY=VALUE` changes one of its SETTING_KEYS) and writes into the fixture
folder: `stream_manifest.json` (the run's manifest), `initial.safetensors` (the run's initial
state, the pretrained backbone with the head and the first LoRA our seed draws, in the authors'
layout, `pretrained.save_online_lora_safetensors`) and `settings.json` (every config value the
authors' loop takes). The model inputs (float32, as our input pipeline makes them) go to
`--inputs`, a scratch file (60 MB) that is not part of the fixture.

`record` imports the authors' `Disjoint/` modules from `--authors` (a copy, patched with
scripts/parity/online_lora.patch: one line, the reason in the file) and runs what their
`main.py` runs: seeds, their `LoRA_ViT_timm` around a timm ViT of our demo's sizes, Adam over
the model's parameters, cross-entropy, and their `engine.train_and_evaluate`, unchanged. Two
things are replaced, as in docs/parity-online-lora.md: the data loaders (the manifest's
batches in order, task by task; each task's test examples in the manifest's order, 64 at a
time) and the initial weights (`initial.safetensors`, loaded strictly but for their unused
`proj_3d`). It is deterministic: seeds, `torch.use_deterministic_algorithms(True)`, `--threads`
threads (1 for a recording).

What it records, without touching their loop: the training loader, resumed by their loop before
each step and once after a task's last step, reads the loop's own variables (the loss, the
loss window, its mean and variance, the peak flag, the plateau count, the hard buffer's batches,
Omega) at that moment; a wrapper around their `evaluate_till_now` and a forward hook on their
ViT catch each test batch's logits and the accuracy row at every task end. The recording,
`authors_run.npz`, uses our names and layouts (tests/test_parity_online_lora.py compares it
with our trace and task-end exports), and `authors_run.json` says what produced it.

`--no-record` runs the same loop without recording (timing: `--threads 2`); the `ours` stage
runs our CLI on the same fixture (`ours_command`, the parity test's command), to time beside it.

timm imports torchvision, whose only builds for torch 2.13 on PyPI are CUDA builds that cannot
load beside the CPU torch. Where torchvision does not import, `record` gives timm an empty
stand-in whose every object refuses to be used: the ViT and the authors' loop use none of it
(their datasets.py, which does, is never imported).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "online_lora.patch")
MANIFEST = "stream_manifest.json"
WEIGHTS = "initial.safetensors"
SETTINGS = "settings.json"
RECORDING = "authors_run.npz"
RECORDING_INFO = "authors_run.json"
EVAL_BATCH = 64  # test examples per forward pass in their evaluation
# The config keys the authors' loop takes, read from the resolved config by `prepare`.
SETTING_KEYS = ("seed", "fidelity", "data.dataset", "learner.batch_size", "learner.buffer_size",
                "learner.rank", "learner.learning_rate", "learner.reg_lambda", "learner.window",
                "learner.mean_threshold", "learner.var_threshold", "model.image_size",
                "model.patch_size", "model.width", "model.depth", "model.num_heads",
                "model.mlp_dim")
TARGETS = ("query", "value")  # ours; theirs: _q, _v


def sha256_of(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Stage 1: ours.


def prepare(args) -> None:
  sys.path.insert(0, ROOT)
  from configs import demo
  from olora_jax import pretrained, trainer
  from olora_jax.data import manifest as manifest_lib
  from olora_jax.data.preprocess import to_model_input
  from olora_jax.learner import online_lora

  config = demo.get_config()
  config.fidelity = "reference"
  for item in args.set:
    key, _, value = item.partition("=")
    if key not in SETTING_KEYS[2:]:  # their loop reads these; the test sets them from settings
      raise SystemExit(f"--set {key}: only {', '.join(SETTING_KEYS[2:])} can be set")
    section, _, leaf = key.rpartition(".")
    node = config[section] if section else config
    try:
      node[leaf] = json.loads(value)
    except json.JSONDecodeError:  # a bare string
      node[leaf] = value
  setup = trainer.Setup(config)
  c = setup.config
  os.makedirs(args.fixture, exist_ok=True)
  manifest_sha = manifest_lib.write_manifest(os.path.join(args.fixture, MANIFEST), setup.manifest)

  # The run's initial state, as `launch/run.py` builds it from the seed.
  state = trainer.run_initial_state(setup, c.seed, trainer.load_params(setup, c))
  frozen = {k: v for k, v in state["frozen"].items() if k != online_lora.FROZEN_LORA}
  trainable = state["state"].trainable
  weights = os.path.join(args.fixture, WEIGHTS)
  pretrained.save_online_lora_safetensors(
      {**frozen, "head": trainable["head"]}, trainable["lora"], weights,
      frozen_lora=state["frozen"].get(online_lora.FROZEN_LORA))

  settings = {key: _get(c, key) for key in SETTING_KEYS}
  settings.update(num_classes=setup.num_classes, config="configs/demo.py",
                  overrides=list(args.set), stream_manifest_sha256=manifest_sha,
                  initial_weights_sha256=sha256_of(weights))
  with open(os.path.join(args.fixture, SETTINGS), "w") as f:
    json.dump(settings, f, indent=1, sort_keys=True)
    f.write("\n")

  steps = [setup.pipeline.batch(s) for s in range(len(setup.pipeline))]
  test = setup.test_source
  test_images, test_labels = test.get(np.arange(len(test)))
  np.savez(args.inputs,
           step_images=np.stack([b["images"] for b in steps]),
           step_labels=np.stack([b["labels"] for b in steps]),
           step_mask=np.stack([b["mask"] for b in steps]),
           test_images=to_model_input(test_images, c.model.image_size, c.data.input_scale),
           test_labels=np.asarray(test_labels, np.int64),
           test_ids=manifest_lib.record_ids(test),
           stream_manifest_sha256=np.array(manifest_sha))
  print(f"wrote {args.fixture}/{{{MANIFEST},{WEIGHTS},{SETTINGS}}} and {args.inputs}")


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


# ---------------------------------------------------------------------------------------------
# Stage 2: theirs.


class _Refused(type):
  """A torchvision object in the stand-in: any attribute is another one; making one fails."""

  def __getattr__(cls, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return _absent(name)


def _refuse(self, *args, **kwargs):
  raise RuntimeError(f"torchvision's {type(self).__name__} was used, but torchvision is a"
                     " stand-in here (scripts/parity/online_lora.py): install a torchvision that"
                     " loads with this torch")


def _absent(name: str) -> type:
  return _Refused(name, (), {"__init__": _refuse})


class _StandInModule(types.ModuleType):
  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    value = _absent(name)
    setattr(self, name, value)
    return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  def find_spec(self, fullname, path, target=None):
    if fullname == "torchvision" or fullname.startswith("torchvision."):
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    return _StandInModule(spec.name)

  def exec_module(self, module):
    module.__path__ = []


def _torchvision_or_stand_in() -> str:
  try:
    import torchvision  # noqa: F401
    return "torchvision " + torchvision.__version__
  except Exception:  # absent, or a build that cannot load beside this torch
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
      del sys.modules[name]
    sys.meta_path.insert(0, _StandInFinder())
    return "stand-in (torchvision does not load beside this torch)"


def _patched_copy(authors: str, workdir: str) -> str:
  """A copy of the authors' Disjoint/ with the patch applied; the checkout is left as it is."""
  source = os.path.join(authors, "Disjoint")
  if not os.path.isfile(os.path.join(source, "engine.py")):
    raise SystemExit(f"--authors={authors!r} holds no Disjoint/engine.py; pass a checkout of"
                     " Christina200/Online-LoRA-official")
  copy = os.path.join(workdir, "Disjoint")
  shutil.copytree(source, copy)
  subprocess.run(["git", "apply", "--unidiff-zero", PATCH], cwd=copy, check=True)
  return copy


def _authors_commit(authors: str) -> str:
  done = subprocess.run(["git", "-C", authors, "rev-parse", "HEAD"], capture_output=True,
                        text=True)
  return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"


class _Recorder:
  """Reads the authors' loop's variables between its steps (see the module docstring)."""

  def __init__(self, torch, model, settings: dict, step_ids: np.ndarray, enabled: bool):
    self.torch, self.model, self.enabled = torch, model, enabled
    self.step_ids = step_ids  # (T, B) the record id of every row of every step
    self.k = settings["learner.buffer_size"]
    self.reg_lambda = settings["learner.reg_lambda"]
    self.ids_of = {}  # id() of a step's input tensor -> its step (the tensors are kept alive)
    self.tensors = []
    self.steps = []  # one dict per step, in order
    self.plateaus = []
    self.task_ends = []
    self.had_omega = False  # Omega existed when the step being recorded began
    self.evaluating = None  # the logits list of the evaluation under way
    model.lora_vit.register_forward_hook(self._hook)

  def batch(self, step: int, inputs):
    self.ids_of[id(inputs)] = step
    self.tensors.append(inputs)

  def after_step(self, frame, step: int) -> None:
    """Called from their loop's frame (`frame`) once step `step` is done."""
    if not self.enabled:
      return
    if frame.f_code.co_name != "train_and_evaluate":
      raise RuntimeError(f"the training loader was resumed from {frame.f_code.co_name}, not the"
                         " authors' train_and_evaluate: their loop changed; update the driver")
    v = frame.f_locals
    fired = v["count_updates"] > len(self.plateaus)
    hard_loss = [h.item() for h in v["hard_loss"]]
    mas_loss = v["mas_loss"] if self.had_omega else 0.0  # their float 0. until Omega is an array
    if isinstance(mas_loss, self.torch.Tensor):
      mas_loss = mas_loss.item()
    reg = self.reg_lambda / 2.0 * mas_loss
    buffer_steps = [self.ids_of[id(entry["state"])] for entry in v["hard_buffer"]]
    candidates = [self.ids_of[id(x)] for x in v["xt"]]
    scores = [float(v["loss"][candidates.index(s)]) for s in buffer_steps]
    self.steps.append(dict(
        window_value=np.float32(np.mean(v["first_train_loss"])),
        loss=np.float32(v["total_loss"].item()),
        ce_current=np.float32(v["current_loss"][0].item()),
        ce_buffer=np.float32(sum(hard_loss)) if hard_loss else np.float32(0.0),
        reg=np.float32(reg),
        window_mean=np.float32(v["loss_window_means"][-1]),
        window_var=np.float32(v["loss_window_variances"][-1]),
        plateau=fired, peak_after=bool(v["new_peak_detected"]),
        buffer_steps=buffer_steps, buffer_scores=scores))
    if fired:
      self.plateaus.append(dict(step=step,
                                omega_a=_omega(v["omega_As"], self.model.wnew_As),
                                omega_b=_omega(v["omega_Bs"], self.model.wnew_Bs),
                                frozen_a=_weights(self.model.w_As),
                                frozen_b=_weights(self.model.w_Bs)))
    self.had_omega = len(v["omega_As"]) != 0

  def _hook(self, module, inputs, output):
    if self.evaluating is not None:
      self.evaluating.append(output.detach().numpy().copy())

  def wrap_evaluation(self, evaluate_till_now, task_ids: list[np.ndarray]):
    """Their `evaluate_till_now`, also recording each test batch's logits and the accuracy row."""

    def evaluate_and_record(*args, **kwargs):
      self.evaluating = [] if self.enabled else None
      try:
        stats = evaluate_till_now(*args, **kwargs)
      finally:
        logits, self.evaluating = self.evaluating, None
      if self.enabled:
        task = kwargs["task_id"]
        m = self.model
        self.task_ends.append(dict(
            task=task, record_ids=np.concatenate(task_ids[:task + 1]),
            logits=np.concatenate(logits), accuracy=kwargs["acc_matrix"][:task + 1, task].copy(),
            head_kernel=m.lora_vit.head.weight.detach().numpy().T.copy(),
            head_bias=m.lora_vit.head.bias.detach().numpy().copy(),
            lora_a=_weights(m.wnew_As), lora_b=_weights(m.wnew_Bs)))
      return stats

    return evaluate_and_record

  def arrays(self) -> dict[str, np.ndarray]:
    """The recording in our trace's names and layouts (docs/replay.md, step traces)."""
    out = {"step": np.arange(len(self.steps), dtype=np.int64)}
    for key in ("window_value", "loss", "ce_current", "ce_buffer", "reg", "window_mean",
                "window_var"):
      out[key] = np.array([s[key] for s in self.steps], np.float32)
    out["plateau"] = np.array([s["plateau"] for s in self.steps], bool)
    peak_after = np.array([s["peak_after"] for s in self.steps], bool)
    out["armed"] = peak_after | out["plateau"]  # a peak seen at the step's plateau check
    before = np.concatenate([[True], peak_after[:-1]])  # the flag before each step
    out["rearmed"] = out["armed"] & ~before
    n, b = len(self.steps), self.step_ids.shape[1]
    out["buffer_ids"] = np.full((n, self.k, b), -1, np.int64)
    out["buffer_scores"] = np.full((n, self.k), np.nan, np.float32)
    for t, s in enumerate(self.steps):
      for slot, (src, score) in enumerate(zip(s["buffer_steps"], s["buffer_scores"],
                                              strict=True)):
        out["buffer_ids"][t, slot] = self.step_ids[src]
        out["buffer_scores"][t, slot] = score
    out["plateau_step"] = np.array([p["step"] for p in self.plateaus], np.int64)
    # Theirs: one list per factor over blocks and targets, [block 0 q, block 0 v, block 1 q, ...],
    # A as (r, D) and B as (D, r) Linear weights; ours: lora_a (D, r), lora_b (r, D).
    for name, (a_key, b_key) in (("omega", ("omega_a", "omega_b")),
                                 ("frozen_lora", ("frozen_a", "frozen_b"))):
      for i, (block, target) in enumerate(self._targets()):
        prefix = f"{name}/encoderblock_{block}/{target}"
        out[f"{prefix}/lora_a"] = np.stack([p[a_key][i].T for p in self.plateaus])
        out[f"{prefix}/lora_b"] = np.stack([p[b_key][i].T for p in self.plateaus])
    for e in self.task_ends:
      prefix = f"task_{e['task']}"
      out[f"{prefix}/record_ids"] = e["record_ids"].astype(np.int64)
      out[f"{prefix}/logits"] = e["logits"].astype(np.float32)
      out[f"{prefix}/accuracy"] = e["accuracy"].astype(np.float64)
      out[f"{prefix}/params/head/kernel"] = e["head_kernel"]
      out[f"{prefix}/params/head/bias"] = e["head_bias"]
      for i, (block, target) in enumerate(self._targets()):
        lora = f"{prefix}/params/lora/encoderblock_{block}/{target}"
        out[f"{lora}/lora_a"] = e["lora_a"][i].T.copy()
        out[f"{lora}/lora_b"] = e["lora_b"][i].T.copy()
    return out

  def _targets(self):
    return [(i // 2, TARGETS[i % 2]) for i in range(len(self.model.w_As))]


def _weights(linears: list) -> list[np.ndarray]:
  return [w.weight.detach().numpy().copy() for w in linears]


def _omega(entries: list, linears: list) -> list[np.ndarray]:
  """Their Omega of one factor, as arrays: an entry is an array, or the int 0 of a plateau whose
  buffer was empty (as zeros of its Linear's weight shape)."""
  return [np.broadcast_to(np.asarray(o, np.float32), w.weight.shape).copy()
          for o, w in zip(entries, linears, strict=True)]


def _vit(s: dict):
  from timm.models.vision_transformer import VisionTransformer

  return VisionTransformer(img_size=s["model.image_size"], patch_size=s["model.patch_size"],
                           num_classes=s["num_classes"], embed_dim=s["model.width"],
                           depth=s["model.depth"], num_heads=s["model.num_heads"],
                           mlp_ratio=s["model.mlp_dim"] / s["model.width"])


def record(args) -> None:
  for name in ("authors", "fixture", "inputs"):  # their loop runs in a scratch folder
    setattr(args, name, os.path.abspath(getattr(args, name)))
  with open(os.path.join(args.fixture, SETTINGS)) as f:
    s = json.load(f)
  with open(os.path.join(args.fixture, MANIFEST)) as f:
    manifest = json.load(f)
  inputs = np.load(args.inputs)
  if str(inputs["stream_manifest_sha256"]) != s["stream_manifest_sha256"]:
    raise SystemExit(f"{args.inputs} was prepared for another manifest; run `prepare` again")
  if s["fidelity"] != "reference":
    raise SystemExit("the authors' code is `reference` fidelity; prepare with fidelity=reference")
  weights = os.path.join(args.fixture, WEIGHTS)
  if sha256_of(weights) != s["initial_weights_sha256"]:
    raise SystemExit(f"{weights} is not the file `prepare` wrote; run `prepare` again")

  import torch

  torch.set_num_threads(args.threads)
  torch.set_num_interop_threads(1)
  torch.use_deterministic_algorithms(True)
  torchvision = _torchvision_or_stand_in()
  import timm
  from safetensors.torch import load_file

  workdir = tempfile.mkdtemp(prefix="olora_parity_")
  start = time.perf_counter()
  sys.path.insert(0, _patched_copy(args.authors, workdir))
  import engine
  import lora as lora_module
  import utils

  # What their main.py does, but the data loader and the weights.
  run_args = argparse.Namespace(
      num_tasks=len(manifest["task_classes"]), nb_batch=1, epochs=1, print_freq=10,
      hard_loss=True, regularization=True, new_lora=True, all_metrics=True,
      MAS_weight=s["learner.reg_lambda"], hard_buffer_size=s["learner.buffer_size"],
      loss_window_length=s["learner.window"],
      loss_window_mean_threshold=s["learner.mean_threshold"],
      loss_window_variance_threshold=s["learner.var_threshold"], lr=s["learner.learning_rate"],
      lora_rank=s["learner.rank"], nb_classes=s["num_classes"], seed=s["seed"], device="cpu",
      output_dir=os.path.join(workdir, "output"))
  os.makedirs(run_args.output_dir)
  here = os.getcwd()
  os.chdir(workdir)  # their loop writes ./results and ./logs
  utils.init_distributed_mode(run_args)
  with contextlib.redirect_stdout(io.StringIO()):
    _seed_as_main(torch, run_args.seed)
  model = lora_module.LoRA_ViT_timm(vit_model=_vit(s), r=run_args.lora_rank,
                                    num_classes=run_args.nb_classes)
  missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
  if unexpected or any(not k.startswith("proj_3d.") for k in missing):
    raise SystemExit(f"{weights} does not fit their model: missing {missing}, unexpected"
                     f" {unexpected}")
  optimizer = torch.optim.Adam(model.parameters(), lr=run_args.lr)
  criterion = torch.nn.CrossEntropyLoss()

  step_ids = np.array(manifest["steps"], np.int64)
  recorder = _Recorder(torch, model, s, step_ids, enabled=not args.no_record)
  loaders = _loaders(torch, manifest, inputs, recorder)
  engine.evaluate_till_now = recorder.wrap_evaluation(
      engine.evaluate_till_now, [ids for ids in _task_test_ids(manifest, inputs)])
  log_path = os.path.join(workdir, "stdout.log")
  with open(log_path, "w") as log, contextlib.redirect_stdout(log):
    engine.train_and_evaluate(model=model, criterion=criterion, data_loader=loaders,
                              optimizer=optimizer, device=torch.device("cpu"), args=run_args,
                              class_mask=None)
  wall = time.perf_counter() - start
  os.chdir(here)
  print(f"their loop ran {len(step_ids)} steps in {wall:.1f} s ({args.threads} thread(s));"
        f" its printout: {log_path}")
  if args.no_record:
    return
  arrays = recorder.arrays()
  np.savez_compressed(os.path.join(args.fixture, RECORDING), **arrays)
  info = dict(
      authors_repository="Christina200/Online-LoRA-official",
      authors_commit=_authors_commit(args.authors),
      authors_files_sha256={name: sha256_of(os.path.join(args.authors, "Disjoint", name))
                            for name in ("engine.py", "lora.py", "utils.py", "main.py")},
      patch_sha256=sha256_of(PATCH), torch=torch.__version__, timm=timm.__version__,
      numpy=np.__version__, torchvision=torchvision, python=platform.python_version(),
      threads=args.threads, cpu=_cpu_model(), stream_manifest_sha256=s["stream_manifest_sha256"],
      initial_weights_sha256=s["initial_weights_sha256"], eval_batch=EVAL_BATCH,
      plateau_steps=arrays["plateau_step"].tolist(),
      accuracy_after_last_task=[float(a) for a in recorder.task_ends[-1]["accuracy"]])
  with open(os.path.join(args.fixture, RECORDING_INFO), "w") as f:
    json.dump(info, f, indent=1, sort_keys=True)
    f.write("\n")
  print(f"recorded {args.fixture}/{RECORDING}: plateaus at {info['plateau_steps']}")


def _seed_as_main(torch, seed: int) -> None:
  """Their main.py's `set_seed` (its module imports torchvision's datasets, so it is not
  imported): the same seeds, for the parts of their model our weights do not replace."""
  import random

  torch.manual_seed(seed)
  np.random.seed(seed)
  random.seed(seed)


def _task_test_ids(manifest: dict, inputs) -> list[np.ndarray]:
  labels = inputs["test_labels"]
  return [inputs["test_ids"][np.isin(labels, classes)] for classes in manifest["task_classes"]]


class _Loader:
  """An iterable of (inputs (n, 3, H, W) float32, labels (n,) int64) with a length."""

  def __init__(self, batches, on_resume=None):
    self.batches, self.on_resume = batches, on_resume

  def __len__(self):
    return len(self.batches)

  def __iter__(self):
    for i, batch in enumerate(self.batches):
      if self.on_resume is not None and i > 0:
        self.on_resume(sys._getframe(1), i - 1)
      yield batch
    if self.on_resume is not None and self.batches:
      self.on_resume(sys._getframe(1), len(self.batches) - 1)


def _loaders(torch, manifest: dict, inputs, recorder: _Recorder) -> list[dict]:
  step_task = np.array(manifest["step_task"])
  images, labels, mask = inputs["step_images"], inputs["step_labels"], inputs["step_mask"]
  if not mask.all():
    raise SystemExit("a step with padding: their loop takes whole batches only")
  test_images, test_labels = inputs["test_images"], inputs["test_labels"]
  loaders = []
  for task, classes in enumerate(manifest["task_classes"]):
    steps = np.flatnonzero(step_task == task)
    train = []
    for step in steps:
      x = torch.from_numpy(images[step]).permute(0, 3, 1, 2).contiguous()
      recorder.batch(int(step), x)
      train.append((x, torch.from_numpy(labels[step].astype(np.int64))))
    rows = np.flatnonzero(np.isin(test_labels, classes))
    val = [(torch.from_numpy(test_images[r]).permute(0, 3, 1, 2).contiguous(),
            torch.from_numpy(test_labels[r]))
           for r in np.array_split(rows, -(-len(rows) // EVAL_BATCH))]
    first = int(steps[0])

    def on_resume(frame, i, first=first):
      recorder.after_step(frame, first + i)

    loaders.append({"train": _Loader(train, on_resume), "val": _Loader(val)})
  return loaders


def _cpu_model() -> str:
  with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
    for line in f:
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  return platform.processor() or "unknown"


def ours_command(fixture: str, manifest: str, workdir: str, python: str = sys.executable
                 ) -> list[str]:
  """Our CLI on the fixture: configs/demo.py with the fixture's settings, its stream manifest
  (`manifest`, the whole stream or a cut of it), its initial weights, `reference` fidelity as
  recorded; no figures, no trackers, one anytime evaluation, no periodic checkpoint. The parity
  test adds its trace and logit exports to this; `ours` runs it as it is, for timing."""
  with open(os.path.join(fixture, SETTINGS)) as f:
    settings = json.load(f)
  weights = os.path.join(fixture, WEIGHTS)
  keys = [k for k in settings if "." in k or k == "seed"]
  return [python, os.path.join(ROOT, "launch", "run.py"), "--config",
          os.path.join(ROOT, "configs", "demo.py"), "--workdir", workdir,
          *(f"--config.{k}={settings[k]}" for k in keys),
          f"--config.fidelity={settings['fidelity']}",
          f"--config.data.stream_manifest={manifest}", f"--config.pretrained.path={weights}",
          "--config.pretrained.format=online_lora", "--config.pretrained.keep_head=True",
          f"--config.learner.initial_lora={weights}",
          "--config.eval.write_plots=False", "--config.loggers=",
          "--config.eval.eval_every=4000", "--config.checkpoint_every=0"]


def ours(args) -> None:
  """Runs `ours_command` on the whole fixture stream in a fresh temporary workdir (its exit code
  is this process's), e.g. beside `record --no-record --threads 2` to time the two loops."""
  with tempfile.TemporaryDirectory(prefix="olora_parity_ours_") as tmp:
    command = ours_command(args.fixture, os.path.join(args.fixture, MANIFEST),
                           os.path.join(tmp, "run"))
    command.append(f"--compilation_cache={args.compilation_cache}")
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL)
  sys.exit(done.returncode)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="stage", required=True)
  p = sub.add_parser("prepare", help="ours: the manifest, initial weights and model inputs")
  p.add_argument("--fixture", required=True, help="folder of the fixture")
  p.add_argument("--inputs", required=True, help="scratch .npz of the model inputs")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a setting of configs/demo.py to change, one of SETTING_KEYS but seed and"
                 " fidelity (repeatable)")
  r = sub.add_parser("record", help="theirs: run their loop and record it")
  r.add_argument("--authors", required=True, help="checkout of Online-LoRA-official")
  r.add_argument("--fixture", required=True, help="the folder `prepare` wrote")
  r.add_argument("--inputs", required=True, help="the .npz `prepare` wrote")
  r.add_argument("--threads", type=int, default=1, help="PyTorch threads (1 for a recording)")
  r.add_argument("--no-record", action="store_true", help="run without recording (timing)")
  o = sub.add_parser("ours", help="ours: our CLI on the fixture's stream and weights (timing)")
  o.add_argument("--fixture", required=True, help="the folder `prepare` wrote")
  o.add_argument("--compilation_cache", default="off",
                 help="launch/run.py's flag: 'off' (default) compiles every program, cold; a"
                 " directory keeps them across runs, warm")
  args = parser.parse_args(argv)
  {"prepare": prepare, "record": record, "ours": ours}[args.stage](args)


if __name__ == "__main__":
  main()
