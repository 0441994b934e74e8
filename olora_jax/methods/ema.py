"""EMA (Soutif-Cormerais et al. 2023): evaluate an exponential moving average of the weights.

Wraps a method (DER++: `ema_der_pp`; RAR: `ema_rar`): training is the inner method's, unchanged;
after each update of the weights the average of the trainable weights (and, on a model with
BatchNorm, of its running statistics) moves towards them (DER++: once a step; RAR: after each of
its `repeats` rehearsals of a batch, as the authors' code moves it after every training
iteration and runs RAR's passes as iterations),
    ema <- lambda * ema + (1 - lambda) * params,
with lambda = `ema_warmup_decay` for the first `ema_warmup_steps` steps, then `ema_decay`. The
average starts at the initial weights; `predict` (what the evaluator reads) uses it. The EMA
authors' code (AlbinSou/online_ema) averages every tensor of the model's state, so the averaged
network is normalised with averaged statistics, not the trained network's. Paper:
lambda 0.9 during warm-up, then 0.99, LR 2e-4; the warm-up length (`ema_warmup_steps`, 100
batches) is *ours*.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, ours, paper
from olora_jax.methods import base, common, der_pp, er, rar
from olora_jax.models import resnet


def update(ema, params, decay):
  """ema <- decay * ema + (1 - decay) * params, leaf by leaf. Pure."""
  return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)


def decay_at(block, step):
  """The lambda of the update that ends stream step `step` (1 for the first):
  `ema_warmup_decay` for the first `ema_warmup_steps` steps, then `ema_decay`. Pure."""
  return jnp.where(step <= block.ema_warmup_steps, block.ema_warmup_decay, block.ema_decay)


def moved(block, state, step):
  """`state` with its average ("ema_params", and "ema_batch_stats" where held) moved towards the
  current weights (and running statistics) with the lambda of stream step `step`. Pure."""
  decay = decay_at(block, step)
  state = {**state, "ema_params": update(state["ema_params"], state["params"], decay)}
  if "ema_batch_stats" in state:
    state["ema_batch_stats"] = update(state["ema_batch_stats"],
                                      state["frozen"][resnet.BATCH_STATS], decay)
  return state


def wrap(inner: base.Method, block, moves_itself: bool = False) -> base.Method:
  """`inner` with its evaluated weights replaced by their moving average (state "ema_params"),
  and on a model with BatchNorm its running statistics too (state "ema_batch_stats"): the
  averaged network is evaluated with the averaged statistics, as the EMA authors' code averages
  every tensor of the state_dict (AlbinSou/online_ema, src/plugins/mean_evaluation.py). The
  average moves after each step (`moved`), or, with `moves_itself`, where the inner method's step
  calls `moved` itself (RAR, after each rehearsal)."""

  def init(key, params):
    state = inner.init(key, params)
    state = {**state, "ema_params": jax.tree.map(jnp.array, state["params"])}
    if resnet.BATCH_STATS in state["frozen"]:
      state["ema_batch_stats"] = jax.tree.map(jnp.array, state["frozen"][resnet.BATCH_STATS])
    return state

  def train_step(state, batch):
    state, scalars, extras = inner.train_step(state, batch)
    if not moves_itself:
      state = moved(block, state, state["step"])
    return state, scalars, extras

  def predict(state, images):
    averaged = {**state, "params": state["ema_params"]}
    if "ema_batch_stats" in state:
      averaged["frozen"] = {**state["frozen"], resnet.BATCH_STATS: state["ema_batch_stats"]}
    return inner.predict(averaged, images)

  return base.Method(name=inner.name, init=init, train_step=train_step, predict=predict)


def build_der_pp(ctx: base.Context) -> base.Method:
  return wrap(der_pp.make(ctx, "ema_der_pp", ctx.config.ema_der_pp), ctx.config.ema_der_pp)


def build_rar(ctx: base.Context) -> base.Method:
  block = ctx.config.ema_rar
  after_update = lambda state, step: moved(block, state, step)  # noqa: E731
  return wrap(rar.make(ctx, "ema_rar", block, after_update), block, moves_itself=True)


def _config(**keys):
  """The keys of the EMA wrapper (the paper's lambda 0.9 during warm-up, then 0.99; no WD in the
  paper's table), then the inner method's `keys`."""
  return common.baseline_block(
      learning_rate=common.shared(2e-4, paper(2e-4, rate=True)),
      weight_decay=common.shared(0.0, paper(0.0, config_keys.PAPER_TABLE + ": EMA's row gives no"
                                            " weight decay (the authors' configs: 0)")),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      ema_decay=Key(0.99, "lambda of ema <- lambda * ema + (1 - lambda) * weights after the"
                    " warm-up, in [0, 1); the evaluator reads the average",
                    paper(0.99, config_keys.PAPER_TABLE + ": EMA's lambda")),
      ema_warmup_decay=Key(0.9, "lambda during the first ema_warmup_steps steps, in [0, 1)",
                           paper(0.9, config_keys.PAPER_TABLE + ": EMA's lambda for warm-up")),
      ema_warmup_steps=Key(100, "steps that use ema_warmup_decay (>= 0; *ours*)",
                           ours("100, a fixed count: the authors warm up for one task's"
                                " iterations (about 222 on their CIFAR-100 config,"
                                " AlbinSou/online_ema); a task-free run cannot read a task's"
                                " length")),
      **keys)


# The EMA authors' code (its DER++ plugin: plain SGD at 0.1 in every config; the batch, then the
# replayed samples in a forward pass of their own). `er.optimizer_keys`'s `authors`.
ONLINE_EMA = "AlbinSou/online_ema"
AUTHORS_ONLINE_EMA = (f"the EMA authors' code, {ONLINE_EMA}", "0.1", "two passes")


def config_der_pp():
  """The `ema_der_pp` block: EMA on DER++ (its keys, and its optimiser and replay pass)."""
  return _config(**er.optimizer_keys(paper("adam", config_keys.PAPER_SETTINGS), ours(er.ONE_PASS),
                                     authors=AUTHORS_ONLINE_EMA),
                 **der_pp.replay_keys())


def config_rar():
  """The `ema_rar` block: EMA on RAR (ER's keys and optimiser, and RAR's repeats and
  augmentation)."""
  return _config(
      # The optimiser (Adam by default, the paper's; their code: plain SGD); RAR's one joint pass
      # needs no `replay_pass`.
      optimizer=er.optimizer_keys(paper("adam", config_keys.PAPER_SETTINGS), ours(er.ONE_PASS),
                                  authors=AUTHORS_ONLINE_EMA)["optimizer"],
      replay_batch=Key(10, "stored samples drawn uniformly for each rehearsal, at most"
                       " buffer_size; 0 = learner.batch_size",
                       authors(0, "AlbinSou/online_ema, src/online_factories.py: the replay"
                               " draw equals the incoming batch (32)",
                               differs="10, ER's replayed per batch (the Online-LoRA paper's ER"
                               " row), as RAR is ER with repeats and augmentation")),
      repeats=Key(3, "rehearsals of each incoming batch, each with a fresh replay draw and"
                  " augmentation (>= 1; the authors' 3 passes)",
                  authors(3, "AlbinSou/online_ema, src/config/cifar100/rar.yml: nepochs (each"
                          " incoming batch trained nepochs times)")),
      augment=Key(True, "RAR augments the batch and the replayed samples at each rehearsal (a"
                  " random shift, and a flip unless flip is False); False trains on the images"
                  " as given",
                  authors(True, "AlbinSou/online_ema, src/config/cifar100/rar.yml:"
                          " use_transforms (a random crop of the zero-padded image and a"
                          " horizontal flip)")),
      flip=Key(True, "RAR's augmentation mirrors images left-right (besides its random shift);"
               " False for data a mirror changes, such as digits",
               authors(True, "AlbinSou/online_ema, src/config/cifar100/rar.yml:"
                       " use_transforms")))


DER_PP_PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((42.28, 4.36), (55.59, 1.48)),
        "imagenet_r disjoint/10 vit_b16": ((41.75, 1.98), (32.65, 1.55)),
        "imagenet_sketch disjoint/10 vit_b16": ((16.88, 2.23), (36.28, 1.09)),
        "caltech_birds2011 disjoint/5 vit_b16": ((35.26, 3.31), (25.55, 3.35)),
        "cifar100 disjoint/10 vit_s16": ((12.76, 0.65), (41.17, 1.75)),
        "imagenet_r disjoint/10 vit_s16": ((20.89, 3.05), (48.03, 1.79)),
        "imagenet_sketch disjoint/10 vit_s16": ((12.93, 0.13), (22.59, 0.16)),
        "caltech_birds2011 disjoint/5 vit_s16": ((35.79, 5.27), (24.85, 4.2)),
    },
}

RAR_PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((47.1, 0.82), (50.01, 0.35)),
        "imagenet_r disjoint/10 vit_b16": ((30.04, 0.33), (39.36, 0.04)),
        "imagenet_sketch disjoint/10 vit_b16": ((14.06, 0.37), (36.28, 1.09)),
        "caltech_birds2011 disjoint/5 vit_b16": ((33.34, 1.11), (28.68, 0.56)),
        "cifar100 disjoint/10 vit_s16": ((19.21, 2.16), (41.99, 1.73)),
        "imagenet_r disjoint/10 vit_s16": ((16.11, 0.35), (50.58, 0.83)),
        "imagenet_sketch disjoint/10 vit_s16": ((14.5, 2.71), (23.79, 2.91)),
        "caltech_birds2011 disjoint/5 vit_s16": ((34.53, 1.04), (30.19, 0.36)),
    },
}

METHODS = (
    base.MethodSpec(name="ema_der_pp", build=build_der_pp, config=config_der_pp,
                    report_name="EMA (DER++)", table_row=9, paper_results=DER_PP_PAPER_RESULTS,
                    check=base.Check("step", ONLINE_EMA, "tests/test_parity_online_ema.py",
                                     "for the moving average only (momentum 0.9 for a 20-step"
                                     " warm-up, then 0.99; the averaged weights and BatchNorm"
                                     " statistics evaluated at 5 task ends), 40 steps, float32,"
                                     " with DER++'s replay"
                                     " off on both sides (DER++ itself: `der_pp`'s check against"
                                     " Mammoth)",
                                     settings={"model.name": "resnet18_reduced",
                                               "ema_der_pp.optimizer": "sgd",
                                               "ema_der_pp.replay_pass": "separate",
                                               "ema_der_pp.trainable": "all",
                                               "ema_der_pp.replay_batch": 1})),
    base.MethodSpec(name="ema_rar", build=build_rar, config=config_rar,
                    report_name="EMA (RAR)", table_row=10, paper_results=RAR_PAPER_RESULTS,
                    check=base.Check("step", ONLINE_EMA, "tests/test_parity_online_ema.py",
                                     "for the moving average over RAR's repeated rehearsals only"
                                     " (3 rehearsals a batch, the average moved after each:"
                                     " momentum 0.9 for a 20-batch warm-up, then 0.99; each"
                                     " rehearsal's loss; the averaged weights and BatchNorm"
                                     " statistics evaluated at 5 task ends), 40 batches,"
                                     " float32, with RAR's replay and augmentation off on both"
                                     " sides (their replay is another algorithm: docs/parity.md)",
                                     settings={"model.name": "resnet18_reduced",
                                               "ema_rar.optimizer": "sgd",
                                               "ema_rar.trainable": "all",
                                               "ema_rar.repeats": 3,
                                               "ema_rar.augment": False})),
)
