"""GDumb, greedy sampler and dumb learner (Prabhu et al. 2020).

On the stream GDumb only fills a class-balanced buffer of `gdumb.buffer_size` (replay.py,
`class_balanced_update`); it takes no gradient step there (its `loss` is reported as 0). At each
evaluation point the learner trains a model from the initial weights (pretrained backbone, fresh
head) on the buffer alone for `gdumb.epochs` epochs of `learner.batch_size` samples: Adam with L2
weight decay, the raw gradient's global norm clipped to `gdumb.clip_norm`, the learning rate
following a cosine from `gdumb.learning_rate` down to `gdumb.min_learning_rate`. The loop
evaluates GDumb at task ends only, as the paper reports it (A_auc is n/a). Paper: buffer 500,
LR 1e-3, minimal LR 5e-4, WD 1e-4, clipping 10, 30 epochs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from olora_jax import config_keys
from olora_jax.config_keys import Key, paper
from olora_jax.methods import base, common, replay
from olora_jax.models import resnet


def build(ctx: base.Context) -> base.Method:
  block, scale = ctx.config.gdumb, ctx.config.data.input_scale
  apply = common.make_apply(ctx.model)
  batch_size, capacity = ctx.batch_size, block.buffer_size
  steps_per_epoch = max(math.ceil(capacity / batch_size), 1)
  total_steps = block.epochs * steps_per_epoch
  schedule = optax.cosine_decay_schedule(block.learning_rate, total_steps,
                                         alpha=block.min_learning_rate / block.learning_rate)
  tx = common.make_adam(schedule, block.weight_decay, block.clip_norm)

  def init(key, params):
    lora_key, key = jax.random.split(key)
    trainable, frozen = common.split_trainable(params, block.trainable, lora_key, ctx.spec,
                                               ctx.config.learner.rank)
    return {"params": trainable, "frozen": frozen, "step": jnp.zeros((), jnp.int32), "key": key,
            "buffer": replay.init(capacity, ctx.image_shape),
            "class_seen": jnp.zeros((ctx.num_classes,), bool)}

  @common.train_step("gdumb")
  def train_step(state, batch):
    buf, class_seen = replay.class_balanced_update(
        state["buffer"], state["class_seen"], batch, common.step_key(state), scale)
    state = {**state, "buffer": buf, "class_seen": class_seen, "step": state["step"] + 1}
    return state, {"loss": jnp.zeros((), jnp.float32),
                   "buffer_fill": jnp.sum(buf.valid.astype(jnp.int32))}, {}

  def ce(params, frozen, images, labels, mask):
    logits = apply(frozen, params, images)
    return common.masked_mean(common.per_example_ce(logits, labels), mask)

  def eval_state(state):
    """The model GDumb evaluates: trained from the initial weights on the buffer alone."""
    common.TRACE_COUNTS["gdumb.eval_state"] += 1
    buf, frozen = state["buffer"], state["frozen"]
    images = replay.decode(buf.images, scale)
    key = common.step_key(state)
    padded = steps_per_epoch * batch_size

    def epoch(e, carry):
      # The valid samples first, in a fresh random order each epoch; then padding.
      order = jnp.argsort(jnp.where(buf.valid, jax.random.uniform(jax.random.fold_in(key, e),
                                                                  (capacity,)), 2.0))
      order = jnp.concatenate([order, jnp.zeros((padded - capacity,), order.dtype)])
      in_range = jnp.arange(padded) < capacity

      def step(s, carry):
        idx = jax.lax.dynamic_slice(order, (s * batch_size,), (batch_size,))
        mask = jax.lax.dynamic_slice(in_range, (s * batch_size,), (batch_size,)) & buf.valid[idx]

        def update(carry):
          params, stats, opt_state = carry
          # A model with BatchNorm moves its running statistics (`stats`; {} on other models)
          # as it trains.
          now = {**frozen, **stats}
          stats = common.moved_batch_statistics(ctx.model, now, params, images[idx], mask)
          grads = jax.grad(ce)(params, now, images[idx], buf.labels[idx], mask)
          updates, opt_state = tx.update(grads, opt_state, params)
          return (optax.apply_updates(params, updates),
                  {k: v for k, v in stats.items() if k in carry[1]}, opt_state)

        return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry)

      return jax.lax.fori_loop(0, steps_per_epoch, step, carry)

    # The model is trained afresh: BatchNorm's running statistics (if any) start afresh too.
    stats = {k: v for k, v in common.reset_batch_statistics(frozen).items()
             if k == resnet.BATCH_STATS}
    params, stats, _ = jax.lax.fori_loop(0, block.epochs, epoch,
                                         (state["params"], stats, tx.init(state["params"])))
    return {"params": params, "frozen": {**frozen, **stats}}

  return base.Method(name="gdumb", init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x),
                     eval_state=jax.jit(eval_state), anytime_eval=False,
                     eval_state_keys=("gdumb.learning_rate",))


def config():
  """The `gdumb` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=Key(1e-3, "Adam's learning rate at the start of each training from the"
                        " buffer, decayed by a cosine to min_learning_rate (> 0)",
                        paper(1e-3, rate=True)),
      min_learning_rate=Key(5e-4, "the cosine's final learning rate, in (0, learning_rate]",
                            paper(5e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      clip_norm=Key(10.0, "the raw gradient's global norm is clipped to this (>= 0; 0 = no"
                    " clipping)", paper(10.0)),
      epochs=Key(30, "passes over the buffer, in batches of learner.batch_size, each time a"
                 " model is trained from it (at each evaluation) (>= 1)",
                 paper(30, config_keys.PAPER_TABLE + ": epochs to train for memory")),
      buffer_size=Key(500, "class-balanced memory, in samples, filled by GDumb's greedy sampler"
                      " (>= 1)", common.PAPER_BUFFER))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((41.0, 19.97), None),
        "imagenet_r disjoint/10 vit_b16": ((8.87, 1.36), None),
        "imagenet_sketch disjoint/10 vit_b16": ((1.65, 0.22), None),
        "caltech_birds2011 disjoint/5 vit_b16": ((9.09, 1.03), None),
        "cifar100 disjoint/10 vit_s16": ((10.87, 4.94), None),
        "imagenet_r disjoint/10 vit_s16": ((5.33, 1.09), None),
        "imagenet_sketch disjoint/10 vit_s16": ((2.09, 0.32), None),
        "caltech_birds2011 disjoint/5 vit_s16": ((3.28, 0.99), None),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((14.76, 1.13), None),
        "core50 domain/8 swin_t": ((79.52, 3.0), None),
    },
}

METHODS = (base.MethodSpec(name="gdumb", build=build, config=config, report_name="GDumb",
                           table_row=5, paper_results=PAPER_RESULTS),)
