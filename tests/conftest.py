"""Session fixtures: one uninterrupted run of the tiny stream, shared by the resume, failure and
run tests, and the compilation cache its subprocesses and the tests' in-process runs share. The
session compiles at XLA's fastest optimisation level (tiny_run.FAST_COMPILE_FLAG, with the legacy
fusion emitters where jaxlib has them: tiny_run.LEGACY_FUSION_FLAG), or at XLA's default with
OLORA_TEST_XLA_OPT=default (tiny_run.session_xla_env). Every float comparison in the
tests follows the rule at the top of numerics.py (exact only where bit-exactness is the claim,
else a tolerance scaled to what is compared): AMD and Intel hosts differ in the last bits.
Under -n, the hook pytest_xdist_make_scheduler keeps test_slurm.py's tests on one worker, and
each parity file whose tests share one run of ours on one worker (scheduling.py)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import scheduling
import tiny_run

# Before any backend exists (XLA reads its flags once per process); see tiny_run.FAST_COMPILE_FLAG.
# Subprocesses inherit os.environ, so they compile at the same level.
os.environ.update(tiny_run.session_xla_env(os.environ))

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache as jax_cache  # noqa: E402

from olora_jax import compute  # noqa: E402


def pytest_collection_modifyitems(config, items):
  """The checks against the authors' recordings (tests/test_parity_*.py) carry the `parity`
  marker: CI runs them in its first leg (.ci/run)."""
  for item in items:
    if item.path.name.startswith("test_parity_"):
      item.add_marker(pytest.mark.parity)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Under -n, test_slurm.py's tests on one worker, one after another, and each file of
  scheduling.SAME_WORKER_FILES whole on one worker (scheduling.py)."""
  return scheduling.make_scheduler(config, log)


def _session_root(tmp_path_factory) -> Path:
  """The session's temporary directory, above each pytest-xdist worker's own."""
  root = tmp_path_factory.getbasetemp()
  return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def session_root(tmp_path_factory) -> Path:
  """The session's temporary directory, shared by pytest-xdist's workers: for runs made once in
  the session under a lock, whichever worker needs one first."""
  return _session_root(tmp_path_factory)


@pytest.fixture(scope="session")
def method_runs_root(session_root) -> Path:
  """The session's directory of the per-method command-line runs (tiny_methods.method_run),
  shared by pytest-xdist's workers and by the tests that read those runs."""
  path = session_root / "method_runs"
  path.mkdir(exist_ok=True)
  return path


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory) -> Path:
  """One directory for the whole session, shared by pytest-xdist's workers (they write entries
  JAX reads back whole or not at all: a half-written entry fails to decompress and is compiled
  afresh), so a program is compiled once, not once per worker."""
  path = _session_root(tmp_path_factory) / "compilation_cache"
  path.mkdir(exist_ok=True)
  return path


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(compilation_cache):
  """Every run of the session, inside the test process or a `launch/run.py` subprocess (which
  inherits the environment), loads the programs an earlier run compiled for the same shapes, as
  `launch/run.py` does across runs, and none writes to the user's own cache; a cached program is
  the one a fresh compile makes, so no result changes. Restored afterwards."""
  before = {k: getattr(jax.config, k) for k in compute.COMPILATION_CACHE_SETTINGS}
  compute.enable_compilation_cache(str(compilation_cache))
  jax_cache.reset_cache()  # takes the new directory
  with pytest.MonkeyPatch.context() as patch:
    for name, value in tiny_run.cache_env(compilation_cache).items():
      patch.setenv(name, value)
    yield
  for k, v in before.items():
    jax.config.update(k, v)
  jax_cache.reset_cache()


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, compilation_cache) -> Path:
  """An uninterrupted run of tiny_run's stream (it also fills the compilation cache), made once
  per session: the first pytest-xdist worker to need it runs it while the others wait. Tests
  only read it (they copy it to change it); what the command printed is beside it
  (tiny_run.printed)."""
  root = _session_root(tmp_path_factory) / "uninterrupted"
  root.mkdir(exist_ok=True)
  workdir = root / "run"
  with open(root / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not (workdir / "results.json").exists():
      shutil.rmtree(workdir, ignore_errors=True)  # a worker that failed half-way
      done = tiny_run.run(workdir, compilation_cache)
      tiny_run.keep_printed(workdir, done)
      assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads((workdir / "results.json").read_text())["plateau_steps"] == [4, 13, 20, 30]
  return workdir
