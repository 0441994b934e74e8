"""Aggregates finished runs into a paper-style table of mean ± std over seeds.

    .venv/bin/python launch/report.py RUN_DIR [RUN_DIR ...] [--csv report.csv] \
        [--metrics A_final,forgetting] [--plots DIR]

Runs are grouped by their whole config.json except `seed` (give seeds with `--config.seed=N` to
launch/run.py). Rows are methods in the order of the paper's Table 1 (`--config.method=NAME`
runs: AGEM, ER, EWC++, MIR, GDumb, DER++, fine-tuning, Online-LoRA, the i.i.d. upper bound),
column groups are settings (dataset, scenario/tasks, backbone), each with its metrics, mean ± std
over seeds. Runs of one setting and seed made on different streams (their stream manifests
differ) are refused with exit code 2. Add `wall_seconds` to --metrics for the wall time per
method. Prints Markdown and writes the same numbers as CSV. With `--plots DIR`, also draws
DIR/anytime_overlay.png and .pdf: every run's anytime-accuracy curve, with the mean and a +-1 std
band per (method, setting) group.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from olora_jax import plots, reporting  # noqa: E402

_CSV = flags.DEFINE_string("csv", "report.csv", "Where to write the table as CSV.")
_METRICS = flags.DEFINE_list("metrics", list(reporting.DEFAULT_METRICS),
                             "results.json metrics to tabulate, comma separated.")
_PLOTS = flags.DEFINE_string("plots", "", "Directory for the overlay figure ('' = no figure).")


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise app.UsageError("give one or more run directories: launch/report.py RUN_DIR [RUN_DIR ...]")
  try:
    rows = reporting.aggregate(run_dirs, _METRICS.value)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(reporting.markdown_table(rows, _METRICS.value))
  reporting.write_csv(rows, _CSV.value, _METRICS.value)
  print(f"\nCSV written to {_CSV.value}")
  if _PLOTS.value:
    path = plots.write_overlay_plot(rows, _PLOTS.value)
    print(f"overlay figure written to {path} (and .pdf)")


if __name__ == "__main__":
  app.run(main)
