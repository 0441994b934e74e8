"""RAR, repeated augmented rehearsal (Zhang et al. 2022), on ER.

ER (er.py) where each incoming batch is rehearsed `repeats` times: each repeat draws a fresh
`replay_batch` of stored samples uniformly, augments the current and replayed images (`augment`,
unless the block's `augment` is False: a random horizontal flip unless `flip` is False, and a
random shift of up to 1/8 of the side, edges replicated) and takes one Adam step on CE(batch) +
CE(replayed) from one forward pass over both, each step followed by `after_update` where a
wrapper gives one (EMA's average moves after every rehearsal, ema.py); then the batch enters the
reservoir once. `step` counts batches, as for every method. The paper runs RAR only under EMA
(`ema_rar`, ema.py) and gives no RAR values: `repeats` (3) and the augmentation are *ours*, the
buffer and the 10 replayed samples per batch are ER's.

On a model with BatchNorm each rehearsal is a training forward pass, as each of the EMA authors'
passes is (AlbinSou/online_ema): the pass normalises with its valid rows' statistics (the
masked rows of a draw from a buffer not yet full stay out), and each rehearsal moves the running
statistics once: the first by the loop's move before the step (`common.with_batch_statistics`,
the batch's valid rows), each later one by the batch's valid rows as that rehearsal sees them,
with the weights the previous rehearsal left.

`scalars`: "loss" (and its terms) is the last rehearsal's; with `repeats` > 1, each rehearsal's
loss is logged too, as "loss_rehearsal{r}" (r from 0).

`data.replay_draws`: the reservoir decisions of every step and its replay draw are read from a
file (er.py) instead of drawn from the run's key; every rehearsal of a step replays the step's
given draw.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from olora_jax.methods import base, common, er


def augment(key: jax.Array, images: jax.Array, flip: bool = True) -> jax.Array:
  """images (N, H, W, 3) -> (N, H, W, 3): per image a random horizontal flip (when `flip`: not
  for data a mirror changes, such as digits) and a random shift by up to max(H // 8, 1) pixels
  in each direction (edge pixels replicated). Pure."""
  n, h, w, _ = images.shape
  pad = max(h // 8, 1)
  flip_key, y_key, x_key = jax.random.split(key, 3)
  flip = jax.random.bernoulli(flip_key, 0.5, (n,)) & flip
  images = jnp.where(flip[:, None, None, None], images[:, :, ::-1], images)
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
  dy = jax.random.randint(y_key, (n,), 0, 2 * pad + 1)
  dx = jax.random.randint(x_key, (n,), 0, 2 * pad + 1)
  crop = lambda im, y, x: jax.lax.dynamic_slice(im, (y, x, 0), (h, w, im.shape[-1]))  # noqa: E731
  return jax.vmap(crop)(padded, dy, dx)


def make(ctx: base.Context, name: str, block, after_update=None) -> base.Method:
  """RAR under `name` with `block`'s keys; `after_update(state, step) -> state`, if given, runs
  after each rehearsal's optimizer step, `step` being the stream step that rehearsal belongs to
  (1 for the first batch)."""
  tx, apply = common.optimizer_and_apply(ctx, block)

  def pass_loss(params, frozen, seen, mem):
    # One pass over the batch and the replayed samples, normalised (BatchNorm) by the valid rows.
    rows = er.norm_rows(ctx, jnp.concatenate([seen["mask"], mem["mask"]]))
    return er.replay_loss(functools.partial(apply, **rows), params, frozen, seen, mem)

  loss_fn = jax.value_and_grad(pass_loss, has_aux=True)
  shifted = (lambda key, images: augment(key, images, block.flip)) if block.augment else (
      lambda key, images: images)

  @common.train_step(name)
  def train_step(state, batch):
    key, update_key = jax.random.split(common.step_key(state))
    step = state["step"]

    def rehearse(r, state):
      sample_key, aug_key, mem_aug_key = jax.random.split(jax.random.fold_in(key, r), 3)
      mem = er.draw(ctx, block, state, sample_key)
      seen = {**batch, "images": shifted(aug_key, batch["images"])}
      mem = {**mem, "images": shifted(mem_aug_key, mem["images"])}
      # The running statistics: the first rehearsal's moved before the step (the loop's move),
      # each later one's here, by this rehearsal's pass of the batch (a no-op without BatchNorm).
      if r > 0:
        state = {**state, "frozen": common.moved_batch_statistics(
            ctx.model, state["frozen"], state["params"], seen["images"], batch["mask"])}
      (loss, aux), grads = loss_fn(state["params"], state["frozen"], seen, mem)
      state = common.apply_gradients(state, grads, tx)
      if after_update is not None:
        state = after_update(state, step + 1)
      return state, {"loss": loss, **aux}

    # The rehearsals unrolled, not a lax.fori_loop: XLA's CPU backend runs convolutions inside a
    # loop's body many times slower (the reduced ResNet-18 at 32 px, batch 10, 2-core AMD EPYC:
    # 20 steps ran in about 285 s in a loop, 11 s unrolled, for about twice the compile time).
    losses = []
    for r in range(block.repeats):
      state, scalars = rehearse(r, state)
      losses.append(scalars["loss"])
    state = {**state, "step": step + 1,
             "buffer": er.store(ctx, state, step, batch, update_key)}
    if block.repeats > 1:  # each rehearsal's loss besides the last's ("loss")
      scalars.update({f"loss_rehearsal{r}": losses[r] for r in range(block.repeats)})
    return state, scalars, {}  # the last repeat's loss

  init = er.with_given_draws(ctx, block, er.init_with_buffer(ctx, block, tx))
  return base.Method(name=name, init=init, train_step=train_step,
                     predict=lambda s, x: apply(s["frozen"], s["params"], x))
