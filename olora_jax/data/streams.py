"""Task-free streams: which training examples arrive at each step, in which order.

A `Stream` is fully determined by (labels, scenario parameters, seed). The learner only ever sees
the batches; the task structure (`step_task`, `task_classes`) is for the evaluator alone.
Batches never straddle a task boundary: the last batch of a task may be short and is padded and
masked by the batcher, so task-end evaluations happen exactly at the true boundaries. Every
training example that the scenario uses appears exactly once (one pass).

Scenarios (DESIGN.md section 3), all built from one `numpy.random.default_rng(seed)`:

- `disjoint_class_incremental`: the classes are split into `n_tasks` groups of equal size, in
  label order or a seeded permutation; each task's examples are shuffled with the seed.
- `si_blurry` (Si-Blurry, Moon et al. 2023, used by the paper's section 5): N% of the classes are
  disjoint (all their samples in one task), the others blurry; each group is cut into `n_tasks`
  parts at random points, so the number of classes per task is random; then M% of the
  blurry-class samples, drawn at random, move to a uniformly drawn *other* task. A task's classes
  (`task_classes`) are the labels its samples actually carry, moved samples included.
- `domain_incremental` (CORe50): the domains (sessions) arrive one after another in the given
  order, each one a task over the same classes; `order='shuffled'` is the released code's i.i.d.
  variant: all sessions concatenated and shuffled into one single task.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import ml_collections
import numpy as np

SCENARIOS = ("disjoint", "si_blurry", "domain")
CORE50_ORDERS = ("sequential", "shuffled")


@dataclasses.dataclass(frozen=True)
class Stream:
  steps: tuple[np.ndarray, ...]  # example ids of each step's batch, 1 <= len <= batch_size
  step_task: np.ndarray  # (n_steps,) the true task of each step (evaluator only)
  task_classes: tuple[np.ndarray, ...]  # the classes whose samples occur in each task
  # Si-Blurry only (None elsewhere): the disjoint classes, and each class's home task (-1 when
  # the class has no training sample); a blurry sample outside its home task was "moved".
  disjoint_classes: np.ndarray | None = None
  home_task: np.ndarray | None = None

  @property
  def n_tasks(self) -> int:
    return len(self.task_classes)

  @property
  def n_samples(self) -> int:
    return sum(len(s) for s in self.steps)

  def task_end_steps(self) -> np.ndarray:
    """Index of the last step of each task."""
    return np.array([np.flatnonzero(self.step_task == t)[-1] for t in range(self.n_tasks)])

  def task_sizes(self) -> np.ndarray:
    """Number of training samples in each task."""
    sizes = np.zeros(self.n_tasks, np.int64)
    for ids, task in zip(self.steps, self.step_task, strict=True):
      sizes[task] += len(ids)
    return sizes

  def sha256(self) -> str:
    """Content hash of the step order and the task structure (identical streams, identical hash)."""
    h = hashlib.sha256()
    for ids, task in zip(self.steps, self.step_task, strict=True):
      h.update(np.asarray([task, len(ids)], np.int64).tobytes())
      h.update(np.asarray(ids, np.int64).tobytes())
    for classes in self.task_classes:
      h.update(np.asarray(classes, np.int64).tobytes() + b"|")
    for extra in (self.disjoint_classes, self.home_task):
      if extra is not None:
        h.update(b"#" + np.asarray(extra, np.int64).tobytes())
    return h.hexdigest()


def _check_batch_size(batch_size: int) -> None:
  if batch_size < 1:
    raise ValueError(f"learner.batch_size={batch_size} must be >= 1")


def _batch_tasks(task_ids: Sequence[np.ndarray], batch_size: int,
                 rng: np.random.Generator) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
  """Shuffles each task's example ids with `rng` and cuts them into batches, task after task."""
  steps, step_task = [], []
  for t, ids in enumerate(task_ids):
    if len(ids) == 0:
      raise ValueError(f"task {t} has no training examples; use fewer tasks or more data")
    ids = rng.permutation(ids)
    for start in range(0, len(ids), batch_size):
      steps.append(ids[start:start + batch_size])
      step_task.append(t)
  return tuple(steps), np.asarray(step_task, np.int64)


def disjoint_class_incremental(labels: np.ndarray, n_tasks: int, batch_size: int, seed: int,
                               class_order: str = "label",
                               num_classes: int | None = None) -> Stream:
  """Disjoint class-incremental stream over `n_tasks` equal groups of classes.

  The classes are 0..num_classes-1 when `num_classes` is given (a class without training samples
  still belongs to its task), else the labels present.
  """
  labels = np.asarray(labels)
  classes = np.unique(labels) if num_classes is None else np.arange(num_classes)
  if n_tasks < 1 or len(classes) % n_tasks:
    raise ValueError(
        f"data.n_tasks={n_tasks} must be >= 1 and divide the {len(classes)} classes evenly")
  _check_batch_size(batch_size)
  rng = np.random.default_rng(seed)
  if class_order == "seeded":
    classes = rng.permutation(classes)
  elif class_order != "label":
    raise ValueError(f"unknown data.class_order={class_order!r}; use 'label' or 'seeded'")
  task_classes = tuple(np.sort(c) for c in np.split(classes, n_tasks))
  task_ids = [np.flatnonzero(np.isin(labels, cls)) for cls in task_classes]
  steps, step_task = _batch_tasks(task_ids, batch_size, rng)
  return Stream(steps=steps, step_task=step_task, task_classes=task_classes)


def si_blurry(labels: np.ndarray, n_tasks: int, disjoint_percent: float, blurry_percent: float,
              batch_size: int, seed: int, num_classes: int | None = None) -> Stream:
  """Si-Blurry stream: N = `disjoint_percent` % disjoint classes, M = `blurry_percent` % of the
  blurry-class samples moved to other tasks, a random number of classes per task."""
  labels = np.asarray(labels)
  if n_tasks < 2:
    raise ValueError(f"data.n_tasks={n_tasks} must be >= 2 for Si-Blurry")
  for key, value in (("si_blurry_n", disjoint_percent), ("si_blurry_m", blurry_percent)):
    if not 0.0 <= value <= 100.0:
      raise ValueError(f"data.{key}={value} is a percentage; give a value in [0, 100]")
  _check_batch_size(batch_size)
  num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
  rng = np.random.default_rng(seed)
  classes = rng.permutation(np.unique(labels))  # only classes with samples can be placed
  n_disjoint = int(round(disjoint_percent / 100.0 * len(classes)))
  disjoint, blurry = classes[:n_disjoint], classes[n_disjoint:]
  home_task = np.full(num_classes, -1, np.int64)
  for kind, group in (("disjoint", disjoint), ("blurry", blurry)):
    if len(group) == 0:
      continue
    if len(group) < n_tasks:
      raise ValueError(
          f"Si-Blurry has {len(group)} {kind} classes for data.n_tasks={n_tasks} tasks; every"
          " task needs one: lower data.n_tasks or change data.si_blurry_n")
    # n_tasks - 1 distinct random cut points: every task gets >= 1 class of this kind.
    cuts = np.sort(rng.choice(np.arange(1, len(group)), n_tasks - 1, replace=False))
    for t, part in enumerate(np.split(group, cuts)):
      home_task[part] = t
  example_task = home_task[labels]
  blurry_ids = np.flatnonzero(np.isin(labels, blurry))
  n_moved = int(round(blurry_percent / 100.0 * len(blurry_ids)))
  moved = rng.choice(blurry_ids, n_moved, replace=False)
  example_task[moved] = (example_task[moved] + rng.integers(1, n_tasks, n_moved)) % n_tasks
  task_ids = [np.flatnonzero(example_task == t) for t in range(n_tasks)]
  steps, step_task = _batch_tasks(task_ids, batch_size, rng)
  return Stream(steps=steps, step_task=step_task,
                task_classes=tuple(np.unique(labels[ids]) for ids in task_ids),
                disjoint_classes=np.sort(disjoint), home_task=home_task)


def domain_incremental(labels: np.ndarray, domains: np.ndarray, domain_order: Sequence[int],
                       batch_size: int, seed: int, order: str = "sequential") -> Stream:
  """Domain-incremental stream: one task per domain of `domain_order`, in that order.

  `order='shuffled'` (the released code's CORe50 loader) concatenates the same domains and
  shuffles them into one i.i.d. task. Examples of domains not in `domain_order` are not used.
  """
  labels, domains = np.asarray(labels), np.asarray(domains)
  if labels.shape != domains.shape:
    raise ValueError(f"labels {labels.shape} and domains {domains.shape} must align")
  _check_batch_size(batch_size)
  missing = sorted(set(domain_order) - set(np.unique(domains).tolist()))
  if missing:
    raise ValueError(f"domains {missing} have no training examples; check the dataset")
  rng = np.random.default_rng(seed)
  task_ids = [np.flatnonzero(domains == d) for d in domain_order]
  if order == "shuffled":
    task_ids = [np.concatenate(task_ids)]
  elif order != "sequential":
    raise ValueError(f"unknown data.core50_order={order!r}; use one of {CORE50_ORDERS}")
  steps, step_task = _batch_tasks(task_ids, batch_size, rng)
  return Stream(steps=steps, step_task=step_task,
                task_classes=tuple(np.unique(labels[ids]) for ids in task_ids))


def build_stream(data_config: ml_collections.ConfigDict, source, batch_size: int,
                 seed: int) -> Stream:
  """The stream of `data_config.scenario` over the training `source` (labels and metadata)."""
  c = data_config
  if c.scenario == "disjoint":
    return disjoint_class_incremental(source.labels, c.n_tasks, batch_size, seed, c.class_order,
                                      num_classes=source.num_classes)
  if c.scenario == "si_blurry":
    return si_blurry(source.labels, c.n_tasks, c.si_blurry_n, c.si_blurry_m, batch_size, seed,
                     num_classes=source.num_classes)
  if c.scenario == "domain":
    domains = getattr(source, "metadata", {}).get("session")
    if domains is None:
      raise ValueError(
          f"data.scenario='domain' needs a dataset with sessions (core50), not {c.dataset!r}")
    # Sessions in ascending order: CORe50's s1 s2 s4 s5 s6 s8 s9 s11.
    return domain_incremental(source.labels, domains, np.unique(domains).tolist(), batch_size,
                              seed, c.core50_order)
  raise ValueError(f"unknown data.scenario={c.scenario!r}; available: {SCENARIOS}")


def iid_order(stream: Stream, batch_size: int, seed: int) -> Stream:
  """The i.i.d. upper bound's order: every sample of `stream` once, shuffled across tasks with
  `default_rng([seed, 1])`, in full batches of `batch_size` (the last may be short).

  Step t counts as task k when its last sample falls in task k's share of the samples (task k
  keeps its original size), so task-end evaluations happen after as many samples as in `stream`;
  `task_classes` are unchanged.
  """
  _check_batch_size(batch_size)
  ids = np.concatenate(stream.steps)
  ids = ids[np.random.default_rng([seed, 1]).permutation(len(ids))]
  steps = tuple(ids[i:i + batch_size] for i in range(0, len(ids), batch_size))
  task_ends = np.cumsum(stream.task_sizes())  # samples seen at each task's end
  last_sample = np.cumsum([len(s) for s in steps]) - 1
  step_task = np.searchsorted(task_ends, last_sample, side="right")
  missing = sorted(set(range(stream.n_tasks)) - set(step_task.tolist()))
  if missing:
    raise ValueError(f"task(s) {missing} hold fewer samples than one batch, so the i.i.d. order"
                     " has no step to evaluate them at; lower learner.batch_size")
  return dataclasses.replace(stream, steps=steps, step_task=step_task)
