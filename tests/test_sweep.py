"""launch/sweep.py's cells without a scheduler: each run's exit is recorded in its workdir, a run
that did not exit 0 is failed (with its one line) and runs again, never skipped as finished,
--fail_fast stops at the first, --status reads the workdirs, and the SLURM batch script's
shape (the SLURM runs themselves: test_slurm.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from tiny_run import ROOT

from launch import cells, slurm


def _load_sweep():
  spec = importlib.util.spec_from_file_location("sweep", ROOT / "launch" / "sweep.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _fake_run(code: int, results: bool = False, line: str = "boom; fix it") -> list[str]:
  """A stand-in for launch/run.py: writes results.json (when asked), then exits `code` with
  run.py's last stderr line."""
  script = ("import json, os, sys; w = sys.argv[1]; os.makedirs(w, exist_ok=True)\n"
            f"if {results}: json.dump({{'A_final': 0.5}}, open(os.path.join(w, 'results.json'),"
            " 'w'))\n"
            f"if {code}: print('progress...\\nerror: {line}', file=sys.stderr)\n"
            f"sys.exit({code})")
  return [sys.executable, "-c", script]


def _sweep_args(**kw) -> argparse.Namespace:
  return argparse.Namespace(**{"dry_run": False, "fail_fast": False, **kw})


def test_a_failed_run_is_recorded_reported_and_run_again(tmp_path, capsys):
  sweep = _load_sweep()
  ok, late, bad, never = (str(tmp_path / n) for n in ("ok", "late", "bad", "never"))
  runs = [(ok, _fake_run(0, results=True) + [ok]),
          (late, _fake_run(1, results=True, line="plots failed") + [late]),  # results, then 1
          (bad, _fake_run(3, line="non-finite loss at stream step 7") + [bad]),
          (never, _fake_run(0, results=True) + [never])]
  code, stop = sweep.execute(runs, _sweep_args())
  out = capsys.readouterr().out
  assert (code, stop) == (1, False)  # the first failure's code; 1 and 3 do not stop the sweep
  assert f"{late}: failed (exit 1): plots failed" in out
  assert f"{bad}: failed (exit 3): non-finite loss at stream step 7" in out
  assert cells.read_record(late)["code"] == 1 and cells.read_record(ok)["code"] == 0
  assert not cells.is_finished(late) and cells.is_finished(ok) and cells.is_finished(never)
  assert cells.cell_status(late) == ("failed", "exit 1: plots failed")
  # The same sweep again skips the finished runs and reruns the failed ones, results or not.
  runs[1] = (late, _fake_run(0, results=True) + [late])
  sweep.execute(runs, _sweep_args())
  out = capsys.readouterr().out
  assert f"{ok}: finished, skipped" in out and f"{late}: resuming (it failed before)" in out
  assert f"{bad}: failed (exit 3)" in out and cells.is_finished(late)
  # --fail_fast: the first failed run stops the sweep; the rest wait.
  for workdir in (bad, never):
    os.remove(os.path.join(workdir, cells.EXIT_RECORD))
  os.remove(os.path.join(never, "results.json"))
  code, stop = sweep.execute(runs, _sweep_args(fail_fast=True))
  assert (code, stop) == (3, True)
  assert "sweep stopped at the first failed run (--fail_fast)" in capsys.readouterr().err
  assert cells.cell_status(never) == ("not started", "")


def test_status_reads_every_state_from_the_workdirs(tmp_path):
  root = tmp_path / "sweep"
  names = ["done", "failed", "stopped", "running", "gone", "waiting"]
  cells.write_plan(str(root), [{"workdir": str(root / n), "command": [], "tuning": None}
                               for n in names])
  (root / "done").mkdir()
  (root / "done" / "results.json").write_text("{}")
  cells.write_record(str(root / "done"), {"state": "exited", "code": 0, "seconds": 12.0})
  cells.write_record(str(root / "failed"), {"state": "exited", "code": 2,
                                            "line": "learner.batch_size=0 must be >= 1"})
  cells.write_record(str(root / "stopped"), {"state": "exited", "code": 143,
                                             "line": "stopped by signal 15 after stream step 9"})
  for name, pid in (("running", os.getpid()), ("gone", 2 ** 22 + 7)):
    cells.write_record(str(root / name), {"state": "running", "pid": pid, "host": os.uname()[1],
                                          "since": "now", "slurm_task": "7_3"})
    (root / name / "stream_manifest.json").write_text(json.dumps({"steps": [[0]] * 46}))
    (root / name / "metrics.jsonl").write_text('{"step": 0}\n{"step": 11, "event": "train"}\n')
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), "--status",
                         str(root)], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == f"{root}/done: finished, 12 s"
  assert lines[1] == f"{root}/failed: failed, exit 2: learner.batch_size=0 must be >= 1"
  assert lines[2].startswith(f"{root}/stopped: stopped, exit 143: stopped by signal 15")
  assert lines[3].startswith(f"{root}/running: running, step 12 of 46 (pid {os.getpid()} on")
  assert "SLURM task 7_3" in lines[3]
  assert lines[4].startswith(f"{root}/gone: stopped, killed (pid 4194311")
  assert lines[5] == f"{root}/waiting: not started"
  assert lines[6] == "6 cells: 1 finished, 1 running, 2 stopped, 1 failed, 1 not started"
  (tmp_path / "empty").mkdir()
  for bad, says in ((tmp_path / "nope", "no such directory"),
                    (tmp_path / "empty", "no sweep there")):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), "--status",
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and not proc.stdout


def test_slurm_dry_run_prints_one_batch_script_and_writes_nothing(tmp_path):
  root = tmp_path / "sweep"
  command = [sys.executable, str(ROOT / "launch" / "sweep.py"), f"--root={root}",
             "--settings=configs/tiny.py", "--methods=finetune,er", "--seeds=0,1",
             "--launcher=slurm", "--partition=gpu", "--time=4:00:00", "--mem=16G", "--cpus=4",
             "--gres=gpu:1", "--throttle=2", "--sbatch=--account=abc", "--signal_lead=300",
             "--dry_run"]
  proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  for line in ("#SBATCH --partition=gpu", "#SBATCH --time=4:00:00", "#SBATCH --mem=16G",
               "#SBATCH --cpus-per-task=4", "#SBATCH --gres=gpu:1", "#SBATCH --account=abc",
               "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
               f"sbatch --parsable --array=0-3%2 {root}/slurm/sweep.sbatch"):
    assert line in proc.stdout.splitlines()
  assert 'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in proc.stdout
  assert not root.exists()
  # With --tune, the seeds wait for the tuning points (a second array, after the first).
  tuned = subprocess.run([*command, "--tune", "--grid=learning_rate=1e-3,1e-2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert tuned.returncode == 0, tuned.stderr
  assert "--array=0-3%2 " in tuned.stdout and "--array=4-7%2 --dependency=afterany:" in tuned.stdout
  assert not root.exists()


@pytest.mark.parametrize("flags, says", [
    (["--time=1:00:00"], "--time only apply to --launcher slurm; add it or drop them"),
    (["--launcher=slurm", "--throttle=-1"], "--throttle=-1 must be >= 0"),
    (["--launcher=slurm", "--cpus=0"], "--cpus=0 must be >= 1"),
])
def test_bad_launcher_flags_are_one_line(tmp_path, flags, says):
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"),
                         f"--root={tmp_path / 'r'}", "--settings=configs/tiny.py",
                         "--methods=finetune", *flags], capture_output=True, text=True,
                        timeout=120, cwd=ROOT)
  assert proc.returncode == 2 and says in proc.stderr.splitlines()[-1]
  assert not (tmp_path / "r").exists()


def test_array_ranges():
  assert slurm.array_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
  assert slurm.array_ranges([3]) == "3"


def _tune_args(**kw) -> argparse.Namespace:
  return argparse.Namespace(**{"root": "R", "settings": ["configs/tiny.py"], "grid": None,
                               "tune_seed": 0, "tune_metric": "A_final",
                               "validation_fraction": 0.1, "overrides": [], **kw})


def test_online_lora_is_tuned_in_its_learner_block():
  sweep = _load_sweep()
  plans = {p["method"]: p for p in sweep.tuning_plans(_tune_args(methods=["online_lora", "er"]))}
  ol, er = plans["online_lora"], plans["er"]
  # Online-LoRA's grid: learning rate and the plateau rule's thresholds, keys of `learner`.
  assert ol["block"] == "learner" and er["block"] == "er"
  assert set(ol["points"][0]) == {"learning_rate", "mean_threshold", "var_threshold"}
  assert len(ol["points"]) == len(sweep.grid_points(sweep.TUNING_GRIDS["online_lora"])) <= 12
  assert ol["workdirs"][0] == os.path.join("R", "tiny", "online_lora", "tune",
                                           "lr0.0001_mean3.5_var0.05")
  assert ol["commands"][0][-4:] == [
      "--config.data.validation_fraction=0.1", "--config.learner.learning_rate=0.0001",
      "--config.learner.mean_threshold=3.5", "--config.learner.var_threshold=0.05"]
  # The baselines' points keep their names and their blocks' overrides.
  assert er["workdirs"][0].endswith(os.path.join("er", "tune", "lr0.0001_wd0.0001"))
  assert er["commands"][0][-2:] == ["--config.er.learning_rate=0.0001",
                                    "--config.er.weight_decay=0.0001"]
  # Every default grid names float keys of its method's block; a --grid key a tuned method's
  # block lacks is refused before anything runs, in one line.
  assert sweep.grid_problem(_tune_args(methods=list(sweep.TUNING_GRIDS))) is None
  problem = sweep.grid_problem(_tune_args(methods=["online_lora", "er"],
                                          grid=sweep.parse_grid("mean_threshold=3,4")))
  assert problem.startswith("--grid key 'mean_threshold': method=er reads no float key"
                            " er.mean_threshold;")
  with pytest.raises(argparse.ArgumentTypeError, match="number values"):
    sweep.parse_grid("mean_threshold=high")


def test_bad_grid_key_is_one_line_before_any_run(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"),
                         f"--root={tmp_path / 'r'}", "--settings=configs/tiny.py",
                         "--methods=online_lora", "--tune", "--grid=window=3,5"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 2, proc.stderr
  assert ("--grid key 'window': method=online_lora reads no float key learner.window;"
          in proc.stderr.splitlines()[-1])
  assert not (tmp_path / "r").exists()


def test_tuned_online_lora_runs_its_seed_with_the_pick_and_the_report_says_so(tmp_path):
  # Two learning rates (1e-7 learns nothing), with the thresholds that let plateaus fire on the
  # tiny stream (tiny_run.py): every key of the point is one of the `learner` block's.
  root = tmp_path / "tune"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "sweep.py"), f"--root={root}",
       "--settings=configs/tiny.py", "--methods=online_lora", "--seeds=0", "--tune",
       "--grid=learning_rate=1e-7,3e-3;mean_threshold=6;var_threshold=1", "--",
       "--config.data.test_fraction=0.7", "--config.eval.write_plots=False"],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  method_dir = root / "tiny" / "online_lora"
  record = json.loads((method_dir / "tuning.json").read_text())
  assert record["block"] == "learner" and record["metric"] == "A_final"
  scores = []
  for entry, tag in zip(record["scores"], ("lr1e-07_mean6_var1", "lr0.003_mean6_var1"),
                        strict=True):
    results = json.loads((method_dir / "tune" / tag / "results.json").read_text())
    assert entry["score"] == results["A_final"]  # each point scored by its validation run
    scores.append(entry["score"])
  assert scores[0] != scores[1]
  best = record["scores"][scores.index(max(scores))]["point"]
  assert record["chosen"] == best
  # The test seed ran with the pick, on the test set.
  config = json.loads((method_dir / "seed0" / "config.json").read_text())
  assert config["learner"]["learning_rate"] == best["learning_rate"]
  assert config["learner"]["mean_threshold"] == 6.0 and config["learner"]["var_threshold"] == 1.0
  assert config["data"]["validation_fraction"] == 0
  # The report marks the tuned row and says on what; the validation runs stay out of the table.
  report = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), str(root)],
                          capture_output=True, text=True, timeout=120)
  assert report.returncode == 0, report.stderr
  row = (f"| Online-LoRA (tuned: learning_rate={best['learning_rate']:g}, mean_threshold=6,"
         " var_threshold=1) | ")
  assert row in report.stdout
  assert ("(tuned: ...): the grid point `launch/sweep.py --tune` picked by validation A_final on"
          " the training split less a held-out 10%, seed 0" in report.stdout)
  assert f"note: {method_dir / 'tune'} holds sweep --tune's validation runs" in report.stderr
  # A seed that finished with other values than the pick (run before the tuning, say) is kept:
  # the sweep skips it with a note, and the report does not label it tuned.
  config["learner"]["mean_threshold"] = 5.0
  (method_dir / "seed0" / "config.json").write_text(json.dumps(config))
  again = subprocess.run(proc.args, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert again.returncode == 0, again.stderr[-2000:]
  assert (f"note: {method_dir / 'seed0'} finished with other values than the pick in"
          f" {method_dir}/tuning.json; it is kept and skipped" in again.stderr)
  report = subprocess.run([sys.executable, str(ROOT / "launch" / "report.py"), str(root)],
                          capture_output=True, text=True, timeout=120)
  assert report.returncode == 0 and "| Online-LoRA | " in report.stdout
  assert "tuned" not in report.stdout
