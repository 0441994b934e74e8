"""ER, experience replay (Chaudhry et al. 2019): reservoir buffer, random retrieval.

Each step: draw `er.replay_batch` stored samples uniformly, take one Adam step on
CE(batch) + CE(replayed), then offer the batch to the reservoir buffer of `er.buffer_size`.
Paper (appendix, ViT-B/16): buffer 500, 10 replayed samples per batch, LR 1e-4, WD 1e-4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, paper
from olora_jax.methods import base, common, replay


def init_with_buffer(ctx: base.Context, block, tx, n_logits: int = 0):
  """`init(key, params)` of a reservoir-replay baseline: the common state plus "buffer"."""

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx)
    return {**state, "buffer": replay.init(block.buffer_size, ctx.image_shape, n_logits)}

  return init


def replay_loss(apply, params, frozen, batch: dict, mem: dict):
  """CE(batch) + CE(replayed) from one forward pass over both; (loss, terms). Pure."""
  n = batch["labels"].shape[0]
  logits = apply(frozen, params, jnp.concatenate([batch["images"], mem["images"]]))
  ce = common.per_example_ce(logits, jnp.concatenate([batch["labels"], mem["labels"]]))
  ce_current = common.masked_mean(ce[:n], batch["mask"])
  ce_replay = common.masked_mean(ce[n:], mem["mask"])
  return ce_current + ce_replay, dict(ce_current=ce_current, ce_replay=ce_replay)


def make(ctx: base.Context, name: str, block, retrieve) -> base.Method:
  """A reservoir-replay method: one Adam step on CE(batch) + CE(retrieved), then the batch enters
  the reservoir. `retrieve(apply, state, batch, key) -> replay.sample-like dict` picks what to
  replay from the buffer (ER: uniformly; MIR: the most interfered)."""
  scale = ctx.config.data.input_scale
  tx, apply = common.optimizer_and_apply(ctx, block)

  @common.train_step(name)
  def train_step(state, batch):
    retrieve_key, update_key = jax.random.split(common.step_key(state))
    mem = retrieve(apply, state, batch, retrieve_key)
    (loss, aux), grads = jax.value_and_grad(functools.partial(replay_loss, apply), has_aux=True)(
        state["params"], state["frozen"], batch, mem)
    state = common.apply_gradients(state, grads, tx)
    state["buffer"] = replay.reservoir_update(state["buffer"], batch, update_key, scale)
    return state, {"loss": loss, **aux}, {}

  return base.Method(name=name, init=init_with_buffer(ctx, block, tx), train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def build(ctx: base.Context) -> base.Method:
  """ER from the `er` config block: the `Method` whose replay draws `replay_batch` stored samples
  uniformly (`replay.sample`) each step."""
  block, scale = ctx.config.er, ctx.config.data.input_scale
  return make(ctx, "er", block, lambda apply, state, batch, key: replay.sample(
      state["buffer"], key, common.replay_batch(ctx, block), scale))


def config():
  """The `er` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=common.shared(1e-4, paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      replay_batch=Key(10, "stored samples drawn uniformly and replayed with each batch, at most"
                       " buffer_size; 0 = learner.batch_size (the online-continual-learning"
                       " codebase's eps_mem_batch, 10)",
                       paper(10, config_keys.PAPER_TABLE + ": episode memory per batch")))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((44.85, 1.83), (44.67, 4.29)),
        "imagenet_r disjoint/10 vit_b16": ((40.99, 3.96), (32.38, 0.89)),
        "imagenet_sketch disjoint/10 vit_b16": ((30.21, 0.7), (37.14, 1.83)),
        "caltech_birds2011 disjoint/5 vit_b16": ((31.66, 0.83), (14.23, 0.07)),
        "cifar100 disjoint/10 vit_s16": ((31.91, 2.06), (52.21, 6.41)),
        "imagenet_r disjoint/10 vit_s16": ((32.73, 0.2), (45.37, 1.72)),
        "imagenet_sketch disjoint/10 vit_s16": ((19.53, 1.44), (45.1, 0.48)),
        "caltech_birds2011 disjoint/5 vit_s16": ((21.81, 3.02), (24.52, 2.98)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((42.6, 0.75), (38.68, 0.26)),
        "core50 domain/8 swin_t": ((88.93, 2.99), (4.16, 0.09)),
    },
}

METHODS = (base.MethodSpec(name="er", build=build, config=config, report_name="ER",
                           table_row=2, paper_results=PAPER_RESULTS),)
