"""CODA-Prompt and DualPrompt against GT-RIPL/CODA-Prompt (the CODA-Prompt authors' code, which
holds their DualPrompt too): record what their learner does on a stream this project writes
(docs/parity.md).

Two steps, in two environments, per method (`--method coda_prompt|dualprompt`):

    # 1. in this project's venv: the stream, its inputs and our initial state in their layout
    .venv/bin/python scripts/parity/coda_prompt.py prepare --method coda_prompt --out /tmp/coda-prep
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/coda-venv &&
    #    /tmp/coda-venv/bin/pip install torch==2.13.0 numpy pillow pyyaml &&
    #    /tmp/coda-venv/bin/pip install --no-deps timm==0.4.12), on a checkout of their code
    #    (git clone https://github.com/GT-RIPL/CODA-Prompt /tmp/CODA-Prompt):
    /tmp/coda-venv/bin/python scripts/parity/coda_prompt.py record --coda /tmp/CODA-Prompt \\
        --prepared /tmp/coda-prep --out tests/fixtures/parity/coda_prompt.npz
    # (dualprompt: --out tests/fixtures/parity/coda_prompt_dualprompt.npz)

`prepare` builds the parity run's config (configs/demo.py with `overrides(method)`) and the
authors' settings: Adam at 1e-3, no weight decay, a new prompt block and a new optimiser at each
task boundary (`boundaries.rule=oracle`), the cross-entropy over the current task's classes
(`train_mask=task`). CODA-Prompt: the demo's pretrained 64-wide, 2-block ViT on MNIST digits at
32 px, its pool of 60 components in 5 blocks of 12 on blocks 0 and 1, prompts of 8 tokens, no
orthogonality loss. DualPrompt: their code puts G-prompts on blocks 0-1 and E-prompts on 2-4, so
a 3-block ViT of the demo's sizes from our seed (random: no pretrained backbone has 3 blocks),
their `--prompt_param 10 20 6` (10 E-prompts of 10 key and 10 value tokens, G-prompts of 3 and
3), top 1, the key loss summed over the batch (our mean times the batch), no clipping, no copy of
the previous task's E-prompts. It cuts the seeded stream to its first `STEPS_PER_TASK` steps of
each task and writes `manifest.json`, `inputs.npz` (aml.write_inputs), `weights.npz` (our run's
initial state, the same seed, as the state_dict of their `ViTZoo`: the backbone under `feat.`
in timm's layout, the head as `last`, the prompts under `prompt.`: `their_pool`, `their_dual`),
`key.npy` (the run's random key: our new CODA-Prompt blocks' draws) and `run.json` (the
overrides and the sizes their model is built at).

`record` imports their `models` and `learners` from the checkout, unchanged, and runs what their
trainer.py runs for `--learner_name CODAPrompt` (or `DualPrompt`), task by task: the model's
`task_id`, their `add_valid_output_dim`, from the second task on their `process_task_count` (a
new CODA-Prompt block; DualPrompt's counts the task), then
their `learn_batch` (a new Adam; their `update_model` on each batch: logits sliced to the classes
so far, the earlier tasks' set to -inf, CE + prompt loss, one step) on the stream's batches in
the manifest's order, one epoch; at each task end their model's logits on every test sample in
eval mode. Their settings: CODA-Prompt's `--prompt_param 60 8 0.0` (the demo's pool; their
e_layers 0-4, of which the 2-block ViT has blocks 0 and 1), DualPrompt's `10 20 6`; Adam (betas
0.9, 0.999) at lr 1e-3, weight_decay 0, `memory 0`, one epoch a task. Their cosine schedule
lowers the rate only from the second epoch (its first epoch runs at the base rate; with one
epoch, K - 1 = 0 divides by zero when it is built), so the run states `schedule_type: decay`
with `schedule: [1]` (no step within the epoch): the constant rate their cosine gives the first
epoch, which ours takes throughout.

What is replaced, outside their code:
- the model's construction: their `ViTZoo.__init__` hard-codes ViT-B/16 at 224 px, downloads
  timm's pretrained weights and builds the prompt module at width 768. `vit_pt_imnet` (the
  factory their learner calls by name) is replaced by one that builds the same `ViTZoo` object
  from their classes at the demo's sizes: their `VisionTransformer(img_size=32, patch_size=4,
  embed_dim=64, depth=2, num_heads=4)` (the arguments `ViTZoo` passes otherwise), their
  `CodaPrompt(64, n_tasks, prompt_param, key_dim=64)` (or `DualPrompt(...)`) and `last =
  nn.Linear(64, classes)`; every forward pass is theirs;
- a new CODA-Prompt block's components: at each boundary their `process_task_count` draws new
  components (Gram-Schmidt on `torch.randn`); the driver then sets those rows to what our
  `at_boundary` makes from the same pool (`coda_prompt.init_block` on their current components,
  with our run's key for that step: `grow`, run by this project's Python as a subprocess), as
  their initial weights are ours;
- CUDA: their code calls `.cuda()` on the prompt-loss accumulator, the ortho penalty's identity
  and the class weights. On this CPU `torch.Tensor.cuda` returns a copy on the CPU (a copy, as
  `.cuda()` makes one, so the accumulator stays a non-leaf their in-place sum needs);
- torchvision, which timm and their modules import but the run never uses: online_lora.py's
  stand-in where no torchvision loads beside the CPU torch.

It records per step the loss (`update_model`'s: CE + prompt loss), the CE and the prompt loss
apart, and the classes their CE runs over; at each task end every test sample's logits (all
classes) and the head, and the prompts at the last; and the same from three runs of their
code from the weights perturbed at float32 rounding (aml.perturbed): their own drift, the scale
of the tolerances. Seeds fixed, `torch.use_deterministic_algorithms(True)`, one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import aml  # noqa: E402 (the ER/ER-ACE driver: stream cut, inputs, perturbed starts)

SEED = 0  # the stream's, our initial state's and their run's seeds
STEPS_PER_TASK = 8  # the parity stream: the first 8 batches of 16 of each of the 5 tasks
OWN_DRIFT_RUNS = 3  # their runs from perturbed weights (aml.perturbed), each its own draw
ENTRIES = {"keys": "e_k", "attention": "e_a", "prompts": "e_p"}  # our pool's names -> theirs
METHODS = ("coda_prompt", "dualprompt")
LEARNERS = {"coda_prompt": "CODAPrompt", "dualprompt": "DualPrompt"}  # their --learner_name
BATCH = 16  # the demo's learner.batch_size: every batch of the cut stream is full


def overrides(method: str = "coda_prompt") -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  common = {
      "method": method, "seed": SEED, "data.test_fraction": 0.05,
      "boundaries.rule": "oracle",  # their trainer: a new prompt and optimiser at each task
      "eval.eval_every": 10**9, "eval.export": "logits",
      f"{method}.train_mask": "task", f"{method}.learning_rate": 1e-3,
      f"{method}.weight_decay": 0.0, f"{method}.reset_optimizer": True}
  if method == "coda_prompt":
    return {**common, "coda_prompt.ortho_weight": 0.0}
  # DualPrompt: their G-prompts on blocks 0-1 and E-prompts on 2-4 need a third block, so a
  # 3-block ViT from our seed (no pretrained backbone has 3 blocks); their --prompt_param 10 20 6
  # (10 E-prompts of 20 tokens and G-prompts of 6, half key and half value: our lengths 10 and 3)
  return {**common, "model.depth": 3, "pretrained.path": "",
          "dualprompt.g_layers": (0, 1), "dualprompt.e_layers": (2,),
          "dualprompt.g_prompt_length": 3, "dualprompt.prompt_length": 10,
          "dualprompt.pool_size": 10, "dualprompt.top_k": 1,
          "dualprompt.lr_reference_batch": 0,  # their rate as it is
          "dualprompt.clip_norm": 0.0,  # no clipping
          "dualprompt.key_loss_weight": float(BATCH),  # their (1 - cos) summed over the batch
          "dualprompt.init_from_previous": False}  # each task's E-prompt from its own init


def command_line(settings: dict) -> list[str]:
  """`settings` as launch/run.py's --config.KEY=VALUE arguments (a layer list, a list once
  through JSON, as the tuple the config holds)."""
  return aml.command_line({k: tuple(v) if isinstance(v, list) else v
                           for k, v in settings.items()})


def their_dual(pool: dict, g_layers, e_layers) -> dict[str, np.ndarray]:
  """Our DualPrompt pool {"g_prompts" (|g|, 2, Lg, D), "e_prompts" (M, |e|, 2, Le, D), "keys"
  (M, D)} as their `prompt.g_p_l` (2 Lg, D), `prompt.e_p_l` (M, 2 Le, D) (the key half first)
  and `prompt.e_k_l` (M, D) (one key set per E-block; ours is shared by the E-blocks)."""
  g, e = np.asarray(pool["g_prompts"]), np.asarray(pool["e_prompts"])
  out = {f"prompt.g_p_{layer}": g[j].reshape(-1, g.shape[-1]) for j, layer in enumerate(g_layers)}
  for j, layer in enumerate(e_layers):
    out[f"prompt.e_p_{layer}"] = e[:, j].reshape(e.shape[0], -1, e.shape[-1])
    out[f"prompt.e_k_{layer}"] = np.asarray(pool["keys"])
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def our_dual(state_dict: dict, g_layers, e_layers) -> dict[str, np.ndarray]:
  """`their_dual`'s inverse (the keys of the first E-block)."""
  g = np.stack([np.asarray(state_dict[f"prompt.g_p_{layer}"]) for layer in g_layers])
  e = np.stack([np.asarray(state_dict[f"prompt.e_p_{layer}"]) for layer in e_layers], axis=1)
  return {"g_prompts": g.reshape(g.shape[0], 2, -1, g.shape[-1]),
          "e_prompts": e.reshape(e.shape[0], e.shape[1], 2, -1, e.shape[-1]),
          "keys": np.asarray(state_dict[f"prompt.e_k_{e_layers[0]}"])}


def their_pool(pool: dict, layers) -> dict[str, np.ndarray]:
  """Our pool {"keys" (M, L, D), "attention" (M, L, D), "prompts" (M, L, Lp, D)} as their
  `prompt.e_k_l` (M, D), `prompt.e_a_l` (M, D), `prompt.e_p_l` (M, Lp, D), l each prompted block."""
  return {f"prompt.{theirs}_{layer}": np.ascontiguousarray(np.asarray(pool[ours])[:, j])
          for ours, theirs in ENTRIES.items() for j, layer in enumerate(layers)}


def our_pool(state_dict: dict, layers) -> dict[str, np.ndarray]:
  """`their_pool`'s inverse."""
  return {ours: np.stack([np.asarray(state_dict[f"prompt.{theirs}_{layer}"]) for layer in layers],
                         axis=1) for ours, theirs in ENTRIES.items()}


# ------------------------------------------------------------------------------------------------
# prepare and grow (this project's venv)


def _setup(method: str):
  from configs import demo
  from olora_jax import trainer

  settings = overrides(method)
  config = demo.get_config()
  for key, value in settings.items():
    section, _, leaf = key.rpartition(".")
    setattr(config[section] if section else config, leaf, value)
  return settings, trainer.Setup(config)


def prepare(args) -> None:
  import jax

  from olora_jax import pretrained, trainer

  settings, setup = _setup(args.method)
  config, block = setup.config, setup.config[args.method]
  os.makedirs(args.out, exist_ok=True)
  manifest = aml.cut_manifest(setup.manifest, STEPS_PER_TASK)
  with open(os.path.join(args.out, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  aml.write_inputs(setup, manifest, os.path.join(args.out, "inputs.npz"))
  state = jax.device_get(trainer.run_initial_state(setup, np.uint32(SEED),
                                                   trainer.load_params(setup, config)))
  weights = {f"feat.{k}": v for k, v in pretrained._ours_to_timm(state["frozen"]).items()}
  weights["last.weight"] = np.ascontiguousarray(state["params"]["head"]["kernel"].T)
  weights["last.bias"] = np.asarray(state["params"]["head"]["bias"])
  pool = state["params"]["prompt_pool"]
  if args.method == "coda_prompt":
    weights.update(their_pool(pool, block.layers))
    prompt = {"layers": list(block.layers), "pool_size": block.pool_size,
              "prompt_length": block.prompt_length, "ortho_weight": block.ortho_weight}
  else:
    weights.update(their_dual(pool, block.g_layers, block.e_layers))
    prompt = {"g_layers": list(block.g_layers), "e_layers": list(block.e_layers),
              "pool_size": block.pool_size, "prompt_length": block.prompt_length,
              "g_prompt_length": block.g_prompt_length}
  np.savez(os.path.join(args.out, "weights.npz"), **weights)
  np.save(os.path.join(args.out, "key.npy"), np.asarray(jax.random.key_data(state["key"])))
  spec = setup.spec
  run = {"method": args.method, "overrides": settings, **prompt,
         "learning_rate": block.learning_rate, "weight_decay": block.weight_decay,
         "n_tasks": config.data.n_tasks, "num_classes": setup.num_classes,
         "image_size": spec.image_size, "patch_size": spec.patch_size, "width": spec.width,
         "depth": spec.depth, "num_heads": spec.num_heads, "mlp_dim": spec.mlp_dim}
  with open(os.path.join(args.out, "run.json"), "w") as f:
    json.dump(run, f)
  print(f"prepared {args.method}: {len(manifest['steps'])} steps, {len(manifest['test']['ids'])}"
        f" test records, {len(weights)} tensors -> {args.out}")


def grow(args) -> None:
  """Our `at_boundary`'s new block, made from their pool: `coda_prompt.init_block` on the pool in
  `--pool` (their layout) with the key our run uses at stream step `--step`, written to `--out`
  (their layout)."""
  import jax

  from olora_jax.methods import coda_prompt

  with open(os.path.join(args.prepared, "run.json")) as f:
    run = json.load(f)
  layers = run["layers"]
  pool = {k: jax.numpy.asarray(v) for k, v in our_pool(dict(np.load(args.pool)), layers).items()}
  key = jax.random.wrap_key_data(np.load(os.path.join(args.prepared, "key.npy")))
  key = jax.random.fold_in(jax.random.fold_in(key, args.step), coda_prompt.BOUNDARY_SALT)
  size = coda_prompt.block_size(run["pool_size"], run["n_tasks"])
  made = jax.jit(coda_prompt.init_block, static_argnums=3)(pool, key, args.start, size)
  np.savez(args.out, **their_pool(jax.device_get(made), layers))


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


def record(args) -> None:
  """Runs their learner on the prepared stream from the prepared weights, and OWN_DRIFT_RUNS
  times from them perturbed at float32 rounding, and writes the recording."""
  import torch
  from online_lora import _torchvision_or_stand_in

  torchvision = _torchvision_or_stand_in()
  sys.path.insert(0, os.path.abspath(args.coda))
  with open(os.path.join(args.prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.prepared, "run.json")) as f:
    run = json.load(f)
  data = dict(np.load(os.path.join(args.prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(args.prepared, "weights.npz")))
  log, ends = run_theirs(args, manifest, run, data, weights)
  own = [run_theirs(args, manifest, run, data, aml.perturbed(weights, seed))
         for seed in range(1, OWN_DRIFT_RUNS + 1)]
  logits = np.stack([e["logits"] for e in ends])
  rel = (lambda a, b: np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
  steps = manifest["steps"]
  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), overrides=json.dumps(run["overrides"]),
      run=json.dumps(run), loss=np.array([s["loss"] for s in log], np.float32),
      ce=np.array([s["ce"] for s in log], np.float32),
      prompt_loss=np.array([s["prompt_loss"] for s in log], np.float32),
      ce_classes=np.array([s["ce_classes"] for s in log], np.int64),
      task_end_logits=logits,
      # the head at every task end; the components at the last (each block is frozen after its
      # task, so the last task end holds every block as its task left it)
      task_end_head_kernel=np.stack([e["params"]["head_kernel"] for e in ends]),
      task_end_head_bias=np.stack([e["params"]["head_bias"] for e in ends]),
      **{f"final_{k}": v for k, v in ends[-1]["params"].items() if not k.startswith("head")},
      own_loss=np.array([[s["loss"] for s in own_log] for own_log, _ in own], np.float32),
      own_task_end_predictions=np.stack(
          [np.stack([e["logits"] for e in own_ends]).argmax(-1) for _, own_ends in own]
      ).astype(np.int8),
      own_logit_drift=np.array([[np.abs(e["logits"] - z).max()
                                 for e, z in zip(own_ends, logits, strict=True)]
                                for _, own_ends in own]),
      own_param_drift=np.array([[max(rel(e["params"][k], ref["params"][k]) for k in e["params"])
                                 for e, ref in zip(own_ends, ends, strict=True)]
                                for _, own_ends in own]),
      test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
      task_end_steps=np.array([t for t in range(len(steps)) if t + 1 == len(steps)
                               or manifest["step_task"][t + 1] != manifest["step_task"][t]]),
      perturbation=np.float64(aml.PERTURBATION), coda_commit=_commit(args.coda),
      versions=json.dumps({"torch": torch.__version__, "numpy": np.__version__,
                           "python": sys.version.split()[0], "torchvision": torchvision}))
  accuracy = [(z[:, :2 * (j + 1)].argmax(1) == data["test_y"]).mean().round(4)
              for j, z in enumerate(logits)]
  print(f"recorded {run['method']}: {len(log)} steps, final loss {log[-1]['loss']:.6f}, task-end"
        f" accuracies (all test samples) {accuracy} -> {args.out}")


def _prompt_param(run: dict) -> list:
  """Their --prompt_param: CODA-Prompt's (pool, length, ortho weight); DualPrompt's (pool, E
  length, G length), each length both halves (key and value)."""
  if run["method"] == "coda_prompt":
    return [run["pool_size"], run["prompt_length"], run["ortho_weight"]]
  return [run["pool_size"], 2 * run["prompt_length"], 2 * run["g_prompt_length"]]


def _commit(checkout: str) -> str:
  done = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True,
                        text=True)
  return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"


def _cpu_cuda(torch):
  """`Tensor.cuda` on a CPU-only torch: a copy on the CPU (module docstring)."""
  torch.Tensor.cuda = lambda self, *args, **kwargs: self.clone()


def _their_model(torch, run: dict):
  """The factory their learner calls (`models.zoo.vit_pt_imnet`), building their ViTZoo at the
  demo's sizes from their classes (module docstring)."""
  from models import vit, zoo

  def factory(out_dim, block_division=None, prompt_flag="None", prompt_param=None):
    if prompt_flag not in ("coda", "dual"):
      raise SystemExit(f"this driver builds CODA-Prompt's and DualPrompt's models, not"
                       f" {prompt_flag!r}")
    model = zoo.ViTZoo.__new__(zoo.ViTZoo)
    torch.nn.Module.__init__(model)
    model.prompt_flag, model.task_id = prompt_flag, None
    model.feat = vit.VisionTransformer(
        img_size=run["image_size"], patch_size=run["patch_size"], embed_dim=run["width"],
        depth=run["depth"], num_heads=run["num_heads"], mlp_ratio=run["mlp_dim"] / run["width"],
        ckpt_layer=0, drop_path_rate=0)
    model.last = torch.nn.Linear(run["width"], out_dim)
    # ViTZoo passes (768, prompt_param[0] = the number of tasks, prompt_param[1])
    module = zoo.CodaPrompt if prompt_flag == "coda" else zoo.DualPrompt
    model.prompt = module(run["width"], prompt_param[0], prompt_param[1], key_dim=run["width"])
    return model

  return factory


def run_theirs(args, manifest: dict, run: dict, data: dict, weights: dict):
  """Their trainer's task loop (module docstring) from `weights`: (per-step log, per task end
  {"logits" (N, C), "params" {name: array}})."""

  import torch

  _cpu_cuda(torch)
  import learners
  import models

  aml.deterministic_torch(torch, SEED)
  models.zoo.vit_pt_imnet = _their_model(torch, run)
  task_classes = manifest["task_classes"]
  if [c for cls in task_classes for c in cls] != list(range(run["num_classes"])):
    raise SystemExit("their code numbers the classes task by task (0.., then the next task's);"
                     f" this stream's task classes {task_classes} would need a relabelling")
  n_tasks = len(task_classes)
  # What their trainer.py puts in the learner's config, with this run's settings.
  config = {
      "num_classes": run["num_classes"], "lr": run["learning_rate"], "debug_mode": False,
      "momentum": 0.9, "weight_decay": run["weight_decay"], "schedule": [1],
      "schedule_type": "decay", "model_type": "zoo", "model_name": "vit_pt_imnet",
      "optimizer": "Adam", "gpuid": [-1], "memory": 0, "temp": 2.0,
      "out_dim": run["num_classes"], "overwrite": True, "DW": False,
      "batch_size": len(manifest["steps"][0]), "upper_bound_flag": False,
      "tasks": task_classes, "top_k": 1,
      "prompt_param": [n_tasks, _prompt_param(run)]}
  with _quiet():
    learner = getattr(learners.prompt, LEARNERS[run["method"]])(config)
  model = learner.model
  tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  # their prompted blocks past the ViT's last: never read
  if unexpected or any(not k.startswith("prompt.") or int(k.rsplit("_", 1)[1]) < run["depth"]
                       for k in missing):
    raise SystemExit(f"weights do not fit their model: missing {missing}, unexpected {unexpected}")

  step_log: dict = {}
  orig_criterion, orig_forward = learner.criterion, model.forward

  def criterion(logits, targets, data_weights):
    loss = orig_criterion(logits, targets, data_weights)
    step_log["ce"] = loss.item()
    step_log["ce_classes"] = torch.isfinite(logits[0]).nonzero().view(-1).tolist()
    return loss

  def forward(x, pen=False, train=False):
    out = orig_forward(x, pen=pen, train=train)
    if train:
      step_log["prompt_loss"] = out[1].sum().item()
    return out

  learner.criterion, model.forward = criterion, forward
  orig_update = learner.update_model

  def update_model(inputs, targets):
    loss, logits = orig_update(inputs, targets)
    step_log["loss"] = loss.item()
    log.append(dict(step_log))
    return loss, logits

  learner.update_model = update_model
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  layers, log, ends = run.get("layers"), [], []
  for task in range(n_tasks):
    model.task_id = task  # trainer.py's order
    with _quiet():
      learner.add_valid_output_dim(len(task_classes[task]))
    if task > 0:
      model.prompt.process_task_count()
    if task > 0 and run["method"] == "coda_prompt":
      start = manifest["step_task"].index(task)
      _set_new_block(args, torch, model, start, task * model.prompt.e_pool_size // n_tasks,
                     layers)
    batches = []
    for t, ids in enumerate(manifest["steps"]):
      if manifest["step_task"][t] == task:
        rows = [row[i] for i in ids]
        x = torch.from_numpy(np.ascontiguousarray(data["train_x"][rows].transpose(0, 3, 1, 2)))
        y = torch.from_numpy(data["train_y"][rows].astype(np.int64))
        batches.append((x, y, torch.full((len(ids),), task)))
    with _quiet():
      learner.learn_batch(batches, None, os.path.join(args.scratch, f"task-{task}/"))
    model.eval()
    with torch.no_grad():
      logits = torch.cat([model.forward(test_x[i:i + 128]) for i in range(0, len(test_x), 128)])
    state = model.state_dict()
    prompts = {k: v.numpy() for k, v in state.items() if k.startswith("prompt.")}
    params = {**(our_pool(prompts, layers) if run["method"] == "coda_prompt" else
                 our_dual(prompts, run["g_layers"], run["e_layers"])),
              "head_kernel": state["last.weight"].numpy().T.copy(),
              "head_bias": state["last.bias"].numpy().copy()}
    ends.append({"logits": logits.numpy().astype(np.float32), "params": params})
  return log, ends


def _set_new_block(args, torch, model, step: int, start: int, layers) -> None:
  """Rows [start, start + size) of every prompted block's components: ours (`grow`, run by this
  project's Python on their current pool, with our run's key at `step`)."""
  path = os.path.join(args.scratch, "pool.npz")
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()
           if k.startswith("prompt.")}
  np.savez(path, **state)
  out = os.path.join(args.scratch, "grown.npz")
  subprocess.run([args.ours, os.path.abspath(__file__), "grow", "--prepared", args.prepared,
                  "--pool", path, "--step", str(step), "--start", str(start), "--out", out],
                 check=True, cwd=ROOT)
  made = dict(np.load(out))
  size = model.prompt.e_pool_size // model.prompt.n_tasks
  with torch.no_grad():
    for name, value in made.items():
      getattr(model.prompt, name.split(".", 1)[1])[start:start + size] = torch.from_numpy(
          value[start:start + size])


class _quiet:
  """Their learner prints as it goes: silenced."""

  def __enter__(self):
    import contextlib
    import io

    self._redirect = contextlib.redirect_stdout(io.StringIO())
    self._redirect.__enter__()

  def __exit__(self, *exc):
    self._redirect.__exit__(*exc)


def main(argv=None) -> None:
  parser, sub, p, r = aml.driver_parser(__doc__, "coda", "GT-RIPL/CODA-Prompt",
                                        "tests/fixtures/parity/coda_prompt.npz")
  p.add_argument("--method", choices=METHODS, default="coda_prompt")
  g = sub.add_parser("grow", help="in this project's venv: our new block from their pool")
  g.add_argument("--prepared", required=True)
  g.add_argument("--pool", required=True)
  g.add_argument("--step", type=int, required=True)
  g.add_argument("--start", type=int, required=True)
  g.add_argument("--out", required=True)
  r.add_argument("--ours", default=os.path.join(ROOT, ".venv", "bin", "python"),
                 help="this project's Python (for `grow`)")
  r.add_argument("--scratch", default="/tmp/coda-parity-scratch", help="a scratch folder")
  args = parser.parse_args(argv)
  if args.command == "record":
    os.makedirs(args.scratch, exist_ok=True)
  aml.run_command(args, {"prepare": prepare, "grow": grow, "record": record})

if __name__ == "__main__":
  main()
