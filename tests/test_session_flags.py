"""The switch that picks the test session's XLA optimisation level (tiny_run.session_xla_env):
level 0 by default (with XLA's legacy fusion emitters where this jaxlib still has them), XLA's
own default with OLORA_TEST_XLA_OPT=default (CI's second leg), or whatever level XLA_FLAGS
already names."""

import os

import pytest
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
