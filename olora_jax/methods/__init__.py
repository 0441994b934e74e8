"""Continual-learning methods on one interface (`olora_jax.methods.base.Method`).

`REGISTRY` maps the `method` config key to the module whose `build(ctx) -> Method` makes it;
docs/methods.md describes every method and how to add one.
"""

from __future__ import annotations

from olora_jax.methods import (
  agem,
  base,
  der_pp,
  ema,
  er,
  ewc_pp,
  finetune,
  gdumb,
  l2p,
  lode,
  mir,
  mvp,
  online_lora,
  pcr,
)

# method name -> builder; every baseline `name` reads the config block `config.<name>`.
REGISTRY = {
    "online_lora": online_lora.build,
    "finetune": finetune.build,
    "iid": finetune.build_iid,
    "er": er.build,
    "der_pp": der_pp.build,
    "ewc_pp": ewc_pp.build,
    "agem": agem.build,
    "mir": mir.build,
    "gdumb": gdumb.build,
    "pcr": pcr.build,
    "lode": lode.build,
    "ema_der_pp": ema.build_der_pp,
    "ema_rar": ema.build_rar,
    "l2p": l2p.build,
    "mvp": mvp.build,
}


def build(ctx: base.Context) -> base.Method:
  """The method named by `ctx.config.method`; ValueError for an unknown name."""
  name = ctx.config.method
  if name not in REGISTRY:
    raise ValueError(f"unknown method={name!r}; use one of {tuple(REGISTRY)}")
  return REGISTRY[name](ctx)
