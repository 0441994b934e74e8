"""Sweeps as SLURM job arrays against a real scheduler (`.ci/slurm.sh start` runs a single-node
one): two grids submitted into one root at once both finish with the local sweep's results; the
scheduler's signals (scancel --signal, a real time limit) requeue a cell, which resumes to the
uninterrupted result, while SIGKILL and failures are final, each with its line, and
--max_requeues and --fail_fast say what they did; --status asks the scheduler (queued, lost,
never started); a cell of two processes under srun survives a signal. Without a SLURM here these
skip with one line, but in CI ($OLORA_CI_SLURM set by .ci/run), where a missing SLURM fails
them."""

from __future__ import annotations

import contextlib
import json
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

from olora_jax.sweep import cells, slurm
from olora_jax.sweep.status import cell_status

# Under -n, one worker runs them all, one after another (conftest.pytest_xdist_make_scheduler):
# each has the single node to itself, never waiting on another's cells or srun for the CPUs.
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


def _sweep(root, *args: str, time_limit: str = "10", cache=None) -> list[str]:
  """The sweep command into `root` on the tiny config (the session's compilation cache shared by
  every cell: `cache`, else the sweep's own under ROOT)."""
  return [*SWEEP, f"--root={root}", "--settings=configs/tiny.py", "--launcher=slurm",
          f"--time={time_limit}", *([f"--compilation_cache={cache}"] if cache else []), *args]


def _job(stdout: str) -> str:
  return next(line.split()[3].rstrip(":") for line in stdout.splitlines()
              if line.startswith("submitted job array"))


def _submit(root, *args: str, time_limit: str = "10", env=None, cache=None) -> str:
  proc = subprocess.run(_sweep(root, *args, time_limit=time_limit, cache=cache),
                        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return _job(proc.stdout)


def _wait_for(job: str, timeout: float = 400) -> None:
  """Waits until job `job` has left the queue (squeue, a cheap C client, asked every 0.2 s: a
  test waits a dozen times for a job, each time half a poll too long on average)."""
  deadline = time.time() + timeout
  while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                       timeout=30).stdout.strip():
    assert time.time() < deadline, f"job {job} still in the queue after {timeout} s"
    time.sleep(0.2)


def _status(root) -> str:
  return subprocess.run([*SWEEP, "--status", str(root)], capture_output=True, text=True,
                        timeout=60).stdout


def _log(root, task: str) -> str:
  return (root / "slurm" / "logs" / f"{task}.out").read_text()


def test_two_submissions_into_one_root_at_once_both_finish_with_the_local_results(
    tmp_path, compilation_cache):
  """Two grids submitted into one root at the same moment: sweep.json, changed under its lock,
  holds all four cells, each array runs its own, and they end with the local sweep's results.
  --status asks the scheduler: the cells it holds back are queued with its reason."""
  root, local = tmp_path / "slurm", tmp_path / "local"
  grids = (["--methods=finetune", "--seeds=0,1"], ["--methods=er", "--seeds=0,1"])
  procs = [subprocess.Popen(_sweep(root, *grid, "--", *TINY, cache=compilation_cache),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
           for grid in grids]
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  jobs = [_job(out) for out, _ in outs]
  assert sorted(out.split("cells ")[1].split()[0] for out, _ in outs) == ["0-1", "2-3"], outs
  plan = json.loads((root / "sweep.json").read_text())["cells"]
  assert sorted(c["workdir"] for c in plan) == sorted(
      f"tiny/{m}/seed{s}" for m in ("finetune", "er") for s in (0, 1))  # relative to ROOT
  # Wait for a cell line that says running and one the scheduler holds back. The node may still
  # be busy for a while (a job ending); ": " keeps the summary line's "0 running, " out.
  seen, deadline = "", time.time() + 300
  while not (": running, " in seen and ": queued, waiting (scheduler: PENDING" in seen):
    assert time.time() < deadline, seen
    seen = _status(root)
    time.sleep(0.3)
  running = next(line for line in seen.splitlines() if ": running, " in line)
  assert "SLURM task" in running and f"log {root}/slurm/logs/" in seen, seen
  proc = subprocess.run([*SWEEP, f"--root={local}", "--settings=configs/tiny.py",
                         "--methods=finetune,er", "--seeds=0,1", "--", *TINY],
                        capture_output=True, text=True, timeout=600, cwd=ROOT,
                        env=tiny_run.env(compilation_cache))
  assert proc.returncode == 0, proc.stderr[-2000:]
  for job in jobs:
    _wait_for(job)
  status = _status(root)
  assert status.splitlines()[-1] == ("4 cells: 4 finished, 0 running, 0 queued, 0 stopped,"
                                     " 0 lost, 0 failed, 0 not started"), status
  for method in ("finetune", "er"):
    for seed in (0, 1):
      cell = f"tiny/{method}/seed{seed}"
      assert_same_run(root / cell, local / cell)
  # The same commands again submit nothing: every cell is finished.
  for grid in grids:
    again = subprocess.run(_sweep(root, *grid, "--", *TINY), capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "2 cells, 2 finished, 0 to submit" in again.stdout


def _running(workdir, task: str, timeout: float = 180, after: int = -1) -> dict:
  """The cell's running record once its run (of array task `task`) has started and, when
  `after` is given, checkpointed past that step."""
  deadline = time.time() + timeout
  while True:
    record = cells.read_record(str(workdir)) or {}
    if (record.get("state") == "running" and record.get("slurm_task") == task
        and record.get("pid") and (cells.newest_checkpoint(str(workdir)) or -1) > after):
      return record
    assert time.time() < deadline, f"task {task} did not get there in {timeout} s: {record}"
    time.sleep(0.05)


def test_the_schedulers_signals_requeue_sigkill_does_not_and_the_limit_says_so(
    tmp_path, tiny_reference, compilation_cache):
  """One cell over four allocations: SIGKILL (what the out-of-memory killer sends) is final, with
  its line, and --status shows the newest checkpoint's step; the scheduler's SIGUSR1 requeues it
  until --max_requeues, which says so in one line; resubmitted, it ends identical to the
  uninterrupted run, its wall time summed over its allocations."""
  root = tmp_path / "slurm"
  workdir = root / "tiny" / "online_lora" / "seed0"
  submit = ("--methods=online_lora", "--seeds=0", "--max_requeues=1", "--", *TINY)
  job = _submit(root, *submit, cache=compilation_cache)
  record = _running(workdir, f"{job}_0", after=3)
  os.kill(record["pid"], signal.SIGKILL)
  _wait_for(job)
  log = _log(root, f"{job}_0")
  assert ("exit 137 (SIGKILL, not the scheduler's signal, and no out-of-memory kill in its"
          " memory cgroup's count: a kill): not requeued; --requeue_on=137 requeues it") in log, (
              log[-3000:])
  assert "restart 1" not in log
  step = cells.newest_checkpoint(str(workdir))
  line = next(x for x in _status(root).splitlines() if x.startswith(f"{workdir}:"))
  assert line.startswith(f"{workdir}: stopped, exit 137: killed by SIGKILL before it could"
                         f" checkpoint; checkpoint at step {step} of {tiny_run.N_STEPS}"), line
  # Submitted again: the scheduler's signal requeues it once, the second reaches the limit.
  job = _submit(root, *submit, cache=compilation_cache)
  for restart in (0, 1):
    _running(workdir, f"{job}_0")
    subprocess.run(["scancel", "--signal=USR1", "--batch", f"{job}_0"], check=True, timeout=30)
    if restart == 0:
      deadline = time.time() + 120
      while (cells.read_record(str(workdir)) or {}).get("allocations") != 3:
        assert time.time() < deadline, "the task was not requeued"
        time.sleep(0.1)
  _wait_for(job)
  log = _log(root, f"{job}_0")
  assert f"requeueing {job}_0 (requeue 1 of at most 1)" in log, log[-3000:]
  assert ("stopped by the scheduler's signal, exit 143: not requeued, --max_requeues=1 reached;"
          " submit the same command to resume it from its newest checkpoint") in log
  for x in log.splitlines():  # the runner's lines start their own line, never the bar's
    assert "requeueing" not in x or x.startswith("["), x
  assert "running, running" not in log and f"{workdir}: resuming" in log
  assert "No such process" not in log, log[-3000:]
  assert "--max_requeues=1 reached" in _status(root)
  job = _submit(root, *submit, cache=compilation_cache)
  _wait_for(job)
  assert cell_status(str(workdir))[0] == "finished"
  assert_same_run(workdir, tiny_reference)
  assert results(workdir)["plateau_steps"] == [4, 13, 20, 30]
  record = cells.read_record(str(workdir))
  assert record["allocations"] == 4 and record["seconds"] > 0, record
  assert f"finished, {record['seconds']:.0f} s over 4 allocations" in _status(root)


def test_cancel_stops_a_running_sweep_without_a_requeue_and_the_same_command_resumes_it(
    tmp_path, tiny_reference, compilation_cache):
  """`--cancel ROOT`: the running cell checkpoints and stops with SLURM's SIGTERM (one stop,
  though it reaches the run twice) and does not requeue itself, the queued one never starts;
  --status says where each stopped; the same sweep command resumes both to the uninterrupted
  result."""
  root = tmp_path / "slurm"
  workdir = root / "tiny" / "online_lora" / "seed0"
  submit = ("--methods=online_lora", "--seeds=0,1", "--throttle=1", "--", *TINY)
  job = _submit(root, *submit, cache=compilation_cache)
  # The same command again while the cells are queued or running: nothing is queued twice (a
  # duplicate once ran, was refused, and --status then called the running cell lost).
  proc = subprocess.run(_sweep(root, *submit, cache=compilation_cache), capture_output=True,
                        text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"{workdir}: already queued or running (SLURM task {job}_0, " in proc.stdout
  assert f"(SLURM task {job}_1, PENDING): not submitted again" in proc.stdout
  assert "2 cells, 0 finished, 2 queued or running, 0 to submit" in proc.stdout
  assert "submitted job array" not in proc.stdout
  _running(workdir, f"{job}_0", after=3)
  assert f"{workdir}: running" in _status(root)
  proc = subprocess.run([*SWEEP, "--cancel", str(root)], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"cancelled job(s) {job}: running cells checkpoint and stop")
  _wait_for(job)
  gone = time.time()
  log = _log(root, f"{job}_0")
  assert "not requeued, the sweep was cancelled (launch/sweep.py --cancel at" in log, log[-3000:]
  assert "requeueing" not in log and "second signal" not in log, log[-3000:]
  record = cells.read_record(str(workdir))
  assert record["code"] == 143 and record["allocations"] == 1, record
  assert not (root / "tiny" / "online_lora" / "seed1" / cells.EXIT_RECORD).exists()
  status = _status(root)
  assert f"{workdir}: stopped, exit 143" in status, status
  # 3 s after the job left the queue (the checks above took part of them), a requeue would have
  # put the task back in it.
  time.sleep(max(0.0, gone + 3 - time.time()))
  assert not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                            timeout=30).stdout.strip()
  job = _submit(root, *submit, cache=compilation_cache)  # the same command: it resumes
  assert not (root / "slurm" / slurm.CANCELLED).exists()
  _wait_for(job)
  for seed in (0, 1):
    assert cell_status(str(root / "tiny" / "online_lora" / f"seed{seed}"))[0] == "finished"
  assert_same_run(workdir, tiny_reference)


CHECK_PERIOD = 30  # s: slurmctld checks time limits (and sends --signal warnings) this often


def test_a_cell_that_hits_its_real_time_limit_is_requeued_and_resumes_identical(
    tmp_path, compilation_cache):
  """A real time limit, no scancel: once the cell is mid-run (its first checkpoint written), its
  run is paused (SIGSTOP) and its limit lowered to the next whole minute past one minute from
  now, so that the scheduler's own warning (SIGUSR1 at its first time-limit check within
  --signal_lead plus CHECK_PERIOD of the limit) comes at its next check, at least 30 s before the
  limit. Paused, the run cannot end before the warning however fast the machine, and it leaves
  the CPUs to the other tests while the scheduler takes its time. The warning's SIGTERM waits
  for the run, which is resumed (SIGCONT) once the batch script has printed it: the run
  checkpoints and the cell is requeued; its limit is raised again, and it resumes and ends
  identical to the same cell run locally. (A limit of one minute from the start would warn every
  allocation at its first check, however little it had run: a few seconds on a loaded machine.)
  The local run goes meanwhile, on the compilation cache the cell's allocations share."""
  # The tiny stream's 46 steps, whose programs the session's compilation cache holds by now (the
  # finetune cells of the two-submission test; else the first of the two runs compiles them):
  # the run is paused a few steps past its first checkpoint (step 4, seen within 0.05 s; in
  # tries on a loaded 2-core AMD EPYC it stopped after step 7), about 40 steps from its end:
  # some 4 s, 80 polls, on that machine, and a loaded machine slows the run as much as the
  # test. (It ran 180 steps at batch size 8 before issue 77: its resumed allocation alone ran
  # about 175 steps, and both runs compiled programs no other test shares.)
  grid = ["--methods=finetune", "--seeds=0", "--", *TINY]
  root, local = tmp_path / "slurm", tmp_path / "local"
  done = subprocess.Popen([*SWEEP, f"--root={local}", "--settings=configs/tiny.py", *grid],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env=tiny_run.env(compilation_cache))
  job = _submit(root, "--signal_lead=119", *grid, time_limit="10", cache=compilation_cache)
  workdir = root / "tiny" / "finetune" / "seed0"
  pid = _running(workdir, f"{job}_0", timeout=300, after=3)["pid"]
  os.kill(pid, signal.SIGSTOP)
  try:
    assert not cells.is_finished(str(workdir)), (
        "the run finished before it could be paused: give the cell more steps")
    elapsed = slurm.time_seconds(subprocess.run(
        ["squeue", "-h", "-j", f"{job}_0", "-o", "%M"], capture_output=True, text=True,
        timeout=30, check=True).stdout.strip())
    minutes = -(-(elapsed + 60) // 60)  # the limit 60-120 s away: warned at the next check
    subprocess.run(["scontrol", "update", f"JobId={job}_0", f"TimeLimit={minutes}"], check=True,
                   timeout=30)
    _wait_in_log(root, f"{job}_0", "SIGUSR1: stopping the run", timeout=300)
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGCONT)
  _wait_in_log(root, f"{job}_0", f"requeueing {job}_0", timeout=120)
  subprocess.run(["scontrol", "update", f"JobId={job}_0", "TimeLimit=10"], check=True,
                 timeout=30)
  _, err = done.communicate(timeout=600)
  assert done.returncode == 0, err[-2000:]
  _wait_for(job, timeout=600)
  log = _log(root, f"{job}_0")
  assert "SIGUSR1: stopping the run" in log and "restart 1" in log, log[-3000:]
  assert "error: stopped by signal 15 after stream step " in log, log[-3000:]  # mid-run
  assert "DUE TO TIME LIMIT" not in log, log[-3000:]  # never killed without its checkpoint
  assert "No such process" not in log, log[-3000:]  # the batch script's traps stay quiet
  assert cell_status(str(workdir))[0] == "finished"
  assert cells.read_record(str(workdir))["allocations"] == 2
  assert_same_run(workdir, local / "tiny" / "finetune" / "seed0")


def _wait_in_log(root, task: str, text: str, timeout: float) -> None:
  """Waits until the log of array task `task` holds `text`."""
  deadline, log = time.time() + timeout, ""
  while text not in log:
    assert time.time() < deadline, f"no {text!r} in its log after {timeout} s: {log[-3000:]}"
    time.sleep(0.2)
    with contextlib.suppress(FileNotFoundError):
      log = _log(root, task)


def test_a_failing_cell_is_not_requeued_and_fail_fast_cancels_the_cells_not_started(tmp_path):
  """A cell that fails (bad input, exit 2) is final, with its line; with --fail_fast its task
  cancels the array's tasks not started yet. A record that says running while the scheduler no
  longer runs its task is a lost cell, and a task whose run never started (a --setup line that
  failed) shows the scheduler's state and its log's last line."""
  root, other = tmp_path / "slurm", tmp_path / "setup"
  job = _submit(root, "--methods=finetune", "--seeds=0,1", "--throttle=1", "--fail_fast",
                "--", *TINY, "--config.learner.batch_size=0")
  # A set-up line that fails (the run never starts), in a root of its own: submitted now, its
  # task runs beside the first array's (the node has a CPU for each), not after it.
  setup_job = _submit(other, "--methods=finetune", "--seeds=0",
                      "--setup=echo 'module: cuda/12.4 not found' >&2; exit 1", "--", *TINY)
  _wait_for(job, timeout=200)
  first, second = (str(root / "tiny" / "finetune" / f"seed{s}") for s in (0, 1))
  state, detail = cell_status(first)
  assert state == "failed" and detail.startswith("exit 2: ") and "batch_size" in detail, detail
  log = _log(root, f"{job}_0")
  assert "requeueing" not in log and "restart 1" not in log and "exit 2" in log
  assert (f"--fail_fast: cell 0 failed (exit 2): cancelling the sweep's tasks not started (jobs"
          f" {job}); the running ones finish") in log, log[-3000:]
  status = _status(root)
  assert f"{first}: failed, exit 2: {detail[len('exit 2: '):]}" in status, status
  assert cells.read_record(second) is None and not (root / "slurm" / "logs" /
                                                    f"{job}_1.out").exists(), status
  assert f"{second}: not started, cancelled before it started (scheduler: CANCELLED)" in status
  # The record of a runner whose node died: it says running, the scheduler knows better.
  cells.write_record(first, {"state": "running", "pid": 4321, "host": "node17",
                             "since": cells.now(), "heartbeat": cells.now(),
                             "slurm_task": f"{job}_0"})
  line = next(x for x in _status(root).splitlines() if x.startswith(f"{first}:"))
  assert line.startswith(f"{first}: lost, its record says running (pid 4321 on node17, SLURM task"
                         f" {job}_0) but the scheduler "), line
  assert "no checkpoint yet, it starts over" in line and f"log {root}/slurm/logs/" in line
  # The set-up line that failed: the run never started.
  _wait_for(setup_job, timeout=200)
  line = _status(other).splitlines()[0]
  assert line.startswith(f"{other}/tiny/finetune/seed0: failed, its run never started: the"
                         " scheduler says FAILED, exit 1"), line
  assert "its log ends: module: cuda/12.4 not found" in line, line


def test_a_two_process_cell_survives_a_signal_and_equals_one_process(
    tmp_path, tiny_reference, compilation_cache):
  """--ntasks=2: each cell is one run over two processes that srun starts inside the task. The
  scheduler's SIGUSR1 mid-run reaches both through the step (never srun), both checkpoint the
  same step, the task is requeued and resumes them both; the cell ends equal to the one-process
  run within the tolerance of test_distributed."""
  from test_distributed import _assert_close_to

  root = tmp_path / "slurm"
  workdir = root / "tiny" / "online_lora" / "seed0"
  job = _submit(root, "--methods=online_lora", "--seeds=0", "--ntasks=2", "--mem=4G", "--",
                *TINY, cache=compilation_cache)
  _running(workdir, f"{job}_0", after=3)
  subprocess.run(["scancel", "--signal=USR1", "--batch", f"{job}_0"], check=True, timeout=30)
  _wait_for(job)
  log = _log(root, f"{job}_0")
  assert f"requeueing {job}_0" in log and "restart 1" in log, log[-3000:]
  assert log.count("error: stopped by signal 15") == 2, log[-3000:]  # both processes
  assert cell_status(str(workdir))[0] == "finished"
  assert (cells.read_record(str(workdir)) or {})["allocations"] == 2
  _assert_close_to(workdir, tiny_reference)


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
