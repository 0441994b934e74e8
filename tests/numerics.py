"""Float comparisons scaled to the magnitude of what is compared, and the rule every test follows.

The rule (a test that breaks it fails on some CPU, not on the author's):
- Exact equality (`==`, `assert_array_equal`) only where bit-exactness is the claim: the same
  program on the same inputs (a resumed run, a restored checkpoint), a value passed through
  untouched (a frozen parameter, a copy, zeros the code writes), integers and booleans (labels,
  counts, indices, masks).
- Two computations of one float32 quantity (jit against numpy, a vmap against a loop, one program
  against another): `assert_close` with `rtol >= reduction_rtol(n)`, n the length of the longest
  chain of sums behind the value, and its `atol` from the magnitude of the terms: the compared
  array's largest value by default, `scale=` where a value is a difference of larger terms (a dot
  product near 0, a loss change). A bare `rtol` fails on the element that lands near zero.
- float64 arithmetic on counts (metrics, reports): `pytest.approx`'s default.
Checked by running the numeric tests with XLA's code generation capped at AVX2 and at SSE4_2
(`XLA_FLAGS=--xla_cpu_max_isa=AVX2`) at both optimisation levels (tiny_run.FAST_COMPILE_FLAG).

float32 results differ between CPUs (AVX-512 or not, thread counts under load) by a few units in
the last place of the *largest* values involved: a bare `atol` is too tight for values near 5 and
meaningless for values near 1e-3. `assert_close` allows `rtol` of the compared array's largest
magnitude on every element (plus `rtol` of each element), so one tolerance serves any scale.

`reduction_rtol(n)` is that tolerance for results that sum n terms in another order (a vmap for a
loop, another program's fusion, another CPU's vector width): each float32 sum of n terms is within
(n - 1) u of the exact one relative to the sum of the terms' magnitudes (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., eq. 4.4; u = eps / 2), so two orders differ by up to
n eps. A result made of several reductions in a chain (a gradient through a network) sums their
lengths. Measured, the differences sit well inside it: the Online-LoRA importance test's
per-sample gradients differ by 1.3e-5 (elementwise) between AMD and Intel hosts, against a bound of
3.9e-5.
"""

from __future__ import annotations

import numpy as np

EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


def assert_close(actual, expected, rtol: float = 1e-5, scale: float | None = None,
                 err_msg: str = "") -> None:
  """|actual - expected| <= rtol * |expected| + rtol * scale, elementwise; `scale` is the
  magnitude of the terms behind the values, max|expected| unless given (a value that cancels,
  like a dot product near 0, passes the magnitude of its terms: the sum of |a_i b_i|). `err_msg`
  names what is compared in a failure."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  if scale is None:
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(float(scale), 1e-30),
                             err_msg=err_msg)


def reduction_rtol(n_terms: int) -> float:
  """The rtol for two float32 results that each sum `n_terms` terms, in different orders (module
  docstring): n_terms eps, and never below 1e-6 (a few units in the last place)."""
  return max(n_terms * EPS, 1e-6)


def vit_rtol(spec, passes: int = 1) -> float:
  """reduction_rtol for a ViT's outputs computed by two programs: each block sums over the width,
  the MLP and the tokens twice (softmax, values); `passes=2` for a gradient (forward and back).
  `spec` is a models.vit.ViTSpec; prompts or prefixes add a few tokens, inside its slack."""
  tokens = (spec.image_size // spec.patch_size) ** 2 + 1
  return reduction_rtol(passes * spec.depth * (spec.width + spec.mlp_dim + 2 * tokens))
