"""Pretrained ViT checkpoints (timm, Google AugReg, big_vision) into our Flax parameter tree.

Design
------
Every loader goes through the same four steps, so the three formats cannot drift apart:

1. **Read** the file into a flat `{name: np.ndarray}` dict ("raw" checkpoint), never touching
   the network: timm `.safetensors` via `safetensors.numpy` (no torch), AugReg / big_vision
   `.npz` via `np.load(allow_pickle=False)`. Everything is cast to float32 (bfloat16 files too).
2. **Validate** the raw dict against what the `ViTSpec` demands, failing with one-line
   `CheckpointError`s that name the problem and the fix, in this order: architecture
   (width / depth / heads / MLP width / patch size read off the checkpoint), missing keys,
   unexpected keys, mis-shaped keys. timm's fused `qkv` does not record the head count, so for
   timm files `num_heads` is taken on trust (it only regroups the same weights).
3. **Convert** to our layout (see `olora_jax.models.vit`): PyTorch (out, in) matrices become
   (in, out) kernels, timm's fused `qkv` is split into `query` / `key` / `value`, the npz
   per-head kernels `(D, H, Dh)` / `(H, Dh, D)` are flattened to `(D, D)`.
4. **Adapt** what legitimately differs between pretraining and the benchmark:

   * Position embeddings. When the checkpoint grid differs from `image_size // patch_size`,
     the grid part is resampled in 2D and the class-token position kept, exactly as timm does
     it: bicubic with antialias for timm files (timm's `checkpoint_filter_fn`), bilinear
     without antialias for npz files (timm's `_load_weights`). Both follow PyTorch's
     `F.interpolate(align_corners=False, size=...)` and are implemented here in NumPy
     (`resize_grid`), so no torch is needed and downsampling also matches PyTorch.
   * The head. Benchmarks rarely have the checkpoint's class count, so the checkpoint head is
     reused only when it has exactly `num_classes` outputs; otherwise (or when the file has no
     head) the head is a fresh zero kernel and zero bias, the same as
     `VisionTransformer`'s own initialiser, and the choice is logged. Note that a head
     trained together with a `pre_logits` layer is never reused (see below).

   Finally the result is checked against the shapes of `VisionTransformer(spec,
   num_classes).init` (computed with `jax.eval_shape`, no FLOPs).

Unexpected keys are errors, with one documented exception: vit_jax checkpoints from the
original ViT paper carry a `pre_logits/{kernel,bias}` tanh layer between the encoder and the
head. vit_jax itself drops it when fine-tuning with a new head (its "drop-head variant"), and
so do we: `pre_logits/*` is ignored for the npz formats (and then the checkpoint head, which
was trained on top of `pre_logits`, is not reused either). Nothing else is ignored: e.g. a
timm `fc_norm.*` (global-average-pool models) or `blocks.0.ls1.gamma` (LayerScale) means a
different architecture and is reported as unexpected.

The writers `save_timm_safetensors` and `save_npz` are the exact inverses of the readers
(float32 transposes and reshapes only), so `load_pretrained(save_...(params))` gives back
bit-identical parameters; they exist for tests and for shipping small checkpoints.

The authors' layout ('online_lora')
-----------------------------------
The released code wraps a timm ViT in a LoRA model whose state_dict is timm's under a
`lora_vit.` prefix, except that every block's fused qkv Linear sits one level deeper
(`lora_vit.blocks.N.attn.qkv.qkv.{weight,bias}`), beside eight bias-free LoRA Linears in
PyTorch's (out, in) layout: `linear_a_q`, `linear_b_q`, `linear_a_v`, `linear_b_v` (the frozen
pair of the `factor_sum` merge, A_old (r, D) and B_old (D, r)) and `linear_new_a_q`,
`linear_new_b_q`, `linear_new_a_v`, `linear_new_b_v` (the current, trainable LoRA). The wrapper
computes q = x W_q^T + b_q + x A_old^T B_old^T + x A^T B^T (v likewise), which is our model with
`lora_a = A^T`, `lora_b = B^T` and the frozen pair beside it (`models.lora.concat_adapters`).
A `proj_3d.*` module of the wrapper is not part of the classifier and is ignored with a warning.
`split_online_lora` reads the layout into (timm state_dict, current LoRA, frozen pair);
`save_online_lora_safetensors` writes it back, bit for bit. Torch is not needed: convert a
state_dict saved with `torch.save` once, where torch is installed, with
`safetensors.torch.save_file(state_dict, "model.safetensors")` (docs/replay.md).
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
import zipfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from olora_jax.checkpoint_checks import CheckpointError
from olora_jax.checkpoint_checks import as_numpy as _as_numpy
from olora_jax.checkpoint_checks import check_keys as _check_keys
from olora_jax.checkpoint_checks import head_judge as _head_judge
from olora_jax.checkpoint_checks import listed as _listed
from olora_jax.models.swin import SwinSpec, SwinTransformer
from olora_jax.models.vit import VisionTransformer, ViTSpec

logger = logging.getLogger(__name__)

FORMATS = ("timm", "augreg", "big_vision", "online_lora")

# The authors' LoRA-wrapped timm model (module docstring): prefix, the qkv wrapper's key names.
ONLINE_LORA_PREFIX = "lora_vit."
ONLINE_LORA_SWIN_PREFIX = "lora_swin."  # their wrapper of a timm Swin (pretrained_swin.py)
_ONLINE_LORA_IGNORED_PREFIXES = ("proj_3d.",)
# (factor name, tree) for each LoRA Linear: current LoRA ('lora') or frozen pair ('frozen').
_ONLINE_LORA_LINEARS = {
    "linear_new_a_{t}": ("lora", "lora_a"), "linear_new_b_{t}": ("lora", "lora_b"),
    "linear_a_{t}": ("frozen", "lora_a"), "linear_b_{t}": ("frozen", "lora_b"),
}
_ONLINE_LORA_TARGETS = {"query": "q", "value": "v"}

# Per npz layout: key prefix, attention / second LayerNorm / MLP module names, position key.
_NPZ_NAMES = {
    "augreg": {"prefix": "", "mha": "MultiHeadDotProductAttention_1", "ln2": "LayerNorm_2",
               "mlp": "MlpBlock_3", "pos": "Transformer/posembed_input/pos_embedding"},
    "big_vision": {"prefix": "params/", "mha": "MultiHeadDotProductAttention_0",
                   "ln2": "LayerNorm_1", "mlp": "MlpBlock_0", "pos": "pos_embedding"},
}

# How each format's position embeddings are resampled (timm's choices, see module docstring).
_POS_RESAMPLE = {
    "timm": ("bicubic", True),
    "augreg": ("bilinear", False),
    "big_vision": ("bilinear", False),
    "online_lora": ("bicubic", True),
}

# The only keys ever dropped silently (npz formats only, after the prefix): see module docstring.
_NPZ_IGNORED_PREFIXES = ("pre_logits/",)



def is_swin(spec) -> bool:
  return isinstance(spec, SwinSpec)


def _is_swin_params(params: dict) -> bool:
  return "patch_embed" in params  # the ViT's patch embedding is "embedding"


# --------------------------------------------------------------------------------------------
# Reading and format detection.


def _looks_like_safetensors(path: str) -> bool:
  with open(path, "rb") as f:
    head = f.read(9)
  if len(head) < 9:
    return False
  (header_len,) = struct.unpack("<Q", head[:8])
  return 0 < header_len < os.path.getsize(path) and head[8:9] == b"{"


def _npz_layout(keys: list[str], path: str) -> str:
  if any(k.startswith("params/") for k in keys):
    return "big_vision"
  if any(k.startswith("Transformer/encoderblock_0/MultiHeadDotProductAttention_1/") for k in keys):
    return "augreg"
  raise CheckpointError(
      f"cannot tell the layout of npz checkpoint {path}: it has neither 'params/...' keys"
      " (big_vision) nor 'Transformer/encoderblock_0/MultiHeadDotProductAttention_1/...' keys"
      " (AugReg); pass fmt='augreg' or fmt='big_vision' explicitly if it is one of them")


def detect_format(path: str) -> str:
  """Which of `FORMATS` the file at `path` is, judged by its suffix and content."""
  path = os.fspath(path)
  _check_exists(path)
  if path.endswith(".safetensors") or _looks_like_safetensors(path):
    try:
      with safetensors.safe_open(path, framework="numpy") as f:
        keys = list(f.keys())
    except (safetensors.SafetensorError, OSError):
      return "timm"  # read_checkpoint reports what is wrong with the file
    wrapped = (ONLINE_LORA_PREFIX, ONLINE_LORA_SWIN_PREFIX)
    return "online_lora" if any(k.startswith(wrapped) for k in keys) else "timm"
  if zipfile.is_zipfile(path):
    with np.load(path, allow_pickle=False) as z:
      return _npz_layout(list(z.files), path)
  raise CheckpointError(
      f"cannot tell the format of checkpoint {path}: it is neither a safetensors file (timm)"
      " nor an npz archive (AugReg / big_vision); convert it to one of those")


def _check_exists(path: str) -> None:
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"checkpoint file not found: {path}; check the path (nothing is ever downloaded, so"
        " fetch the file yourself first)")


def read_checkpoint(path: str, fmt: str = "auto") -> tuple[dict[str, np.ndarray], str]:
  """The raw `{key: float32 array}` dict of a checkpoint file and its format."""
  path = os.fspath(path)
  _check_exists(path)
  if fmt == "auto":
    fmt = detect_format(path)
  if fmt not in FORMATS:
    raise CheckpointError(
        f"unknown checkpoint format {fmt!r}; use one of 'auto', {', '.join(map(repr, FORMATS))}")
  try:
    if fmt in ("timm", "online_lora"):
      raw = safetensors.numpy.load_file(path)
    else:
      with np.load(path, allow_pickle=False) as z:
        raw = {k: z[k] for k in z.files}
  except (safetensors.SafetensorError, OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    kind = "a safetensors file" if fmt in ("timm", "online_lora") else "an npz archive"
    raise CheckpointError(
        f"cannot read checkpoint {path} as {kind} (fmt={fmt!r}): {type(e).__name__}: {e};"
        " check the file is complete and pass the right fmt") from None
  out = {}
  for k, v in raw.items():
    try:
      out[k] = np.asarray(v).astype(np.float32)
    except (TypeError, ValueError):
      raise CheckpointError(
          f"checkpoint {path} key {k!r} has dtype {np.asarray(v).dtype}, not a float tensor;"
          " only numeric tensors are supported, strip that entry") from None
    bad = np.size(out[k]) - int(np.isfinite(out[k]).sum())
    if bad:  # NaN/Inf weights would only surface as a NaN loss after compute
      raise CheckpointError(
          f"checkpoint {path} key {k!r} holds {bad} NaN/Inf value(s) of {np.size(out[k])};"
          " the file is damaged: fetch or convert it again")
  return out, fmt


# --------------------------------------------------------------------------------------------
# Position-embedding resampling with PyTorch `F.interpolate(align_corners=False)` semantics.


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
  """Keys' cubic convolution kernel with parameter `a` (PyTorch: -0.75 plain, -0.5 antialias)."""
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _triangle(x: np.ndarray) -> np.ndarray:
  return np.maximum(0.0, 1.0 - np.abs(x))


def interp_matrix(in_size: int, out_size: int, method: str, antialias: bool) -> np.ndarray:
  """The (out_size, in_size) float64 matrix of 1-D `F.interpolate(size=out_size, mode=method,
  antialias=antialias, align_corners=False)` for `method` in {'bilinear', 'bicubic'}."""
  if method not in ("bilinear", "bicubic"):
    raise ValueError(f"unknown interpolation method {method!r}; use 'bilinear' or 'bicubic'")
  scale = in_size / out_size
  m = np.zeros((out_size, in_size), np.float64)
  if antialias:
    # PyTorch's `_upsample_{bilinear,bicubic}2d_aa` (PIL's resampling): the kernel is
    # stretched by `scale` when downsampling, cut at the image border and renormalised.
    interp_size, filt = (2, _triangle) if method == "bilinear" else (4, lambda x: _cubic(x, -0.5))
    support = interp_size / 2 * scale if scale >= 1 else interp_size / 2
    invscale = 1 / scale if scale >= 1 else 1.0
    for i in range(out_size):
      center = scale * (i + 0.5)
      lo = max(int(center - support + 0.5), 0)  # int() truncates, as the C++ cast does
      hi = min(int(center + support + 0.5), in_size)
      j = np.arange(lo, hi)
      w = filt((j - center + 0.5) * invscale)
      total = w.sum()
      m[i, lo:hi] = w / total if total != 0 else w
    return m
  for i in range(out_size):
    src = scale * (i + 0.5) - 0.5
    if method == "bilinear":  # `upsample_bilinear2d`: clamp at 0, two taps, edge-replicated
      src = max(src, 0.0)
      i0 = int(src)
      i1 = min(i0 + 1, in_size - 1)
      frac = src - i0
      m[i, i0] += 1 - frac
      m[i, i1] += frac
    else:  # `upsample_bicubic2d`: four taps of Keys' kernel (a=-0.75), indices clamped
      i0 = math.floor(src)
      t = src - i0
      w = _cubic(np.array([t + 1, t, 1 - t, 2 - t]), -0.75)
      for tap, wt in zip(range(i0 - 1, i0 + 3), w, strict=True):
        m[i, min(max(tap, 0), in_size - 1)] += wt
  return m


def resize_grid(grid: np.ndarray, new_hw: tuple[int, int], method: str,
                antialias: bool) -> np.ndarray:
  """Resamples an (H, W, C) grid to `new_hw` like PyTorch's `F.interpolate` on (1, C, H, W)
  with `align_corners=False` (separable, computed in float64, returned as float32)."""
  h, w, _ = grid.shape
  mh = interp_matrix(h, new_hw[0], method, antialias)
  mw = interp_matrix(w, new_hw[1], method, antialias)
  out = np.einsum("oh,hwc,pw->opc", mh, grid.astype(np.float64), mw)
  return out.astype(np.float32)


def resample_pos_embedding(pos: np.ndarray, new_grid: int, method: str,
                           antialias: bool) -> np.ndarray:
  """(1, 1 + g*g, D) -> (1, 1 + new_grid**2, D): class-token position kept, grid resampled."""
  tokens, width = pos.shape[1], pos.shape[2]
  old = math.isqrt(tokens - 1)
  if old == new_grid:
    return pos
  grid = pos[0, 1:].reshape(old, old, width)
  grid = resize_grid(grid, (new_grid, new_grid), method, antialias)
  return np.concatenate([pos[:, :1], grid.reshape(1, new_grid * new_grid, width)], axis=1)


# --------------------------------------------------------------------------------------------
# Validation helpers.


def _check_arch(found: dict[str, int | None], spec: ViTSpec, path: str) -> None:
  """`found` maps ViTSpec field names to the sizes read off the checkpoint (None: unknown)."""
  for name, value in found.items():
    want = getattr(spec, name)
    if value is not None and value != want:
      raise CheckpointError(
          f"checkpoint {path} has {name}={value} but the model has {name}={want}; pick the"
          f" model.name preset this checkpoint belongs to, or set model.name=custom with"
          f" model.{name}={value} (a preset ignores model.{name}), or use a checkpoint with"
          f" {name}={want}")


def _pos_judge(width: int) -> Callable[[tuple[int, ...]], str | None]:
  def judge(shape: tuple[int, ...]) -> str | None:
    ok = (len(shape) == 3 and shape[0] == 1 and shape[2] == width and shape[1] > 1
          and math.isqrt(shape[1] - 1) ** 2 == shape[1] - 1)
    return None if ok else f"(1, 1 + g*g, {width}) for a square g x g grid"
  return judge


def _block_depth(keys: list[str], pattern: str) -> int | None:
  idx = [int(m.group(1)) for k in keys if (m := re.match(pattern, k))]
  return max(idx) + 1 if idx else None


def _shape_of(raw: dict[str, np.ndarray], key: str, axis: int, ndim: int) -> int | None:
  v = raw.get(key)
  return v.shape[axis] if v is not None and v.ndim == ndim else None


# --------------------------------------------------------------------------------------------
# timm <-> ours.


def _timm_validate(raw: dict[str, np.ndarray], spec: ViTSpec, path: str) -> None:
  d, p, m = spec.width, spec.patch_size, spec.mlp_dim
  if any(k.startswith(ONLINE_LORA_PREFIX) for k in raw):
    raise CheckpointError(
        f"checkpoint {path} is in the authors' LoRA-wrapped layout (keys"
        f" '{ONLINE_LORA_PREFIX}...'), not plain timm; set pretrained.format=online_lora (or"
        " auto)")
  found = {
      "width": _shape_of(raw, "cls_token", 2, 3) or _shape_of(raw, "patch_embed.proj.weight", 0, 4),
      "depth": _block_depth(list(raw), r"blocks\.(\d+)\."),
      "mlp_dim": _shape_of(raw, "blocks.0.mlp.fc1.weight", 0, 2),
      "patch_size": _shape_of(raw, "patch_embed.proj.weight", 3, 4),
  }
  _check_arch(found, spec, path)
  fixed = {
      "patch_embed.proj.weight": (d, 3, p, p), "patch_embed.proj.bias": (d,),
      "cls_token": (1, 1, d), "norm.weight": (d,), "norm.bias": (d,),
  }
  for i in range(spec.depth):
    b = f"blocks.{i}."
    fixed.update({
        b + "norm1.weight": (d,), b + "norm1.bias": (d,),
        b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
        b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
        b + "norm2.weight": (d,), b + "norm2.bias": (d,),
        b + "mlp.fc1.weight": (m, d), b + "mlp.fc1.bias": (m,),
        b + "mlp.fc2.weight": (d, m), b + "mlp.fc2.bias": (d,),
    })
  flexible = {"pos_embed": _pos_judge(d), "head.weight": _head_judge(d, "out_in"),
              "head.bias": _head_judge(d, "bias")}
  _check_keys(raw, fixed, flexible, ("head.weight", "head.bias"), path, "timm")
  if "head.weight" in raw and raw["head.weight"].shape[0] != raw["head.bias"].shape[0]:
    raise CheckpointError(
        f"checkpoint {path} (fmt='timm') has head.weight {raw['head.weight'].shape} but head.bias"
        f" {raw['head.bias'].shape}; the head is corrupt, delete both head tensors to start fresh")


def _timm_to_ours(raw: dict[str, np.ndarray], spec: ViTSpec) -> tuple[dict, np.ndarray | None]:
  d = spec.width
  params = {
      "embedding": {"kernel": raw["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
                    "bias": raw["patch_embed.proj.bias"]},
      "cls": raw["cls_token"],
      "pos_embedding": raw["pos_embed"],
      "encoder_norm": {"scale": raw["norm.weight"], "bias": raw["norm.bias"]},
  }
  for i in range(spec.depth):
    b = f"blocks.{i}."
    qkv_w, qkv_b = raw[b + "attn.qkv.weight"], raw[b + "attn.qkv.bias"]
    attn = {name: {"kernel": qkv_w[j * d:(j + 1) * d].T, "bias": qkv_b[j * d:(j + 1) * d]}
            for j, name in enumerate(("query", "key", "value"))}
    attn["out"] = {"kernel": raw[b + "attn.proj.weight"].T, "bias": raw[b + "attn.proj.bias"]}
    params[f"encoderblock_{i}"] = {
        "LayerNorm_0": {"scale": raw[b + "norm1.weight"], "bias": raw[b + "norm1.bias"]},
        "attn": attn,
        "LayerNorm_1": {"scale": raw[b + "norm2.weight"], "bias": raw[b + "norm2.bias"]},
        "mlp": {"fc1": {"kernel": raw[b + "mlp.fc1.weight"].T, "bias": raw[b + "mlp.fc1.bias"]},
                "fc2": {"kernel": raw[b + "mlp.fc2.weight"].T, "bias": raw[b + "mlp.fc2.bias"]}},
    }
  head = None
  if "head.weight" in raw:
    head = {"kernel": raw["head.weight"].T, "bias": raw["head.bias"]}
  return params, head


def _ours_to_timm(params: dict) -> dict[str, np.ndarray]:
  a = _as_numpy(params)
  sd = {
      "patch_embed.proj.weight": a["embedding"]["kernel"].transpose(3, 2, 0, 1),
      "patch_embed.proj.bias": a["embedding"]["bias"],
      "cls_token": a["cls"],
      "pos_embed": a["pos_embedding"],
      "norm.weight": a["encoder_norm"]["scale"],
      "norm.bias": a["encoder_norm"]["bias"],
  }
  for i in range(_depth_of(a)):
    blk, b = a[f"encoderblock_{i}"], f"blocks.{i}."
    att = blk["attn"]
    ln1, ln2 = blk["LayerNorm_0"], blk["LayerNorm_1"]
    fc1, fc2 = blk["mlp"]["fc1"], blk["mlp"]["fc2"]
    sd.update({
        b + "norm1.weight": ln1["scale"], b + "norm1.bias": ln1["bias"],
        b + "attn.qkv.weight": np.concatenate(
            [att[n]["kernel"].T for n in ("query", "key", "value")], axis=0),
        b + "attn.qkv.bias": np.concatenate([att[n]["bias"] for n in ("query", "key", "value")]),
        b + "attn.proj.weight": att["out"]["kernel"].T, b + "attn.proj.bias": att["out"]["bias"],
        b + "norm2.weight": ln2["scale"], b + "norm2.bias": ln2["bias"],
        b + "mlp.fc1.weight": fc1["kernel"].T, b + "mlp.fc1.bias": fc1["bias"],
        b + "mlp.fc2.weight": fc2["kernel"].T, b + "mlp.fc2.bias": fc2["bias"],
    })
  if "head" in a:
    sd["head.weight"] = a["head"]["kernel"].T
    sd["head.bias"] = a["head"]["bias"]
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


# --------------------------------------------------------------------------------------------
# The authors' LoRA-wrapped timm layout ('online_lora') <-> timm + LoRA trees.


def _online_lora_layout(spec) -> tuple[str, dict[str, str]]:
  """(key prefix, our block name -> timm's module path of that block) of the authors' wrapper
  around the backbone of `spec`: `lora_vit.` and `blocks.{i}`, or `lora_swin.` and
  `layers.{s}.blocks.{b}`."""
  if is_swin(spec):
    from olora_jax import pretrained_swin
    return ONLINE_LORA_SWIN_PREFIX, pretrained_swin.timm_block_prefixes(spec)
  return ONLINE_LORA_PREFIX, {f"encoderblock_{i}": f"blocks.{i}" for i in range(spec.depth)}


def _online_lora_key(prefix: str, block: str, linear: str) -> str:
  return f"{prefix}{block}.attn.qkv.{linear}.weight"


_WARNED: set[tuple[str, str]] = set()


def _warn_once(source: str, note: str) -> None:
  """A note the user sees (a warning on stderr; the other notes are INFO), once per file: a
  replay names one file as pretrained.path and learner.initial_lora."""
  if (source, note) not in _WARNED:
    _WARNED.add((source, note))
    logger.warning("%s: %s", source, note)


def split_online_lora(raw: dict[str, np.ndarray], spec, source: str = "<checkpoint>"
                      ) -> tuple[dict[str, np.ndarray], dict | None, dict | None, list[str]]:
  """The authors' state_dict -> (timm state_dict, current LoRA, frozen pair, notes).

  The LoRA trees are in our layout (`models.lora`), or None when the file has no LoRA Linears
  (a LoRA-free file is a plain timm model under the prefix). `spec` (a ViT's or a Swin's) picks
  the wrapper: `lora_vit.` or `lora_swin.`. Pure; raises CheckpointError.
  """
  prefix, blocks = _online_lora_layout(spec)
  notes = []
  ignored = [k for k in raw if k.startswith(_ONLINE_LORA_IGNORED_PREFIXES)]
  if ignored:
    note = (f"ignored {_listed(ignored)}: the released code's proj_3d module is not part of the"
            " classifier")
    notes.append(note)
    _warn_once(source, note)
  foreign = [k for k in raw if k not in ignored and not k.startswith(prefix)]
  if foreign:
    raise CheckpointError(
        f"checkpoint {source} (fmt='online_lora') has {len(foreign)} key(s) outside"
        f" '{prefix}': {_listed(foreign)}; strip them (only proj_3d.* is ignored), or pick the"
        " model.name of the backbone the file wraps")
  timm, factors = {}, {}
  for k, v in raw.items():
    if k in ignored:
      continue
    name = k[len(prefix):]
    m = re.fullmatch(r"(.+)\.attn\.qkv\.(linear_\w+)\.weight", name)
    if m:
      factors[(m.group(1), m.group(2))] = v
      continue
    timm[re.sub(r"\.attn\.qkv\.qkv\.", ".attn.qkv.", name)] = v
  if not factors:
    return timm, None, None, notes
  trees: dict[str, dict] = {"lora": {}, "frozen": {}}
  expected = {(theirs, pattern.format(t=t))
              for theirs in blocks.values() for pattern in _ONLINE_LORA_LINEARS
              for t in _ONLINE_LORA_TARGETS.values()}
  if set(factors) != expected:
    missing = sorted(_online_lora_key(prefix, b, n) for b, n in expected - set(factors))
    extra = sorted(_online_lora_key(prefix, b, n) for b, n in set(factors) - expected)
    raise CheckpointError(
        f"checkpoint {source} (fmt='online_lora') has an incomplete LoRA: missing"
        f" {_listed(missing) or 'none'}, unexpected {_listed(extra) or 'none'}; every block needs"
        " the eight linear_{a,b,new_a,new_b}_{q,v} weights")
  first = next(iter(blocks.values()))
  rank = factors[(first, "linear_new_a_q")].shape[0]
  widths = spec.lora_layers()
  for ours, theirs in blocks.items():
    width = widths[ours]
    for target, t in _ONLINE_LORA_TARGETS.items():
      for pattern, (tree, factor) in _ONLINE_LORA_LINEARS.items():
        w = factors[(theirs, pattern.format(t=t))]
        want = (rank, width) if factor == "lora_a" else (width, rank)
        if w.shape != want:
          raise CheckpointError(
              f"checkpoint {source} (fmt='online_lora')"
              f" {_online_lora_key(prefix, theirs, pattern.format(t=t))} has shape {w.shape},"
              f" expected {want} (rank {rank}, width {width})")
        trees[tree].setdefault(ours, {}).setdefault(target, {})[factor] = w.T
  return timm, trees["lora"], trees["frozen"], notes


def _ours_to_online_lora(params: dict, lora: dict, frozen_lora: dict | None) -> dict:
  swin = _is_swin_params(params)
  if swin:
    from olora_jax import pretrained_swin
    prefix, timm = ONLINE_LORA_SWIN_PREFIX, pretrained_swin.ours_to_timm(params)
    blocks = {name: f"layers.{m.group(1)}.blocks.{m.group(2)}" for name in lora
              if (m := re.fullmatch(r"stage(\d+)_block(\d+)", name))}
  else:
    prefix, timm = ONLINE_LORA_PREFIX, _ours_to_timm(params)
    blocks = {name: f"blocks.{name.split('_')[1]}" for name in lora}
  sd = {}
  for k, v in timm.items():
    sd[prefix + re.sub(r"\.attn\.qkv\.(weight|bias)$", r".attn.qkv.qkv.\1", k)] = v
  frozen_lora = frozen_lora if frozen_lora is not None else jax.tree.map(np.zeros_like, lora)
  trees = {"lora": _as_numpy(lora), "frozen": _as_numpy(frozen_lora)}
  for block, theirs in blocks.items():
    for target, t in _ONLINE_LORA_TARGETS.items():
      for pattern, (tree, factor) in _ONLINE_LORA_LINEARS.items():
        sd[_online_lora_key(prefix, theirs, pattern.format(t=t))] = np.ascontiguousarray(
            trees[tree][block][target][factor].T, dtype=np.float32)
  return sd


def save_online_lora_safetensors(params: dict, lora: dict, path: str,
                                 frozen_lora: dict | None = None) -> None:
  """Writes a model in the authors' layout (module docstring): `params` the full ViT tree with
  its head (merged LoRAs already in its kernels), `lora` the current LoRA, `frozen_lora` the
  `factor_sum` frozen pair (zeros when None). No proj_3d is written: load it into the released
  code with `load_state_dict(..., strict=False)`. `load_online_lora` reads it back bit for bit."""
  safetensors.numpy.save_file(_ours_to_online_lora(params, lora, frozen_lora), os.fspath(path))


def load_online_lora(path: str, spec: ViTSpec, rank: int) -> tuple[dict, dict]:
  """The (current LoRA, frozen pair) of a file in the authors' layout, as jnp trees of rank
  `rank` (`learner.initial_lora`). The rest of the file (the backbone) is not read here.
  Raises FileNotFoundError or CheckpointError (one line each)."""
  raw, fmt = read_checkpoint(path, "auto")
  if fmt != "online_lora":
    raise CheckpointError(
        f"learner.initial_lora={path!r} is a {fmt!r} checkpoint, not the authors' layout (keys"
        f" '{_online_lora_layout(spec)[0]}...attn.qkv.linear_new_a_q.weight', ...); export one with"
        " pretrained.save_online_lora_safetensors")
  spec.validate()
  _, lora, frozen, notes = split_online_lora(raw, spec, path)
  if lora is None:
    raise CheckpointError(
        f"learner.initial_lora={path!r} holds no LoRA Linears (linear_new_a_q, ...); give a file"
        " with the LoRA factors")
  got = next(iter(lora.values()))["query"]["lora_a"].shape[1]
  if got != rank:
    raise CheckpointError(f"learner.initial_lora={path!r} has LoRA rank {got} but learner.rank"
                          f" is {rank}; set learner.rank={got}")
  for note in notes:
    logger.info("load_online_lora(%s): %s", path, note)
  return jax.device_put((lora, frozen))  # one transfer per array, no program per shape


# --------------------------------------------------------------------------------------------
# AugReg / big_vision npz <-> ours.


def _npz_keys(layout: str, depth: int) -> dict[str, str]:
  """Our flat `a/b/c` names -> the layout's npz names (head and position included)."""
  n = _NPZ_NAMES[layout]
  pre = n["prefix"]
  keys = {
      "embedding/kernel": "embedding/kernel", "embedding/bias": "embedding/bias", "cls": "cls",
      "pos_embedding": n["pos"],
      "encoder_norm/scale": "Transformer/encoder_norm/scale",
      "encoder_norm/bias": "Transformer/encoder_norm/bias",
      "head/kernel": "head/kernel", "head/bias": "head/bias",
  }
  for i in range(depth):
    ours, theirs = f"encoderblock_{i}/", f"Transformer/encoderblock_{i}/"
    for pname in ("scale", "bias"):
      keys[ours + f"LayerNorm_0/{pname}"] = theirs + f"LayerNorm_0/{pname}"
      keys[ours + f"LayerNorm_1/{pname}"] = theirs + f"{n['ln2']}/{pname}"
    for proj in ("query", "key", "value", "out"):
      for pname in ("kernel", "bias"):
        keys[ours + f"attn/{proj}/{pname}"] = theirs + f"{n['mha']}/{proj}/{pname}"
    for r in range(2):
      for pname in ("kernel", "bias"):
        keys[ours + f"mlp/fc{r + 1}/{pname}"] = theirs + f"{n['mlp']}/Dense_{r}/{pname}"
  return {k: pre + v for k, v in keys.items()}


def _npz_raw_shapes(spec: ViTSpec) -> dict[str, tuple[int, ...]]:
  """Our flat names -> the npz shapes they must have (head and position excluded)."""
  d, h, p, m = spec.width, spec.num_heads, spec.patch_size, spec.mlp_dim
  dh = d // h
  shapes = {"embedding/kernel": (p, p, 3, d), "embedding/bias": (d,), "cls": (1, 1, d),
            "encoder_norm/scale": (d,), "encoder_norm/bias": (d,)}
  for i in range(spec.depth):
    b = f"encoderblock_{i}/"
    for ln in ("LayerNorm_0", "LayerNorm_1"):
      shapes[b + f"{ln}/scale"] = shapes[b + f"{ln}/bias"] = (d,)
    for proj in ("query", "key", "value"):
      shapes[b + f"attn/{proj}/kernel"] = (d, h, dh)
      shapes[b + f"attn/{proj}/bias"] = (h, dh)
    shapes[b + "attn/out/kernel"] = (h, dh, d)
    shapes[b + "attn/out/bias"] = (d,)
    shapes.update({b + "mlp/fc1/kernel": (d, m), b + "mlp/fc1/bias": (m,),
                   b + "mlp/fc2/kernel": (m, d), b + "mlp/fc2/bias": (d,)})
  return shapes


def _npz_validate(raw: dict[str, np.ndarray], spec: ViTSpec, path: str, layout: str) -> None:
  n = _NPZ_NAMES[layout]
  pre, blk0 = n["prefix"], f"{n['prefix']}Transformer/encoderblock_0/"
  found = {
      "width": _shape_of(raw, pre + "cls", 2, 3) or _shape_of(raw, pre + "embedding/kernel", 3, 4),
      "depth": _block_depth(list(raw), re.escape(pre) + r"Transformer/encoderblock_(\d+)/"),
      "num_heads": _shape_of(raw, blk0 + f"{n['mha']}/query/kernel", 1, 3),
      "mlp_dim": _shape_of(raw, blk0 + f"{n['mlp']}/Dense_0/kernel", 1, 2),
      "patch_size": _shape_of(raw, pre + "embedding/kernel", 0, 4),
  }
  _check_arch(found, spec, path)
  names = _npz_keys(layout, spec.depth)
  fixed = {names[k]: s for k, s in _npz_raw_shapes(spec).items()}
  d = spec.width
  flexible = {names["pos_embedding"]: _pos_judge(d),
              names["head/kernel"]: _head_judge(d, "in_out"),
              names["head/bias"]: _head_judge(d, "bias")}
  _check_keys(raw, fixed, flexible, (names["head/kernel"], names["head/bias"]), path, layout)
  hk, hb = names["head/kernel"], names["head/bias"]
  if hk in raw and raw[hk].shape[1] != raw[hb].shape[0]:
    raise CheckpointError(
        f"checkpoint {path} (fmt={layout!r}) has {hk} {raw[hk].shape} but {hb} {raw[hb].shape};"
        " the head is corrupt, delete both head tensors to start fresh")


def _npz_to_ours(raw: dict[str, np.ndarray], spec: ViTSpec,
                 layout: str) -> tuple[dict, np.ndarray | None]:
  d = spec.width
  names = _npz_keys(layout, spec.depth)
  flat = {}
  for ours, theirs in names.items():
    if ours.startswith("head/"):
      continue
    v = raw[theirs]
    if re.search(r"attn/(query|key|value)/kernel$", ours):
      v = v.reshape(d, d)
    elif re.search(r"attn/(query|key|value)/bias$", ours):
      v = v.reshape(d)
    elif ours.endswith("attn/out/kernel"):
      v = v.reshape(d, d)
    flat[ours] = v
  head = None
  if names["head/kernel"] in raw:
    head = {"kernel": raw[names["head/kernel"]], "bias": raw[names["head/bias"]]}
  return _unflatten(flat), head


def _ours_to_npz(params: dict, layout: str, num_heads: int) -> dict[str, np.ndarray]:
  a = _as_numpy(params)
  d = a["cls"].shape[-1]
  if d % num_heads:
    raise ValueError(f"num_heads={num_heads} does not divide the width {d}; pass the model's"
                     " num_heads")
  dh = d // num_heads
  names = _npz_keys(layout, _depth_of(a))
  out = {}
  for ours, v in _flatten(a).items():
    if ours not in names:
      raise ValueError(f"parameter {ours!r} has no place in the {layout} layout; is this a"
                       " VisionTransformer params tree (without LoRA)?")
    if re.search(r"attn/(query|key|value)/kernel$", ours):
      v = v.reshape(d, num_heads, dh)
    elif re.search(r"attn/(query|key|value)/bias$", ours):
      v = v.reshape(num_heads, dh)
    elif ours.endswith("attn/out/kernel"):
      v = v.reshape(num_heads, dh, d)
    out[names[ours]] = np.ascontiguousarray(v, dtype=np.float32)
  return out


# --------------------------------------------------------------------------------------------
# Tree helpers.


def _depth_of(params: dict) -> int:
  return sum(1 for k in params if re.fullmatch(r"encoderblock_\d+", k))


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  flat = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      flat.update(_flatten(v, f"{prefix}{k}/"))
    else:
      flat[prefix + k] = v
  return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
  tree: dict = {}
  for path, v in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree


def param_shapes(spec: ViTSpec | SwinSpec, num_classes: int,
                 key: jax.Array | None = None) -> dict:
  """Shapes of the model's params (`VisionTransformer` or `SwinTransformer` of `spec`, with a
  `num_classes` head; via `jax.eval_shape`, no FLOPs)."""
  model = (SwinTransformer if is_swin(spec) else VisionTransformer)(spec, num_classes)
  images = jax.ShapeDtypeStruct((1, spec.image_size, spec.image_size, 3), jnp.float32)
  # The default key is made inside the trace: an eager one would compile programs of its own.
  variables = jax.eval_shape(
      lambda images: model.init(jax.random.PRNGKey(0) if key is None else key, images), images)
  return jax.tree.map(lambda s: tuple(s.shape), variables["params"])


def _backbone_kind(raw: dict[str, np.ndarray], fmt: str) -> str | None:
  """'ViT' or 'Swin' when the file's keys say which backbone it holds (timm's names: a ViT's
  `blocks.N.` under a class token and position embedding, a Swin's `layers.N.blocks.M.`; the
  npz layouts are ViTs), else None (the checks that follow name what is wrong)."""
  keys = [k.removeprefix(ONLINE_LORA_SWIN_PREFIX).removeprefix(ONLINE_LORA_PREFIX) for k in raw]
  if any(k.startswith("layers.") and ".blocks." in k for k in keys):
    return "Swin"  # whatever fmt says: a Swin file given as fmt='augreg' is told its layout
  if fmt not in ("timm", "online_lora"):
    return "ViT"
  if any(k.split(".")[-1] in ("cls_token", "pos_embed") for k in keys) and any(
      ".blocks." in f".{k}" for k in keys):
    return "ViT"
  return None


def _check_backbone_kind(held: str | None, swin: bool, source: str) -> None:
  """Refuses a file that holds a ViT for a Swin model (`swin`), or a Swin for a ViT."""
  if swin and held == "ViT" or not swin and held == "Swin":
    wanted = "a Swin" if swin else "a ViT"
    raise CheckpointError(
        f"checkpoint {source} holds a {held}, but the model (model.name) is {wanted}: give"
        f" {wanted}'s weights in pretrained.path, or a model.name of the {held} this file holds;"
        " for the demo on a Swin run configs/demo_swin.py (its weights are shipped)")


def check_backbone_kind(path: str, fmt: str, swin: bool) -> None:
  """The backbone check of `convert_checkpoint` from the file's names alone (the safetensors
  header, the npz index; no tensor is read), before the model's sizes are checked: a ViT file
  for a Swin model is named as such, not as a Swin's image size the file has nothing to do
  with. A file that cannot be read is left to `read_checkpoint`, which says why."""
  try:
    if fmt == "auto":
      fmt = detect_format(path)
    if fmt in ("timm", "online_lora"):
      with safetensors.safe_open(path, framework="numpy") as f:
        keys = list(f.keys())
    elif fmt in FORMATS:
      with np.load(path, allow_pickle=False) as z:
        keys = list(z.files)
    else:
      return
  except (CheckpointError, safetensors.SafetensorError, OSError, ValueError, EOFError,
          zipfile.BadZipFile):
    return
  _check_backbone_kind(_backbone_kind(dict.fromkeys(keys), fmt), swin, path)


# --------------------------------------------------------------------------------------------
# Public entry points.


def convert_checkpoint(raw: dict[str, np.ndarray], spec: ViTSpec, num_classes: int, fmt: str,
                       source: str = "<in-memory checkpoint>",
                       key: jax.Array | None = None,
                       require_head: bool = False) -> tuple[dict, list[str]]:
  """Validates and converts a raw checkpoint dict of format `fmt` (one of `FORMATS`).

  Returns our params tree (float32 NumPy arrays) and human-readable notes on what was adapted
  (ignored tensors, resampled position embeddings, fresh head); each note is also logged.
  `require_head` (`pretrained.keep_head`) refuses a file whose head cannot be kept.
  """
  if fmt not in FORMATS:
    raise CheckpointError(
        f"unknown checkpoint format {fmt!r}; use one of 'auto', {', '.join(map(repr, FORMATS))}")
  spec.validate()
  raw = {k: np.asarray(v, dtype=np.float32) for k, v in raw.items()}
  notes = []
  drop_head = False
  if fmt == "online_lora":
    raw, lora, _, notes = split_online_lora(raw, spec, source)
    if lora is not None:
      notes.append("the file's LoRA factors are not part of the backbone; set"
                   " learner.initial_lora to this file to start from them")
  _check_backbone_kind(_backbone_kind(raw, fmt), is_swin(spec), source)
  if is_swin(spec):
    if fmt not in ("timm", "online_lora"):
      raise CheckpointError(
          f"checkpoint {source} is fmt={fmt!r}, a ViT layout; a Swin loads from timm safetensors"
          " (fmt='timm') or the authors' wrapper (fmt='online_lora')")
    from olora_jax import pretrained_swin
    raw, swin_notes = pretrained_swin.prepare(raw, spec, source)
    notes += swin_notes
    params, head = pretrained_swin.timm_to_ours(raw, spec)
  elif fmt in ("timm", "online_lora"):
    _timm_validate(raw, spec, source)
    params, head = _timm_to_ours(raw, spec)
  else:
    pre = _NPZ_NAMES[fmt]["prefix"]
    ignored = [k for k in raw if k.startswith(tuple(pre + p for p in _NPZ_IGNORED_PREFIXES))]
    if ignored:
      drop_head = True
      notes.append(f"ignored {_listed(ignored)} (vit_jax 'drop-head' fine-tuning: the"
                   " pre_logits layer is not part of our model)")
      raw = {k: v for k, v in raw.items() if k not in ignored}
    _npz_validate(raw, spec, source, fmt)
    params, head = _npz_to_ours(raw, spec, fmt)

  grid = spec.image_size // spec.patch_size
  pos = params.get("pos_embedding")  # the Swin has none (relative position biases only)
  old_grid = grid if pos is None else math.isqrt(pos.shape[1] - 1)
  if old_grid != grid:
    method, antialias = _POS_RESAMPLE[fmt]
    params["pos_embedding"] = resample_pos_embedding(pos, grid, method, antialias)
    notes.append(f"resampled position embeddings from a {old_grid}x{old_grid} to a {grid}x{grid}"
                 f" grid ({method}, antialias={antialias}, as timm does for {fmt} files)")

  if head is not None and head["bias"].shape[0] == num_classes and not drop_head:
    params["head"] = head
  else:
    if head is None:
      why = "the checkpoint has no head"
    elif drop_head:
      why = "the checkpoint head was trained on top of the dropped pre_logits layer"
    else:
      why = f"the checkpoint head has {head['bias'].shape[0]} classes, not {num_classes}"
    if require_head:
      raise CheckpointError(f"pretrained.keep_head=True but {why} ({source}); set"
                            " pretrained.keep_head=False to train a fresh head")
    params["head"] = {"kernel": np.zeros((spec.width, num_classes), np.float32),
                      "bias": np.zeros((num_classes,), np.float32)}
    notes.append(f"fresh zero-initialised head with {num_classes} classes: {why}")

  want = param_shapes(spec, num_classes, key)
  got = jax.tree.map(lambda x: tuple(x.shape), params)
  if want != got:  # a bug in this module rather than in the file
    raise CheckpointError(f"converted {source} does not match the model's parameter tree;"
                          f" expected {want}, got {got}; please report this")
  for note in notes:
    logger.info("load_pretrained(%s): %s", source, note)
  return params, notes


def load_pretrained(path: str, spec: ViTSpec | SwinSpec, num_classes: int, fmt: str = "auto",
                    key: jax.Array | None = None, require_head: bool = False) -> dict:
  """The full `params` of `VisionTransformer(spec, num_classes)` (or of the `SwinTransformer`
  of a `SwinSpec`: timm and online_lora files only, olora_jax/pretrained_swin.py) from a local
  checkpoint file.

  `fmt` is 'timm' (safetensors state_dict), 'augreg' (vit_jax npz), 'big_vision' (npz with a
  `params/` prefix), 'online_lora' (the authors' LoRA-wrapped timm model; its LoRA factors are
  read by `load_online_lora`) or 'auto' (detected from the suffix and keys). Position embeddings are
  resampled to the spec's grid and the head is reused only if it has `num_classes` outputs,
  else zero-initialised (both logged). `key` only seeds the shape-only template init, so it
  never changes the values. Raises `FileNotFoundError` or `CheckpointError` (one line each).
  """
  path = os.fspath(path)
  raw, fmt = read_checkpoint(path, fmt)
  params, _ = convert_checkpoint(raw, spec, num_classes, fmt, source=path, key=key,
                                 require_head=require_head)
  # Placed by one transfer per array: `jnp.asarray` of a NumPy array compiles a placement
  # program per array shape (11 for the demo's ViT).
  return jax.device_put(params)


def save_timm_safetensors(params: dict, path: str) -> None:
  """Writes our params as a timm `VisionTransformer` (or `SwinTransformer`) state_dict (fused
  qkv, (out, in))."""
  if _is_swin_params(params):
    from olora_jax import pretrained_swin
    safetensors.numpy.save_file(pretrained_swin.ours_to_timm(params), os.fspath(path))
    return
  safetensors.numpy.save_file(_ours_to_timm(params), os.fspath(path))


def save_npz(params: dict, path: str, layout: str = "augreg", *, num_heads: int) -> None:
  """Writes our params as an AugReg ('augreg') or big_vision ('big_vision') npz. `num_heads`
  is needed to split the attention kernels per head. The file is written at `path` exactly
  (no `.npz` is appended)."""
  if layout not in _NPZ_NAMES:
    raise ValueError(f"unknown npz layout {layout!r}; use 'augreg' or 'big_vision'")
  arrays = _ours_to_npz(params, layout, num_heads)
  with open(os.fspath(path), "wb") as f:
    np.savez(f, **arrays)
