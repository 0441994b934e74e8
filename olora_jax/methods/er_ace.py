"""ER-ACE, experience replay with asymmetric cross-entropy (Caccia et al., ICLR 2022).

ER's reservoir buffer and uniform replay draw, with the incoming batch's cross-entropy taken over
fewer classes: the classes present in the incoming batch, and the classes never seen so far; the
logits of every class seen before but absent from the batch leave its softmax, so the new samples
do not push the old classes' logits down (the abrupt change of their representation the paper
measures at a task switch). The replayed samples keep the full cross-entropy over every class.
Each step: one Adam step on ACE(batch) + CE(replayed), then the batch enters the reservoir.
`class_seen` (C,) bool in the state marks the classes met so far (the batch's own included
before its loss, as the authors' code updates it first). Task-free: no task id or boundary is
used; the authors' code forces its task-free mode for ER-ACE. The authors' code defaults: 10
replayed samples per incoming batch of 10, SGD; here ER's settings of the Online-LoRA paper
(buffer 500, 10 replayed, Adam, LR 1e-4, WD 1e-4), so that the two rows differ only in the loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from olora_jax.config_keys import Key
from olora_jax.methods import base, common, er, replay


def asymmetric_ce(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                  seen: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(masked mean ACE of the incoming batch, the classes seen after it). ACE is the cross-entropy
  over the classes of the batch's valid items and the classes not in `seen` (C,) bool (never met
  before the batch); a seen class absent from the batch gets `common.ABSENT_LOGIT`. Pure."""
  present = common.classes_in(labels, mask, logits.shape[-1])
  seen = seen | present
  ce = common.per_example_ce(common.restrict_logits(logits, present | ~seen), labels)
  return common.masked_mean(ce, mask), seen


def ace_replay_loss(apply, params, frozen, batch: dict, mem: dict, seen: jax.Array):
  """ACE(batch) + CE(replayed) from one forward pass over both; (loss, (terms, seen after)).
  Pure."""
  n = batch["labels"].shape[0]
  logits = apply(frozen, params, jnp.concatenate([batch["images"], mem["images"]]))
  ce_current, seen = asymmetric_ce(logits[:n], batch["labels"], batch["mask"], seen)
  ce_replay = common.masked_mean(common.per_example_ce(logits[n:], mem["labels"]), mem["mask"])
  return ce_current + ce_replay, (dict(ace_current=ce_current, ce_replay=ce_replay), seen)


def build(ctx: base.Context) -> base.Method:
  """ER-ACE from the `er_ace` block."""
  block, scale = ctx.config.er_ace, ctx.config.data.input_scale
  tx, apply = common.optimizer_and_apply(ctx, block)
  init_buffered = er.init_with_buffer(ctx, block, tx)

  def init(key, params):
    return {**init_buffered(key, params), "class_seen": jnp.zeros((ctx.num_classes,), bool)}

  @common.train_step("er_ace")
  def train_step(state, batch):
    retrieve_key, update_key = jax.random.split(common.step_key(state))
    mem = replay.sample(state["buffer"], retrieve_key, common.replay_batch(ctx, block), scale)
    loss_fn = functools.partial(ace_replay_loss, apply, frozen=state["frozen"], batch=batch,
                                mem=mem, seen=state["class_seen"])
    (loss, (terms, seen)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    state = common.apply_gradients(state, grads, tx)
    state["class_seen"] = seen
    state["buffer"] = replay.reservoir_update(state["buffer"], batch, update_key, scale)
    return state, {"loss": loss, **terms}, {}

  return base.Method(name="er_ace", init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def config():
  """The `er_ace` block: ER's settings (the Online-LoRA paper's for ER), each key with its
  meaning."""
  return common.baseline_block(
      learning_rate=1e-4, weight_decay=1e-4, buffer_size=500,
      replay_batch=Key(10, "stored samples drawn uniformly and replayed with each batch (full"
                       " cross-entropy), at most buffer_size; 0 = learner.batch_size (the"
                       " authors' buffer_batch_size, 10)"))


METHODS = (base.MethodSpec(name="er_ace", build=build, config=config, report_name="ER-ACE",
                           table_row=2.5),)
