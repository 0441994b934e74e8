"""Session fixtures: one uninterrupted run of the tiny stream, shared by the resume and failure
tests, and the compilation cache its subprocesses and the tests' in-process runs share."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
import tiny_run
from jax._src import compilation_cache as jax_cache

from olora_jax import compute


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("compilation_cache")


@pytest.fixture(scope="session", autouse=True)
def in_process_compilation_cache(compilation_cache):
  """Runs inside the test process load the programs an earlier test (or a subprocess) compiled
  for the same shapes, as `launch/run.py` does across runs; a cached program is the one a fresh
  compile makes, so no result changes. Restored afterwards."""
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  before = {k: getattr(jax.config, k) for k in keys}
  compute.enable_compilation_cache(str(compilation_cache))
  jax_cache.reset_cache()  # takes the new directory
  yield
  for k, v in before.items():
    jax.config.update(k, v)
  jax_cache.reset_cache()


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, compilation_cache) -> Path:
  """An uninterrupted run of tiny_run's stream (it also fills the compilation cache)."""
  workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
  done = tiny_run.run(workdir, compilation_cache)
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads((workdir / "results.json").read_text())["plateau_steps"] == [4, 13, 20, 30]
  return workdir
