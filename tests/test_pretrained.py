"""Tests of `olora_jax.pretrained`: the timm / AugReg / big_vision loaders against timm's own
outputs (tests/fixtures), against an independent NumPy ViT that reads raw checkpoint dicts,
the writers' exact round trip, position-embedding resampling and the one-line errors."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from numerics import assert_close
from safetensors.numpy import load_file, save_file

from olora_jax.models.vit import VisionTransformer, ViTSpec
from olora_jax.pretrained import (
  CheckpointError,
  convert_checkpoint,
  detect_format,
  interp_matrix,
  load_pretrained,
  resize_grid,
  save_npz,
  save_timm_safetensors,
)

FIX = Path(__file__).parent / "fixtures"
FIXTURE_FILES = {
    "timm": FIX / "vit_tiny_timm.safetensors",
    "augreg": FIX / "vit_tiny_augreg.npz",
    "big_vision": FIX / "vit_tiny_big_vision.npz",
}
SPEC = ViTSpec(width=48, depth=2, num_heads=3, mlp_dim=192, patch_size=4, image_size=32)
SPEC48 = ViTSpec(width=48, depth=2, num_heads=3, mlp_dim=192, patch_size=4, image_size=48)
TINY = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)

# Measured against timm: logits 3.6e-7, pre_logits 1.2e-6, 48x48 logits 3.3e-7 (timm) /
# 2.8e-7 (npz); `assert_close` allows 1e-5 of each array's largest magnitude.
NPZ = {
    "augreg": {"pre": "", "mha": "MultiHeadDotProductAttention_1", "ln2": "LayerNorm_2",
               "mlp": "MlpBlock_3", "pos": "Transformer/posembed_input/pos_embedding"},
    "big_vision": {"pre": "params/", "mha": "MultiHeadDotProductAttention_0",
                   "ln2": "LayerNorm_1", "mlp": "MlpBlock_0", "pos": "pos_embedding"},
}


def apply(spec: ViTSpec, num_classes: int, params: dict, x: np.ndarray, **kw) -> np.ndarray:
  return np.asarray(VisionTransformer(spec, num_classes).apply({"params": params}, x, **kw))


def read_raw(path: Path) -> dict[str, np.ndarray]:
  if path.suffix == ".safetensors":
    return load_file(str(path))
  with np.load(path) as z:
    return {k: z[k] for k in z.files}


def write_raw(raw: dict[str, np.ndarray], path: Path) -> Path:
  if path.suffix == ".safetensors":
    save_file({k: np.ascontiguousarray(v) for k, v in raw.items()}, str(path))
  else:
    with open(path, "wb") as f:
      np.savez(f, **raw)
  return path


# --------------------------------------------------------------------------------------------
# An independent NumPy ViT (float64) over the raw checkpoint dicts.


def _ln(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * scale + bias


_erf = np.vectorize(math.erf)


def _gelu(x):
  return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_vit_timm(sd: dict, x_nhwc: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
  sd = {k: v.astype(np.float64) for k, v in sd.items()}
  x = x_nhwc.astype(np.float64).transpose(0, 3, 1, 2)
  w = sd["patch_embed.proj.weight"]
  d, _, p, _ = w.shape
  b, _, h, _ = x.shape
  g = h // p
  patches = x.reshape(b, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, -1)
  t = patches @ w.reshape(d, -1).T + sd["patch_embed.proj.bias"]
  t = np.concatenate([np.broadcast_to(sd["cls_token"], (b, 1, d)), t], 1) + sd["pos_embed"]
  dh = d // heads
  i = 0
  while f"blocks.{i}.norm1.weight" in sd:
    k = f"blocks.{i}."
    y = _ln(t, sd[k + "norm1.weight"], sd[k + "norm1.bias"])
    qkv = (y @ sd[k + "attn.qkv.weight"].T + sd[k + "attn.qkv.bias"])
    q, kk, v = qkv.reshape(b, -1, 3, heads, dh).transpose(2, 0, 3, 1, 4)
    a = _softmax(q @ kk.swapaxes(-1, -2) / math.sqrt(dh))
    o = (a @ v).transpose(0, 2, 1, 3).reshape(b, -1, d)
    t = t + o @ sd[k + "attn.proj.weight"].T + sd[k + "attn.proj.bias"]
    y = _ln(t, sd[k + "norm2.weight"], sd[k + "norm2.bias"])
    y = _gelu(y @ sd[k + "mlp.fc1.weight"].T + sd[k + "mlp.fc1.bias"])
    t = t + y @ sd[k + "mlp.fc2.weight"].T + sd[k + "mlp.fc2.bias"]
    i += 1
  feats = _ln(t, sd["norm.weight"], sd["norm.bias"])[:, 0]
  return feats, feats @ sd["head.weight"].T + sd["head.bias"]


def np_vit_npz(w: dict, x_nhwc: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
  n = NPZ[layout]
  pre = n["pre"]
  w = {k[len(pre):]: v.astype(np.float64) for k, v in w.items()}
  x = x_nhwc.astype(np.float64)
  kern = w["embedding/kernel"]
  p, _, _, d = kern.shape
  b, h = x.shape[:2]
  g = h // p
  t = np.einsum("byuxvc,uvcd->byxd", x.reshape(b, g, p, g, p, 3), kern).reshape(b, g * g, d)
  t = t + w["embedding/bias"]
  t = np.concatenate([np.broadcast_to(w["cls"], (b, 1, d)), t], 1) + w[n["pos"]]
  i = 0
  while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in w:
    blk = f"Transformer/encoderblock_{i}/"
    att = blk + n["mha"] + "/"
    y = _ln(t, w[blk + "LayerNorm_0/scale"], w[blk + "LayerNorm_0/bias"])
    q, k, v = (np.einsum("btd,dhk->bthk", y, w[att + f"{m}/kernel"]) + w[att + f"{m}/bias"]
               for m in ("query", "key", "value"))
    dh = q.shape[-1]
    a = _softmax(np.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(dh))
    o = np.einsum("bhqs,bshk->bqhk", a, v)
    t = t + np.einsum("bqhk,hkd->bqd", o, w[att + "out/kernel"]) + w[att + "out/bias"]
    y = _ln(t, w[blk + n["ln2"] + "/scale"], w[blk + n["ln2"] + "/bias"])
    mlp = blk + n["mlp"] + "/"
    y = _gelu(y @ w[mlp + "Dense_0/kernel"] + w[mlp + "Dense_0/bias"])
    t = t + y @ w[mlp + "Dense_1/kernel"] + w[mlp + "Dense_1/bias"]
    i += 1
  feats = _ln(t, w["Transformer/encoder_norm/scale"], w["Transformer/encoder_norm/bias"])[:, 0]
  return feats, feats @ w["head/kernel"] + w["head/bias"]


# --------------------------------------------------------------------------------------------
# Random raw checkpoints, written straight in each layout (not through our writers).


def random_raw(layout: str, spec: ViTSpec, num_classes: int, seed: int = 0) -> dict:
  d, m, p, hh = spec.width, spec.mlp_dim, spec.patch_size, spec.num_heads
  dh, n = d // hh, spec.num_patches
  if layout == "timm":
    shapes = {"patch_embed.proj.weight": (d, 3, p, p), "patch_embed.proj.bias": (d,),
              "cls_token": (1, 1, d), "pos_embed": (1, 1 + n, d), "norm.weight": (d,),
              "norm.bias": (d,), "head.weight": (num_classes, d), "head.bias": (num_classes,)}
    for i in range(spec.depth):
      k = f"blocks.{i}."
      shapes.update({k + "norm1.weight": (d,), k + "norm1.bias": (d,),
                     k + "attn.qkv.weight": (3 * d, d), k + "attn.qkv.bias": (3 * d,),
                     k + "attn.proj.weight": (d, d), k + "attn.proj.bias": (d,),
                     k + "norm2.weight": (d,), k + "norm2.bias": (d,),
                     k + "mlp.fc1.weight": (m, d), k + "mlp.fc1.bias": (m,),
                     k + "mlp.fc2.weight": (d, m), k + "mlp.fc2.bias": (d,)})
  else:
    nm = NPZ[layout]
    shapes = {"embedding/kernel": (p, p, 3, d), "embedding/bias": (d,), "cls": (1, 1, d),
              nm["pos"]: (1, 1 + n, d), "Transformer/encoder_norm/scale": (d,),
              "Transformer/encoder_norm/bias": (d,), "head/kernel": (d, num_classes),
              "head/bias": (num_classes,)}
    for i in range(spec.depth):
      blk = f"Transformer/encoderblock_{i}/"
      att, mlp = blk + nm["mha"] + "/", blk + nm["mlp"] + "/"
      for ln in ("LayerNorm_0", nm["ln2"]):
        shapes[blk + ln + "/scale"] = shapes[blk + ln + "/bias"] = (d,)
      for proj in ("query", "key", "value"):
        shapes[att + proj + "/kernel"] = (d, hh, dh)
        shapes[att + proj + "/bias"] = (hh, dh)
      shapes.update({att + "out/kernel": (hh, dh, d), att + "out/bias": (d,),
                     mlp + "Dense_0/kernel": (d, m), mlp + "Dense_0/bias": (m,),
                     mlp + "Dense_1/kernel": (m, d), mlp + "Dense_1/bias": (d,)})
    shapes = {nm["pre"] + k: s for k, s in shapes.items()}
  rng = np.random.default_rng(seed)
  raw = {}
  for k, s in shapes.items():
    scale = 0.5 if k.endswith(("kernel", "weight")) and len(s) > 1 else 0.2
    v = rng.normal(size=s) * scale
    if len(s) == 1 and k.endswith(("scale", "norm1.weight", "norm2.weight", "norm.weight")):
      v = v + 1.0  # LayerNorm scales around one
    raw[k] = v.astype(np.float32)
  return raw


SUFFIX = {"timm": ".safetensors", "augreg": ".npz", "big_vision": ".npz"}


# --------------------------------------------------------------------------------------------
# timm's own outputs.


@pytest.mark.parametrize("fmt", list(FIXTURE_FILES))
def test_fixture_matches_timm_logits(fmt):
  path = FIXTURE_FILES[fmt]
  assert detect_format(str(path)) == fmt
  x = np.load(FIX / "inputs_nhwc.npy")
  for f in ("auto", fmt):
    params = load_pretrained(str(path), SPEC, 10, fmt=f)
    assert_close(apply(SPEC, 10, params, x), np.load(FIX / "logits.npy"))
    assert_close(apply(SPEC, 10, params, x, pre_logits=True),
                               np.load(FIX / "pre_logits.npy"))


@pytest.mark.parametrize("fmt,expected", [
    ("timm", "logits48_timm_bicubic_antialias.npy"),
    ("augreg", "logits48_npz_bilinear.npy"),
    ("big_vision", "logits48_npz_bilinear.npy"),
])
def test_pos_embedding_resampling_matches_timm(fmt, expected, caplog):
  x = np.load(FIX / "inputs48_nhwc.npy")
  with caplog.at_level(logging.INFO, logger="olora_jax.pretrained"):
    params = load_pretrained(str(FIXTURE_FILES[fmt]), SPEC48, 10)
  assert "8x8 to a 12x12" in caplog.text
  assert params["pos_embedding"].shape == (1, 145, 48)
  logits = apply(SPEC48, 10, params, x)
  assert_close(logits, np.load(FIX / expected))
  # The fixtures do tell the two resamplers apart (by ~9e-4), so the check above has teeth.
  other = ("logits48_npz_bilinear.npy" if fmt == "timm"
           else "logits48_timm_bicubic_antialias.npy")
  assert np.abs(logits - np.load(FIX / other)).max() > 1e-4


def test_interp_matrix_hand_values():
  # PyTorch bilinear, antialias, 2x down: PIL's [1, 3, 3, 1] / 8 triangle, cut at the border.
  m = interp_matrix(8, 4, "bilinear", True)
  np.testing.assert_allclose(m[1], [0, 1 / 8, 3 / 8, 3 / 8, 1 / 8, 0, 0, 0])
  np.testing.assert_allclose(m[0], [3 / 7, 3 / 7, 1 / 7, 0, 0, 0, 0, 0])
  # Plain bilinear, 2x down: the mean of each pair.
  np.testing.assert_allclose(interp_matrix(4, 2, "bilinear", False),
                             [[.5, .5, 0, 0], [0, 0, .5, .5]])
  # Plain bicubic (a = -0.75), 2x down: taps at -1..2 of src 0.5, index -1 clamped to 0.
  c1, c2 = 0.59375, -0.09375
  np.testing.assert_allclose(interp_matrix(4, 2, "bicubic", False)[0], [c2 + c1, c1, c2, 0])
  # Plain bilinear 2x up clamps the source coordinate at 0 (edge replication).
  np.testing.assert_allclose(interp_matrix(2, 4, "bilinear", False)[0], [1, 0])
  for method in ("bilinear", "bicubic"):
    for aa in (True, False):
      for n_in, n_out in ((8, 12), (14, 7), (24, 37)):
        np.testing.assert_allclose(interp_matrix(n_in, n_out, method, aa).sum(1), 1, atol=1e-12)


@pytest.mark.parametrize("method,jax_method,antialias", [
    ("bicubic", "cubic", True), ("bilinear", "linear", True), ("bilinear", "linear", False)])
@pytest.mark.parametrize("new", [5, 7, 12, 16, 23])
def test_resize_agrees_with_jax_image_resize(method, jax_method, antialias, new):
  # PyTorch's antialiased kernels (Keys a=-0.5 / triangle, stretched when shrinking) and its
  # plain bilinear coincide with jax.image.resize; its plain bicubic (a=-0.75) does not.
  grid = np.random.default_rng(0).normal(size=(10, 10, 3)).astype(np.float32)
  ours = resize_grid(grid, (new, new), method, antialias)
  ref = np.asarray(jax.image.resize(grid, (new, new, 3), jax_method, antialias=antialias))
  assert_close(ours, ref)


# --------------------------------------------------------------------------------------------
# Random tiny checkpoints against the independent NumPy ViT.


@pytest.mark.parametrize("fmt", ["timm", "augreg", "big_vision"])
def test_random_checkpoint_matches_numpy_vit(fmt, tmp_path):
  raw = random_raw(fmt, TINY, 5, seed=1)
  path = write_raw(raw, tmp_path / f"ckpt{SUFFIX[fmt]}")
  x = np.random.default_rng(2).uniform(size=(3, 16, 16, 3)).astype(np.float32)
  feats, logits = (np_vit_timm(raw, x, TINY.num_heads) if fmt == "timm"
                   else np_vit_npz(raw, x, fmt))
  params = load_pretrained(str(path), TINY, 5)
  assert_close(apply(TINY, 5, params, x), logits)
  assert_close(apply(TINY, 5, params, x, pre_logits=True), feats)


@pytest.mark.parametrize("fmt", ["timm", "augreg"])
def test_fresh_zero_head_when_classes_differ(fmt, tmp_path, caplog):
  raw = random_raw(fmt, TINY, 5)
  path = write_raw(raw, tmp_path / f"ckpt{SUFFIX[fmt]}")
  x = np.random.default_rng(2).uniform(size=(2, 16, 16, 3)).astype(np.float32)
  with caplog.at_level(logging.INFO, logger="olora_jax.pretrained"):
    params = load_pretrained(str(path), TINY, 7)
  assert "fresh zero-initialised head with 7 classes" in caplog.text
  assert params["head"]["kernel"].shape == (16, 7)
  assert not np.any(params["head"]["kernel"]) and not np.any(params["head"]["bias"])
  feats = np_vit_timm(raw, x, 2)[0] if fmt == "timm" else np_vit_npz(raw, x, fmt)[0]
  assert_close(apply(TINY, 7, params, x, pre_logits=True), feats)
  # A checkpoint without any head gets the fresh head too.
  no_head = {k: v for k, v in raw.items() if not k.startswith("head")}
  _, notes = convert_checkpoint(no_head, TINY, 5, fmt)
  assert any("has no head" in n for n in notes)


def test_augreg_pre_logits_is_dropped_with_its_head(tmp_path):
  raw = random_raw("augreg", TINY, 5)
  raw["pre_logits/kernel"] = np.ones((16, 16), np.float32)
  raw["pre_logits/bias"] = np.ones((16,), np.float32)
  params, notes = convert_checkpoint(raw, TINY, 5, "augreg")
  assert any("pre_logits/bias, pre_logits/kernel" in n for n in notes)
  assert not np.any(params["head"]["kernel"])


# --------------------------------------------------------------------------------------------
# Writers.


def _assert_trees_equal(a: dict, b: dict) -> None:
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (p, x), (_, y) in zip(la, lb, strict=True):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), p


@pytest.mark.parametrize("fmt", ["timm", "augreg", "big_vision"])
def test_writers_reproduce_fixture_files_exactly(fmt, tmp_path):
  params = load_pretrained(str(FIXTURE_FILES["timm"]), SPEC, 10)
  out = tmp_path / f"w{SUFFIX[fmt]}"
  if fmt == "timm":
    save_timm_safetensors(params, str(out))
  else:
    save_npz(params, str(out), fmt, num_heads=3)
  written, original = read_raw(out), read_raw(FIXTURE_FILES[fmt])
  assert sorted(written) == sorted(original)
  for k in original:
    assert np.array_equal(written[k], original[k]), k


@pytest.mark.parametrize("fmt", ["timm", "augreg", "big_vision"])
def test_roundtrip_is_exact(fmt, tmp_path):
  model = VisionTransformer(TINY, 5)
  params = model.init(jax.random.PRNGKey(3), np.zeros((1, 16, 16, 3), np.float32))["params"]
  params = jax.tree.map(  # a non-zero head, cls and biases, so every tensor is exercised
      lambda v: v + jax.random.normal(jax.random.PRNGKey(v.size), v.shape), params)
  out = tmp_path / ("rt.safetensors" if fmt == "timm" else "rt.bin")  # any name works for npz
  if fmt == "timm":
    save_timm_safetensors(params, str(out))
  else:
    save_npz(params, str(out), fmt, num_heads=TINY.num_heads)
  assert detect_format(str(out)) == fmt
  _assert_trees_equal(load_pretrained(str(out), TINY, 5), params)


# --------------------------------------------------------------------------------------------
# Errors.


def _raises(exc, match, fn, *args, **kw):
  with pytest.raises(exc, match=match) as info:
    fn(*args, **kw)
  assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
  _raises(FileNotFoundError, r"checkpoint file not found: .*nope\.npz; check the path",
          load_pretrained, str(tmp_path / "nope.npz"), SPEC, 10)


def test_unknown_format(tmp_path):
  _raises(CheckpointError, r"unknown checkpoint format 'onnx'; use one of",
          load_pretrained, str(FIXTURE_FILES["timm"]), SPEC, 10, fmt="onnx")
  junk = tmp_path / "junk.bin"
  junk.write_bytes(b"not a checkpoint at all")
  _raises(CheckpointError, r"cannot tell the format of checkpoint .*junk\.bin",
          load_pretrained, str(junk), SPEC, 10)
  other = write_raw({"foo/bar": np.zeros(3, np.float32)}, tmp_path / "other.npz")
  _raises(CheckpointError, r"cannot tell the layout of npz checkpoint",
          load_pretrained, str(other), SPEC, 10)
  _raises(CheckpointError, r"cannot read checkpoint .* as a safetensors file",
          load_pretrained, str(FIXTURE_FILES["augreg"]), SPEC, 10, fmt="timm")


def test_missing_key(tmp_path):
  raw = read_raw(FIXTURE_FILES["timm"])
  del raw["blocks.1.norm1.bias"]
  del raw["head.bias"]  # half a head is missing too; a whole head may be absent
  path = write_raw(raw, tmp_path / "m.safetensors")
  _raises(CheckpointError,
          r"m\.safetensors \(fmt='timm'\) is missing 2 key\(s\) the model needs:"
          r" blocks\.1\.norm1\.bias, head\.bias",
          load_pretrained, str(path), SPEC, 10)


def test_unexpected_key(tmp_path):
  raw = read_raw(FIXTURE_FILES["timm"])
  raw["fc_norm.weight"] = np.ones(48, np.float32)
  path = write_raw(raw, tmp_path / "u.safetensors")
  _raises(CheckpointError, r"has 1 unexpected key\(s\): fc_norm\.weight",
          load_pretrained, str(path), SPEC, 10)
  raw = read_raw(FIXTURE_FILES["big_vision"])
  raw["opt/state"] = np.ones(3, np.float32)
  path = write_raw(raw, tmp_path / "u.npz")
  _raises(CheckpointError, r"\(fmt='big_vision'\) has 1 unexpected key\(s\): opt/state",
          load_pretrained, str(path), SPEC, 10)


def test_wrong_shape(tmp_path):
  raw = read_raw(FIXTURE_FILES["augreg"])
  raw["Transformer/encoderblock_1/LayerNorm_2/bias"] = np.zeros(47, np.float32)
  raw["Transformer/posembed_input/pos_embedding"] = np.zeros((1, 64, 48), np.float32)
  path = write_raw(raw, tmp_path / "s.npz")
  _raises(CheckpointError,
          r"mis-shaped key\(s\): Transformer/encoderblock_1/LayerNorm_2/bias expected \(48,\)"
          r" got \(47,\); Transformer/posembed_input/pos_embedding expected \(1, 1 \+ g\*g, 48\)",
          load_pretrained, str(path), SPEC, 10)


@pytest.mark.parametrize("fmt,field,value,found", [
    ("timm", "depth", 3, 2), ("augreg", "depth", 1, 2), ("big_vision", "width", 96, 48),
    ("augreg", "num_heads", 4, 3), ("timm", "mlp_dim", 96, 192), ("big_vision", "patch_size", 8, 4),
])
def test_architecture_mismatch(fmt, field, value, found):
  sizes = {"width": 48, "depth": 2, "num_heads": 3, "mlp_dim": 192, "patch_size": 4,
           "image_size": 32}
  sizes[field] = value
  _raises(CheckpointError,
          rf"has {field}={found} but the model has {field}={value}; pick the model\.name"
          rf" preset this checkpoint belongs to, or set model\.name=custom with"
          rf" model\.{field}={found} \(a preset ignores model\.{field}\)",
          load_pretrained, str(FIXTURE_FILES[fmt]), ViTSpec(**sizes), 10)
