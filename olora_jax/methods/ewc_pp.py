"""EWC++ (Chaudhry et al. 2018): EWC with an online, running-average Fisher.

Loss: CE(batch) + lambda * sum_i F~_i (theta_i - theta*_i)^2, as the online-continual-learning
codebase the paper took EWC++ from computes it (no 1/2). Every step adds the squared gradient of
CE(batch) to an accumulator; every `ewc_pp.fisher_every` steps the running Fisher becomes
    F <- alpha * (accumulator / fisher_every) + (1 - alpha) * F
the accumulator is cleared and the anchor theta* moves to the current weights. Task-free: the
period replaces the task boundaries at which that code consolidates. The penalty weighs with
F~ = `normalise(F)`: `ewc_pp.fisher_normalisation` 'min_max' (default, the source code's: one
min and one max over every trainable tensor together, F~ = (F - min) / (max - min), in [0, 1])
or 'none' (the raw running Fisher, a documented variant). Paper: lambda 100, alpha 0.9, Fisher
updated every 50 batches, LR 1e-4, WD 1e-4.

Three switches take the source code's steps instead (tests/test_parity_ocl.py checks them against
it; docs/parity.md), each off by default:
  consolidate='boundary'  the anchor moves, and the penalty's Fisher becomes normalise(F), only at
                          the boundaries the run's boundary switch signals (`at_boundary`;
                          `boundaries.rule` 'oracle': the code's end of each `train_learner`
                          call, a task); between them the penalty keeps both. With rule 'none'
                          nothing consolidates. Default 'period': both every `fisher_every` steps.
  fisher_of='loss'        the accumulator adds the squared gradient of the whole loss, penalty
                          included (the code squares its parameters' .grad after backward).
                          Default 'ce': that of CE(batch), the Fisher of the log-likelihood.
  fisher_window='task'    the running Fisher updates at the start of every step i (counted from 0
                          since the last boundary, or the stream's start) with (i + 1) %
                          fisher_every == 0, from what accumulated since the previous update (the
                          accumulator is not cleared at a boundary): the code's update at the top
                          of its batch loop. Default 'stream': after every `fisher_every`-th step
                          of the stream, from the `fisher_every` steps just taken.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Constant, Key, authors, paper
from olora_jax.methods import base, common, er

OCL = er.OCL  # the code the Online-LoRA paper took its EWC++ numbers from


def update_fisher(fisher, accumulator, alpha: float, every: int):
  """F <- alpha * accumulator / every + (1 - alpha) * F, leaf by leaf. Pure."""
  return jax.tree.map(lambda f, a: alpha * (a / every) + (1.0 - alpha) * f, fisher, accumulator)


NORMALISATIONS = ("min_max", "none")
CONSOLIDATIONS = ("period", "boundary")  # where the anchor and the penalty's Fisher move
FISHER_OF = ("ce", "loss")  # whose squared gradient the accumulator adds
FISHER_WINDOWS = ("stream", "task")  # where the running Fisher's updates fall
MIN_MAX_EPS = 1e-32  # the source code's guard against max == min (an all-zero Fisher stays 0)
CONSTANTS = {
    "MIN_MAX_EPS": Constant("added to max - min in the min_max Fisher normalisation",
                            authors(1e-32, f"{OCL}, agents/ewc_pp.py: the normalised"
                                    " Fisher's guard")),
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
  for key, allowed in (("fisher_normalisation", NORMALISATIONS), ("consolidate", CONSOLIDATIONS),
                       ("fisher_of", FISHER_OF), ("fisher_window", FISHER_WINDOWS)):
    if block[key] not in allowed:
      raise ValueError(f"unknown ewc_pp.{key}={block[key]!r}; use one of {allowed}")
  tx, apply = common.optimizer_and_apply(ctx, block)
  at_boundaries = block.consolidate == "boundary"
  task_window = block.fisher_window == "task"
  every = block.fisher_every

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx)
    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    state = {**state, "fisher": zeros, "fisher_accumulator": jax.tree.map(jnp.zeros_like, zeros),
             "anchor": jax.tree.map(jnp.array, state["params"])}
    if at_boundaries:  # the penalty's Fisher, set at each boundary (none yet: no penalty)
      state["penalty_fisher"] = jax.tree.map(jnp.zeros_like, zeros)
    if task_window:  # steps since the last boundary (or the stream's start)
      state["task_step"] = jnp.zeros((), jnp.int32)
    return state

  def pick(due, new, old):
    return jax.tree.map(lambda n, o: jnp.where(due, n, o), new, old)

  @common.train_step("ewc_pp")
  def train_step(state, batch):
    if task_window:  # the update at the top of the step, before its gradient
      due = (state["task_step"] + 1) % every == 0
      fisher = update_fisher(state["fisher"], state["fisher_accumulator"], block.alpha, every)
      state = {**state, "fisher": pick(due, fisher, state["fisher"]),
               "fisher_accumulator": pick(due, jax.tree.map(jnp.zeros_like, fisher),
                                          state["fisher_accumulator"]),
               "task_step": state["task_step"] + 1}
      if not at_boundaries:
        state["anchor"] = pick(due, state["params"], state["anchor"])

    def ce(params):
      logits = apply(state["frozen"], params, batch["images"])
      return common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])

    ce_current, ce_grads = jax.value_and_grad(ce)(state["params"])
    # The penalty and its gradient in closed form.
    if at_boundaries:  # the Fisher normalised at the last boundary
      penalty, penalty_grads = penalty_and_grad(state["params"], state["anchor"],
                                                state["penalty_fisher"], block.reg_lambda, "none")
    else:
      penalty, penalty_grads = penalty_and_grad(state["params"], state["anchor"], state["fisher"],
                                                block.reg_lambda, block.fisher_normalisation)
    grads = jax.tree.map(jnp.add, ce_grads, penalty_grads)
    accumulator = jax.tree.map(lambda a, g: a + jnp.square(g), state["fisher_accumulator"],
                               grads if block.fisher_of == "loss" else ce_grads)
    state = common.apply_gradients(state, grads, tx)
    if task_window:
      state.update(fisher_accumulator=accumulator)
    else:
      due = state["step"] % every == 0  # every `fisher_every` steps taken
      fisher = update_fisher(state["fisher"], accumulator, block.alpha, every)
      state.update(fisher=pick(due, fisher, state["fisher"]),
                   fisher_accumulator=pick(due, jax.tree.map(jnp.zeros_like, accumulator),
                                           accumulator))
      if not at_boundaries:
        state.update(anchor=pick(due, state["params"], state["anchor"]))
    return state, {"loss": ce_current + penalty, "ce_current": ce_current,
                   "ewc_penalty": penalty}, {}

  @jax.jit
  def consolidate(state):
    """A boundary: the anchor moves to the current weights and the penalty's Fisher becomes the
    normalised running Fisher (consolidate='boundary'); the window restarts (fisher_window=
    'task')."""
    state = dict(state)
    if at_boundaries:
      state.update(anchor=jax.tree.map(jnp.array, state["params"]),
                   penalty_fisher=normalise(state["fisher"], block.fisher_normalisation))
    if task_window:
      state["task_step"] = jnp.zeros_like(state["task_step"])
    return state

  told = at_boundaries or task_window
  return base.Method(name="ewc_pp", init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x),
                     at_boundary=(lambda s, host: (consolidate(s), host)) if told else None)


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
                               authors("min_max", f"{OCL}, agents/ewc_pp.py: the normalised"
                                       " Fisher")),
      consolidate=Key("period", "where the anchor theta* moves and the penalty's Fisher is"
                      " normalised: 'period' every `fisher_every` steps (task-free) | 'boundary'"
                      " at each boundary the boundary switch signals (boundaries.rule; with"
                      " 'none' never)",
                      authors("boundary", f"{OCL}, agents/ewc_pp.py: train_learner's end (one"
                              " call a task) sets prev_params and normalized_fisher",
                              differs="'period', task-free: the Online-LoRA paper's baselines"
                              " see no task ends, and a period of `fisher_every` steps stands"
                              " in for them")),
      fisher_of=Key("ce", "whose squared gradient the Fisher accumulates: 'ce' CE(batch)'s (the"
                    " log-likelihood's) | 'loss' the whole loss's, penalty included",
                    authors("loss", f"{OCL}, agents/ewc_pp.py: accum_fisher squares .grad after"
                            " the backward of total_loss (CE + penalty)",
                            differs="'ce', the Fisher information EWC++ (Chaudhry et al. 2018)"
                            " defines: the log-likelihood's squared gradient, without the"
                            " penalty's")),
      fisher_window=Key("stream", "where the running Fisher's updates fall: 'stream' after every"
                        " `fisher_every`-th step of the stream, from the steps just taken |"
                        " 'task' at the start of every step i (from 0 since the last boundary)"
                        " with (i + 1) % fisher_every == 0, from what accumulated since the last"
                        " update",
                        authors("task", f"{OCL}, agents/ewc_pp.py: update_running_fisher at the"
                                " top of the batch loop, batch i of the call with (i + 1) %"
                                " fisher_update_after == 0; tmp_fisher kept across calls",
                                differs="'stream', task-free: a window of the `fisher_every`"
                                " steps just taken, counted over the stream")))


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
                           table_row=3, paper_results=PAPER_RESULTS,
                           check=base.Check("step", OCL, "tests/test_parity_ocl.py",
                                            "with the paper's Adam at 1e-4 (weight decay 1e-4),"
                                            " lambda 100 and alpha 0.9, batch 10, the Fisher"
                                            " updated every 3 batches (8 a task): all 40 steps"
                                            " and 5 task ends of one seed, float32",
                                            settings={"model.name": "resnet18_reduced",
                                                      "boundaries.rule": "oracle",
                                                      "ewc_pp.consolidate": "boundary",
                                                      "ewc_pp.fisher_of": "loss",
                                                      "ewc_pp.fisher_window": "task",
                                                      "ewc_pp.fisher_normalisation": "min_max",
                                                      "ewc_pp.trainable": "all"},
                                            code=er.OCL_CODE)),)
