"""The ViT with a separate LoRA pytree: B = 0 is the backbone; an exact merge keeps outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close

from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import PRESETS, VisionTransformer, ViTSpec

SPEC = ViTSpec(width=32, depth=2, num_heads=4, mlp_dim=64, patch_size=4, image_size=16)


@pytest.fixture(scope="module")
def model_and_params():
  model = VisionTransformer(SPEC, num_classes=5)
  images = jax.random.uniform(jax.random.key(0), (3, 16, 16, 3))
  # Jitted: op by op, the init compiles each of its primitives on its own (seconds).
  params = jax.jit(model.init)(jax.random.key(1), images)["params"]
  # Non-trivial head and biases so that mistakes in any branch show in the logits.
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda p: p + 0.05 * rng.standard_normal(p.shape, np.float32), params)
  return model, params, images


def test_lora_with_zero_b_is_the_backbone_bit_for_bit(model_and_params):
  model, params, images = model_and_params
  lora = lora_lib.init_lora(jax.random.key(3), SPEC, rank=4)
  assert all(np.all(np.asarray(f["lora_b"]) == 0) for b in lora.values() for f in b.values())
  plain = model.apply({"params": params}, images)
  with_lora = model.apply({"params": params}, images, lora=lora)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(with_lora))


def test_nonzero_lora_changes_the_output(model_and_params):
  model, params, images = model_and_params
  lora = lora_lib.init_lora(jax.random.key(3), SPEC, rank=4)
  lora = jax.tree.map(lambda x: x + 0.1, lora)
  plain = model.apply({"params": params}, images)
  with_lora = model.apply({"params": params}, images, lora=lora)
  assert np.abs(np.asarray(plain - with_lora)).max() > 1e-3


def test_exact_merge_keeps_the_function(model_and_params):
  model, params, images = model_and_params
  lora = lora_lib.init_lora(jax.random.key(4), SPEC, rank=4)
  lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(5), x.shape), lora)
  before = model.apply({"params": params}, images, lora=lora)
  frozen = {k: v for k, v in params.items() if k != "head"}
  merged = {**lora_lib.merge_into_backbone(frozen, lora), "head": params["head"]}
  fresh = lora_lib.init_lora(jax.random.key(6), SPEC, rank=4)
  after = model.apply({"params": merged}, images, lora=fresh)  # new LoRA has B = 0
  assert_close(after, before)
  # The merge touched only the q and v kernels.
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), frozen,
                         {k: v for k, v in merged.items() if k != "head"})
  paths = {jax.tree_util.keystr(p) for p, c in jax.tree_util.tree_leaves_with_path(changed) if c}
  assert paths == {f"['encoderblock_{i}']['attn']['{t}']['kernel']"
                   for i in range(SPEC.depth) for t in ("query", "value")}


def test_fresh_lora_init_matches_design():
  lora = lora_lib.init_lora(jax.random.key(0), SPEC, rank=3)
  bound = 1 / np.sqrt(SPEC.width)
  for block in lora.values():
    assert set(block) == {"query", "value"}
    for factors in block.values():
      a, b = np.asarray(factors["lora_a"]), np.asarray(factors["lora_b"])
      assert a.shape == (SPEC.width, 3) and b.shape == (3, SPEC.width)
      assert np.all(np.abs(a) <= bound) and a.std() > bound / 4  # U(-1/sqrt(d), 1/sqrt(d))
      assert np.all(b == 0)
  other = lora_lib.init_lora(jax.random.key(1), SPEC, rank=3)
  assert not np.array_equal(lora["encoderblock_0"]["query"]["lora_a"],
                            other["encoderblock_0"]["query"]["lora_a"])


def test_vit_b16_rank4_has_the_papers_lora_parameter_count():
  spec = ViTSpec(image_size=224, **PRESETS["vit_b16"])
  shapes = jax.eval_shape(lambda: lora_lib.init_lora(jax.random.key(0), spec, rank=4))
  assert lora_lib.num_lora_params(shapes) == 147_456


@pytest.mark.parametrize("rank", [0, 33])
def test_rank_out_of_range_is_refused(rank):
  with pytest.raises(ValueError, match="learner.rank"):
    lora_lib.init_lora(jax.random.key(0), SPEC, rank=rank)


def test_prompts_none_and_empty_prompts_are_the_plain_model_bit_for_bit(model_and_params):
  model, params, images = model_and_params
  plain = model.apply({"params": params}, images)
  for prompts in (None, jnp.zeros((3, 0, SPEC.width))):
    out = model.apply({"params": params}, images, prompts=prompts)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def test_prompts_carry_no_position_embedding(model_and_params):
  """Tokens without position information: permuting the prompts permutes only their outputs, so
  the class token and the prompt tokens' mean are unchanged; the prompts do change the output."""
  model, params, images = model_and_params
  prompts = jax.random.normal(jax.random.key(7), (3, 5, SPEC.width))
  reversed_prompts = prompts[:, ::-1]
  plain = model.apply({"params": params}, images)
  for pool in ("token", "prompts"):
    out = model.apply({"params": params}, images, prompts=prompts, pool=pool)
    assert_close(model.apply({"params": params}, images, prompts=reversed_prompts, pool=pool), out)
    assert np.abs(np.asarray(out - plain)).max() > 1e-3
  with pytest.raises(ValueError, match="'prompts' needs prompts"):
    model.apply({"params": params}, images, pool="prompts")


def test_bfloat16_compute_tracks_float32(model_and_params):
  """Logits within 3% of their scale and LoRA gradients aligned (cosine > 0.99); parameters and
  gradients stay float32, logits come back float32."""
  model, params, images = model_and_params
  bf16 = VisionTransformer(SPEC, num_classes=5, dtype=jnp.bfloat16)
  lora = jax.tree.map(lambda x: x + 0.05, lora_lib.init_lora(jax.random.key(3), SPEC, rank=4))
  labels = jnp.array([0, 3, 4])

  def loss(m, lora):
    logits = m.apply({"params": params}, images, lora=lora)
    return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(3), labels]), logits

  (loss32, logits32), grads32 = jax.jit(jax.value_and_grad(lambda f: loss(model, f),
                                                           has_aux=True))(lora)
  (loss16, logits16), grads16 = jax.jit(jax.value_and_grad(lambda f: loss(bf16, f),
                                                           has_aux=True))(lora)
  assert logits16.dtype == jnp.float32 and loss16.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(logits32)))
  assert float(jnp.max(jnp.abs(logits16 - logits32))) < 0.03 * scale
  assert float(abs(loss16 - loss32)) < 0.03 * float(loss32)
  g32 = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads32)])
  g16 = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads16)])
  assert g16.dtype == jnp.float32
  assert float(g16 @ g32 / (jnp.linalg.norm(g16) * jnp.linalg.norm(g32))) > 0.99


@pytest.mark.parametrize("name, params", [("vit_ti16", 5_717_416), ("vit_s16", 22_050_664),
                                          ("vit_b16", 86_567_656), ("vit_l16", 304_326_632),
                                          ("vit_h14", 632_045_800)])
def test_presets_have_timms_parameter_counts(name, params):
  """timm's counts for vit_{tiny,small,base,large}_patch16_224 and vit_huge_patch14_224 with a
  1000-class head (shapes only: jax.eval_shape, no FLOPs)."""
  spec = ViTSpec(image_size=224, **PRESETS[name])
  shapes = jax.eval_shape(VisionTransformer(spec, 1000).init, jax.random.key(0),
                          jnp.zeros((1, 224, 224, 3)))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == params
