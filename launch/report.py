r"""Aggregates finished runs into a paper-style table of mean ± std over seeds.

    .venv/bin/python launch/report.py RUN_DIR [RUN_DIR ...] [--csv report.csv] \
        [--metrics A_final,forgetting] [--plots DIR [--no_titles]] [--format latex]
    .venv/bin/python launch/report.py --layout table1 ROOT   # the paper's Table 1 (table2: 2)
    .venv/bin/python launch/report.py --layout table1 --format latex ROOT > table1.tex

A RUN_DIR may also be a directory of runs (e.g. the ROOT of launch/sweep.py): every run below it
is read (a tracker's store there, ROOT/mlruns of a sweep tracked with MLflow, is not: it holds
copies of the runs' files); unfinished ones (no results.json, or a damaged one) are named on
stderr with the reason and left out, and so are the validation runs of
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
column groups are settings (dataset, scenario/tasks, backbone, and the class order when it is
not the labels', e.g. "reversed order"), each named once over its metrics, mean ± std over
seeds. Runs of one setting and seed made on different streams (their stream manifests differ)
are refused with exit code 2, naming the stream keys their configs differ in (data.class_order,
...). Add `wall_seconds` to --metrics for the wall time per method.

The tables are built from one row per run, the rows `olora_jax.reporting.results_rows` returns
to Python (every metric of results.json and its run's check status, a pandas DataFrame with
`as_dataframe`). A row whose runs are not their method as its check against its authors' code
ran it (results.json `check`: CODA-Prompt without task boundaries, ER on a ViT with Adam) gets a
footnote naming each differing setting with the run's value and the checked one, and every row
of an unchecked method one footnote saying so: in Markdown as GitHub's footnotes ([^a] after
the method, `[^a]: ...` under the table), in LaTeX as superscripts with the footnotes under the
tabular. Runs made before results.json recorded the check carry no footnote. A metric that
only some runs record (the Task-IL `A_final_task_il`, `A_auc_task_il` of disjoint streams) is n/a
for the others.

Prints the table as `--format`: markdown (the default), latex (a booktabs table: \toprule,
\multicolumn setting headers over a \cmidrule, mean $\pm$ std, each metric column's best mean
in bold, the upper bound excluded, a caption and `--label`; needs \usepackage{booktabs}) or csv.
A LaTeX table heads each setting with its title (dataset: tasks and protocol, backbone, class
order), or with the names `--setting_names` gives, one per setting in the table's order. Writes
nothing unless asked (stdout holds the table alone, for `> table.tex`; notes, and what was
written, go to stderr):
`--csv PATH` writes the numbers as CSV, `--plots DIR` draws a paper's figures into DIR
(PNG and PDF each, olora_jax/plots.py): anytime_overlay (every run's anytime-accuracy curve, the
mean and a +-1 std band per (method, setting) group, the true task boundaries),
accuracy_matrices_<setting> (each method's final accuracy matrix, mean over seeds) and
forgetting_per_task (each earlier task's forgetting per method); `--no_titles` leaves their
titles out, for a caption to say what they show.
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from olora_jax import plots, reporting  # noqa: E402

_CSV = flags.DEFINE_string("csv", "", "Where to write the table as CSV ('' = no CSV file).")
_METRICS = flags.DEFINE_list("metrics", list(reporting.DEFAULT_METRICS),
                             "results.json metrics to tabulate, comma separated.")
_PLOTS = flags.DEFINE_string("plots", "", "Directory for the figures: anytime overlay, accuracy"
                             " matrices, forgetting per task ('' = no figure).")
_NO_TITLES = flags.DEFINE_bool("no_titles", False, "Draw the --plots figures without titles (a"
                               " paper's caption says what they show).")
_FORMAT = flags.DEFINE_enum("format", "markdown", list(reporting.FORMATS),
                            "How the table is printed: markdown, latex (booktabs) or csv.")
_LABEL = flags.DEFINE_string("label", None, "The LaTeX table's \\label (default tab:results, or"
                             " tab:LAYOUT with --layout).")
_SETTING_NAMES = flags.DEFINE_list("setting_names", [], "The LaTeX table's setting headers, one"
                                   " per setting in the table's order, comma separated (default:"
                                   " each setting's title).")
_LAYOUT = flags.DEFINE_enum("layout", None, list(reporting.LAYOUTS),
                            "Print one of the paper's tables (its metrics; --metrics is ignored).")


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise app.UsageError("give one or more run directories: launch/report.py RUN_DIR [RUN_DIR ...]")
  metrics = reporting.LAYOUTS[_LAYOUT.value].metrics if _LAYOUT.value else _METRICS.value
  try:
    validation = []
    # One row per run (reporting.results_rows, the Python API's rows): every table is built
    # from them.
    cells = reporting.results_rows(run_dirs, validation=validation)
    for cell in cells:
      if cell["status"] != reporting.FINISHED:
        print(f"note: {cell['workdir']}: {cell['status']}; left out", file=sys.stderr)
    for d in validation:
      print(f"note: {d} holds sweep --tune's validation runs (scored on held-out training data,"
            " not the test set); left out (give it by name to tabulate them)", file=sys.stderr)
    latex = {}
    if _FORMAT.value == "latex":
      latex = {"setting_names": _SETTING_NAMES.value,
               **({"label": _LABEL.value} if _LABEL.value else {})}
    elif _SETTING_NAMES.value or _LABEL.value:
      raise ValueError("--setting_names and --label shape the LaTeX table; add --format latex")
    if _LAYOUT.value:
      rows, table = reporting.layout_table(cells, _LAYOUT.value, _FORMAT.value, **latex)
    else:
      rows = reporting.table_rows(cells, metrics)
      table = reporting.render(rows, metrics, _FORMAT.value, **latex)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(table)
  if _FORMAT.value == "latex":
    for note in reporting.latex_notes(rows, metrics):
      print(f"note: {note}", file=sys.stderr)
  if _CSV.value:
    reporting.write_csv(rows, _CSV.value, metrics)
    print(f"CSV written to {_CSV.value}", file=sys.stderr)
  if _PLOTS.value:
    try:
      paths = plots.write_report_plots(rows, _PLOTS.value, titles=not _NO_TITLES.value)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(f"figures written to {_PLOTS.value}: "
          + ", ".join(os.path.basename(p) for p in paths) + " (and a .pdf of each)",
          file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
