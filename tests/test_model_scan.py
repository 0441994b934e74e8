"""The ViT's scanned encoder blocks (model.scan_blocks) compute what the unrolled blocks compute,
from the same parameters; model.matmul_precision reaches every matmul and convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, reduction_rtol

from configs import tiny
from olora_jax import fidelity
from olora_jax.models import ModelError, build_model, spec_from_config
from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import VisionTransformer, ViTSpec

SPEC = ViTSpec(width=32, depth=3, num_heads=4, mlp_dim=64, patch_size=4, image_size=16)
# A gradient through three blocks of width 32 and MLP width 64 sums a few hundred terms per step.
RTOL = reduction_rtol(3 * (32 + 64 + 17))


@pytest.fixture(scope="module")
def setup():
  images = jax.random.uniform(jax.random.key(0), (2, 16, 16, 3))
  params = jax.jit(VisionTransformer(SPEC, 5).init)(jax.random.key(1), images)["params"]
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda p: p + 0.05 * rng.standard_normal(p.shape, np.float32), params)
  lora = jax.tree.map(lambda x: x + 0.05, lora_lib.init_lora(jax.random.key(3), SPEC, rank=2))
  return params, images, lora


def _both(params, images, **kwargs):
  return [VisionTransformer(SPEC, 5, scan_blocks=scan).apply({"params": params}, images, **kwargs)
          for scan in (False, True)]


def test_scanned_blocks_match_the_unrolled_ones(setup):
  params, images, lora = setup
  unrolled, scanned = _both(params, images, lora=lora)
  assert_close(scanned, unrolled, RTOL)
  # Prefixes in the first two blocks only (DualPrompt's layers): a run of two, then one.
  prefixes = {f"encoderblock_{i}": {"key": jnp.full((2, 3, 32), 0.1 * (i + 1)),
                                    "value": jnp.full((2, 3, 32), -0.2)} for i in range(2)}
  prompts = jnp.linspace(-1, 1, 2 * 2 * 32).reshape(2, 2, 32)
  for kwargs in ({"prefixes": prefixes, "lora": lora}, {"prompts": prompts, "pool": "prompts"},
                 {"blocks": 2, "final_norm": False, "pre_logits": True}, {}):
    unrolled, scanned = _both(params, images, **kwargs)
    assert_close(scanned, unrolled, RTOL)


def test_scanned_gradients_match_the_unrolled_ones(setup):
  params, images, lora = setup
  grads = []
  for scan in (False, True):
    model = VisionTransformer(SPEC, 5, scan_blocks=scan)
    loss = lambda lo, p, m=model: jnp.sum(jnp.sin(m.apply({"params": p}, images, lora=lo)))  # noqa: E731
    grads.append(jax.grad(loss, argnums=(0, 1))(lora, params))
  # Against the scale of all gradients: some (the class token's, whose output only the head
  # reads through the final LayerNorm) are float32 noise around 0.
  flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in grads]
  assert_close(flat[1], flat[0], RTOL)
  assert jax.tree.structure(grads[1]) == jax.tree.structure(grads[0])


def test_scan_compiles_one_block_for_the_run_of_like_blocks(setup):
  params, images, lora = setup
  model = VisionTransformer(SPEC, 5, scan_blocks=True)
  jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, images, lora=lora))(params)
  scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert [e.params["length"] for e in scans] == [SPEC.depth]


def _config(**model):
  config = tiny.get_config()
  for key, value in model.items():
    config.model[key] = value
  return fidelity.resolve(config)


def test_build_model_passes_scan_and_refuses_what_it_cannot_scan():
  config = _config(depth=2, scan_blocks=True)
  model = build_model(config, spec_from_config(config.model), 10)
  assert model.scan_blocks and model.matmul_precision == "default"
  config = _config(scan_blocks=True)
  config.method = "inflora"
  with pytest.raises(ModelError, match="capture_intermediates, .*; set model.scan_blocks=False"):
    build_model(config, spec_from_config(config.model), 10)
  config = _config(name="swin_custom", width=16, patch_size=2, scan_blocks=True)
  with pytest.raises(ModelError, match="set model.scan_blocks=False"):
    build_model(config, spec_from_config(config.model), 10)


def _precisions(jaxpr) -> set:
  """The precision of every matmul and convolution in `jaxpr`, its sub-jaxprs included."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      found.add(eqn.params["precision"])
    for value in eqn.params.values():  # a scan's, a custom_jvp's or a pjit's body
      for sub in value if isinstance(value, tuple) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          found |= _precisions(sub)
  return found


@pytest.mark.parametrize("scan", [False, True])
def test_matmul_precision_reaches_every_product_forward_and_backward(setup, scan):
  params, images, lora = setup
  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  for precision, want in (("highest", {highest}), ("default", {None})):
    model = VisionTransformer(SPEC, 5, matmul_precision=precision, scan_blocks=scan)
    loss = lambda lo, m=model: jnp.sum(m.apply({"params": params}, images, lora=lo))  # noqa: E731
    assert _precisions(jax.make_jaxpr(jax.grad(loss))(lora).jaxpr) == want, precision


def test_matmul_precision_follows_the_fidelity():
  config = tiny.get_config()
  assert fidelity.resolve(config).model.matmul_precision == "default"
  config.fidelity = "reference"
  assert fidelity.resolve(config).model.matmul_precision == "highest"
  config.model.matmul_precision = "high"
  with pytest.raises(ValueError, match="unknown model.matmul_precision='high'"):
    fidelity.resolve(config)
