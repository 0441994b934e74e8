"""Sweeps as SLURM job arrays against a real scheduler (`.ci/slurm.sh start` runs a single-node
one): a 2 x 2 array finishes with the local sweep's results, a cell signalled before its time
limit is requeued and resumes to the uninterrupted result, a failing cell is reported with its
line and not requeued. Without a SLURM here these skip with one line, but in CI
($OLORA_CI_SLURM set by .ci/run), where a missing SLURM fails them."""

from __future__ import annotations

import os
import shutil
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


def _submit(root, *args: str) -> str:
  proc = subprocess.run([*SWEEP, f"--root={root}", "--settings=configs/tiny.py",
                         "--launcher=slurm", "--time=10", *args], capture_output=True,
                        text=True, timeout=120, cwd=ROOT)
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


def test_a_two_process_srun_run_equals_one_process(tmp_path, tiny_reference):
  from test_distributed import _assert_close_to

  workdir = tmp_path / "run"
  proc = subprocess.run(["srun", "-n2", "--cpus-per-task=1", "--mem=4G",
                         *tiny_run.command(workdir, "--config.distributed.initialize=cluster")],
                        capture_output=True, text=True, timeout=400, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("results written to") == 1  # process 0 alone prints the table
  _assert_close_to(workdir, tiny_reference)
