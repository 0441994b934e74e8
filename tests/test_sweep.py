"""launch/sweep.py's cells without a scheduler: each run's exit is recorded in its workdir, a run
that did not exit 0 is failed (with its one line) and runs again, never skipped as finished,
--fail_fast stops at the first, --status reads the workdirs, and the SLURM batch script's
shape (the SLURM runs themselves: test_slurm.py)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tiny_run import ROOT

import olora_jax.sweep as api
from olora_jax.sweep import cells, local, plan, slurm
from olora_jax.sweep.status import cell_status


def _fake_run(code: int, results: bool = False, line: str = "boom; fix it") -> list[str]:
  """A stand-in for launch/run.py: writes results.json (when asked), then exits `code` with
  run.py's last stderr line."""
  script = ("import json, os, sys; w = sys.argv[1]; os.makedirs(w, exist_ok=True)\n"
            f"if {results}: json.dump({{'A_final': 0.5}}, open(os.path.join(w, 'results.json'),"
            " 'w'))\n"
            f"if {code}: print('progress...\\nerror: {line}', file=sys.stderr)\n"
            f"sys.exit({code})")
  return [sys.executable, "-c", script]


def _sweep_args(**kw) -> plan.Sweep:
  return plan.Sweep(**{"root": "", "settings": [], "methods": [], **kw})


def test_the_api_plans_a_grid_and_reads_its_state_as_data(tmp_path):
  """olora_jax.sweep from Python: plan_cells lists (and writes) the cells the command line plans,
  read_status gives what --status prints, one dict per cell; a setting that does not exist or a
  SLURM option out of range is the command line's one line, as a ValueError."""
  root, tiny = str(tmp_path / "sw"), str(ROOT / "configs" / "tiny.py")
  planned = api.plan_cells(root, [tiny], ["er"], seeds=[0, 1], write=True)
  workdirs = [os.path.join(root, "tiny", "er", f"seed{s}") for s in (0, 1)]
  assert [c["workdir"] for c in planned] == workdirs and planned[0]["tuning"] is None
  assert planned[1]["command"][-4:-2] == ["--config.method=er", "--config.seed=1"]
  stored = json.loads((tmp_path / "sw" / cells.PLAN).read_text())["cells"]
  assert [c["workdir"] for c in stored] == [os.path.join("tiny", "er", f"seed{s}") for s in (0, 1)]
  cells.write_record(workdirs[0], {"state": "exited", "code": 3, "line": "non-finite loss",
                                   "seconds": 5.0, "allocations": 1})
  rows = api.read_status(root)
  assert [(r["setting"], r["method"], r["seed"], r["point"], r["state"]) for r in rows] == [
      ("tiny", "er", 0, None, "failed"), ("tiny", "er", 1, None, "not started")]
  assert {k: rows[0][k] for k in ("code", "line", "seconds", "detail", "step", "slurm_task")} == {
      "code": 3, "line": "non-finite loss", "seconds": 5.0, "detail": "exit 3: non-finite loss",
      "step": None, "slurm_task": None}
  assert rows[1]["code"] is None and rows[1]["seconds"] is None
  with pytest.raises(ValueError, match=r"config file\(s\) \['configs/nope.py'\] do not exist"):
    api.plan_cells(root, ["configs/nope.py"], ["er"])
  with pytest.raises(ValueError, match=r"--cpus=0 must be >= 1"):  # as the flag is refused
    api.submit(root, [tiny], ["er"], dry_run=True, cpus=0)


def test_the_api_refuses_what_would_plan_a_wrong_grid_in_one_line(tmp_path):
  """A string for `settings` or `methods` was read letter by letter ("config file(s) ['c', 'o',
  ...] do not exist", "unknown method='f'"), seeds=[0, 0] planned two cells of one workdir, an
  empty grid said "every grid point failed" and an unknown override was planned unchecked."""
  root, tiny = str(tmp_path / "sw"), str(ROOT / "configs" / "tiny.py")
  with pytest.raises(TypeError, match=re.escape(
      f"settings={tiny!r}: give a list of config files, e.g. settings=[{tiny!r}]")):
    api.plan_cells(root, tiny, ["er"])
  with pytest.raises(TypeError, match=re.escape(
      "methods='er': give a list of method names, e.g. methods=['er']")):
    api.run_local(root, [tiny], "er", dry_run=True)
  with pytest.raises(TypeError, match=re.escape("seeds=['0']: '0' is not one of the integer")):
    api.plan_cells(root, [tiny], ["er"], seeds=["0"])
  with pytest.raises(ValueError, match=re.escape(
      "seeds [0, 0] name 0 more than once: each cell has one workdir and runs once")):
    api.plan_cells(root, [tiny], ["er"], seeds=[0, 0])
  with pytest.raises(ValueError, match=re.escape(
      "methods is empty: the sweep has no cells; give at least one")):
    api.plan_cells(root, [tiny], [])
  with pytest.raises(ValueError, match=re.escape(
      "grid key 'learning_rate' has the values []: give a non-empty list of numbers")):
    api.run_local(root, [tiny], ["er"], tune=True, grid={"learning_rate": []})
  with pytest.raises(ValueError, match=re.escape(
      "unknown config key(s) learner.rnak in the overrides: no code reads them; fix the spelling"
      " (did you mean learner.rank?)")):
    api.plan_cells(root, [tiny], ["er"], overrides=["--config.learner.rnak=4"])
  # Keys of any of the sweep's methods' blocks pass (each run warns of another method's block).
  overrides = ["--config.learner.rank=4", "--config.er.replay_batch=8"]
  assert len(api.plan_cells(root, [tiny], ["er", "online_lora"], seeds=[0],
                            overrides=overrides)) == 2
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match=re.escape(
      f"--root {tmp_path / 'file'} is a file, not a directory")):
    api.plan_cells(str(tmp_path / "file"), [tiny], ["er"], write=True)
  assert not os.path.exists(root)  # nothing was written


def test_a_root_that_is_a_file_is_one_line_for_every_command(tmp_path):
  """`--root FILE` ended in a FileExistsError traceback."""
  path = tmp_path / "file"
  path.write_text("")
  for args in ([f"--root={path}", "--settings=configs/tiny.py", "--methods=er", "--seeds=0"],
               ["--status", str(path)], ["--cancel", str(path)]):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{path} is a file, not a directory: a sweep's root holds its cells' workdirs" in (
        proc.stderr.splitlines()[-1]), proc.stderr


def test_a_cell_whose_interpreter_is_missing_ends_in_one_line_and_blocks_nothing(tmp_path):
  """A missing interpreter in command[0] ended in a FileNotFoundError traceback and left a
  "running, pid None" record that refused the next --run_cell for 120 s."""
  root = tmp_path / "sw"
  workdir = root / "a"
  cells.write_plan(str(root), [{"workdir": str(workdir), "command": ["/no/such/python", "x.py"],
                                "tuning": None}])
  sweep = [sys.executable, str(ROOT / "launch" / "sweep.py"), "--run_cell", str(root), "0"]
  for _ in range(2):  # the second is not blocked by the first
    proc = subprocess.run(sweep, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: cannot start {workdir}'s run: /no/such/python: No such file or directory (the"
        " first word of its command in the sweep's plan); if that Python moved or is gone, run"
        " the same sweep command again with the Python to use: it rewrites the cells' commands")
    record = cells.read_record(str(workdir))
    assert record["state"] == "exited" and record["code"] == 2, record
  assert cell_status(str(workdir))[0] == "failed"


def test_a_runner_that_died_before_its_run_started_blocks_nothing(tmp_path):
  """A running record without its run's pid (the runner died before starting it) is judged by
  the runner's own pid on its host, not held for the heartbeat's 120 s."""
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  record = {"state": "running", "pid": None, "runner": dead.pid, "host": socket.gethostname(),
            "since": cells.now(), "heartbeat": cells.now()}
  assert not cells._live_elsewhere(record, None)
  assert cells._live_elsewhere({**record, "runner": os.getpid()}, None)


def test_a_resubmission_does_not_queue_a_cell_still_queued_or_running(tmp_path, monkeypatch,
                                                                     capsys):
  """The same --launcher slurm command again while a cell ran queued a duplicate, whose refusal
  made --status call the running cell lost. A cell whose task the scheduler still holds is not
  submitted again."""
  root, tiny = str(tmp_path / "sw"), str(ROOT / "configs" / "tiny.py")
  planned = api.plan_cells(root, [tiny], ["er"], seeds=[0, 1, 2], write=True)
  with cells.plan_lock(root):
    merged = cells.load_plan(root)
    for i in range(3):
      merged[i]["slurm"] = {"task": f"7_{i}", "jobs": ["7"], "max_requeues": 1,
                            "requeue_on": [], "fail_fast": False, "ntasks": 1, "cpus": 1}
    cells.write_plan(root, merged)
  states = {"7_0": "RUNNING", "7_1": "PENDING", "7_2": "COMPLETED"}
  monkeypatch.setattr(slurm, "tasks", lambda ids: {
      i: {"state": states[i], "reason": "", "exit": "0", "restarts": 0} for i in ids})
  assert api.submit(root, [tiny], ["er"], seeds=[0, 1, 2], dry_run=True) == 0
  out = capsys.readouterr().out
  assert f"{planned[0]['workdir']}: already queued or running (SLURM task 7_0, RUNNING): not" \
      " submitted again" in out
  assert "(SLURM task 7_1, PENDING)" in out and "7_2" not in out
  assert "3 cells, 0 finished, 2 queued or running, 1 to submit" in out
  assert "--array=2 " in out  # only the cell whose task ended


def test_a_failed_run_is_recorded_reported_and_run_again(tmp_path, capsys):
  ok, late, bad, never = (str(tmp_path / n) for n in ("ok", "late", "bad", "never"))
  runs = [(ok, _fake_run(0, results=True) + [ok]),
          (late, _fake_run(1, results=True, line="plots failed") + [late]),  # results, then 1
          (bad, _fake_run(3, line="non-finite loss at stream step 7") + [bad]),
          (never, _fake_run(0, results=True) + [never])]
  code, stop = local.execute(runs, _sweep_args())
  out = capsys.readouterr().out
  assert (code, stop) == (1, False)  # the first failure's code; 1 and 3 do not stop the sweep
  assert f"{late}: failed (exit 1): plots failed" in out
  assert f"{bad}: failed (exit 3): non-finite loss at stream step 7" in out
  assert cells.read_record(late)["code"] == 1 and cells.read_record(ok)["code"] == 0
  assert not cells.is_finished(late) and cells.is_finished(ok) and cells.is_finished(never)
  assert cell_status(late) == ("failed", "exit 1: plots failed")
  # The same sweep again skips the finished runs and reruns the failed ones, results or not.
  runs[1] = (late, _fake_run(0, results=True) + [late])
  local.execute(runs, _sweep_args())
  out = capsys.readouterr().out
  assert f"{ok}: finished, skipped" in out and f"{late}: resuming (it failed before)" in out
  assert f"{bad}: failed (exit 3)" in out and cells.is_finished(late)
  # --fail_fast: the first failed run stops the sweep; the rest wait.
  for workdir in (bad, never):
    os.remove(os.path.join(workdir, cells.EXIT_RECORD))
  os.remove(os.path.join(never, "results.json"))
  code, stop = local.execute(runs, _sweep_args(fail_fast=True))
  assert (code, stop) == (3, True)
  assert "sweep stopped at the first failed run (--fail_fast)" in capsys.readouterr().err
  assert cell_status(never) == ("not started", "")


def test_a_cell_whose_results_json_is_damaged_is_not_finished(tmp_path):
  (tmp_path / "results.json").write_text('{"A_final": 0.5, "forg')  # cut short
  cells.write_record(str(tmp_path), {"state": "exited", "code": 0})
  assert not cells.is_finished(str(tmp_path))
  (tmp_path / "results.json").write_text('{"A_final": 0.5}')
  assert cells.is_finished(str(tmp_path))


def _checkpoints(workdir, *steps: int) -> None:
  for step in steps:
    (workdir / "checkpoints" / str(step)).mkdir(parents=True)


def test_status_reads_every_state_from_the_workdirs(tmp_path):
  """Without a scheduler: each state from the workdir, the step shown the newest checkpoint's
  (not the run log's last line), a running record judged by its pid on this host and by its
  heartbeat elsewhere; the plan's workdirs are relative, so a moved root shows its own paths."""
  old_root, root = tmp_path / "before", tmp_path / "sweep"
  names = ["done", "failed", "stopped", "running", "gone", "silent", "waiting"]
  cells.write_plan(str(old_root), [{"workdir": str(old_root / n), "command": ["python"],
                                    "tuning": None}
                                   for n in names])
  assert json.loads((old_root / "sweep.json").read_text())["cells"][0]["workdir"] == "done"
  old_root.rename(root)
  (root / "done").mkdir()
  (root / "done" / "results.json").write_text("{}")
  cells.write_record(str(root / "done"), {"state": "exited", "code": 0, "seconds": 46.0,
                                          "allocations": 6})
  cells.write_record(str(root / "failed"), {"state": "exited", "code": 2,
                                            "line": "learner.batch_size=0 must be >= 1"})
  cells.write_record(str(root / "stopped"), {"state": "exited", "code": 4, "line":
                                             "cannot write to workdir (No space left on device)"})
  cells.write_record(str(root / "stopped"), {"state": "exited", "code": 137,
                                             "line": "killed by SIGKILL before it could checkpoint",
                                             "seconds": 30.0, "allocations": 2})
  stale = (datetime.datetime.now().astimezone() - datetime.timedelta(seconds=600)).isoformat()
  for name, pid, host, beat in (("running", os.getpid(), os.uname()[1], cells.now()),
                                ("gone", 2 ** 22 + 7, os.uname()[1], cells.now()),
                                ("silent", 1234, "node17", stale)):
    cells.write_record(str(root / name), {"state": "running", "pid": pid, "host": host,
                                          "since": "then", "heartbeat": beat,
                                          "slurm_task": "7_3"})
  for name in ("stopped", "running", "gone", "silent"):
    (root / name / "stream_manifest.json").write_text(json.dumps({"steps": [[0]] * 46}))
    # The run log is ahead of the newest checkpoint: a resume starts from the checkpoint.
    (root / name / "metrics.jsonl").write_text('{"step": 0}\n{"step": 14, "event": "train"}\n')
    _checkpoints(root / name, 8, 12)
  proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), "--status",
                         str(root)], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == f"{root}/done: finished, 46 s over 6 allocations"
  assert lines[1] == f"{root}/failed: failed, exit 2: learner.batch_size=0 must be >= 1"
  assert lines[2] == (f"{root}/stopped: stopped, exit 137: killed by SIGKILL before it could"
                      " checkpoint; checkpoint at step 12 of 46 (30 s over 2 allocations so far)")
  assert lines[3].startswith(f"{root}/running: running, checkpoint at step 12 of 46 (pid"
                             f" {os.getpid()} on {os.uname()[1]}, SLURM task 7_3, since then)")
  assert lines[4] == (f"{root}/gone: lost, pid 4194311 on {os.uname()[1]}, SLURM task 7_3 is gone"
                      " without an exit record; resumes from its checkpoint at step 12 of 46")
  assert lines[5].startswith(f"{root}/silent: lost, no heartbeat from pid 1234 on node17, SLURM"
                             " task 7_3 for ")
  assert lines[5].endswith(f" s (stale after {cells.STALE_SECONDS} s); resumes from its"
                           " checkpoint at step 12 of 46")
  assert lines[6] == f"{root}/waiting: not started"
  assert lines[7] == ("7 cells: 1 finished, 1 running, 0 queued, 1 stopped, 2 lost, 1 failed,"
                      " 1 not started")
  # The scheduler runs a cell's task before its run has written a record: the line names the task.
  assert cell_status(str(root / "waiting"), {"state": "RUNNING"}, None, "7_4") == (
      "running", "setting up (SLURM task 7_4, scheduler: RUNNING)")
  (tmp_path / "empty").mkdir()
  for bad, says in ((tmp_path / "nope", "no such directory"),
                    (tmp_path / "empty", "no sweep there")):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), "--status",
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and not proc.stdout


@pytest.mark.parametrize("damage, says", [
    ('{"cells": [{"workdir": "a"', "Expecting ',' delimiter"),
    ("[]", "a JSON list, not the object of a plan"),
    ('{"cells": 5}', "'cells' is not a list"),
    ('{"cells": [{"command": []}]}', "cell 0 has no workdir"),
    ('{"cells": [{"workdir": "a", "command": ["python"], "slurm": 7}]}',
     "cell 0's 'slurm' is 7, not an object (or null)")])
def test_a_damaged_plan_is_one_line_wherever_it_is_read(tmp_path, damage, says):
  """ROOT/sweep.json cut short or edited: --status, a resubmission and an array task each end
  with exit 2 and one line naming the file, what is wrong and how to go on; the file is kept."""
  root = tmp_path / "sweep"
  root.mkdir()
  (root / cells.PLAN).write_text(damage)
  sweep = [sys.executable, str(ROOT / "launch" / "sweep.py")]
  for args in (["--status", str(root)],
               [f"--root={root}", "--settings=configs/tiny.py", "--methods=er", "--seeds=0"],
               ["--run_cell", str(root), "0"]):
    proc = subprocess.run(sweep + args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, (args, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {root / cells.PLAN} is damaged ({says}") and (
        "run the same sweep command again to write it anew") in last, last
  assert (root / cells.PLAN).read_text() == damage
  assert sorted(p.name for p in root.iterdir()) == [cells.PLAN, cells.PLAN + ".lock"]


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
  assert not root.exists()
  # A cell over several processes, set-up lines, one compilation cache for every cell.
  multi = subprocess.run([*command, "--ntasks=4", "--gpus_per_task=1", "--gres=",
                          "--setup=module load cuda/12.4", "--setup=source ~/venv/bin/activate"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert multi.returncode == 0, multi.stderr
  lines = multi.stdout.splitlines()
  for line in ("#SBATCH --ntasks=4", "#SBATCH --gpus-per-task=1", "module load cuda/12.4",
               "source ~/venv/bin/activate", "export JAX_LOCAL_DEVICE_IDS=0",
               f"export JAX_COMPILATION_CACHE_DIR={root}/jax_cache"):
    assert line in lines, multi.stdout
  assert lines.index("module load cuda/12.4") < next(
      i for i, x in enumerate(lines) if "--run_cell" in x)
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
    (["--launcher=slurm", "--time=2", "--dry_run"],
     "--signal_lead=120 is not shorter than --time=2 (120 s): the warning would come before the"
     " cell could run; give a --signal_lead below 120"),
    (["--launcher=slurm", "--requeue_on=kill"], "'kill': give exit codes 1-255"),
    (["--setup=module load cuda"], "--setup only apply to --launcher slurm"),
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


def _tune_args(**kw) -> plan.Sweep:
  return plan.Sweep(**{"root": "R", "settings": ["configs/tiny.py"], "grid": None,
                       "tune_seed": 0, "tune_metric": "A_final",
                       "validation_fraction": 0.1, "overrides": [], **kw})


def test_online_lora_is_tuned_in_its_learner_block():
  plans = {p["method"]: p for p in plan.tuning_plans(_tune_args(methods=["online_lora", "er"]))}
  ol, er = plans["online_lora"], plans["er"]
  # Online-LoRA's grid: learning rate and the plateau rule's thresholds, keys of `learner`.
  assert ol["block"] == "learner" and er["block"] == "er"
  assert set(ol["points"][0]) == {"learning_rate", "mean_threshold", "var_threshold"}
  assert len(ol["points"]) == len(plan.grid_points(plan.TUNING_GRIDS["online_lora"])) <= 12
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
  assert plan.grid_problem(_tune_args(methods=list(plan.TUNING_GRIDS))) is None
  problem = plan.grid_problem(_tune_args(methods=["online_lora", "er"],
                                         grid=plan.parse_grid("mean_threshold=3,4")))
  assert problem.startswith("--grid key 'mean_threshold': method=er reads no float key"
                            " er.mean_threshold;")
  with pytest.raises(argparse.ArgumentTypeError, match="number values"):
    plan.parse_grid("mean_threshold=high")


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
         " var_threshold=1) [^a] | ")  # [^a]: the paper's fidelity, not the checked one
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
  assert report.returncode == 0 and "| Online-LoRA [^a] | " in report.stdout
  assert "tuned" not in report.stdout


def _script(body: str) -> list[str]:
  return [sys.executable, "-c", body]


def test_wall_time_sums_allocations_and_a_duplicate_leaves_a_finished_record(tmp_path):
  workdir = str(tmp_path / "cell")
  stop = _script("import sys, time; time.sleep(0.3); print('error: stopped by signal 15 after"
                 " stream step 3', file=sys.stderr); sys.exit(143)")
  for _ in range(2):  # two allocations, each stopped by the scheduler's signal
    assert cells.run_cell(workdir, stop)[:2] == (143, "stopped by signal 15 after stream step 3")
  record = cells.read_record(workdir)
  assert record["allocations"] == 2 and 0.6 <= record["seconds"] < 30, record
  # Another runner finishes the cell while this one's run goes: its record is kept.
  finish = _script(
      "import json, os, sys; w = sys.argv[1]; open(os.path.join(w, 'results.json'), 'w')"
      ".write('{}'); json.dump({'state': 'exited', 'code': 0, 'run': 'other', 'seconds': 46.0,"
      " 'allocations': 3}, open(os.path.join(w, 'exit.json'), 'w'))")
  assert cells.run_cell(workdir, [*finish, workdir])[0] == 0
  assert cells.read_record(workdir)["run"] == "other"
  assert cell_status(workdir) == ("finished", "46 s over 3 allocations")
  # A duplicate task started once the cell finished runs nothing and writes nothing.
  assert cells.run_cell(workdir, _script("raise SystemExit(9)")) == (0, "finished earlier", False)
  assert cells.read_record(workdir)["seconds"] == 46.0
  # A duplicate refused because the first holds the workdir leaves the first's record.
  busy = str(tmp_path / "busy")
  cells.write_record(busy, {"state": "running", "run": "first", "pid": 1, "host": "n1"})
  refused = _script("import sys; print('error: workdir x is in use by pid 1 on host n1; wait',"
                    " file=sys.stderr); sys.exit(4)")
  assert cells.run_cell(busy, refused)[0] == 4
  assert cells.read_record(busy)["run"] == "first"
  # A duplicate started while the first runner's run goes on (its pid alive here, or a fresh
  # heartbeat from another host) neither starts the run nor touches the record, so the first
  # one's exit record is the cell's (SLURM: a resubmission in the first task's last seconds).
  ran = tmp_path / "ran"
  touch = _script(f"open({str(ran)!r}, 'w').close()")
  live = {"state": "running", "run": "first", "pid": os.getpid(), "host": socket.gethostname(),
          "since": cells.now(), "slurm_task": "7_0"}
  elsewhere = {**live, "pid": 1, "host": "n1", "heartbeat": cells.now()}
  for record in (live, elsewhere):
    cells.write_record(busy, record)
    code, line, _ = cells.run_cell(busy, touch)
    assert code == 4 and line.startswith(f"workdir {busy} is in use by pid {record['pid']} on"
                                         f" {record['host']} (SLURM task 7_0)"), line
    assert cells.read_record(busy) == record and not ran.exists()
  # The same array task's earlier allocation on another host, or a dead pid here, is over.
  for record in ({**elsewhere, "slurm_task": "8_0"}, {**live, "pid": _dead_pid()}):
    cells.write_record(busy, record)
    with mock_env({"SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "0"}):
      assert cells.run_cell(busy, touch)[0] == 0
    assert ran.exists() and cells.read_record(busy)["state"] == "exited"
    ran.unlink()


def test_an_allocation_killed_with_its_runner_counts_until_its_last_write(tmp_path):
  """A runner SIGKILLed with its allocation leaves a running record whose heartbeat is up to
  HEARTBEAT_SECONDS old: the next start adds what the run did after it (until its last write
  to metrics.jsonl) to the cell's wall time."""
  workdir = tmp_path / "cell"
  workdir.mkdir()
  beat = (datetime.datetime.now().astimezone() - datetime.timedelta(seconds=50)).isoformat()
  cells.write_record(str(workdir), {"state": "running", "run": "gone", "pid": _dead_pid(),
                                    "host": socket.gethostname(), "since": beat,
                                    "heartbeat": beat, "seconds": 100.0, "allocations": 1})
  (workdir / "metrics.jsonl").write_text("{}\n")
  written = time.time() - 20  # its last step's line: 30 s after the heartbeat
  os.utime(workdir / "metrics.jsonl", (written, written))
  assert cells.run_cell(str(workdir), _script("pass"))[0] == 0
  record = cells.read_record(str(workdir))
  assert record["allocations"] == 2
  assert 129 <= record["seconds"] < 140, record  # 100 + 30 + this allocation's own
  assert cells._unrecorded_seconds(str(workdir), record) == 0.0  # an exit record: nothing


def _limited_memory_cgroup(tmp_name: str, limit: int) -> Path | None:
  """A memory cgroup of this process's own (cgroup v1 here; v2 where the parent delegates the
  memory controller) holding at most `limit` bytes, or None where one cannot be made (no
  memory controller, not root, a read-only hierarchy)."""
  counter = cells.memory_cgroup(os.getpid())
  if counter is None or "oom_kill " not in Path(counter).read_text():  # a kernel that counts
    return None
  path = Path(counter).parent / tmp_name
  limits = (["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            if counter.endswith("oom_control") else ["memory.max", "memory.swap.max"])
  try:
    path.mkdir()
    for i, name in enumerate(limits):
      try:
        (path / name).write_text(str(limit if i == 0 or "memsw" in name else 0))
      except OSError:
        # The swap limit cannot be set: with swap on, the run would swap instead of being
        # killed, so no such cgroup is of use.
        if i == 0 or _swap_bytes() > 0:
          raise
  except OSError:
    if path.exists():
      path.rmdir()
    return None
  return path


def _swap_bytes() -> int:
  with open("/proc/meminfo") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("SwapTotal:"))


def test_an_out_of_memory_kill_is_named_with_advice_a_plain_kill_is_not(tmp_path):
  """A run the out-of-memory killer stops (its memory cgroup counts the kill: cgroup v2's
  memory.events, v1's memory.oom_control) is named so, with advice that works (more memory or a
  smaller batch, not the same command again); a SIGKILL from elsewhere stays a kill."""
  group = _limited_memory_cgroup(f"olora-oom-{os.getpid()}", 256 * 2**20)
  if group is None:
    pytest.skip("no memory cgroup can be made here (needs root and a writable memory"
                " controller)")
  try:
    runner = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        open({str(group / "cgroup.procs")!r}, "w").write(str(os.getpid()))
        from olora_jax.sweep import cells
        hog = [sys.executable, "-c", "x = bytearray(2 << 30); x[::4096] = b'1' * len(x[::4096])"]
        print(json.dumps(cells.run_cell(sys.argv[1], hog)[:2]))
        """)
    done = subprocess.run([sys.executable, "-c", runner, str(tmp_path / "oom")],
                          capture_output=True, text=True, timeout=120)
    code, line = json.loads(done.stdout)
  finally:
    group.rmdir()
  assert code == 137, (code, line, done.stderr[-2000:])
  assert line == ("killed by the out-of-memory killer (its memory cgroup counted the kill) before"
                  f" it could checkpoint: {cells.OOM_ADVICE}")
  assert "--mem" in line and "batch_size" in line
  kill = _script("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
  assert cells.run_cell(str(tmp_path / "kill"), kill)[:2] == (
      137, "killed by SIGKILL before it could checkpoint")


def _dead_pid() -> int:
  """A pid no process has: a child's, once it has been waited for."""
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


@contextlib.contextmanager
def mock_env(values: dict):
  before = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in before.items():
      if v is None:
        os.environ.pop(k)
      else:
        os.environ[k] = v


def test_the_exit_record_is_written_when_the_disk_is_full(tmp_path, monkeypatch):
  """A full disk refuses the temporary file: the exit record overwrites the running one in
  place, within the bytes it already holds, so --status still shows the run's line."""
  workdir = str(tmp_path / "cell")
  cells.write_record(workdir, {"state": "running", "pid": 1, "command": ["x"] * 50})
  real_open = open

  def full(path, *args, **kwargs):
    if str(path).endswith(".tmp"):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr("builtins.open", full)
  line = ("cannot write to workdir (No space left on device); free space, then run the same"
          " command: it resumes from checkpoint 8")
  cells.update_record(workdir, lambda r: {**r, "state": "exited", "code": 4, "line": line})
  monkeypatch.setattr("builtins.open", real_open)
  assert cells.read_record(workdir)["line"] == line
  assert os.path.getsize(os.path.join(workdir, cells.EXIT_RECORD)) == cells.RECORD_BYTES
  assert not [f for f in os.listdir(workdir) if f.endswith(".tmp")]
  assert cell_status(workdir) == ("failed", f"exit 4: {line}")


def test_only_the_schedulers_signals_requeue():
  assert slurm.requeue_reason(0, False, []) is None
  assert slurm.requeue_reason(143, True, []).startswith("stopped by the scheduler's signal")
  assert slurm.requeue_reason(143, False, []).startswith("stopped by SIGTERM")
  assert slurm.requeue_reason(137, False, []) == ""  # SIGKILL: the out-of-memory killer
  assert slurm.requeue_reason(1, False, []) == ""
  assert slurm.requeue_reason(137, False, [137]) == "exit 137, in --requeue_on"


def test_time_seconds_reads_slurms_forms():
  assert [slurm.time_seconds(t) for t in ("10", "1:30", "4:00:00", "2-0", "1-2:3",
                                          "1-0:0:5", "soon")] == [
      600, 90, 14400, 172800, 93780, 86405, None]
