"""Continual-learning methods on one interface (`olora_jax.methods.base.Method`).

`REGISTRY` maps the `method` config key to the module whose `build(ctx) -> Method` makes it;
docs/methods.md describes every method and how to add one.
"""

from __future__ import annotations

from olora_jax.methods import base
from olora_jax.methods import online_lora

REGISTRY = {
    "online_lora": online_lora.build,
}


def build(ctx: base.Context) -> base.Method:
  """The method named by `ctx.config.method`; ValueError for an unknown name."""
  name = ctx.config.method
  if name not in REGISTRY:
    raise ValueError(f"unknown method={name!r}; use one of {tuple(REGISTRY)}")
  return REGISTRY[name](ctx)
