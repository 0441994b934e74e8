"""End to end: `launch/run.py` on the tiny config writes every output file with its keys."""

import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import tiny_run

from olora_jax import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "run.py"), *args],
                        capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_writes_config_metrics_and_results(tiny_reference):
  """The session's tiny run (conftest.py), `launch/run.py` with tiny_run.OVERRIDES."""
  workdir, (stdout, _) = tiny_reference, tiny_run.printed(tiny_reference)
  config = json.loads((workdir / "config.json").read_text())
  assert config["learner"]["mean_threshold"] == 6.0  # the override is recorded
  events = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert all({"step", "samples_seen", "event"} <= set(e) for e in events)
  kinds = {e["event"] for e in events}
  assert kinds == {"train", "plateau", "rearm", "eval", "task_end"}
  results = json.loads((workdir / "results.json").read_text())
  for key in ("A_final", "forgetting", "A_auc", "acc_matrix", "n_plateaus", "wall_seconds"):
    assert key in results
  acc = np.array(results["acc_matrix"])
  assert acc.shape == (5, 5) and np.all((acc >= 0) & (acc <= 1))
  assert results["A_final"] == pytest.approx(acc[:, -1].mean())
  assert results["n_plateaus"] == sum(e["event"] == "plateau" for e in events) >= 1
  anytime = [e["anytime_accuracy"] for e in events if e["event"] == "eval"]
  assert results["A_auc"] == pytest.approx(np.mean(anytime))
  task_ends = [e for e in events if e["event"] == "task_end"]
  assert [e["task"] for e in task_ends] == list(range(5))
  assert task_ends[-1]["samples_seen"] == results["samples_seen"] == 1438
  # The closing table opens in the README's layout: setting and seed, then the method's row.
  pct = lambda v: f"{100 * v:.2f}"  # noqa: E731
  assert ("| sklearn_digits: 5 disjoint tasks, custom ViT, seed 0 | A_final % | Forgetting % |"
          " A_auc % | plateaus |\n|---|---|---|---|---|\n| Online-LoRA (`paper` fidelity) |"
          f" {pct(results['A_final'])} | {pct(results['forgetting'])} | {pct(results['A_auc'])}"
          f" | {results['n_plateaus']} |") in stdout


BAR_FRAME = re.compile(r"(\d+)/(\d+) \[([^<\]]*)<([^,\]]*)")  # n/total [elapsed<remaining


def _frames(stderr: str) -> list[tuple[str, int, str]]:
  """The progress bar's frames (tqdm redraws with carriage returns): (text, n, remaining)."""
  return [(f, int(m[1]), m[4]) for f in re.split(r"[\r\n]", stderr)
          if (m := BAR_FRAME.search(f))]


def test_progress_bar_says_compiling_until_the_first_step_ends(tiny_reference):
  frames = _frames(tiny_run.printed(tiny_reference)[1])
  assert frames and frames[0][0].startswith(f"{trainer.COMPILING}:") and frames[0][1] == 0
  assert not any(f.startswith(trainer.COMPILING) for f, n, _ in frames if n > 0)
  # Step 1 compiled: no estimate from it ("?"), one from the steps after it.
  assert [r for _, n, r in frames if n == 1] == ["?"]


def test_progress_estimate_excludes_the_compile(capsys):
  """A first step that compiled for an hour, then steps of 0.1 s: the estimate is the steady
  steps' (about 99 s for 989 to go), never the compile's (which would be 90 hours)."""
  bar = trainer._progress_bar(1000, 0, True)
  bar.start_t -= 3600.0  # the first step's compile, since the bar was last drawn
  bar.last_print_t -= 3600.0
  progress = types.SimpleNamespace(plateau_steps=[])
  trainer._advance(bar, 0, {"loss": 1.0}, progress)
  for step in range(1, 11):
    trainer._advance(bar, step, {"loss": 1.0}, progress)
  bar.start_t -= 1.0  # the 10 steady steps took 1 s
  bar.refresh()
  bar.close()
  frames = _frames(capsys.readouterr().err)
  assert [r for _, n, r in frames if n == 1] == ["?"]
  assert frames[-1][1] == 11 and re.fullmatch(r"0[01]:[0-5]\d", frames[-1][2]), frames[-1]


def test_misspelt_key_is_an_error_and_writes_nothing(tmp_path):
  # --traceback shows the traceback for bad input too; the error line stays the last line.
  proc = run("--config", "configs/tiny.py", "--workdir", str(tmp_path / "x"),
             "--config.learner.learning_rat=0.1", "--traceback")
  assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr
  assert proc.stderr.splitlines()[-1].startswith("error: unknown config key(s)"
                                                 " learner.learning_rat")
  assert not (tmp_path / "x").exists()


def test_bad_value_fails_before_any_output(tmp_path):
  proc = run("--config", "configs/tiny.py", "--workdir", str(tmp_path / "x"),
             "--config.learner.learning_rate=-1.0")
  assert proc.returncode == 2 and "learner.learning_rate" in proc.stderr
  assert not (tmp_path / "x").exists()


def test_plain_single_lora_baseline_runs(tmp_path):
  """The comparison the README gives: Online-LoRA's parts off, no hard buffer (K = 0)."""
  workdir = tmp_path / "plain"
  proc = run("--config", "configs/tiny.py", "--workdir", str(workdir),
             "--config.learner.incremental_lora=False", "--config.learner.hard_loss=False",
             "--config.learner.buffer_size=0", "--config.eval.write_plots=False")  # no figures:
  # output-only, not read here (test_all_methods_cli.py holds the command line's figures)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["n_plateaus"] == 0 and results["samples_seen"] == 1438
