"""A sweep's results in Python: one row per run, a pandas DataFrame of them, and the report's
table built from the same rows (`olora_jax.reporting`).

    .venv/bin/python examples/sweep_results.py runs/tables

ROOT is a `launch/sweep.py --root` (or any directory of runs); a list of workdirs works too.
`as_dataframe` needs pandas, which olora-jax does not install (`pip install pandas`).
"""

from __future__ import annotations

import sys

from olora_jax import reporting


def main(root: str) -> None:
  rows = reporting.results_rows(root)  # one dict per run: setting, method, seed, metrics, status
  for row in rows:
    print(row["setting"], row["method"], row["seed"], row["status"], row.get("A_final"))
  try:
    frame = reporting.as_dataframe(rows)
    print(frame.groupby(["setting", "method"])["A_final"].agg(["mean", "std"]))
  except ImportError as e:
    print(e)
  table = reporting.table_rows(rows, ["A_final", "forgetting"])  # what launch/report.py prints
  print(reporting.render(table, ["A_final", "forgetting"], "latex"))


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "runs/tables")
