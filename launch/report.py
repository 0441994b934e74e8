"""Aggregates finished runs into a paper-style table of mean ± std over seeds.

    .venv/bin/python launch/report.py RUN_DIR [RUN_DIR ...] [--csv report.csv] \
        [--metrics A_final,forgetting] [--plots DIR]
    .venv/bin/python launch/report.py --layout table1 ROOT   # the paper's Table 1 (table2: 2)

A RUN_DIR may also be a directory of runs (e.g. the ROOT of launch/sweep.py): every run below it
is read; unfinished ones (no results.json, or a damaged one) are named on stderr with the reason
and left out, and so are the validation runs of
`launch/sweep.py --tune` (ROOT/NAME/METHOD/tune/); a row whose runs `--tune` made with its
picked point is labelled "(tuned: KEY=VALUE, ...)" and the table's last line says on what.
`--layout table1` prints the paper's Table 1 (disjoint runs: A_final / Forgetting), `--layout
table2` its Table 2 (Si-Blurry runs: A_auc / A_final), `--layout swin` the appendix's Swin-T
table (Split ImageNet-S and CORe50 runs of model.name=swin_t: A_final / Forgetting), each
followed by the wall time per method, with the paper's own numbers in a "(paper)" column where a
setting matches (olora_jax/reporting.py: PAPER_RESULTS).

Runs are grouped by their whole config.json except `seed` (give seeds with `--config.seed=N` to
launch/run.py). Rows are methods in the order of the paper's Table 1 (`--config.method=NAME`
runs: AGEM, ER, EWC++, MIR, GDumb, DER++, fine-tuning, Online-LoRA, the i.i.d. upper bound),
column groups are settings (dataset, scenario/tasks, backbone), each with its metrics, mean ± std
over seeds. Runs of one setting and seed made on different streams (their stream manifests
differ) are refused with exit code 2. Add `wall_seconds` to --metrics for the wall time per
method. Prints Markdown; writes nothing unless asked: `--csv PATH` writes the same numbers as
CSV, `--plots DIR` draws DIR/anytime_overlay.png and .pdf (every run's anytime-accuracy curve,
with the mean and a +-1 std band per (method, setting) group, and the true task boundaries).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from olora_jax import plots, reporting  # noqa: E402

_CSV = flags.DEFINE_string("csv", "", "Where to write the table as CSV ('' = no CSV file).")
_METRICS = flags.DEFINE_list("metrics", list(reporting.DEFAULT_METRICS),
                             "results.json metrics to tabulate, comma separated.")
_PLOTS = flags.DEFINE_string("plots", "", "Directory for the overlay figure ('' = no figure).")
_LAYOUT = flags.DEFINE_enum("layout", None, list(reporting.LAYOUTS),
                            "Print one of the paper's tables (its metrics; --metrics is ignored).")


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise app.UsageError("give one or more run directories: launch/report.py RUN_DIR [RUN_DIR ...]")
  metrics = reporting.LAYOUTS[_LAYOUT.value].metrics if _LAYOUT.value else _METRICS.value
  try:
    validation = []
    run_dirs, unfinished = reporting.find_runs(run_dirs, validation)
    for d in unfinished:
      print(f"note: {d}: {reporting.unfinished_reason(d)}; left out", file=sys.stderr)
    for d in validation:
      print(f"note: {d} holds sweep --tune's validation runs (scored on held-out training data,"
            " not the test set); left out (give it by name to tabulate them)", file=sys.stderr)
    if _LAYOUT.value:
      rows, table = reporting.layout_table(run_dirs, _LAYOUT.value)
    else:
      rows = reporting.aggregate(run_dirs, metrics)
      table = reporting.markdown_table(rows, metrics)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(table)
  if _CSV.value:
    reporting.write_csv(rows, _CSV.value, metrics)
    print(f"\nCSV written to {_CSV.value}")
  if _PLOTS.value:
    path = plots.write_overlay_plot(rows, _PLOTS.value)
    print(f"overlay figure written to {path} (and .pdf)")


if __name__ == "__main__":
  app.run(main)
