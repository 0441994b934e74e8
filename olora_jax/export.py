"""Task-end exports (`eval.export`): what the model predicts and what the method has trained at
each true task end and at the stream's end, so a run can be checked against another codebase
(docs/replay.md) without running the stream again cut at each task end.

WORKDIR/export/ holds one file per point, written as the point is reached:

    task_<j>.npz   the end of task j: the state the task-end evaluation reads (before a boundary
                   hook changes it, `boundaries.rule`), the same model as column j of the
                   accuracy matrix
    final.npz      the stream's end: the state the final checkpoint holds

Each file holds (N test examples, C classes, in the test source's order):

    record_ids     (N,) int64    each test example's record id (`Source.record_ids`: its row in
                                 the dataset's split; the stream manifest's test ids)
    labels         (N,) int64    their labels
    logits         (N, C) float32  eval.export='logits': the model's raw logits (no class mask)
    top_k_classes  (N, k) int64    eval.export='top_k' (k = eval.export_top_k): the k classes the
    top_k_logits   (N, k) float32  evaluator ranks first, highest first (ties: the lower class),
                                   among the seen classes with eval.mask_unseen_logits, and
                                   their logits
    seen_classes   (S,) int64    the classes the stream had shown by then (the class mask of
                                 eval.mask_unseen_logits)
    step, samples_seen, task  ()  int64  the stream step, samples seen, and the task that ended
                                 (-1 in final.npz)
    params/<path>  the method's trainable parameters (`trainable_params`: LoRA and head,
                   prompts, the whole ViT, ... whatever the method trains) in the model the
                   logits are of, one array per leaf, named by its path in the method's tree
                   ('/'-joined, as in trace.npz)

Each file is written whole or not at all (a temporary file, then a rename; one left by a killed
run is removed when the run starts again), before the checkpoint of its step: a resumed run finds
the files of the points before the checkpoint it resumes from and writes the later ones again,
with the same values (bit for bit on a CPU). The export reads the state and never changes it: a
run's results are the same with it on or off.
"""

from __future__ import annotations

import contextlib
import glob
import os
import zipfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from olora_jax import sharding
from olora_jax.data import manifest as manifest_lib

DIRECTORY = "export"
MODES = ("none", "logits", "top_k")
FINAL = "final.npz"


def task_file(task: int) -> str:
  return f"task_{task}.npz"


def check_config(mode: str, top_k: int, num_classes: int) -> None:
  """eval.export and eval.export_top_k, before any compute (ValueError: exit 2)."""
  if mode not in MODES:
    raise ValueError(f"eval.export={mode!r} is not one of {MODES}; 'logits' writes every test"
                     " example's logits at each task end, 'top_k' its eval.export_top_k best"
                     " classes")
  if mode == "top_k" and not 1 <= top_k <= num_classes:
    raise ValueError(f"eval.export_top_k={top_k} must be in 1..{num_classes} (the classes of"
                     " the benchmark)")


# State entries that are never what a method fits: the frozen backbone, the step, the PRNG key.
_NOT_FITTED = ("frozen", "pretrained", "step", "key")


def trainable_params(method, state: Any) -> Any:
  """What `method` trains, from the state the evaluator reads (its `eval_state(state)` when it
  has one: GDumb's model trained from the buffer, SLDA's and RanPAC's fitted heads): its
  `trainable(state)` when it declares one, else the `params` entry of the baselines' common state
  (olora_jax/methods/common.py), else (a method that fits statistics, no weights by gradient)
  every entry but the frozen backbone, the step and the PRNG key."""
  if method.trainable is not None:
    return method.trainable(state)
  if isinstance(state, dict) and "params" in state:
    return state["params"]
  if isinstance(state, dict):
    return {k: v for k, v in state.items() if k not in _NOT_FITTED}
  raise ValueError(f"method={method.name!r}: its state is a {type(state).__name__}, not a dict;"
                   " give its Method a trainable(state) for eval.export")


def _flatten(tree: Any, prefix: str) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {prefix + "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path):
          np.asarray(v) for path, v in leaves}


def _write(path: str, arrays: dict[str, np.ndarray]) -> None:
  """`arrays` as the .npz at `path` (what `np.savez` writes, read by `np.load`), whole or not at
  all. Each member carries a fixed date, so the same arrays make the same bytes: a resumed run's
  files equal an uninterrupted run's."""
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
      for name, array in arrays.items():
        with z.open(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE), "w",
                    force_zip64=True) as member:
          np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # zip's earliest date


def remove_partial_files(directory: str) -> None:
  """Removes the temporary files of writes cut short (`_write`'s `<file>.<pid>.tmp`, left by a
  SIGKILL or a second signal): the run that starts writes the files it reaches again."""
  for path in glob.glob(os.path.join(glob.escape(directory), "*.npz.*.tmp")):
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


class NullExport:
  """eval.export='none': nothing is computed or written."""

  def at_step(self, step: int, samples_seen: int, state: Any) -> None:
    pass

  def at_end(self, step: int, samples_seen: int, state: Any) -> None:
    pass


class Export:
  """Writes WORKDIR/export/ (module docstring). `evaluator` gives the logits
  (`Evaluator.logits`), `seen_classes()` the classes seen so far, `task_ends` {step: task}, and
  `view(state, step)` the state the evaluator reads after stream step `step` (a method's
  `eval_state`, checked: `run_control.evaluated_state`; or the state)."""

  def __init__(self, workdir: str, mode: str, top_k: int, method, evaluator,
               record_ids: np.ndarray, labels: np.ndarray, task_ends: dict[int, int],
               seen_classes: Callable[[], list], view: Callable[[Any], Any]):
    self.directory = os.path.join(workdir, DIRECTORY)
    self.mode, self.top_k, self.method, self.evaluator = mode, top_k, method, evaluator
    self.record_ids = np.asarray(record_ids, np.int64)
    self.labels = np.asarray(labels, np.int64)
    self.task_ends, self.seen_classes, self.view = task_ends, seen_classes, view
    self.primary = sharding.is_primary()
    if self.primary:  # under the workdir's lock: no other run writes here
      remove_partial_files(self.directory)

  def at_step(self, step: int, samples_seen: int, state: Any) -> None:
    """After the evaluations of stream step `step`: the task-end file when a task ended."""
    if step in self.task_ends:
      task = self.task_ends[step]
      self._export(task_file(task), step, samples_seen, task, state)

  def at_end(self, step: int, samples_seen: int, state: Any) -> None:
    """After the last step (`step`), on the state the final checkpoint holds."""
    self._export(FINAL, step, samples_seen, -1, state)

  def _export(self, name: str, step: int, samples_seen: int, task: int, state: Any) -> None:
    seen = np.asarray(self.seen_classes(), np.int64)
    # Every process computes (the predictions are sharded over them); process 0 writes.
    evaluated = self.view(state, step)  # the model the predictions are of: its parameters too
    logits = self.evaluator.logits(evaluated, np.arange(len(self.labels)))
    params = _flatten(sharding.to_host(trainable_params(self.method, evaluated)), "params/")
    if not self.primary:
      return
    arrays = {"record_ids": self.record_ids, "labels": self.labels, "seen_classes": seen,
              "step": np.int64(step), "samples_seen": np.int64(samples_seen),
              "task": np.int64(task)}
    if self.mode == "logits":
      arrays["logits"] = logits
    else:
      ranked = np.where(self.evaluator.class_mask(seen)[None, :], logits, -np.inf)
      order = np.argsort(-ranked, axis=1, kind="stable")[:, :self.top_k]
      arrays["top_k_classes"] = order.astype(np.int64)
      arrays["top_k_logits"] = np.take_along_axis(logits, order, axis=1)
    os.makedirs(self.directory, exist_ok=True)
    _write(os.path.join(self.directory, name), {**arrays, **params})


def make_export(config, workdir: str, method, evaluator, test_source, stream,
                seen_classes: Callable[[], list],
                eval_state: Callable[[Any, int], Any] | None = None) -> Export | NullExport:
  """The run's export (eval.export), or a `NullExport` when off. `eval_state(state, step)`: the
  state the evaluator reads (the protocol's); None: the state itself."""
  if config.eval.export == "none":
    return NullExport()
  record_ids = manifest_lib.record_ids(test_source)
  ends = stream.task_end_steps().tolist()
  task_ends = {int(step): int(stream.step_task[step]) for step in ends}
  view = eval_state if eval_state is not None else (lambda state, step: state)
  return Export(workdir, config.eval.export, config.eval.export_top_k, method, evaluator,
                record_ids, test_source.labels, task_ends, seen_classes, view)

