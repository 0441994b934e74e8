"""Every registered method as a user runs it: `launch/run.py` on one tiny stream with its figures
on, exit 0 and every figure drawn, then `launch/report.py` over all the runs in each layout.

The methods come from the registry (`olora_jax.methods.specs()`), not a list kept here, so a new
method is run as soon as its module declares it. Each run is its own process (the command line is
what is tested: its exit code, its end-of-run figures and table) on tiny_methods.STREAM.
Before issue 39's fix, SLDA, RanPAC and SimpleCIL exited 1 here after writing results.json, and
every report over them ended in a traceback.

One test per method (pytest-xdist spreads them over its workers, and a failure names its method);
the runs live in one directory of the session, each made once under its own lock by whichever
test needs it first (tiny_methods.method_run), so the report test reads the same runs without
running them again, and test_methods_run resumes each from its checkpoint at step 8 and compares
the resumed run with it.

The same runs hold each method to its budget of compiled programs: the compute ledger's
`n_compilations` must be the number docs/performance.md states for it ("Programs a run
compiles"), Online-LoRA's at most ONLINE_LORA_PROGRAMS, so a new program (an eager op, a
placement per shape, another jitted helper) cannot creep in unnoticed. The runs share the
session's persistent compilation cache: the ledger counts a program loaded from it as one compiled
(test_compute checks that), so the counts are those of runs with the cache off.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tiny_methods
import tiny_run

from olora_jax import methods, plots

# One more run, Si-Blurry, so that the Table 2 layout has a row (the training-free SLDA: seconds),
# given an override of a block it does not read, which changes nothing but a warning line.
SI_BLURRY = ("slda", {"data.scenario": "si_blurry"})
UNREAD = "--config.er.buffer_size=7"
# The budget for the paper's method: train step, consolidation, evaluation, state
# initialisation and the few small programs beside them.
ONLINE_LORA_PROGRAMS = 8
PERFORMANCE_DOC = tiny_run.ROOT / "docs" / "performance.md"


def documented_programs() -> dict[str, int]:
  """{method: programs} from the table of docs/performance.md's "Programs a run compiles"."""
  section = PERFORMANCE_DOC.read_text().split("\n## Programs a run compiles", 1)[1]
  section = section.split("\n## ", 1)[0]
  return {name: int(n) for name, n in re.findall(r"^\| `(\w+)` \| (\d+) \|", section, re.M)}


# (run name, method, overrides beyond tiny_methods.STREAM): every packaged method, and the
# Si-Blurry run.
RUNS = [(spec.name, spec.name, {}) for spec in methods.specs()] + [
    (f"{SI_BLURRY[0]}_si_blurry", *SI_BLURRY)]


def _method_run(root: Path, name: str, method: str, extra: dict, cache) -> tuple[Path, int, str]:
  return tiny_methods.method_run(root, name, method, extra, cache, *((UNREAD,) if extra else ()))


@pytest.mark.parametrize("name, method, extra", RUNS, ids=[r[0] for r in RUNS])
def test_every_registered_method_runs_from_the_command_line(method_runs_root, compilation_cache,
                                                            name, method, extra):
  workdir, code, stderr = _method_run(method_runs_root, name, method, extra, compilation_cache)
  warned = [line.split("] ", 1)[-1] for line in stderr.splitlines()
            if "does not read" in line]  # after absl's prefix
  assert warned == ([f"method=slda does not read the er block: {UNREAD.split('=')[0]} changes"
                     " nothing (it reads --config.slda.*)"] if extra else []), warned
  assert code == 0, f"{name}: exit {code}: {tiny_run.last_line(stderr)}"
  drawn = plots.plot_files(json.loads((workdir / "config.json").read_text()))
  missing = [p for p in drawn if not (workdir / "plots" / p).is_file()]
  assert not missing, f"{name}: missing plots {missing}"
  if extra:
    return
  budget = documented_programs()
  assert budget["online_lora"] <= ONLINE_LORA_PROGRAMS, budget
  programs = json.loads((workdir / "results.json").read_text())["compute"]["n_compilations"]
  assert programs == budget.get(name), (
      f"{name} compiled {programs} programs, docs/performance.md says {budget.get(name)}:"
      " run with JAX_LOG_COMPILES=1 to see each program, remove a new one at its cause or state"
      " the new count in the docs' table")


def test_the_report_reads_every_method_in_each_layout(method_runs_root, compilation_cache,
                                                       tmp_path):
  for name, method, extra in RUNS:  # made by the tests above, or here if this test runs first
    _method_run(method_runs_root, name, method, extra, compilation_cache)
  table = tiny_methods.cli("report.py", method_runs_root, cache=compilation_cache)
  assert table.returncode == 0, table.stderr[-2000:]
  for spec in methods.specs():
    assert f"| {spec.report_name} " in table.stdout, (spec.name, table.stdout)  # [boundaries]
  for layout in ("table1", "table2"):
    done = tiny_methods.cli("report.py", "--layout", layout, "--csv", tmp_path / f"{layout}.csv",
                            "--plots", tmp_path / layout, method_runs_root, cache=compilation_cache)
    assert done.returncode == 0, f"{layout}: {done.stderr[-2000:]}"
    assert (tmp_path / layout / "anytime_overlay.png").is_file()
  assert "| SLDA [^unchecked] |" in done.stdout  # the Si-Blurry run, in Table 2 (unchecked)
  # No Swin-T run among them: the layout says so in one line (exit 2), not a traceback.
  done = tiny_methods.cli("report.py", "--layout", "swin", method_runs_root,
                          cache=compilation_cache)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert tiny_run.last_line(done.stderr).startswith("error: no run with"), done.stderr
