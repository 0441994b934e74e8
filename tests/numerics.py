"""Float comparisons scaled to the magnitude of what is compared.

float32 results differ between CPUs (AVX-512 or not, thread counts under load) by a few units in
the last place of the *largest* values involved: a bare `atol` is too tight for values near 5 and
meaningless for values near 1e-3. `assert_close` allows `rtol` of the compared array's largest
magnitude on every element (plus `rtol` of each element), so one tolerance serves any scale.
"""

from __future__ import annotations

import numpy as np


def assert_close(actual, expected, rtol: float = 1e-5) -> None:
  """|actual - expected| <= rtol * |expected| + rtol * max|expected|, elementwise."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  scale = float(np.max(np.abs(expected))) if expected.size else 0.0
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30))
