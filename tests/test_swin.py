"""The Swin backbone: timm's own outputs (tests/fixtures/swin-tiny-timm), timm's window rules, the
authors' Online-LoRA wrapper of a Swin, and LoRA on every stage through the ViT's LoRA code."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import assert_close
from safetensors.numpy import load_file, save_file

from configs import core50, split_imagenet_s
from olora_jax import models, pretrained, reporting, validation
from olora_jax.learner import buffer as buffer_lib
from olora_jax.learner import online_lora
from olora_jax.models import lora as lora_lib
from olora_jax.models import swin

FIX = Path(__file__).parent / "fixtures" / "swin-tiny-timm"
TIMM_FILE = FIX / "swin_tiny_timm.safetensors"
AUTHORS_FILE = FIX / "swin_tiny_online_lora.safetensors"
# timm SwinTransformer(img_size=32, patch_size=2, embed_dim=16, depths=(2, 2, 2),
# num_heads=(2, 4, 8), window_size=4): stages 16x16, 8x8 and 4x4 (window = map: no shift).
SPEC = swin.SwinSpec(embed_dim=16, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4,
                     patch_size=2, image_size=32)
# Measured against timm: logits 1.6e-7, pre-logits 1.8e-7, stages 3.2e-7 / 4.0e-7 / 4.8e-7,
# authors' wrapper 2.4e-7 (relative to each array's largest magnitude); `assert_close` allows 1e-5.


@functools.cache
def _timm_params():
  return pretrained.load_pretrained(str(TIMM_FILE), SPEC, 10)


def _apply(params, x, **kw):
  return jax.jit(functools.partial(swin.SwinTransformer(SPEC, 10).apply, **kw))(
      {"params": params}, x)


def test_matches_timm_logits_pre_logits_and_every_stage():
  x = np.load(FIX / "inputs_nhwc.npy")
  assert pretrained.detect_format(str(TIMM_FILE)) == "timm"
  params = _timm_params()
  logits, sown = _apply(params, x, mutable=["intermediates"])
  assert_close(logits, np.load(FIX / "logits.npy"))
  assert_close(_apply(params, x, pre_logits=True), np.load(FIX / "pre_logits.npy"))
  stages = np.load(FIX / "stage_outputs.npz")
  for s in range(3):
    (out,) = sown["intermediates"][f"stage{s}"]
    assert_close(out, stages[f"stage{s}"])


def test_timms_window_rules():
  """The window shrinks to a map no larger than it, and then nothing is shifted; otherwise every
  second block is shifted by half a window (Swin-T at 224 px: 56, 28, 14, 7)."""
  t = swin.SwinSpec(image_size=224, **swin.PRESETS["swin_t"])
  t.validate()
  assert [t.stage_resolution(s) for s in range(4)] == [56, 28, 14, 7]
  assert [t.window_and_shift(2, b) for b in range(6)] == [(7, 0), (7, 3)] * 3
  assert [t.window_and_shift(3, b) for b in range(2)] == [(7, 0), (7, 0)]
  small = swin.SwinSpec(embed_dim=8, depths=(2, 2), num_heads=(1, 2), window_size=7,
                        patch_size=2, image_size=20)
  assert [small.window_and_shift(1, b) for b in range(2)] == [(5, 0), (5, 0)]  # 5x5 < 7
  assert SPEC.window_and_shift(2, 1) == (4, 0) and SPEC.window_and_shift(1, 1) == (4, 2)
  # The mask separates the regions of the cyclically shifted 8x8 map: window (0, 0) is one
  # region (16 x 16 pairs allowed), (0, 1) and (1, 0) two of 8 tokens (2 x 8 x 8), (1, 1) four
  # of 4 (4 x 4 x 4); each token attends only within its own region.
  mask = swin.shifted_window_mask(8, 4, 2)
  assert mask.shape == (4, 16, 16) and set(np.unique(mask)) == {0.0, swin.MASK_VALUE}
  assert [int((m == 0).sum()) for m in mask] == [256, 128, 128, 64]


def test_swin_t_has_timms_parameter_count():
  """timm's count for swin_tiny_patch4_window7_224 with a 1000-class head (shapes only)."""
  spec = swin.SwinSpec(image_size=224, **swin.PRESETS["swin_t"])
  shapes = jax.eval_shape(swin.SwinTransformer(spec, 1000).init, jax.random.key(0),
                          jnp.zeros((1, 224, 224, 3)))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == 28_288_354
  lora = jax.eval_shape(lambda: lora_lib.init_lora(jax.random.key(0), spec, rank=4))
  # q and v of 12 blocks: 2 * 2 * 4 * (96 * 2 + 192 * 2 + 384 * 6 + 768 * 2) = 70,656.
  assert lora_lib.num_lora_params(lora) == 70_656


def test_timm_roundtrip_is_exact_and_an_older_layout_loads_the_same(tmp_path):
  params = _timm_params()
  path = tmp_path / "back.safetensors"
  pretrained.save_timm_safetensors(params, str(path))
  assert load_file(str(path)).keys() == load_file(str(TIMM_FILE)).keys()
  jax.tree.map(np.testing.assert_array_equal, pretrained.load_pretrained(str(path), SPEC, 10),
               params)
  # timm < 0.9: patch merging at the end of the stage before, head.*, saved buffers.
  raw = load_file(str(TIMM_FILE))
  old = {}
  for k, v in raw.items():
    if ".downsample." in k:
      s = int(k.split(".")[1])
      k = k.replace(f"layers.{s}.", f"layers.{s - 1}.", 1)
    old[k.replace("head.fc.", "head.")] = v
  for s in range(3):
    for b in range(2):
      old[f"layers.{s}.blocks.{b}.attn.relative_position_index"] = (
          swin.relative_position_index(4).astype(np.int64))
  loaded, notes = pretrained.convert_checkpoint(old, SPEC, 10, "timm")
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, params))
  assert any("older timm layout" in n for n in notes)
  assert any("dropped 6 buffer(s)" in n for n in notes)
  old["layers.0.blocks.0.attn.relative_position_index"] = swin.relative_position_index(3)
  with pytest.raises(pretrained.CheckpointError, match="another window size"):
    pretrained.convert_checkpoint(old, SPEC, 10, "timm")


def test_a_vit_file_for_a_swin_model_says_it_holds_a_vit_and_the_reverse():
  """One line naming the backbone the file holds (not one Swin size after another), pointing at
  the demo's Swin config."""
  vit_file = Path(pretrained.__file__).parent / "assets" / "vit_tiny_digits.safetensors"
  with pytest.raises(pretrained.CheckpointError, match=(
      r"holds a ViT, but the model \(model.name\) is a Swin: .*configs/demo_swin.py")):
    pretrained.load_pretrained(str(vit_file), SPEC, 10)
  vit = models.spec_from_config(split_imagenet_s.get_config().model)
  with pytest.raises(pretrained.CheckpointError, match=r"holds a Swin, but the model"):
    pretrained.load_pretrained(str(TIMM_FILE), vit, 10)


@pytest.mark.parametrize("change, match", [
    ("drop", r"missing 1 key\(s\) the model needs: layers.1.downsample.norm.bias"),
    ("extra", r"1 unexpected key\(s\): layers.0.blocks.0.attn.extra"),
    ("shape", r"mis-shaped key\(s\): layers.2.blocks.1.attn.relative_position_bias_table"
              r" expected \(49, 8\) got \(169, 8\)"),
    ("heads", r"num_heads=\(2, 4, 4\) but the model has num_heads=\(2, 4, 8\)"),
])
def test_bad_files_are_refused_in_one_line(change, match):
  raw = dict(load_file(str(TIMM_FILE)))
  if change == "drop":
    del raw["layers.1.downsample.norm.bias"]
  elif change == "extra":
    raw["layers.0.blocks.0.attn.extra"] = np.zeros(3, np.float32)
  elif change == "shape":
    raw["layers.2.blocks.1.attn.relative_position_bias_table"] = np.zeros((169, 8), np.float32)
  else:
    raw["layers.2.blocks.0.attn.relative_position_bias_table"] = np.zeros((49, 4), np.float32)
  with pytest.raises(pretrained.CheckpointError, match=match) as e:
    pretrained.convert_checkpoint(raw, SPEC, 10, "timm", source="f")
  assert "\n" not in str(e.value)
  with pytest.raises(pretrained.CheckpointError, match="a Swin loads from timm safetensors"):
    pretrained.convert_checkpoint(raw, SPEC, 10, "augreg", source="f")


def test_authors_swin_wrapper_logits_and_exact_roundtrip(tmp_path, caplog):
  """The released code's LoRA_Swin_timm: frozen and current pairs on q and v of every block of
  every stage, both non-zero; its logits; import -> export -> import bit for bit."""
  path = str(AUTHORS_FILE)
  assert pretrained.detect_format(path) == "online_lora"
  with caplog.at_level(logging.INFO, logger="olora_jax.pretrained"):
    params = pretrained.load_pretrained(path, SPEC, 10, require_head=True)
  assert "proj_3d.bias, proj_3d.weight: the released code's proj_3d module" in caplog.text
  lora, frozen = pretrained.load_online_lora(path, SPEC, rank=4)
  assert set(lora) == set(SPEC.lora_layers()) and lora.keys() == frozen.keys()
  assert all(np.any(x) for x in jax.tree.leaves((lora, frozen)))
  x = np.load(FIX / "inputs_nhwc.npy")
  logits = _apply(params, x, lora=lora_lib.concat_adapters(lora, frozen))
  assert_close(logits, np.load(FIX / "online_lora_logits.npy"))

  out = tmp_path / "export.safetensors"
  pretrained.save_online_lora_safetensors(params, lora, str(out), frozen_lora=frozen)
  original, exported = load_file(path), load_file(str(out))
  assert set(original) - set(exported) == {"proj_3d.weight", "proj_3d.bias"}
  assert set(exported) <= set(original)
  for k, v in exported.items():
    np.testing.assert_array_equal(v, original[k])
  jax.tree.map(np.testing.assert_array_equal, pretrained.load_online_lora(str(out), SPEC, 4),
               (lora, frozen))
  jax.tree.map(np.testing.assert_array_equal,
               pretrained.load_pretrained(str(out), SPEC, 10, require_head=True), params)
  with pytest.raises(pretrained.CheckpointError, match="has LoRA rank 4 but learner.rank is 2"):
    pretrained.load_online_lora(path, SPEC, rank=2)
  broken = {k: v for k, v in original.items()
            if k != "lora_swin.layers.1.blocks.1.attn.qkv.linear_b_v.weight"}
  save_file(broken, str(tmp_path / "broken.safetensors"))
  with pytest.raises(pretrained.CheckpointError,
                     match=r"missing lora_swin.layers.1.blocks.1.attn.qkv.linear_b_v.weight"):
    pretrained.load_online_lora(str(tmp_path / "broken.safetensors"), SPEC, 4)


# --------------------------------------------------------------------------------------------
# LoRA through the ViT's code: a zero B, the paper's merge, the reference's fused pass. On a
# smaller random Swin (3 blocks: the shifted 8x8 stage and a 4x4 one), to compile fast.

SMALL = swin.SwinSpec(embed_dim=8, depths=(2, 1), num_heads=(1, 2), window_size=4, patch_size=2,
                      image_size=16)


@functools.cache
def _small():  # callers must not mutate (or donate) the returned trees
  model = swin.SwinTransformer(SMALL, 10)
  x = jax.random.uniform(jax.random.key(0), (4, 16, 16, 3))
  params = jax.jit(model.init)(jax.random.key(1), x)["params"]
  rng = np.random.default_rng(2)  # non-trivial biases, scales, bias tables and head
  params = jax.tree.map(  # in NumPy: eager JAX ops would compile one program each
      lambda p: np.asarray(p) + 0.05 * rng.standard_normal(p.shape, np.float32), params)
  return model, params, x


def _random_lora(seed: int, scale: float = 0.05) -> dict:
  tree = lora_lib.init_lora(jax.random.key(seed), SMALL, 2)
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(
      treedef, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)])


@functools.cache
def _small_forward():
  model = _small()[0]
  return jax.jit(lambda params, x, lora: model.apply({"params": params}, x, lora=lora))


def _small_apply(params, x, lora=None):
  return _small_forward()(params, x, lora)


def test_lora_with_zero_b_is_the_backbone_bit_for_bit_and_sits_on_every_stage():
  _, params, x = _small()
  lora = lora_lib.init_lora(jax.random.key(3), SMALL, rank=4)
  assert {k: v["query"]["lora_a"].shape for k, v in lora.items()} == {
      "stage0_block0": (8, 4), "stage0_block1": (8, 4), "stage1_block0": (16, 4)}
  plain = _small_apply(params, x)
  np.testing.assert_array_equal(_small_apply(params, x, lora=lora), plain)
  assert np.abs(_small_apply(params, x, lora=_random_lora(4)) - plain).max() > 1e-3
  with pytest.raises(ValueError, match="learner.rank=9 must be between 1 and the model width 8"):
    lora_lib.init_lora(jax.random.key(0), SMALL, rank=9)


def test_paper_plateau_merge_keeps_the_function_and_the_fused_pair_equals_its_merge():
  model, params, x = _small()
  backbone, head = online_lora.split_params(jax.tree.map(jnp.array, params))
  config = online_lora.LearnerConfig(rank=2)
  tx = online_lora.make_optimizer(1e-3)
  learner = online_lora.make_learner(model, tx, config)
  # consolidate donates the state and the frozen tree: give it copies.
  frozen = online_lora.init_frozen(jax.tree.map(jnp.array, backbone), SMALL, config)
  state = online_lora.init_train_state(jax.random.key(1), head, SMALL, config, tx)
  buf = buffer_lib.HardBuffer(images=jnp.asarray(x[:2]), labels=jnp.array([1, 2]),
                              valid=jnp.array([True, False]))
  lora1 = _random_lora(5)
  state = state.replace(trainable={**state.trainable, "lora": jax.tree.map(jnp.array, lora1)})
  before = learner.predict(state, frozen, x)
  state, frozen = learner.consolidate(state, frozen, buf)
  assert_close(learner.predict(state, frozen, x), before)
  assert int(state.n_plateaus) == 1 and any(np.any(o) for o in jax.tree.leaves(state.omega))
  q = lora1["stage1_block0"]["query"]
  assert_close(frozen["stage1_block0"]["attn"]["query"]["kernel"],
               backbone["stage1_block0"]["attn"]["query"]["kernel"] + q["lora_a"] @ q["lora_b"])
  # The reference fidelity's frozen pair runs beside the current LoRA in one pass of rank 2r:
  # the same function as the pair merged into W plus the current LoRA on its own.
  pair, current = _random_lora(7), _random_lora(9)
  fused = _small_apply(params, x, lora=lora_lib.concat_adapters(current, pair))
  merged = {**lora_lib.merge_into_backbone(backbone, pair), "head": head}
  assert_close(fused, _small_apply(merged, x, lora=current))


def test_one_concatenated_pass_equals_separate_passes():
  """The learner's single forward over the batch and the hard buffer together gives the losses
  and gradients of separate passes (window masks are per image, so nothing leaks across)."""
  model, params, x = _small()
  backbone, head = online_lora.split_params(jax.tree.map(jnp.array, params))
  config = online_lora.LearnerConfig(rank=2)
  # SGD with lr 1000: the update is -1000 x the gradient, large enough not to drown in the
  # rounding of the weights it is added to.
  tx = optax.sgd(1000.0)
  learner = online_lora.make_learner(model, tx, config)
  state = online_lora.init_train_state(jax.random.key(1), head, SMALL, config, tx,
                                       lora=_random_lora(11))
  batch = {"images": jnp.asarray(x[:2]), "labels": jnp.array([3, 4]),
           "mask": jnp.array([True, True])}
  buf = buffer_lib.HardBuffer(images=jnp.asarray(x[2:]), labels=jnp.array([5, 6]),
                              valid=jnp.array([True, True]))

  def objective(trainable):
    def ce(images, labels):
      logits = model.apply({"params": {**backbone, "head": trainable["head"]}}, images,
                           lora=trainable["lora"])
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return ce(batch["images"], batch["labels"]) + ce(buf.images, buf.labels)

  trainable = jax.tree.map(jnp.array, state.trainable)
  value, grad = jax.jit(jax.value_and_grad(objective))(trainable)
  new_state, scalars, _ = learner.train_step(state, backbone, buf, batch)
  assert_close(scalars["window_value"], value)
  step = jax.tree.map(lambda a, b: (a - b) / 1000.0, trainable, new_state.trainable)
  jax.tree.map(assert_close, step, grad)


def test_bfloat16_compute_tracks_float32():
  _, params, x = _small()
  bf16 = swin.SwinTransformer(SMALL, 10, dtype=jnp.bfloat16)
  logits16 = jax.jit(bf16.apply)({"params": params}, x, lora=_random_lora(13))
  logits32 = _small_apply(params, x, lora=_random_lora(13))
  assert logits16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(logits16 - logits32))) < 0.03 * float(jnp.max(jnp.abs(logits32)))


def test_prompts_are_refused():
  with pytest.raises(ValueError, match="need a ViT backbone"):
    _small()[0].apply({"params": _small()[1]}, _small()[2], prompts=jnp.zeros((4, 2, 16)))


def test_swin_t_variants_of_the_appendix_settings():
  """`:swin_t` of Split ImageNet-S and CORe50: Swin-T at 224 px, Online-LoRA lr 3e-4, and the
  setting labels under which the report layout holds the appendix's numbers."""
  for module, label in ((split_imagenet_s, "imagenet_sketch disjoint/10 swin_t"),
                        (core50, "core50 domain/8 swin_t")):
    config = module.get_config("swin_t")
    assert config.learner.learning_rate == 3e-4 and config.pretrained.format == "timm"
    assert models.spec_from_config(config.model) == swin.SwinSpec(image_size=224,
                                                                  **swin.PRESETS["swin_t"])
    assert reporting.setting_label(validation.flatten(config)) == label
    assert reporting.PAPER_RESULTS["swin"][label]["Online-LoRA"][0][0] in (53.75, 95.29)
  assert reporting.LAYOUTS["swin"].backbones == ("swin_t",)


def test_the_public_api_builds_a_swin_from_a_config():
  """`olora_jax.spec_from_config` gives a `SwinSpec` for a Swin model section (a `ViTSpec` for a
  ViT one), and the exported `SwinTransformer` and `init_lora` take it as the trainer does."""
  import olora_jax as ol
  config = core50.get_config("swin_t").model
  config.update(name=swin.CUSTOM, width=8, stage_depths=(2, 1), stage_heads=(1, 2),
                window_size=4, patch_size=2, image_size=16)
  spec = ol.spec_from_config(config)
  assert isinstance(spec, ol.SwinSpec) and spec == SMALL
  assert ol.SwinTransformer is swin.SwinTransformer
  assert isinstance(ol.spec_from_config(split_imagenet_s.get_config().model), ol.ViTSpec)
  _, params, x = _small()
  lora = ol.init_lora(jax.random.key(3), spec, 2)
  np.testing.assert_array_equal(
      jax.jit(ol.SwinTransformer(spec, 10).apply)({"params": params}, x, lora=lora),
      _small_apply(params, x))


def test_a_preset_refusing_an_image_size_names_its_own_window_and_a_size_that_works():
  """A preset's window is its own (model.window_size is swin_custom's): the refusal says 7, not
  the ignored value, and the image size it advises builds."""
  config = core50.get_config("swin_t").model
  config.update(window_size=4, image_size=64)
  with pytest.raises(ValueError, match=r"model.name='swin_t' cannot take model.image_size=64"
                     r" \(stage 0's 16x16 feature map is not a multiple of the preset's window 7;"
                     r".*use model.image_size=224 or a multiple of it"):
    swin.spec_from_config(config)
  config.image_size = 448
  assert swin.spec_from_config(config).window_size == 7
