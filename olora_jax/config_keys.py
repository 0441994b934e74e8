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
    Constant(meaning, source)  a module constant that carries a number (a scale, an eps, a
                               probability), declared in its module's `CONSTANTS` {name: Constant}
    block(about, **keys)       a plain `ml_collections.ConfigDict` of the keys' defaults (a value
                               that is a ConfigDict is a sub-block), remembering each key's meaning
                               and the block's `about` line for the reference
    about(config)              a block's `about` line ('' if none)
    meanings(config)           {dotted key: meaning} of every key that has one, in declared order
    unexplained(config)        the dotted keys without a meaning (an empty or name-only one counts)
    sources(config)            {dotted key: Source} of every key declared with one
    shown(value)               a value as the method pages show it (repr; a float under 1e-3 or
                               from 1e6 in short scientific form, 1e-4), the form a reason names
                               it in
    describe(source)           a Source as one line for the method pages
    source_rows(config)        (key, default, meaning, source) rows of a method's Keys table
    unsourced(config)          the dotted keys without a source, those whose default differs
                               from their source's value without a stated reason, and those
                               whose reason does not name the default it justifies
    numeric_constants(module)  {name: value} of a module's numbers at module level
    constant_rows(module)      (name, value, meaning, source) rows of its declared constants
    unsourced_constants(module)
                               `unsourced`'s lines for a module's numeric constants: undeclared,
                               or off their source's value without a reason naming the value

A reason names the value it justifies by opening with it, as `shown` writes it: `differs` (and an
`unscaled` on a rate that is not its source's value) opens with our default ("1e-4, ER's rate..."),
and so does an `ours` reason that quotes any number; a reason that still names an old value, or
names ours only somewhere among others, is refused. An `unscaled` reason on a rate equal to its
source's value needs no number: that the rate is kept as set is the equality the check compares.

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


def shown(value) -> str:
  """`value` as the method pages show it and as a reason must name it: its repr, except a float
  of magnitude under 1e-3 (not 0) or from 1e6 up, which is written in short scientific form (1e-4,
  2.5e-5, -1e9) when that reads back as the same float; a tuple or list shows each item so."""
  if isinstance(value, (tuple, list)):
    inner = ", ".join(shown(v) for v in value)
    if isinstance(value, list):
      return f"[{inner}]"
    return f"({inner}{',' if len(value) == 1 else ''})"
  if isinstance(value, float) and value and not 1e-3 <= abs(value) < 1e6:
    mantissa, exponent = f"{value:.15e}".split("e")
    short = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    if float(short) == value:
      return short
  return repr(value)


# What may follow the value a reason opens with: not a character that would make it another value
# (10 -> 100 or 10.5, 0.1 -> 0.15, 1e-4 -> 1e-45, 5 -> 5,000).
_VALUE_END = re.compile(r"(?!\w|[.,]\w)")


def names_value(value, reason: str) -> bool:
  """Whether `reason` opens with `value` as `shown` writes it (a string may also be named bare,
  'adam' as adam), followed by no character that makes it another value."""
  text = reason.strip()
  spellings = [shown(value)] + ([value] if isinstance(value, str) and value else [])
  return any(text.startswith(s) and _VALUE_END.match(text, len(s)) for s in spellings)


def quotes_number(text: str) -> bool:
  """Whether `text` quotes a number (a digit)."""
  return any(ch.isdigit() for ch in text)


def describe(source: Source) -> str:
  """One line for a reader: "the authors': 0.01 at batch 128 (repo, file: setting); ...", "the
  Online-LoRA paper's: ...", or "ours: why"."""
  if source.kind == "ours":
    return f"ours: {source.where}"
  owner = {"authors": "the authors'", "paper": "the Online-LoRA paper's"}.get(source.kind,
                                                                             source.kind)
  at = f" at batch {source.batch}" if source.batch else ""
  notes = "".join(f"; {text}" for text in (source.differs, source.unscaled) if text)
  return f"{owner}: {shown(source.value)}{at} ({source.where}){notes}"


def source_rows(config: ml_collections.ConfigDict) -> list[list[str]]:
  """One row per key of a method's block, as its page shows it (the `key-sources` directive):
  the key, `shown(default)`, its meaning and `describe(source)` ('none declared' without one)."""
  found, given = sources(config), meanings(config)
  return [[key, shown(default), given.get(key, ""),
           describe(found[key]) if key in found else "none declared"]
          for key, default in leaves(config)]


def same_value(a, b) -> bool:
  """Whether a default and a source's value agree (tuples and lists alike; numbers by value)."""
  if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
  if isinstance(a, bool) or isinstance(b, bool):  # True is not the number 1 here
    return a is b
  return a == b


def source_problem(key: str, default, source: Source | None, reference_batch=None) -> str:
  """Why `source` does not trace `default` (key or constant `key`), or '' when it does: no source,
  a malformed one (an unknown kind, no `where`), a default off the authors' or the paper's value
  without a reason, a reason that does not open with the default it justifies, an `ours` reason
  that quotes a number but not the default first, or a rate set at another batch than
  `reference_batch` (the block's `lr_reference_batch`) that is neither scaled nor kept with a
  reason."""
  if source is None:
    return (f"{key} (default {shown(default)}): no source declared; give its Key a third"
            " argument, authors(...), paper(...) or ours('why')")
  if source.kind not in SOURCE_KINDS or not source.where.strip():
    return f"{key}: source {source!r} needs a kind of {SOURCE_KINDS} and a 'where'"
  if source.kind == "ours":
    if quotes_number(source.where) and not names_value(default, source.where):
      return (f"{key}: our reason {source.where!r} quotes a number but does not open with the"
              f" default it justifies, {shown(default)}; begin it with \"{shown(default)}, ...\"")
    return ""
  kept = same_value(default, source.value)
  if not kept and not source.differs.strip():
    return (f"{key}: default {shown(default)} differs from the {source.kind}' value"
            f" {shown(source.value)} ({source.where}) without a stated reason (differs=...)")
  for field in ("differs", "unscaled"):
    reason = getattr(source, field)
    if reason.strip() and not (field == "unscaled" and kept) and not names_value(default, reason):
      return (f"{key}: its {field}= reason {reason!r} does not name the default it justifies,"
              f" {shown(default)} (the {source.kind}' value is {shown(source.value)}); begin it"
              f" with \"{shown(default)}, ...\"")
  if source.batch and not source.unscaled.strip() and reference_batch != source.batch:
    return (f"{key}: a rate set at batch {source.batch} ({source.where}) is neither scaled (the"
            f" block's lr_reference_batch is {reference_batch!r}) nor kept with a reason"
            " (unscaled=...)")
  return ""


def unsourced(config: ml_collections.ConfigDict) -> list[str]:
  """One line per key of `config` (a method's block) that `source_problem` finds untraced: no
  declared source, a malformed one, a default off the authors' or the paper's value without a
  reason, a reason that does not open with the default it justifies, or a learning rate set at
  another batch that is neither scaled by the block's `lr_reference_batch` (the same batch) nor
  kept with a reason; [] when every default is traced."""
  found = sources(config)
  lines = [source_problem(key, default, found.get(key), config.get("lr_reference_batch"))
           for key, default in leaves(config)]
  return [line for line in lines if line]


class Constant(NamedTuple):
  """A module constant that carries a number, as its module's `CONSTANTS` {name: Constant}
  declares it: one line of what it does, and where its value comes from (a `Source`; the value
  itself is the module's, compared with the source's)."""

  meaning: str
  source: Source


def _is_number(value) -> bool:
  if isinstance(value, bool):
    return False
  if isinstance(value, (int, float)):
    return True
  if isinstance(value, (tuple, list)):
    return bool(value) and all(_is_number(v) for v in value)
  return type(value).__name__ == "ndarray" and value.dtype.kind in "iuf"


def numeric_constants(module) -> dict[str, Any]:
  """{name: value} of `module`'s public upper-case module-level numbers: an int or float (not a
  bool), a tuple or list of them, or a NumPy array of them."""
  return {name: value for name, value in vars(module).items()
          if name.isupper() and not name.startswith("_") and _is_number(value)}


def _plain(value):
  """A NumPy array as a tuple of its items, each float the shortest decimal that reads back as
  the array's item (a float32 0.299 as 0.299)."""
  if type(value).__name__ != "ndarray":
    return value
  if value.dtype.kind == "f":
    return tuple(float(str(item)) for item in value.ravel())
  return tuple(int(item) for item in value.ravel())


def _same_constant(value, declared) -> bool:
  if type(value).__name__ == "ndarray":  # the declared numbers, in the array's dtype
    import numpy as np
    return bool(np.array_equal(value, np.asarray(declared, value.dtype)))
  return same_value(value, declared)


def constant_rows(module) -> list[list[str]]:
  """(name, `shown(value)`, meaning, `describe(source)`) of each constant `module` declares in
  its `CONSTANTS`, in declared order (a method page's constants table)."""
  return [[name, shown(_plain(getattr(module, name, None))), constant.meaning,
           describe(constant.source)]
          for name, constant in getattr(module, "CONSTANTS", {}).items()]


def unsourced_constants(module) -> list[str]:
  """One line per numeric module constant of `module` (`numeric_constants`) that its `CONSTANTS`
  does not declare, or whose declaration does not trace its value (`source_problem`, the value
  compared with the source's as a key's default is), or per declared name the module lacks;
  [] when every number is traced."""
  declared, found = getattr(module, "CONSTANTS", {}), numeric_constants(module)
  where = module.__name__
  lines = [f"{where}.{name} = {shown(_plain(value))}: a module constant without a declared"
           f" source; add \"{name}\": Constant('what it does', authors(...) | paper(...) |"
           " ours('why')) to its CONSTANTS"
           for name, value in found.items() if name not in declared]
  for name, constant in declared.items():
    if name not in found:
      lines.append(f"{where}.CONSTANTS declares {name}, which is not a numeric constant of it")
      continue
    value, source = found[name], constant.source
    if source.kind in ("authors", "paper") and _same_constant(value, source.value):
      value = source.value  # the declared numbers (an array's float32 items read back so)
    problem = source_problem(f"{where}.{name}", _plain(value), source)
    if problem:
      lines.append(problem)
  return lines
