"""Every registered method as a user runs it: `launch/run.py` on one tiny stream with its figures
on, exit 0 and every figure drawn, then `launch/report.py` over all the runs in each layout.

The methods come from the registry (`olora_jax.methods.specs()`), not a list kept here, so a new
method is run as soon as its module declares it. Each run is its own process (the command line is
what is tested: its exit code, its end-of-run figures and table); the stream is test_methods_run's
(same shapes), so the session's compilation cache serves the programs either test compiled first.
Before issue 39's fix, SLDA, RanPAC and SimpleCIL exited 1 here after writing results.json, and
every report over them ended in a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys

import tiny_methods
import tiny_run

from configs import tiny
from olora_jax import methods, plots, validation

STREAM = {"data.test_fraction": 0.7, "eval.eval_every": 200, "checkpoint_every": 0,
          "eval.write_plots": True, "iid.epochs": 2}
# One more run, Si-Blurry, so that the Table 2 layout has a row (the training-free SLDA: seconds),
# given an override of a block it does not read, which changes nothing but a warning line.
SI_BLURRY = ("slda", {"data.scenario": "si_blurry"})
UNREAD = "--config.er.buffer_size=7"


def _overrides(method: str, extra: dict) -> list[str]:
  """The command-line overrides that turn configs/tiny.py into tiny_methods.small_config(method)
  on STREAM: the run's own block and the shared keys, never another method's block."""
  config = tiny_methods.small_config(method)
  for key, value in {**STREAM, **extra}.items():
    section, _, leaf = key.rpartition(".")
    if section in (s.name for s in methods.specs()) and section != method:
      continue
    setattr(config[section] if section else config, leaf, value)
  default = validation.flatten(tiny.get_config())
  blocks = {s.name for s in methods.specs()} - {method}
  return [f"--config.{key}={value}" for key, value in validation.flatten(config).items()
          if value != default.get(key) and key.split(".")[0] not in blocks]


def _cli(script: str, *args, cache) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(tiny_run.ROOT / "launch" / script), *map(str, args)],
                        cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=300,
                        env=tiny_run.env(cache))


def test_every_registered_method_runs_from_the_command_line_and_reports(tmp_path,
                                                                        compilation_cache):
  runs = [(spec.name, spec.name, {}) for spec in methods.specs()]
  runs.append((f"{SI_BLURRY[0]}_si_blurry", *SI_BLURRY))
  failed = []
  for name, method, extra in runs:
    workdir = tmp_path / name
    unread = (UNREAD,) if extra else ()
    done = _cli("run.py", "--config", tiny_run.ROOT / "configs" / "tiny.py", "--workdir", workdir,
                *_overrides(method, extra), *unread, cache=compilation_cache)
    warned = [line.split("] ", 1)[-1] for line in done.stderr.splitlines()
              if "does not read" in line]  # after absl's prefix
    assert warned == ([f"method=slda does not read the er block: {UNREAD.split('=')[0]} changes"
                       " nothing (it reads --config.slda.*)"] if unread else []), warned
    config = workdir / "config.json"
    drawn = plots.plot_files(json.loads(config.read_text()) if config.is_file() else {})
    missing = [p for p in drawn if not (workdir / "plots" / p).is_file()]
    if done.returncode != 0 or missing:
      failed.append(f"{name}: exit {done.returncode}, missing plots {missing}:"
                    f" {tiny_run.last_line(done.stderr)}")
  assert not failed, "\n".join(failed)

  table = _cli("report.py", tmp_path, cache=compilation_cache)
  assert table.returncode == 0, table.stderr[-2000:]
  for spec in methods.specs():
    assert f"| {spec.report_name} " in table.stdout, (spec.name, table.stdout)  # [boundaries]
  for layout in ("table1", "table2"):
    done = _cli("report.py", "--layout", layout, "--csv", tmp_path / f"{layout}.csv", "--plots",
                tmp_path / layout, tmp_path, cache=compilation_cache)
    assert done.returncode == 0, f"{layout}: {done.stderr[-2000:]}"
    assert (tmp_path / layout / "anytime_overlay.png").is_file()
  assert "| SLDA |" in done.stdout  # the Si-Blurry run, in Table 2
  # No Swin-T run among them: the layout says so in one line (exit 2), not a traceback.
  done = _cli("report.py", "--layout", "swin", tmp_path, cache=compilation_cache)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert tiny_run.last_line(done.stderr).startswith("error: no run with"), done.stderr
