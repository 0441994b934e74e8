"""Swin Transformer (Liu et al. 2021) in Flax, with LoRA on the q and v projections of every block.

The architecture is timm's `SwinTransformer` (the layout of `swin_tiny_patch4_window7_224`): a
strided-conv patch embedding followed by a LayerNorm, stages of blocks that attend within
non-overlapping windows, with a learned relative position bias table per block and the windows
shifted by half a window (and the attention masked across the wrap-around) in every second block
of a stage, patch merging (2x2 neighbours concatenated, LayerNorm, bias-free linear 4C -> 2C) at
the start of every stage but the first, a final LayerNorm, global average pooling and one Dense
head. LayerNorm eps 1e-5, exact (erf) GELU, MLP ratio 4.

timm's edge case, followed exactly: when a stage's feature map is no larger than the window, the
window shrinks to the map and the shift is off (Swin-T at 224 px: the last stage is 7x7 with
window 7, so its second block is not shifted). `SwinSpec.window_and_shift` is that rule.

Parameter tree of `SwinTransformer` (`C_s` the width of stage s, `W_s` its window, `H_s` its
heads, `P` the patch):

    patch_embed/{kernel (P, P, 3, C_0), bias (C_0,)}
    patch_embed_norm/{scale, bias}
    stage{s}_merge/norm/{scale, bias} (4 C_{s-1},), reduction/kernel (4 C_{s-1}, C_s)   s >= 1
    stage{s}_block{b}/LayerNorm_0/{scale, bias}
    stage{s}_block{b}/attn/{query, key, value, out}/{kernel (C_s, C_s), bias (C_s,)}
    stage{s}_block{b}/attn/relative_position_bias_table ((2 W_s - 1)^2, H_s)
    stage{s}_block{b}/LayerNorm_1/{scale, bias}
    stage{s}_block{b}/mlp/{fc1 (C_s, 4 C_s), fc2 (4 C_s, C_s)}/{kernel, bias}
    encoder_norm/{scale, bias}
    head/{kernel (C_last, C), bias (C,)}

Every block is a top-level entry with an `attn/{query, value}` pair, as the ViT's
`encoderblock_{i}`, so the LoRA tree (`olora_jax.models.lora`: `stage{s}_block{b}/{query|value}/
{lora_a (C_s, r), lora_b (r, C_s)}`), its merge, Omega and regulariser are the ViT's code: the
learner sees "the adapted layers" whatever backbone holds them (`SwinSpec.lora_layers`).

`dtype` is the computation dtype as for the ViT (olora_jax/models/vit.py): parameters stay
float32; with bfloat16 the attention logits (bias and mask added), softmax and LayerNorm
statistics run in float32 and the logits come back float32. Prompts (L2P, MVP) are ViT-only:
the Swin has no token sequence to insert them into, so `prompts` must be None (the methods a Swin
refuses: `olora_jax.models.VIT_ONLY_METHODS`, docs/models.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from olora_jax.models.vit import HEAD_KERNEL_INIT, LoRADense, MlpBlock, matmul_precision

LAYER_NORM_EPS = 1e-5
MLP_RATIO = 4
# timm's value for the attention between positions of different regions of a shifted window.
MASK_VALUE = -100.0


@dataclasses.dataclass(frozen=True)
class SwinSpec:
  """Static architecture of a Swin Transformer: everything that fixes the shapes but the head."""

  embed_dim: int
  depths: tuple[int, ...]
  num_heads: tuple[int, ...]
  window_size: int
  patch_size: int
  image_size: int

  @property
  def num_stages(self) -> int:
    return len(self.depths)

  @property
  def width(self) -> int:
    """The width of the pooled features (the head's input): the last stage's."""
    return self.stage_width(self.num_stages - 1)

  def stage_width(self, stage: int) -> int:
    return self.embed_dim * 2**stage

  def stage_resolution(self, stage: int) -> int:
    return self.image_size // self.patch_size // 2**stage

  def window_and_shift(self, stage: int, block: int) -> tuple[int, int]:
    """timm's rule: the window shrinks to a feature map no larger than it, and then no shift;
    otherwise every second block of a stage is shifted by half a window."""
    res = self.stage_resolution(stage)
    window = min(self.window_size, res)
    shift = 0 if res <= window or block % 2 == 0 else self.window_size // 2
    return window, shift

  def block_name(self, stage: int, block: int) -> str:
    return f"stage{stage}_block{block}"

  def lora_layers(self) -> dict[str, int]:
    """The blocks whose q and v carry LoRA, in order, with their width."""
    return {self.block_name(s, b): self.stage_width(s)
            for s in range(self.num_stages) for b in range(self.depths[s])}

  def validate(self) -> None:
    if len(self.depths) != len(self.num_heads) or not self.depths:
      raise ValueError(
          f"model.stage_depths={self.depths} and model.stage_heads={self.num_heads} must list one"
          " value per stage (the same number of stages)")
    if min(self.embed_dim, self.window_size, self.patch_size, *self.depths,
           *self.num_heads) < 1:
      raise ValueError(f"model sizes must be >= 1, got {self}")
    if self.image_size % self.patch_size:
      raise ValueError(
          f"model.image_size={self.image_size} is not a multiple of"
          f" model.patch_size={self.patch_size}; resize images to a multiple of the patch")
    grid = self.image_size // self.patch_size
    if grid % 2 ** (self.num_stages - 1):
      raise ValueError(
          f"the {grid}x{grid} patch grid cannot be halved {self.num_stages - 1} times by patch"
          f" merging; pick model.image_size / model.patch_size divisible by"
          f" {2 ** (self.num_stages - 1)}")
    for s in range(self.num_stages):
      width, heads, res = self.stage_width(s), self.num_heads[s], self.stage_resolution(s)
      if width % heads:
        raise ValueError(
            f"stage {s} width {width} is not divisible by its {heads} heads"
            f" (model.stage_heads); pick head counts that divide embed_dim * 2**stage")
      window, _ = self.window_and_shift(s, 0)
      if res % window:
        raise ValueError(
            f"stage {s}'s {res}x{res} feature map is not a multiple of model.window_size="
            f"{self.window_size}; pick a window that divides every stage's resolution")


# Presets (Liu et al. 2021; timm's swin_{tiny,small,base}_patch4_window7_224).
PRESETS = {
    "swin_t": dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7,
                   patch_size=4),
    "swin_s": dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=7,
                   patch_size=4),
    "swin_b": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=7,
                   patch_size=4),
}
CUSTOM = "swin_custom"  # model.name of a Swin sized by the model config's Swin keys


def spec_from_config(model_config: Any) -> SwinSpec:
  """A `SwinSpec` from the `model` config section: a preset, or `swin_custom` with `width` (the
  embedding width), `stage_depths`, `stage_heads`, `window_size` and `patch_size`."""
  name = model_config.name
  if name == CUSTOM:
    sizes = dict(embed_dim=model_config.width, depths=tuple(model_config.stage_depths),
                 num_heads=tuple(model_config.stage_heads),
                 window_size=model_config.window_size, patch_size=model_config.patch_size)
  else:
    sizes = PRESETS[name]
  spec = SwinSpec(image_size=model_config.image_size, **sizes)
  try:
    spec.validate()
  except ValueError as e:
    if name == CUSTOM:
      raise
    # A preset's sizes are fixed (model.window_size and the other Swin keys are swin_custom's):
    # only the image size can be changed.
    step = spec.patch_size * 2 ** (spec.num_stages - 1) * spec.window_size
    reason = str(e).split(";")[0].replace(f"model.window_size={spec.window_size}",
                                          f"the preset's window {spec.window_size}")
    raise ValueError(
        f"model.name={name!r} cannot take model.image_size={spec.image_size} ({reason}; a"
        f" preset's window and patch are its own, model.window_size applies to {CUSTOM!r}"
        f" only); use model.image_size={step} or a multiple of it, or model.name={CUSTOM!r}"
        " to choose the window") from None
  return spec


@functools.cache
def relative_position_index(window: int) -> np.ndarray:
  """(N, N) int32, N = window^2: the row of the bias table for each query/key pair (timm's)."""
  coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
  rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (window - 1)
  return (rel[..., 0] * (2 * window - 1) + rel[..., 1]).astype(np.int32)


def window_partition(x: jnp.ndarray, window: int) -> jnp.ndarray:
  """(B, H, W, C) -> (B * H/w * W/w, w*w, C), windows in row-major order per image."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // window, window, w // window, window, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, window * window, c)


def window_reverse(windows: jnp.ndarray, window: int, h: int, w: int) -> jnp.ndarray:
  c = windows.shape[-1]
  x = windows.reshape(-1, h // window, w // window, window, window, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, h, w, c)


@functools.cache
def shifted_window_mask(resolution: int, window: int, shift: int) -> np.ndarray:
  """(nW, N, N) float32: 0 within a region of the cyclically shifted map, MASK_VALUE across."""
  regions = np.zeros((1, resolution, resolution, 1), np.float32)
  bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
  label = 0
  for hs in bounds:
    for ws in bounds:
      regions[:, hs, ws, :] = label
      label += 1
  ids = np.asarray(window_partition(regions, window))[..., 0]  # (nW, N)
  return np.where(ids[:, None, :] != ids[:, :, None], MASK_VALUE, 0.0).astype(np.float32)


class WindowAttention(nn.Module):
  """Multi-head attention within windows, with a relative position bias (and a shift mask)."""

  num_heads: int
  window: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray, mask: np.ndarray | None,
               lora: dict | None = None) -> jnp.ndarray:
    windows, tokens, width = x.shape
    head_dim = width // self.num_heads
    lora = lora or {}

    def heads(name: str) -> jnp.ndarray:
      y = LoRADense(width, dtype=self.dtype, name=name)(x, lora.get(name))
      return y.reshape(windows, tokens, self.num_heads, head_dim)

    q, k, v = heads("query"), heads("key"), heads("value")
    q = q * jnp.asarray(head_dim ** -0.5, x.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    table = self.param("relative_position_bias_table", nn.initializers.truncated_normal(0.02),
                       ((2 * self.window - 1) ** 2, self.num_heads))
    bias = table[relative_position_index(self.window)]  # (N, N, heads)
    logits = logits + bias.transpose(2, 0, 1)[None]
    if mask is not None:  # (nW, N, N): windows of one image are consecutive
      n_win = mask.shape[0]
      logits = logits.reshape(windows // n_win, n_win, self.num_heads, tokens, tokens)
      logits = (logits + mask[None, :, None]).reshape(windows, self.num_heads, tokens, tokens)
    weights = nn.softmax(logits, axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(windows, tokens, width)
    return LoRADense(width, dtype=self.dtype, name="out")(out)


class SwinBlock(nn.Module):
  num_heads: int
  window: int
  shift: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray, lora: dict | None = None) -> jnp.ndarray:
    _, h, w, width = x.shape
    y = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="LayerNorm_0")(x)
    mask = None
    if self.shift:
      y = jnp.roll(y, (-self.shift, -self.shift), axis=(1, 2))
      mask = shifted_window_mask(h, self.window, self.shift)
    y = WindowAttention(self.num_heads, self.window, self.dtype, name="attn")(
        window_partition(y, self.window), mask, lora)
    y = window_reverse(y, self.window, h, w)
    if self.shift:
      y = jnp.roll(y, (self.shift, self.shift), axis=(1, 2))
    x = x + y
    y = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="LayerNorm_1")(x)
    return x + MlpBlock(MLP_RATIO * width, self.dtype, name="mlp")(y)


class PatchMerging(nn.Module):
  """2x2 neighbours concatenated (timm's channel order), LayerNorm, Linear 4C -> 2C (no bias)."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 4, 2, 5)
    x = x.reshape(b, h // 2, w // 2, 4 * c)
    x = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="norm")(x)
    return nn.Dense(2 * c, use_bias=False, dtype=self.dtype, name="reduction")(x)


class SwinTransformer(nn.Module):
  """Swin classifier. `images` are NHWC floats; `lora` maps `stage{s}_block{b}` to
  `{query|value: {lora_a (C_s, r), lora_b (r, C_s)}}` or is None for the plain backbone.
  Returns logits (B, C), or the pooled features (B, C_last) with `pre_logits`. Each stage's
  output (B, H_s, W_s, C_s) is sown as `intermediates/stage{s}` (apply with
  `mutable=["intermediates"]` to read them). `prompts` and `pool` exist for the call signature
  the methods share with the ViT; prompts are refused (ViT-only)."""

  spec: SwinSpec
  num_classes: int
  dtype: Any = jnp.float32
  matmul_precision: str = "default"  # as the ViT's (olora_jax/models/vit.py)

  @nn.compact
  def __call__(self, images: jnp.ndarray, lora: dict | None = None,
               pre_logits: bool = False, prompts: jnp.ndarray | None = None,
               pool: str = "token") -> jnp.ndarray:
    with matmul_precision(self.matmul_precision):  # model.matmul_precision
      if prompts is not None or pool != "token":
        raise ValueError("prompt tokens (L2P, MVP) need a ViT backbone; the Swin takes none")
      s = self.spec
      x = nn.Conv(s.embed_dim, (s.patch_size, s.patch_size), strides=s.patch_size,
                  padding="VALID", dtype=self.dtype, name="patch_embed")(images)
      x = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="patch_embed_norm")(x)
      lora = lora or {}
      for stage in range(s.num_stages):
        if stage:
          x = PatchMerging(self.dtype, name=f"stage{stage}_merge")(x)
        for block in range(s.depths[stage]):
          window, shift = s.window_and_shift(stage, block)
          name = s.block_name(stage, block)
          x = SwinBlock(s.num_heads[stage], window, shift, self.dtype, name=name)(
              x, lora.get(name))
        self.sow("intermediates", f"stage{stage}", x)
      x = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="encoder_norm")(x)
      features = jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(self.dtype)  # (B, C_last)
      if pre_logits:
        return features.astype(jnp.float32)
      return nn.Dense(self.num_classes, kernel_init=HEAD_KERNEL_INIT, dtype=self.dtype,
                      name="head")(features).astype(jnp.float32)
