"""Adam with bias corrections exact to float32 rounding, as PyTorch's `torch.optim.Adam` runs it.

`optax.adam` computes the bias corrections `1 - b1^t` and `1 - b2^t` in float32 from the rounded
decay rates; `float32(0.999) = 0.99900001287`, so `1 - b2^t` is about 1.3e-5 relatively too small
at small t and every update about 6e-6 relatively too small. PyTorch computes both corrections in
float64 on the host from the exact Python floats. `adam_exact` gets the same values inside jit,
in float32, without float64: `1 - b^t = -expm1(t * log(b))` with `log(b)` taken in float64 when
the transform is built, so the only errors are a few float32 roundings (~1e-7 relative).

The rest follows PyTorch's single-tensor / foreach Adam (no weight decay, no amsgrad) operation
by operation, in float32:

    mu <- mu + (1 - b1) * (g - mu)                      # exp_avg.lerp_(grad, 1 - b1)
    nu <- nu * b2 + (1 - b2) * g * g                    # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    update = -(lr / bc1) * (mu / (sqrt(nu) / sqrt(bc2) + eps))

with bc1 = 1 - b1^t, bc2 = 1 - b2^t and t the step count (1 at the first update). The moment
updates use the float32 decay rates, as PyTorch's float32 kernels do.

`adam_exact` is an ordinary `optax.GradientTransformation` (pure `init` / `update`, jit-able,
composes with `optax.chain`); its state is `ScaleByExactAdamState(count, mu, nu)`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# The values of `learner.adam_bias_correction` (a fidelity key, olora_jax/fidelity.py).
BIAS_CORRECTIONS = ("float32", "exact")


class ScaleByExactAdamState(NamedTuple):
  count: jax.Array  # int32 (): updates taken so far
  mu: optax.Updates  # first moment, like the params
  nu: optax.Updates  # second moment, like the params


def exact_bias_correction(log_decay: float, count: jax.Array) -> jax.Array:
  """1 - decay^count in float32, exact to float32 rounding; `log_decay` = log(decay) in float64
  (a Python float), `count` an int32 scalar (traced or not). Pure."""
  t = count.astype(jnp.float32)
  return -jnp.expm1(t * jnp.float32(log_decay))


def adam_exact(learning_rate: float, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8) -> optax.GradientTransformation:
  """Adam with exact bias corrections and PyTorch's operation order (module docstring).

  Returns the *negative* scaled step (ready for `optax.apply_updates`), like `optax.adam`.
  """
  if not learning_rate > 0:
    raise ValueError(f"learner.learning_rate={learning_rate} must be > 0")
  for name, b in (("b1", b1), ("b2", b2)):
    if not 0.0 < b < 1.0:
      raise ValueError(f"Adam {name}={b} must lie in (0, 1)")
  log_b1, log_b2 = math.log(b1), math.log(b2)

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return ScaleByExactAdamState(count=jnp.zeros([], jnp.int32), mu=zeros,
                                 nu=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu = jax.tree.map(lambda m, g: m + (1.0 - b1) * (g - m), state.mu, updates)
    nu = jax.tree.map(lambda v, g: v * b2 + (1.0 - b2) * g * g, state.nu, updates)
    step_size = jnp.float32(learning_rate) / exact_bias_correction(log_b1, count)
    bc2_sqrt = jnp.sqrt(exact_bias_correction(log_b2, count))
    new_updates = jax.tree.map(lambda m, v: -step_size * (m / (jnp.sqrt(v) / bc2_sqrt + eps)),
                               mu, nu)
    return new_updates, ScaleByExactAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def adam(learning_rate: float, bias_correction: str = "float32", b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
  """The learner's Adam: `optax.adam` ('float32' bias corrections) or `adam_exact` ('exact')."""
  if not learning_rate > 0:
    raise ValueError(f"learner.learning_rate={learning_rate} must be > 0")
  if bias_correction == "float32":
    return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
  if bias_correction == "exact":
    return adam_exact(learning_rate, b1=b1, b2=b2, eps=eps)
  raise ValueError(f"unknown learner.adam_bias_correction={bias_correction!r}; use one of"
                   f" {BIAS_CORRECTIONS}")
