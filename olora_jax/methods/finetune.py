"""Continual fine-tuning (no protection against forgetting), and the i.i.d. upper bound.

`finetune`: one Adam step on the cross-entropy of each stream batch, nothing else. With
`finetune.trainable` = 'all' (the whole ViT with its fresh head), 'head' (a linear probe on the
frozen backbone) or 'lora' (a single LoRA on q and v plus the head).

`iid` (the paper's upper bound, UB: supervised training on the whole i.i.d. data): the same
learner on `iid.epochs` passes over i.i.d. shuffles of all the stream's samples (the trainer builds
that order, data/streams.py `iid_order`), evaluated on the same test sets; the config block `iid`.
Its learning rate follows `iid.schedule`: 'constant' (every baseline's optimiser) or 'cosine'
(decayed from `learning_rate` to 0 over all the i.i.d. order's steps, as supervised training is
usually run).
"""

from __future__ import annotations

import math

import jax
import optax

from olora_jax.config_keys import Key, ours
from olora_jax.methods import base, common

IID_SCHEDULES = ("constant", "cosine")


def iid_learning_rate(ctx: base.Context, block):
  """The upper bound's learning rate: `block.learning_rate`, constant or cosine-decayed to 0
  over the i.i.d. order's ceil(epochs * samples / batch) steps (data/streams.py `iid_order`)."""
  if block.schedule not in IID_SCHEDULES:
    raise ValueError(f"unknown iid.schedule={block.schedule!r}; use one of {IID_SCHEDULES}")
  if block.schedule == "constant":
    return block.learning_rate
  if ctx.stream_samples < 1:
    raise ValueError("iid.schedule='cosine' needs the stream's size (Context.stream_samples)")
  steps = math.ceil(block.epochs * ctx.stream_samples / ctx.batch_size)
  return optax.cosine_decay_schedule(block.learning_rate, decay_steps=steps)


def make(ctx: base.Context, name: str, block, iid_stream: bool = False) -> base.Method:
  if iid_stream:
    tx = common.make_adam(iid_learning_rate(ctx, block), block.weight_decay)
    apply = common.make_apply(ctx.model)
  else:
    tx, apply = common.optimizer_and_apply(ctx, block)
  rank = ctx.config.learner.rank

  def init(key, params):
    return common.init_state(key, params, block.trainable, ctx.spec, rank, tx)

  @common.train_step(name)
  def train_step(state, batch):

    def loss_fn(params):
      logits = apply(state["frozen"], params, batch["images"])
      return common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    return common.apply_gradients(state, grads, tx), {"loss": loss}, {}

  def predict(state, images):
    return apply(state["frozen"], state["params"], images)

  return base.Method(name=name, init=init, train_step=train_step, predict=predict,
                     iid_stream=iid_stream)


def build(ctx: base.Context) -> base.Method:
  return make(ctx, "finetune", ctx.config.finetune)


def build_iid(ctx: base.Context) -> base.Method:
  return make(ctx, "iid", ctx.config.iid, iid_stream=True)


# Fine-tuning has no row in the Online-LoRA paper's table: the baselines' shared rate and decay.
FINETUNE_SETTINGS = ("the Online-LoRA paper's baseline rate and decay (its ER and AGEM rows);"
                     " fine-tuning has no row of its own")


def config_finetune():
  """The `finetune` block: no protection (not in the paper's table: the baselines' shared LR and
  WD)."""
  return common.baseline_block(learning_rate=common.shared(1e-4, ours(FINETUNE_SETTINGS)),
                               weight_decay=common.shared(1e-4, ours(FINETUNE_SETTINGS)))


def config_iid():
  """The `iid` block: the upper bound, finetune's learner on i.i.d. shuffles of the stream."""
  return common.baseline_block(
      learning_rate=Key(1e-4, "Adam's learning rate (> 0): constant, or the start of the cosine"
                        " with schedule='cosine'",
                        ours("the paper's upper bound has no settings of its own: fine-tuning's"
                             " rate and decay")),
      weight_decay=common.shared(1e-4, ours("the paper's upper bound has no settings of its own:"
                                            " fine-tuning's rate and decay")),
      epochs=Key(5, "passes over i.i.d. shuffles of all the stream's samples (>= 1)",
                 ours("5 passes over i.i.d. shuffles, a budget a CPU demo affords; the"
                      " online-continual-learning codebase's offline runs take 50")),
      schedule=Key("constant", "'constant' | 'cosine' (the learning rate decayed to 0 over all"
                   " the passes' steps)",
                   ours("a constant rate, as the stream's learners; 'cosine' for an offline"
                        " bound")))


IID_PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((89.5, 0.04), None),
        "imagenet_r disjoint/10 vit_b16": ((76.78, 0.44), None),
        "imagenet_sketch disjoint/10 vit_b16": ((63.82, 0.02), None),
        "caltech_birds2011 disjoint/5 vit_b16": ((82.81, 1.07), None),
        "cifar100 disjoint/10 vit_s16": ((86.55, 0.01), None),
        "imagenet_r disjoint/10 vit_s16": ((69.94, 0.34), None),
        "imagenet_sketch disjoint/10 vit_s16": ((59.28, 0.11), None),
        "caltech_birds2011 disjoint/5 vit_s16": ((73.91, 1.16), None),
    },
    "table2": {
        "cifar100 si_blurry/5 vit_b16": (None, (89.5, 0.04)),
        "imagenet_r si_blurry/5 vit_b16": (None, (76.78, 0.44)),
        "imagenet_sketch si_blurry/5 vit_b16": (None, (63.82, 0.02)),
        "cifar100 si_blurry/5 vit_s16": (None, (86.55, 0.01)),
        "imagenet_r si_blurry/5 vit_s16": (None, (69.94, 0.34)),
        "imagenet_sketch si_blurry/5 vit_s16": (None, (59.28, 0.11)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((71.98, 0.23), None),
        "core50 domain/8 swin_t": ((97.56, 0.02), None),
    },
}

METHODS = (
    base.MethodSpec(name="finetune", build=build, config=config_finetune,
                    report_name="Fine-tuning", table_row=13),
    base.MethodSpec(name="iid", build=build_iid, config=config_iid,
                    report_name="Upper bound (i.i.d.)", table_row=100,
                    paper_results=IID_PAPER_RESULTS),
)
