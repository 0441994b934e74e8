"""The comparison sentences the pages state about the demo table hold on its rows.

Each claim is declared once here: the page, the words it states it in, the two rows of the
demo table (docs/tutorials/first-comparison.md, read by `olora_jax.methods.cards.demo_rows`), the
columns and the relation. `beyond`: the first mean lies on the stated side of the second by more
than the sum of the two standard deviations (the tables' "seeds' spread"); `within`: the two
means differ by no more than that sum, so neither is ranked above the other. A page that drops
the words, or a table whose numbers no longer bear the claim out, fails here. The table holds
the given class order over the seeds each row names; the reversed order and held-out seeds are
not in it, so the claims are checked on those rows alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from olora_jax.methods import cards

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = "docs/tutorials/first-comparison.md"

# (page, words on the page, row, other row, columns, relation)
CLAIMS = [
    ("docs/methods/scr.md", "its Forgetting is below ER's by more than the seeds' spread",
     "SCR", "ER", ("forgetting",), "below"),
    ("docs/methods/scr.md", "its A_final on both demos and its Si-Blurry A_auc are within the"
     " spread of ER's", "SCR", "ER", ("A_final", "blurry_A_final", "blurry_A_auc"), "within"),
    (TUTORIAL, "ends above fine-tuning's demo A_final by more than the seeds' spread",
     "LwF", "Fine-tuning", ("A_final",), "above"),
    ("docs/methods/lwf.md", "It stays below ER's A_final by more than the seeds' spread", "LwF",
     "ER", ("A_final",), "below"),
    ("docs/methods/onpro.md", "its A_final is within the seeds' spread of ER's on both demos",
     "OnPro", "ER", ("A_final", "blurry_A_final"), "within"),
    (TUTORIAL, "ends within the seeds' spread of ER's demo A_final", "OnPro", "ER", ("A_final",),
     "within"),
]


def mean_std(cell: str) -> tuple[float, float]:
  match = re.fullmatch(r"(-?\d+(?:\.\d+)?) ± (\d+(?:\.\d+)?)", cell)
  assert match, f"{TUTORIAL}: {cell!r} is not 'mean ± std'"
  return float(match.group(1)), float(match.group(2))


def holds(a: str, b: str, relation: str) -> bool:
  (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
  return {"above": ma - mb > sa + sb, "below": mb - ma > sa + sb,
          "within": abs(ma - mb) <= sa + sb}[relation]


def test_the_relation_reads_the_spread_as_the_tables_do():
  assert holds("29.20 ± 7.58", "15.02 ± 2.87", "above")
  assert not holds("29.20 ± 7.58", "25.02 ± 2.87", "above")
  assert holds("53.49 ± 6.31", "52.94 ± 6.53", "within")
  assert not holds("19.80 ± 4.99", "44.75 ± 8.70", "within")
  assert holds("19.80 ± 4.99", "44.75 ± 8.70", "below")


@pytest.mark.parametrize("page,words,row,other,columns,relation", CLAIMS,
                         ids=[f"{c[2]}-{c[3]}-{c[5]}" for c in CLAIMS])
def test_each_comparison_sentence_holds_on_the_demo_table(page, words, row, other, columns,
                                                          relation):
  text = " ".join((ROOT / page).read_text().split())
  assert words in text, f"{page} no longer says {words!r}: drop or update its claim here"
  rows = cards.demo_rows((ROOT / TUTORIAL).read_text())
  for column in columns:
    assert holds(rows[row][column], rows[other][column], relation), (
        f"{page}: {words!r} fails on {TUTORIAL}'s {column}: {row} {rows[row][column]} against"
        f" {other} {rows[other][column]}")
