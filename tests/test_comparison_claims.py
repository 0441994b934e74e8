"""The demo comparison's committed data (docs/data/demo_comparison/, `olora_jax.comparison`) and
the comparison sentences of the docs computed from it.

Each sentence is declared once (`comparison.CLAIMS`: the page, its words, the two methods, the
metrics, the relation and the streams it speaks of). A page that drops the words, or data on
which the relation fails on any stream the claim names (the given and the reversed class order
for a ranking on the disjoint demo; the Si-Blurry demo where the sentence speaks of it), fails
here, over the seeds committed for both methods (at least `comparison.MIN_SEEDS`). The data are
the summaries `scripts/demo_comparison.py collect` wrote from real runs; the collection itself is
tested on a run of this session, placed in a sweep root's layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from olora_jax import comparison, methods, reporting

ROOT = Path(__file__).resolve().parents[1]


def stat(mean: float, std: float, n: int = 5) -> dict:
  return {"mean": mean, "std": std, "n": n}


def test_the_relation_reads_the_spread_as_the_tables_do():
  assert comparison.relation_holds(stat(29.20, 7.58), stat(15.02, 2.87), "above")
  assert not comparison.relation_holds(stat(29.20, 7.58), stat(25.02, 2.87), "above")
  assert comparison.relation_holds(stat(53.49, 6.31), stat(52.94, 6.53), "within")
  assert not comparison.relation_holds(stat(19.80, 4.99), stat(44.75, 8.70), "within")
  assert comparison.relation_holds(stat(19.80, 4.99), stat(44.75, 8.70), "below")


@pytest.mark.parametrize("claim", comparison.CLAIMS,
                         ids=[f"{c.method}-{c.other}-{c.relation}-{'+'.join(c.metrics)}"
                              for c in comparison.CLAIMS])
def test_each_comparison_sentence_holds_on_every_stream_it_names(claim):
  text = " ".join((ROOT / claim.page).read_text().split())
  assert claim.words in text, (f"{claim.page} no longer says {claim.words!r}: drop or update its"
                               " claim in olora_jax/comparison.py")
  failures = claim.failures(comparison.load())
  assert not failures, f"{claim.page}: {claim.words!r} fails: " + "; ".join(failures)


def test_a_claim_fails_on_a_stream_where_the_relation_does_not_hold():
  cells = []
  for seed in range(5):
    for stream, a in (("demo", 0.9), ("demo_reversed", 0.5)):
      cells.append({"stream": stream, "method": "x", "seed": seed, "A_final": a + 0.01 * seed})
      cells.append({"stream": stream, "method": "y", "seed": seed, "A_final": 0.5 + 0.01 * seed})
  claim = comparison.Claim("p", "w", "x", "y", ("A_final",), "above", ("demo",))
  assert claim.failures(cells) == []
  both = dataclasses.replace(claim, streams=("demo", "demo_reversed"))
  (line,) = both.failures(cells)
  assert line.startswith("demo_reversed A_final over seeds [0, 1, 2, 3, 4]: x 52.00 ± 1.58 is"
                         " not above y 52.00 ± 1.58")
  short = [c for c in cells if not (c["method"] == "y" and c["seed"] == 4)]
  assert claim.failures(short) == ["demo A_final: 4 seeds committed for both x and y, fewer than"
                                   " 5"]


def test_the_committed_data_are_summaries_of_registered_methods_on_the_planned_seeds():
  cells = comparison.load()
  assert cells, f"no committed data in {comparison.DATA_DIR}"
  registered = {s.name for s in methods.specs()}
  seeds = {s.name: set(s.seeds) for s in comparison.STREAMS}
  keys = [(c["stream"], c["method"], c["seed"]) for c in cells]
  assert len(keys) == len(set(keys)), "a run summarised twice"
  for c in cells:
    assert c["method"] in registered, c
    assert c["seed"] in seeds[c["stream"]], c
    assert c["code"] and c["stream_sha256"], c
    matrix = np.asarray(c["acc_matrix"])
    assert matrix.shape == (5, 5) and math.isclose(matrix[:, -1].mean(), c["A_final"],
                                                   rel_tol=1e-9, abs_tol=1e-12), c
  for stream in comparison.STREAM_NAMES:  # the files are what `write` makes of them
    path = comparison.data_path(stream)
    if path.is_file():
      lines = path.read_text().splitlines()
      assert lines == sorted(lines, key=lambda x: comparison._key(json.loads(x))), path
      assert all(line == json.dumps(json.loads(line), sort_keys=True) for line in lines), path


def test_collect_summarises_a_sweep_roots_runs_and_keeps_the_others(tmp_path, tiny_reference):
  sweep_root = tmp_path / "sweep"
  workdir = sweep_root / "demo_reversed" / "online_lora" / "seed0"
  shutil.copytree(tiny_reference, workdir)
  data = tmp_path / "data"
  kept = {"stream": "demo_reversed", "method": "er", "seed": 3, "A_final": 0.5}
  comparison.write([kept], data)
  comparison.collect([sweep_root], "abc123", data)
  cells = {(c["method"], c["seed"]): c for c in comparison.load(data)}
  assert cells[("er", 3)] == kept
  run = cells[("online_lora", 0)]
  results = json.loads((workdir / "results.json").read_text())
  assert run["stream"] == "demo_reversed" and run["code"] == "abc123"
  for key in comparison.KEPT:
    assert run[key] == results.get(key), key
  assert run["passes_per_step"] == results["compute"]["passes_per_step"]
  assert run["check"] == results["check"]["status"]
  # stat aggregates as the report's table rows do
  (row,) = reporting.table_rows(reporting.results_rows([sweep_root], unfinished=False),
                                ("A_final",))
  ours = comparison.stat(comparison.load(data), "demo_reversed", "online_lora", "A_final")
  assert (ours["mean"], ours["n"], ours["seeds"]) == (row["A_final"]["mean"], 1, [0])
  elsewhere = tmp_path / "other" / "online_lora" / "seed0"
  shutil.copytree(tiny_reference, elsewhere)
  with pytest.raises(ValueError, match="setting directory 'other' is none of the comparison's"):
    comparison.collect([tmp_path / "other"], "abc123", data)


def test_every_rendered_table_of_the_docs_is_the_rendering_of_the_committed_data():
  pages = comparison.rendered_pages()
  assert pages, "no page holds a table rendered from the data"
  cells = comparison.load()
  for page in pages:
    text = page.read_text()
    for name, block in comparison.rendered_blocks(text):
      assert block == comparison.render_table(name, cells), (
          f"{page.relative_to(ROOT)}: its {name!r} table is not the rendering of"
          f" {comparison.DATA_DIR}: run scripts/demo_comparison.py render")


def test_a_table_shows_a_method_once_each_stream_has_its_seeds():
  cells = []
  for stream in comparison.STREAM_NAMES:
    for seed in range(5):
      cells.append({"stream": stream, "method": "er", "seed": seed, "label": "ER",
                    "A_final": 0.5 + 0.01 * seed, "forgetting": 0.2, "A_auc": 0.6})
  table = comparison.render_table("streams", cells).splitlines()
  assert table[2] == ("| ER | 0-4 / 0-4 / 0-4 | 52.00 ± 1.58 | 20.00 ± 0.00 | 52.00 ± 1.58 |"
                      " 20.00 ± 0.00 | 60.00 ± 0.00 | 52.00 ± 1.58 |")
  assert len(comparison.render_table("streams", cells[1:]).splitlines()) == 2
  page = (f"x\n{comparison.BLOCK_START.format(name='streams')}\nold\n"
          f"{comparison.BLOCK_END.format(name='streams')}\ny\n")
  new = comparison.render_blocks(page, cells)
  assert comparison.rendered_blocks(new) == [("streams", "\n".join(table))]
  assert new.startswith("x\n") and new.endswith("-->\ny\n")
