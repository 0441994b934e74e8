"""The evaluation protocol on a hand-made stream with a stand-in evaluator: when it evaluates
(anytime points every `eval_every` samples, true task ends, one pass when both fall on a step),
what each evaluation records in the log and in metrics.jsonl, and how the records become the
metrics of results.json."""

from __future__ import annotations

import numpy as np
import pytest

from olora_jax import checkpointing, metrics, protocol
from olora_jax.data.sources import Source
from olora_jax.data.streams import Stream
from olora_jax.evaluate import ClassCounts

C = 4
# Two tasks of two classes; batches of 4 samples; task 0 ends at step 2, task 1 at step 5.
STREAM = Stream(steps=tuple(np.arange(4 * i, 4 * i + 4) for i in range(6)),
                step_task=np.array([0, 0, 0, 1, 1, 1]),
                task_classes=(np.array([0, 1]), np.array([2, 3])))
LABELS = [np.array(x) for x in ([0, 1, 0, 1], [1, 0, 1, 0], [0, 0, 1, 1], [2, 3, 2, 3],
                                [3, 2, 3, 2], [2, 2, 3, 3])]
TEST = Source("test", "test", np.zeros((8, 2, 2, 3), np.uint8), np.repeat(np.arange(C), 2), C)


class Evaluator:
  """Stand-in: class c has 10 test examples, of which the model gets `hits[c]` right; records
  every call as (kind, seen classes)."""

  def __init__(self):
    self.calls = []
    self.hits = np.array([10, 5, 8, 2])

  def _counts(self, classes):
    keep = np.isin(np.arange(C), classes)
    return ClassCounts(self.hits * keep, np.full(C, 10) * keep)

  def all_counts(self, state, seen):
    self.calls.append(("all", list(seen)))
    return self._counts(np.arange(C))

  def seen_counts(self, state, seen, seen_domains=None):
    self.calls.append(("seen", list(seen)))
    return self._counts(seen)


class TaskILEvaluator(Evaluator):
  """Stand-in counting Task-IL too: `til_hits[c]` of class c's 10 right with its task's mask."""

  task_of_class = np.array([0, 0, 1, 1])
  til_hits = np.array([10, 7, 9, 6])

  def _counts(self, classes):
    keep = np.isin(np.arange(C), classes)
    return super()._counts(classes)._replace(task_il_correct=self.til_hits * keep)


def run(eval_every: int, anytime_eval: bool = True, evaluator=None):
  log = protocol.EvaluationLog.initial(eval_every)
  lines, evaluator = [], evaluator or Evaluator()
  p = protocol.EvaluationProtocol(
      log, STREAM, TEST, evaluator, C, eval_every, anytime_eval, False,
      write=lambda event, step, samples, **values: lines.append((event, step, samples, values)),
      timed_eval=lambda seconds: None)
  samples = 0
  for step, labels in enumerate(LABELS):
    samples += len(labels)
    p.observe(labels)
    p.evaluate_if_due(step, samples, state=None)
  return p, log, lines, evaluator


def test_anytime_points_every_eval_every_samples_and_task_ends():
  _, log, lines, evaluator = run(eval_every=8)
  assert log.anytime_samples == [8, 16, 24]  # due at 8, 16, 24 samples (steps 1, 3, 5)
  assert [(e, s) for e, s, _, _ in lines] == [
      ("eval", 1), ("task_end", 2), ("eval", 3), ("eval", 5), ("task_end", 5)]
  # Step 5 is both: one pass over the whole test set serves the two records.
  assert evaluator.calls == [("seen", [0, 1]), ("all", [0, 1]), ("seen", [0, 1, 2, 3]),
                             ("all", [0, 1, 2, 3])]
  assert log.anytime == pytest.approx([15 / 20, 25 / 40, 25 / 40])
  assert log.next_eval == 32


def test_a_gap_larger_than_eval_every_moves_the_next_point_past_it():
  _, log, _, _ = run(eval_every=3)  # due at 3: evaluated at 4 samples; then 6 -> 8, 9 -> 12, ...
  assert log.anytime_samples == [4, 8, 12, 16, 20, 24]
  assert log.next_eval == 27


def test_task_ends_only_without_anytime_evaluation():
  _, log, lines, evaluator = run(eval_every=1, anytime_eval=False)
  assert [e for e, *_ in lines] == ["task_end", "task_end"] and log.anytime == []
  assert [kind for kind, _ in evaluator.calls] == ["all", "all"]


def test_task_end_records_and_the_results_they_make():
  p, log, lines, _ = run(eval_every=8)
  # Column j: accuracy on each task's classes (10 + 5 of 20; 8 + 2 of 20), whatever was seen.
  assert log.acc_columns == [[0.75, 0.5], [0.75, 0.5]]
  assert log.end_seen == [[True, True, False, False], [True, True, True, True]]
  assert log.task_end_samples == [12, 24]
  end = lines[1][3]
  assert end["task"] == 0 and end["average_accuracy_seen"] == 0.75
  assert end["accuracy_seen_sample_weighted"] == 0.75
  results = p.results([3], [16], [], {"n_steps": 6, "wall_seconds": 1.0})
  acc = np.array(log.acc_columns).T
  assert results["A_final"] == pytest.approx(metrics.a_final(acc))
  assert results["forgetting"] == pytest.approx(metrics.forgetting(acc))
  assert results["A_auc"] == pytest.approx(np.mean(log.anytime))
  assert results["acc_matrix"] == acc.tolist()
  detection = results["plateau_detection"]  # a plateau at task 1's first step, 16 samples in
  assert (detection["precision"], detection["recall"]) == (1.0, 1.0)
  assert detection["latency_samples"] == [4] and results["plateau_steps"] == [3]
  assert results["task_end_steps"] == [2, 5]
  keys = list(results)  # results.json's order: metrics, events, the run, the definitions
  assert keys[0] == "A_final" and keys[-1] == "metric_notes"
  assert keys.index("nonfinite_steps") < keys.index("task_end_steps") < keys.index("n_steps")
  assert "eval_every = 8 samples" in results["metric_notes"]["A_auc"]


def test_task_il_records_and_results_where_the_evaluator_counts_them():
  p, log, lines, _ = run(eval_every=8, evaluator=TaskILEvaluator())
  # Column j: each task's Task-IL accuracy ((10 + 7) / 20, (9 + 6) / 20), beside acc_columns.
  assert log.acc_columns_task_il == [[0.85, 0.75], [0.85, 0.75]]
  assert log.acc_columns == [[0.75, 0.5], [0.75, 0.5]]  # the class-incremental ones unchanged
  evals = [v for e, _, _, v in lines if e == "eval"]
  assert [v["anytime_accuracy_task_il"] for v in evals] == pytest.approx(
      [17 / 20, 32 / 40, 32 / 40])
  assert log.anytime_task_il == [v["anytime_accuracy_task_il"] for v in evals]
  ends = [v for e, _, _, v in lines if e == "task_end"]
  assert [v["task_accuracies_task_il"] for v in ends] == log.acc_columns_task_il
  results = p.results([], [], [], {})
  plain = run(eval_every=8)[0].results([], [], [], {})
  matrix = np.array(log.acc_columns_task_il).T
  assert results["acc_matrix_task_il"] == matrix.tolist()
  assert results["A_final_task_il"] == pytest.approx(metrics.a_final(matrix))
  assert results["A_auc_task_il"] == pytest.approx(np.mean(log.anytime_task_il))
  assert results["anytime_accuracy_task_il"] == pytest.approx(log.anytime_task_il)
  til_keys = {"acc_matrix_task_il", "A_final_task_il", "A_auc_task_il",
              "anytime_accuracy_task_il"}
  assert set(results) - set(plain) == til_keys  # every other value as without Task-IL
  assert {k: v for k, v in results.items() if k not in til_keys | {"metric_notes"}} == {
      k: v for k, v in plain.items() if k != "metric_notes"}
  notes = results["metric_notes"]
  assert "masked to the classes of its own task" in notes["acc_matrix_task_il"]
  assert {k: v for k, v in notes.items() if "task_il" not in k} == plain["metric_notes"]
  # A checkpoint written before Task-IL was recorded: its records are partial, so left out.
  restored = checkpointing.Progress.from_json(
      {k: v for k, v in _record(log).items() if k not in checkpointing.TASK_IL_JSON_KEYS})
  assert restored.evaluation.acc_columns_task_il == []
  assert restored.evaluation.anytime == log.anytime
  restored.evaluation.acc_columns_task_il = log.acc_columns_task_il[1:]
  p.log = restored.evaluation
  partial = p.results([], [], [], {})
  assert not til_keys & set(partial) and "resumed from a checkpoint" in partial["metric_notes"][
      "task_il"]


def _record(log) -> dict:
  progress = checkpointing.Progress.initial(8)
  progress.evaluation = log
  return progress.to_json()


def test_the_log_survives_a_round_trip_through_the_checkpoint_record():
  _, log, _, _ = run(eval_every=8)
  restored = checkpointing.Progress.from_json(_record(log))
  assert restored.evaluation == log
  assert list(_record(log)) == list(checkpointing.PROGRESS_JSON_KEYS)
  _, log, _, _ = run(eval_every=8, evaluator=TaskILEvaluator())  # Task-IL's keys after them
  assert checkpointing.Progress.from_json(_record(log)).evaluation == log
  assert list(_record(log)) == [*checkpointing.PROGRESS_JSON_KEYS,
                                *checkpointing.TASK_IL_JSON_KEYS]


def test_a_stream_shorter_than_eval_every_warns_and_takes_a_auc_from_the_final_evaluation(
    caplog):
  with caplog.at_level("WARNING"):
    p, log, lines, evaluator = run(eval_every=100)  # the stream has 24 samples
  (warning,) = [r.getMessage() for r in caplog.records]
  assert "24 samples, fewer than eval.eval_every=100" in warning and "\n" not in warning
  # The last step's task-end pass is also the one anytime point: the seen data, all 4 classes.
  assert log.anytime_samples == [24] and log.anytime == pytest.approx([25 / 40])
  assert [(e, s) for e, s, _, _ in lines] == [("task_end", 2), ("eval", 5), ("task_end", 5)]
  assert [kind for kind, _ in evaluator.calls] == ["all", "all"]
  results = p.results([], [], [], {})
  assert results["A_auc"] == pytest.approx(25 / 40)
  assert "final evaluation alone" in results["metric_notes"]["A_auc"]
  # A stream of exactly eval_every samples has its point already; no anytime evaluation at
  # all (GDumb) has no curve to miss: neither warns.
  caplog.clear()
  with caplog.at_level("WARNING"):
    _, exact, _, _ = run(eval_every=24)
    _, none, _, _ = run(eval_every=100, anytime_eval=False)
  assert caplog.records == [] and exact.anytime_samples == [24] and none.anytime == []


@pytest.mark.parametrize("eval_every,anytime_eval", [(8, True), (3, True), (1, False),
                                                     (100, True)])
def test_evaluation_points_plan_the_evaluations_the_protocol_makes(eval_every, anytime_eval):
  _, _, lines, evaluator = run(eval_every, anytime_eval)
  labels = np.concatenate(LABELS)  # STREAM's ids are 0..23 in order
  points = protocol.evaluation_points(STREAM, labels, eval_every, anytime_eval)
  # One point per evaluator pass, at the steps of the run's records, with the same seen classes
  # and the whole test set exactly at the task ends.
  assert [step for step, _, _ in points] == sorted({step for _, step, _, _ in lines})
  assert [("all" if end else "seen", seen.tolist()) for _, seen, end in points] == evaluator.calls
