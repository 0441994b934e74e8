"""Online-LoRA (the paper's method) on the method interface.

State pytree: {"state": learner.online_lora.TrainState (LoRA, head, Adam state, Omega, k, step,
key), "frozen": the backbone with every merged LoRA, "buffer": the hard buffer}. The numerics
live in `olora_jax.learner.online_lora`; this module wires them to the loop:

    train_step   paper steps 1-2 (loss on batch + hard buffer + L_LoRA, one Adam step)  [jitted]
    after_step   step 3: the loss window and plateau/peak rule (learner/plateau.py)   [host]
                 step 4: on a plateau, `consolidate` (importance on the buffer this step
                         trained on, Omega, merge, new LoRA)                            [jitted]
                 step 5: the hard-buffer update from the step's pre-update losses       [jitted]

Config: the `learner` block (configs/common.py); `learner.incremental_lora=False` turns off the
window, plateaus and consolidation (single LoRA with the hard buffer).
"""

from __future__ import annotations

from olora_jax.learner import buffer as buffer_lib
from olora_jax.learner import online_lora
from olora_jax.learner import plateau as plateau_lib
from olora_jax.methods import base


def window_to_json(window: plateau_lib.PlateauState) -> dict:
  d = window._asdict()
  d["values"] = list(window.values)
  return d


def window_from_json(d: dict) -> plateau_lib.PlateauState:
  d = dict(d)
  d["values"] = tuple(float(v) for v in d["values"])
  return plateau_lib.PlateauState(**d)


def build(ctx: base.Context) -> base.Method:
  """Online-LoRA from the `learner` config block; raises ValueError on a bad value."""
  c = ctx.config.learner
  plateau_config = plateau_lib.PlateauConfig(
      window=c.window, mean_threshold=c.mean_threshold, var_threshold=c.var_threshold,
      check_partial_window=c.check_partial_window)
  tx = online_lora.make_optimizer(c.learning_rate)
  learner_config = online_lora.LearnerConfig(
      rank=c.rank, reg_lambda=c.reg_lambda, hard_loss=c.hard_loss,
      reset_opt_state_at_merge=c.reset_opt_state_at_merge, buffer_unit=c.buffer_unit,
      window_value=c.window_value, importance=c.importance, merge=c.merge,
      new_lora_init=c.new_lora_init)
  buffer_lib.init_buffer(c.buffer_size, (1,))  # validates the size
  learner = online_lora.make_learner(ctx.model, tx, learner_config)
  spec, incremental = ctx.spec, c.incremental_lora

  def init(key, params):
    backbone, head = online_lora.split_params(params)
    return {"state": online_lora.init_train_state(key, head, spec, learner_config, tx),
            "frozen": online_lora.init_frozen(backbone, spec, learner_config),
            "buffer": online_lora.init_buffer(learner_config, c.buffer_size, ctx.batch_size,
                                              ctx.image_shape)}

  def train_step(s, batch):
    state, scalars, scores = learner.train_step(s["state"], s["frozen"], s["buffer"], batch)
    return {**s, "state": state}, scalars, scores

  def predict(s, images):
    return learner.predict(s["state"], s["frozen"], images)

  def after_step(s, host, step, batch, scalars, scores):
    state, frozen, events, values = s["state"], s["frozen"], (), {}
    if incremental:
      window, stats = plateau_lib.update(window_from_json(host["window"]),
                                         scalars["window_value"], plateau_config)
      host = {"window": window_to_json(window)}
      values = dict(window_mean=stats.mean, window_var=stats.var)
      if stats.fired:
        # Importance on the buffer used in this step, then merge (paper steps 4a-4d).
        state, frozen = learner.consolidate(state, frozen, s["buffer"])
        events = (("plateau", dict(n_plateaus=window.n_plateaus, window_mean=stats.mean,
                                   window_var=stats.var)),)
    buf = learner.update_buffer(s["buffer"], batch, scores)  # paper step 5, after step 4
    return ({"state": state, "frozen": frozen, "buffer": buf}, host,
            base.StepReport(events=events, train_values=values))

  return base.Method(name="online_lora", init=init, train_step=train_step, predict=predict,
                     after_step=after_step,
                     init_host=lambda: {"window": window_to_json(plateau_lib.init())})
