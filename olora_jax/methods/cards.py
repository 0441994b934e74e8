"""A method's card: the few lines its documentation page opens with, so a reader sees in a minute
what the method does, which check backs its numbers, its row on the demo, the readings that move
its numbers and what is not validated; the page's long reasoning follows below it.

What the registry knows is generated from it: the check (`MethodSpec.check`), the defaults that
differ from their declared sources (`config_keys`), and the demo row, read from the one table
that publishes every method's demo numbers (`demo_rows` of docs/tutorials/first-comparison.md),
so a card quotes the seeds that table quotes. What the code cannot know, the page gives: the
one sentence of what the method does, and the readings and limits its reasoning establishes
(the `method-card` directive of the documentation, docs/_ext/olora_docs.py).
"""

from __future__ import annotations

import re

from olora_jax import config_keys
from olora_jax.methods import base

# The table of every method's demo numbers, and the header it is found by.
DEMO_TABLE = "docs/tutorials/first-comparison.md"
DEMO_HEADER = "| method | seeds: demo / Si-Blurry |"
# Its columns after the method's name, in order.
DEMO_COLUMNS = ("seeds", "A_final", "forgetting", "passes", "blurry_A_auc", "blurry_A_final")
MAX_WORDS = 45  # the card's sentence of what the method does
CONSTANTS = {"MAX_WORDS": config_keys.Constant(
    "the most words of a card's sentence of what the method does",
    config_keys.ours("45, a sentence that fits a card's first line or two"))}
# What a check of each kind leaves unvalidated ({scope}: the setting a check covers, if not the
# method's defaults).
CHECK_LIMITS = {
    "none": "its implementation against its authors' code: its numbers rest on our reading of"
            " their paper and code",
    "seeds": "step-by-step equality with its authors' code: the check compares means over seeds",
    "step": "",
}


def demo_rows(markdown: str) -> dict[str, dict[str, str]]:
  """{row label: {column: cell}} of the demo table (`DEMO_HEADER`) in `markdown`."""
  lines = markdown.splitlines()
  try:
    start = next(i for i, line in enumerate(lines) if line.startswith(DEMO_HEADER))
  except StopIteration:
    raise ValueError(f"no demo table (a line starting {DEMO_HEADER!r}) in {DEMO_TABLE}") from None
  rows = {}
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    rows[cells[0]] = dict(zip(DEMO_COLUMNS, cells[1:], strict=True))
  return rows


def demo_line(row: dict[str, str]) -> str:
  """A demo row as the card says it, each stream with the seeds its numbers are over."""
  demo_seeds, _, blurry_seeds = (s.strip() for s in row["seeds"].partition("/"))
  line = (f"disjoint demo (seeds {demo_seeds}): A_final {row['A_final']}, Forgetting"
          f" {row['forgetting']}, {row['passes']} passes/step")
  if blurry_seeds in ("", "-") or row["blurry_A_final"] == "not run":
    return line + "; Si-Blurry demo: not run"
  return (line + f"; Si-Blurry demo (seeds {blurry_seeds}): A_auc {row['blurry_A_auc']},"
          f" A_final {row['blurry_A_final']}")


def differing_defaults(spec: base.MethodSpec) -> list[str]:
  """The keys of the method's block whose default is not their declared source's value (each
  with its stated reason on the page's table of sources)."""
  if spec.config is None:
    return []
  config = spec.config()
  found = config_keys.sources(config)
  return [key for key, default in config_keys.leaves(config)
          if key in found and found[key].kind != "ours"
          and not config_keys.same_value(default, found[key].value)]


ORIGINS = (("authors", "its authors' code"), ("paper", "the Online-LoRA paper's appendix"),
           ("ours", "this project"))


def default_origins(spec: base.MethodSpec) -> str:
  """Where the block's defaults come from, counted: "its authors' code (5), the Online-LoRA
  paper's appendix (2), this project (1)"; '' without a block."""
  if spec.config is None:
    return ""
  kinds = [source.kind for source in config_keys.sources(spec.config()).values()]
  return ", ".join(f"{name} ({kinds.count(kind)})" for kind, name in ORIGINS
                   if kinds.count(kind))


def card(spec: base.MethodSpec, sentence: str, demo: dict[str, str] | None, readings: str = "",
         unvalidated: str = "") -> list[tuple[str, str]]:
  """The card's rows, (label, text): what it does (`sentence`), its check, its demo row (`demo`,
  a row of `demo_rows`; None: not in the table), the readings that move its numbers (`readings`,
  then the defaults that differ from their sources) and what is not validated (`unvalidated`,
  after what its check leaves out)."""
  sentence = " ".join(sentence.split())
  problem = sentence_problem(sentence)
  if problem:
    raise ValueError(f"method {spec.name!r}: the card's sentence {problem}")
  check = spec.check_sentence().removeprefix("Check: ")
  differ = differing_defaults(spec)
  moved = [readings.strip().rstrip(".")] if readings.strip() else []
  origin = default_origins(spec)
  if origin:
    moved.append("its defaults from " + origin)
  if differ:
    moved.append("defaults other than their sources' (the table below says why): "
                 + ", ".join(f"`{k}`" for k in differ))
  not_validated = [text for text in (CHECK_LIMITS[spec.check.kind].format(
      scope=spec.check.scope), unvalidated.strip().rstrip(".")) if text]
  return [("What it does", sentence),
          ("Check", check),
          ("Demo row", demo_line(demo) if demo is not None else "not in the demo table"),
          ("Readings that move its numbers", ("; ".join(moved) or "none stated") + "."),
          ("Not validated", ("; ".join(not_validated) or "nothing stated beyond its check") + ".")]


def sentence_problem(sentence: str) -> str:
  """What is wrong with a card's sentence ('' if nothing): it is one sentence of at most
  `MAX_WORDS` words ending with a full stop."""
  if not sentence:
    return "is missing: give one sentence of what the method does as the directive's content"
  if not sentence.endswith("."):
    return "must end with a full stop"
  if len(sentence.split()) > MAX_WORDS:
    return f"has {len(sentence.split())} words; keep it to {MAX_WORDS}"
  if re.search(r"[.!?] [A-Z]", sentence.rstrip(".")):
    return "must be one sentence"
  return ""
