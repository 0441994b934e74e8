"""DER++, dark experience replay++ (Buzzega et al. 2020): replay with stored logits.

The reservoir buffer keeps, with each sample, the logits the model gave it in the step it arrived
(computed before that step's update). Each step draws two independent replay batches of
`der_pp.replay_batch` samples (default 0: as many as the learner's batch, as Mammoth's DER++
whose replay batch defaults to the batch size; `common.replay_batch`) and minimises
    CE(batch) + alpha * mean ||f(x') - z'||^2 + beta * CE(f(x''), y'')
with z' the stored logits (never refreshed). Paper: buffer 500, alpha 0.2, beta 0.5, LR 3e-4 (no
weight decay), Adam.

`optimizer='sgd'` (plain SGD) and `replay_pass='separate'` (the batch and the two draws in three
forward passes, in that order, as Mammoth's `observe` does; on a model with BatchNorm each pass
normalises with its own rows and moves the running statistics) express Mammoth's settings; the
defaults keep one Adam step on one joint pass. `data.replay_draws`: the reservoir decisions and
both draws of every step are read from a file (another codebase's, olora_jax/methods/replay.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, ours, paper
from olora_jax.methods import base, common, er


def ce_current(state, logits, batch):
  """DER++'s loss on the current batch: CE over all classes; (loss, terms). Pure."""
  ce = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
  return ce, dict(ce_current=ce)


def make(ctx: base.Context, name: str, block, current_loss=ce_current) -> base.Method:
  """DER++ with `current_loss(state, logits (B, C), batch) -> (loss, terms)` on the current batch
  (LODE decouples it); the replay terms and the buffer are DER++'s."""
  tx, apply = common.optimizer_and_apply(ctx, block)
  forward = er.replay_forward(ctx, block, apply)

  @common.train_step(name)
  def train_step(state, batch):
    key_logits, key_labels, update_key = jax.random.split(common.step_key(state), 3)
    step = state["step"]
    m1 = er.draw(ctx, block, state, key_logits, which=0)  # for the logit term
    m2 = er.draw(ctx, block, state, key_labels, which=1)  # for the label term

    def loss_fn(params):
      logits, logits_1, logits_2 = forward(params, state["frozen"], batch, m1, m2)
      current, terms = current_loss(state, logits, batch)
      logit_mse = common.masked_mean(
          jnp.mean(jnp.square(logits_1 - m1["logits"]), axis=-1), m1["mask"])
      ce_replay = common.masked_mean(common.per_example_ce(logits_2, m2["labels"]), m2["mask"])
      loss = current + block.alpha * logit_mse + block.beta * ce_replay
      return loss, dict(**terms, logit_mse=logit_mse, ce_replay=ce_replay, batch_logits=logits)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    stored = jax.lax.stop_gradient(aux.pop("batch_logits"))  # pre-update logits of the batch
    frozen = er.replay_statistics(ctx, block, state, m1, m2)
    state = {**common.apply_gradients(state, grads, tx), "frozen": frozen}
    state["buffer"] = er.store(ctx, state, step, batch, update_key, stored)
    return state, {"loss": loss, **aux}, {}

  init = er.init_with_buffer(ctx, block, tx, ctx.num_classes)
  return base.Method(name=name, init=er.with_given_draws(ctx, block, init, draws_per_step=2),
                     train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def build(ctx: base.Context) -> base.Method:
  return make(ctx, "der_pp", ctx.config.der_pp)


def replay_keys() -> dict:
  """DER++'s own keys, each `Key(default, meaning)` (the paper's values); LODE's block and EMA on
  DER++'s declare them from here."""
  return dict(
      replay_batch=Key(0, "samples in each of DER++'s two replay draws per step, at most"
                       " buffer_size; 0 = learner.batch_size (Mammoth's default)",
                       authors(0, "aimagelab/mammoth, utils/best_args.py: minibatch_size equal"
                               " to batch_size (32) for buffer 500; 0 here is the learner's"
                               " batch")),
      alpha=Key(0.2, "weight of the MSE between replayed samples' logits and the logits stored"
                " with them (>= 0)", paper(0.2, config_keys.PAPER_TABLE + ": DER++'s alpha")),
      beta=Key(0.5, "weight of the CE on the second replay draw's labels (>= 0)",
               paper(0.5, config_keys.PAPER_TABLE + ": DER++'s beta")))


# Mammoth's DER++ (models/derpp.py, its default optimiser in models/utils/continual_model.py).
MAMMOTH = "aimagelab/mammoth"
AUTHORS_MAMMOTH = (f"Mammoth's DER++, {MAMMOTH}", "0.03", "three passes")


def config():
  """The `der_pp` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      **er.optimizer_keys(paper("adam", config_keys.PAPER_SETTINGS), ours(er.ONE_PASS),
                          authors=AUTHORS_MAMMOTH),
      learning_rate=common.shared(3e-4, paper(3e-4, rate=True)),
      weight_decay=common.shared(0.0, paper(0.0, config_keys.PAPER_TABLE + ": DER++'s row gives"
                                            " no weight decay (Mammoth's optim_wd 0)")),
      buffer_size=common.shared(500, common.PAPER_BUFFER), **replay_keys())


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((36.64, 6.11), (56.94, 7.55)),
        "imagenet_r disjoint/10 vit_b16": ((30.9, 8.04), (24.26, 4.14)),
        "imagenet_sketch disjoint/10 vit_b16": ((6.47, 0.06), (15.34, 0.15)),
        "caltech_birds2011 disjoint/5 vit_b16": ((26.61, 1.27), (32.16, 0.55)),
        "cifar100 disjoint/10 vit_s16": ((17.67, 4.04), (51.65, 3.67)),
        "imagenet_r disjoint/10 vit_s16": ((22.17, 4.27), (54.79, 0.89)),
        "imagenet_sketch disjoint/10 vit_s16": ((18.15, 0.66), (46.22, 0.95)),
        "caltech_birds2011 disjoint/5 vit_s16": ((29.53, 2.37), (21.49, 1.16)),
    },
}

METHODS = (base.MethodSpec(name="der_pp", build=build, config=config, report_name="DER++",
                           table_row=7, paper_results=PAPER_RESULTS,
                           check=base.Check("step", MAMMOTH, "tests/test_parity_mammoth.py",
                                            "and the authors' other settings and replay draws",
                                            settings=er.aml_settings("der_pp"))),)
