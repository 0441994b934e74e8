"""Every config key is declared with its meaning beside its default (`olora_jax.config_keys`), the
config reference is generated from those declarations, and a key without one is refused: here
first, so a key added without a meaning fails this test before the docs build (whose
`config-keys` directive prints the same lines as warnings, errors under `sphinx -W`)."""

from __future__ import annotations

import json

import ml_collections
import pytest
from ml_collections import config_dict

from configs import common
from olora_jax import config_keys, methods
from olora_jax.config_keys import Key, block
from olora_jax.methods import common as methods_common
from tests.test_configs import CONFIGS, load_config


def test_every_key_of_the_shared_config_has_a_meaning():
  config = common.get_config()
  assert common.unexplained_keys(config) == []
  given = config_keys.meanings(config)
  leaves = [key for key, _ in config_keys.leaves(config)]
  assert list(given) == leaves and len(leaves) > 200  # every block, every packaged method's
  assert {key.split(".")[0] for key in leaves} >= {s.name for s in methods.specs() if s.config}


@pytest.mark.parametrize("name", [s.name for s in methods.specs() if s.config is not None])
def test_every_method_block_declares_its_meanings(name):
  spec = methods.resolve(name)
  block_config = spec.config()
  assert config_keys.unexplained(block_config) == []
  assert set(config_keys.meanings(block_config)) == set(block_config.keys())


def test_a_key_without_a_meaning_is_refused_with_one_line_naming_where_to_add_it():
  config = common.get_config()
  config.unlock()
  config.eval.new_key = 3  # a key added the old way: a default, no meaning
  config.er.other_key = "x"
  lines = common.unexplained_keys(config)
  assert lines == [
      "config key er.other_key (default 'x'): it has no meaning; declare it as"
      " other_key=Key('x', \"what it does, its units and allowed values\") in"
      " olora_jax/methods/er.py",
      "config key eval.new_key (default 3): it has no meaning; declare it as"
      " new_key=Key(3, \"what it does, its units and allowed values\") in configs/common.py"]
  assert all("\n" not in line for line in lines)


def test_a_meaning_that_restates_the_key_or_is_empty_is_refused():
  config = block("a block", window_size=Key(4, "Window size."), depth=Key(2, " "),
                 patch_size=Key(4, "patch side in pixels"), extra=5)
  assert config_keys.unexplained(config) == ["window_size", "depth", "extra"]
  assert config_keys.is_meaning("model.window_size", "side of the attention windows, in patches")
  assert not config_keys.is_meaning("model.window_size", "model window_size")
  line = common.unexplained_keys(block("", top=block("", window_size=Key(4, "window size"))))
  assert line == ["config key top.window_size (default 4): its meaning 'window size' only"
                  " restates its name; declare it as window_size=Key(4, \"what it does, its"
                  " units and allowed values\") in configs/common.py"]


def test_an_outside_method_without_meanings_still_runs_and_is_listed():
  config = common.get_config(method="examples/custom_method/class_balanced_er.py:build")
  assert config.cb_er.replay_batch == 10  # a bare default: the config works as before
  assert common.unexplained_keys(config) == [
      "config key cb_er.replay_batch (default 10): it has no meaning; declare it as"
      " replay_batch=Key(10, \"what it does, its units and allowed values\") in"
      " examples/custom_method/class_balanced_er.py"]
  # buffer_size, learning_rate, weight_decay, trainable: the shared meanings of baseline_block
  assert config_keys.meanings(config.cb_er) == {
      key: methods_common.SHARED_MEANINGS[key]
      for key in ("trainable", "learning_rate", "weight_decay", "buffer_size")}


def test_a_block_is_the_plain_configdict_of_its_defaults():
  declared = block("about it", rate=Key(1e-4, "a learning rate"), sizes=Key((2, 2), "per stage"),
                   unset=Key(config_dict.placeholder(str), "a fidelity key"),
                   order=Key(config_dict.FieldReference("label", field_type=object), "any type"),
                   sub=block("inner", k=Key(1, "one key")))
  plain = ml_collections.ConfigDict({
      "rate": 1e-4, "sizes": (2, 2), "unset": config_dict.placeholder(str),
      "order": config_dict.FieldReference("label", field_type=object),
      "sub": ml_collections.ConfigDict({"k": 1})})
  assert declared == plain and declared.to_json() == plain.to_json()
  assert json.loads(declared.to_json()) == {"rate": 1e-4, "sizes": [2, 2], "unset": None,
                                            "order": "label", "sub": {"k": 1}}
  assert config_keys.about(declared) == "about it" and config_keys.about(declared.sub) == "inner"
  assert list(config_keys.meanings(declared)) == ["rate", "sizes", "unset", "order", "sub.k"]
  declared.lock()
  declared.order = [3, 1, 0, 2]  # the FieldReference keeps taking any type
  declared.unset = "unit"
  with pytest.raises(AttributeError):
    declared.new = 1  # locked as any ConfigDict
  with pytest.raises(TypeError):
    declared.rate = "fast"  # type-safe as any ConfigDict


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.py")
                                         if p.stem not in ("__init__", "common", "benchmark")))
def test_every_setting_keeps_the_meanings(name):
  """A setting overrides values only: its config has the same keys, all explained."""
  assert common.unexplained_keys(load_config(name)) == []
