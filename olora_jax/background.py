"""Imports a run needs later, started in a daemon thread while it does other work.

A module that takes a noticeable part of a second to import (matplotlib for the figures drawn at
the end, orbax with TensorStore for the first checkpoint) is imported while the run builds its
state and the device computes, instead of before the work that needs it. Using the module needs
no join: an import the thread has begun is finished by Python's import lock first, and one that
failed in the thread fails again, with its error, where the module is used.
"""

from __future__ import annotations

import importlib
import threading


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
