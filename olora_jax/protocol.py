"""The evaluation protocol: when the evaluator runs, what each evaluation records, and how the
records become the metrics of results.json.

The learner never sees tasks; the protocol does (docs/metrics.md):

    anytime point   every `eval.eval_every` samples seen (methods with `anytime_eval`): accuracy
                    on the test data of the classes (or domains) seen so far -> the `eval` line of
                    metrics.jsonl and one point of the anytime curve (A_auc)
    task end        at each true task boundary of the stream: accuracy on every task's test data
                    -> the `task_end` line and one column a_{:, j} of the accuracy matrix, plus the
                    per-class counts Si-Blurry's A_last / F_last are computed from
    results         `EvaluationProtocol.results`: A_final, Forgetting, A_auc, backward transfer,
                    A_last, F_last, the task-balanced accuracy, per-class accuracy, plateau
                    detection against the true boundaries, and every metric's definition

When both fall on one step, one pass over the whole test set serves both (the seen classes' part
of a task-end evaluation is the anytime evaluation: same class mask, same predictions). A stream
shorter than `eval.eval_every` would have no anytime point: its final evaluation (the last task
end) is taken as the one point, so A_auc is its accuracy on the seen data, and the run warns.

Its state is an `EvaluationLog` (the protocol's part of the checkpointed `Progress`): a resumed
run continues the same records, so its results equal an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from olora_jax import compute as compute_lib
from olora_jax import evaluate
from olora_jax import metrics as metrics_lib
from olora_jax.data import sources as sources_lib
from olora_jax.data.streams import Stream


@dataclasses.dataclass
class EvaluationLog:
  """The protocol's records so far (JSON-able; checkpointed inside `checkpointing.Progress`)."""

  next_eval: int  # samples_seen at which the next anytime evaluation is due
  seen_classes: list[int]  # classes the stream has shown so far (sorted)
  acc_columns: list[list[float]]  # task-end evaluations, one column a_{:, j} each
  anytime: list[float]  # anytime accuracies on the classes seen so far
  anytime_samples: list[int]  # samples seen at each anytime evaluation
  task_end_samples: list[int]  # samples seen at each true task end
  end_correct: list[list[int]]  # per-class correct counts at each task end (T, C)
  end_total: list[list[int]]  # per-class test counts at each task end (T, C)
  end_seen: list[list[bool]]  # classes seen by each task end (T, C)
  # Task-IL (runs that count it, `task_il_map`): its columns and anytime accuracies, beside
  # acc_columns and anytime (empty in checkpoints written before Task-IL was recorded).
  acc_columns_task_il: list[list[float]] = dataclasses.field(default_factory=list)
  anytime_task_il: list[float] = dataclasses.field(default_factory=list)

  @classmethod
  def initial(cls, eval_every: int) -> EvaluationLog:
    return cls(next_eval=eval_every, seen_classes=[], acc_columns=[], anytime=[],
               anytime_samples=[], task_end_samples=[], end_correct=[], end_total=[],
               end_seen=[])


class EvaluationProtocol:
  """Evaluates at the protocol's points and keeps its records in `log` (an `EvaluationLog`).

  `evaluator` counts a model's predictions (`olora_jax.evaluate.Evaluator`); `write(event, step,
  samples_seen, **values)` appends a line to the run log; `timed_eval(seconds)` books the
  evaluation time in the compute ledger. `anytime_eval=False`: task ends only (GDumb);
  `eval_state(state, step)`: the state the evaluator reads after stream step `step` (a method's
  `eval_state`, checked: `run_control.evaluated_state`; None: the state itself)."""

  def __init__(self, log: EvaluationLog, stream: Stream, test_source, evaluator: Any,
               num_classes: int, eval_every: int, anytime_eval: bool, mask_unseen_logits: bool,
               write: Callable[..., None], timed_eval: Callable[[float], None],
               eval_state: Callable[[Any], Any] | None = None):
    self.log, self.stream, self.evaluator, self.eval_state = log, stream, evaluator, eval_state
    self.num_classes, self.eval_every, self.anytime_eval = num_classes, eval_every, anytime_eval
    self.mask_unseen_logits = mask_unseen_logits
    self._write, self._timed_eval = write, timed_eval
    self.task_ends = set(stream.task_end_steps().tolist())
    # Which test examples are "task i's test data": by class, or by domain (docs/streams.md).
    self.groups = stream.evaluation_groups(sources_lib.domains_of(test_source))
    self.last_step = len(stream.steps) - 1
    # No multiple of eval_every within the stream: the final evaluation is the anytime point.
    self.short_stream = anytime_eval and stream.n_samples < eval_every
    if self.short_stream:
      logging.warning("%s", short_stream_note(stream.n_samples, eval_every))

  def observe(self, labels: np.ndarray) -> None:
    """The classes of one stream batch (all of its rows, across processes) are now seen."""
    self.log.seen_classes = sorted(set(self.log.seen_classes) | set(np.unique(labels).tolist()))

  def evaluate_if_due(self, step: int, samples_seen: int, state: Any) -> None:
    """Runs the evaluations due after stream step `step` (`samples_seen` samples in) on the
    learner's `state`, and records them."""
    log, stream = self.log, self.stream
    anytime_due = self.anytime_eval and _anytime_due(step, samples_seen, log.next_eval,
                                                     self.short_stream, self.last_step)
    at_task_end = step in self.task_ends
    if not (anytime_due or at_task_end):
      return
    seen = np.array(log.seen_classes)
    if self.eval_state is not None:  # e.g. GDumb trains its model from the buffer here
      state = self.eval_state(state, step)
    # Domain streams evaluated by domain: the test data of the domains seen so far.
    seen_domains = (self.groups.domains[: stream.step_task[step] + 1] if self.groups.by_domain
                    else None)
    # One pass serves both evaluations when they coincide: the whole test set at a task end,
    # the seen classes' test data otherwise (same class mask, same predictions).
    with compute_lib.Stopwatch() as eval_time:
      counts = (self.evaluator.all_counts(state, seen) if at_task_end
                else self.evaluator.seen_counts(state, seen, seen_domains))
    self._timed_eval(eval_time.seconds)
    if anytime_due:
      log.next_eval = _next_anytime(samples_seen, log.next_eval, self.eval_every)
      acc = counts.accuracy(seen, seen_domains)
      log.anytime.append(acc)
      log.anytime_samples.append(samples_seen)
      balanced = metrics_lib.task_balanced_accuracy(
          evaluate.group_accuracies(counts, self.groups, seen, seen_domains))
      til = {}
      if counts.task_il_correct is not None:
        log.anytime_task_il.append(counts.task_il_accuracy(seen))
        til = {"anytime_accuracy_task_il": log.anytime_task_il[-1]}
      self._write("eval", step, samples_seen, anytime_accuracy=acc,
                  anytime_accuracy_task_balanced=balanced, n_seen_classes=len(seen), **til)
    if at_task_end:
      column = evaluate.group_accuracies(counts, self.groups)
      log.acc_columns.append(column.tolist())
      log.end_correct.append(counts.correct.tolist())
      log.end_total.append(counts.total.tolist())
      log.end_seen.append(np.isin(np.arange(self.num_classes), seen).tolist())
      log.task_end_samples.append(samples_seen)
      task = int(stream.step_task[step])
      til = {}
      if counts.task_il_correct is not None:
        log.acc_columns_task_il.append(counts.task_il_accuracies(self.groups.classes).tolist())
        til = {"task_accuracies_task_il": log.acc_columns_task_il[-1]}
      self._write("task_end", step, samples_seen, task=task, task_accuracies=column,
                  average_accuracy_seen=float(column[: task + 1].mean()),
                  accuracy_seen_sample_weighted=counts.accuracy(seen),
                  seen_classes=seen, class_correct=counts.correct, class_total=counts.total,
                  **til)

  def results(self, plateau_steps: list[int], plateau_samples: list[int],
              nonfinite_steps: list[int], run_record: dict) -> dict:
    """results.json: the protocol's metrics; the step events (`plateau_*`: the method's plateau
    events, scored against the true task ends; `nonfinite_steps`: steps skipped for a
    non-finite loss) and the true task ends; `run_record` (what the run was: steps, samples,
    stream digests, compute, ...); each metric's definition; and, for a stream evaluated by
    domain, the per-domain records."""
    log = self.log
    acc_matrix = np.array(log.acc_columns).T  # (T, T): acc[i, j] after task j on task i
    class_correct = np.array(log.end_correct)  # (T, C) at each task end
    class_total = np.array(log.end_total)
    seen_at_end = np.array(log.end_seen, bool)  # (T, C)
    notes = dict(metrics_lib.DEFINITIONS)
    notes["A_auc"] += f" (eval_every = {self.eval_every} samples)"
    if self.short_stream:
      notes["A_auc"] += "; " + short_stream_note(self.stream.n_samples, self.eval_every)
    notes["mask_unseen_logits"] = (
        "logits of classes not yet seen were masked at evaluation" if self.mask_unseen_logits
        else "no logit masking at evaluation: every class can be predicted")
    results = {
        "A_final": metrics_lib.a_final(acc_matrix),
        "forgetting": metrics_lib.forgetting(acc_matrix),
        "A_auc": metrics_lib.a_auc(np.array(log.anytime)),
        "backward_transfer": metrics_lib.backward_transfer(acc_matrix),
        "A_last": metrics_lib.a_last(class_correct[-1], class_total[-1], seen_at_end[-1]),
        "F_last": metrics_lib.f_last(class_correct, class_total, seen_at_end),
        "task_balanced_accuracy_final": metrics_lib.task_balanced_accuracy(
            acc_matrix[:, -1], [seen_at_end[-1][cls].any() for cls in self.stream.task_classes]),
        "acc_matrix": acc_matrix,
        "class_accuracy_final": metrics_lib.class_accuracy(class_correct[-1], class_total[-1]),
        "anytime_accuracy": np.array(log.anytime),
        "anytime_samples": log.anytime_samples,
        "n_plateaus": len(plateau_steps),
        "plateau_steps": plateau_steps,
        "plateau_detection": {k: jsonable(v) for k, v in metrics_lib.plateau_detection(
            plateau_samples, log.task_end_samples).items()},
        "nonfinite_steps": nonfinite_steps,
        "task_end_steps": sorted(self.task_ends),
        **run_record,
        "metric_notes": notes,
    }
    results.update(self._task_il_results(notes))
    if self.groups.by_domain:  # rows of acc_matrix are domains: forgetting of each one
      notes["acc_matrix"] += "; task i = domain task_domains[i], its test examples of every class"
      notes["forgetting_per_domain"] = metrics_lib.FORGETTING_PER_DOMAIN
      results["task_domains"] = self.groups.domains
      results["forgetting_per_domain"] = metrics_lib.forgetting_per_task(acc_matrix)
    return {k: jsonable(v) if not isinstance(v, dict) else v for k, v in results.items()}

  def _task_il_results(self, notes: dict) -> dict:
    """results.json's Task-IL metrics, where the evaluator counts them (`task_il_map`):
    `acc_matrix_task_il`, `A_final_task_il`, `A_auc_task_il` and `anytime_accuracy_task_il`,
    their definitions added to `notes`. {} on other streams; and {} with a note for a run
    resumed from a checkpoint written before Task-IL was recorded (its records are partial)."""
    log = self.log
    if getattr(self.evaluator, "task_of_class", None) is None:
      return {}
    if (len(log.acc_columns_task_il) != len(log.acc_columns)
        or len(log.anytime_task_il) != len(log.anytime)):
      notes["task_il"] = metrics_lib.TASK_IL_PARTIAL
      return {}
    matrix = np.array(log.acc_columns_task_il).T
    notes.update({k: metrics_lib.DEFINITIONS_TASK_IL[k] for k in metrics_lib.DEFINITIONS_TASK_IL})
    notes["A_auc_task_il"] += f" (eval_every = {self.eval_every} samples)"
    return {"A_final_task_il": metrics_lib.a_final(matrix),
            "A_auc_task_il": metrics_lib.a_auc(np.array(log.anytime_task_il)),
            "acc_matrix_task_il": matrix,
            "anytime_accuracy_task_il": np.array(log.anytime_task_il)}


def task_il_map(stream: Stream, test_source, num_classes: int, scenario: str
                ) -> np.ndarray | None:
  """The class -> task map (C,) the evaluator masks Task-IL logits with (`Evaluator`'s
  `task_of_class`), or None where Task-IL is not defined: a domain stream (its tasks share the
  classes, or it is one shuffled task), a stream evaluated by domain, or one in which a class
  occurs in several tasks (Si-Blurry's moved blurry samples; `Stream.task_of_class`)."""
  if scenario == "domain" or stream.evaluation_groups(
      sources_lib.domains_of(test_source)).by_domain:
    return None
  return stream.task_of_class(num_classes)


def _anytime_due(step: int, samples_seen: int, next_eval: int, short_stream: bool,
                 last_step: int) -> bool:
  """An anytime point falls after `step`: `next_eval` samples reached (or, on a stream shorter
  than eval.eval_every, its last step)."""
  return samples_seen >= next_eval or (short_stream and step == last_step)


def _next_anytime(samples_seen: int, next_eval: int, eval_every: int) -> int:
  """The samples_seen of the anytime point after the one just taken: the next multiple."""
  return next_eval + eval_every * ((samples_seen - next_eval) // eval_every + 1)


def evaluation_points(stream: Stream, train_labels: np.ndarray, eval_every: int,
                      anytime_eval: bool = True) -> list[tuple[int, np.ndarray, bool]]:
  """The evaluations an uninterrupted run of `stream` makes, in order, as `EvaluationProtocol`
  schedules them: (step, classes seen by then, at a task end). Pure, on the host; the cost of a
  whole stream's evaluations is estimated from it (launch/device_check.py)."""
  points, seen, next_eval, samples = [], set(), eval_every, 0
  task_ends = set(stream.task_end_steps().tolist())
  short_stream, last_step = anytime_eval and stream.n_samples < eval_every, len(stream.steps) - 1
  for step, ids in enumerate(stream.steps):
    samples += len(ids)
    seen |= set(np.unique(train_labels[ids]).tolist())
    due = anytime_eval and _anytime_due(step, samples, next_eval, short_stream, last_step)
    if due:
      next_eval = _next_anytime(samples, next_eval, eval_every)
    if due or step in task_ends:
      points.append((step, np.array(sorted(seen)), step in task_ends))
  return points


def short_stream_note(n_samples: int, eval_every: int) -> str:
  """The one line a run whose stream is shorter than `eval.eval_every` warns with (and
  results.json's A_auc note records)."""
  return (f"the stream has {n_samples} samples, fewer than eval.eval_every={eval_every}: the"
          " anytime curve is the final evaluation alone and A_auc its accuracy on the seen"
          f" data; lower eval.eval_every for a curve of several points")


def jsonable(v):
  """A value as JSON holds it: arrays as lists, NumPy scalars as Python's, non-finite as None."""
  if isinstance(v, (np.ndarray, jax.Array)):
    v = np.asarray(v).tolist()
  if isinstance(v, (np.floating, float)):
    return None if not np.isfinite(v) else float(v)
  if isinstance(v, np.integer):
    return int(v)
  if isinstance(v, list):
    return [jsonable(x) for x in v]
  return v
