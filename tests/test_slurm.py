"""Sweeps as SLURM job arrays against a real scheduler (`.ci/slurm.sh start` runs a single-node
one): a 2 x 2 array finishes with the local sweep's results, a cell signalled before its time
limit is requeued and resumes to the uninterrupted result, a failing cell is reported with its
line and not requeued. Without a SLURM here these skip with one line, but in CI
($OLORA_CI_SLURM set by .ci/run), where a missing SLURM fails them."""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import tiny_run
from tiny_run import ROOT, assert_same_run, results

from launch import cells

pytestmark = pytest.mark.slurm
SWEEP = [sys.executable, str(ROOT / "launch" / "sweep.py")]
TINY = [f"--config.{k}={v}" for k, v in tiny_run.OVERRIDES.items()]


@pytest.fixture(scope="module")
def slurm_state() -> str:
  """sinfo's node states ('' when sinfo is missing, fails or hangs: no controller to ask)."""
  if not shutil.which("sinfo"):
    return ""
  try:
    return subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                          timeout=10).stdout
  except subprocess.TimeoutExpired:
    return ""


@pytest.fixture(autouse=True)
def slurm_running(slurm_state):
  if not any(state in slurm_state for state in ("idle", "mixed", "allocated")):
    message = "no SLURM running here (`.ci/slurm.sh start` starts one)"
    if os.environ.get("OLORA_CI_SLURM"):
      pytest.fail(f"{message}, but CI needs one")
    pytest.skip(message)


def _submit(root, *args: str, time_limit: str = "10", env=None) -> str:
  proc = subprocess.run([*SWEEP, f"--root={root}", "--settings=configs/tiny.py",
                         "--launcher=slurm", f"--time={time_limit}", *args], capture_output=True,
                        text=True, timeout=120, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return next(line.split()[3].rstrip(":") for line in proc.stdout.splitlines()
              if line.startswith("submitted job array"))


def _wait_for(job: str, timeout: float = 400) -> None:
  deadline = time.time() + timeout
  while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                       timeout=30).stdout.strip():
    assert time.time() < deadline, f"job {job} still in the queue after {timeout} s"
    time.sleep(1)


def _status(root) -> str:
  return subprocess.run([*SWEEP, "--status", str(root)], capture_output=True, text=True,
                        timeout=60).stdout


def test_an_array_sweep_finishes_with_the_local_sweeps_results(tmp_path):
  root, local = tmp_path / "slurm", tmp_path / "local"
  grid = ["--methods=finetune,er", "--seeds=0,1", "--", *TINY]
  job = _submit(root, *grid)
  seen = ""
  deadline = time.time() + 120
  while "running, step" not in seen and time.time() < deadline:
    seen = _status(root)
    time.sleep(0.3)
  assert "running, step" in seen and "SLURM task" in seen, seen
  proc = subprocess.run([*SWEEP, f"--root={local}", "--settings=configs/tiny.py", *grid],
                        capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  _wait_for(job)
  status = _status(root)
  assert status.splitlines()[-1] == ("4 cells: 4 finished, 0 running, 0 stopped, 0 failed,"
                                     " 0 not started"), status
  for method in ("finetune", "er"):
    for seed in (0, 1):
      cell = f"tiny/{method}/seed{seed}"
      assert_same_run(root / cell, local / cell)
  # The same command again submits nothing: every cell is finished.
  again = subprocess.run([*SWEEP, f"--root={root}", "--settings=configs/tiny.py",
                          "--launcher=slurm", *grid], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
  assert again.returncode == 0 and "4 cells, 4 finished, 0 to submit" in again.stdout


def test_a_signalled_cell_is_requeued_and_resumes_identical(tmp_path, tiny_reference):
  root = tmp_path / "slurm"
  job = _submit(root, "--methods=online_lora", "--seeds=0", "--", *TINY)
  workdir = root / "tiny" / "online_lora" / "seed0"
  deadline = time.time() + 120
  while not tiny_run.steps(workdir) and time.time() < deadline:  # a checkpoint: mid-run
    time.sleep(0.05)
  assert tiny_run.steps(workdir), "no checkpoint in time"
  subprocess.run(["scancel", "--signal=USR1", "--batch", f"{job}_0"], check=True, timeout=30)
  _wait_for(job)
  log = (root / "slurm" / "logs" / f"{job}_0.out").read_text()
  assert f"exit 143 (a signal): requeueing {job}_0" in log, log[-3000:]
  assert "restart 1" in log
  assert cells.cell_status(str(workdir))[0] == "finished"
  assert_same_run(workdir, tiny_reference)
  assert results(workdir)["plateau_steps"] == [4, 13, 20, 30]


def _next_time_limit_check(tmp_path) -> float:
  """When slurmctld next checks time limits (it does so once a minute, for every job at once):
  a probe job whose warning signal is due at once records the moment it comes."""
  stamp = tmp_path / "probe_signal"
  probe = subprocess.run(
      ["sbatch", "--parsable", "--time=2", "--signal=B:USR1@119", "--output=/dev/null",
       "--cpus-per-task=1", "--mem=100M", "--wrap",
       f"trap 'date +%s.%N > {stamp}; exit 0' USR1; while true; do sleep 0.2; done"],
      capture_output=True, text=True, timeout=30, check=True).stdout.strip()
  _wait_for(probe, timeout=150)
  return float(stamp.read_text()) + 60


def test_a_cell_that_hits_its_real_time_limit_is_requeued_and_resumes_identical(tmp_path):
  """A one-minute time limit, no scancel: the scheduler's own warning (SIGUSR1 at its first
  time-limit check once the lead is reached; SLURM checks once a minute, so with a 59 s lead the
  warning comes at the first check of each allocation) stops the run with a checkpoint and the
  cell is requeued, until it ends identical to the same cell run locally. The cell is submitted
  20 s before a check, so its first allocation ends mid-run, as would a real limit."""
  # 720 steps: longer than the ~20 s of the first allocation and the ~30 s of a later one can
  # hold on an idle machine with the compilation cache warm.
  grid = ["--methods=finetune", "--seeds=0", "--", *TINY, "--config.learner.batch_size=2"]
  root, local = tmp_path / "slurm", tmp_path / "local"
  # A compilation cache the cell's allocations share (sbatch passes the environment on): a
  # requeued allocation of ~30 s on a loaded machine then spends it on steps, not compiling.
  env = tiny_run.env(tmp_path / "cache")
  time.sleep(max(0.0, _next_time_limit_check(tmp_path) - 20 - time.time()))
  job = _submit(root, "--signal_lead=59", *grid, time_limit="1", env=env)
  done = subprocess.run([*SWEEP, f"--root={local}", "--settings=configs/tiny.py", *grid],
                        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert done.returncode == 0, done.stderr[-2000:]
  _wait_for(job, timeout=900)
  log = (root / "slurm" / "logs" / f"{job}_0.out").read_text()
  assert "SIGUSR1: stopping the run" in log and f"requeueing {job}_0" in log, log[-3000:]
  assert "DUE TO TIME LIMIT" not in log, log[-3000:]  # never killed without its checkpoint
  cell = "tiny/finetune/seed0"
  assert cells.cell_status(str(root / cell))[0] == "finished"
  assert_same_run(root / cell, local / cell)


def test_a_failing_cell_is_reported_with_its_line_and_not_requeued(tmp_path):
  root = tmp_path / "slurm"
  job = _submit(root, "--methods=finetune", "--seeds=0", "--", *TINY,
                "--config.learner.batch_size=0")
  _wait_for(job, timeout=200)
  state, detail = cells.cell_status(str(root / "tiny" / "finetune" / "seed0"))
  assert state == "failed" and detail.startswith("exit 2: ") and "batch_size" in detail, detail
  log = (root / "slurm" / "logs" / f"{job}_0.out").read_text()
  assert "requeueing" not in log and "restart 1" not in log and "exit 2" in log
  assert f"failed, exit 2: {detail[len('exit 2: '):]}" in _status(root)


SRUN = ["srun", "-n2", "--cpus-per-task=1", "--mem=4G"]


def _srun(workdir, *extra: str) -> subprocess.Popen:
  """The tiny stream as one run of two processes under srun (JAX finds the SLURM cluster)."""
  run = tiny_run.command(workdir, "--config.distributed.initialize=cluster", *extra)
  return subprocess.Popen([*SRUN, *run], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def srun_run(tmp_path_factory, slurm_state):
  """An uninterrupted two-process run of the tiny stream, and its wall time in seconds."""
  if not any(state in slurm_state for state in ("idle", "mixed", "allocated")):
    pytest.skip("no SLURM running here")
  workdir = tmp_path_factory.mktemp("srun") / "run"
  start = time.time()
  out, err = _srun(workdir).communicate(timeout=400)
  assert "results written to" in out, err[-3000:]
  return workdir, time.time() - start, out


def test_a_two_process_srun_run_equals_one_process(srun_run, tiny_reference):
  from test_distributed import _assert_close_to

  workdir, _, out = srun_run
  assert out.count("results written to") == 1  # process 0 alone prints the table
  _assert_close_to(workdir, tiny_reference)


def _task_pids(workdir, srun_pid: int, n: int = 2, timeout: float = 60) -> list[int]:
  """The PIDs of the run's processes that srun started (found by their workdir argument)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    found = subprocess.run(["pgrep", "-f", "--", f"workdir {workdir}"], capture_output=True,
                           text=True).stdout.split()
    pids = []
    for pid in map(int, found):
      try:
        program = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
      except OSError:
        continue
      if pid != srun_pid and not program.endswith(b"srun"):
        pids.append(pid)
    if len(pids) == n:
      return pids
    time.sleep(0.01)
  raise AssertionError(f"the run's {n} processes did not start in {timeout} s")


def test_sigterm_to_every_process_at_random_moments_stops_all_and_resumes_identical(
    tmp_path, srun_run):
  """SIGTERM to both processes at >= 5 random moments (start-up, restore, compile, steps and
  saves alike): every stop exits 143 with the same line in both processes (the same step
  checkpointed), and the run, resumed after each, ends identical to the uninterrupted one."""
  reference, full_seconds, _ = srun_run
  seed = int(os.environ.get("OLORA_TEST_SEED", time.time_ns() % 2**31))
  rng = random.Random(seed)
  workdir, moments, finished = tmp_path / "run", [], 0
  longest = 0.8 * full_seconds  # the moments: from start-up to the last steps of a launch
  while len(moments) < 5 or not (workdir / "results.json").exists():
    proc, start = _srun(workdir), time.time()
    if len(moments) < 5:
      pids = _task_pids(workdir, proc.pid)
      delay = rng.uniform(0, longest)
      time.sleep(max(0.0, start + delay - time.time()))
      for pid in pids if proc.poll() is None else ():  # never a PID reused after the run
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=400)
    where = f"seed {seed}, moments so far {moments}: {err[-2500:]}"
    if proc.returncode == 0:  # the run ended before the signal: compare, start again sooner
      assert_same_run(workdir, reference)
      finished += 1
      assert finished <= 5, f"the run kept finishing before its signal; {where}"
      longest = 0.6 * (time.time() - start)
      if len(moments) < 5:
        shutil.rmtree(workdir)
      continue
    assert proc.returncode == 128 + signal.SIGTERM, where
    lines = [x for x in err.splitlines() if x.startswith("error: stopped by signal 15")]
    # A process signalled before its first line (Python's own start-up) ends without one.
    assert len(set(lines)) <= 1, where
    assert not (workdir / "results.json").exists(), where
    stage = lines[0].split(";")[0][len("error: stopped by signal 15 "):] if lines else (
        "in Python's start-up")
    moments.append((round(delay, 1), stage))
  assert_same_run(workdir, reference)
  print(f"seed {seed}: {moments}")
