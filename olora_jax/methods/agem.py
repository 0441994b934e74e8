"""A-GEM, averaged gradient episodic memory (Chaudhry et al. 2019).

Each step: g = gradient of CE(batch); g_ref = gradient of CE on `agem.replay_batch` samples drawn
from the reservoir buffer. When g . g_ref < 0 the update uses g - (g . g_ref / g_ref . g_ref) g_ref
(so it no longer increases the memory loss to first order), else g itself. Then the batch enters
the reservoir. Paper: buffer 500, LR 1e-4, WD 1e-4.

`replay_pass`: on a model with BatchNorm (resnet18_reduced) the memory draw's pass normalises with
its valid samples' statistics; 'separate' also moves the running statistics by that pass, after
the batch's, as a second PyTorch forward pass does (the online-continual-learning codebase's
A-GEM); 'joint' (default) moves them by the batch alone, as for every other method.

`data.replay_draws`: the reservoir decisions and the memory draws of every step are read from a
file (another codebase's, olora_jax/methods/replay.py) instead of drawn from the run's key.
"""

from __future__ import annotations

import jax

from olora_jax.config_keys import Key, authors, ours, paper
from olora_jax.methods import base, common, er


def project(grads, ref_grads):
  """A-GEM's projection of `grads` against `ref_grads` (pytrees of one structure). Pure."""
  dot = common.tree_dot(grads, ref_grads)
  ref_sq = common.tree_dot(ref_grads, ref_grads)
  scale = jax.numpy.where(dot < 0, dot / jax.numpy.maximum(ref_sq, 1e-30), 0.0)
  return jax.tree.map(lambda g, r: g - scale * r, grads, ref_grads), dot


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.agem
  tx, apply = common.optimizer_and_apply(ctx, block)

  def ce(params, frozen, images, labels, mask, rows):
    logits = apply(frozen, params, images, **rows)
    return common.masked_mean(common.per_example_ce(logits, labels), mask)

  @common.train_step("agem")
  def train_step(state, batch):
    sample_key, update_key = jax.random.split(common.step_key(state))
    step = state["step"]
    mem = er.draw(ctx, block, state, sample_key)
    grad_fn = jax.value_and_grad(ce)
    loss, grads = grad_fn(state["params"], state["frozen"], batch["images"], batch["labels"],
                          batch["mask"], {})
    # A draw from a buffer holding fewer samples is padded: its pass normalises with the valid.
    ce_memory, ref_grads = grad_fn(state["params"], state["frozen"], mem["images"],
                                   mem["labels"], mem["mask"], er.norm_rows(ctx, mem["mask"]))
    grads, dot = project(grads, ref_grads)
    frozen = er.replay_statistics(ctx, block, state, mem)
    state = {**common.apply_gradients(state, grads, tx), "frozen": frozen}
    state["buffer"] = er.store(ctx, state, step, batch, update_key)
    return state, {"loss": loss, "ce_memory": ce_memory, "grad_dot_memory": dot}, {}

  init = er.with_given_draws(ctx, block, er.init_with_buffer(ctx, block, tx))
  return base.Method(name="agem", init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def config():
  """The `agem` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=common.shared(1e-4, paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      replay_pass=Key("joint", "on a model with BatchNorm (resnet18_reduced): 'joint' (the"
                      " running statistics move by the batch's pass alone) | 'separate' (the"
                      " memory draw's pass moves them too, after the batch's, as in"
                      f" {er.AUTHORS_OCL_AGEM}); the same on a model without BatchNorm",
                      ours("'joint': the statistics move by the stream's samples alone, as for"
                           " every method here (common.with_batch_statistics)")),
      replay_batch=Key(10, "stored samples drawn uniformly each step for the reference gradient"
                       " g_ref, at most buffer_size; 0 = learner.batch_size",
                       authors(10, "RaptorMai/online-continual-learning, general_main.py:"
                               " --eps_mem_batch")))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((12.67, 1.87), (82.51, 2.27)),
        "imagenet_r disjoint/10 vit_b16": ((5.6, 2.74), (53.97, 1.97)),
        "imagenet_sketch disjoint/10 vit_b16": ((0.16, 0.04), (9.42, 0.17)),
        "caltech_birds2011 disjoint/5 vit_b16": ((10.84, 1.57), (47.79, 0.04)),
        "cifar100 disjoint/10 vit_s16": ((7.43, 2.15), (82.45, 5.46)),
        "imagenet_r disjoint/10 vit_s16": ((2.35, 0.87), (48.01, 0.05)),
        "imagenet_sketch disjoint/10 vit_s16": ((2.75, 2.86), (18.81, 0.44)),
        "caltech_birds2011 disjoint/5 vit_s16": ((1.4, 0.17), (27.06, 1.39)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((31.67, 0.96), (50.12, 0.27)),
        "core50 domain/8 swin_t": ((90.15, 1.31), (1.16, 0.05)),
    },
}

METHODS = (base.MethodSpec(name="agem", build=build, config=config, report_name="AGEM",
                           table_row=1, paper_results=PAPER_RESULTS,
                           check=base.Check("step", er.OCL, "tests/test_parity_ocl.py",
                                            "with the paper's Adam at 1e-4 (weight decay 1e-4, 10"
                                            " replayed), batch 10, a 100-slot buffer and their"
                                            " reservoir decisions and memory draws: all 40 steps"
                                            " and 5 task ends of one seed, float32",
                                            settings={"model.name": "resnet18_reduced",
                                                      "agem.replay_pass": "separate",
                                                      "agem.trainable": "all"},
                                            code=er.OCL_CODE)),)
