"""SimpleCIL, its APER first phase and SLCA against the toolbox of SimpleCIL's authors
(LAMDA-CL/LAMDA-PILOT): record what their learners do on a stream this project writes
(docs/parity.md).

Two steps, in two environments:

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/pilot.py prepare --method simplecil --out /tmp/pilot-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/pilot-venv &&
    #    /tmp/pilot-venv/bin/pip install torch==2.13.0 numpy scipy tqdm pillow pyyaml &&
    #    /tmp/pilot-venv/bin/pip install --no-deps timm==0.6.13), on a checkout of their code
    #    (git clone https://github.com/LAMDA-CL/LAMDA-PILOT /tmp/LAMDA-PILOT):
    /tmp/pilot-venv/bin/python scripts/parity/pilot.py record --pilot /tmp/LAMDA-PILOT \
        --prepared /tmp/pilot-prep --out tests/fixtures/parity/pilot_simplecil.npz

`--method simplecil` is our SimpleCIL against their `models/simplecil.py`; `--method aper` is our
`simplecil.first_phase='all'` (the whole ViT adapted until the first task end, `boundaries.rule=
oracle`) against their `models/aper_finetune.py` (APER with full fine-tuning); `--method slca` is
our SLCA with `boundaries.rule=oracle` and `slca.alignment='after_boundary'` (their task ends)
against their `models/slca.py`.

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits and its tiny pretrained ViT, a 5% test split), cuts the seeded stream to its first
`STEPS_PER_TASK` batches of 16 of each task and writes: `manifest.json` (our stream manifest),
`inputs.npz` (the model inputs of every training and test record, float32 NHWC, exactly what our
pipeline feeds; `aml.write_inputs`), `weights.npz` (our run's initial state, the same seed, in
their layout: the pretrained ViT as a timm state_dict; for APER the first phase's cosine head as
their CosineLinear's `weight` rows of the first task's classes and `sigma`; for SLCA the ViT's
initial head, whose rows go to their per-task Linear heads) and `overrides.json`.

`record` imports their modules unchanged from the checkout and drives their `Learner` as their
trainer.py does, task by task: `incremental_train(data_manager)`, `eval_task()`, `after_task()`,
with these replacements, all from outside their code:
- `utils.inc_net.get_backbone`, which would download a ViT-B/16, returns a timm
  `VisionTransformer` of the demo's sizes (`num_classes=0`: the final-norm class token, what
  their `vit_base_patch16_224` with `num_classes=0` returns) loaded strict from `weights.npz`;
- the data manager is ours (`StreamData`): `get_task_size` and `get_dataset` of their
  DataManager, over the manifest's records, each task's training records in the stream's order;
- their modules' `DataLoader` is ours (`StreamLoader`): the training set in the stream's batches
  (their loaders shuffle, with 8 workers), the test set 64 at a time in the manifest's order;
- their `update_fc` is followed by loading our initial head into the rows it made (their torch
  draw would be another): APER's fresh CosineLinear at the first task, SLCA's new Linear head of
  each task's classes; their module's `F.cross_entropy` is wrapped to record each step's loss
  (SLCA's alignment apart, `_stage2_compact_classifier` being wrapped to tell them apart).
Their settings: SimpleCIL has none; APER's first phase is their `_init_train` for one epoch
(`tuned_epoch=1`: one pass over the first task's batches in the stream's order, at the constant
initial rate, their cosine stepping only after the epoch), SGD momentum 0.9, our first phase's
rate (learning_rate x batch / lr_reference_batch: 0.01 x 16 / 128) and weight decay 5e-4.
SLCA's slow learner is their `_run` for one epoch a task (their milestone is never reached) at
our head rate (0.01 x 16 / 128), backbone scale 1/100 and weight decay 5e-4; their alignment
runs at the same `lrate` (their code has one rate), so our run takes that rate as
`slca.alignment_learning_rate`; 5 alignment epochs, logit norm 0.1.

Recorded at each task end: every test sample's logits (the learner's network on the whole test
set, all classes seen so far), their `eval_task` top-1 accuracy (the seen classes' test samples)
and for SimpleCIL and APER their classifier's rows (the prototypes: `fc.weight`) and `sigma`; for
APER also each first phase step's loss and the adapted ViT's update over the phase
(`update_fingerprint`); for SLCA each slow-learner step's loss and each alignment step's. And
`OWN_DRIFT_RUNS` more runs of their code from the same weights perturbed at float32 rounding
(`aml.perturbed`): how far their run moves from itself, the scale of the tolerances. Seeds fixed,
`torch.use_deterministic_algorithms(True)`, one thread.

Two compatibility shims, outside their code: timm 0.6.12 (their README's) does not import on
Python 3.11 (a dataclass with a mutable default), so the side venv takes 0.6.13, its bug-fix
release; timm imports torchvision, whose PyPI builds for this torch are CUDA builds that do not
load beside the CPU torch, so `online_lora._torchvision_or_stand_in` gives timm a stand-in that
refuses any use (neither the ViT nor these learners use it).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the AML driver: demo_config, write_inputs, perturbed, OWN_DRIFT_RUNS)

SEED = 0  # the stream's, our initial weights' and their run's seeds
STEPS_PER_TASK = 10  # the parity stream: the first 10 batches of 16 of each of the 5 tasks
EVAL_BATCH = 64  # test samples per forward pass in their evaluation
METHODS = ("simplecil", "aper", "slca")
THEIR_MODULE = {"simplecil": "simplecil", "aper": "aper_finetune", "slca": "slca"}
HEAD = "cosine_head"  # weights.npz: our initial head (APER's cosine one, SLCA's linear one)


def overrides(method: str) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  settings = {"method": "slca" if method == "slca" else "simplecil", "seed": SEED,
              "data.test_fraction": 0.05, "eval.eval_every": 10**9, "eval.export": "logits"}
  if method == "aper":  # the whole ViT adapted until the first true task end
    settings.update({"simplecil.first_phase": "all", "boundaries.rule": "oracle"})
  if method == "slca":  # their tasks: boundaries at the true task ends, alignment after each
    settings.update({"boundaries.rule": "oracle", "slca.alignment": "after_boundary"})
  return settings


# ------------------------------------------------------------------------------------------------
# prepare (this project's venv)


def first_phase_rate(config) -> float:
  """Our first phase's learning rate at this run's batch (`simplecil.first_phase_learning_rate`,
  constant with first_phase_cosine_steps 0): their init_lr."""
  from olora_jax.methods import simplecil

  assert config.simplecil.first_phase_cosine_steps == 0
  return float(simplecil.first_phase_learning_rate(config.simplecil, config.learner.batch_size))


def prepare(args) -> None:
  import jax

  from olora_jax import pretrained, trainer

  settings = overrides(args.method)
  setup = trainer.Setup(aml.demo_config(settings))
  c = setup.config
  os.makedirs(args.out, exist_ok=True)
  manifest = aml.cut_manifest(setup.manifest, STEPS_PER_TASK)
  order = [k for classes in manifest["task_classes"] for k in classes]
  if order != list(range(setup.num_classes)):  # their learners take task t's classes as the
    raise SystemExit("the parity stream needs its classes in label order")  # next indices
  with open(os.path.join(args.out, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  aml.write_inputs(setup, manifest, os.path.join(args.out, "inputs.npz"))
  state = jax.device_get(trainer.run_initial_state(setup, np.uint32(SEED),
                                                   trainer.load_params(setup, c)))
  backbone = {"aper": "pretrained", "slca": "params"}.get(args.method, "frozen")
  backbone = state[backbone]  # the pretrained ViT: SLCA's params start from it
  weights = pretrained._ours_to_timm({k: v for k, v in backbone.items() if k != "head"})
  their = {"method": args.method, "num_classes": setup.num_classes,
           "model": {k: c.model[k] for k in ("image_size", "patch_size", "width", "depth",
                                              "num_heads", "mlp_dim")}}
  if args.method == "aper":
    head = state["params"]["head"]
    first = manifest["task_classes"][0]
    weights[f"{HEAD}.weight"] = np.ascontiguousarray(head["kernel"].T[first], np.float32)
    weights[f"{HEAD}.sigma"] = np.asarray(head["sigma"], np.float32).reshape(1)
    their.update(init_lr=first_phase_rate(c), weight_decay=c.simplecil.weight_decay)
  if args.method == "slca":  # our initial head: their per-task Linear heads' rows and biases
    weights[f"{HEAD}.weight"] = np.ascontiguousarray(state["params"]["head"]["kernel"].T)
    weights[f"{HEAD}.bias"] = np.asarray(state["params"]["head"]["bias"])
    b = c.slca
    their.update(lrate=b.learning_rate * c.learner.batch_size / b.lr_reference_batch,
                 bcb_lrscale=b.backbone_lr_scale, weight_decay=b.weight_decay,
                 ca_epochs=b.alignment_epochs, ca_with_logit_norm=b.logit_norm_temperature)
    # Their alignment runs at their one rate `lrate` (ours has a key of its own, unscaled).
    settings["slca.alignment_learning_rate"] = their["lrate"]
  np.savez(os.path.join(args.out, "weights.npz"), **weights)
  with open(os.path.join(args.out, "overrides.json"), "w") as f:
    json.dump({"overrides": settings, "theirs": their}, f)
  print(f"prepared {args.method}: {len(manifest['steps'])} steps, {len(weights)} tensors ->"
        f" {args.out}")


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


class StreamSet:
  """What their DataManager.get_dataset returns, over our records: `labels`, and `batches` (row
  lists) in the order `StreamLoader` yields them."""

  def __init__(self, data: dict, split: str, rows: list[list[int]]):
    self.x, self.y = data[f"{split}_x"], data[f"{split}_y"].astype(np.int64)
    self.batches = [b for b in rows if b]
    self.labels = self.y[[r for b in self.batches for r in b]]

  def __len__(self):
    return len(self.labels)


class StreamData:
  """Their DataManager's two methods their learners call, on the prepared stream: the training
  records of the classes asked for, in the stream's batches; the test records in the manifest's
  order, EVAL_BATCH at a time."""

  dataset_name = "stream"  # SLCA's learner reads it

  def __init__(self, manifest: dict, data: dict):
    self.manifest, self.data = manifest, data
    self.train_row = {int(r): i for i, r in enumerate(data["train_ids"])}

  def get_task_size(self, task: int) -> int:
    return len(self.manifest["task_classes"][task])

  def get_dataset(self, indices, source: str, mode: str, appendent=None, ret_data=False):
    keep = {int(k) for k in indices}
    if source == "train":  # mode 'train' would add their dataset's augmentation: none here
      rows = [[self.train_row[i] for i in step if int(self.data["train_y"][self.train_row[i]])
               in keep] for step in self.manifest["steps"]]
    else:
      rows = [i for i, y in enumerate(self.data["test_y"]) if int(y) in keep]
      rows = [rows[i:i + EVAL_BATCH] for i in range(0, len(rows), EVAL_BATCH)]
    dataset = StreamSet(self.data, source, rows)
    if ret_data:  # SLCA's class statistics: (images, labels, dataset)
      return dataset.x[[r for b in dataset.batches for r in b]], dataset.labels, dataset
    return dataset


def stream_loader(torch):
  """Their modules' DataLoader: (dataset, batch_size=, shuffle=, num_workers=) -> the dataset's
  batches in order, each (rows, images NCHW, labels) as their loops unpack it."""

  class StreamLoader:
    def __init__(self, dataset, batch_size=None, shuffle=False, num_workers=0, **kwargs):
      self.dataset = dataset

    def __len__(self):
      return len(self.dataset.batches)

    def __iter__(self):
      for rows in self.dataset.batches:
        x = np.ascontiguousarray(self.dataset.x[rows].transpose(0, 3, 1, 2))
        yield (torch.tensor(rows), torch.from_numpy(x), torch.from_numpy(self.dataset.y[rows]))

  return StreamLoader


def their_vit(model: dict, weights: dict):
  """A timm VisionTransformer of the demo's sizes without a head, loaded strict."""
  import online_lora
  import torch

  vit = online_lora._vit({f"model.{k}": v for k, v in model.items()} | {"num_classes": 0})
  vit.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()
                       if not k.startswith(("head.", HEAD))}, strict=True)
  vit.out_dim = model["width"]
  return vit.eval()


def run_theirs(method: str, manifest: dict, data: dict, weights: dict, their: dict) -> dict:
  """Their trainer.py's loop over the tasks (module docstring) from `weights`: the recording."""
  import random

  import torch
  import utils.inc_net as inc_net  # their package, from the checkout

  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  random.seed(SEED)
  np.random.seed(SEED)
  torch.manual_seed(SEED)
  module = __import__(f"models.{THEIR_MODULE[method]}", fromlist=["Learner"])
  inc_net.get_backbone = lambda args, pretrained=False: their_vit(their["model"], weights)
  module.DataLoader = stream_loader(torch)
  n_tasks = len(manifest["task_classes"])
  args = {"model_name": THEIR_MODULE[method], "backbone_type": "vit_demo", "device": ["cpu"],
          "memory_size": 0, "memory_per_class": 0, "fixed_memory": False,
          "init_cls": len(manifest["task_classes"][0]),
          "increment": len(manifest["task_classes"][-1]), "seed": SEED}
  losses = {"train": [], "alignment": []}
  phase = ["train"]
  batch = manifest["params"]["batch_size"]
  if method == "aper":
    args.update(init_lr=their["init_lr"], weight_decay=their["weight_decay"], min_lr=0.0,
                optimizer="sgd", tuned_epoch=1, batch_size=batch)
  if method == "slca":  # one epoch a task (their milestone, 18, is never reached)
    args.update(batch_size=batch, epochs=1, milestones=[18], lrate_decay=0.1,
                **{k: their[k] for k in ("lrate", "bcb_lrscale", "weight_decay", "ca_epochs",
                                         "ca_with_logit_norm")})

  class RecordingF:  # their module's `F`, with cross_entropy's value recorded
    def __getattr__(self, name):
      return getattr(torch.nn.functional, name)

    def cross_entropy(self, *a, **k):
      loss = torch.nn.functional.cross_entropy(*a, **k)
      losses[phase[0]].append(loss.item())
      return loss

  module.F = RecordingF()
  learner = module.Learner(args)
  learner.topk = 1  # their 5 exceeds the 2 classes of the first task; top-1 is what is recorded
  update_fc = learner._network.update_fc

  def update_fc_with_ours(nb_classes, *a, **k):
    """Their update_fc, then our initial head in the rows it made (their draw would differ)."""
    update_fc(nb_classes, *a, **k)
    fc = learner._network.fc
    if method == "aper" and learner._cur_task == 0:  # their fresh CosineLinear
      fc.weight.data.copy_(torch.from_numpy(weights[f"{HEAD}.weight"]))
      fc.sigma.data.copy_(torch.from_numpy(weights[f"{HEAD}.sigma"]))
    if method == "slca":  # their new Linear head of the task's classes
      classes = manifest["task_classes"][learner._cur_task]
      fc.heads[-1][-1].weight.data.copy_(torch.from_numpy(weights[f"{HEAD}.weight"][classes]))
      fc.heads[-1][-1].bias.data.copy_(torch.from_numpy(weights[f"{HEAD}.bias"][classes]))

  learner._network.update_fc = update_fc_with_ours
  if method == "slca":  # their classifier alignment's losses apart from the slow learner's
    align = learner._stage2_compact_classifier

    def align_recorded(*a):
      phase[0] = "alignment"
      align(*a)
      phase[0] = "train"

    learner._stage2_compact_classifier = align_recorded
  stream = StreamData(manifest, data)
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  out = {"prototypes": [], "sigma": [], "logits": [], "their_top1": []}
  for task in range(n_tasks):
    learner.incremental_train(stream)
    if method == "aper" and task == 0:
      out["adapted"] = learner._network.backbones[1].state_dict()
    cnn_accy, _ = learner.eval_task()
    network = learner._network
    network.eval()
    with torch.no_grad():
      logits = torch.cat([network(test_x[i:i + EVAL_BATCH])["logits"]
                          for i in range(0, len(test_x), EVAL_BATCH)]).numpy()
    pad = np.full((len(test_x), their["num_classes"] - logits.shape[1]), np.nan, np.float32)
    out["logits"].append(np.concatenate([logits, pad], axis=1))
    if method != "slca":
      rows = network.fc.weight.detach().numpy()
      out["prototypes"].append(np.concatenate(
          [rows, np.full((their["num_classes"] - len(rows), rows.shape[1]), np.nan,
                         np.float32)]))
      out["sigma"].append(float(network.fc.sigma.item()))
    out["their_top1"].append(float(cnn_accy["top1"]))
    learner.after_task()
  out["loss"] = np.array(losses["train"], np.float32)
  out["alignment_loss"] = np.array(losses["alignment"], np.float32)
  return out


def as_numpy(state: dict) -> dict:
  return {k: v.detach().numpy() for k, v in state.items()}


def update_fingerprint(final: dict, initial: dict) -> np.ndarray:
  """Per tensor of a timm state_dict, in sorted key order, the first phase's update
  u = final - initial as (||u||, <u, g>) with g a fixed N(0, 1) tensor (seeded by the key's
  rank): (K, 2) float64. Two runs whose updates differ in size or direction differ here, without
  a copy of the weights in the recording."""
  out = []
  for i, key in enumerate(sorted(final)):
    u = np.asarray(final[key], np.float64) - np.asarray(initial[key], np.float64)
    g = np.random.default_rng(i).standard_normal(u.shape)
    out.append((np.linalg.norm(u), float((u * g).sum())))
  return np.array(out)


def record(args) -> None:
  """Runs their learner on the prepared stream from the prepared weights, and
  aml.OWN_DRIFT_RUNS times from them perturbed at float32 rounding, and writes the recording."""
  import online_lora

  shim = online_lora._torchvision_or_stand_in()
  import timm
  import torch

  sys.path.insert(0, os.path.abspath(args.pilot))
  with open(os.path.join(args.prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.prepared, "overrides.json")) as f:
    prepared = json.load(f)
  their, method = prepared["theirs"], prepared["theirs"]["method"]
  data = dict(np.load(os.path.join(args.prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(args.prepared, "weights.npz")))
  run = run_theirs(method, manifest, data, weights, their)
  starts = [aml.perturbed(weights, seed) for seed in range(1, aml.OWN_DRIFT_RUNS + 1)]
  own = [run_theirs(method, manifest, data, start, their) for start in starts]
  logits = np.stack(run["logits"]).astype(np.float32)
  extra = {}
  if method != "simplecil":
    extra = {"loss": run["loss"], "own_loss": np.stack([o["loss"] for o in own])}
  if method == "aper":
    extra |= {"adapted_keys": np.array(sorted(run["adapted"])),
             "adapted_update": update_fingerprint(as_numpy(run["adapted"]), weights),
             "own_adapted_update": np.stack([update_fingerprint(as_numpy(o["adapted"]), start)
                                             for o, start in zip(own, starts, strict=True)])}
  if method == "slca":
    extra |= {"alignment_loss": run["alignment_loss"]}
  else:
    prototypes = np.stack(run["prototypes"]).astype(np.float32)
    with np.errstate(invalid="ignore"):
      own_proto = np.stack([np.nanmax(np.abs(np.stack(o["prototypes"]) - prototypes),
                                      axis=(1, 2)) for o in own])
    extra |= {"prototypes": prototypes, "sigma": np.array(run["sigma"], np.float32),
              "own_prototype_drift": own_proto}
  with np.errstate(invalid="ignore"):
    own_logit = np.stack([np.nanmax(np.abs(np.stack(o["logits"]) - logits), axis=(1, 2))
                          for o in own])
  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), overrides=json.dumps(prepared["overrides"]),
      theirs=json.dumps(their), task_end_logits=logits, their_top1=np.array(run["their_top1"]),
      own_task_end_predictions=np.stack([np.nan_to_num(np.stack(o["logits"]), nan=-np.inf)
                                         .argmax(-1) for o in own]).astype(np.int8),
      own_logit_drift=own_logit,
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      perturbation=np.float64(aml.PERTURBATION), **extra,
      versions=json.dumps({"torch": torch.__version__, "timm": timm.__version__,
                           "numpy": np.__version__, "python": sys.version.split()[0],
                           "torchvision": shim}))
  print(f"recorded {method}: their top-1 at the task ends {run['their_top1']}, own drift of the"
        f" logits {own_logit.max(0)} -> {args.out}")


def main(argv=None) -> None:
  parser, _, p, _ = aml.driver_parser(__doc__, "pilot", "LAMDA-CL/LAMDA-PILOT",
                                      "tests/fixtures/parity/pilot_simplecil.npz")
  p.add_argument("--method", choices=METHODS, required=True)
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})

if __name__ == "__main__":
  main()
