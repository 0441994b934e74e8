"""Task-free streams: which training examples arrive at each step, in which order.

A `Stream` is fully determined by (labels, scenario parameters, seed). The learner only ever sees
the batches; the task structure (`step_task`, `task_classes`) is for the evaluator alone.
Batches never straddle a task boundary: the last batch of a task may be short and is padded and
masked by the batcher, so task-end evaluations happen exactly at the true boundaries. Every
training example that the scenario uses appears exactly once (one pass).

Scenarios (docs/streams.md), all built from one `numpy.random.default_rng(seed)`:

- `disjoint_class_incremental`: the classes are split into `n_tasks` groups of equal size, in
  label order, a seeded permutation or an explicit order (`data.class_order`, a list of every
  class); each task's examples are shuffled with the seed.
- `si_blurry` (Si-Blurry, Moon et al. 2023, used by the paper's section 5): N% of the classes are
  disjoint (all their samples in one task), the others blurry; each group is cut into `n_tasks`
  parts at random points, so the number of classes per task is random; then M% of the
  blurry-class samples, drawn at random, move to a uniformly drawn *other* task. A task's classes
  (`task_classes`) are the labels its samples actually carry, moved samples included.
- `domain_incremental`: the domains of any source with per-sample domain ids (CORe50's
  sessions, rotated MNIST's rotations, a user dataset's `domains`) arrive one after another in
  ascending id order, each one a task over the classes present in it; `order='shuffled'` (CORe50's
  `reference` fidelity) is the released code's i.i.d. variant: all domains concatenated and
  shuffled into one single task. `Stream.task_domains` records each task's domain, and the
  evaluator measures a_{i,j} on domain i's test data when the test split has those domains
  (`Stream.evaluation_groups`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import ml_collections
import numpy as np

SCENARIOS = ("disjoint", "si_blurry", "domain")
CORE50_ORDERS = ("sequential", "shuffled")
CLASS_ORDERS = ("label", "seeded")  # or an explicit list of every class


@dataclasses.dataclass(frozen=True)
class Stream:
  """A task-free stream: the training example ids of every step, in order (the learner's view),
  and the true task structure (the evaluator's view). Immutable."""

  steps: tuple[np.ndarray, ...]  # example ids of each step's batch, 1 <= len <= batch_size
  step_task: np.ndarray  # (n_steps,) the true task of each step (evaluator only)
  task_classes: tuple[np.ndarray, ...]  # the classes whose samples occur in each task
  # Si-Blurry only (None elsewhere): the disjoint classes, and each class's home task (-1 when
  # the class has no training sample); a blurry sample outside its home task was "moved".
  disjoint_classes: np.ndarray | None = None
  home_task: np.ndarray | None = None
  # Domain streams only (None elsewhere): the domain id of each task, (n_tasks,) int64.
  task_domains: np.ndarray | None = None

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

  def evaluation_groups(self, test_domains: np.ndarray | None) -> EvaluationGroups:
    """Which test examples make up "task i's test data" in a_{i,j} (evaluator only).

    By class (task i = the test examples of `task_classes[i]`), unless this is a domain stream
    whose every task domain occurs in `test_domains` (the test split's (N,) domain ids): then by
    domain (task i = the test examples of domain `task_domains[i]`, all its classes). CORe50's
    test sessions are not training sessions, so it is evaluated by class (its tasks share all
    50 classes)."""
    if self.task_domains is None or test_domains is None:
      return EvaluationGroups(self.task_classes, None)
    if not set(self.task_domains.tolist()) <= set(np.unique(test_domains).tolist()):
      return EvaluationGroups(self.task_classes, None)
    return EvaluationGroups(self.task_classes, self.task_domains)

  def task_of_class(self, num_classes: int) -> np.ndarray | None:
    """(num_classes,) int64: the one task whose samples carry each class (-1 for a class in no
    task), or None when a class occurs in several tasks (Si-Blurry's blurry classes, a domain
    stream's shared classes): an example's task then names no single class set, and Task-IL
    accuracy is not defined (docs/metrics.md)."""
    out = np.full(num_classes, -1, np.int64)
    for task, classes in enumerate(self.task_classes):
      classes = np.asarray(classes, np.int64)
      if np.any(out[classes] >= 0):
        return None
      out[classes] = task
    return out

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


class EvaluationGroups(NamedTuple):
  """The test data of each task i: its classes' test examples, restricted to domain
  `domains[i]` when `domains` is not None (a domain stream with per-domain test sets)."""

  classes: tuple[np.ndarray, ...]  # (T,) arrays of class ids
  domains: np.ndarray | None  # (T,) int64 domain id per task, or None = grouped by class only

  @property
  def by_domain(self) -> bool:
    return self.domains is not None


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


def explicit_class_order(class_order, classes: np.ndarray) -> np.ndarray | None:
  """`data.class_order` as an explicit order: a sequence of ints, or a string of comma-separated
  ints ('3,1,0,2'); None for the named orders 'label' and 'seeded'. It must list every class in
  `classes` exactly once."""
  if isinstance(class_order, str):
    if class_order in CLASS_ORDERS:
      return None
    try:
      class_order = [int(x) for x in class_order.split(",")]
    except ValueError:
      raise ValueError(f"unknown data.class_order={class_order!r}; use 'label', 'seeded' or a"
                       " list of every class id, e.g. '3,1,0,2'") from None
  order = np.asarray(list(class_order))
  if order.ndim != 1 or not np.issubdtype(order.dtype, np.integer):
    raise ValueError(f"data.class_order={class_order!r} must be a list of class ids (ints)")
  if len(order) != len(classes) or set(order.tolist()) != set(np.asarray(classes).tolist()):
    ids, counts = np.unique(order, return_counts=True)
    wanted = set(np.asarray(classes).tolist())
    problems = [f"{name} {sorted(found)}" for name, found in (
        ("repeats", ids[counts > 1].tolist()),
        ("misses", sorted(wanted - set(ids.tolist()))),
        ("names classes outside the dataset", sorted(set(ids.tolist()) - wanted)))
        if found]
    raise ValueError(
        f"data.class_order {'; '.join(problems)} (the dataset has classes"
        f" {int(np.min(classes))}..{int(np.max(classes))}, {len(classes)} of them); list every"
        " class exactly once")
  return order.astype(np.int64)


def disjoint_class_incremental(labels: np.ndarray, n_tasks: int, batch_size: int, seed: int,
                               class_order: str | Sequence[int] = "label",
                               num_classes: int | None = None) -> Stream:
  """Disjoint class-incremental stream over `n_tasks` equal groups of classes.

  The classes are 0..num_classes-1 when `num_classes` is given (a class without training samples
  still belongs to its task), else the labels present. `class_order`: 'label', 'seeded' (a
  permutation drawn from `seed`) or an explicit order listing every class once (task t gets the
  t-th group of that list). Pure: the same arguments give the same stream.
  """
  labels = np.asarray(labels)
  classes = np.unique(labels) if num_classes is None else np.arange(num_classes)
  if n_tasks < 1 or len(classes) % n_tasks:
    raise ValueError(
        f"data.n_tasks={n_tasks} must be >= 1 and divide the {len(classes)} classes evenly")
  _check_batch_size(batch_size)
  rng = np.random.default_rng(seed)
  explicit = explicit_class_order(class_order, classes)
  if explicit is not None:
    classes = explicit
  elif class_order == "seeded":
    classes = rng.permutation(classes)
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

  `labels`, `domains` (N,) ints. `order='shuffled'` (the released code's CORe50 loader)
  concatenates the same domains and shuffles them into one i.i.d. task (then `task_domains` is
  None: the task is no single domain). Examples of domains not in `domain_order` are not used.
  Pure.
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
                task_classes=tuple(np.unique(labels[ids]) for ids in task_ids),
                task_domains=(np.asarray(domain_order, np.int64) if order == "sequential"
                              else None))


def domain_stream_order(data_config: ml_collections.ConfigDict) -> str:
  """`data.core50_order` for CORe50 (the released code shuffles its sessions); every other
  domain stream is sequential."""
  return data_config.core50_order if data_config.dataset == "core50" else "sequential"


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
    domains = getattr(source, "domains", None)
    if domains is None:
      raise ValueError(
          f"data.scenario='domain' needs a dataset with per-sample domain ids (core50,"
          f" rotated_mnist_5k, or a user dataset returning domains), not {c.dataset!r}")
    # Domains in ascending order: CORe50's sessions s1 s2 s4 s5 s6 s8 s9 s11, rotations 0..4.
    return domain_incremental(source.labels, domains, np.unique(domains).tolist(), batch_size,
                              seed, domain_stream_order(c))
  raise ValueError(f"unknown data.scenario={c.scenario!r}; available: {SCENARIOS}")


def iid_order(stream: Stream, batch_size: int, seed: int, epochs: int = 1) -> Stream:
  """The i.i.d. upper bound's order: `epochs` passes over every sample of `stream`, each pass a
  fresh shuffle across tasks (successive permutations of `default_rng([seed, 1])`, so one epoch
  is the order it always was), the passes one after another in full batches of `batch_size`
  (the last may be short).

  Step t counts as task k when its last sample falls in task k's share of the `epochs` passes'
  samples (task k's size times `epochs`), so the task-end evaluations come at the same fractions
  of training as in `stream` and the last one after every epoch; `task_classes` are unchanged.
  """
  _check_batch_size(batch_size)
  if epochs < 1:
    raise ValueError(f"iid.epochs={epochs} must be >= 1")
  ids = np.concatenate(stream.steps)
  rng = np.random.default_rng([seed, 1])
  ids = np.concatenate([ids[rng.permutation(len(ids))] for _ in range(epochs)])
  steps = tuple(ids[i:i + batch_size] for i in range(0, len(ids), batch_size))
  task_ends = epochs * np.cumsum(stream.task_sizes())  # samples seen at each task's end
  last_sample = np.cumsum([len(s) for s in steps]) - 1
  step_task = np.searchsorted(task_ends, last_sample, side="right")
  missing = sorted(set(range(stream.n_tasks)) - set(step_task.tolist()))
  if missing:
    raise ValueError(f"task(s) {missing} hold fewer samples than one batch, so the i.i.d. order"
                     " has no step to evaluate them at; lower learner.batch_size")
  return dataclasses.replace(stream, steps=steps, step_task=step_task)
