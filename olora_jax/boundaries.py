"""The boundary switch: whether, and when, a method is told that a task boundary was passed.

Every method is task-free by default. A method that uses task boundaries while it trains (a new
prompt or LoRA direction per task, a first phase that ends) declares `Method.at_boundary(state,
host) -> (state, host)`; the run's `boundaries.rule` says who calls it:

    none     never (the default: task-free, every method's results as without the switch)
    oracle   at the last step of each true task (the evaluator's task ends): an upper-bound
             setting that breaks task-freeness; results.json's `boundaries` and the report
             tables mark such runs
    plateau  when the loss-window rule Online-LoRA uses (learner/plateau.py: the window mean and
             variance below their thresholds, after a peak) fires on the method's own training
             loss, `scalars["loss"]` of each finite step (`boundaries.window`,
             `.mean_threshold`, `.var_threshold`): task-free, as Online-LoRA's own plateaus

With `oracle` and `plateau` every signalled boundary is a `boundary` line of metrics.jsonl, and
with `plateau` each firing is also a `plateau` line, so results.json scores the detector against
the true boundaries (`plateau_detection`: precision, recall, latency) for any method, as it does
for Online-LoRA. The window's mean and variance join each `train` line. A method without the hook
runs unchanged under any rule: the switch then only measures when the rule would have fired.
Online-LoRA detects its own boundaries (its plateaus consolidate) and keeps `none`.

When, within the step that passes a boundary (olora_jax/trainer.py): the switch decides after
the method's own hook (`after_step`), the step's events and `train` line are written, the step's
evaluations run (its task end, its anytime point), and only then is the method told (`tell`),
before the step's checkpoint. So the task-end evaluation of task t sees the model that finished
task t, as the methods' authors evaluate it (e.g. SD-LoRA's renormalisation of the finished
component, a new prompt or a merged branch apply after it), and a checkpoint after the step holds
the state the method left after the boundary, from which a resumed run continues.
"""

from __future__ import annotations

from olora_jax.data.streams import Stream
from olora_jax.learner import plateau as plateau_lib
from olora_jax.methods import base

RULES = ("none", "oracle", "plateau")


class BoundarySwitch:
  """Decides after each step whether a boundary was passed and tells the method. Its host state
  (the plateau rule's window) is a JSON record kept in the checkpointed progress."""

  def __init__(self, config, stream: Stream, method: base.Method):
    self.rule = config.rule
    self.method = method
    self.task_ends = set(stream.task_end_steps().tolist())
    self.plateau_config = plateau_lib.PlateauConfig(
        window=config.window, mean_threshold=config.mean_threshold,
        var_threshold=config.var_threshold)

  def init_host(self) -> dict:
    """The switch's record before the first step."""
    if self.rule == "plateau":
      return {"window": plateau_lib.to_json(plateau_lib.init()), "n_signalled": 0}
    return {"n_signalled": 0} if self.rule == "oracle" else {}

  def after_step(self, record: dict, step: int, scalars: dict, finite: bool):
    """-> (crossed, events, train_values) after stream step `step`: whether a boundary was
    passed at it, the metrics.jsonl events to write and the values to add to the step's `train`
    line. `record` (the switch's host record) is updated in place. The method is not told
    here: the loop calls `tell` once the step's evaluations are done (module docstring)."""
    if self.rule == "none":
      return False, (), {}
    events, train_values, crossed = [], {}, False
    if self.rule == "oracle":
      crossed = step in self.task_ends
    elif finite:  # plateau: a skipped step has no loss to add to the window
      before = plateau_lib.from_json(record["window"])
      window, stats = plateau_lib.update(before, scalars["loss"], self.plateau_config)
      record["window"] = plateau_lib.to_json(window)
      train_values = dict(boundary_window_mean=stats.mean, boundary_window_var=stats.var)
      crossed = stats.fired
      if stats.rearmed:  # the detector may fire again
        events.append(plateau_lib.rearm_event(stats, before))
      if crossed:
        events.append(("plateau", dict(n_plateaus=window.n_plateaus, window_mean=stats.mean,
                                       window_var=stats.var)))
    if crossed:
      record["n_signalled"] += 1
      events.append(("boundary", dict(rule=self.rule, n_boundaries=record["n_signalled"],
                                      told=self.method.at_boundary is not None)))
    return crossed, tuple(events), train_values

  def tell(self, state, method_host: dict, check=None):
    """-> (state, method_host) as the method's `at_boundary` leaves them (unchanged for a
    method without the hook): called for a step whose `after_step` said crossed, after that
    step's evaluations and before its checkpoint. `check` (`methods.base.HookCheck`) refuses a
    return the loop cannot take, naming the hook."""
    if self.method.at_boundary is None:
      return state, method_host
    result = self.method.at_boundary(state, method_host)
    return result if check is None else check.at_boundary(result)

  def results(self, record: dict) -> dict:
    """results.json's `boundaries` (absent with `none`, so a task-free run's results stay as
    they were)."""
    if self.rule == "none":
      return {}
    return {"boundaries": {
        "rule": self.rule,
        "task_free": self.rule != "oracle",
        "n_signalled": record["n_signalled"],
        "method_told": self.method.at_boundary is not None,
        "note": ("oracle: the method was told each true task end (not task-free; an upper"
                 " bound on what a boundary detector gives)" if self.rule == "oracle" else
                 "plateau: boundaries from the loss-window rule on the method's own loss"
                 " (task-free)")}}
