"""Vision Transformer (Dosovitskiy et al. 2021) in Flax, with LoRA on the q and v projections.

The architecture is the one timm and Google's AugReg checkpoints share: a strided-conv patch
embedding, a class token, learned position embeddings, pre-LayerNorm blocks (eps 1e-6), exact
(erf) GELU, class-token pooling after a final LayerNorm, and one Dense head.

Parameter tree of `VisionTransformer` (`D` width, `P` patch, `N` patches, `M` MLP width):

    embedding/{kernel (P, P, 3, D), bias (D,)}
    cls (1, 1, D)
    pos_embedding (1, 1 + N, D)
    encoderblock_{i}/LayerNorm_0/{scale, bias}
    encoderblock_{i}/attn/{query, key, value, out}/{kernel (D, D), bias (D,)}
    encoderblock_{i}/LayerNorm_1/{scale, bias}
    encoderblock_{i}/mlp/{fc1 (D, M), fc2 (M, D)}/{kernel, bias}
    encoder_norm/{scale, bias}
    head/{kernel (D, C), bias (C,)}

LoRA factors are *not* Flax parameters: they are a separate pytree passed to `__call__`, so the
learner can take gradients with respect to them alone (see `olora_jax.models.lora`). A projection
with LoRA computes `x @ W + b + (x @ lora_a) @ lora_b` with scale 1 (no alpha/r), which is the
paper's `W x + B A x` in PyTorch's (out, in) convention.

Prompts (L2P, MVP; `olora_jax.methods.prompt_pool`) are likewise not Flax parameters: `prompts`
(B, Lp, D) are tokens inserted after the class token once the position embedding has been added,
so they carry none (as L2P's prompts). `pool='prompts'` pools the mean of the prompt tokens'
outputs instead of the class token (L2P's classifier input). With `prompts=None` the model
computes exactly what it computes without the argument.

Prefixes (prefix-tuning: DualPrompt, CODA-Prompt) are per-block key and value tokens: `prefixes`
maps `encoderblock_{i}` to `{"key": (B, Lp, D), "value": (B, Lp, D)}`, which that block's attention
prepends, split into heads, to its projected keys and values (after the k and v projections, as
the authors' code does), so every query also attends to the Lp prefix positions; the token
sequence and its length do not change. A block without an entry (or `prefixes=None`) computes
exactly what it computes without the argument.

`dtype` is the computation dtype: float32 (the default) or bfloat16 (`model.compute_dtype`).
Parameters stay float32 and are cast where they are used, so gradients, optimizer state and
Omega stay float32; with bfloat16, attention softmax and LayerNorm statistics run in float32 and
the logits come back as float32, so every loss is computed in float32. With float32 every cast
is a no-op and the model computes exactly what it did before the option existed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

LAYER_NORM_EPS = 1e-6

# Names of the LoRA-carrying projections inside `attn`, in the paper's q, v order.
LORA_TARGETS = ("query", "value")
# The computation dtypes of `model.compute_dtype` (parameters are float32 in every case).
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# What the classifier reads: the class token, or the mean of the prompt tokens' outputs (L2P).
POOLING = ("token", "prompts")
# `model.matmul_precision`: 'default' leaves every matmul and convolution at JAX's default
# precision (float32 inputs rounded to TF32 on NVIDIA GPUs since Ampere, to bfloat16 passes on
# TPUs; exact float32 on CPUs), 'highest' computes them in full float32 on every device.
MATMUL_PRECISIONS = ("default", "highest")


def matmul_precision(precision: str):
  """The context a model's forward pass is traced in: every matmul and convolution in it, and
  in its backward pass (which inherits each product's precision), at `precision` (one of
  MATMUL_PRECISIONS). 'default' adds nothing, so $JAX_DEFAULT_MATMUL_PRECISION still applies."""
  if precision not in MATMUL_PRECISIONS:
    raise ValueError(f"unknown model.matmul_precision={precision!r}; use one of"
                     f" {MATMUL_PRECISIONS}")
  if precision == "default":
    return contextlib.nullcontext()
  return jax.default_matmul_precision(precision)


@dataclasses.dataclass(frozen=True)
class ViTSpec:
  """Static architecture of a ViT: everything that fixes the parameter shapes but the head."""

  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  patch_size: int
  image_size: int

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  def lora_layers(self) -> dict[str, int]:
    """The blocks whose q and v carry LoRA, in order, with their width."""
    return {f"encoderblock_{i}": self.width for i in range(self.depth)}

  def validate(self) -> None:
    if min(self.width, self.depth, self.num_heads, self.mlp_dim, self.patch_size) < 1:
      raise ValueError(f"model sizes must be >= 1, got {self}")
    if self.width % self.num_heads:
      raise ValueError(
          f"model.width={self.width} is not divisible by model.num_heads={self.num_heads};"
          " pick a width that is a multiple of the head count")
    if self.image_size % self.patch_size:
      raise ValueError(
          f"model.image_size={self.image_size} is not a multiple of"
          f" model.patch_size={self.patch_size}; resize images to a multiple of the patch")


# Presets of the paper's backbones (Dosovitskiy et al. 2021; Steiner et al. 2022).
PRESETS = {
    "vit_ti16": dict(width=192, depth=12, num_heads=3, mlp_dim=768, patch_size=16),
    "vit_s16": dict(width=384, depth=12, num_heads=6, mlp_dim=1536, patch_size=16),
    "vit_b16": dict(width=768, depth=12, num_heads=12, mlp_dim=3072, patch_size=16),
    # Larger than the paper's backbones (for users past ViT-B; same layouts, timm and AugReg).
    "vit_l16": dict(width=1024, depth=24, num_heads=16, mlp_dim=4096, patch_size=16),
    "vit_h14": dict(width=1280, depth=32, num_heads=16, mlp_dim=5120, patch_size=14),
}


def spec_from_config(model_config: Any) -> ViTSpec:
  """Builds a `ViTSpec` from the `model` config section (a preset name or `custom` sizes)."""
  name = model_config.name
  if name == "custom":
    sizes = dict(width=model_config.width, depth=model_config.depth,
                 num_heads=model_config.num_heads, mlp_dim=model_config.mlp_dim,
                 patch_size=model_config.patch_size)
  elif name in PRESETS:
    sizes = PRESETS[name]
  else:
    raise ValueError(f"unknown model.name={name!r}; use one of {sorted(PRESETS)} or 'custom'")
  spec = ViTSpec(image_size=model_config.image_size, **sizes)
  spec.validate()
  return spec


class LoRADense(nn.Module):
  """`nn.Dense` (D -> D) plus an optional low-rank update `(x @ lora_a) @ lora_b`."""

  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray, lora: dict | None = None) -> jnp.ndarray:
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    y = x @ kernel.astype(self.dtype) + bias.astype(self.dtype)
    if lora is not None:  # (.., D) @ (D, r) @ (r, D)
      y = y + (x @ lora["lora_a"].astype(self.dtype)) @ lora["lora_b"].astype(self.dtype)
    return y


class Attention(nn.Module):
  """Multi-head self-attention with separate q, k, v, out projections (D x D each)."""

  num_heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray, lora: dict | None = None,
               prefix: dict | None = None) -> jnp.ndarray:
    batch, tokens, width = x.shape
    head_dim = width // self.num_heads
    lora = lora or {}

    def heads(name: str) -> jnp.ndarray:
      y = LoRADense(width, dtype=self.dtype, name=name)(x, lora.get(name))
      return y.reshape(batch, tokens, self.num_heads, head_dim)

    q, k, v = heads("query"), heads("key"), heads("value")
    if prefix is not None:  # prefix-tuning: (B, Lp, D) key and value tokens before the others
      def prepend(tokens: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
        tokens = tokens.astype(y.dtype).reshape(batch, -1, self.num_heads, head_dim)
        return jnp.concatenate([tokens, y], axis=1)

      k, v = prepend(prefix["key"], k), prepend(prefix["value"], v)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
    weights = nn.softmax(logits.astype(jnp.float32), axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, width)
    return LoRADense(width, dtype=self.dtype, name="out")(out)


class MlpBlock(nn.Module):
  mlp_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    y = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1")(x)
    y = nn.gelu(y, approximate=False)
    return nn.Dense(x.shape[-1], dtype=self.dtype, name="fc2")(y)


class EncoderBlock(nn.Module):
  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray, lora: dict | None = None,
               prefix: dict | None = None) -> jnp.ndarray:
    y = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="LayerNorm_0")(x)
    x = x + Attention(self.num_heads, self.dtype, name="attn")(y, lora, prefix)
    y = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="LayerNorm_1")(x)
    return x + MlpBlock(self.mlp_dim, self.dtype, name="mlp")(y)


# A fresh classifier head as timm creates it for a new class count (the released code's model):
# kernel ~ N(0, 0.02^2) (timm's trunc_normal_(std=.02) truncates at an absolute +-2, never reached),
# bias 0. A non-zero head matters: with a zero head every LoRA gradient is exactly 0 at step 0.
HEAD_KERNEL_INIT = nn.initializers.normal(0.02)


def init_head(key, width: int, num_classes: int) -> dict:
  """A fresh head's parameters {"kernel" (D, C), "bias" (C,)}, as `VisionTransformer` inits it."""
  return {"kernel": HEAD_KERNEL_INIT(key, (width, num_classes), jnp.float32),
          "bias": jnp.zeros((num_classes,), jnp.float32)}


class VisionTransformer(nn.Module):
  """ViT classifier. `images` are NHWC floats; `lora` maps `encoderblock_{i}` to
  `{query|value: {lora_a (D, r), lora_b (r, D)}}` or is None for the plain backbone; `prompts`
  (B, Lp, D) are tokens inserted after the class token (no position embedding) or None;
  `prefixes` maps `encoderblock_{i}` to that block's key/value prefixes (module docstring) or is
  None; `pool` is one of `POOLING`; `final_norm=False` skips the final LayerNorm (MVP's query,
  read before it); `blocks` runs only the first `blocks` encoder blocks (None: all of them; MVP's
  query, read after block depth - 2). Returns logits (B, C), or the pooled features (B, D) with
  `pre_logits`."""

  spec: ViTSpec
  num_classes: int
  dtype: Any = jnp.float32  # the computation dtype (module docstring); parameters are float32
  matmul_precision: str = "default"  # of every matmul and convolution (module docstring)
  scan_blocks: bool = False  # run runs of like blocks as one scanned block (module docstring)

  @nn.compact
  def __call__(self, images: jnp.ndarray, lora: dict | None = None,
               pre_logits: bool = False, prompts: jnp.ndarray | None = None,
               pool: str = "token", prefixes: dict | None = None,
               final_norm: bool = True, blocks: int | None = None) -> jnp.ndarray:
    with matmul_precision(self.matmul_precision):  # model.matmul_precision
      if pool not in POOLING or (pool == "prompts" and prompts is None):
        raise ValueError(f"pool={pool!r} must be one of {POOLING}; 'prompts' needs prompts")
      s = self.spec
      x = nn.Conv(s.width, (s.patch_size, s.patch_size), strides=s.patch_size, padding="VALID",
                  dtype=self.dtype, name="embedding")(images)
      batch = x.shape[0]
      x = x.reshape(batch, -1, s.width)  # (B, N, D)
      cls = self.param("cls", nn.initializers.zeros, (1, 1, s.width))
      x = jnp.concatenate([jnp.broadcast_to(cls, (batch, 1, s.width)).astype(x.dtype), x], axis=1)
      pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                       (1, 1 + s.num_patches, s.width))
      x = x + pos.astype(x.dtype)
      if prompts is not None:  # (B, 1 + Lp + N, D): class token, prompts, patches
        x = jnp.concatenate([x[:, :1], prompts.astype(x.dtype), x[:, 1:]], axis=1)
      lora, prefixes = lora or {}, prefixes or {}
      names = [f"encoderblock_{i}" for i in range(s.depth if blocks is None else blocks)]
      if self.scan_blocks and not self.is_initializing():
        x = self._scanned_blocks(x, names, lora, prefixes)
      else:
        for name in names:
          x = EncoderBlock(s.num_heads, s.mlp_dim, self.dtype, name=name)(x, lora.get(name),
                                                                          prefixes.get(name))
      if final_norm:
        x = nn.LayerNorm(epsilon=LAYER_NORM_EPS, dtype=self.dtype, name="encoder_norm")(x)
      if pool == "token":
        features = x[:, 0]  # class-token pooling, (B, D)
      else:
        features = jnp.mean(x[:, 1:1 + prompts.shape[1]], axis=1)  # prompt tokens' mean, (B, D)
      if pre_logits:
        return features.astype(jnp.float32)
      return nn.Dense(self.num_classes, kernel_init=HEAD_KERNEL_INIT, dtype=self.dtype,
                      name="head")(features).astype(jnp.float32)

  def _scanned_blocks(self, x: jnp.ndarray, names: list[str], lora: dict,
                      prefixes: dict) -> jnp.ndarray:
    """The blocks `names` in order, each run of consecutive blocks with the same extra inputs
    (LoRA or not, prefixes or not, of the same shapes) as one `jax.lax.scan` over their
    parameters stacked on a leading axis: one block body to compile per run, not one per block.
    Reads the same `encoderblock_{i}` parameters the unrolled loop creates."""
    params = self.variables["params"]
    block = EncoderBlock(self.spec.num_heads, self.spec.mlp_dim, self.dtype, parent=None)

    def inputs(name):
      return params[name], lora.get(name), prefixes.get(name)

    def kind(name):  # blocks that can share one scanned body
      return jax.tree.structure(inputs(name)), [a.shape for a in jax.tree.leaves(inputs(name))]

    runs: list[list[str]] = []
    for name in names:
      if runs and kind(runs[-1][-1]) == kind(name):
        runs[-1].append(name)
      else:
        runs.append([name])
    for run in runs:
      stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[inputs(n) for n in run])

      def body(y, xs):
        p, layer_lora, prefix = xs
        return block.apply({"params": p}, y, layer_lora, prefix), None

      x, _ = jax.lax.scan(body, x, stacked)
    return x
