"""The reduced ResNet-18 of online continual learning, trained from scratch, with BatchNorm.

The backbone most online continual-learning papers train from scratch (Lopez-Paz & Ranzato 2017,
GEM, and after it ER, MIR, SCR, OCM, OnPro): a ResNet-18 whose widths are cut from 64 to `nf` = 20
initial filters. A 3x3 stride-1 stem convolution (no 7x7 stem, no max-pool, so 32 px inputs keep
their resolution), BatchNorm and ReLU; four stages of two BasicBlocks (3x3 conv, BN, ReLU, 3x3
conv, BN, plus the input, ReLU; a 1x1 strided conv with BN on the shortcut where the shape
changes) of widths nf, 2nf, 4nf, 8nf and strides 1, 2, 2, 2; global average pooling; a linear
head. Convolutions have no bias (BatchNorm follows each). The authors pool 4x4 windows of the
last map, which is global pooling at 32 px; global pooling here keeps the feature width 8 nf =
160 at every input size.

Parameter tree (`params`; BatchNorm's running statistics in the separate `batch_stats` entry):

    stem/conv/kernel (3, 3, 3, nf)           stem/bn/{scale, bias} (nf,)
    stage{s}_block{b}/conv{1,2}/kernel       stage{s}_block{b}/bn{1,2}/{scale, bias}
    stage{s}_block{b}/shortcut/{conv/kernel, bn/{scale, bias}}   (first block of stages 1-3)
    head/{kernel (8 nf, C), bias (C,)}
    batch_stats/<the same paths>/{mean, var}  BatchNorm's running mean and (unbiased) variance

BatchNorm as PyTorch's `BatchNorm2d` that the authors' code uses (eps 1e-5, momentum 0.1): a
training forward pass normalises with the batch's statistics; evaluation normalises with the
running statistics. Both live in one pure function: `ReducedResNet.apply` normalises with the
batch's statistics unless traced inside `running_statistics()` (the evaluator's `predict`: see
olora_jax.methods.common.with_batch_statistics), and `update_statistics=True` also returns the
running statistics moved by one batch (the valid rows of `mask` only). The running statistics
are never trained: `common.split_trainable` keeps them in the frozen tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from olora_jax.models.vit import matmul_precision

NAME = "resnet18_reduced"  # model.name
BATCH_STATS = "batch_stats"  # the params tree's entry of BatchNorm's running statistics
BN_EPS = 1e-5  # PyTorch's BatchNorm2d defaults, the authors' code
BN_MOMENTUM = 0.1  # running = (1 - momentum) * running + momentum * batch

_RUNNING = [False]  # set while `running_statistics()` is entered (at trace time)


@contextlib.contextmanager
def running_statistics():
  """Inside it, a `ReducedResNet` forward pass being traced normalises with the running
  statistics (evaluation) instead of the batch's (training)."""
  before, _RUNNING[0] = _RUNNING[0], True
  try:
    yield
  finally:
    _RUNNING[0] = before


@dataclasses.dataclass(frozen=True)
class ResNetSpec:
  """Static architecture of the reduced ResNet-18: `nf` initial filters, BasicBlocks per stage."""

  image_size: int
  nf: int = 20
  blocks: tuple[int, ...] = (2, 2, 2, 2)
  strides: tuple[int, ...] = (1, 2, 2, 2)

  @property
  def width(self) -> int:
    """The pooled feature width (the head's input), 8 nf."""
    return self.nf * 2 ** (len(self.blocks) - 1)

  @property
  def depth(self) -> int:
    return sum(self.blocks)

  def lora_layers(self) -> dict[str, int]:
    """No attention, so no LoRA (the LoRA methods are refused on this model)."""
    return {}

  def validate(self) -> None:
    reduction = 1
    for s in self.strides:
      reduction *= s
    if self.image_size < reduction:
      raise ValueError(f"model.image_size={self.image_size} is smaller than the ResNet's total"
                       f" stride {reduction}; use model.image_size >= {reduction} (32 for CIFAR)")


def spec_from_config(model_config: Any) -> ResNetSpec:
  spec = ResNetSpec(image_size=model_config.image_size)
  spec.validate()
  return spec


class BatchNorm(nn.Module):
  """BatchNorm over (N, H, W) per channel; scale and bias in `params`, running mean and unbiased
  variance in `batch_stats` (PyTorch's BatchNorm2d). Statistics in float32."""

  use_running: bool

  @nn.compact
  def __call__(self, x, mask=None):
    channels = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (channels,))
    bias = self.param("bias", nn.initializers.zeros, (channels,))
    run_mean = self.variable(BATCH_STATS, "mean", jnp.zeros, (channels,), jnp.float32)
    run_var = self.variable(BATCH_STATS, "var", jnp.ones, (channels,), jnp.float32)
    x32 = x.astype(jnp.float32)
    if self.use_running:
      mean, var = run_mean.value, run_var.value
    else:
      weight = (jnp.ones(x.shape[0], jnp.float32) if mask is None
                else mask.astype(jnp.float32))[:, None, None, None]
      count = jnp.maximum(jnp.sum(weight) * x.shape[1] * x.shape[2], 1.0)
      mean = jnp.sum(x32 * weight, axis=(0, 1, 2)) / count
      var = jnp.sum(jnp.square(x32 - mean) * weight, axis=(0, 1, 2)) / count
      if self.is_mutable_collection(BATCH_STATS) and not self.is_initializing():
        unbiased = var * count / jnp.maximum(count - 1.0, 1.0)
        run_mean.value = (1 - BN_MOMENTUM) * run_mean.value + BN_MOMENTUM * mean
        run_var.value = (1 - BN_MOMENTUM) * run_var.value + BN_MOMENTUM * unbiased
    y = (x32 - mean) * jax.lax.rsqrt(var + BN_EPS) * scale + bias
    return y.astype(x.dtype)


def _conv(features: int, kernel: int, stride: int, dtype, name: str) -> nn.Conv:
  pad = kernel // 2
  return nn.Conv(features, (kernel, kernel), strides=stride, padding=((pad, pad), (pad, pad)),
                 use_bias=False, dtype=dtype, kernel_init=nn.initializers.kaiming_normal(),
                 name=name)


class BasicBlock(nn.Module):
  features: int
  stride: int
  use_running: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    y = _conv(self.features, 3, self.stride, self.dtype, "conv1")(x)
    y = nn.relu(BatchNorm(self.use_running, name="bn1")(y, mask))
    y = _conv(self.features, 3, 1, self.dtype, "conv2")(y)
    y = BatchNorm(self.use_running, name="bn2")(y, mask)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = ShortCut(self.features, self.stride, self.use_running, self.dtype,
                   name="shortcut")(x, mask)
    return nn.relu(y + x)


class ShortCut(nn.Module):
  features: int
  stride: int
  use_running: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    x = _conv(self.features, 1, self.stride, self.dtype, "conv")(x)
    return BatchNorm(self.use_running, name="bn")(x, mask)


class Stem(nn.Module):
  """The 3x3 stride-1 convolution to nf channels, BN, ReLU (no max-pool)."""

  features: int
  use_running: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    x = _conv(self.features, 3, 1, self.dtype, "conv")(x)
    return nn.relu(BatchNorm(self.use_running, name="bn")(x, mask))


class ResNet(nn.Module):
  """The Flax module (variables `params` and `batch_stats`); `ReducedResNet` is what runs."""

  spec: ResNetSpec
  num_classes: int
  use_running: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, images, pre_logits: bool = False, mask=None):
    s = self.spec
    x = Stem(s.nf, self.use_running, self.dtype, name="stem")(images.astype(self.dtype), mask)
    for stage, (n_blocks, stride) in enumerate(zip(s.blocks, s.strides, strict=True)):
      for b in range(n_blocks):
        x = BasicBlock(s.nf * 2 ** stage, stride if b == 0 else 1, self.use_running, self.dtype,
                       name=f"stage{stage}_block{b}")(x, mask)
    features = jnp.mean(x.astype(jnp.float32), axis=(1, 2))  # global average pooling
    if pre_logits:
      return features
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(features).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ReducedResNet:
  """The model every method calls, with the ViT's interface: `init(key, images)` ->
  {"params": tree} (the running statistics under `params["batch_stats"]`) and
  `apply({"params": tree}, images, lora=None, pre_logits=False)` -> logits (N, C) float32, or
  the pooled features (N, 8 nf) with `pre_logits`. `update_statistics=True` returns
  (output, running statistics moved by this batch's valid rows, `mask`); in a training forward
  pass `mask` likewise keeps the padded rows out of the batch's statistics (None: every row)."""

  spec: ResNetSpec
  num_classes: int
  dtype: Any = jnp.float32
  matmul_precision: str = "default"

  def _module(self, use_running: bool) -> ResNet:
    return ResNet(self.spec, self.num_classes, use_running, self.dtype)

  def init(self, key, images):
    variables = self._module(False).init(key, images)
    return {"params": {**variables["params"], BATCH_STATS: variables[BATCH_STATS]}}

  def apply(self, variables, images, lora=None, pre_logits: bool = False,
            update_statistics: bool = False, mask=None):
    if lora:
      raise ValueError(f"model.name={NAME!r} has no attention to carry LoRA factors")
    params = dict(variables["params"])
    variables = {"params": params, BATCH_STATS: params.pop(BATCH_STATS)}
    use_running = _RUNNING[0] and not update_statistics
    with matmul_precision(self.matmul_precision):
      if update_statistics:
        out, moved = self._module(False).apply(
            variables, images, pre_logits, mask,
            mutable=[BATCH_STATS])
        return out, moved[BATCH_STATS]
      if use_running:
        return self._module(True).apply(variables, images,
                                        pre_logits)
      out, _ = self._module(False).apply(variables, images,
                                         pre_logits, mask, mutable=[BATCH_STATS])
      return out
