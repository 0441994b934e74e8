"""docs/metrics.md's worked matrix: our Forgetting (the paper's eq. 9, `olora_jax.metrics`) beside
Mammoth's convention, every number of it computed when the site is built
(docs/_ext/forgetting_example.py, the `forgetting-example` directive); none typed in the section."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from olora_jax import metrics

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import forgetting_example as example  # noqa: E402  (docs/_ext is not a package)

PAGE = ROOT / "docs" / "metrics.md"
HEADING = "## Our Forgetting and Mammoth's"


def page_section() -> str:
  text = PAGE.read_text()
  assert HEADING in text, f"{PAGE.name} lacks its section {HEADING!r}"
  return text.split(HEADING, 1)[1].split("\n## ", 1)[0]


def page_matrix() -> np.ndarray:
  block = re.search(r"^```\{forgetting-example\}\n(.*?)^```", page_section(), re.S | re.M)
  assert block, f"{PAGE.name}: the section has no forgetting-example block"
  return example.parse_matrix(block.group(1).splitlines())


def mammoth_by_hand(acc: np.ndarray) -> list[float]:
  """Mammoth's log restated as a loop: after task j only tasks 0..j are logged, the rest 0."""
  t = len(acc)
  logged = [[acc[i][j] if i <= j else 0.0 for i in range(t)] for j in range(t)]
  return [max(logged[j][k] for j in range(t)) - acc[k][t - 1] for k in range(t - 1)]


def test_mammoths_terms_on_a_matrix_computed_by_hand():
  acc = np.array([[0.8, 0.5, 0.6],    # forgotten: 0.8 - 0.6 in both
                  [0.3, 0.4, 0.7],    # learnt later; its 0.3 before it was learnt is not logged
                  [0.0, 0.0, 0.9]])
  np.testing.assert_allclose(example.mammoth_forgetting_per_task(acc), [0.2, 0.0])
  np.testing.assert_allclose(metrics.forgetting_per_task(acc), [0.2, -0.3])
  rng = np.random.default_rng(0)
  for _ in range(20):
    acc = rng.uniform(size=(5, 5))
    np.testing.assert_allclose(example.mammoth_forgetting_per_task(acc), mammoth_by_hand(acc))
    assert np.all(example.mammoth_forgetting_per_task(acc) >= 0)


def test_the_page_works_a_matrix_that_shows_each_difference_it_names():
  acc = page_matrix()
  ours, theirs = metrics.forgetting_per_task(acc), example.mammoth_forgetting_per_task(acc)
  t = len(acc)
  agree = [k for k in range(t - 1) if ours[k] > 0 and np.isclose(ours[k], theirs[k])]
  later = [k for k in range(t - 1) if ours[k] < 0 and theirs[k] == 0]
  before = [k for k in range(t - 1) if np.argmax(acc[k, : t - 1]) < k and ours[k] > theirs[k]]
  # The prose under the matrix names them: task 0 forgotten alike, task 1 learnt later, task 2
  # at its best before it was learnt.
  assert (agree, later, before) == ([0], [1], [2]), (agree, later, before)
  assert metrics.forgetting(acc) < 0 < theirs.mean()  # the signs the section explains
  header, rows = example.forgetting_rows(acc)
  assert rows[-1][header.index("ours (results.json)")] == example.pct(metrics.forgetting(acc))
  assert rows[-1][header.index("Mammoth's")] == example.pct(theirs.mean())
  assert [r[3] for r in rows[:-1]] == [example.pct(x) for x in ours]


def test_the_section_types_no_number_the_build_computes():
  prose = re.sub(r"^```\{forgetting-example\}\n.*?^```", "", page_section(), flags=re.S | re.M)
  typed = re.findall(r"-?\d+\.\d+|\d+ ?%", prose)
  assert not typed, f"{PAGE.name}, {HEADING!r}: numbers typed by hand: {typed}"


@pytest.mark.parametrize("lines,said", [
    (["0.9 0.5", "0.1"], "square"),
    (["0.9 x", "0.1 0.8"], "row 1 ('0.9 x')"),
    (["90 50", "0 80"], "a fraction in [0, 1]"),
    (["0.9"], "T >= 2"),
])
def test_a_malformed_matrix_is_refused_naming_what_is_wrong(lines, said):
  with pytest.raises(ValueError, match=re.escape(said)):
    example.parse_matrix(lines)
