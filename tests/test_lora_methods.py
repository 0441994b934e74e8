"""InfLoRA and SD-LoRA on a tiny ViT (width 16, 2 blocks, 16 px): what each does at a task
boundary and in the steps around it. (End to end on the tiny stream, one trace and bit-exact
resume: tests/test_methods_run.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import tiny_methods
from numerics import assert_close

from configs import tiny
from olora_jax import validation
from olora_jax.methods import inflora, sd_lora
from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import LORA_TARGETS, VisionTransformer, ViTSpec

SPEC = ViTSpec(width=16, depth=2, num_heads=2, mlp_dim=32, patch_size=4, image_size=16)
C = 4
SHAPE = (16, 16, 3)
MODEL = VisionTransformer(SPEC, C)


def build(module, **block):
  method, state, _ = tiny_methods.build(module, SPEC, C, **block)
  return method, state


def batch(seed, n=8):
  rng = np.random.default_rng(seed)
  return {"images": rng.random((n, *SHAPE), np.float32),
          "labels": rng.integers(0, C, n).astype(np.int32), "mask": np.arange(n) < n - 1}


def steps(method, state, seeds):
  step = jax.jit(method.train_step)
  for seed in seeds:
    state, scalars, _ = step(state, batch(seed))
    assert np.isfinite(scalars["loss"])
  return state


def layer_inputs(state, images):
  """The inputs of q and v in each block (L, N_items, tokens, D), as the model sees them."""
  _, captured = MODEL.apply({"params": {**state["frozen"], "head": state["params"]["head"]}},
                            images, lora=inflora.lora_tree(state["down"], state["params"]["up"]),
                            capture_intermediates=inflora.layer_inputs,
                            mutable=["intermediates"])
  found = captured["intermediates"]
  return np.stack([found[f"encoderblock_{i}"]["LayerNorm_0"]["__call__"][0]
                   for i in range(SPEC.depth)])


def covariance(inputs, mask):
  x = np.asarray(inputs, np.float64)[:, np.asarray(mask)]
  x = x.reshape(x.shape[0], -1, x.shape[-1])
  return np.einsum("lnd,lne->lde", x, x) / x.shape[1]


def top_projector(cov, basis, rank):
  """U_r U_r^T of (I - M M^T) C, in float64."""
  out = np.eye(len(cov)) - basis @ basis.T
  u = np.linalg.svd(out @ cov)[0][:, :rank]
  return u @ u.T


# --------------------------------------------------------------------------------------------
# InfLoRA.

def test_inflora_designs_each_branch_off_the_stored_subspace_and_merges_exactly():
  rank = 3
  method, state = build(inflora, rank=rank, n_tasks=3, threshold_start=0.9,
                        learning_rate=1e-2)
  first = batch(0)
  inputs = layer_inputs(state, first["images"])  # the untrained branch adds nothing yet
  state = steps(method, state, [0])
  down = np.asarray(state["down"], np.float64)
  for layer in range(SPEC.depth):  # task 0: the top-r directions of the first batch's C
    expected = top_projector(covariance(inputs, first["mask"])[layer], np.zeros((16, 0)), rank)
    assert_close(3.0 * down[layer] @ down[layer].T, expected, rtol=1e-4)
  state = steps(method, state, [1, 2, 3])
  assert not state["pending"] and float(jnp.abs(state["params"]["up"]).max()) > 0

  probe = batch(9)["images"]
  before = method.predict(state, probe)
  state, host = method.at_boundary(state, {})
  assert int(state["task"]) == 1 and bool(state["pending"])
  assert_close(method.predict(state, probe), before, rtol=1e-5)  # merged == unmerged
  assert float(jnp.abs(state["params"]["up"]).max()) == 0.0 and float(state["count"]) == 0.0
  dims = np.asarray(state["basis_dim"])
  assert host["subspace_dims"] == [dims.tolist()] and (dims >= 1).all() and (dims < 16).all()
  basis = [np.asarray(state["basis"][i][:, :d], np.float64) for i, d in enumerate(dims)]
  for m in basis:  # orthonormal columns
    assert_close(m.T @ m, np.eye(m.shape[1]), rtol=1e-5)

  second = batch(4)
  inputs = layer_inputs(state, second["images"])
  state = steps(method, state, [4])
  down = np.asarray(state["down"], np.float64)
  for layer, m in enumerate(basis):
    # Orthogonal to the stored subspace, to float tolerance of the branch's own size.
    assert np.abs(m.T @ down[layer]).max() <= 1e-5 * np.abs(down[layer]).max()
    expected = top_projector(covariance(inputs, second["mask"])[layer], m, rank)
    assert_close(3.0 * down[layer] @ down[layer].T, expected, rtol=1e-4)


def test_inflora_subspace_grows_by_the_energy_criterion():
  d = 6
  rotation = np.linalg.qr(np.random.default_rng(0).normal(size=(d, d)))[0]
  scales = np.array([4.0, 2.0, 1.0, 0.5, 0.25, 0.0])  # singular values of C
  cov = jnp.asarray(rotation @ np.diag(scales) @ rotation.T, jnp.float32)
  # Energy shares scales^2 / sum: 0.7507, 0.1877, 0.0469, 0.0117, 0.0029, 0.
  empty = jnp.zeros((d, d))
  basis, dim = inflora.update_subspace(cov, empty, jnp.int32(0), 0.9)
  assert int(dim) == 2  # 0.7507 + 0.1877 >= 0.9 > 0.7507
  assert_close(np.abs(np.asarray(basis[:, :2]).T @ rotation[:, :2]), np.eye(2), rtol=1e-5)
  assert float(jnp.abs(basis[:, 2:]).max()) == 0.0
  # The energy already in M counts: 0.9384 stored, + 0.0469 = 0.9853 < 0.99 <= 0.9971.
  basis, dim = inflora.update_subspace(cov, basis, dim, 0.99)
  assert int(dim) == 4
  assert_close(np.abs(np.asarray(basis[:, 2:4]).T @ rotation[:, 2:4]), np.eye(2), rtol=1e-4)
  unchanged = inflora.update_subspace(jnp.zeros((d, d)), basis, dim, 0.99)
  assert int(unchanged[1]) == 4 and np.array_equal(unchanged[0], basis)  # no input, no update


def test_inflora_threshold_schedule_is_linear_and_held_after_the_last_task():
  block = ml_collections.ConfigDict({"threshold_start": 0.98, "threshold_end": 1.0})
  got = [float(inflora.threshold_at(block, jnp.int32(t), 10)) for t in (0, 5, 9, 12)]
  np.testing.assert_allclose(got, [0.98, 0.99, 0.998, 0.998], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# SD-LoRA.

def test_sd_lora_freezes_normalised_directions_and_trains_their_magnitudes():
  method, state = build(sd_lora, rank=2, n_tasks=2, learning_rate=1e-2)
  state = steps(method, state, [0, 1, 2])
  live = {k: np.asarray(state["params"][k]) for k in ("down", "up", "magnitudes")}
  state, host = method.at_boundary(state, {})
  assert int(state["task"]) == 1 and host == {}
  directions = {k: np.asarray(v) for k, v in state["directions"].items()}
  assert np.array_equal(directions["down"][0], live["down"])
  assert np.array_equal(directions["up"][0], live["up"])
  products = np.einsum("ljdr,ljre->ljde", live["down"].astype(np.float64), live["up"])
  norms = np.linalg.norm(products, axis=(-2, -1))
  assert_close(directions["norm"][0], norms, rtol=1e-5)
  assert float(jnp.abs(state["params"]["up"]).max()) == 0.0  # the new component adds nothing
  assert not np.array_equal(np.asarray(state["params"]["down"]), live["down"])  # fresh draw

  # The model is W + alpha_0 B_0 A_0 / ||B_0 A_0||_F now: merge that by hand and compare.
  alpha = live["magnitudes"][0]
  lora = {f"encoderblock_{i}": {t: {"lora_a": live["down"][i, j],
                                    "lora_b": alpha / norms[i, j] * live["up"][i, j]}
                                for j, t in enumerate(LORA_TARGETS)}
          for i in range(SPEC.depth)}
  merged = lora_lib.merge_into_backbone(state["frozen"], lora)
  probe = batch(9)["images"]
  expected = MODEL.apply({"params": {**merged, "head": state["params"]["head"]}}, probe)
  assert_close(method.predict(state, probe), expected, rtol=1e-5)

  # Two steps: the first moves B_1 off zero, alpha_1's gradient (through B_1 A_1) is 0 before.
  after = steps(method, state, [3, 4])
  for key in ("down", "up", "norm"):  # earlier directions: unchanged by the steps
    assert np.array_equal(np.asarray(after["directions"][key]), directions[key])
  magnitudes = np.asarray(after["params"]["magnitudes"])
  before = np.asarray(state["params"]["magnitudes"])
  assert magnitudes[0] != before[0] and magnitudes[1] != before[1]  # both magnitudes train
  assert float(jnp.abs(after["params"]["up"]).max()) > 0

  # No slot left (n_tasks=2): the live component stays and the boundary is counted.
  same, host = method.at_boundary(after, {})
  assert same is after and host == {"boundaries_past_last_slot": 1}


@pytest.mark.parametrize("module", [inflora, sd_lora])
def test_without_boundaries_one_component_trains_for_the_whole_stream(module):
  """boundaries.rule='none' never calls at_boundary: the counter stays 0 whatever the steps."""
  method, state = build(module, rank=2, n_tasks=3)
  state = steps(method, state, [0, 1, 2])
  assert int(state["task"]) == 0 and int(state["step"]) == 3


@pytest.mark.parametrize("key, value, match", [
    ("inflora.rank", 17, r"inflora.rank=17 must be an integer in \[1, model width=16\]"),
    ("sd_lora.rank", 0, r"sd_lora.rank=0 must be an integer in \[1, model width=16\]"),
    ("inflora.trainable", "all", r"inflora.trainable='all': inflora trains .* use 'lora'$"),
    ("sd_lora.n_tasks", -1, r"sd_lora.n_tasks=-1 must be an integer >= 0"),
    ("inflora.threshold_start", 1.5, r"0 < start <= end <= 1"),
])
def test_bad_branch_config_is_refused(key, value, match):
  config = tiny.get_config()
  config.method, _, leaf = key.partition(".")
  config[config.method][leaf] = value
  with pytest.raises(validation.InputError, match=match):
    validation.check_method(config, width=16)
