"""Float comparisons scaled to the magnitude of what is compared.

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


def assert_close(actual, expected, rtol: float = 1e-5) -> None:
  """|actual - expected| <= rtol * |expected| + rtol * max|expected|, elementwise."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  scale = float(np.max(np.abs(expected))) if expected.size else 0.0
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30))


def reduction_rtol(n_terms: int) -> float:
  """The rtol for two float32 results that each sum `n_terms` terms, in different orders (module
  docstring): n_terms eps, and never below 1e-6 (a few units in the last place)."""
  return max(n_terms * EPS, 1e-6)
