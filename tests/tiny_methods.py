"""A method built on a random tiny ViT, for the method tests that drive its functions directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from configs import tiny
from olora_jax.methods import base
from olora_jax.models.vit import VisionTransformer


def build(module, spec, num_classes: int, batch_size: int = 8, **block):
  """(method, its initial state, model): `module`'s first method on a random ViT of `spec` with
  a `num_classes`-way head, its config block updated with `block`."""
  config = tiny.get_config()
  name = module.METHODS[0].name
  config.method = name
  for key, value in block.items():
    config[name][key] = value
  shape = (spec.image_size, spec.image_size, 3)
  model = VisionTransformer(spec, num_classes)
  method = module.build(base.Context(config=config, model=model, spec=spec,
                                     num_classes=num_classes, batch_size=batch_size,
                                     image_shape=shape))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, *shape)))["params"]
  return method, jax.jit(method.init)(jax.random.key(1), params), model
