"""Continual-learning methods on one interface (`olora_jax.methods.base.Method`), and the registry
that finds them.

Every module of this package that declares `METHODS = (MethodSpec(...), ...)` is a method module:
the `method` config key names one of its specs, whose `build(ctx) -> Method` makes the method and
whose `config()` gives the defaults of its config block `config.<name>` (`configs/common.py` reads
them from here). A method outside the package declares a `MethodSpec` the same way in its own file
and is named by where it lives: `method="path/to/file.py:NAME"` or `method="package.module:NAME"`,
NAME being the spec or its `build` function (docs/extending.md). Nothing else lists the methods:
the config, validation, the sweep and the report tables all read the specs.

    specs()                   the packaged methods' specs, in the paper's Table 1 order
    resolve(name)             the spec a `method` value names (packaged, or from a file/module)
    add_config_block(config, name)   adds the method's block with its defaults when missing
    unread_overrides(method, keys)   the overridden keys of blocks a run of `method` never reads
    build(ctx)                the method of `ctx.config.method`
    REGISTRY                  packaged name -> build function
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pkgutil
import sys

from olora_jax.methods import base


@functools.cache
def _packaged() -> dict[str, base.MethodSpec]:
  found = []
  for info in pkgutil.iter_modules(__path__):
    module = importlib.import_module(f"{__name__}.{info.name}")
    found.extend(getattr(module, "METHODS", ()))
  return {s.name: s for s in sorted(found, key=lambda s: (s.table_row, s.name))}


def specs() -> tuple[base.MethodSpec, ...]:
  """Every packaged method's spec, in report row order (the paper's Table 1)."""
  return tuple(_packaged().values())


def is_outside(name: str) -> bool:
  """Whether a `method` value names a method outside the package ('file.py:NAME', 'mod:NAME')."""
  return isinstance(name, str) and ":" in name


def _load_module(where: str, name: str):
  """The module of an outside method: a Python file (relative to the working directory) or an
  importable module name."""
  if where.endswith(".py"):
    path = os.path.abspath(where)
    if not os.path.isfile(path):
      raise ValueError(f"method={name!r}: no file {where!r} (a path relative to the working"
                       " directory, or absolute)")
    module_name = "olora_jax_outside_method_" + os.path.splitext(os.path.basename(path))[0]
    if module_name in sys.modules and getattr(sys.modules[module_name], "__file__", "") == path:
      return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module
  try:
    return importlib.import_module(where)
  except ModuleNotFoundError as e:
    raise ValueError(f"method={name!r}: cannot import module {where!r} ({e}); give"
                     " 'path/to/file.py:NAME' or an importable 'module:NAME'") from None


@functools.cache
def resolve(name: str) -> base.MethodSpec:
  """The spec a `method` config value names; ValueError (one line) if it names none."""
  packaged = _packaged()
  if name in packaged:
    return packaged[name]
  if not is_outside(name):
    names = ("online_lora", *(n for n in packaged if n != "online_lora"))
    raise ValueError(f"unknown method={name!r}; use one of {names} or a method of your own as"
                     " 'path/to/file.py:NAME' (docs/extending.md)")
  where, _, attribute = name.rpartition(":")
  module = _load_module(where, name)
  found = getattr(module, attribute, None)
  if not isinstance(found, base.MethodSpec):  # a build function: its module's spec for it
    found = next((s for s in getattr(module, "METHODS", ()) if s.build is found), None)
  if found is None:
    raise ValueError(f"method={name!r}: {attribute!r} in {where!r} is neither a MethodSpec nor"
                     " the build function of one in the module's METHODS; declare"
                     " METHODS = (MethodSpec(...),) there (docs/extending.md)")
  if found.name in packaged:
    raise ValueError(f"method={name!r} declares the name {found.name!r} of a packaged method;"
                     " give its MethodSpec a name of its own")
  return found


def add_config_block(config, name: str | None = None):
  """Adds the config block of method `name` (default: `config.method`) with its defaults when the
  config lacks it (a method outside the package); returns the config, still locked if it was."""
  spec = resolve(name if name is not None else config.method)
  if spec.config is not None and spec.name not in config:
    locked = config.is_locked
    config.unlock()
    config[spec.name] = spec.config()
    if locked:
      config.lock()
  return config


def unread_overrides(method: str, keys) -> list[str]:
  """The dotted config keys among `keys` that fall in another method's block (`er.buffer_size`
  on a run of `inflora`): a method reads its own block, never another's, so such an override
  changes nothing. ValueError for an unknown `method` (as `resolve`)."""
  other = {s.name for s in specs() if s.config is not None} - {resolve(method).name}
  return [k for k in keys if k.split(".")[0] in other]


def build(ctx: base.Context) -> base.Method:
  """The method named by `ctx.config.method`; ValueError for an unknown name or a function of
  the wrong signature (`base.check_signatures`). On a model with
  BatchNorm its steps also move the running statistics (`common.with_batch_statistics`)."""
  from olora_jax.methods import common

  method = resolve(ctx.config.method).build(ctx)
  base.check_signatures(method)  # a hook of the wrong signature: refused before any compute
  return common.with_batch_statistics(method, ctx.model)


def __getattr__(attribute: str):
  if attribute == "REGISTRY":  # packaged name -> builder (the specs are found on first use)
    return {s.name: s.build for s in specs()}
  raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
