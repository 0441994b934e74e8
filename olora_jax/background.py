"""Work a run needs later, started in a daemon thread while it does other work.

A module that takes a noticeable part of a second to import (matplotlib for the figures drawn at
the end, orbax with TensorStore for the first checkpoint) is imported while the run builds its
state and the device computes, instead of before the work that needs it. Using the module needs
no join: an import the thread has begun is finished by Python's import lock first, and one that
failed in the thread fails again, with its error, where the module is used. `call` does the same
for one function's result (the forward pass's FLOP estimate, traced while the first step
compiles), read where it is needed.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import threading
from collections.abc import Callable


def _import_quietly(names: tuple[str, ...]) -> None:
  for name in names:
    try:
      importlib.import_module(name)
    except Exception:  # noqa: BLE001 (raised again, and reported, where the module is used)
      pass


def import_modules(*names: str) -> None:
  """Starts importing `names`, in order, in one daemon thread."""
  threading.Thread(target=_import_quietly, args=(names,), name=f"import {names[0]}",
                   daemon=True).start()


def call(fn: Callable, *args) -> concurrent.futures.Future:
  """`fn(*args)` in a daemon thread; its Future's `result()` returns the value or raises what
  `fn` raised. JAX's and Flax's tracing state is per thread, so `fn` may trace."""
  future: concurrent.futures.Future = concurrent.futures.Future()

  def run() -> None:
    try:
      future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 (given to whoever reads the result)
      future.set_exception(e)

  threading.Thread(target=run, name=f"call {getattr(fn, '__name__', 'fn')}", daemon=True).start()
  return future
