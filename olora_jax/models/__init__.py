"""The backbones and the one place that picks between them from the `model` config section.

`model.name` is a ViT preset (`vit_ti16` ... `vit_h14`), `custom` (a ViT of the config's sizes),
a Swin preset (`swin_t`, `swin_s`, `swin_b`) or `swin_custom` (a Swin of the config's sizes:
`model.width` the embedding width, `model.stage_depths`, `model.stage_heads`,
`model.window_size`, `model.patch_size`). Both backbones take the same call
(`model.apply({"params": ...}, images, lora=...)`) and the same LoRA tree layout
(olora_jax/models/lora.py), so every method runs on either ViT or Swin; the ResNet has no
attention and no pretrained weights, and runs the methods that train the whole model
(`olora_jax.validation.check_model_supports_method`: models/ never imports the method registry).
"""

from __future__ import annotations

from typing import Any

from olora_jax import errors
from olora_jax.models import lora as lora_lib
from olora_jax.models import resnet, swin, vit

# Methods built on the ViT's structure alone, with why: the prompt methods prompt a ViT's token
# sequence or its attention (olora_jax/methods/prompt_pool.py), and InfLoRA / SD-LoRA stack their
# LoRA branches into one array over blocks of one width (a Swin's stages differ in width).
VIT_ONLY_METHODS = {
    "l2p": "inserts prompt tokens into a ViT's token sequence",
    "mvp": "inserts prompt tokens into a ViT's token sequence",
    "dualprompt": "prepends prefix tokens to the keys and values of a ViT's attention",
    "coda_prompt": "prepends prefix tokens to the keys and values of a ViT's attention",
    "hide_prompt": "prepends prefix tokens to the keys and values of a ViT's attention",
    "inflora": "stacks its LoRA branches over a ViT's blocks of one width",
    "sd_lora": "stacks its LoRA branches over a ViT's blocks of one width",
}


# Methods that cannot run with model.scan_blocks, with why.
UNSCANNED_METHODS = {
    "inflora": "reads each block's input through Flax's capture_intermediates, which a scanned"
               " block does not expose",
}


class ModelError(errors.BadInput):
  """A model config that cannot run with the chosen method or learner settings."""


def spec_from_config(model_config: Any) -> vit.ViTSpec | swin.SwinSpec | resnet.ResNetSpec:
  """The backbone's static sizes from the `model` config section: a `ViTSpec` for a ViT preset or
  `custom`, a `SwinSpec` for a Swin preset or `swin_custom`, a `ResNetSpec` for
  `resnet18_reduced` (module docstring). Validated."""
  name = model_config.name
  if name == resnet.NAME:
    return resnet.spec_from_config(model_config)
  if family(name) == "Swin":
    return swin.spec_from_config(model_config)
  if family(name) == "ViT":
    return vit.spec_from_config(model_config)
  raise ValueError(
      f"unknown model.name={name!r}; use one of {sorted(vit.PRESETS)}, 'custom' (a ViT),"
      f" {sorted(swin.PRESETS)}, {swin.CUSTOM!r} or {resnet.NAME!r}")


def family(name: str) -> str | None:
  """'ViT' or 'Swin', the transformer a model.name builds (a preset or its custom sizes); None
  for the ResNet or an unknown name."""
  if name in swin.PRESETS or name == swin.CUSTOM:
    return "Swin"
  if name in vit.PRESETS or name == "custom":
    return "ViT"
  return None


# The model keys a preset sizes itself, each as (config key, the preset's own value's key): they
# apply to 'custom' (a ViT) and swin_custom only.
_VIT_SIZE_KEYS = (("width", "width"), ("depth", "depth"), ("num_heads", "num_heads"),
                  ("mlp_dim", "mlp_dim"), ("patch_size", "patch_size"))
_SWIN_SIZE_KEYS = (("width", "embed_dim"), ("stage_depths", "depths"),
                   ("stage_heads", "num_heads"), ("window_size", "window_size"),
                   ("patch_size", "patch_size"))


# Every size key of the `model` block (the ViT's and the Swin's); the ResNet reads none.
SIZE_KEYS = frozenset(key for key, _ in _VIT_SIZE_KEYS + _SWIN_SIZE_KEYS)


def preset_sizes(name: str) -> tuple[str, dict[str, Any]] | None:
  """For a preset `model.name`: (the custom name that takes sizes from the config, {model key:
  the preset's value} of every size key the preset ignores); None for 'custom', swin_custom or
  an unknown name."""
  if name in vit.PRESETS:
    return "custom", {key: vit.PRESETS[name][own] for key, own in _VIT_SIZE_KEYS}
  if name in swin.PRESETS:
    return swin.CUSTOM, {key: swin.PRESETS[name][own] for key, own in _SWIN_SIZE_KEYS}
  return None


def is_swin(spec: Any) -> bool:
  return isinstance(spec, swin.SwinSpec)


def is_resnet(spec: Any) -> bool:
  return isinstance(spec, resnet.ResNetSpec)


def build_model(config: Any, spec: vit.ViTSpec | swin.SwinSpec | resnet.ResNetSpec,
                num_classes: int):
  """The Flax classifier of `spec` with a `num_classes` head in `model.compute_dtype` and
  `model.matmul_precision` (`config` resolved by olora_jax/fidelity.py), after the checks that
  need both the model and the method (before any compute): the VIT_ONLY_METHODS need a ViT, the
  LoRA rank must fit the narrowest adapted layer, and model.scan_blocks needs a ViT and a method
  outside UNSCANNED_METHODS."""
  dtype = vit.COMPUTE_DTYPES[config.model.compute_dtype]
  precision = config.model.matmul_precision
  if precision not in vit.MATMUL_PRECISIONS:
    raise ModelError(f"model.matmul_precision={precision!r}: use one of {vit.MATMUL_PRECISIONS}"
                     " (None takes the fidelity's default: resolve the config first)")
  if is_resnet(spec):
    if config.model.scan_blocks:
      raise ModelError(f"model.scan_blocks=True scans a ViT's encoder blocks and"
                       f" model.name={resnet.NAME!r} has none; set model.scan_blocks=False")
    return resnet.ReducedResNet(spec, num_classes, dtype=dtype, matmul_precision=precision)
  if config.model.scan_blocks and is_swin(spec):
    raise ModelError("model.scan_blocks=True scans a ViT's encoder blocks and the Swin has none"
                     " of one shape; set model.scan_blocks=False")
  if config.model.scan_blocks and config.method in UNSCANNED_METHODS:
    raise ModelError(f"model.scan_blocks=True: method={config.method!r}"
                     f" {UNSCANNED_METHODS[config.method]}; set model.scan_blocks=False")
  if is_swin(spec):
    if config.method in VIT_ONLY_METHODS:
      raise ModelError(
          f"method={config.method!r} {VIT_ONLY_METHODS[config.method]} and has no Swin version;"
          f" use a ViT model.name ({', '.join(sorted(vit.PRESETS))}) or another method")
    narrowest = lora_lib.max_rank(spec)
    if config.learner.rank > narrowest:
      raise ModelError(
          f"learner.rank={config.learner.rank} is larger than the Swin's first-stage width"
          f" {narrowest} (LoRA sits on every stage's q and v); use learner.rank <= {narrowest}")
    return swin.SwinTransformer(spec, num_classes, dtype=dtype, matmul_precision=precision)
  return vit.VisionTransformer(spec, num_classes, dtype=dtype, matmul_precision=precision,
                               scan_blocks=bool(config.model.scan_blocks))
