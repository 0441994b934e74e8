"""A-GEM, MIR and EWC++ against the codebase the Online-LoRA paper took their numbers from
(RaptorMai/online-continual-learning; GDumb too, not checked yet): record what their agent does
on a stream this project writes (docs/parity.md).

Two steps, in two environments (the side venv is SCR's, scripts/parity/scr.py):

    # 1. in this project's venv: the stream, its inputs and our initial weights in their layout
    .venv/bin/python scripts/parity/ocl.py prepare --method agem --out /tmp/ocl-prep-agem
    # 2. in a side venv with PyTorch (python3.11 -m venv /tmp/scr-venv &&
    #    /tmp/scr-venv/bin/pip install torch==2.13.0 numpy kornia==0.4.1 pillow matplotlib
    #    scikit-image pandas psutil pyyaml), on a checkout of their code
    #    (git clone https://github.com/RaptorMai/online-continual-learning /tmp/ocl):
    /tmp/scr-venv/bin/python scripts/parity/ocl.py record --ocl /tmp/ocl \
        --prepared /tmp/ocl-prep-agem --commit "$(git -C /tmp/ocl rev-parse HEAD)" \
        --out tests/fixtures/parity/ocl_agem.npz

`prepare` builds the parity run's config (configs/demo.py with `overrides()`: the demo's MNIST
digits at 32 px in [0, 1] (their loader's ToTensor), the reduced ResNet-18 trained from scratch,
batch 10, and the method's settings as the Online-LoRA paper ran them: Adam at 1e-4 with L2
weight decay 1e-4 (their parser's --optimizer Adam --learning_rate 1e-4 --weight_decay 1e-4),
10 replayed (their --eps_mem_batch), a buffer of `MEM_SIZE`), cuts the seeded stream to its first
`aml.STEPS_PER_TASK` steps of each task and writes the prepared files (`aml.write_prepared`): the
manifest, the model inputs, our initial weights as their Reduced_ResNet18's state_dict (their
model.py's layout is AML's: `aml.their_state_dict`) and the overrides.

`record` imports their modules unchanged from the checkout (with SCR's shims,
`scr._compatibility_shims`) and builds what their general_main.py builds for `--agent AGEM` or
`--agent ER --retrieve MIR` (Reduced_ResNet18 for a 10-class CIFAR entry, their setup_opt, the
agent with the reservoir update), loads our initial weights strict and calls their
`train_learner` once per batch of the stream, in the manifest's order (as the SCR driver does:
their per-call loader then shuffles within the batch of 10 only; their task counter counts
calls, so A-GEM takes its reference gradient from the second batch on, as our task-free A-GEM
does once its buffer holds a sample; called once per task, their A-GEM takes none in the first
task). Wrapping the agent's methods and their module's `random_retrieve` (no line of their code
changes), it records per step: the losses (their `criterion`'s calls: the batch's, then the
memory's), the memory draw (A-GEM: the retrieved records; MIR: the `subsample` candidates drawn
and the `eps_mem_batch` of them retrieved, in their order), the buffer's records after the
update and each incoming item's slot (-1 if rejected), and for A-GEM whether the gradient was
projected and g . g_ref (recomputed by the driver on a copy of the model in the same state: the
reference gradient as theirs computes it); at each task end every test sample's logits (eval
mode). Records are named by their pixels (every training image of the stream is distinct).
Each recording also holds `aml.OWN_DRIFT_RUNS` runs of their code from our weights perturbed at
float32 rounding (`aml.perturbed`): their own drift, the tolerances' scale. Seeds fixed,
deterministic algorithms, one thread (`aml.deterministic_torch`).

EWC++ (`--agent EWC`, `run_theirs_ewc`): no buffer and no draws; `prepare` sets the settings
that take their steps (`boundaries.rule=oracle`, `ewc_pp.consolidate=boundary`,
`ewc_pp.fisher_of=loss`, `ewc_pp.fisher_window=task`) with their --lambda 100 and --alpha 0.9
and --fisher_update_after `FISHER_UPDATE_AFTER`. `record` calls their `train_learner` once per
task, as their general_main.py does (their anchor and normalised Fisher move at each call's
end); their loader shuffles the task's batches, and the recording's manifest holds the batches in
the order their run took them (asserted the same in the perturbed runs). Per step: the batch's
CE (their `criterion`) and the penalty (recomputed by the driver at their `total_loss`'s call
from their normalised Fisher and anchor; NaN before the first task end); at each task end the
test logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aml  # noqa: E402 (the AML driver: the stream's cut, the ResNet's layout, own drift)
import scr  # noqa: E402 (the SCR driver: the shims their modules need)

METHODS = ("agem", "mir", "ewc_pp")
AGENT = {"agem": ("AGEM", "random"), "mir": ("ER", "MIR"),  # their --agent, --retrieve
         "ewc_pp": ("EWC", "random")}
SEED = aml.SEED
BATCH = 10  # their --batch
EPS_MEM_BATCH = 10  # their --eps_mem_batch default (A-GEM's reference batch, MIR's retrieved)
MEM_SIZE = 100  # their --mem_size: the buffer fills at step 10 of 40, then 30 steps of reservoir
SUBSAMPLE = 50  # their --subsample default (MIR's candidates)
LEARNING_RATE = 1e-4  # the paper's (appendix); their --learning_rate (default 0.1, SGD)
WEIGHT_DECAY = 1e-4  # the paper's; their --weight_decay (default 0)
NUM_CLASSES = 10  # their 'cifar10' entry: Reduced_ResNet18(10), inputs (3, 32, 32), ToTensor
# EWC++: their --lambda and --alpha defaults (the paper's), and --fisher_update_after cut from
# their (and the paper's) 50 to 3 for the 8 batches a task: two updates a task, the windows
# crossing the task ends (3 does not divide 8).
EWC_LAMBDA = 100.0
EWC_ALPHA = 0.9
FISHER_UPDATE_AFTER = 3


def overrides(method: str, learning_rate: float = LEARNING_RATE) -> dict:
  """Our run's config over configs/demo.py: {dotted key: value}, as --config.KEY=VALUE would."""
  out = {
      "method": method, "seed": SEED, "model.name": "resnet18_reduced", "pretrained.path": "",
      "data.input_scale": "unit",  # their ToTensor: pixels / 255
      "data.test_fraction": 0.05, "learner.batch_size": BATCH,
      "eval.eval_every": 10**9, "eval.export": "logits",
      f"{method}.learning_rate": learning_rate, f"{method}.weight_decay": WEIGHT_DECAY,
      f"{method}.trainable": "all"}
  if method == "ewc_pp":  # their steps: consolidation at each call's end (a task), the Fisher
    # of the whole loss, its window counted within the call
    return {**out, "boundaries.rule": "oracle", "ewc_pp.consolidate": "boundary",
            "ewc_pp.fisher_of": "loss", "ewc_pp.fisher_window": "task",
            "ewc_pp.fisher_normalisation": "min_max", "ewc_pp.reg_lambda": EWC_LAMBDA,
            "ewc_pp.alpha": EWC_ALPHA, "ewc_pp.fisher_every": FISHER_UPDATE_AFTER}
  # Their passes: each its own BatchNorm statistics, each moving the running statistics.
  out.update({f"{method}.buffer_size": MEM_SIZE, f"{method}.replay_batch": EPS_MEM_BATCH,
              f"{method}.replay_pass": "separate"})
  if method == "mir":
    out["mir.n_candidates"] = SUBSAMPLE
  return out


def their_params(method: str, seed: int, learning_rate: float) -> argparse.Namespace:
  """What their general_main.py's parser gives the agent at these settings."""
  agent, retrieve = AGENT[method]
  return argparse.Namespace(
      agent=agent, data="cifar10", seed=seed, cuda=False, epoch=1, batch=BATCH, verbose=False,
      mem_size=MEM_SIZE, eps_mem_batch=EPS_MEM_BATCH, mem_iters=1, update="random",
      retrieve=retrieve, subsample=SUBSAMPLE, buffer_tracker=False, error_analysis=False,
      learning_rate=learning_rate, weight_decay=WEIGHT_DECAY, optimizer="Adam",
      lambda_=EWC_LAMBDA, alpha=EWC_ALPHA, fisher_update_after=FISHER_UPDATE_AFTER,
      trick={"labels_trick": False, "separated_softmax": False, "kd_trick": False,
             "kd_trick_star": False, "review_trick": False, "ncm_trick": False})


# ------------------------------------------------------------------------------------------------
# prepare (this project's venv)


def prepare(args) -> None:
  from olora_jax.models import resnet

  def weights_of(setup, state):
    return aml.their_state_dict(state["params"], state["frozen"][resnet.BATCH_STATS],
                                cosine=False)

  aml.write_prepared(args.out, overrides(args.method, args.lr), aml.STEPS_PER_TASK, weights_of)


# ------------------------------------------------------------------------------------------------
# record (the side venv with PyTorch)


def run_theirs(settings: dict, manifest: dict, data: dict, weights: dict):
  """Their run (module docstring) from `weights`: (per-step log, task-end test logits (tasks, N,
  C) float32)."""
  import contextlib
  import copy
  import io

  import torch
  import utils.name_match as name_match  # their package; first, as their experiment/run.py
  from utils.setup_elements import setup_architecture, setup_opt

  mir_retrieve = sys.modules["utils.buffer.mir_retrieve"]  # imported by name_match

  aml.deterministic_torch(torch, SEED)
  method = settings["method"]
  params = their_params(method, SEED, settings[f"{method}.learning_rate"])
  model = setup_architecture(params)
  model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()},
                        strict=True)
  opt = setup_opt(params.optimizer, model, params.learning_rate, params.weight_decay)
  with contextlib.redirect_stdout(io.StringIO()):  # their Buffer prints its size
    agent = name_match.agents[params.agent](model, opt, params)
  if method == "ewc_pp":
    return run_theirs_ewc(agent, manifest, data)
  buffer = agent.buffer
  train_x = np.ascontiguousarray(data["train_x"].transpose(0, 3, 1, 2))
  id_of = {train_x[i].tobytes(): int(r) for i, r in enumerate(data["train_ids"])}
  assert len(id_of) == len(train_x), "two training images of the stream are equal"

  def ids(images) -> list[int]:
    return [id_of[np.ascontiguousarray(x).tobytes()] for x in images.detach().numpy()]

  def held() -> list[int]:
    out = ids(buffer.buffer_img[:buffer.current_index])
    return out + [-1] * (MEM_SIZE - len(out))

  step: dict = {}
  criterion, update, retrieve = agent.criterion, buffer.update, buffer.retrieve
  candidates_of = mir_retrieve.random_retrieve

  def recorded_criterion(logits, labels):
    loss = criterion(logits, labels)
    step["losses"].append(loss.item())
    return loss

  def recorded_update(x, y, **kwargs):
    out = update(x, y, **kwargs)
    step["buffer_ids"] = held()
    return out

  def slots(drawn) -> list[int]:
    before = {v: s for s, v in enumerate(step["held_before"]) if v >= 0}
    return [before[v] for v in ids(drawn)]

  def recorded_retrieve(**kwargs):
    if method == "agem":  # g: the batch's gradient, before the reference gradient replaces it
      step["grad"] = [p.grad.clone() for p in agent.model.parameters() if p.requires_grad]
    mem_x, mem_y = retrieve(**kwargs)
    step["replayed_slots"] = slots(mem_x)
    if method == "agem" and mem_x.size(0) > 0:  # g . g_ref, on a copy in the same state
      twin = copy.deepcopy(agent.model)
      twin.zero_grad()
      torch.nn.functional.cross_entropy(twin(mem_x), mem_y).backward()
      step["dot"] = sum(torch.sum(g * p.grad).item() for g, p in zip(
          step["grad"], [p for p in twin.parameters() if p.requires_grad], strict=True))
    return mem_x, mem_y

  def recorded_candidates(buf, num_retrieve, *args, **kwargs):
    out = candidates_of(buf, num_retrieve, *args, **kwargs)
    step["candidate_slots"] = slots(out[0])
    return out

  opt_step = opt.step

  def recorded_step(*args, **kwargs):
    if "grad" in step and "dot" in step:
      final = [p.grad for p in agent.model.parameters() if p.requires_grad]
      step["projected"] = any(not torch.equal(a, b) for a, b in zip(step["grad"], final,
                                                                   strict=True))
    return opt_step(*args, **kwargs)

  agent.criterion, buffer.update, buffer.retrieve = recorded_criterion, recorded_update, \
      recorded_retrieve
  mir_retrieve.random_retrieve = recorded_candidates
  opt.step = recorded_step
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  steps, step_task, log, task_logits = manifest["steps"], manifest["step_task"], [], []
  try:
    for t, batch_ids in enumerate(steps):
      rows = [row[i] for i in batch_ids]
      step = {"losses": [], "replayed_slots": [], "candidate_slots": [], "projected": False,
              "dot": 0.0, "held_before": held()}
      agent.train_learner(data["train_x"][rows], data["train_y"][rows].astype(np.int64))
      after = {v: s for s, v in enumerate(step["buffer_ids"]) if v >= 0}
      step["stored_slot"] = [after.get(int(i), -1) for i in batch_ids]
      step.pop("grad", None)
      log.append(step)
      if t + 1 == len(steps) or step_task[t + 1] != step_task[t]:  # a task end
        agent.model.eval()
        with torch.no_grad():
          task_logits.append(torch.cat([agent.model(test_x[i:i + 128])
                                        for i in range(0, len(test_x), 128)]).numpy())
        agent.model.train()
  finally:
    mir_retrieve.random_retrieve = candidates_of
  return log, np.stack(task_logits).astype(np.float32)


def run_theirs_ewc(agent, manifest: dict, data: dict):
  """Their EWC++ agent called once per task, as their general_main.py calls it (its loader
  shuffles the task's batches; the driver records the order): (per-step log, task-end test logits
  (tasks, N, C) float32). Per step: the batch's record ids, CE (their `criterion`), and the
  penalty lambda sum F~ (theta - theta*)^2 (recomputed by the driver from their normalised Fisher
  and anchor at their `total_loss`'s call, as it computes it; NaN before the first task end, when
  they add none)."""
  import torch

  train_x = np.ascontiguousarray(data["train_x"].transpose(0, 3, 1, 2))
  id_of = {train_x[i].tobytes(): int(r) for i, r in enumerate(data["train_ids"])}
  assert len(id_of) == len(train_x), "two training images of the stream are equal"
  row = {int(r): i for i, r in enumerate(data["train_ids"])}
  log: list[dict] = []
  criterion, total_loss, forward = agent.criterion, agent.total_loss, agent.forward

  def recorded_forward(x):
    log.append({"ids": [id_of[np.ascontiguousarray(v).tobytes()] for v in x.detach().numpy()],
                "losses": [], "penalty": float("nan")})
    return forward(x)

  def recorded_criterion(logits, labels):
    loss = criterion(logits, labels)
    log[-1]["losses"].append(loss.item())
    return loss

  def recorded_total_loss(inputs, targets):
    if agent.prev_params:
      with torch.no_grad():
        reg = 0
        for n, p in agent.weights.items():
          reg += (agent.normalized_fisher[n] * (p - agent.prev_params[n]) ** 2).sum()
        log[-1]["penalty"] = (agent.lambda_ * reg).item()
    return total_loss(inputs, targets)

  agent.forward, agent.criterion, agent.total_loss = recorded_forward, recorded_criterion, \
      recorded_total_loss
  test_x = torch.from_numpy(np.ascontiguousarray(data["test_x"].transpose(0, 3, 1, 2)))
  steps, step_task, task_logits = manifest["steps"], manifest["step_task"], []
  for task in sorted(set(step_task), key=step_task.index):
    rows = [row[i] for t, batch in enumerate(steps) if step_task[t] == task for i in batch]
    agent.train_learner(data["train_x"][rows], data["train_y"][rows].astype(np.int64))
    agent.model.eval()
    with torch.no_grad():
      task_logits.append(torch.cat([agent.model(test_x[i:i + 128])
                                    for i in range(0, len(test_x), 128)]).numpy())
    agent.model.train()
  assert len(log) == len(steps), (len(log), len(steps))
  return log, np.stack(task_logits).astype(np.float32)


def task_end_fields(logits, own: list, data: dict) -> dict:
  """What every recording holds of the task ends: their logits, their own perturbed runs'
  predictions and largest logit drift (`own`: (run log, task-end logits) pairs), the test set's
  ids and labels and the perturbation's size."""
  return dict(task_end_logits=logits,
              own_task_end_predictions=np.stack([z.argmax(-1) for _, z in own]).astype(np.int8),
              own_logit_drift=np.stack([np.abs(z - logits).max(axis=(1, 2)) for _, z in own]),
              test_ids=data["test_ids"], test_labels=data["test_y"].astype(np.int64),
              perturbation=np.float64(aml.PERTURBATION))


def versions(commit: str, torch) -> str:
  """The recording's provenance (JSON): their commit, the torch, NumPy and Python versions and
  the CPU that recorded it."""
  import platform
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
              if line.startswith("model name")), platform.processor())
  return json.dumps({"authors_commit": commit, "torch": torch.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0], "cpu": cpu})


def record_ewc(args, manifest: dict, settings: dict, data: dict, weights: dict) -> None:
  """EWC++'s recording: their run and `aml.OWN_DRIFT_RUNS` perturbed ones; the manifest's steps
  in their loader's order (the same in every run: their seeds are fixed)."""
  import torch

  log, logits = run_theirs(settings, manifest, data, weights)
  own = [run_theirs(settings, manifest, data, aml.perturbed(weights, seed))
         for seed in range(1, aml.OWN_DRIFT_RUNS + 1)]
  order = [s["ids"] for s in log]
  assert all([s["ids"] for s in run] == order for run, _ in own), "their batches moved"
  label = {int(r): int(y) for r, y in zip(data["train_ids"], data["train_y"], strict=True)}
  manifest = {**manifest, "steps": order,
              "step_labels": [[label[i] for i in batch] for batch in order],
              "params": {**manifest.get("params", {}), "order": "their loader's, within each"
                         " task (scripts/parity/ocl.py record)"}}
  for t, batch in enumerate(order):  # each batch within its task
    assert set(batch) <= set(sum((b for u, b in enumerate(order)
                                  if manifest["step_task"][u] == manifest["step_task"][t]), []))

  def column(run, key):
    return np.array([s["losses"][0] if key == "loss" else s[key] for s in run], np.float32)

  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), overrides=json.dumps(settings),
      loss=column(log, "loss"), penalty=column(log, "penalty"),
      own_loss=np.stack([column(run, "loss") for run, _ in own]),
      own_penalty=np.stack([column(run, "penalty") for run, _ in own]),
      own_decisions_same=np.bool_(True),  # no draws: the batch order, asserted the same above
      **task_end_fields(logits, own, data), versions=versions(args.commit, torch))
  print(f"recorded ewc_pp: {len(log)} steps, final loss {log[-1]['losses'][0]:.6f}, penalty"
        f" {[round(s['penalty'], 8) for s in log]}, task-end accuracies"
        f" {[(z.argmax(1) == data['test_y']).mean().round(4) for z in logits]} -> {args.out}")


def record(args) -> None:
  """Runs their code on the prepared stream from the prepared weights, and `aml.OWN_DRIFT_RUNS`
  times from them perturbed at float32 rounding, and writes the recording."""
  import torch

  scr._compatibility_shims()
  sys.path.insert(0, os.path.abspath(args.ocl))
  with open(os.path.join(args.prepared, "manifest.json")) as f:
    manifest = json.load(f)
  with open(os.path.join(args.prepared, "overrides.json")) as f:
    settings = json.load(f)
  method = settings["method"]
  data = dict(np.load(os.path.join(args.prepared, "inputs.npz")))
  weights = dict(np.load(os.path.join(args.prepared, "weights.npz")))
  if method == "ewc_pp":
    return record_ewc(args, manifest, settings, data, weights)
  log, logits = run_theirs(settings, manifest, data, weights)
  own = [run_theirs(settings, manifest, data, aml.perturbed(weights, seed))
         for seed in range(1, aml.OWN_DRIFT_RUNS + 1)]
  # The draws (from their generators), which the float drift cannot move; the projections and
  # MIR's retrievals are recorded per run.
  fields = ("buffer_ids", "candidate_slots", "stored_slot") + (
      ("replayed_slots",) if method == "agem" else ())
  draws = {"format": "olora-jax replay draws v1",
           "source": f"RaptorMai/online-continual-learning {AGENT[method][0]}"
                     f" (scripts/parity/ocl.py record)",
           "stored_slot": [s["stored_slot"] for s in log],
           "replayed_slots": [s["candidate_slots" if method == "mir" else "replayed_slots"]
                              for s in log]}

  def padded(key, width, run=log):
    out = np.full((len(run), width), -1, np.int64)
    for t, s in enumerate(run):
      out[t, :len(s[key])] = s[key]
    return out

  def losses(run, i):
    return np.array([s["losses"][i] if len(s["losses"]) > i else np.nan for s in run],
                    np.float32)

  np.savez_compressed(
      args.out, manifest=json.dumps(manifest), draws=json.dumps(draws),
      overrides=json.dumps(settings), loss=losses(log, 0), memory_loss=losses(log, 1),
      own_loss=np.stack([losses(run, 0) for run, _ in own]),
      own_memory_loss=np.stack([losses(run, 1) for run, _ in own]),
      buffer_ids=np.array([s["buffer_ids"] for s in log], np.int16),
      replayed_slots=padded("replayed_slots", EPS_MEM_BATCH).astype(np.int16),
      candidate_slots=padded("candidate_slots", SUBSAMPLE).astype(np.int16),
      projected=np.array([s["projected"] for s in log]),
      own_projected=np.array([[s["projected"] for s in run] for run, _ in own]),
      own_replayed_slots=np.stack([padded("replayed_slots", EPS_MEM_BATCH, run)
                                   for run, _ in own]).astype(np.int16),
      grad_dot_memory=np.array([s["dot"] for s in log], np.float64),
      own_grad_dot_memory=np.array([[s["dot"] for s in run] for run, _ in own], np.float64),
      own_decisions_same=np.bool_(all(
          a[k] == b[k] for run, _ in own for a, b in zip(log, run, strict=True)
          for k in fields)),
      **task_end_fields(logits, own, data), versions=versions(args.commit, torch))
  print(f"recorded {method}: {len(log)} steps, final loss {log[-1]['losses'][0]:.6f},"
        f" projected at {sum(s['projected'] for s in log)} steps, task-end accuracies"
        f" {[(z.argmax(1) == data['test_y']).mean().round(4) for z in logits]} -> {args.out}")


def main(argv=None) -> None:
  parser, _, p, r = aml.driver_parser(__doc__, "ocl", "RaptorMai/online-continual-learning",
                                      "tests/fixtures/parity/ocl_agem.npz")
  p.add_argument("--method", choices=METHODS, required=True)
  p.add_argument("--lr", type=float, default=LEARNING_RATE, help="Adam's learning rate (their"
                 " --learning_rate; MIR's virtual step's too)")
  r.add_argument("--commit", required=True, help="the checkout's commit (git rev-parse HEAD)")
  aml.run_command(parser.parse_args(argv), {"prepare": prepare, "record": record})


if __name__ == "__main__":
  main()
