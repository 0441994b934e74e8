"""The worked accuracy matrix of docs/metrics.md: Forgetting as results.json computes it
(`olora_jax.metrics`, the Online-LoRA paper's eq. 9 read literally) beside Mammoth's convention,
every number computed at build time from the matrix the page declares. Pure (numpy only), so the
tests import it without Sphinx; the `forgetting-example` directive of olora_docs.py renders it.

Mammoth's convention (aimagelab/mammoth, `utils/metrics.py`, the DER++ authors' library, read
and restated here, nothing copied): the accuracies logged after each task end hold only the
tasks seen so far, padded with zeros to T columns; each earlier task's forgetting is the max of
its accuracies over every task end, the last one included, minus its accuracy after the last.
"""

from __future__ import annotations

import numpy as np

from olora_jax import metrics


def parse_matrix(lines: list[str]) -> np.ndarray:
  """The directive's content: one row a line, a_{i,0} .. a_{i,T-1} as fractions in [0, 1]
  separated by spaces (row i = task i's test data, column j = after task j). A ValueError names
  the line and what is wrong with it."""
  rows = []
  for n, line in enumerate((x for x in lines if x.strip()), start=1):
    try:
      rows.append([float(cell) for cell in line.split()])
    except ValueError:
      raise ValueError(f"row {n} ({line.strip()!r}) is not numbers separated by spaces") from None
  if not rows or any(len(r) != len(rows) for r in rows):
    raise ValueError(f"the matrix must be square with T >= 2 rows of T numbers, got rows of"
                     f" {[len(r) for r in rows]}")
  acc = np.array(rows, np.float64)
  if len(rows) < 2 or not np.all((acc >= 0) & (acc <= 1)):
    raise ValueError("the matrix needs T >= 2 and every accuracy a fraction in [0, 1]")
  return acc


def mammoth_forgetting_per_task(acc: np.ndarray) -> np.ndarray:
  """Mammoth's term of each earlier task k < T-1: its task ends before it was learnt counted as
  0, the max over every task end (the last included) minus a_{k,T-1}; never negative. (T-1,)."""
  acc = np.asarray(acc, np.float64)
  t = acc.shape[1]
  logged = np.where(np.arange(t)[None, :] >= np.arange(t)[:, None], acc, 0.0)
  return logged[: t - 1].max(axis=1) - acc[: t - 1, -1]


def pct(x: float) -> str:
  """A fraction as the reports print it: percent, two decimals (-0.00 written 0.00)."""
  return f"{100 * x + 0.0:.2f}"


def matrix_rows(acc: np.ndarray) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the matrix in %: one row per task, one column per task end."""
  t = acc.shape[0]
  return ([r"a_{i,j} (%)", *(f"after task {j}" for j in range(t))],
          [[f"task {i}", *(pct(v) for v in acc[i])] for i in range(t)])


def forgetting_rows(acc: np.ndarray) -> tuple[list[str], list[list[str]]]:
  """(header, rows): per earlier task, its best task end before the last (the column ours takes,
  marked when the task was not learnt yet), its final accuracy and both terms; then the means,
  ours as `olora_jax.metrics.forgetting` computes it."""
  t = acc.shape[0]
  ours, theirs = metrics.forgetting_per_task(acc), mammoth_forgetting_per_task(acc)
  rows = []
  for k in range(t - 1):
    best = int(np.argmax(acc[k, : t - 1]))
    where = f"after task {best}" + (f" (before task {k} was learnt)" if best < k else "")
    rows.append([f"task {k}", f"{pct(acc[k, best])}, {where}", pct(acc[k, -1]), pct(ours[k]),
                 pct(theirs[k])])
  rows.append(["mean: Forgetting", "", "", pct(metrics.forgetting(acc)), pct(theirs.mean())])
  return (["earlier task k", "best before the last task end", "final", "ours (results.json)",
           "Mammoth's"], rows)
