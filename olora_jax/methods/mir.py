"""MIR, maximally interfered retrieval (Aljundi et al. 2019).

Each step: draw `mir.n_candidates` stored samples uniformly; take a virtual SGD step on CE(batch)
with the learning rate, theta_v = theta - lr * grad; retrieve the `mir.replay_batch` candidates
whose loss rises most, CE(theta_v) - CE(theta); take one Adam step on CE(batch) + CE(retrieved);
then offer the batch to the reservoir. Paper: buffer 500, 50 candidates, LR 1e-4, WD 1e-4; the
10 retrieved per batch follow the original code's memory batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, paper
from olora_jax.methods import base, common, er, replay


def interference(apply, params, frozen, batch: dict, candidates: dict, learning_rate: float):
  """Per candidate (N,): CE after the virtual SGD step on the batch minus CE before; -inf for an
  invalid candidate. Pure."""

  def ce(p, images, labels):
    return common.per_example_ce(apply(frozen, p, images), labels)

  grads = jax.grad(lambda p: common.masked_mean(ce(p, batch["images"], batch["labels"]),
                                                batch["mask"]))(params)
  virtual = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
  rise = (ce(virtual, candidates["images"], candidates["labels"])
          - ce(params, candidates["images"], candidates["labels"]))
  return jnp.where(candidates["mask"], rise, -jnp.inf)


def build(ctx: base.Context) -> base.Method:
  block, scale = ctx.config.mir, ctx.config.data.input_scale

  def retrieve(apply, state, batch, key):
    candidates = replay.sample(state["buffer"], key, block.n_candidates, scale)
    rise = interference(apply, state["params"], state["frozen"], batch, candidates,
                        block.learning_rate)
    _, top = jax.lax.top_k(rise, common.replay_batch(ctx, block))
    return jax.tree.map(lambda x: x[top], candidates)

  return er.make(ctx, "mir", block, retrieve)


def config():
  """The `mir` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=Key(1e-4, "Adam's learning rate, constant (> 0); also the step size of the"
                        " virtual SGD step that scores interference", paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      n_candidates=Key(50, "stored samples drawn uniformly each step as retrieval candidates"
                       " (the paper's \"number of subsample\"), in [replay_batch, buffer_size]",
                       paper(50, config_keys.PAPER_TABLE + ": number of subsample")),
      replay_batch=Key(10, "candidates replayed per step: those whose loss a virtual step on the"
                       " batch raises most, at most n_candidates; 0 = learner.batch_size",
                       authors(10, "RaptorMai/online-continual-learning, general_main.py:"
                               " --eps_mem_batch")))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((48.36, 3.11), (43.41, 1.02)),
        "imagenet_r disjoint/10 vit_b16": ((41.51, 2.99), (31.32, 5.17)),
        "imagenet_sketch disjoint/10 vit_b16": ((30.33, 3.81), (35.92, 1.75)),
        "caltech_birds2011 disjoint/5 vit_b16": ((31.64, 2.97), (23.43, 0.05)),
        "cifar100 disjoint/10 vit_s16": ((29.08, 1.14), (39.42, 1.6)),
        "imagenet_r disjoint/10 vit_s16": ((34.73, 0.29), (48.66, 0.69)),
        "imagenet_sketch disjoint/10 vit_s16": ((13.96, 1.95), (42.61, 0.08)),
        "caltech_birds2011 disjoint/5 vit_s16": ((22.95, 1.12), (32.54, 0.88)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((42.9, 0.19), (38.49, 0.15)),
        "core50 domain/8 swin_t": ((87.47, 0.65), (5.67, 0.14)),
    },
}

METHODS = (base.MethodSpec(name="mir", build=build, config=config, report_name="MIR",
                           table_row=4, paper_results=PAPER_RESULTS),)
