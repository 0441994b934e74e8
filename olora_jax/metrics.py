"""Continual-learning metrics as pure functions of the evaluation log (docs/metrics.md).

The evaluation log of a run has three parts, all produced by `olora_jax.evaluate.Evaluator`:

- `acc` (T, T): the accuracy matrix, `acc[i, j]` = a_{i,j}, the accuracy on task i's test data
  after training through task j (0-based here, 1-based in the paper), evaluated at every true
  task end on every task, seen or not.
- per-class counts at each task end: `class_correct` and `class_total` (T, C) integer arrays,
  the number of correctly classified and of all test examples of each class, and `seen` (T, C),
  whether the stream had shown the class by that task end. A class with no test example has
  total 0: its accuracy is undefined (nan) and it is left out of every class-wise mean.
- `anytime` (N,): the sample-weighted accuracy on the test data of the classes seen so far,
  evaluated every `eval_every` samples (the anytime-inference curve).

Accuracies are fractions in [0, 1]; reports print percentages. Undefined metrics (Forgetting
with T = 1, an empty curve) are nan, written as null in results.json.

Plateau telemetry (`plateau_detection`) compares the plateaus the learner detected, without task
information, with the true task boundaries only the evaluator knows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Labels written next to the numbers in results.json, so a reader never has to guess a definition.
DEFINITIONS = {
    "A_final": "A_Final (paper appendix): mean_i a_{i,T}, task-balanced accuracy over all T tasks"
               " after the last task",
    "forgetting": "Forgetting (paper appendix): 1/(T-1) sum_{k<T} max_{t<T} (a_{k,t} - a_{k,T}),"
                  " unclipped; null for T = 1",
    "A_auc": "A_AUC: mean of the anytime accuracies (sample-weighted, test data of the classes"
             " seen so far) evaluated every eval_every samples; equal spacing makes it the"
             " normalised area under the accuracy-vs-samples curve",
    "backward_transfer": "BWT (Lopez-Paz & Ranzato 2017): 1/(T-1) sum_{i<T} (a_{i,T} - a_{i,i});"
                         " negative = forgetting; null for T = 1",
    "A_last": "Si-Blurry A_last: sample-weighted accuracy on all test examples of the classes"
              " seen by the end of the stream",
    "F_last": "Si-Blurry-style class-wise F_last: mean over classes seen and tested at an earlier"
              " task end of max_{t<T, class seen at t} acc_c(t) - acc_c(T), unclipped; null when"
              " no such class exists (e.g. T = 1)",
    "task_balanced_accuracy_final": "mean over the tasks with a seen class of their accuracy"
                                    " after the last task (equals A_final once all are seen)",
    "class_accuracy_final": "per-class accuracy after the last task; null for a class with no"
                            " test example",
    "acc_matrix": "acc_matrix[i][j] = accuracy on task i's test data after training through"
                  " task j (0-based)",
    "plateau_detection": "detected plateaus against the T-1 true task boundaries (the start of"
                         " tasks 1..T-1, in samples). A plateau detects boundary b_j when it is"
                         " the first plateau at or after b_j and before b_{j+1}; latency ="
                         " samples seen at that plateau - b_j. recall = detected boundaries /"
                         " (T-1); precision = detecting plateaus / plateaus after b_1 (plateaus"
                         " within the first task have no boundary to detect and are counted in"
                         " n_plateaus_first_task instead)",
    "accuracies": "fractions in [0, 1]",
}
# Written only by runs that count Task-IL (`protocol.task_il_map`: every class in one task).
DEFINITIONS_TASK_IL = {
    "acc_matrix_task_il": "Task-IL (task-incremental): acc_matrix_task_il[i][j] = accuracy on"
                          " task i's test data after training through task j, each test"
                          " example's logits masked to the classes of its own task before the"
                          " argmax (the task identity given at test time; eval.mask_unseen_logits"
                          " not applied); the same predictions as acc_matrix",
    "A_final_task_il": "Task-IL A_final: mean_i of acc_matrix_task_il[i][T], task-balanced over"
                       " all T tasks after the last task",
    "A_auc_task_il": "Task-IL A_AUC: mean of the anytime Task-IL accuracies"
                     " (anytime_accuracy_task_il: sample-weighted, test data of the classes seen"
                     " so far, each example masked to its task's classes)",
}
TASK_IL_PARTIAL = ("Task-IL metrics left out: the run was resumed from a checkpoint written before"
                   " Task-IL was recorded, so its Task-IL records miss the earlier evaluations;"
                   " rerun it in a new workdir for them")
# Written only by runs evaluated by domain (DEFINITIONS is every run's `metric_notes`).
FORGETTING_PER_DOMAIN = ("per earlier domain k < T (row k of acc_matrix): max_{t<T} (a_{k,t} -"
                         " a_{k,T}), unclipped; its mean is `forgetting`")


def _as_matrix(acc: np.ndarray) -> np.ndarray:
  acc = np.asarray(acc, np.float64)
  if acc.ndim != 2 or acc.shape[0] != acc.shape[1] or acc.shape[0] < 1:
    raise ValueError(f"the accuracy matrix must be square (T, T) with T >= 1, got {acc.shape}")
  return acc


def a_final(acc: np.ndarray) -> float:
  """A_Final = mean_i a_{i,T}: mean accuracy over all tasks after the last one."""
  acc = _as_matrix(acc)
  return float(acc[:, -1].mean())


def forgetting(acc: np.ndarray) -> float:
  """The paper's Forgetting (appendix, eq. 9): 1/(T-1) sum_{k<T} max_{t<T} (a_{k,t} - a_{k,T}).

  Taken literally: the max runs over every t < T (a task not yet learned adds a_{k,t} ~ 0 for
  t < k, which never wins in class-incremental streams) and is not clipped at 0. Undefined for
  T = 1: returns nan (written as null in results.json).
  """
  acc = _as_matrix(acc)
  t = acc.shape[1]
  if t < 2:
    return float("nan")
  drops = acc[: t - 1, : t - 1].max(axis=1) - acc[: t - 1, -1]
  return float(drops.mean())


def forgetting_per_task(acc: np.ndarray) -> np.ndarray:
  """Forgetting of each earlier task k < T: max_{t<T} a_{k,t} - a_{k,T}, (T-1,) unclipped; its
  mean is `forgetting`. For a domain stream evaluated by domain, task k is domain k. Pure."""
  acc = _as_matrix(acc)
  t = acc.shape[1]
  return acc[: t - 1, : t - 1].max(axis=1) - acc[: t - 1, -1] if t > 1 else np.zeros(0)


def backward_transfer(acc: np.ndarray) -> float:
  """BWT = 1/(T-1) sum_{i<T} (a_{i,T} - a_{i,i}): the final accuracy of each earlier task minus
  its accuracy right after it was learned. Negative values mean forgetting; nan for T = 1."""
  acc = _as_matrix(acc)
  t = acc.shape[1]
  if t < 2:
    return float("nan")
  return float(np.mean(acc[: t - 1, -1] - np.diag(acc)[: t - 1]))


def a_auc(anytime_acc: np.ndarray) -> float:
  """A_AUC: mean of the anytime accuracies, evaluated every `eval_every` samples on the test data
  of the classes seen so far. Equal spacing makes this the normalised area under the curve
  (the paper's sum_i f(i dn) dn divided by the number of samples)."""
  anytime_acc = np.asarray(anytime_acc, np.float64)
  if anytime_acc.size == 0:
    return float("nan")
  return float(anytime_acc.mean())


def class_accuracy(class_correct: np.ndarray, class_total: np.ndarray) -> np.ndarray:
  """Per-class accuracy, elementwise over any shape; nan where a class has no test example."""
  correct = np.asarray(class_correct, np.float64)
  total = np.asarray(class_total, np.float64)
  if correct.shape != total.shape:
    raise ValueError(f"class_correct {correct.shape} and class_total {total.shape} differ")
  if np.any(correct > total) or np.any(correct < 0):
    raise ValueError("class_correct must lie in [0, class_total] for every class")
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(total > 0, correct / np.maximum(total, 1), np.nan)


def sample_weighted_accuracy(class_correct: np.ndarray, class_total: np.ndarray,
                             classes: np.ndarray | None = None) -> float:
  """Accuracy over every test example of `classes` (all classes when None): each example counts
  once, so frequent classes weigh more. nan when those classes have no test example."""
  correct = np.asarray(class_correct, np.int64)
  total = np.asarray(class_total, np.int64)
  if classes is not None:
    correct, total = correct[np.asarray(classes, np.int64)], total[np.asarray(classes, np.int64)]
  n = int(total.sum())
  return float(correct.sum() / n) if n else float("nan")


def task_accuracies(class_correct: np.ndarray, class_total: np.ndarray,
                    task_classes: Sequence[np.ndarray]) -> np.ndarray:
  """Accuracy on each task's test data (sample-weighted within the task): a column a_{:, j}."""
  return np.array([sample_weighted_accuracy(class_correct, class_total, cls)
                   for cls in task_classes])


def task_balanced_accuracy(task_acc: np.ndarray, seen_tasks: np.ndarray | None = None) -> float:
  """Mean of the task accuracies over `seen_tasks` (a boolean mask; all tasks when None), each
  task weighing the same whatever its size; tasks without test data (nan) are skipped."""
  task_acc = np.asarray(task_acc, np.float64)
  if seen_tasks is not None:
    task_acc = task_acc[np.asarray(seen_tasks, bool)]
  task_acc = task_acc[np.isfinite(task_acc)]
  return float(task_acc.mean()) if task_acc.size else float("nan")


def a_last(class_correct: np.ndarray, class_total: np.ndarray, seen: np.ndarray) -> float:
  """Si-Blurry's A_last: sample-weighted accuracy on the test data of every class seen by the
  end of the stream. Arguments are the last task end's (C,) counts and seen mask."""
  seen = np.asarray(seen, bool)
  return sample_weighted_accuracy(class_correct, class_total, np.flatnonzero(seen))


def f_last(class_correct: np.ndarray, class_total: np.ndarray, seen: np.ndarray) -> float:
  """Class-wise F_last (Si-Blurry reports forgetting per class, since its tasks share classes).

  Arguments are (T, C): counts and seen mask at each task end. For each class c that was seen
  and tested at some task end t < T, F_c = max_{t<T, c seen at t} acc_c(t) - acc_c(T); F_last is
  the mean of F_c over those classes (unclipped). Classes never tested are left out; nan when no
  class qualifies (T = 1, or nothing seen before the last task).
  """
  acc = class_accuracy(class_correct, class_total)
  seen = np.asarray(seen, bool)
  if acc.ndim != 2 or seen.shape != acc.shape:
    raise ValueError(f"counts and seen must be (T, C) of one shape, got {acc.shape}, {seen.shape}")
  if acc.shape[0] < 2:
    return float("nan")
  earlier = np.where(seen[:-1] & np.isfinite(acc[:-1]), acc[:-1], -np.inf)  # (T-1, C)
  best = earlier.max(axis=0)
  valid = np.isfinite(best) & np.isfinite(acc[-1])
  if not valid.any():
    return float("nan")
  return float(np.mean(best[valid] - acc[-1][valid]))


def plateau_detection(plateau_samples: Sequence[int], task_end_samples: Sequence[int]) -> dict:
  """Plateaus (found by the learner without task information) against the true task boundaries.

  `plateau_samples`: samples seen when each plateau fired (ascending). `task_end_samples`: samples
  seen at the last step of each task; task j+1 starts right after `task_end_samples[j]`, so the
  T-1 boundaries are b_j = task_end_samples[j-1] for j = 1..T-1.

  A plateau detects boundary b_j when it is the first plateau with b_j < samples <= b_{j+1}
  (i.e. fired during task j); its latency is samples - b_j (a plateau at the first step of the
  new task has a latency of one batch). recall = detected / (T-1); precision = detecting plateaus
  / plateaus after b_1 (the first task has no boundary before it: its plateaus are reported as
  `n_plateaus_first_task`). Both are nan when their denominator is 0.

  Returns a dict (results.json's `plateau_detection`): n_boundaries, n_plateaus,
  n_plateaus_first_task, n_detected, precision, recall, latency_samples (per boundary, None =
  missed), mean_latency_samples, boundary_samples, plateau_samples and plateaus_per_task.
  """
  plateaus = np.asarray(plateau_samples, np.int64)
  ends = np.asarray(task_end_samples, np.int64)
  if ends.ndim != 1 or ends.size < 1 or np.any(np.diff(ends) <= 0):
    raise ValueError(f"task_end_samples must be a strictly increasing list, got {ends.tolist()}")
  if plateaus.size and np.any(np.diff(plateaus) < 0):
    raise ValueError("plateau_samples must be in ascending order")
  boundaries = ends[:-1]  # b_1..b_{T-1}
  upper = ends[1:]  # task j ends at upper[j-1]
  latencies, detected = [], 0
  for b, u in zip(boundaries, upper, strict=True):
    inside = plateaus[(plateaus > b) & (plateaus <= u)]
    if inside.size:
      detected += 1
      latencies.append(int(inside[0] - b))
    else:
      latencies.append(None)
  n_first = int(np.sum(plateaus <= ends[0]))
  n_later = int(plateaus.size - n_first)
  found = [x for x in latencies if x is not None]
  nan = float("nan")
  return {
      "n_boundaries": int(boundaries.size),
      "n_plateaus": int(plateaus.size),
      "n_plateaus_first_task": n_first,
      "n_detected": detected,
      "precision": detected / n_later if n_later else nan,
      "recall": detected / boundaries.size if boundaries.size else nan,
      "latency_samples": latencies,  # per boundary; null = missed
      "mean_latency_samples": float(np.mean(found)) if found else nan,
      "boundary_samples": boundaries.tolist(),
      "plateau_samples": plateaus.tolist(),
      "plateaus_per_task": np.histogram(
          plateaus, bins=np.concatenate([[0], ends]) + 0.5)[0].astype(int).tolist(),
  }
