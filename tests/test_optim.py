"""The exact Adam (olora_jax/learner/optim.py) against float64 NumPy Adams over 300 steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from olora_jax import fidelity
from olora_jax.learner import online_lora, optim

STEPS, LR, B1, B2, EPS = 300, 1e-3, 0.9, 0.999, 1e-8


def numpy_adam_updates(grads: np.ndarray, moment_decays: tuple[float, float]) -> np.ndarray:
  """Adam's update at every step, (T, N), in float64 with exact bias corrections 1 - b^t.

  `moment_decays` are the decay rates the moment averages use: the exact (0.9, 0.999) for
  textbook Adam, or their float32 roundings for PyTorch's float32 kernels (which cast the
  Python-float decays to float32 but take the bias corrections in float64).
  """
  d1, d2 = moment_decays
  mu = np.zeros(grads.shape[1])
  nu = np.zeros(grads.shape[1])
  out = []
  for t, g in enumerate(grads.astype(np.float64), start=1):
    mu = d1 * mu + (1.0 - B1) * g
    nu = d2 * nu + (1.0 - B2) * g * g
    out.append(-LR * (mu / (1 - B1**t)) / (np.sqrt(nu / (1 - B2**t)) + EPS))
  return np.array(out)


def jax_updates(tx: optax.GradientTransformation, grads: np.ndarray) -> np.ndarray:
  params = jnp.zeros(grads.shape[1], jnp.float32)

  def step(state, g):
    updates, state = tx.update(g, state, params)
    return state, updates

  _, updates = jax.lax.scan(step, tx.init(params), jnp.asarray(grads))
  return np.asarray(updates, np.float64)


@pytest.fixture(scope="module")
def grads() -> np.ndarray:
  rng = np.random.default_rng(0)
  # Gradients over four orders of magnitude, drifting in scale like a real run's.
  scale = np.exp(rng.normal(0.0, 2.0, (1, 64)))
  return (rng.normal(0.0, 1.0, (STEPS, 64)) * scale).astype(np.float32)


def _relative_errors(updates: np.ndarray, reference: np.ndarray) -> np.ndarray:
  """Per-step relative error of the whole update vector, (T,)."""
  return np.linalg.norm(updates - reference, axis=1) / np.linalg.norm(reference, axis=1)


def test_exact_adam_matches_float64_to_float32_rounding(grads):
  f32 = float(np.float32(B1)), float(np.float32(B2))
  pytorch64 = numpy_adam_updates(grads, f32)  # PyTorch's Adam evaluated in float64
  textbook64 = numpy_adam_updates(grads, (B1, B2))
  exact = jax_updates(optim.adam_exact(LR, B1, B2, EPS), grads)
  optax_adam = jax_updates(optax.adam(LR, b1=B1, b2=B2, eps=EPS), grads)

  eps32 = float(np.finfo(np.float32).eps)
  err_exact = _relative_errors(exact, pytorch64)
  err_optax = _relative_errors(optax_adam, pytorch64)
  # Exact Adam: a few float32 roundings per step (measured max 3.1e-7), no drift over 300 steps.
  assert err_exact.max() < 4 * eps32, err_exact.max()
  # optax's float32 bias correction 1 - float32(0.999)^t: ~6e-6 relatively too small per update
  # (measured 3.6e-6 to 1.0e-5), at every step.
  assert err_optax.min() > 5 * err_exact.max(), (err_optax.min(), err_exact.max())
  assert np.median(err_optax) > 10 * err_exact.max()
  # Against textbook float64 Adam (exact decays inside the moments too) the only extra difference
  # is the float32 rounding of b2 in the second moment, which PyTorch shares: still below
  # optax's error at every step.
  err_textbook = _relative_errors(exact, textbook64)
  assert err_textbook.max() < _relative_errors(optax_adam, textbook64).min()


def test_exact_bias_correction_values():
  for b in (0.9, 0.999):
    for t in (1, 2, 10, 300, 10_000):
      got = float(optim.exact_bias_correction(np.log(b), jnp.int32(t)))
      want = 1.0 - b**t  # float64
      assert abs(got - want) <= 4 * float(np.finfo(np.float32).eps) * want


def test_state_is_checkpointable_and_jitted():
  tx = optim.adam_exact(1e-2)
  params = {"a": jnp.ones((3, 2)), "b": jnp.zeros(4)}
  state = tx.init(params)
  assert int(state.count) == 0
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  assert int(state.count) == 1
  # First step of Adam: mu_hat / sqrt(nu_hat) = sign(g), so the update is -lr exactly.
  np.testing.assert_allclose(np.asarray(updates["a"]), -1e-2, rtol=1e-6)
  chained = optax.chain(optax.clip_by_global_norm(1.0), optim.adam_exact(1e-2))
  assert jax.tree.structure(chained.init(params)) is not None


def test_fidelity_key_selects_the_optimizer():
  assert fidelity.FIDELITY_DEFAULTS[("learner", "adam_bias_correction")] == {
      "paper": "float32", "reference": "exact"}
  assert isinstance(online_lora.make_optimizer(1e-3, bias_correction="exact").init(
      jnp.zeros(2)), optim.ScaleByExactAdamState)
  with pytest.raises(ValueError, match="adam_bias_correction"):
    online_lora.make_optimizer(1e-3, bias_correction="float64")
