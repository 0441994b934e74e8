"""Config keys declared with their meanings: each key of a config block is one line,
`name=Key(default, "what it does")`, and the config reference (docs/reference/config.md) is
generated from those lines, so a key's meaning sits beside its default and cannot go missing:
the docs build and tests/test_config_keys.py refuse a key without one.

    Key(default, meaning)      one key: its default value and one line saying what it does (units,
                               allowed values, what 0 or '' means)
    block(about, **keys)       a plain `ml_collections.ConfigDict` of the keys' defaults (a value
                               that is a ConfigDict is a sub-block), remembering each key's meaning
                               and the block's `about` line for the reference
    about(config)              a block's `about` line ('' if none)
    meanings(config)           {dotted key: meaning} of every key that has one, in declared order
    unexplained(config)        the dotted keys without a meaning (an empty or name-only one counts)

A key given as a bare value (`block("...", rank=4)`) has no meaning: the config works, the docs
build fails naming it. The meanings ride on the ConfigDict objects `block` makes, not in their
fields, so nothing reads them but the functions above: config.json, comparisons of configs and
command-line overrides see the same ConfigDict as before (a copy of a config drops them).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import ml_collections

# Where `block` keeps (about, {key: meaning}, declared key order) on the ConfigDict it makes.
_ATTRIBUTE = "_olora_meanings"


class Key(NamedTuple):
  """One config key as a block declares it: its default value and its meaning."""

  default: Any
  meaning: str


def block(about: str = "", /, **keys) -> ml_collections.ConfigDict:
  """A ConfigDict of `keys`' defaults: each `Key(default, meaning)` gives its default (a bare value
  is taken as it is, without a meaning; a ConfigDict is a sub-block). The meanings and `about`
  (one line: what the block configures) are kept for `meanings` and the reference page."""
  values, explained = {}, {}
  for name, value in keys.items():
    if isinstance(value, Key):
      values[name], explained[name] = value.default, value.meaning
    else:
      values[name] = value
  config = ml_collections.ConfigDict(values)
  object.__setattr__(config, _ATTRIBUTE, (about, explained, tuple(keys)))
  return config


def _declared(config) -> tuple[str, dict[str, str], tuple[str, ...]]:
  return config.__dict__.get(_ATTRIBUTE, ("", {}, ()))


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
