"""The boundary switch on the tiny stream, through a method with an `at_boundary` hook (continual
fine-tuning that records when it is told): `oracle` tells it at exactly the true task ends,
`plateau` exactly where the loss-window rule fires on its logged training loss (reproduced here
from metrics.jsonl), and results.json and metrics.jsonl mark and count what was signalled; a
resumed run is told at the same steps."""

from __future__ import annotations

import json
import shutil

import pytest

from configs import tiny
from olora_jax import reporting, trainer, validation
from olora_jax.learner import plateau

METHOD_FILE = '''
import dataclasses
from olora_jax.methods import base, common, finetune

def build(ctx):
  method = finetune.make(ctx, "told", ctx.config.told)
  def at_boundary(state, host):  # records the train steps taken when told
    return state, {**host, "told_after": host.get("told_after", []) + [int(state["step"])]}
  return dataclasses.replace(method, at_boundary=at_boundary)

def config():
  return common.baseline_block(learning_rate=3e-3, weight_decay=0.0)

METHODS = (base.MethodSpec(name="told", build=build, config=config, report_name="Told"),)
'''


def run(tmp_path, rule: str, **boundaries):
  path = tmp_path / "told.py"
  path.write_text(METHOD_FILE)
  config = tiny.get_config(f"{path}:build")
  config.boundaries.rule = rule
  for key, value in boundaries.items():
    config.boundaries[key] = value
  config.eval.write_plots = False
  config.checkpoint_every = 8
  workdir = tmp_path / rule
  results = trainer.train_and_evaluate(config, str(workdir), progress=False)
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return config, workdir, results, lines


def told_after(workdir) -> list[int]:
  last = max(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
  host = json.loads((workdir / "checkpoints" / str(last) / "host" / "metadata").read_text())
  return host["progress"]["method_host"].get("told_after", [])


def test_oracle_tells_the_method_at_each_true_task_end(tmp_path):
  _, workdir, results, lines = run(tmp_path, "oracle")
  ends = results["task_end_steps"]
  assert told_after(workdir) == [e + 1 for e in ends]  # after the step that ends each task
  assert [x["step"] for x in lines if x["event"] == "boundary"] == ends
  assert results["boundaries"]["rule"] == "oracle" and not results["boundaries"]["task_free"]
  assert results["boundaries"]["n_signalled"] == len(ends) == 5


def test_plateau_tells_it_where_the_rule_fires_on_its_logged_loss(tmp_path):
  config, workdir, results, lines = run(tmp_path, "plateau", mean_threshold=2.0,
                                        var_threshold=0.02)
  rule = plateau.PlateauConfig(window=config.boundaries.window, mean_threshold=2.0,
                               var_threshold=0.02)
  window, fired = plateau.init(), []
  for line in lines:
    if line["event"] == "train":
      window, stats = plateau.update(window, line["loss"], rule)
      assert line["boundary_window_mean"] == pytest.approx(stats.mean, rel=1e-6)
      if stats.fired:
        fired.append(line["step"])
  assert fired, "the thresholds should make the rule fire on this stream"
  assert [x["step"] for x in lines if x["event"] == "boundary"] == fired
  assert results["plateau_steps"] == fired and results["n_plateaus"] == len(fired)
  assert told_after(workdir) == [s + 1 for s in fired]
  assert results["boundaries"]["task_free"] and results["plateau_detection"]["n_plateaus"] == len(
      fired)
  # A run killed after checkpoint 8 and resumed is told at the same steps.
  killed = tmp_path / "killed"
  shutil.copytree(workdir, killed, ignore=shutil.ignore_patterns("results.json"))
  for d in (killed / "checkpoints").iterdir():
    if d.name.isdigit() and int(d.name) > 8:
      shutil.rmtree(d)
  resumed = trainer.train_and_evaluate(config, str(killed), progress=False)
  assert told_after(killed) == told_after(workdir)
  assert resumed["plateau_steps"] == results["plateau_steps"]
  assert (killed / "metrics.jsonl").read_bytes() == (workdir / "metrics.jsonl").read_bytes()


SPOILER_FILE = '''
import jax.numpy as jnp
from olora_jax.methods import base, common, finetune

def build(ctx):
  inner = finetune.make(ctx, "spoiler", ctx.config.spoiler)
  def init(key, params):
    return {**inner.init(key, params), "spoiled": jnp.zeros((), bool)}
  def train_step(state, batch):  # trains as fine-tuning, whatever the flag; clears it
    state = dict(state)
    spoiled = state.pop("spoiled")
    state, scalars, extras = inner.train_step(state, batch)
    return {**state, "spoiled": jnp.zeros_like(spoiled)}, scalars, extras
  def predict(state, images):  # a spoiled model ranks the classes backwards
    logits = inner.predict({k: v for k, v in state.items() if k != "spoiled"}, images)
    return jnp.where(state["spoiled"], -logits, logits)
  def at_boundary(state, host):
    return {**state, "spoiled": jnp.ones((), bool)}, {**host, "told": host.get("told", 0) + 1}
  return base.Method(name="spoiler", init=init, train_step=train_step, predict=predict,
                     at_boundary=at_boundary)

def config():
  return common.baseline_block(learning_rate=3e-3, weight_decay=0.0)

METHODS = (base.MethodSpec(name="spoiler", build=build, config=config, report_name="Spoiler"),)
'''


def test_a_task_end_evaluation_sees_the_model_that_finished_the_task(tmp_path):
  """A method whose boundary change spoils its predictions until its next train step (which
  trains as if nothing happened): told at each true task end, its task-end and anytime
  accuracies are those of the same run never told, i.e. of the model before the boundary; the
  checkpoint written after a boundary step holds the state after the change, and a run resumed
  from it ends as the uninterrupted one."""
  path = tmp_path / "spoiler.py"
  path.write_text(SPOILER_FILE)
  runs, first_end = {}, None
  for rule in ("none", "oracle"):
    config = tiny.get_config(f"{path}:build")
    config.boundaries.rule = rule
    config.eval.write_plots = False
    if first_end is not None:  # a checkpoint right after the first task's last step
      config.checkpoint_every, config.max_to_keep = first_end + 1, 10
    runs[rule] = trainer.train_and_evaluate(config, str(tmp_path / rule), progress=False)
    first_end = runs[rule]["task_end_steps"][0]
  told, untold = runs["oracle"], runs["none"]
  assert told["boundaries"]["n_signalled"] == 5
  assert told["acc_matrix"] == untold["acc_matrix"]
  assert told["anytime_accuracy"] == untold["anytime_accuracy"]
  assert max(max(column) for column in told["acc_matrix"]) > 0.5  # negated, it would be ~0
  # The checkpoint after the first task's last step: told once, its state spoiled.
  workdir = tmp_path / "oracle"
  checkpoint = workdir / "checkpoints" / str(first_end + 1)
  host = json.loads((checkpoint / "host" / "metadata").read_text())
  assert host["progress"]["method_host"] == {"told": 1}
  killed = tmp_path / "killed"
  shutil.copytree(workdir, killed, ignore=shutil.ignore_patterns("results.json"))
  for d in (killed / "checkpoints").iterdir():
    if d.name.isdigit() and int(d.name) > first_end + 1:
      shutil.rmtree(d)
  resumed = trainer.train_and_evaluate(config, str(killed), progress=False)
  assert resumed["acc_matrix"] == told["acc_matrix"]
  assert (killed / "metrics.jsonl").read_bytes() == (workdir / "metrics.jsonl").read_bytes()


def test_none_adds_nothing_and_reports_mark_the_rule(tmp_path):
  _, _, results, lines = run(tmp_path, "none")
  assert "boundaries" not in results and results["plateau_steps"] == []
  assert not any(x["event"] == "boundary" or "boundary_window_mean" in x for x in lines)
  assert reporting.method_label({"method": "er", "boundaries.rule": "oracle"}) == (
      "ER [oracle boundaries]")
  assert reporting.method_label({"method": "er", "boundaries.rule": "none"}) == "ER"


def test_a_method_without_the_hook_runs_identically_under_every_rule(tmp_path):
  # What docs/methods/boundaries.md's regime table relies on for the sixteen methods without
  # `at_boundary`.
  runs = {}
  for rule in ("none", "oracle"):
    config = tiny.get_config("finetune")
    config.boundaries.rule = rule
    config.eval.write_plots = False
    workdir = tmp_path / rule
    results = trainer.train_and_evaluate(config, str(workdir), progress=False)
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    runs[rule] = results, [x["loss"] for x in lines if x["event"] == "train"]
  (none, none_losses), (oracle, oracle_losses) = runs["none"], runs["oracle"]
  assert oracle_losses == none_losses
  assert oracle["acc_matrix"] == none["acc_matrix"]
  assert oracle["anytime_accuracy"] == none["anytime_accuracy"]
  assert oracle["boundaries"]["n_signalled"] == 5 and "boundaries" not in none


@pytest.mark.parametrize("key,value,says", [
    ("rule", "always", "unknown boundaries.rule='always'"),
    ("window", 0, "boundaries.window=0 must be an integer >= 1"),
    ("mean_threshold", 0.0, "boundaries.mean_threshold=0.0 must be > 0"),
])
def test_bad_switch_values_are_refused(key, value, says):
  config = tiny.get_config("er")
  config.boundaries[key] = value
  with pytest.raises(validation.InputError, match=says):
    validation.check_method(config)


def test_online_lora_keeps_its_own_boundaries():
  config = tiny.get_config()
  config.boundaries.rule = "oracle"
  with pytest.raises(validation.InputError, match="Online-LoRA finds its own boundaries"):
    validation.check_method(config)
