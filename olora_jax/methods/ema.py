"""EMA (Soutif-Cormerais et al. 2023): evaluate an exponential moving average of the weights.

Wraps a method (DER++: `ema_der_pp`; RAR: `ema_rar`): training is the inner method's, unchanged;
after each step the average of the trainable weights moves towards them,
    ema <- lambda * ema + (1 - lambda) * params,
with lambda = `ema_warmup_decay` for the first `ema_warmup_steps` steps, then `ema_decay`. The
average starts at the initial weights; `predict` (what the evaluator reads) uses it. Paper:
lambda 0.9 during warm-up, then 0.99, LR 2e-4; the warm-up length (`ema_warmup_steps`, 100
batches) is *ours*.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax.methods import base, der_pp, rar


def update(ema, params, decay):
  """ema <- decay * ema + (1 - decay) * params, leaf by leaf. Pure."""
  return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)


def wrap(inner: base.Method, block) -> base.Method:
  """`inner` with its evaluated weights replaced by their moving average (state "ema_params")."""

  def init(key, params):
    state = inner.init(key, params)
    return {**state, "ema_params": jax.tree.map(jnp.array, state["params"])}

  def train_step(state, batch):
    state, scalars, extras = inner.train_step(state, batch)
    decay = jnp.where(state["step"] <= block.ema_warmup_steps, block.ema_warmup_decay,
                      block.ema_decay)
    return {**state, "ema_params": update(state["ema_params"], state["params"], decay)}, \
        scalars, extras

  def predict(state, images):
    return inner.predict({**state, "params": state["ema_params"]}, images)

  return base.Method(name=inner.name, init=init, train_step=train_step, predict=predict)


def build_der_pp(ctx: base.Context) -> base.Method:
  return wrap(der_pp.make(ctx, "ema_der_pp", ctx.config.ema_der_pp), ctx.config.ema_der_pp)


def build_rar(ctx: base.Context) -> base.Method:
  return wrap(rar.make(ctx, "ema_rar", ctx.config.ema_rar), ctx.config.ema_rar)
