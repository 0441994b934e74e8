"""Config keys declared with their meanings: each key of a config block is one line,
`name=Key(default, "what it does")`, and the config reference (docs/reference/config.md) is
generated from those lines, so a key's meaning sits beside its default and cannot go missing:
the docs build and tests/test_config_keys.py refuse a key without one.

    Key(default, meaning, source)
                               one key: its default value, one line saying what it does (units,
                               allowed values, what 0 or '' means) and, optionally, where the
                               default comes from (a `Source`)
    authors(value, where, batch=0, differs='')
    paper(value, where, differs='')
    ours(reason)               the three kinds of `Source`: the method's authors' released code
                               (their value, the file and setting, the batch a rate was set at),
                               the Online-LoRA paper's appendix tables (batch 64, Adam), or this
                               project's own choice (and why)
    block(about, **keys)       a plain `ml_collections.ConfigDict` of the keys' defaults (a value
                               that is a ConfigDict is a sub-block), remembering each key's meaning
                               and the block's `about` line for the reference
    about(config)              a block's `about` line ('' if none)
    meanings(config)           {dotted key: meaning} of every key that has one, in declared order
    unexplained(config)        the dotted keys without a meaning (an empty or name-only one counts)
    sources(config)            {dotted key: Source} of every key declared with one
    describe(source)           a Source as one line for the method pages
    source_rows(config)        (key, default, meaning, source) rows of a method's Keys table
    unsourced(config)          the dotted keys without a source, and those whose default differs
                               from their source's value without a stated reason

A key given as a bare value (`block("...", rank=4)`) has no meaning: the config works, the docs
build fails naming it. The meanings ride on the ConfigDict objects `block` makes, not in their
fields, so nothing reads them but the functions above: config.json, comparisons of configs and
command-line overrides see the same ConfigDict as before (a copy of a config drops them).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import ml_collections

# Where `block` keeps (about, {key: meaning}, declared key order, {key: Source}) on the ConfigDict
# it makes.
_ATTRIBUTE = "_olora_meanings"

SOURCE_KINDS = ("authors", "paper", "ours")
# The Online-LoRA paper's appendix: "Training Settings" (batch 64, Adam, buffer 500) and
# "Hyperparameters for the baseline methods on ViT-B/16", whose learning rates the paper's authors
# adjusted by a grid search on their own streams.
PAPER_TABLE = "Online-LoRA paper, appendix, baseline hyperparameters (ViT-B/16, batch 64, Adam)"
PAPER_SETTINGS = ("Online-LoRA paper, appendix, training settings shared by the baselines"
                  " (ViT-B/16, batch 64, Adam)")
PAPER_BATCH = 64


class Source(NamedTuple):
  """Where a key's default comes from.

    kind      'authors' (the method's authors: their released code, or their own paper where
              its value is the one taken and the code differs, as `where` says), 'paper' (the
              Online-LoRA paper's appendix tables) or 'ours' (this project's choice)
    where     authors: "repository, file: setting"; paper: the table; ours: the reason
    value     the value found there (None for 'ours')
    batch     for a learning rate: the batch size it was set at (0: not a rate, or not stated)
    differs   why our default is not `value`, when it is not ('' when it is)
    unscaled  for a rate set at a batch the block does not scale it from (its
              `lr_reference_batch`): why it is used as it is
  """

  kind: str
  where: str
  value: Any = None
  batch: int = 0
  differs: str = ""
  unscaled: str = ""


# The one rule for a rate set at another batch: an SGD rate is scaled linearly to the run's batch
# (the linear scaling rule of Goyal et al., 2017: the block's `lr_reference_batch`); an Adam rate,
# whose per-coordinate step does not grow with the batch as SGD's does, is kept as its authors set
# it, unless their own code scales it (DualPrompt's and HiDe-Prompt's lr x batch / 256).
ADAM_UNSCALED = ("an Adam rate, kept as the authors set it (the linear scaling rule is SGD's; their"
                 " code scales it by no batch rule)")
# Why the Online-LoRA paper's rates are used as given at any batch: the paper set them by a grid
# search for its own comparison, not carried from a codebase run at another batch.
PAPER_UNSCALED = ("tuned by the Online-LoRA paper's grid search for its batch 64 and used as"
                  " given (launch/sweep.py --tune re-tunes it for another setting)")


def authors(value, where: str, batch: int = 0, differs: str = "", unscaled: str = "") -> Source:
  """The authors' released code sets this key to `value` at `where` ("repository, file:
  setting"); a learning rate was set there for a batch of `batch`."""
  return Source("authors", where, value, batch, differs, unscaled)


def paper(value, where: str = PAPER_TABLE, differs: str = "", rate: bool = False) -> Source:
  """The Online-LoRA paper's appendix sets this key to `value`; a `rate` was set there for its
  batch of 64 and is used as given (`PAPER_UNSCALED`)."""
  return Source("paper", where, value, PAPER_BATCH if rate else 0, differs,
                PAPER_UNSCALED if rate else "")


def ours(reason: str) -> Source:
  """Neither the authors nor the paper set this key: this project's choice, for `reason`."""
  return Source("ours", reason)


class Key(NamedTuple):
  """One config key as a block declares it: its default value, its meaning and, for a method's
  key, the source of its default (`Source`)."""

  default: Any
  meaning: str
  source: Source | None = None


def block(about: str = "", /, **keys) -> ml_collections.ConfigDict:
  """A ConfigDict of `keys`' defaults: each `Key(default, meaning)` gives its default (a bare value
  is taken as it is, without a meaning; a ConfigDict is a sub-block). The meanings and `about`
  (one line: what the block configures) are kept for `meanings` and the reference page."""
  values, explained, sourced = {}, {}, {}
  for name, value in keys.items():
    if isinstance(value, Key):
      values[name], explained[name] = value.default, value.meaning
      if value.source is not None:
        sourced[name] = value.source
    else:
      values[name] = value
  config = ml_collections.ConfigDict(values)
  object.__setattr__(config, _ATTRIBUTE, (about, explained, tuple(keys), sourced))
  return config


def _declared(config) -> tuple[str, dict[str, str], tuple[str, ...], dict[str, Source]]:
  return config.__dict__.get(_ATTRIBUTE, ("", {}, (), {}))


def about(config: ml_collections.ConfigDict) -> str:
  """The `about` line a block was declared with ('' for a block without one)."""
  return _declared(config)[0]


def _is_block(value) -> bool:
  return isinstance(value, ml_collections.ConfigDict)


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, Any]]:
  """(dotted key, default) of every leaf, each block's declared keys first in declared order,
  then any others in the ConfigDict's order (sub-blocks where they stand)."""
  declared = _declared(config)[2]
  order = [k for k in declared if k in config] + [k for k in config.keys() if k not in declared]
  out = []
  for key in order:
    value = config[key]
    if _is_block(value):
      out += leaves(value, f"{prefix}{key}.")
    else:
      out.append((f"{prefix}{key}", value))
  return out


def meanings(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, str]:
  """{dotted key: meaning} of every leaf of `config` declared with one, in declared order."""
  explained = _declared(config)[1]
  out = {}
  for key, value in config.items():
    if _is_block(value):
      out.update(meanings(value, f"{prefix}{key}."))
    elif key in explained:
      out[f"{prefix}{key}"] = explained[key]
  order = {name: i for i, (name, _) in enumerate(leaves(config, prefix))}
  return dict(sorted(out.items(), key=lambda item: order[item[0]]))


def _words(text: str) -> str:
  return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def is_meaning(key: str, meaning: str) -> bool:
  """Whether `meaning` says something: not empty, and not the key's own name restated
  (`window_size` -> "window size")."""
  name = key.rsplit(".", 1)[-1]
  return bool(_words(meaning)) and _words(meaning) not in (_words(name), _words(key))


def unexplained(config: ml_collections.ConfigDict) -> list[str]:
  """The dotted keys of `config` that have no meaning (none given, or one that only restates the
  key's name), in declared order."""
  explained = meanings(config)
  return [key for key, _ in leaves(config)
          if key not in explained or not is_meaning(key, explained[key])]


def sources(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Source]:
  """{dotted key: Source} of every leaf of `config` declared with one, in declared order."""
  out = {}
  for key, _ in leaves(config, prefix):
    parent = config
    for part in key[len(prefix):].split(".")[:-1]:
      parent = parent[part]
    source = _declared(parent)[3].get(key.rsplit(".", 1)[-1])
    if source is not None:
      out[key] = source
  return out


def describe(source: Source) -> str:
  """One line for a reader: "the authors': 0.01 at batch 128 (repo, file: setting); ...", "the
  Online-LoRA paper's: ...", or "ours: why"."""
  if source.kind == "ours":
    return f"ours: {source.where}"
  owner = {"authors": "the authors'", "paper": "the Online-LoRA paper's"}.get(source.kind,
                                                                             source.kind)
  at = f" at batch {source.batch}" if source.batch else ""
  notes = "".join(f"; {text}" for text in (source.differs, source.unscaled) if text)
  return f"{owner}: {source.value!r}{at} ({source.where}){notes}"


def source_rows(config: ml_collections.ConfigDict) -> list[list[str]]:
  """One row per key of a method's block, as its page shows it (the `key-sources` directive):
  the key, repr(default), its meaning and `describe(source)` ('none declared' without one)."""
  found, given = sources(config), meanings(config)
  return [[key, repr(default), given.get(key, ""),
           describe(found[key]) if key in found else "none declared"]
          for key, default in leaves(config)]


def same_value(a, b) -> bool:
  """Whether a default and a source's value agree (tuples and lists alike; numbers by value)."""
  if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
  if isinstance(a, bool) or isinstance(b, bool):  # True is not the number 1 here
    return a is b
  return a == b


def unsourced(config: ml_collections.ConfigDict) -> list[str]:
  """One line per key of `config` (a method's block) whose default has no declared source, or
  whose source is not well formed (an unknown kind, no `where`), or whose default differs from
  the authors' or the paper's value without a stated reason, or which is a learning rate set at
  another batch that is neither scaled by the block's `lr_reference_batch` (the same batch) nor
  kept with a reason; [] when every default is traced."""
  found, lines = sources(config), []
  for key, default in leaves(config):
    source = found.get(key)
    if source is None:
      lines.append(f"{key} (default {default!r}): no source declared; give its Key a third"
                   " argument, authors(...), paper(...) or ours('why')")
    elif source.kind not in SOURCE_KINDS or not source.where.strip():
      lines.append(f"{key}: source {source!r} needs a kind of {SOURCE_KINDS} and a 'where'")
    elif (source.kind != "ours" and not same_value(default, source.value)
          and not source.differs.strip()):
      lines.append(f"{key}: default {default!r} differs from the {source.kind}' value"
                   f" {source.value!r} ({source.where}) without a stated reason (differs=...)")
    elif (source.batch and not source.unscaled.strip()
          and config.get("lr_reference_batch") != source.batch):
      lines.append(f"{key}: a rate set at batch {source.batch} ({source.where}) is neither"
                   " scaled (the block's lr_reference_batch is"
                   f" {config.get('lr_reference_batch')!r}) nor kept with a reason (unscaled=...)")
  return lines
