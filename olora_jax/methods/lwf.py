"""LwF, learning without forgetting (Li & Hoiem, ECCV 2016), task-free.

A teacher, a frozen copy of the trained weights, is taken at each refresh; every step after the
first refresh adds the distillation of the teacher's logits on the incoming batch to the batch's
cross-entropy (no replay, no stored sample):
    KD = T^2 * mean_i sum_c -softmax(t_i / T)_c log softmax(s_i / T)_c
over every class of the head, s the model's logits and t the teacher's (T = `lwf.temperature`, 2
in the paper and the online-continual-learning codebase). The loss weighs them as that codebase
does, by the number n of teacher refreshes so far (its tasks seen):
    (1 / (n + 1)) CE + (1 - 1 / (n + 1)) KD                        (`lwf.kd_weight` 0, default)
or as the paper's lambda_o: CE + kd_weight * KD once a teacher exists (`lwf.kd_weight` > 0).
Task-free: the teacher refreshes every `lwf.refresh_every` train steps (as EWC++'s period stands
for the task ends at which that codebase consolidates), and also at every boundary the run's
boundary switch signals (`at_boundary`; `boundaries.rule` 'oracle' or 'plateau'; with
refresh_every 0 only there: the codebase's LwF, which refreshes at each task end). The refresh
takes effect at the start of the next step (`refresh_due` in the state), after the boundary
step's evaluations. The paper's first stage (training the new head alone) has no counterpart in
a single-head stream and is left out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olora_jax.config_keys import Key, authors, ours
from olora_jax.methods import base, common

# LwF is not in the Online-LoRA paper's table: it runs EWC++'s optimiser settings from there
# (the authors' are SGD 0.1 at batch 10), so the two regularisers compare at one rate.
EWC_SETTINGS = ("EWC++'s settings of the Online-LoRA paper (Adam; the authors' SGD 0.1 at batch"
                " 10), so that the two regularisers compare at one rate")


def distillation(logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                 temperature: float) -> jax.Array:
  """T^2 times the masked mean over items of the cross-entropy between the teacher's softened
  distribution softmax(t / T) and the model's log softmax(s / T), over every class. Pure; no
  gradient reaches the teacher."""
  target = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits) / temperature, axis=-1)
  per_item = -jnp.sum(target * jax.nn.log_softmax(logits / temperature, axis=-1), axis=-1)
  return temperature ** 2 * common.masked_mean(per_item, mask)


def weighted_loss(ce: jax.Array, kd: jax.Array, refreshes: jax.Array, kd_weight: float):
  """The step's loss from CE and KD given the refreshes n so far: CE alone while n = 0; then
  (1/(n+1)) CE + (1 - 1/(n+1)) KD (kd_weight 0) or CE + kd_weight KD. Pure."""
  if kd_weight > 0:
    return ce + jnp.where(refreshes > 0, kd_weight * kd, 0.0)
  new = 1.0 / (refreshes.astype(jnp.float32) + 1.0)
  return new * ce + (1.0 - new) * kd


def build(ctx: base.Context) -> base.Method:
  """LwF from the `lwf` block."""
  block = ctx.config.lwf
  tx, apply = common.optimizer_and_apply(ctx, block)

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx)
    return {**state, "teacher": jax.tree.map(jnp.array, state["params"]),
            "refreshes": jnp.zeros((), jnp.int32), "refresh_due": jnp.zeros((), bool)}

  @common.train_step("lwf")
  def train_step(state, batch):
    due = state["refresh_due"]
    teacher = jax.tree.map(lambda p, t: jnp.where(due, p, t), state["params"], state["teacher"])
    refreshes = state["refreshes"] + due.astype(jnp.int32)
    teacher_logits = apply(state["frozen"], teacher, batch["images"])

    def loss_fn(params):
      logits = apply(state["frozen"], params, batch["images"])
      ce = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
      kd = distillation(logits, teacher_logits, batch["mask"], block.temperature)
      return weighted_loss(ce, kd, refreshes, block.kd_weight), (ce, kd)

    (loss, (ce, kd)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    state = common.apply_gradients(state, grads, tx)
    periodic = (block.refresh_every > 0) & (state["step"] % max(block.refresh_every, 1) == 0)
    state.update(teacher=teacher, refreshes=refreshes, refresh_due=periodic)
    return state, {"loss": loss, "ce_current": ce, "distillation": kd,
                   "teacher_refreshes": refreshes}, {}

  def at_boundary(state, host):
    """The boundary switch's signal: the teacher refreshes at the start of the next step."""
    # Placed from the host: an eager jnp.ones_like would compile a program.
    due = jax.device_put(np.ones((), bool), state["refresh_due"].sharding)
    return {**state, "refresh_due": due}, host

  return base.Method(name="lwf", init=init, train_step=train_step, at_boundary=at_boundary,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def config():
  """The `lwf` block: each key with its meaning (the online-continual-learning codebase's LwF on
  the Online-LoRA paper's baseline optimiser)."""
  return common.baseline_block(
      learning_rate=common.shared(1e-4, ours("1e-4, " + EWC_SETTINGS)),
      weight_decay=common.shared(1e-4, ours("1e-4, " + EWC_SETTINGS)),
      temperature=Key(2.0, "T, the distillation temperature: teacher and model logits are"
                      " divided by it, the loss multiplied by T^2 (> 0; the paper's 2)",
                      authors(2.0, "RaptorMai/online-continual-learning, utils/kd_manager.py:"
                              " the distillation's temperature")),
      kd_weight=Key(0.0, "0: CE weighted 1/(n+1) and distillation 1 - 1/(n+1), n the teacher"
                    " refreshes so far (the online-continual-learning codebase's); > 0: CE +"
                    " kd_weight * distillation (the paper's lambda_o, 1)",
                    authors(0.0, "RaptorMai/online-continual-learning, agents/lwf.py: the"
                            " 1/(n+1) weighting, which 0 selects")),
      refresh_every=Key(50, "train steps between teacher refreshes, the task-free stand-in for"
                        " task ends (as EWC++'s fisher_every); 0: refresh only at the boundaries"
                        " the boundary switch signals (boundaries.rule)",
                        ours("50, EWC++'s period, stands in: the authors refresh the teacher at"
                             " task ends, which a task-free run does not see")))


METHODS = (base.MethodSpec(name="lwf", build=build, config=config, report_name="LwF",
                           table_row=3.5),)
