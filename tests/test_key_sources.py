"""Every default of every method traced to its source (`olora_jax.config_keys.Source`): the
authors' released code (their value, file and setting, the batch their rates were set at), the
Online-LoRA paper's appendix, or this project's choice with its reason. A default that differs
from its declared source without a stated reason fails here, and so does a reason that does not
open with the value it justifies (a changed default behind a stale reason), and a rate set at
another batch that is neither scaled by the one linear rule (`lr_reference_batch`,
`methods.common.batch_scale`) nor kept with a reason. The numbers the method modules hold as
module constants (scales, eps, probabilities) are declared and checked the same way (each
module's `CONSTANTS`). Each method's page opens with its check against its authors' code and
renders the sources (the `method-card` and `key-sources` directives of docs/_ext/olora_docs.py)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from olora_jax import config_keys, methods
from olora_jax.config_keys import Key, authors, block, ours, paper
from olora_jax.methods import base, cards, common, ease, er_ace, slca

ROOT = Path(__file__).resolve().parents[1]
WITH_BLOCK = [s.name for s in methods.specs() if s.config is not None]
MODULES = sorted(f"olora_jax.methods.{info.name}"
                 for info in pkgutil.iter_modules(methods.__path__))


def other_value(value):
  """A value unlike `value` of its kind (a number doubled and moved on, a string renamed, a
  tuple with its first item changed)."""
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value * 2 + 1
  if isinstance(value, str):
    return value + "_other"
  if isinstance(value, (tuple, list)):
    return type(value)([other_value(value[0]), *value[1:]])
  if isinstance(value, np.ndarray):
    return value * 2 + 1
  raise TypeError(value)


@pytest.mark.parametrize("name", WITH_BLOCK)
def test_every_default_of_every_method_is_traced_to_its_source(name):
  assert config_keys.unsourced(methods.resolve(name).config()) == []


def test_a_default_that_leaves_its_source_without_a_reason_is_refused():
  config = block("", lr=Key(3e-4, "a rate", authors(1e-3, "org/repo, main.py: --lr", batch=10,
                                                        unscaled="kept: a test")),
                 wd=Key(0.0, "decay", authors(5e-4, "org/repo, main.py: --wd")),
                 ok=Key(0.0, "decay", authors(5e-4, "org/repo, main.py: --wd",
                                                  differs="0.0, why")),
                 flag=Key(True, "a switch", paper(1)),
                 mine=Key(7, "ours", ours("because")), bare=Key(2, "no source"))
  lines = config_keys.unsourced(config)
  assert [line.split(":")[0].split(" ")[0] for line in lines] == ["lr", "wd", "flag", "bare"]
  assert "differs from the authors' value 0.001" in lines[0]
  assert "give its Key a third argument" in lines[3]


def test_a_reason_must_open_with_the_value_it_justifies():
  """A `differs` reason opens with our default as the pages show it (`shown`); one that names
  another value (the old default), or ours only later among others, is refused. An `unscaled`
  reason on a rate equal to its source's value needs no number (the equality is compared); on
  one that is not, it opens with the default too. An `ours` reason that quotes a number opens
  with the default."""
  src = "org/repo, main.py: --x"
  config = block("", stale=Key(3e-4, "m", authors(0.1, src, differs="1e-4, the old rate")),
                 buried=Key(500, "m", authors(20, src, differs="buffer 500 as ER's")),
                 prefix=Key(10, "m", authors(0, src, differs="100, a longer number")),
                 fine=Key(1e-4, "m", authors(0.1, src, differs="1e-4, ER's rate")),
                 text=Key("adam", "m", authors("sgd", src, differs="'adam', ER's")),
                 bare=Key("none", "m", authors("task", src, differs="none: every class")),
                 kept=Key(1e-3, "m", authors(1e-3, src, batch=8, unscaled="an Adam rate")),
                 moved=Key(2e-3, "m", authors(1e-3, src, batch=8, differs="0.002, ours",
                                              unscaled="an Adam rate kept")),
                 mine=Key(50, "m", ours("EWC++'s 50-step period")),
                 mine_ok=Key(50, "m", ours("50, EWC++'s period")),
                 plain=Key(16, "m", ours("small beside the adapter")))
  lines = config_keys.unsourced(config)
  assert [line.split(":")[0] for line in lines] == ["stale", "buried", "prefix", "moved", "mine"]
  assert lines[0] == ("stale: its differs= reason '1e-4, the old rate' does not name the default"
                      " it justifies, 3e-4 (the authors' value is 0.1); begin it with"
                      ' "3e-4, ..."')
  assert "unscaled= reason 'an Adam rate kept'" in lines[3]
  assert "quotes a number but does not open with the default it justifies, 50" in lines[4]


def test_shown_writes_values_as_the_pages_show_them():
  assert [config_keys.shown(v) for v in (1e-4, 3e-4, 0.001, 1e-5, 0.1, -1e9, 10, "adam",
                                         (0.2, 1.0), True)] == [
      "1e-4", "3e-4", "0.001", "1e-5", "0.1", "-1e9", "10", "'adam'", "(0.2, 1.0)", "True"]
  for value, text, named in ((10, "10, why", True), (10, "100, why", False),
                             (0.1, "0.15, why", False), (5, "5,000 samples", False),
                             (1e-4, "1e-45", False), ("adam", "adam: why", True)):
    assert config_keys.names_value(value, text) is named, (value, text)


def _reasoned(name):
  """The keys of method `name` whose source gives a reason."""
  found = config_keys.sources(methods.resolve(name).config())
  return [key for key, source in found.items()
          if source.differs or source.unscaled
          or (source.kind == "ours" and config_keys.quotes_number(source.where))]


@pytest.mark.parametrize("name", WITH_BLOCK)
def test_a_changed_default_behind_its_old_reason_fails(name):
  """Every key whose source gives a reason (differs=, unscaled=, or an ours reason that quotes a
  number): its default moved, its reason left as it is, is refused: no reason can stand for a
  value it does not name."""
  keys = _reasoned(name)
  for key in keys:
    config = methods.resolve(name).config()
    parent, leaf = config, key
    if "." in key:
      head, leaf = key.rsplit(".", 1)
      for part in head.split("."):
        parent = parent[part]
    parent[leaf] = other_value(parent[leaf])
    assert any(line.startswith(f"{key}:") for line in config_keys.unsourced(config)), key


@pytest.mark.parametrize("module", MODULES)
def test_every_numeric_constant_of_a_method_module_is_declared_with_its_source(module):
  assert config_keys.unsourced_constants(importlib.import_module(module)) == []


@pytest.mark.parametrize("module", MODULES)
def test_a_constant_moved_off_its_declared_value_fails(module, monkeypatch):
  """Each declared constant, changed in its module with its declaration left as it is, is
  refused: an authors' or the paper's number no longer equal to theirs has no reason, and an
  ours reason opens with the value it justifies."""
  module = importlib.import_module(module)
  for name in getattr(module, "CONSTANTS", {}):
    with monkeypatch.context() as patch:
      patch.setattr(module, name, other_value(getattr(module, name)))
      assert any(f"{module.__name__}.{name}" in line
                 for line in config_keys.unsourced_constants(module)), name


def test_er_ace_cosine_scale_is_the_authors_10(monkeypatch):
  """The mutation the parity check caught (10 -> 16) fails here too, before any run, with the
  authors' value and where it was read."""
  assert er_ace.COSINE_SCALE == 10.0
  monkeypatch.setattr(er_ace, "COSINE_SCALE", 16.0)
  assert config_keys.unsourced_constants(er_ace) == [
      "olora_jax.methods.er_ace.COSINE_SCALE: default 16.0 differs from the authors' value 10.0"
      " (pclucas14/AML, model.py: distLinear's scale_factor) without a stated reason"
      " (differs=...)"]


def test_an_undeclared_or_missing_constant_is_named(monkeypatch):
  monkeypatch.setattr(er_ace, "NEW_MARGIN", 0.5, raising=False)
  monkeypatch.setitem(er_ace.CONSTANTS, "GONE", config_keys.Constant("m", ours("why")))
  lines = config_keys.unsourced_constants(er_ace)
  assert lines[0].startswith("olora_jax.methods.er_ace.NEW_MARGIN = 0.5: a module constant"
                             " without a declared source; add \"NEW_MARGIN\": Constant(")
  assert lines[1] == ("olora_jax.methods.er_ace.CONSTANTS declares GONE, which is not a numeric"
                      " constant of it")
  assert config_keys.constant_rows(er_ace)[0] == [
      "COSINE_SCALE", "10.0", "the cosine head's logits are the cosines times it",
      "the authors': 10.0 (pclucas14/AML, model.py: distLinear's scale_factor)"]


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
  assert dict(card)["Check"] == spec.check_sentence().removeprefix("Check: ")
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
  none = dict(cards.card(methods.resolve("gdumb"), "Trains afresh on its buffer.", None))
  assert none["Demo row"] == "not in the demo table"
  assert none["Not validated"].startswith("its implementation against its authors' code")
  for bad, why in (("", "is missing"), ("No full stop", "must end with a full stop"),
                   ("One. Two.", "must be one sentence"), ("w " * 50 + ".", "has 51 words")):
    with pytest.raises(ValueError, match=why):
      cards.card(spec, bad, row)
