"""ER, experience replay (Chaudhry et al. 2019): reservoir buffer, random retrieval.

Each step: draw `er.replay_batch` stored samples uniformly, take one optimiser step (Adam, or
plain SGD with `er.optimizer='sgd'`) on CE(batch) + CE(replayed), then offer the batch to the
reservoir buffer of `er.buffer_size`. Paper (appendix, ViT-B/16): buffer 500, 10 replayed
samples per batch, LR 1e-4, WD 1e-4.

`replay_pass`: the batch and the replayed samples pass the model together ('joint', one forward
pass) or apart ('separate', two, as the ER-ACE authors' code pclucas14/AML does). On a ViT or a
Swin the two compute the same function; on a model with BatchNorm (the reduced ResNet-18) each
pass normalises with its own rows' statistics, and 'separate' also moves the running statistics
a second time, by the replayed samples, after the batch's move (`replay_statistics`).

`data.replay_draws`: the reservoir decisions and replay draws of every step are read from a file
(another codebase's, olora_jax/methods/replay.py) instead of drawn from the run's key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olora_jax import config_keys, models
from olora_jax.config_keys import Key, ours, paper
from olora_jax.methods import base, common, replay

REPLAY_PASSES = ("joint", "separate")  # `replay_pass`


def init_with_buffer(ctx: base.Context, block, tx, n_logits: int = 0):
  """`init(key, params)` of a reservoir-replay baseline: the common state plus "buffer"."""

  def init(key, params):
    state = common.init_state(key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx)
    return {**state, "buffer": replay.init(block.buffer_size, ctx.image_shape, n_logits)}

  return init


def with_given_draws(ctx: base.Context, block, init, draws_per_step: int = 1,
                     draw_size: int | None = None):
  """`init` with the file of `data.replay_draws`, if set, in the state as "given_draws" (read and
  checked now: `replay.read_draws`, for a method making `draws_per_step` replay draws a step of
  at most `draw_size` slots each, its replay batch when None); `init` itself otherwise."""
  path = ctx.config.data.replay_draws
  if not path:
    return init
  draws = replay.read_draws(path, block.buffer_size, ctx.batch_size,
                            draw_size or common.replay_batch(ctx, block), ctx.stream_steps,
                            draws_per_step, ctx.stream_step_items or None)

  def init_given(key, params):
    return {**init(key, params), "given_draws": jax.tree.map(jnp.asarray, draws)}

  return init_given


def draw(ctx: base.Context, block, state, key, which: int = 0) -> dict:
  """This step's replay draw (its `which`-th of the step, for a method drawing more than once):
  the file's slots (`data.replay_draws`) or `replay_batch` slots drawn uniformly from `key`
  (`replay.sample`)."""
  scale = ctx.config.data.input_scale
  if "given_draws" in state:
    slots = state["given_draws"][replay.REPLAY_FIELDS[which]][state["step"]]
    return replay.given_sample(state["buffer"], slots, scale)
  return replay.sample(state["buffer"], key, common.replay_batch(ctx, block), scale)


def store(ctx: base.Context, state, step, batch, key, logits=None) -> replay.ReplayBuffer:
  """The buffer after the batch is offered to it at stream step `step`, with its `logits` (B, C)
  where the buffer keeps them (DER++): the file's slots (`data.replay_draws`) or the reservoir's
  decisions drawn from `key`."""
  scale = ctx.config.data.input_scale
  if "given_draws" in state:
    return replay.given_update(state["buffer"], batch,
                               state["given_draws"]["stored_slot"][step], scale, logits)
  return replay.reservoir_update(state["buffer"], batch, key, scale, logits)


def replay_forward(ctx: base.Context, block, logits):
  """`forward(params, frozen, batch, *mems) -> (the batch's logits, each replay draw's)` by
  `block.replay_pass` ('joint' where the block has none: one pass over all; 'separate': one pass
  each, in order), with `logits(frozen, params, images, **model_kwargs)` the method's forward
  pass. Apart on a BatchNorm model, each pass normalises with its valid rows' statistics (all
  rows when none is valid: an empty buffer's draw, whose loss is masked, stays finite)."""
  separate = block.get("replay_pass", "joint") == "separate"

  def rows(mask):
    return norm_rows(ctx, mask)

  def forward(params, frozen, batch, *mems):
    parts = (batch, *mems)
    if not separate:
      joint = logits(frozen, params, jnp.concatenate([p["images"] for p in parts]))
      starts = np.cumsum([0] + [p["labels"].shape[0] for p in parts])
      return tuple(joint[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True))
    return tuple(logits(frozen, params, p["images"], **rows(p["mask"])) for p in parts)

  return forward


def norm_rows(ctx: base.Context, mask) -> dict:
  """The model keyword that makes a forward pass on a BatchNorm model normalise with the valid
  rows' statistics alone (`mask`; all rows when none is valid, so that a masked loss stays
  finite); {} on any other model, whose rows never mix."""
  return {"mask": jnp.where(jnp.any(mask), mask, True)} if models.is_resnet(ctx.spec) else {}


def replay_statistics(ctx: base.Context, block, state, *mems) -> dict:
  """The frozen tree with BatchNorm's running statistics moved by each replay draw's valid rows
  in turn, when the replayed samples pass the model apart (`replay_pass='separate'`; a draw with
  none valid moves nothing): the ER-ACE authors' second training forward pass, Mammoth DER++'s
  second and third. `state["frozen"]` otherwise. The batch's own move came first
  (`common.with_batch_statistics`)."""
  frozen = state["frozen"]
  if block.get("replay_pass", "joint") != "separate" or not models.is_resnet(ctx.spec):
    return frozen
  for mem in mems:
    moved = common.moved_batch_statistics(ctx.model, frozen, state["params"], mem["images"],
                                          mem["mask"])
    frozen = jax.tree.map(lambda new, old, m=mem: jnp.where(jnp.any(m["mask"]), new, old),
                          moved, frozen)
  return frozen


def replay_loss(apply, params, frozen, batch: dict, mem: dict):
  """CE(batch) + CE(replayed) from one forward pass over both; (loss, terms). Pure."""
  n = batch["labels"].shape[0]
  logits = apply(frozen, params, jnp.concatenate([batch["images"], mem["images"]]))
  ce = common.per_example_ce(logits, jnp.concatenate([batch["labels"], mem["labels"]]))
  ce_current = common.masked_mean(ce[:n], batch["mask"])
  ce_replay = common.masked_mean(ce[n:], mem["mask"])
  return ce_current + ce_replay, dict(ce_current=ce_current, ce_replay=ce_replay)


def make(ctx: base.Context, name: str, block, retrieve, draw_size: int | None = None
         ) -> base.Method:
  """A reservoir-replay method: one optimiser step on CE(batch) + CE(retrieved), then the batch
  enters the reservoir. `retrieve(apply, state, batch, key) -> replay.sample-like dict` picks what
  to replay from the buffer (ER: uniformly, or as `data.replay_draws` gives; MIR: the most
  interfered; a dict that carries "passes_before", a tuple of draws that passed the model before
  it, has them move the running statistics first, with `replay_pass='separate'`); `draw_size`: the
  slots a given draw may name (`with_given_draws`)."""
  tx, apply = common.optimizer_and_apply(ctx, block)
  forward = replay_forward(ctx, block, apply)
  joint = block.get("replay_pass", "joint") == "joint"

  def loss_fn(params, frozen, batch, mem):
    if joint:
      return replay_loss(apply, params, frozen, batch, mem)
    current, replayed = forward(params, frozen, batch, mem)
    ce_current = common.masked_mean(common.per_example_ce(current, batch["labels"]),
                                    batch["mask"])
    ce_replay = common.masked_mean(common.per_example_ce(replayed, mem["labels"]), mem["mask"])
    return ce_current + ce_replay, dict(ce_current=ce_current, ce_replay=ce_replay)

  @common.train_step(name)
  def train_step(state, batch):
    retrieve_key, update_key = jax.random.split(common.step_key(state))
    step = state["step"]
    mem = retrieve(apply, state, batch, retrieve_key)
    passes = mem.pop("passes_before", ())  # draws that passed the model before `mem` (MIR's)
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], state["frozen"], batch, mem)
    frozen = replay_statistics(ctx, block, state, *passes, mem)
    state = {**common.apply_gradients(state, grads, tx), "frozen": frozen}
    state["buffer"] = store(ctx, state, step, batch, update_key)
    return state, {"loss": loss, **aux}, {}

  init = with_given_draws(ctx, block, init_with_buffer(ctx, block, tx), draw_size=draw_size)
  return base.Method(name=name, init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))


def build(ctx: base.Context) -> base.Method:
  """ER from the `er` config block: the `Method` whose replay draws `replay_batch` stored samples
  uniformly (`replay.sample`) each step, or the slots `data.replay_draws` gives."""
  block = ctx.config.er
  return make(ctx, "er", block, lambda apply, state, batch, key: draw(ctx, block, state, key))


# Why ER, ER-ACE and DER++ pass the batch and the replayed samples through the model together.
ONE_PASS = ("'joint': one forward pass over the batch and the replayed samples: the same function"
            " as a pass for each on a model without BatchNorm (the ViTs), at less cost")


# Whose code runs plain SGD and a separate pass each (`optimizer_keys`): (the code, its learning
# rate, its forward passes a step).
AUTHORS_AML = ("the ER-ACE authors' code, pclucas14/AML", "0.1", "two passes")
# The codebase the Online-LoRA paper took its A-GEM, ER, EWC++, MIR and GDumb numbers from.
OCL = "RaptorMai/online-continual-learning"
# Whose code that is for a method its authors did not write it for (`base.Check.code`).
OCL_CODE = "the code the Online-LoRA paper took its numbers from"
AUTHORS_OCL_AGEM = f"the online-continual-learning codebase's A-GEM ({OCL})"


def optimizer_keys(optimizer_source: config_keys.Source, replay_pass_source: config_keys.Source,
                   optimizer: str = "adam", replay_pass: str = "joint",
                   authors: tuple[str, str, str] = AUTHORS_AML) -> dict:
  """The `optimizer` and `replay_pass` keys ER, ER-ACE and DER++ share, with their meanings and
  the sources of their defaults; `authors` as `AUTHORS_AML`."""
  code, rate, passes = authors
  return dict(
      optimizer=Key(optimizer, "'adam' (PyTorch's Adam, weight_decay added to the gradient) |"
                    f" 'sgd' (plain SGD, no momentum, the same L2: {code}, at learning rate"
                    f" {rate})", optimizer_source),
      replay_pass=Key(replay_pass, "'joint' (the batch and the replayed samples in one forward"
                      f" pass) | 'separate' ({passes}, {code}): the same function but on a model"
                      " with BatchNorm (resnet18_reduced), where each"
                      " pass normalises with its own statistics and 'separate' moves the running"
                      " statistics by the replayed samples too", replay_pass_source))


def config():
  """The `er` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      **optimizer_keys(paper("adam", config_keys.PAPER_SETTINGS), ours(ONE_PASS)),
      learning_rate=Key(1e-4, "the optimiser's learning rate, constant (> 0)",
                        paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      replay_batch=Key(10, "stored samples drawn uniformly and replayed with each batch, at most"
                       " buffer_size; 0 = learner.batch_size (the online-continual-learning"
                       " codebase's eps_mem_batch, 10)",
                       paper(10, config_keys.PAPER_TABLE + ": episode memory per batch")))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((44.85, 1.83), (44.67, 4.29)),
        "imagenet_r disjoint/10 vit_b16": ((40.99, 3.96), (32.38, 0.89)),
        "imagenet_sketch disjoint/10 vit_b16": ((30.21, 0.7), (37.14, 1.83)),
        "caltech_birds2011 disjoint/5 vit_b16": ((31.66, 0.83), (14.23, 0.07)),
        "cifar100 disjoint/10 vit_s16": ((31.91, 2.06), (52.21, 6.41)),
        "imagenet_r disjoint/10 vit_s16": ((32.73, 0.2), (45.37, 1.72)),
        "imagenet_sketch disjoint/10 vit_s16": ((19.53, 1.44), (45.1, 0.48)),
        "caltech_birds2011 disjoint/5 vit_s16": ((21.81, 3.02), (24.52, 2.98)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((42.6, 0.75), (38.68, 0.26)),
        "core50 domain/8 swin_t": ((88.93, 2.99), (4.16, 0.09)),
    },
}

def aml_settings(block: str) -> dict:
  """The settings the checks of ER and ER-ACE (against pclucas14/AML) and of DER++ (against
  aimagelab/mammoth) ran `block` in (`base.Check.settings`): the authors' reduced ResNet-18,
  plain SGD, a forward pass each for the batch and the replayed samples, the whole network
  trained."""
  return {"model.name": "resnet18_reduced", f"{block}.optimizer": "sgd",
          f"{block}.replay_pass": "separate", f"{block}.trainable": "all"}


METHODS = (base.MethodSpec(name="er", build=build, config=config, report_name="ER",
                           table_row=2, paper_results=PAPER_RESULTS,
                           check=base.Check("step", "pclucas14/AML", "tests/test_parity_aml.py",
                                            "and the authors' other settings and replay draws",
                                            settings=aml_settings("er"))),)
