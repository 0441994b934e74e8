"""A result says how it stands to its method's check against its authors' code.

Each method's `Check` declares the settings its parity test ran in (`Check.settings`,
`methods.base.CHECKED_SETTINGS_RULE` says which keys count); here each declaration is tied to
what its parity test replays, the overrides its recording carries over configs/demo.py (so a
driver that changes a setting, or a declaration that names one the test does not run, fails
here); each run's results.json records its method's check and the settings that differ from the
checked ones (`check`); and `launch/report.py`'s Markdown and LaTeX tables mark such rows with a
footnote naming them, and an unchecked method's rows with one of their own.

No run of its own: the results.json test reads the session's tiny CODA-Prompt run (the one every
method's command-line test makes, tiny_methods.method_run), the rest works on configs and on run
directories written here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tiny_methods
import tiny_run

from configs import demo
from olora_jax import methods, reporting, validation
from olora_jax.methods import base, er

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
# (method, the Variant of its check ('' for its own settings)) -> the recording whose overrides
# its parity test replays over configs/demo.py.
RECORDINGS = {
    ("er", ""): "aml_er.npz", ("er_ace", ""): "aml_er_ace.npz",
    ("der_pp", ""): "mammoth_der_pp.npz", ("scr", ""): "ocl_scr.npz",
    ("coda_prompt", ""): "coda_prompt.npz", ("simplecil", ""): "pilot_simplecil.npz",
    ("simplecil", "APER"): "pilot_aper.npz", ("slca", ""): "pilot_slca.npz",
    ("online_lora", ""): "online_lora/settings.json",
    ("agem", ""): "ocl_agem.npz", ("mir", ""): "ocl_mir.npz", ("ewc_pp", ""): "ocl_ewc_pp.npz",
    ("pcr", ""): "pcr.npz", ("lode", ""): "lode.npz",
    ("ema_der_pp", ""): "online_ema_der_pp.npz", ("ema_rar", ""): "online_ema_rar.npz",
}
# The overrides of a recording that are not settings (`CHECKED_SETTINGS_RULE`): the data, the
# evaluation's outputs, the initial weights, the method's name and the seed. Every other
# override that is a choice (a string, a bool, a sequence) must be declared; a number is a
# hyperparameter the check set for its stream, unless declared.
NOT_SETTINGS = ("data.", "eval.", "pretrained.")


def recorded_overrides(name: str) -> dict:
  """The overrides over configs/demo.py a parity test replays, as its recording holds them (the
  Online-LoRA fixture's settings: its dotted keys, the seed and the fidelity, as the driver's
  `ours_command` passes them)."""
  path = FIXTURES / name
  if path.suffix == ".json":
    settings = json.loads(path.read_text())
    return {k: v for k, v in settings.items() if "." in k or k in ("seed", "fidelity")}
  with np.load(path) as z:
    return json.loads(str(z["overrides"]))


def demo_config(overrides: dict):
  """configs/demo.py with `overrides` ({dotted key: value}) set, as --config.KEY=VALUE does."""
  config = demo.get_config()
  for key, value in overrides.items():
    section, _, leaf = key.rpartition(".")
    setattr(config[section] if section else config, leaf,
            tuple(value) if isinstance(value, list) else value)
  return config


def regime(spec: base.MethodSpec, variant: str) -> dict:
  """The checked settings of `spec`'s check ('' its own, else the named variant's)."""
  if not variant:
    return dict(spec.check.settings)
  return dict(next(v for v in spec.check.variants if v.name == variant).settings)


@pytest.mark.parametrize("method, variant", list(RECORDINGS), ids=[
    f"{m}-{v}" if v else m for m, v in RECORDINGS])
def test_each_declared_setting_is_what_its_parity_test_runs(method, variant):
  """The declaration agrees with the recording's overrides both ways: every checked setting is
  the value its parity test runs (overrides over configs/demo.py), and every override that is a
  choice (not the data, outputs, weights, method or seed; not a number) is declared."""
  spec = methods.resolve(method)
  overrides = recorded_overrides(RECORDINGS[(method, variant)])
  flat = validation.flatten(demo_config(overrides))
  assert flat["method"] == method
  declared = regime(spec, variant)
  wrong = {k: (flat.get(k, "missing"), v) for k, v in declared.items()
           if k not in flat or not base.same_setting(flat[k], v)}
  assert not wrong, f"{method} {variant}: declared settings the parity run does not have: {wrong}"
  undeclared = sorted(
      k for k, v in overrides.items()
      if k not in declared and k not in ("method", "seed") and not k.startswith(NOT_SETTINGS)
      and (isinstance(v, (str, bool, list, tuple)) or v is None))
  assert not undeclared, (
      f"{method} {variant}: the parity run overrides {undeclared}, choices its check's settings"
      f" do not declare; declare them (base.CHECKED_SETTINGS_RULE: {base.CHECKED_SETTINGS_RULE})")
  record = spec.check_record(demo_config(overrides))
  assert (record["status"], record["variant"], record["differing"]) == ("checked", variant, {})


def test_every_check_declares_its_settings_and_is_tied_to_its_recording():
  """A packaged method with a check declares the settings it ran in (`Check.settings`), and each
  of them (its variants too) is tied to a recording above: a new check adds its row to
  RECORDINGS."""
  for spec in methods.specs():
    if spec.check.kind == "none":
      assert spec.check_record({})["status"] == "unchecked"
      continue
    assert spec.check.settings is not None, (
        f"{spec.name}: its check declares no settings; give base.Check(..., settings={{dotted"
        " key: value}}) from its parity driver's overrides")
    for variant in ("", *(v.name for v in spec.check.variants)):
      assert (spec.name, variant) in RECORDINGS, (spec.name, variant)


def test_the_card_names_the_settings_that_are_not_the_defaults():
  """The card's check line is derived from the declaration: the checked settings that are not
  the block's defaults, then the scope's free text."""
  coda = methods.resolve("coda_prompt").check_sentence()
  assert "with `boundaries.rule='oracle'`, `coda_prompt.train_mask='task'`, 40 steps" in coda
  assert "reset_optimizer" not in coda  # its default: True, as checked
  assert "with `model.name='resnet18_reduced'`, `er_ace.optimizer='sgd'`" in (
      methods.resolve("er_ace").check_sentence())
  simplecil = methods.resolve("simplecil").check_sentence()
  assert ("and so does APER with `simplecil.first_phase='all'`, `boundaries.rule='oracle'`"
          " except for the first task's prototypes") in simplecil
  assert "first_phase_head" not in simplecil and "'none'" not in simplecil
  # A check of the four fields (no settings declared) still reads as before.
  assert base.Check("step", "org/repo", "tests/test_x.py", "on 5 seeds").sentence() == (
      "Check: matches its authors' code step for step on a shared stream, on 5 seeds (org/repo;"
      " tests/test_x.py).")
  assert base.Check("step", "org/repo", "t.py").record({})["status"] == "undeclared"


def test_a_default_run_differs_from_its_check_and_the_checked_one_does_not():
  """CODA-Prompt as the demo runs it by default (task-free, every class in the loss) differs from
  its check in the boundary rule and the mask, and in nothing else; with those two set it is the
  checked method. The demo's ER runs a ViT with Adam; its Online-LoRA the paper's fidelity;
  SimpleCIL's adapted first phase is nearest its APER check; GDumb is unchecked."""
  def record(method, **overrides):
    return methods.resolve(method).check_record(demo_config({"method": method, **overrides}))

  coda = record("coda_prompt")
  assert coda["status"] == "differs"
  assert coda["differing"] == {"boundaries.rule": {"run": "none", "checked": "oracle"},
                               "coda_prompt.train_mask": {"run": "none", "checked": "task"}}
  assert (coda["kind"], coda["against"], coda["test"]) == (
      "step", "GT-RIPL/CODA-Prompt", "tests/test_parity_coda_prompt.py")
  checked = record("coda_prompt", **{"boundaries.rule": "oracle",
                                     "coda_prompt.train_mask": "task"})
  assert (checked["status"], checked["differing"]) == ("checked", {})
  assert checked["settings"]["coda_prompt.train_mask"] == "task"
  assert set(record("er")["differing"]) == {"model.name", "er.optimizer", "er.replay_pass"}
  assert record("online_lora")["differing"] == {"fidelity": {"run": "paper",
                                                             "checked": "reference"}}
  aper = record("simplecil", **{"simplecil.first_phase": "all"})
  assert aper["variant"] == "APER" and list(aper["differing"]) == ["boundaries.rule"]
  assert record("gdumb")["status"] == "unchecked"
  # A setting is compared as config.json writes it: a tuple as a list, True never the number 1.
  assert base.same_setting((0, 1), [0, 1]) and not base.same_setting(True, 1)
  flat = validation.flatten(demo_config({"method": "coda_prompt"}))  # as config.json reads
  assert methods.resolve("coda_prompt").check_record(
      {**flat, "coda_prompt.reset_optimizer": 1}
  )["differing"]["coda_prompt.reset_optimizer"] == {"run": 1, "checked": True}
  assert json.loads(json.dumps(coda)) == coda  # results.json holds it as it is


def test_the_run_records_its_check_in_results_json(method_runs_root, compilation_cache):
  """The session's tiny CODA-Prompt run (oracle boundaries, an orthogonality weight, every class
  in the loss) records its check and the two settings in which it is not the checked method; its
  closing table says so, and the report marks its row with a footnote naming them."""
  workdir, code, _ = tiny_methods.method_run(method_runs_root, "coda_prompt", "coda_prompt", {},
                                             compilation_cache)
  assert code == 0
  check = json.loads((workdir / "results.json").read_text())["check"]
  assert check["status"] == "differs" and check["test"] == "tests/test_parity_coda_prompt.py"
  assert check["differing"] == {"coda_prompt.train_mask": {"run": "none", "checked": "task"},
                                "coda_prompt.ortho_weight": {"run": 0.1, "checked": 0.0}}
  assert ("| check | not the settings of its check against its authors' code,"
          " GT-RIPL/CODA-Prompt (tests/test_parity_coda_prompt.py): `coda_prompt.train_mask`"
          " 'none' (checked: 'task'); `coda_prompt.ortho_weight` 0.1 (checked: 0.0) |"
          ) in tiny_run.printed(workdir)[0]
  rows = reporting.results_rows(str(workdir))
  assert rows[0]["check/status"] == "differs"
  table = reporting.render(reporting.table_rows(rows), list(reporting.DEFAULT_METRICS))
  assert "| CODA-Prompt [oracle boundaries] [^a] |" in table
  assert ("[^a]: CODA-Prompt [oracle boundaries]: not the settings of its check against its"
          " authors' code, GT-RIPL/CODA-Prompt (tests/test_parity_coda_prompt.py):"
          " `coda_prompt.train_mask` 'none' (checked: 'task'); `coda_prompt.ortho_weight` 0.1"
          " (checked: 0.0)") in table


def write_run(path: Path, seed: int, overrides: dict, check: bool = True) -> str:
  """A finished run directory of configs/demo.py with `overrides`: its config.json, and a
  results.json with its metrics and (`check`) its method's check, as a run writes it."""
  config = demo_config({"seed": seed, **overrides})
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps(config.to_dict()))
  results = {"A_final": 0.5 + seed / 100, "forgetting": 0.1, "A_auc": 0.6,
             "stream_manifest_sha256": "same"}
  if check:
    results["check"] = methods.resolve(config.method).check_record(config)
  (path / "results.json").write_text(json.dumps(results))
  return str(path)


def report_runs(root: Path) -> list[str]:
  """CODA-Prompt by default (twice: two seeds) and as checked, GDumb (unchecked), and ER made
  before runs recorded their check."""
  checked = {"method": "coda_prompt", "boundaries.rule": "oracle",
             "coda_prompt.train_mask": "task"}
  return [write_run(root / "coda0", 0, {"method": "coda_prompt"}),
          write_run(root / "coda1", 1, {"method": "coda_prompt"}),
          write_run(root / "checked", 0, checked),
          write_run(root / "gdumb", 0, {"method": "gdumb"}),
          write_run(root / "old_er", 0, {"method": "er"}, check=False)]


def test_the_report_marks_rows_that_are_not_their_checked_method(tmp_path):
  """Markdown: a footnote marker on each row not as checked, its footnote naming each differing
  setting with its value and the checked one; one shared footnote for unchecked methods; none on
  the checked row or on a run made before runs recorded their check. LaTeX: the same marks as
  superscripts, the footnotes under the tabular, escaped. The rows API carries each run's
  status."""
  dirs = report_runs(tmp_path)
  rows = reporting.results_rows(dirs)
  assert [r["check/status"] for r in rows] == ["differs", "differs", "checked", "unchecked",
                                               reporting.CHECK_NOT_RECORDED]
  assert reporting.check_of(rows[4]) is None
  assert reporting.check_of(rows[0])["differing"]["boundaries.rule"] == {"run": "none",
                                                                         "checked": "oracle"}
  table_rows = reporting.table_rows(rows)
  markdown = reporting.render(table_rows, list(reporting.DEFAULT_METRICS))
  lines = markdown.splitlines()
  body = {line.split(" | ")[0].removeprefix("| ") for line in lines if line.startswith("| ")
          and not line.startswith("| |")}
  assert body >= {"GDumb [^unchecked]", "ER", "CODA-Prompt [^a]",
                  "CODA-Prompt [oracle boundaries]"}, body
  notes = [line for line in lines if line.startswith("[^")]
  assert notes == [
      "[^unchecked]: not checked against its authors' code (docs/parity.md lists the methods"
      " that are)",
      "[^a]: CODA-Prompt: not the settings of its check against its authors' code,"
      " GT-RIPL/CODA-Prompt (tests/test_parity_coda_prompt.py): `boundaries.rule` 'none'"
      " (checked: 'oracle'); `coda_prompt.train_mask` 'none' (checked: 'task')"]
  assert lines[lines.index(notes[0]) - 1] == ""  # the footnotes a paragraph of their own
  tex = reporting.render(table_rows, list(reporting.DEFAULT_METRICS), "latex")
  assert r"CODA-Prompt\textsuperscript{a} & " in tex and r"GDumb\textsuperscript{*} & " in tex
  assert re.search(r"^ER & ", tex, re.M) and re.search(r"^CODA-Prompt \[oracle boundaries\] & ",
                                                        tex, re.M)
  assert (r"\textsuperscript{a}\,CODA-Prompt: not the settings of its check against its authors'"
          r" code, GT-RIPL/CODA-Prompt (tests/test\_parity\_coda\_prompt.py):"
          r" \texttt{boundaries.rule} 'none' (checked: 'oracle'); \texttt{coda\_prompt.train\_mask}"
          r" 'none' (checked: 'task')\par") in tex
  assert tex.splitlines()[-1] == r"\end{table}"


def test_a_setting_whose_check_differs_between_columns_is_named(tmp_path):
  """One row label over two settings, as checked in one and not in the other: its footnote says
  in which setting."""
  checked = {"method": "coda_prompt", "boundaries.rule": "oracle",
             "coda_prompt.train_mask": "task"}
  dirs = [write_run(tmp_path / "a", 0, checked),
          write_run(tmp_path / "b", 0, {**checked, "coda_prompt.train_mask": "none",
                                        "data.n_tasks": 2})]
  markdown = reporting.render(reporting.aggregate(dirs), ["A_final"])
  assert "[^a]: CODA-Prompt [oracle boundaries] (mnist_5k disjoint/2 custom): not the settings" in (
      markdown)


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (.ci/run"
                    " installs Debian's texlive-latex-base and -recommended)")
def test_the_marked_latex_table_compiles(tmp_path):
  """The LaTeX table with its check footnotes goes into a paper as it is."""
  rows = reporting.table_rows(reporting.results_rows(report_runs(tmp_path / "runs")))
  (tmp_path / "table.tex").write_text(reporting.render(rows, ["A_final"], "latex") + "\n")
  (tmp_path / "t.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n"
                                  "\\begin{document}\n\\input{table}\n\\end{document}\n")
  proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "t.tex"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert (tmp_path / "t.pdf").read_bytes()[:5] == b"%PDF-"


def test_a_check_against_another_codebase_names_whose_code_it_is():
  """A-GEM and MIR are checked against the codebase the Online-LoRA paper took their numbers
  from, not their authors' code: their card, results.json and report footnote say so; SCR's,
  against its authors' code in the same codebase, says its authors'."""
  for method in ("agem", "mir"):
    spec = methods.resolve(method)
    assert spec.check_sentence().startswith(f"Check: matches {er.OCL_CODE} step for step")
    assert "authors'" not in spec.check_sentence()
    record = spec.check_record(demo_config({"method": method}))
    assert record["code"] == er.OCL_CODE
    assert f"against {er.OCL_CODE}, {er.OCL}" in reporting.check_summary(record)
  scr = methods.resolve("scr")
  assert scr.check_sentence().startswith("Check: matches its authors' code over seeds")
  assert scr.check_record(demo_config({"method": "scr"}))["code"] == base.AUTHORS_CODE
