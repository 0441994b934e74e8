"""The switch that picks the test session's XLA optimisation level (tiny_run.session_xla_env):
level 0 by default (with XLA's legacy fusion emitters where this jaxlib still has them), XLA's
own default with OLORA_TEST_XLA_OPT=default (CI's second leg), or whatever level XLA_FLAGS
already names; and how pytest-xdist hands out the tests under -n (scheduling.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import scheduling
import tiny_run


def test_fast_by_default():
  no = lambda flag, environ: False  # noqa: E731  (an XLA without the legacy emitters)
  assert tiny_run.session_xla_env({}, accepts=no) == {"XLA_FLAGS": tiny_run.FAST_COMPILE_FLAG}
  assert tiny_run.session_xla_env({"XLA_FLAGS": "--xla_foo=1"}, accepts=no) == {
      "XLA_FLAGS": "--xla_foo=1 " + tiny_run.FAST_COMPILE_FLAG}


def test_the_legacy_fusion_emitters_only_where_xla_knows_the_flag():
  yes = lambda flag, environ: flag == tiny_run.LEGACY_FUSION_FLAG  # noqa: E731
  assert tiny_run.session_xla_env({}, accepts=yes) == {
      "XLA_FLAGS": f"{tiny_run.FAST_COMPILE_FLAG} {tiny_run.LEGACY_FUSION_FLAG}"}
  # A choice already in XLA_FLAGS is kept, and nothing is asked.
  named = {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"}
  assert tiny_run.session_xla_env(named, accepts=None) == {
      "XLA_FLAGS": f"--xla_cpu_use_fusion_emitters=true {tiny_run.FAST_COMPILE_FLAG}"}


def test_xla_accepts_a_flag_it_knows_and_not_one_it_does_not():
  assert tiny_run.xla_accepts("--xla_backend_optimization_level=0")
  assert not tiny_run.xla_accepts("--xla_no_such_flag_anywhere=1")


def test_default_level_leaves_the_flags_alone():
  assert tiny_run.session_xla_env({"OLORA_TEST_XLA_OPT": "default"}) == {}


def test_a_named_level_is_kept():
  environ = {"XLA_FLAGS": "--xla_backend_optimization_level=2"}
  assert tiny_run.session_xla_env(environ) == {}


def test_an_unknown_choice_is_refused():
  with pytest.raises(ValueError, match="OLORA_TEST_XLA_OPT='fastest'"):
    tiny_run.session_xla_env({"OLORA_TEST_XLA_OPT": "fastest"})


def test_this_session_and_its_subprocesses_compile_as_chosen():
  """conftest.py applied the choice to os.environ, which subprocesses inherit."""
  flags = os.environ.get("XLA_FLAGS", "")
  if os.environ.get("OLORA_TEST_XLA_OPT") == "default":
    assert "--xla_backend_optimization_level" not in flags
  else:
    assert "--xla_backend_optimization_level" in flags


def test_a_convolutional_network_compiles_at_level_1_where_the_session_is_at_level_0(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"--xla_foo=1 {tiny_run.FAST_COMPILE_FLAG}"
                                  f" {tiny_run.LEGACY_FUSION_FLAG}")
  assert tiny_run.convolution_level_env()["XLA_FLAGS"] == (
      f"--xla_foo=1 {tiny_run.CONV_COMPILE_FLAG} {tiny_run.LEGACY_FUSION_FLAG}")
  for kept in ("", "--xla_backend_optimization_level=2"):  # XLA's default, a named level
    monkeypatch.setenv("XLA_FLAGS", kept)
    assert tiny_run.convolution_level_env()["XLA_FLAGS"] == kept


def test_under_n_2_the_slurm_tests_run_on_one_worker_and_the_others_anywhere(tmp_path):
  """A session of this suite's scheduler (conftest.py's hook) over a test_slurm.py, two files of
  SAME_WORKER_FILES and another file: every test_slurm.py test on one worker, each of the two
  files whole on one worker, and both workers busy with the rest."""
  tests = Path(__file__).parent
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  (tmp_path / "conftest.py").write_text(
      f"import sys\nsys.path.insert(0, {str(tests)!r})\nimport pytest, scheduling\n\n"
      "@pytest.hookimpl(optionalhook=True)\ndef pytest_xdist_make_scheduler(config, log):\n"
      "  return scheduling.make_scheduler(config, log)\n")
  body = "import time\n" + "".join(f"def test_{i}():\n  time.sleep(0.1)\n" for i in range(6))
  together = [name.removesuffix(".py") for name in scheduling.SAME_WORKER_FILES[:2]]
  files = ["test_a_first", *together, "test_slurm", "test_zz_other"]
  for name in files:
    (tmp_path / f"{name}.py").write_text(body)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "OLORA_"))}
  proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider"],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:]
  ran = re.findall(r"\[(gw\d)\].* PASSED (test_\w+)\.py::", proc.stdout)
  assert len(ran) == 6 * len(files) and "LoadWithOneWorkerFiles" in proc.stdout, (
      proc.stdout[-3000:])
  workers = {name: {worker for worker, file in ran if file == name} for name in files}
  assert len(workers["test_slurm"]) == 1, proc.stdout[-3000:]
  assert all(len(workers[name]) == 1 for name in together), (workers, proc.stdout[-3000:])
  assert workers["test_zz_other"] - workers["test_slurm"], proc.stdout[-3000:]
  assert scheduling.on_one_worker("tests/test_slurm.py::test_x[a/b::c]")
  assert not scheduling.on_one_worker("tests/test_run.py::test_slurm")
  assert all((tests / name).is_file() for name in scheduling.SAME_WORKER_FILES)
