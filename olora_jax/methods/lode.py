"""LODE, loss decoupling (Liang & Li 2023), on DER++.

DER++ (der_pp.py) with its CE on the current batch replaced by LODE's decoupled loss:
    C * CE over the new classes' logits only                       (tell new classes apart)
  + rho * |new| / |old| * mean -log sigma(lse(new logits) - lse(old logits))   (new vs old)
where lse is log-sum-exp. Task-free: the new classes are those in the current batch, the old ones
those seen in earlier batches and absent from this one (`lode.class_seen` in the state, updated
after each step); no task id is used. While no old class exists the term is DER++'s plain CE.
DER++'s replay terms (logit MSE, replayed CE) and buffer are unchanged. Paper: C 1.0, rho 0.1,
LR 3e-4 (DER++'s alpha 0.2 and beta 0.5).

`new_classes='unseen'` expresses the authors' code (liangyanshuo/Loss-Decoupling-for-Task-
Agnostic-Continual-Learning, models/lode_derpp.py), whose new classes are every class from the
current task's first on (`arange(task * n, num_classes)`), the classes not seen yet included:
there the softmaxes of both terms also hold the never-seen classes' logits (the weight stays
rho * |the batch's classes| / |old|, their rho / task when each batch holds its task's classes).
DER++'s keys (`optimizer`, `replay_pass`) and `data.replay_draws` are read as DER++ reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, ours, paper
from olora_jax.methods import base, common, der_pp, er


def decoupled_loss(logits: jax.Array, labels: jax.Array, mask: jax.Array, class_seen: jax.Array,
                   c: float, rho: float, unseen_new: bool = False) -> tuple[jax.Array, dict]:
  """LODE's loss on the current batch (module docstring); logits (B, C), labels (B,), mask (B,),
  class_seen (C,) bool before this batch; `unseen_new`: the never-seen classes count as new
  (`new_classes='unseen'`). (loss, terms). Pure."""
  in_batch = common.classes_in(labels, mask, logits.shape[-1])
  old = class_seen & ~in_batch
  new = ~old if unseen_new else in_batch
  n_new, n_old = jnp.sum(in_batch), jnp.sum(old)
  intra_new = common.masked_mean(
      common.per_example_ce(common.restrict_logits(logits, new), labels), mask)
  lse_new = jax.nn.logsumexp(common.restrict_logits(logits, new), axis=-1)
  lse_old = jax.nn.logsumexp(common.restrict_logits(logits, old), axis=-1)
  inter = common.masked_mean(jnp.logaddexp(lse_new, lse_old) - lse_new, mask)
  lode = c * intra_new + rho * n_new / jnp.maximum(n_old, 1) * inter
  plain = common.masked_mean(common.per_example_ce(logits, labels), mask)
  loss = jnp.where(n_old > 0, lode, plain)
  return loss, dict(ce_current=loss, lode_inter=inter, old_classes=n_old)


def build(ctx: base.Context) -> base.Method:
  block, num_classes = ctx.config.lode, ctx.num_classes

  def current_loss(state, logits, batch):
    return decoupled_loss(logits, batch["labels"], batch["mask"], state["class_seen"], block.c,
                          block.rho, block.new_classes == "unseen")

  inner = der_pp.make(ctx, "lode", block, current_loss)

  def init(key, params):
    return {**inner.init(key, params), "class_seen": jnp.zeros((num_classes,), bool)}

  def train_step(state, batch):
    state, scalars, extras = inner.train_step(state, batch)
    seen = state["class_seen"] | common.classes_in(batch["labels"], batch["mask"], num_classes)
    return {**state, "class_seen": seen}, scalars, extras

  return base.Method(name="lode", init=init, train_step=train_step, predict=inner.predict)


def config():
  """The `lode` block: DER++'s keys and values plus LODE's C and rho (the paper's values)."""
  return common.baseline_block(
      learning_rate=common.shared(3e-4, paper(3e-4, rate=True)),
      weight_decay=common.shared(0.0, paper(0.0, config_keys.PAPER_TABLE + ": LODE's row gives"
                                            " no weight decay (the authors' Mammoth fork: 0)")),
      buffer_size=common.shared(500, common.PAPER_BUFFER), **der_pp.replay_keys(),
      **er.optimizer_keys(paper("adam", config_keys.PAPER_SETTINGS), ours(er.ONE_PASS),
                          authors=AUTHORS_LODE),
      c=Key(1.0, "C, the weight of the CE over the new classes' logits only (> 0)",
            paper(1.0, config_keys.PAPER_TABLE + ": LODE's C")),
      rho=Key(0.1, "rho, the weight of the new-vs-old term, scaled by |new| / |old| (>= 0)",
              paper(0.1, config_keys.PAPER_TABLE + ": LODE's rho")),
      new_classes=Key("batch", "which classes both terms call new: 'batch' (the current batch's)"
                      " | 'unseen' (the batch's and every class not seen yet, as the authors'"
                      " code's arange(task * n, num_classes)); old: seen before and absent from"
                      " the batch", ours("task-free, the batch's classes are the new task's;"
                                         " the classes not seen yet are left out of both"
                                         " terms' softmaxes")))


NEW_CLASSES = ("batch", "unseen")  # `new_classes`
# The LODE authors' code (`er.optimizer_keys`): (the code, its learning rate, its forward passes).
AUTHORS_REPOSITORY = "liangyanshuo/Loss-Decoupling-for-Task-Agnostic-Continual-Learning"
AUTHORS_LODE = (f"the LODE authors' code (a Mammoth fork), {AUTHORS_REPOSITORY}", "0.03",
                "three passes")


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((44.29, 1.48), (45.54, 3.32)),
        "imagenet_r disjoint/10 vit_b16": ((42.2, 6.46), (31.83, 1.05)),
        "imagenet_sketch disjoint/10 vit_b16": ((9.97, 2.29), (8.48, 1.24)),
        "caltech_birds2011 disjoint/5 vit_b16": ((39.2, 4.25), (41.64, 3.59)),
        "cifar100 disjoint/10 vit_s16": ((28.65, 3.06), (40.42, 1.58)),
        "imagenet_r disjoint/10 vit_s16": ((31.65, 0.72), (43.72, 0.09)),
        "imagenet_sketch disjoint/10 vit_s16": ((17.59, 0.84), (47.85, 0.23)),
        "caltech_birds2011 disjoint/5 vit_s16": ((26.81, 0.89), (21.86, 2.3)),
    },
}

METHODS = (base.MethodSpec(name="lode", build=build, config=config, report_name="LODE (DER++)",
                           table_row=8, paper_results=PAPER_RESULTS,
                           check=base.Check("step", AUTHORS_REPOSITORY, "tests/test_parity_lode.py",
                                            "with the authors' other settings (SGD at 0.001, 200"
                                            " slots) and both replay draws, on a stream whose every"
                                            " batch holds its task's two classes: 40 steps (32 with"
                                            " old classes), 5 task ends, float32",
                                            settings={"model.name": "resnet18_reduced",
                                                      "lode.optimizer": "sgd",
                                                      "lode.replay_pass": "separate",
                                                      "lode.new_classes": "unseen",
                                                      "lode.trainable": "all"})),)
