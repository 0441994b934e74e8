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

import os

from olora_jax import pretrained as pretrained_lib
from olora_jax.learner import buffer as buffer_lib
from olora_jax.learner import online_lora
from olora_jax.learner import plateau as plateau_lib
from olora_jax.methods import base

EXPORT_FILENAME = "online_lora.safetensors"  # export_online_lora=True


window_to_json = plateau_lib.to_json
window_from_json = plateau_lib.from_json


def build(ctx: base.Context) -> base.Method:
  """Online-LoRA from the `learner` config block; raises ValueError on a bad value."""
  c = ctx.config.learner
  plateau_config = plateau_lib.PlateauConfig(
      window=c.window, mean_threshold=c.mean_threshold, var_threshold=c.var_threshold,
      check_partial_window=c.check_partial_window)
  tx = online_lora.make_optimizer(c.learning_rate, bias_correction=c.adam_bias_correction)
  learner_config = online_lora.LearnerConfig(
      rank=c.rank, reg_lambda=c.reg_lambda, hard_loss=c.hard_loss,
      reset_opt_state_at_merge=c.reset_opt_state_at_merge, buffer_unit=c.buffer_unit,
      window_value=c.window_value, importance=c.importance, merge=c.merge,
      new_lora_init=c.new_lora_init)
  buffer_lib.check_size(c.buffer_size)
  learner = online_lora.make_learner(ctx.model, tx, learner_config)
  spec, incremental = ctx.spec, c.incremental_lora
  # learner.initial_lora: (first LoRA, frozen pair) in the authors' layout, else (None, None).
  initial_lora, initial_frozen_lora = (
      pretrained_lib.load_online_lora(c.initial_lora, spec, c.rank) if c.initial_lora
      else (None, None))

  def init(key, params):
    backbone, head = online_lora.split_params(params)  # None: the first LoRA from `key`
    return {"state": online_lora.init_train_state(key, head, spec, learner_config, tx,
                                                  lora=initial_lora),
            "frozen": online_lora.init_frozen(backbone, spec, learner_config,
                                              initial_frozen_lora),
            "buffer": online_lora.init_buffer(learner_config, c.buffer_size, ctx.batch_size,
                                              ctx.image_shape)}

  def train_step(s, batch):
    state, scalars, scores = learner.train_step(s["state"], s["frozen"], s["buffer"], batch)
    return {**s, "state": state}, scalars, scores

  def predict(s, images):
    return learner.predict(s["state"], s["frozen"], images)

  def after_step(s, host, step, batch, scalars, scores, finite, trace):
    state, frozen, events, values, stats = s["state"], s["frozen"], (), {}, None
    if not finite:  # skipped: no window value, no buffer update
      trace.record_step(step, scalars, None, scores, buffer_updated=False)
      return s, host, base.StepReport()
    if incremental:
      before = window_from_json(host["window"])
      window, stats = plateau_lib.update(before, scalars["window_value"], plateau_config)
      host = {"window": window_to_json(window)}
      values = dict(window_mean=stats.mean, window_var=stats.var)
      if stats.rearmed:  # a peak since the last plateau: a plateau may fire again
        events = (plateau_lib.rearm_event(stats, before),)
      if stats.fired:
        # Importance on the buffer used in this step, then merge (paper steps 4a-4d).
        merged_lora = trace.fetch(state.trainable["lora"])  # consolidate donates the state
        state, frozen = learner.consolidate(state, frozen, s["buffer"])
        trace.record_plateau(step, merged_lora, state.omega,
                             frozen.get(online_lora.FROZEN_LORA))
        events += (("plateau", dict(n_plateaus=window.n_plateaus, window_mean=stats.mean,
                                    window_var=stats.var)),)
    buf = learner.update_buffer(s["buffer"], batch, scores)  # paper step 5, after step 4
    trace.record_step(step, scalars, stats, scores, buffer_updated=True)
    return ({"state": state, "frozen": frozen, "buffer": buf}, host,
            base.StepReport(events=events, train_values=values))

  def finish(s, workdir):
    """The final model in the authors' layout, for their code to load."""
    state, frozen = s["state"], s["frozen"]
    pretrained_lib.save_online_lora_safetensors(
        {**{k: v for k, v in frozen.items() if k != online_lora.FROZEN_LORA},
         "head": state.trainable["head"]}, state.trainable["lora"],
        os.path.join(workdir, EXPORT_FILENAME), frozen_lora=frozen.get(online_lora.FROZEN_LORA))

  return base.Method(name="online_lora", init=init, train_step=train_step, predict=predict,
                     after_step=after_step,
                     init_host=lambda: {"window": window_to_json(plateau_lib.init())},
                     finish=finish if ctx.config.export_online_lora else None,
                     trainable=lambda s: s["state"].trainable)  # the current LoRA and the head


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((49.4, 1.36), (41.74, 2.58)),
        "imagenet_r disjoint/10 vit_b16": ((48.18, 0.63), (23.85, 1.48)),
        "imagenet_sketch disjoint/10 vit_b16": ((47.06, 0.24), (28.09, 3.25)),
        "caltech_birds2011 disjoint/5 vit_b16": ((41.46, 0.31), (13.64, 0.68)),
        "cifar100 disjoint/10 vit_s16": ((32.16, 0.24), (38.64, 0.65)),
        "imagenet_r disjoint/10 vit_s16": ((33.21, 0.5), (42.76, 0.18)),
        "imagenet_sketch disjoint/10 vit_s16": ((22.45, 0.43), (44.56, 0.24)),
        "caltech_birds2011 disjoint/5 vit_s16": ((37.41, 0.16), (20.78, 2.54)),
    },
    "table2": {
        "cifar100 si_blurry/5 vit_b16": ((60.12, 5.79), (61.7, 6.29)),
        "imagenet_r si_blurry/5 vit_b16": ((45.05, 1.59), (48.0, 6.01)),
        "imagenet_sketch si_blurry/5 vit_b16": ((30.81, 2.09), (30.22, 4.36)),
        "cifar100 si_blurry/5 vit_s16": ((52.84, 7.97), (58.72, 1.44)),
        "imagenet_r si_blurry/5 vit_s16": ((39.47, 1.93), (36.61, 4.63)),
        "imagenet_sketch si_blurry/5 vit_s16": ((15.35, 0.92), (20.18, 1.84)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((53.75, 0.29), (32.86, 0.89)),
        "core50 domain/8 swin_t": ((95.29, 0.06), (0.0, 0.0)),
    },
}

METHODS = (base.MethodSpec(
    name="online_lora", build=build, config=None, report_name="Online-LoRA", table_row=90,
    paper_results=PAPER_RESULTS, paper_row_names={"table2": "Online-LoRA w/o hard loss"},
    check=base.Check("step", "Christina200/Online-LoRA-official",
                     "tests/test_parity_online_lora.py",
                     settings={"fidelity": "reference", "learner.incremental_lora": True,
                               "learner.hard_loss": True})),)
