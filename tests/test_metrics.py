"""Tests of `olora_jax.metrics` on hand-computed toy evaluation logs (docs/metrics.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from olora_jax import metrics

# a_{i,j}: task i after training through task j. Task 1 is tested before it is seen (column 0,
# 0.2: unmasked chance), and improves after task 1 on task 0 (0.9 -> 0.5 -> 0.4).
ACC = np.array([[0.9, 0.5, 0.4],
                [0.2, 0.8, 0.6],
                [0.0, 0.1, 0.7]])


def test_a_final_forgetting_bwt_by_hand():
  assert metrics.a_final(ACC) == pytest.approx((0.4 + 0.6 + 0.7) / 3)
  # k=0: max(0.9, 0.5) - 0.4 = 0.5; k=1: max(0.2, 0.8) - 0.6 = 0.2.
  assert metrics.forgetting(ACC) == pytest.approx((0.5 + 0.2) / 2)
  # (a_{0,2} - a_{0,0}) + (a_{1,2} - a_{1,1}) = -0.5 - 0.2.
  assert metrics.backward_transfer(ACC) == pytest.approx((-0.5 - 0.2) / 2)


def test_forgetting_is_literal_over_unseen_columns_and_unclipped():
  # Task 1 scored 0.5 before it was ever seen (t=0) and 0.3 after learning it (t=1): the paper's
  # max over every t < T counts the unseen column, so F_1 = 0.5 - 0.45.
  acc = np.array([[0.6, 0.6, 0.9],  # task 0 only improves: F_0 = 0.6 - 0.9 = -0.3 (unclipped)
                  [0.5, 0.3, 0.45],
                  [0.0, 0.0, 0.8]])
  assert metrics.forgetting(acc) == pytest.approx((-0.3 + 0.05) / 2)


def test_single_task_t1():
  acc = np.array([[0.75]])
  assert metrics.a_final(acc) == 0.75
  assert math.isnan(metrics.forgetting(acc))
  assert math.isnan(metrics.backward_transfer(acc))
  correct, total, seen = np.array([[3, 1]]), np.array([[4, 2]]), np.array([[True, True]])
  assert math.isnan(metrics.f_last(correct, total, seen))
  assert metrics.a_last(correct[-1], total[-1], seen[-1]) == pytest.approx(4 / 6)


def test_a_auc_is_the_mean_of_equally_spaced_anytime_accuracies():
  anytime = np.array([0.9, 0.6, 0.55, 0.7, 0.4])
  assert metrics.a_auc(anytime) == pytest.approx(anytime.mean())
  # The paper's sum_i f(i dn) dn over n * dn samples (dn = eval_every) is the same number.
  dn = 1000
  assert metrics.a_auc(anytime) == pytest.approx(np.sum(anytime * dn) / (len(anytime) * dn))
  assert math.isnan(metrics.a_auc(np.array([])))


def test_class_accuracy_with_a_class_never_tested():
  correct, total = np.array([3, 0, 0, 5]), np.array([4, 0, 2, 5])
  acc = metrics.class_accuracy(correct, total)
  np.testing.assert_allclose(acc[[0, 2, 3]], [0.75, 0.0, 1.0])
  assert math.isnan(acc[1])  # never tested: undefined, not 0
  assert metrics.sample_weighted_accuracy(correct, total) == pytest.approx(8 / 11)
  assert math.isnan(metrics.sample_weighted_accuracy(correct, total, [1]))
  # A task whose only class has no test data has no accuracy, and task-balanced skips it.
  tasks = [np.array([0, 1]), np.array([2, 3]), np.array([1])]
  task_acc = metrics.task_accuracies(correct, total, tasks)
  np.testing.assert_allclose(task_acc[:2], [3 / 4, 5 / 7])
  assert math.isnan(task_acc[2])
  assert metrics.task_balanced_accuracy(task_acc) == pytest.approx((3 / 4 + 5 / 7) / 2)


def test_sample_weighted_and_task_balanced_differ_on_unequal_tasks():
  # Task 0: class 0 with 90 test examples, all right; task 1: class 1 with 10, none right.
  correct, total = np.array([90, 0]), np.array([90, 10])
  task_acc = metrics.task_accuracies(correct, total, [np.array([0]), np.array([1])])
  assert metrics.sample_weighted_accuracy(correct, total) == pytest.approx(0.9)
  assert metrics.task_balanced_accuracy(task_acc) == pytest.approx(0.5)
  # A task not yet seen is left out of the task-balanced mean when a seen mask is given.
  assert metrics.task_balanced_accuracy(task_acc, [True, False]) == pytest.approx(1.0)


def test_a_last_and_f_last_by_hand():
  # 3 task ends, 4 classes; class 3 is never tested (total 0); class 2 arrives in the last task.
  correct = np.array([[8, 0, 0, 0],
                      [5, 9, 0, 0],
                      [4, 6, 7, 0]])
  total = np.array([[10, 10, 10, 0]] * 3)
  seen = np.array([[1, 0, 0, 1],
                   [1, 1, 0, 1],
                   [1, 1, 1, 1]], bool)
  # Seen by the end: classes 0-3; tested examples 30; correct 4 + 6 + 7.
  assert metrics.a_last(correct[-1], total[-1], seen[-1]) == pytest.approx(17 / 30)
  # Class 0: max(0.8, 0.5) - 0.4 = 0.4; class 1: 0.9 - 0.6 = 0.3 (its t=0 accuracy, before it
  # was seen, is ignored); class 2: not seen before the end; class 3: never tested.
  assert metrics.f_last(correct, total, seen) == pytest.approx((0.4 + 0.3) / 2)


def test_plateau_detection_by_hand():
  # Task ends at 100, 200, 300, 400 samples: boundaries b = 100, 200, 300.
  out = metrics.plateau_detection([50, 130, 150, 260, 390], [100, 200, 300, 400])
  assert out["n_boundaries"] == 3 and out["n_plateaus"] == 5
  assert out["n_plateaus_first_task"] == 1
  assert out["latency_samples"] == [30, 60, 90]
  assert out["recall"] == 1.0
  assert out["precision"] == pytest.approx(3 / 4)  # 150 is a second plateau in task 1
  assert out["mean_latency_samples"] == pytest.approx(60.0)
  assert out["plateaus_per_task"] == [1, 2, 1, 1]


def test_plateau_detection_misses_and_edges():
  # A plateau at the very last sample of task 0 belongs to task 0, not to boundary 100.
  out = metrics.plateau_detection([100, 280], [100, 200, 300])
  assert out["latency_samples"] == [None, 80]
  assert out["recall"] == 0.5 and out["precision"] == 1.0
  assert out["plateaus_per_task"] == [1, 0, 1]
  none = metrics.plateau_detection([], [100, 200])
  assert none["recall"] == 0.0 and math.isnan(none["precision"])
  assert math.isnan(none["mean_latency_samples"])
  single = metrics.plateau_detection([40], [100])  # T = 1: no boundary to detect
  assert single["n_boundaries"] == 0 and single["n_plateaus_first_task"] == 1
  assert math.isnan(single["recall"]) and math.isnan(single["precision"])


def test_bad_inputs_are_one_line_errors():
  with pytest.raises(ValueError, match="square"):
    metrics.a_final(np.zeros((2, 3)))
  with pytest.raises(ValueError, match="class_correct must lie"):
    metrics.class_accuracy(np.array([3]), np.array([2]))
  with pytest.raises(ValueError, match="strictly increasing"):
    metrics.plateau_detection([1], [100, 100])
  with pytest.raises(ValueError, match="ascending"):
    metrics.plateau_detection([50, 10], [100])


def test_every_results_metric_has_a_definition():
  for key in ("A_final", "forgetting", "A_auc", "backward_transfer", "A_last", "F_last",
              "plateau_detection", "acc_matrix"):
    assert metrics.DEFINITIONS[key]
