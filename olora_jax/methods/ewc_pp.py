"""EWC++ (Chaudhry et al. 2018): EWC with an online, running-average Fisher.

Loss: CE(batch) + lambda * sum_i F~_i (theta_i - theta*_i)^2, as the online-continual-learning
codebase the paper took EWC++ from computes it (no 1/2). Every step adds the squared gradient of
CE(batch) to an accumulator; every `ewc_pp.fisher_every` steps the running Fisher becomes
    F <- alpha * (accumulator / fisher_every) + (1 - alpha) * F
the accumulator is cleared and the anchor theta* moves to the current weights. Task-free: the
period replaces the task boundaries at which that code consolidates. The penalty weighs with
F~ = `normalise(F)`: `ewc_pp.fisher_normalisation` 'min_max' (default, the source code's: one
min and one max over every trainable tensor together, F~ = (F - min) / (max - min), in [0, 1])
or 'none' (the raw running Fisher, a documented variant). The source code accumulates the
squared gradient of its whole loss, penalty included; ours that of CE(batch). Paper: lambda 100,
alpha 0.9, Fisher updated every 50 batches, LR 1e-4, WD 1e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Constant, Key, authors, paper
from olora_jax.methods import base, common


def update_fisher(fisher, accumulator, alpha: float, every: int):
  """F <- alpha * accumulator / every + (1 - alpha) * F, leaf by leaf. Pure."""
  return jax.tree.map(lambda f, a: alpha * (a / every) + (1.0 - alpha) * f, fisher, accumulator)


NORMALISATIONS = ("min_max", "none")
MIN_MAX_EPS = 1e-32  # the source code's guard against max == min (an all-zero Fisher stays 0)
CONSTANTS = {
    "MIN_MAX_EPS": Constant("added to max - min in the min_max Fisher normalisation",
                            authors(1e-32, "RaptorMai/online-continual-learning,"
                                    " agents/ewc_pp.py: the normalised Fisher's guard")),
}


def normalise(fisher, mode: str):
  """The Fisher the penalty weighs with: 'min_max' rescales every leaf by the global min and max
  over all leaves to [0, 1]; 'none' returns it as is. Pure."""
  if mode == "none":
    return fisher
  leaves = jax.tree.leaves(fisher)
  lo = jnp.min(jnp.stack([jnp.min(x) for x in leaves]))
  hi = jnp.max(jnp.stack([jnp.max(x) for x in leaves]))
  return jax.tree.map(lambda f: (f - lo) / (hi - lo + MIN_MAX_EPS), fisher)


def penalty_and_grad(params, anchor, fisher, reg_lambda: float, mode: str):
  """(lambda * sum F~ (theta - theta*)^2, its gradient 2 lambda F~ (theta - theta*)). Pure."""
  weight = normalise(fisher, mode)
  diff = jax.tree.map(jnp.subtract, params, anchor)
  weighted = jax.tree.map(jnp.multiply, weight, diff)
  return (reg_lambda * common.tree_dot(weighted, diff),
          jax.tree.map(lambda w: 2.0 * reg_lambda * w, weighted))


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.ewc_pp
  if block.fisher_normalisation not in NORMALISATIONS:
    raise ValueError(f"unknown ewc_pp.fisher_normalisation={block.fisher_normalisation!r}; use"
                     f" one of {NORMALISATIONS}")
  tx, apply = common.optimizer_and_apply(ctx, block)

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx)
    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    return {**state, "fisher": zeros, "fisher_accumulator": jax.tree.map(jnp.zeros_like, zeros),
            "anchor": jax.tree.map(jnp.array, state["params"])}

  @common.train_step("ewc_pp")
  def train_step(state, batch):

    def ce(params):
      logits = apply(state["frozen"], params, batch["images"])
      return common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])

    ce_current, ce_grads = jax.value_and_grad(ce)(state["params"])
    # The penalty and its gradient in closed form.
    penalty, penalty_grads = penalty_and_grad(state["params"], state["anchor"], state["fisher"],
                                              block.reg_lambda, block.fisher_normalisation)
    grads = jax.tree.map(jnp.add, ce_grads, penalty_grads)
    accumulator = jax.tree.map(lambda a, g: a + jnp.square(g), state["fisher_accumulator"],
                               ce_grads)
    state = common.apply_gradients(state, grads, tx)
    due = state["step"] % block.fisher_every == 0  # every `fisher_every` steps taken
    fisher = update_fisher(state["fisher"], accumulator, block.alpha, block.fisher_every)
    pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(due, n, o), new, old)  # noqa: E731
    state.update(fisher=pick(fisher, state["fisher"]),
                 fisher_accumulator=pick(jax.tree.map(jnp.zeros_like, accumulator), accumulator),
                 anchor=pick(state["params"], state["anchor"]))
    return state, {"loss": ce_current + penalty, "ce_current": ce_current,
                   "ewc_penalty": penalty}, {}

  return base.Method(name="ewc_pp", init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def config():
  """The `ewc_pp` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=common.shared(1e-4, paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      reg_lambda=Key(100.0, "lambda, the weight of the penalty sum F~ (theta - theta*)^2 (>= 0;"
                     " set for the min_max Fisher)", paper(100.0)),
      alpha=Key(0.9, "weight of the newest Fisher estimate in the running average, in [0, 1]",
                paper(0.9)),
      fisher_every=Key(50, "train steps between Fisher (and anchor theta*) updates (>= 1)",
                       paper(50, config_keys.PAPER_TABLE + ": training batches between Fisher"
                             " updates")),
      fisher_normalisation=Key("min_max", "'min_max' (the source code's: the Fisher rescaled to"
                               " [0, 1] over every trainable tensor together) | 'none' (the raw"
                               " running Fisher)",
                               authors("min_max", "RaptorMai/online-continual-learning,"
                                       " agents/ewc_pp.py: the normalised Fisher")))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((10.61, 0.74), (84.1, 1.11)),
        "imagenet_r disjoint/10 vit_b16": ((3.86, 2.02), (56.95, 1.46)),
        "imagenet_sketch disjoint/10 vit_b16": ((0.32, 0.28), (22.46, 4.69)),
        "caltech_birds2011 disjoint/5 vit_b16": ((26.14, 3.46), (47.69, 0.07)),
        "cifar100 disjoint/10 vit_s16": ((6.8, 2.13), (81.59, 7.43)),
        "imagenet_r disjoint/10 vit_s16": ((1.32, 0.83), (53.54, 0.19)),
        "imagenet_sketch disjoint/10 vit_s16": ((4.08, 3.24), (21.28, 0.46)),
        "caltech_birds2011 disjoint/5 vit_s16": ((2.07, 0.54), (28.44, 0.83)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((29.57, 1.57), (51.87, 0.04)),
        "core50 domain/8 swin_t": ((90.91, 1.28), (0.04, 0.02)),
    },
}

METHODS = (base.MethodSpec(name="ewc_pp", build=build, config=config, report_name="EWC++",
                           table_row=3, paper_results=PAPER_RESULTS),)
