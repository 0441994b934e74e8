"""A method outside the package (examples/custom_method/) on the one loop, through the command
line: it runs from its file, its config block comes from that file and takes overrides, a run
killed by SIGKILL resumes bit-identical to an uninterrupted one, `launch/sweep.py` and
`launch/report.py` take it, and its rule (a class-balanced memory) holds in the final state."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from tiny_run import ROOT

from configs import tiny
from olora_jax import errors, methods, trainer, validation
from olora_jax.methods import base
from olora_jax.models.vit import VisionTransformer, ViTSpec

FILE = "examples/custom_method/class_balanced_er.py"
METHOD = (f"--config.method={FILE}:build", "--config.cb_er.buffer_size=20",
          "--config.cb_er.replay_batch=4", "--config.cb_er.learning_rate=3e-3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compilation_cache):
  """(uninterrupted workdir, killed-then-resumed workdir, the resume's process)."""
  root = tmp_path_factory.mktemp("custom_method")
  full = tiny_run.run(root / "full", compilation_cache, *METHOD)
  assert full.returncode == 0, full.stderr[-2000:]
  killed = tiny_run.stop_after_checkpoint(root / "killed", 12, signal.SIGKILL, compilation_cache,
                                          *METHOD)
  assert killed.returncode == -signal.SIGKILL
  resumed = tiny_run.run(root / "killed", compilation_cache, *METHOD)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  return root / "full", root / "killed", resumed


def test_runs_from_its_file_with_its_own_block(runs):
  full, _, _ = runs
  config = json.loads((full / "config.json").read_text())
  assert config["method"] == f"{FILE}:build"
  assert config["cb_er"] == {"trainable": "all", "learning_rate": 3e-3, "weight_decay": 1e-4,
                             "buffer_size": 20, "replay_batch": 4}
  results = json.loads((full / "results.json").read_text())
  assert results["n_steps"] == tiny_run.N_STEPS and len(results["acc_matrix"]) == 5


def test_resumes_bit_exactly_after_sigkill(runs):
  full, killed, resumed = runs
  assert "resuming" in resumed.stderr
  tiny_run.assert_same_run(killed, full)


def test_its_memory_is_class_balanced():
  """Fed a class-incremental sequence of batches, the memory ends with every class seen at an
  equal share (GDumb's greedy rule), where a reservoir keeps mostly the early classes."""
  config = tiny.get_config(f"{FILE}:build")
  config.cb_er.buffer_size, config.cb_er.replay_batch = 6, 2
  spec = ViTSpec(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, image_size=8)
  model = VisionTransformer(spec, 3)
  ctx = base.Context(config=config, model=model, spec=spec, num_classes=3, batch_size=4,
                     image_shape=(8, 8, 3))
  method = methods.build(ctx)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
  state = method.init(jax.random.key(1), params)
  step = jax.jit(method.train_step)
  rng = np.random.default_rng(0)
  for label in (0, 0, 0, 1, 1, 2):  # six batches of four, one class each
    batch = {"images": rng.integers(0, 256, (4, 8, 8, 3)).astype(np.float32) / 255,
             "labels": np.full(4, label, np.int32), "mask": np.ones(4, bool)}
    state, scalars, _ = step(state, batch)
    assert np.isfinite(scalars["loss"])
  buffer = state["buffer"]
  counts = np.bincount(np.asarray(buffer.labels)[np.asarray(buffer.valid)], minlength=3)
  assert counts.tolist() == [2, 2, 2]


def test_sweep_and_report_take_it(runs, tmp_path):
  full, _, _ = runs
  sweep = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), "--root",
                          str(tmp_path), "--settings", "configs/tiny.py", "--methods",
                          f"{FILE}:build", "--seeds", "0", "--dry_run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
  assert sweep.returncode == 0, sweep.stderr
  assert f"{tmp_path}/tiny/cb_er/seed0" in sweep.stdout
  report = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), str(full),
                           f"--csv={tmp_path / 'r.csv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert report.returncode == 0, report.stderr
  row = [line for line in report.stdout.splitlines() if line.startswith("| ER (class-")]
  # A method of one's own has no check against its authors' code: the report's footnote says so.
  assert row and row[0].startswith("| ER (class-balanced memory) [^unchecked] |"), report.stdout


def test_a_bad_method_file_is_one_line_before_any_compute(tmp_path, compilation_cache):
  (tmp_path / "no_spec.py").write_text("def build(ctx):\n  return None\n")
  (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
  for target, says in ((tmp_path / "missing.py", "no file"),
                       (tmp_path / "no_spec.py", "neither a MethodSpec nor"),
                       (tmp_path / "broken.py", "cannot load --config.method")):
    done = tiny_run.run(tmp_path / "run", compilation_cache, f"--config.method={target}:build")
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in tiny_run.last_line(done.stderr) and not (tmp_path / "run").exists()


def test_a_hook_of_the_wrong_signature_is_refused_naming_the_hook(tmp_path):
  """An after_step written with six arguments (the interface docs once listed six; the loop
  passes eight) failed at the first step as "unexpected TypeError ... (raised at
  olora_jax/trainer.py) ... please report it": it is refused before any compute, naming it."""
  source = ROOT / FILE
  (tmp_path / "hooked.py").write_text(
      f"import dataclasses\nimport importlib.util\n\nfrom olora_jax.methods import base\n\n"
      f"spec = importlib.util.spec_from_file_location('cb_er_file', {str(source)!r})\n"
      "cb_er = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(cb_er)\n\n\n"
      "def build(ctx):\n  def after_step(state, host, step, batch, scalars, extras):\n"
      "    return state, host, base.StepReport()\n\n"
      "  return dataclasses.replace(cb_er.build(ctx), after_step=after_step)\n\n\n"
      "METHODS = (base.MethodSpec(name='cb_er', build=build, config=cb_er.config,"
      " report_name='hooked'),)\n")
  config = tiny.get_config(f"{tmp_path / 'hooked.py'}:build")
  with pytest.raises(ValueError, match=re.escape(
      "method='cb_er': its after_step(state, host, step, batch, scalars, extras) cannot take the"
      " loop's call after_step(state, host, step, batch, scalars, extras, finite, trace) (too"
      " many positional arguments); give after_step that signature (the method interface:"
      " docs/methods/interface.md)")):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def _hooked_file(tmp_path, body: str) -> str:
  """A file declaring cb_er (the example's method) with `body` as its after_step's."""
  source = ROOT / FILE
  path = tmp_path / "hooked.py"
  path.write_text(
      f"import dataclasses\nimport importlib.util\n\nimport numpy as np\n\n"
      "from olora_jax.methods import base\n\n"
      f"spec = importlib.util.spec_from_file_location('cb_er_file', {str(source)!r})\n"
      "cb_er = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(cb_er)\n\n\n"
      "def build(ctx):\n"
      "  def after_step(state, host, step, batch, scalars, extras, finite, trace):\n"
      f"{body}\n"
      "  return dataclasses.replace(cb_er.build(ctx), after_step=after_step)\n\n\n"
      "METHODS = (base.MethodSpec(name='cb_er', build=build, config=cb_er.config,"
      " report_name='hooked'),)\n")
  return f"{path}:build"


@pytest.mark.parametrize("body, says", [
    # (state, host) for three values: "unexpected ValueError ... (raised at trainer.py)".
    ("    return state, host", "returned 2 values; return three values: state, host,"
     " StepReport(...)"),
    # An array in the host record from step 1 on: the first return passes, the checkpoint at
    # step 4 could not store it: "unexpected TypeError ... (raised at checkpointing.py)".
    ("    host = dict(host, arr=np.zeros(3)) if step else host\n"
     "    return state, host, base.StepReport()",
     "returned a host record that a checkpoint cannot store: host['arr'] is a numpy.ndarray;"
     " keep arrays in the state"),
    # A reserved name in an event at step 2: "unexpected TypeError: RunLog.write() got multiple
    # values for argument 'step' ... please report it".
    ("    events = (('mine', {'step': 1}),) if step == 2 else ()\n"
     "    return state, host, base.StepReport(events=events)",
     "returned the event 'mine' with the value(s) 'step', which every metrics.jsonl line sets"
     " itself"),
])
def test_a_hooks_bad_return_is_named_in_its_own_file(tmp_path, body, says):
  """A mistake in a method's after_step is the user's: exit 2 naming their file and line (the
  hook's), never olora_jax's file with "please report it"."""
  target = _hooked_file(tmp_path, body)
  config = tiny.get_config(target)
  config.checkpoint_every, config.eval.write_plots = 4, False
  config.cb_er.update(buffer_size=20, replay_batch=4)
  with pytest.raises(base.MethodError) as raised:
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert raised.value.exit_code == 2
  message = str(raised.value)
  assert message.startswith(f"method='cb_er': its after_step ({tmp_path / 'hooked.py'}:14) ")
  assert says in message and "report" not in message, message


def test_hook_check_names_each_bad_return():
  """Each shape of a bad hook return, checked without a run."""
  def after_step(state, host, step, batch, scalars, extras, finite, trace):
    return state, host, base.StepReport()
  def train_step(state, batch):
    return state, {"loss": 0.0}, {}
  line = after_step.__code__.co_firstlineno
  method = base.Method(name="mine", init=None, train_step=train_step, predict=None,
                       after_step=after_step)
  scalars = {"loss": 1.0}
  cases = [
      ((1, {}), "returned 2 values; return three values"),
      ((1, [], base.StepReport()), "returned a host record of type list"),
      ((1, {"a": np.float32(1)}, base.StepReport()), "host['a'] is a numpy.float32"),
      ((1, {"a": [{3: 1}]}, base.StepReport()), "host['a'][0] has the key 3 of type int"),
      ((1, {}, ({}, {})), "returned a third value of type tuple"),
      ((1, {}, base.StepReport(events=(("e", {"event": 1}),))), "the value(s) 'event'"),
      ((1, {}, base.StepReport(events=(("e", 1),))), "returned the event ('e', 1)"),
      ((1, {}, base.StepReport(train_values={"loss": 2.0})),
       "returned the train value(s) 'loss', which the step's train line already has"),
      ((1, {}, base.StepReport(train_values={"samples_seen": 2.0})), "value(s) 'samples_seen'"),
  ]
  for result, says in cases:
    with pytest.raises(base.MethodError, match=re.escape(says)) as raised:
      base.HookCheck(method).after_step(result, scalars)
    assert f"its after_step ({__file__}:{line}) " in str(raised.value)
  good = (1, {"window": [1.0, None], "n": 2}, base.StepReport((("e", {"x": 1}),), {"w": 1.0}))
  assert base.HookCheck(method).after_step(good, scalars) is good
  with pytest.raises(base.MethodError, match=re.escape(
      f"its train_step ({__file__}:{train_step.__code__.co_firstlineno}) returned the scalar(s)"
      " 'step'")):
    base.HookCheck(method).scalars({"loss": 1.0, "step": 2})
  with pytest.raises(base.MethodError, match=re.escape("returned 3 values; return two values")):
    base.HookCheck(method).at_boundary((1, {}, 2))
  # A hook of olora_jax's own is a bug to report (exit 1), not the user's to fix.
  own = base.Method(name="x", init=None, train_step=None, predict=None,
                    after_step=trainer.format_results_table)
  with pytest.raises(errors.InternalError, match="please report it"):
    base.HookCheck(own).after_step((1, {}), scalars)


def test_a_config_names_it_in_code():
  config = tiny.get_config(f"{FILE}:build")
  assert config.cb_er.buffer_size == 500 and config.method == f"{FILE}:build"
  validation.check_method(config)
  config = tiny.get_config()
  config.method = f"{FILE}:build"  # named without its block: the line says how to add it
  with pytest.raises(ValueError, match="which the config lacks; build the config with"):
    validation.check_method(config)
  # The registry hands back the declaration the file makes.
  spec = methods.resolve(f"{FILE}:build")
  assert spec.name == "cb_er" and spec.report_name == "ER (class-balanced memory)"
