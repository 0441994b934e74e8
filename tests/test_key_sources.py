"""Every default of every method traced to its source (`olora_jax.config_keys.Source`): the
authors' released code (their value, file and setting, the batch their rates were set at), the
Online-LoRA paper's appendix, or this project's choice with its reason. A default that differs
from its declared source without a stated reason fails here, and so does a rate set at another
batch that is neither scaled by the one linear rule (`lr_reference_batch`,
`methods.common.batch_scale`) nor kept with a reason. Each method's page opens with its check
against its authors' code and renders the sources (the `method-card` and `key-sources`
directives of docs/_ext/olora_docs.py)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import optax
import pytest

from olora_jax import config_keys, methods
from olora_jax.config_keys import Key, authors, block, ours, paper
from olora_jax.methods import base, cards, common, ease, slca

ROOT = Path(__file__).resolve().parents[1]
WITH_BLOCK = [s.name for s in methods.specs() if s.config is not None]


@pytest.mark.parametrize("name", WITH_BLOCK)
def test_every_default_of_every_method_is_traced_to_its_source(name):
  assert config_keys.unsourced(methods.resolve(name).config()) == []


def test_a_default_that_leaves_its_source_without_a_reason_is_refused():
  config = block("", lr=Key(3e-4, "a rate", authors(1e-3, "org/repo, main.py: --lr", batch=10,
                                                        unscaled="kept: a test")),
                 wd=Key(0.0, "decay", authors(5e-4, "org/repo, main.py: --wd")),
                 ok=Key(0.0, "decay", authors(5e-4, "org/repo, main.py: --wd", differs="why")),
                 flag=Key(True, "a switch", paper(1)),
                 mine=Key(7, "ours", ours("because")), bare=Key(2, "no source"))
  lines = config_keys.unsourced(config)
  assert [line.split(":")[0].split(" ")[0] for line in lines] == ["lr", "wd", "flag", "bare"]
  assert "differs from the authors' value 0.001" in lines[0]
  assert "give its Key a third argument" in lines[3]


def test_a_rate_set_at_another_batch_must_be_scaled_or_kept_with_a_reason():
  rate = authors(0.01, "org/repo, main.py: lrate", batch=128)
  scaled = block("", learning_rate=Key(0.01, "rate", rate),
                 lr_reference_batch=Key(128, "batch", authors(128, "org/repo: batch_size")))
  assert config_keys.unsourced(scaled) == []
  unscaled = block("", learning_rate=Key(0.01, "rate", rate))
  assert config_keys.unsourced(unscaled) == [
      "learning_rate: a rate set at batch 128 (org/repo, main.py: lrate) is neither scaled (the"
      " block's lr_reference_batch is None) nor kept with a reason (unscaled=...)"]
  assert config_keys.unsourced(block("", lr=Key(1e-4, "rate", paper(1e-4, rate=True)))) == []


@pytest.mark.parametrize("module,batch", [(slca, 128), (ease, 48)])
def test_slca_and_ease_scale_their_authors_rate_to_the_learners_batch(module, batch):
  """The authors' rate at their batch, times B / their batch: at the demo's B = 16 SLCA's head
  runs at 0.01 x 16 / 128 = 1.25e-3 and EASE at 0.025 x 16 / 48 (one SGD step from zero
  momentum moves a weight by rate x gradient)."""
  config = module.config()
  assert config.lr_reference_batch == batch
  assert common.batch_scale(config, 16) == 16 / batch
  config.weight_decay = 0.0
  tx = (slca.slow_learner(config, 16) if module is slca
        else common.make_sgd(config.learning_rate * common.batch_scale(config, 16), 0.0))
  params = {"head": jnp.ones((2,))}
  updates, _ = tx.update({"head": jnp.ones((2,))}, tx.init(params), params)
  expected = config.learning_rate * 16 / batch
  assert jnp.allclose(optax.apply_updates(params, updates)["head"], 1.0 - expected, rtol=1e-6)
  config.lr_reference_batch = 0  # the rate as given
  assert common.batch_scale(config, 16) == 1.0


def card_of(text: str, name: str) -> tuple[str, dict[str, str]]:
  """The `method-card` directive a page opens with: (its sentence, its options)."""
  body = [line for line in text.splitlines()[1:] if line.strip()]
  assert body[0] == "```{method-card} " + name, body[0]
  block = body[1:body.index("```")]
  options = dict(line[1:].split(": ", 1) for line in block if line.startswith(":"))
  return " ".join(line for line in block if not line.startswith(":")), options


@pytest.mark.parametrize("name", [s.name for s in methods.specs()])
def test_every_method_page_opens_with_its_card_and_renders_its_sources(name):
  """The first thing under a page's title is the method's card (the `method-card` directive):
  one sentence of what it does, its check, its demo row (found in the demo table), the readings
  that move its numbers and what is not validated, at most 8 lines as it renders; a page of a
  method with a block renders its `key-sources` table."""
  text = (ROOT / "docs" / "methods" / f"{name}.md").read_text()
  sentence, options = card_of(text, name)
  assert set(options) <= {"row", "readings", "unvalidated"}, options
  spec = methods.resolve(name)
  rows = cards.demo_rows((ROOT / cards.DEMO_TABLE).read_text())
  row = rows[options.get("row", spec.report_name)]  # its row is in the published table
  card = cards.card(spec, sentence, row, options.get("readings", ""),
                    options.get("unvalidated", ""))
  assert [label for label, _ in card] == ["What it does", "Check", "Demo row",
                                         "Readings that move its numbers", "Not validated"]
  assert len(card) + 2 <= 8  # its header and rule, then a line each
  assert dict(card)["Check"] == spec.check.sentence().removeprefix("Check: ")
  seeds = row["seeds"].split("/")[0].strip()
  assert dict(card)["Demo row"].startswith(
      f"disjoint demo (seeds {seeds}): A_final {row['A_final']}")
  assert spec.check.kind in base.CHECK_KINDS
  if spec.check.kind != "none":
    assert (ROOT / spec.check.test).exists() and spec.check.against
  if spec.config is not None:
    assert "```{key-sources} " + name in text


def test_the_check_sentence_names_the_code_and_the_test():
  assert base.Check("none").sentence().startswith("Check: not checked against its authors' code")
  line = base.Check("step", "org/repo", "tests/test_x.py").sentence()
  assert line == ("Check: matches its authors' code step for step on a shared stream (org/repo;"
                  " tests/test_x.py).")


def test_a_card_says_what_its_pieces_say():
  """The card's generated lines: a demo row with the seeds of each stream, the defaults' origins
  counted and those that differ named, a check's limits; a sentence that is not one is refused."""
  row = {"seeds": "0-9 / 0-4", "A_final": "57.18 ± 4.51", "forgetting": "9.49 ± 6.37",
         "passes": "71.4", "blurry_A_auc": "46.90 ± 4.52", "blurry_A_final": "55.37 ± 7.23"}
  assert cards.demo_line(row) == (
      "disjoint demo (seeds 0-9): A_final 57.18 ± 4.51, Forgetting 9.49 ± 6.37, 71.4 passes/step;"
      " Si-Blurry demo (seeds 0-4): A_auc 46.90 ± 4.52, A_final 55.37 ± 7.23")
  spec = methods.resolve("er_ace")
  lines = dict(cards.card(spec, "ER with a different loss.", row, "a cosine head"))
  assert lines["Readings that move its numbers"].startswith(
      "a cosine head; its defaults from its authors' code (")
  assert "`optimizer`" in lines["Readings that move its numbers"]
  assert lines["Not validated"] == "nothing stated beyond its check."
  none = dict(cards.card(methods.resolve("agem"), "Projects gradients.", None))
  assert none["Demo row"] == "not in the demo table"
  assert none["Not validated"].startswith("its implementation against its authors' code")
  for bad, why in (("", "is missing"), ("No full stop", "must end with a full stop"),
                   ("One. Two.", "must be one sentence"), ("w " * 50 + ".", "has 51 words")):
    with pytest.raises(ValueError, match=why):
      cards.card(spec, bad, row)
