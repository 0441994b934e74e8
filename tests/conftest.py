"""Session fixtures: one uninterrupted run of the tiny stream, shared by the resume and failure
tests, and the compilation cache its subprocesses share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_run


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("compilation_cache")


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, compilation_cache) -> Path:
  """An uninterrupted run of tiny_run's stream (it also fills the compilation cache)."""
  workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
  done = tiny_run.run(workdir, compilation_cache)
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads((workdir / "results.json").read_text())["plateau_steps"] == [4, 13, 20, 30]
  return workdir
