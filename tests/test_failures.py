"""Every failure a user can cause or suffer: the documented exit code, one line at the end of
stderr, nothing good lost, never a hang; after the fault is removed, the same command completes
exactly like an uninterrupted run (tiny_run.assert_same_run)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import tiny_run
from tiny_run import ROOT, assert_same_run, last_line, snapshot, steps

from configs import tiny
from olora_jax import checkpointing, compute, errors, run_control, tb_writer, trainer
from olora_jax import workdir as workdir_lib
from olora_jax.data import tfds_sources
from olora_jax.models.vit import VisionTransformer, spec_from_config
from olora_jax.pretrained import save_timm_safetensors


def _limit_file_size(nbytes: int):
  """preexec_fn: files may not grow past `nbytes` (writes fail with EFBIG, SIGXFSZ ignored)."""

  def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

  return limit


@contextlib.contextmanager
def _read_only(path: Path):
  """`path` read-only for this test's subprocesses: permission bits for a normal user, a
  read-only bind mount for root (whom permission bits do not stop)."""
  if os.geteuid() != 0:
    modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
    for p in modes:
      p.chmod(modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
      yield
    finally:
      for p, mode in modes.items():
        p.chmod(mode)
    return
  bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
  if bind.returncode != 0:
    pytest.skip(f"root cannot make a read-only bind mount here: {bind.stderr!r}")
  try:
    subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True,
                   capture_output=True)
    yield
  finally:
    subprocess.run(["umount", str(path)], check=True, capture_output=True)


def _checkpoint_files(workdir: Path) -> dict:
  """The finished checkpoints' files (not orbax's temporary directory of a failed save)."""
  return {k: v for k, v in snapshot(workdir / "checkpoints").items() if k.split("/")[0].isdigit()}


def test_file_size_limit_then_read_only_workdir_exit_4_and_the_rerun_is_exact(
    tmp_path, tiny_reference, compilation_cache):
  workdir = tmp_path / "run"
  stopped = tiny_run.stop_after_checkpoint(workdir, 8, signal.SIGTERM, compilation_cache)
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
  good = steps(workdir)
  kept = _checkpoint_files(workdir)
  largest = max(p.stat().st_size for p in (workdir / "checkpoints").rglob("*") if p.is_file())
  log_size = (workdir / "metrics.jsonl").stat().st_size
  limit = log_size + 4096  # the log can grow a little; the next checkpoint's files cannot
  assert largest > limit

  # 1. The next checkpoint save hits the file-size limit.
  done = tiny_run.run(workdir, compilation_cache, preexec_fn=_limit_file_size(limit))
  assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr[-3000:]
  line = last_line(done.stderr)
  assert line.startswith(f"error: cannot write to workdir '{workdir}' (File too large); lift the"
                         " file-size limit (ulimit -f), then run the same command"), line
  assert f"resume from checkpoint {good[-1]}" in line
  log = re.search(r"\(traceback(?:, cut short,)? in (.+)\)$", line)  # the limit holds for it too
  assert log and "Traceback" in Path(log.group(1)).read_text()
  assert "Traceback" not in done.stderr  # only in the log, which the line names
  assert steps(workdir) == good and _checkpoint_files(workdir) == kept

  # 2. A read-only workdir: refused at once, nothing changes.
  with _read_only(workdir):
    before = snapshot(workdir)
    done = tiny_run.run(workdir, compilation_cache)
    assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr[-3000:]
    line = last_line(done.stderr)
    assert line.startswith(f"error: workdir '{workdir}' cannot be written ("), line
    assert "make it writable" in line and "free space" not in line, line  # not a full disk
    assert snapshot(workdir) == before

  # 3. The fault removed, the same command resumes and ends exactly like an uninterrupted run.
  done = tiny_run.run(workdir, compilation_cache)
  assert done.returncode == 0, done.stderr[-3000:]
  assert_same_run(workdir, tiny_reference)


def test_a_second_process_on_a_held_workdir_is_refused_at_once(tmp_path, compilation_cache):
  workdir = tmp_path / "run"
  with workdir_lib.WorkdirLock(str(workdir)):  # this test process holds it
    done = tiny_run.run(workdir, compilation_cache)
    assert sorted(p.name for p in workdir.iterdir()) == [".lock"]  # nothing else was written
  assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr[-3000:]
  line = last_line(done.stderr)
  assert line.startswith(f"error: workdir '{workdir}' is in use by pid {os.getpid()} on host"
                         f" {socket.gethostname()} (since "), line
  assert "wait for that run to end" in line
  assert list(workdir.iterdir()) == []  # the lock released, its file goes with it


def test_a_killed_holder_releases_the_lock(tmp_path):
  workdir = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
      import sys, time
      sys.path.insert(0, {str(ROOT)!r})
      from olora_jax import workdir
      with workdir.WorkdirLock({str(workdir)!r}):
        print("locked", flush=True)
        time.sleep(300)
      """)], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(errors.WorkdirBusy, match=rf"in use by pid {holder.pid} on host"):
      with workdir_lib.WorkdirLock(str(workdir)):
        pass
  finally:
    holder.kill()  # SIGKILL: no cleanup code runs in the holder
    holder.wait()
  with workdir_lib.WorkdirLock(str(workdir)):
    fd = os.open(workdir / ".lock", os.O_RDONLY)
    with pytest.raises(BlockingIOError):  # held now by this process
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_a_released_lock_leaves_no_lock_file(tmp_path):
  """Every finished workdir kept a `.lock` naming a dead pid; the run now removes it while it
  still holds it."""
  workdir = tmp_path / "run"
  with workdir_lib.WorkdirLock(str(workdir)):
    (workdir / "results.json").write_text("{}")
    assert (workdir / ".lock").read_text().startswith(f"pid {os.getpid()} on host")
  assert sorted(p.name for p in workdir.iterdir()) == ["results.json"]
  with workdir_lib.WorkdirLock(str(workdir)):  # and the next run takes the workdir as before
    pass


def test_a_removed_lock_neither_lets_a_second_run_in_nor_goes_unsaid(tmp_path, caplog):
  """`.lock` removed mid-run let a second run take the workdir and finish, after which the first
  failed naming an error.log that no longer existed. The directory's own lock now refuses the
  second run, and the holder says at the end what became of its `.lock`."""
  workdir = tmp_path / "run"
  lock = workdir / ".lock"
  with workdir_lib.WorkdirLock(str(workdir)):
    lock.unlink()
    with pytest.raises(errors.WorkdirBusy, match=re.escape(
        f"workdir '{workdir}' is in use by another run, whose {lock} was removed while it ran;"
        " wait for that run to end")):
      with workdir_lib.WorkdirLock(str(workdir)):
        pass
    assert not lock.exists()  # the refused run's own lock file went with it
  assert f"{lock} was removed while this run held it; the workdir's own lock kept other runs out" \
      in caplog.text
  caplog.clear()
  with workdir_lib.WorkdirLock(str(workdir)):
    lock.unlink()
    lock.write_text("someone else's\n")
  assert f"{lock} was replaced by another file while this run held it" in caplog.text
  assert lock.read_text() == "someone else's\n"  # not this run's file: left as it is


def test_a_removed_lock_without_a_directory_lock_fails_the_run(tmp_path, monkeypatch):
  """Where the directory cannot be locked (some network file systems), a removed `.lock` may have
  let another run in: the run that held it ends with exit 4 saying so."""
  monkeypatch.setattr(workdir_lib.WorkdirLock, "_lock_directory", lambda self, fd: None)
  workdir = tmp_path / "run"
  with pytest.raises(errors.EnvironmentFailure, match=re.escape(
      f"{workdir / '.lock'} was removed while this run held it, and this file system cannot lock"
      f" the directory itself, so another run may have written '{workdir}' meanwhile")):
    with workdir_lib.WorkdirLock(str(workdir)):
      (workdir / ".lock").unlink()


def test_a_lock_file_that_is_a_directory_or_immutable_is_named(tmp_path):
  """`.lock` made a directory said "check the disk", made immutable "the workdir cannot be
  written" (while error.log was written there): neither named `.lock`."""
  workdir = tmp_path / "run"
  (workdir / ".lock").mkdir(parents=True)
  with pytest.raises(errors.BadInput, match=re.escape(
      f"{workdir / '.lock'} is a directory, where the workdir's lock file goes; remove it")):
    with workdir_lib.WorkdirLock(str(workdir)):
      pass
  (workdir / ".lock").rmdir()
  (workdir / ".lock").write_text("")
  if os.geteuid() == 0:  # root writes through permission bits, not through the immutable flag
    if subprocess.run(["chattr", "+i", str(workdir / ".lock")], capture_output=True).returncode:
      pytest.skip("chattr +i is not supported here")
  else:
    (workdir / ".lock").chmod(0o444)
  try:
    with pytest.raises(errors.EnvironmentFailure, match=re.escape(
        f"the workdir's lock file {workdir / '.lock'} cannot be written (")) as e:
      with workdir_lib.WorkdirLock(str(workdir)):
        pass
    assert "make it writable (chmod u+w" in str(e.value) and not e.value.write_log
  finally:
    if os.geteuid() == 0:
      subprocess.run(["chattr", "-i", str(workdir / ".lock")], check=True)
  assert sorted(p.name for p in workdir.iterdir()) == [".lock"]


# --- the run log against the checkpoint ----------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, compilation_cache) -> Path:
  """A run stopped by SIGTERM after checkpoint 20: metrics.jsonl holds 20 steps of events."""
  workdir = tmp_path_factory.mktemp("stopped") / "run"
  stopped = tiny_run.stop_after_checkpoint(workdir, 20, signal.SIGTERM, compilation_cache)
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
  return workdir


def _truncate(log: Path) -> None:
  log.write_bytes(log.read_bytes()[: log.stat().st_size // 2])


def _edit(log: Path) -> None:
  log.write_text(log.read_text().replace('"event": "train"', '"event": "trian"', 1))


@pytest.mark.parametrize("damage,match", [
    (_truncate, r"metrics.jsonl has \d+ bytes but checkpoint \d+ recorded \d+ \(truncated\?\)"),
    (_edit, r"the first \d+ bytes of .*metrics.jsonl differ from what checkpoint \d+ recorded"),
    (Path.unlink, r"metrics.jsonl is missing but checkpoint \d+ recorded \d+ bytes of it"),
], ids=["truncated", "edited", "deleted"])
def test_a_damaged_run_log_is_rebuilt_at_resume_from_the_checkpoint(tmp_path, stopped_run,
                                                                    tiny_reference, damage,
                                                                    match, caplog):
  workdir = tmp_path / "run"
  shutil.copytree(stopped_run, workdir)
  damage(workdir / "metrics.jsonl")
  trainer.train_and_evaluate(tiny_run.config(), str(workdir), progress=False)
  said = [r.getMessage() for r in caplog.records if "rebuilt its first" in r.getMessage()]
  assert len(said) == 1 and re.search(match, said[0]), said
  assert_same_run(workdir, tiny_reference)


def test_without_a_copy_a_damaged_log_is_refused_with_the_way_out(tmp_path, stopped_run):
  """A checkpoint written before it carried the log's copy: the damaged log is refused."""
  workdir = tmp_path / "run"
  shutil.copytree(stopped_run, workdir)
  _truncate(workdir / "metrics.jsonl")
  before = snapshot(workdir, skip=(".lock",))
  with pytest.raises(errors.BadInput, match=r"\(truncated\?\); restore .* pass a new --workdir"):
    workdir_lib.restore_run_log(str(workdir), 10**6, "0" * 64, None, 20)
  with pytest.raises(errors.BadInput):  # a copy that is not what the checkpoint recorded
    workdir_lib.restore_run_log(str(workdir), 10**6, "0" * 64, "x" * 10**6, 20)
  assert snapshot(workdir, skip=(".lock",)) == before


def _damage_while_running(workdir: Path, damage, cache: Path) -> subprocess.CompletedProcess:
  """Starts the run, damages metrics.jsonl once checkpoint 8 exists, waits for the run's end."""
  proc = subprocess.Popen(tiny_run.command(workdir), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=tiny_run.env(cache))
  while proc.poll() is None and not (steps(workdir) and steps(workdir)[-1] >= 8):
    time.sleep(0.005)  # not a busy loop: that takes a core from the run it waits for
  assert proc.poll() is None, "the run ended before the log could be damaged"
  damage(workdir / "metrics.jsonl")
  _, stderr = proc.communicate(timeout=300)
  return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def _cut_at_a_line(log: Path) -> None:
  lines = log.read_bytes().splitlines(keepends=True)
  log.write_bytes(b"".join(lines[: len(lines) // 2]))


@pytest.mark.parametrize("damage,found", [
    (_cut_at_a_line, "bytes where the run wrote"),
    (_truncate, "bytes where the run wrote"),
    (Path.unlink, "(deleted)"),
], ids=["cut_at_a_line", "cut_mid_line", "deleted"])
def test_a_log_damaged_while_the_run_goes_stops_it_and_the_rerun_is_exact(
    tmp_path, tiny_reference, compilation_cache, damage, found):
  workdir = tmp_path / "run"
  done = _damage_while_running(workdir, damage, compilation_cache)
  line = last_line(done.stderr)
  assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr[-2000:]
  assert line.startswith("error:") and "metrics.jsonl was changed under the running run" in line
  assert found in line and "run the same command" in line.lower()
  assert not (workdir / "results.json").exists()  # stopped before any result
  rerun = tiny_run.run(workdir, compilation_cache)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert "rebuilt its first" in rerun.stderr
  assert_same_run(workdir, tiny_reference)


# --- a finished workdir ---------------------------------------------------------------------------


def test_a_finished_workdir_says_nothing_ran_and_redraws_missing_plots(tmp_path, tiny_reference,
                                                                       compilation_cache):
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  assert not (workdir / "plots").exists()  # as if killed between results.json and the plots
  (workdir / "error.log").write_text("the traceback of a failure the run since resumed from\n")
  done = tiny_run.run(workdir, compilation_cache, "--config.eval.write_plots=True")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "nothing ran" in done.stdout and "already holds this finished run" in done.stdout
  assert "results written" not in done.stdout
  assert sorted(os.listdir(workdir / "plots"))  # redrawn
  assert tiny_run.results(workdir) == tiny_run.results(tiny_reference)
  assert not (workdir / "error.log").exists()  # an earlier failure's, stale once finished


def test_a_finished_run_on_a_read_only_mount_reprints_its_results(tmp_path, tiny_reference):
  """Reprinting a finished run needs no lock and writes nothing: on a read-only mount it was
  refused as an unwritable workdir (exit 4)."""
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  config = tiny_run.config()
  config.eval.write_plots = True  # its plots are missing: said, not redrawn
  with _read_only(workdir):
    before = snapshot(workdir)
    results = trainer.train_and_evaluate(config, str(workdir), progress=False)
    assert snapshot(workdir) == before
  assert results.pop("already_finished")
  assert results == json.loads((tiny_reference / "results.json").read_text())


def test_a_finished_run_on_a_read_only_mount_says_its_log_is_cut(tmp_path, tiny_reference,
                                                                 caplog):
  """A cut metrics.jsonl of a finished run on a read-only mount: reprinted with exit 0 as before,
  but no longer in silence (writable, it is rebuilt with a warning)."""
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  _cut_at_a_line(workdir / "metrics.jsonl")
  with _read_only(workdir), caplog.at_level(logging.WARNING):
    before = snapshot(workdir)
    results = trainer.train_and_evaluate(tiny_run.config(), str(workdir), progress=False)
    assert snapshot(workdir) == before
  assert results.pop("already_finished")
  said = [r.getMessage() for r in caplog.records if "the finished run's" in r.getMessage()]
  assert len(said) == 1 and "(truncated?)" in said[0], caplog.text
  assert said[0].endswith(f"{workdir} cannot be written, so it stays so: make it writable and"
                          f" run the same command: it rebuilds the log from the copy checkpoint"
                          f" {tiny_run.N_STEPS} keeps")


def test_a_key_added_since_the_run_was_made_is_told_as_such(tmp_path):
  """A resume after an upgrade that added a key was told to pass "the run's original config",
  which no config given to the new version can be (it has the key)."""
  saved = checkpointing.config_to_dict(tiny.get_config())
  del saved["learner"]["allow_dead_lora"]
  with pytest.raises(checkpointing.WorkdirError, match=re.escape(
      "(learner.allow_dead_lora: '<absent>' -> False); learner.allow_dead_lora is newer than the"
      " run (added to olora-jax since it was made): pass a new --workdir to run it with this"
      " version, or resume it with the version of olora-jax that made it")):
    checkpointing.check_same_config(saved, tiny.get_config(), str(tmp_path))
  saved["seed"] = 7  # and a value of its own: its original config too
  with pytest.raises(checkpointing.WorkdirError, match=r"that made it and the run's original"
                     r" config$"):
    checkpointing.check_same_config(saved, tiny.get_config(), str(tmp_path))


def test_keys_of_blocks_the_run_never_reads_are_no_difference(tmp_path):
  """A partial run made before `der_pp.optimizer` existed was refused on resume as "a different
  config" though an Online-LoRA run never reads der_pp's block; a key of its own block still is."""
  saved = checkpointing.config_to_dict(tiny.get_config())
  del saved["der_pp"]["optimizer"]
  checkpointing.check_same_config(saved, tiny.get_config(), str(tmp_path))
  del saved["learner"]["allow_dead_lora"]
  with pytest.raises(checkpointing.WorkdirError, match=re.escape(
      "(learner.allow_dead_lora: '<absent>' -> False); learner.allow_dead_lora is newer")):
    checkpointing.check_same_config(saved, tiny.get_config(), str(tmp_path))


def test_an_older_versions_finished_run_is_reprinted(tmp_path, tiny_reference):
  """A finished run whose config.json lacks keys added since (an older olora-jax made it) was
  refused with exit 2; nothing runs, so it is reprinted. A value of its own still refuses."""
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  saved = json.loads((workdir / "config.json").read_text())
  del saved["learner"]["allow_dead_lora"], saved["der_pp"]["optimizer"]
  (workdir / "config.json").write_text(json.dumps(saved))
  results = trainer.train_and_evaluate(tiny_run.config(), str(workdir), progress=False)
  assert results.pop("already_finished")
  assert results == json.loads((tiny_reference / "results.json").read_text())
  config = tiny_run.config()
  config.seed = 7
  with pytest.raises(checkpointing.WorkdirError, match=re.escape("(seed: 0 -> 7)")):
    trainer.train_and_evaluate(config, str(workdir), progress=False)


def test_a_key_added_to_the_users_own_method_file_is_told_as_theirs(tmp_path):
  """A key added to the config block of a method of the user's own file was called "added to
  olora-jax", with the advice to resume with the olora-jax that made the run."""
  method = "examples/custom_method/class_balanced_er.py:build"
  config = tiny.get_config(method)
  saved = checkpointing.config_to_dict(config)
  del saved["cb_er"]["replay_batch"], saved["learner"]["allow_dead_lora"]
  with pytest.raises(checkpointing.WorkdirError) as raised:
    checkpointing.check_same_config(saved, config, str(tmp_path))
  assert str(raised.value).endswith(
      "learner.allow_dead_lora is newer than the run (added to olora-jax since it was made): pass"
      " a new --workdir to run it with this version, or resume it with the version of olora-jax"
      " that made it; cb_er.replay_batch is newer than the run (added to the config block of your"
      " method in examples/custom_method/class_balanced_er.py since the run was made): pass a new"
      " --workdir to run it with the file as it is now, or resume it with"
      " examples/custom_method/class_balanced_er.py as it was when the run was made")


@pytest.mark.parametrize("damage", [_cut_at_a_line, Path.unlink, lambda log: log.open("a").write(
    '{"step": 0}\n')], ids=["cut", "deleted", "appended"])
def test_a_finished_run_with_a_damaged_log_says_so_and_rebuilds_it(tmp_path, tiny_reference,
                                                                   compilation_cache, damage):
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  damage(workdir / "metrics.jsonl")
  done = tiny_run.run(workdir, compilation_cache)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "the finished run's" in done.stderr and "nothing ran" in done.stdout
  assert (workdir / "metrics.jsonl").read_bytes() == (
      tiny_reference / "metrics.jsonl").read_bytes()


# --- the TensorBoard mirror -----------------------------------------------------------------------


def test_the_tensorboard_mirror_switches_off_on_a_file_size_limit(tmp_path):
  """A real process whose event file hits RLIMIT_FSIZE: one warning, no exception, no hang."""
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(ROOT)!r})
      from olora_jax import tb_writer
      tb_writer.FLUSH_SECONDS = 0.0  # flush every record, so the limit is hit at once
      w = tb_writer.make_scalar_writer({str(tmp_path / "tb")!r})
      for i in range(2000):
        w.write("train", i, {{"loss": 1.0 / (i + 1), "reg": 0.5}})
      print("active" if w.active else "off")
      w.close()
      """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, preexec_fn=_limit_file_size(4096))
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "off"
  assert done.stderr.count("TensorBoard mirror switched off") == 1
  assert "File too large" in done.stderr


def _read_events(path: Path) -> list:
  """TFRecord frames of an event file, each checked against its two masked CRCs."""
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c

  data, events, at = path.read_bytes(), [], 0
  while at < len(data):
    header = data[at:at + 8]
    (n,) = np.frombuffer(header, "<u8")
    assert int(np.frombuffer(data[at + 8:at + 12], "<u4")[0]) == masked_crc32c(header)
    body = data[at + 12:at + 12 + int(n)]
    assert int(np.frombuffer(data[at + 12 + int(n):at + 16 + int(n)], "<u4")[0]) == (
        masked_crc32c(body))
    events.append(event_pb2.Event.FromString(body))
    at += 16 + int(n)
  return events


def test_the_tensorboard_events_are_valid_records(tmp_path):
  w = tb_writer.ScalarWriter(str(tmp_path))
  w.write("eval", 1000, {"anytime_accuracy": 0.5, "n": 3, "flag": True, "none": None})
  w.write("train", 1016, {"loss": float("nan")})  # nothing finite: no record
  w.close()
  (path,) = list(tmp_path.iterdir())
  events = _read_events(path)
  assert events[0].file_version == "brain.Event:2"
  assert [(e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in events[1:]] == [
      (1000, [("eval/anytime_accuracy", 0.5), ("eval/n", 3.0)])]


def test_a_failing_tensorboard_mirror_does_not_change_the_run(tmp_path, tiny_reference,
                                                             monkeypatch, caplog):
  def failing_append(self, event):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(tb_writer.ScalarWriter, "_append", failing_append)
  workdir = tmp_path / "run"
  trainer.train_and_evaluate(tiny_run.config(), str(workdir), progress=False)
  assert caplog.text.count("TensorBoard mirror switched off") == 1
  assert_same_run(workdir, tiny_reference)


# --- bad input through the command line ----------------------------------------------------------


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300)


def _tiny(workdir: Path, *overrides: str) -> subprocess.CompletedProcess:
  return _cli("--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(workdir),
              *overrides)


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/absent.py"], "error: config file 'configs/absent.py' does not exist;"),
    (["--config", "configs/split_cifar100.py:vit_g14"],
     "error: ValueError: unknown backbone 'vit_g14' after the config file's ':'"),
    (["--config", "configs/tiny.py", "--config.seed=99999999999999999999"],
     "error: seed=99999999999999999999 must be an integer in [0, 4294967295]"),
    (["--config", "configs/tiny.py", "--config.seed=-1"],
     "error: seed=-1 must be an integer in [0, 4294967295]"),
    (["--config", "configs/tiny.py", "--config.learner.learning_rate=inf"],
     "error: learner.learning_rate=inf must be a finite number"),
    (["--config", "configs/tiny.py", "--config.learner.reg_lambda=inf"],
     "error: learner.reg_lambda=inf must be a finite number"),
    (["--config", "configs/tiny.py", "--config.learner.mean_threshold=nan"],
     "error: learner.mean_threshold=nan must be a finite number"),
], ids=["missing_config", "bad_backbone", "seed_too_large", "negative_seed", "inf_lr",
        "inf_lambda", "nan_threshold"])
def test_bad_command_lines_exit_2_with_one_line(tmp_path, args, message):
  workdir = tmp_path / "run"
  done = _cli(*args, "--workdir", str(workdir))
  assert done.returncode == errors.EXIT_BAD_INPUT, done.stderr[-2000:]
  assert last_line(done.stderr).startswith(message), done.stderr[-2000:]
  assert "Traceback" not in done.stderr
  assert not workdir.exists()


def test_a_workdir_that_is_a_file_or_a_corrupt_config_json(tmp_path, tiny_reference):
  path = tmp_path / "a_file"
  path.write_text("keep me")
  done = _tiny(path)
  assert done.returncode == errors.EXIT_BAD_INPUT
  assert last_line(done.stderr).startswith(f"error: --workdir='{path}' is a file, not a directory")
  assert path.read_text() == "keep me"

  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  (workdir / "config.json").write_text("{not json")
  with pytest.raises(errors.BadInput, match=r"run/config.json is damaged \(JSONDecodeError: "):
    trainer.train_and_evaluate(tiny_run.config(), str(workdir), progress=False)


def test_nan_pretrained_weights_are_refused_naming_the_tensor(tmp_path):
  config = tiny.get_config()
  spec = spec_from_config(config.model)
  params = jax.jit(VisionTransformer(spec, 10).init)(
      jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32))["params"]
  params = jax.tree.map(np.array, params)
  params["encoderblock_0"]["mlp"]["fc1"]["kernel"][3, 5] = np.nan
  path = tmp_path / "nan.safetensors"
  save_timm_safetensors(params, str(path))
  workdir = tmp_path / "run"
  done = _tiny(workdir, f"--config.pretrained.path={path}")
  assert done.returncode == errors.EXIT_BAD_INPUT, done.stderr[-2000:]
  assert last_line(done.stderr) == (
      f"error: checkpoint {path} key 'blocks.0.mlp.fc1.weight' holds 1 NaN/Inf value(s) of 512;"
      " the file is damaged: fetch or convert it again")
  assert not workdir.exists()


def test_a_tfds_dataset_that_was_never_built(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"TFDS dataset 'cifar100' \(split 'train'\) is not"
                     r" prepared as array_record in data_dir=.*; prepare it with `tfds build"):
    tfds_sources.open_data_source("cifar100", "train", str(tmp_path))


# --- skipping non-finite steps has a bound ---------------------------------------------------


def test_skipping_non_finite_steps_stops_past_the_bound(tmp_path):
  config = tiny.get_config()
  config.learner.learning_rate = 1e38  # the loss is NaN from the second step on
  config.learner.skip_nonfinite = True
  config.learner.max_skipped_fraction = 0.1  # 46 steps: at most 4 skipped
  workdir = tmp_path / "run"
  with pytest.raises(errors.NonFiniteLoss,
                     match=r"5 stream steps skipped for a non-finite loss \(the latest: 5\), more"
                     r" than learner.max_skipped_fraction=0.1 of the 46 steps allow"):
    trainer.train_and_evaluate(config, str(workdir), progress=False)
  events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [e["step"] for e in events if e["event"] == "nonfinite_skipped"] == [1, 2, 3, 4]


def test_a_non_finite_evaluated_model_stops_the_run_naming_the_key_that_made_it(tmp_path):
  """SLCA's aligned head is computed for evaluation only (its eval_state), after the trained
  state's finite loss: a runaway alignment rate made it NaN and the run scored the NaN logits
  (A_final 10%, exit 0, NaN in the export). The evaluated model has its own check."""
  config = tiny.get_config("slca")
  config.slca.alignment_learning_rate = 1e30
  config.eval.export, config.eval.write_plots = "logits", False
  workdir = tmp_path / "run"
  with pytest.raises(errors.NonFiniteLoss, match=re.escape(
      "the model evaluated after stream step 8 holds NaN/Inf (2 array(s), e.g."
      " ['params']['head']['bias']) though the trained state's loss was finite: method='slca'"
      " computes it for evaluation (its eval_state); lower slca.alignment_learning_rate with a"
      " new --workdir (this one keeps this run's config), or check the data; no checkpoint was"
      " written yet")):
    trainer.train_and_evaluate(config, str(workdir), progress=False)
  assert not (workdir / "export").exists() and not (workdir / "results.json").exists()


def test_an_error_in_a_host_callback_names_the_users_exception_and_file(tmp_path):
  """A method's host callback that raises reaches the loop as JAX's runtime error, whose first
  line is a frame of JAX's: the line names the method's exception and file instead, by its type
  and first line when its message spans several (it read "x = 3", its last line)."""
  def check(x):
    raise ValueError("my check failed\nx = 3")

  line = check.__code__.co_firstlineno + 1

  @jax.jit
  def step(x):
    jax.debug.callback(check, x)
    return x + 1

  def run():
    step(np.float32(1)).block_until_ready()
    jax.effects_barrier()

  with pytest.raises(errors.InternalError, match=re.escape(
      f"ValueError: my check failed (raised at {__file__}:{line}); fix the code there")):
    trainer._guarded(run, str(tmp_path))


def test_the_non_finite_advice_names_the_methods_own_rate_and_a_new_workdir(tmp_path):
  """The key to lower is the one the method reads (its own block's), and a changed rate is
  another config: the advice says it needs a new --workdir (the same one refuses it)."""
  for method, key in (("online_lora", "learner.learning_rate"), ("er", "er.learning_rate"),
                      ("slda", None)):
    assert run_control.learning_rate_key(tiny.get_config(method), method if method != "online_lora"
                                         else "learner") == key

  class Saver:  # what the policy needs of the run's saver
    checkpointer = type("C", (), {"directory": str(tmp_path / "checkpoints")})

    def save(self, state, p):
      pass

  p = type("P", (), {"nonfinite_steps": []})()
  policy = run_control.NonFinitePolicy(False, 0.05, 46, Saver(), "er.learning_rate")
  with pytest.raises(errors.NonFiniteLoss, match=re.escape(
      "; lower er.learning_rate with a new --workdir (this one keeps this run's config), or rerun"
      " the same command with --config.learner.skip_nonfinite=True to skip such steps (it resumes"
      " here)")):
    policy.check(7, {"loss": np.float32("nan")}, None, p)
  saved, lowered = tiny.get_config("er"), tiny.get_config("er")
  lowered.er.learning_rate = saved.er.learning_rate / 10
  with pytest.raises(errors.BadInput, match=r"er.learning_rate: .*; pass a new --workdir"):
    checkpointing.check_same_config(checkpointing.config_to_dict(saved), lowered, str(tmp_path))


def test_the_closing_table_lists_skipped_steps(tiny_reference):
  results = json.loads((tiny_reference / "results.json").read_text())
  assert "skipped" not in trainer.format_results_table(results)
  # The tiny stream is disjoint: its Task-IL numbers have a row; a run without them, none.
  til = (f"| Task-IL A_final / A_auc (%) | {100 * results['A_final_task_il']:.2f} /"
         f" {100 * results['A_auc_task_il']:.2f} |")
  assert til in trainer.format_results_table(results)
  assert "Task-IL" not in trainer.format_results_table(
      {k: v for k, v in results.items() if "task_il" not in k})
  results["nonfinite_steps"] = [7, 19]
  assert "| steps skipped for a non-finite loss | 2 (7, 19) |" in (
      trainer.format_results_table(results))
  # A method without a plateau rule says so, not "n/a / 0.00" (a recall it never aimed at).
  table = trainer.format_results_table(results, tiny_run.config())
  assert "| plateau precision / recall |" in table  # Online-LoRA detects plateaus
  config = tiny_run.config()
  config.method = "er"
  table = trainer.format_results_table(results, config)
  assert "| plateau detection | none: this method has no plateau rule |" in table
  assert "precision" not in table
  assert table.splitlines()[2].endswith(" | none |")  # the headline row says so too, not "0"
  # A forgetting that rounds to zero is 0.00, with no sign that reads as a gain.
  results["forgetting"] = -1e-7
  headline = trainer.format_results_table(results, config).splitlines()[2]
  assert headline.split(" | ")[2] == "0.00", headline


# --- what each failure becomes -------------------------------------------------------------------


@pytest.mark.parametrize("error,cause,advice", [
    (OSError(28, "No space left on device"), "No space left on device",
     "free space on that disk (or pass another --workdir)"),
    (OSError(30, "Read-only file system"), "Read-only file system",
     "make it writable (or pass another --workdir)"),
    (ValueError('OUT_OF_RANGE: Error writing "x": Failed to write 10 bytes to file 16: File too'
                " large [os_error_code='27']"), "File too large",
     "lift the file-size limit (ulimit -f)"),
    # NumPy's short write on a full disk carries no errno, only its counts.
    (OSError("500 requested and 255 written"), "No space left on device (a short write)",
     "free space on that disk (or pass another --workdir)"),
], ids=["enospc", "erofs", "orbax_efbig", "numpy_short_write"])
def test_storage_failures_become_exit_4_naming_the_checkpoint_to_resume(tmp_path, error, cause,
                                                                         advice):
  (tmp_path / "checkpoints" / "12").mkdir(parents=True)
  (tmp_path / "checkpoints" / "16.orbax-checkpoint-tmp").mkdir()  # a failed save: not counted

  def fail():
    try:
      raise RuntimeError("while saving")
    except RuntimeError as context:
      raise error from context

  with pytest.raises(errors.EnvironmentFailure, match=re.escape(
      f"cannot write to workdir '{tmp_path}' ({cause}); {advice}, then run the same command to"
      " resume from checkpoint 12")):
    trainer._guarded(fail, str(tmp_path))


def test_other_failures_become_exit_1_and_typed_ones_pass_through(tmp_path):
  def bug():  # a bug of olora_jax: a frame of the package raises
    checkpointing.Progress.from_json({})

  with pytest.raises(errors.InternalError, match=r"unexpected TypeError: EvaluationLog.__init__\(\)"
                     r" missing .* \(raised at"
                     r" .*olora_jax/checkpointing.py:\d+\); the run can resume from the start;"
                     r" please report it") as info:
    trainer._guarded(bug, str(tmp_path))
  assert info.value.exit_code == errors.EXIT_INTERNAL

  def own_code():  # code outside the package (a method or dataset of the user's) raises
    raise KeyError("oops")

  line = own_code.__code__.co_firstlineno + 1
  with pytest.raises(errors.InternalError, match=re.escape(
      f"KeyError: 'oops' (raised at {__file__}:{line}); fix the code there, then run the same"
      " command to resume from the start")):
    trainer._guarded(own_code, str(tmp_path))

  def refused():
    raise errors.BadInput("bad")

  with pytest.raises(errors.BadInput):
    trainer._guarded(refused, str(tmp_path))


# --- signals at any moment ------------------------------------------------------------------------


def test_signals_at_random_moments_of_start_up_exit_with_one_line(tmp_path, tiny_reference,
                                                                   compilation_cache):
  """SIGINT / SIGTERM during imports, set-up, compilation or the first steps: exit 128 + signal
  with one `error:` line, nothing half-written; the same command then completes exactly. (The
  first half second is the Python interpreter's own start-up, before run.py's first line: a
  signal there is Python's, not the run's.)"""
  rng = np.random.default_rng(0)
  workdir = tmp_path / "run"
  for i, delay in enumerate(rng.uniform(0.5, 4.0, 6)):
    sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
    proc = subprocess.Popen(tiny_run.command(workdir), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=tiny_run.env(compilation_cache))
    try:
      proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
      proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    if proc.returncode == 0:  # it finished before the signal: start the next try afresh
      shutil.rmtree(workdir)
      continue
    assert proc.returncode == 128 + sig, (delay, stderr[-2000:])
    line = last_line(stderr)
    assert line.startswith("error: stopped") and f"signal {sig}" in line, (delay, stderr[-2000:])
    if "during start-up" in line:  # the watcher's line or the set-up's: the same words
      assert line == f"error: {errors.start_up_stop(sig)}", (delay, stderr[-2000:])
    assert not (workdir / "results.json").exists()
    if (workdir / "metrics.jsonl").exists():  # every line written is whole
      for text in (workdir / "metrics.jsonl").read_text().splitlines():
        json.loads(text)
  done = tiny_run.run(workdir, compilation_cache)
  assert done.returncode == 0, done.stderr[-2000:]
  assert_same_run(workdir, tiny_reference)


def test_a_signal_in_the_set_up_stops_with_the_start_up_line_and_writes_nothing(tmp_path,
                                                                              monkeypatch):
  """A signal recorded before the set-up's check (launch/run.py records it from its first line)
  stops the run there with the line every stage before the first write prints, so the
  processes of a multi-process run, signalled at different stages of their start-up, agree."""
  monkeypatch.setattr(run_control, "PENDING_SIGNALS", [signal.SIGTERM])
  with pytest.raises(errors.Preempted) as info:
    trainer.train_and_evaluate(tiny_run.config(), str(tmp_path / "run"), progress=False)
  assert info.value.exit_code == 128 + signal.SIGTERM
  assert str(info.value) == errors.start_up_stop(signal.SIGTERM)
  assert not (tmp_path / "run").exists()


def test_a_second_signal_stops_at_once_with_its_line_and_gives_the_handlers_back(monkeypatch):
  """Outside a save, the first signal is a flag the loop reads at the end of its step (the same
  signal again within `errors.SAME_STOP_SECONDS` is that stop delivered twice) and a
  second one stops the run at once, with errors.second_signal_stop's line (launch/run.py's
  watcher prints the same, where the main thread is held in a long device call)."""
  monkeypatch.setattr(run_control, "PENDING_SIGNALS", [])
  monkeypatch.setattr(errors, "SAME_STOP_SECONDS", 0.2)
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(errors.Preempted) as info:
    with run_control.StopSignal() as stop:
      os.kill(os.getpid(), signal.SIGTERM)
      assert stop.signum == signal.SIGTERM
      os.kill(os.getpid(), signal.SIGTERM)  # the same stop again at once (SLURM): no stop now
      assert stop.signum == signal.SIGTERM
      time.sleep(0.3)
      os.kill(os.getpid(), signal.SIGINT)
  assert info.value.exit_code == 128 + signal.SIGINT
  assert str(info.value) == errors.second_signal_stop(signal.SIGINT)
  assert "the newest checkpoint is kept" in str(info.value)
  assert not info.value.every_process  # this process's own: it leaves at once
  assert signal.getsignal(signal.SIGTERM) is before  # the handlers are given back


def test_a_second_signal_during_a_save_lets_the_save_end_then_stops(tmp_path, monkeypatch):
  """The first signal asks for a checkpoint; a second one arriving while it is written waits for
  it: the checkpoint is whole, and the run stops with the first signal's exit."""
  from olora_jax import checkpointing, run_control

  config = tiny_run.config()
  save = checkpointing.Checkpointer.save
  sent = []

  def save_and_signal_twice(self, arrays, progress, meta):
    if progress.cursor == 4 and not sent:  # the first signal, then the second mid-save
      sent.append(os.kill(os.getpid(), signal.SIGTERM))
      sent.append(os.kill(os.getpid(), signal.SIGINT))
    return save(self, arrays, progress, meta)

  monkeypatch.setattr(checkpointing.Checkpointer, "save", save_and_signal_twice)
  monkeypatch.setattr(run_control, "PENDING_SIGNALS", [])
  with pytest.raises(errors.Preempted) as info:
    trainer.train_and_evaluate(config, str(tmp_path), progress=False)
  assert info.value.exit_code == 128 + signal.SIGTERM and "stopped by signal 15" in str(info.value)
  assert info.value.every_process  # the loop's stop: every process of a run agreed on it
  assert steps(tmp_path) == [4]  # the checkpoint being written, whole; the run stopped there


# launch/run.py's failure path (olora_jax.run_cli) with JAX's shutdown barrier and the exit
# replaced by lines.
_FAIL_ORDER = """
import sys
from olora_jax import run_cli as cli
cli.distributed.finish = lambda: print("shutdown barrier", file=sys.stderr, flush=True)
cli._exit_now = lambda code: print(f"exit {code}", file=sys.stderr, flush=True)
cli._fail("stopped by signal 15 after stream step 6", 143, every_process=True)
cli._fail("another process died", 4)
"""


def test_a_stop_every_process_agreed_on_leaves_after_the_shutdown_barrier():
  """A stop every process of a multi-process run raises at the same step (the loop's, on a
  signal) is left through JAX's shutdown barrier once each process has printed its line: a
  process still running when process 0, which hosts the coordination service, exits aborts
  (134) without its line. Any other error leaves at once, without waiting for a peer that may be
  gone."""
  done = subprocess.run([sys.executable, "-c", _FAIL_ORDER], capture_output=True, text=True,
                        timeout=120, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stderr.splitlines()[-5:] == [
      "error: stopped by signal 15 after stream step 6", "shutdown barrier", "exit 143",
      "error: another process died", "exit 4"], done.stderr[-2000:]


# --- sizes that cannot fit ------------------------------------------------------------------------


def test_a_state_larger_than_the_device_is_refused_naming_the_key(tmp_path, compilation_cache):
  done = tiny_run.run(tmp_path / "run", compilation_cache, "--config.method=er",
                      "--config.er.buffer_size=100000000000")
  line = last_line(done.stderr)
  assert done.returncode == errors.EXIT_BAD_INPUT, done.stderr[-2000:]
  assert "its state needs" in line and "lower er.buffer_size" in line and "buffer" in line
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_batch_larger_than_the_stream_is_refused(tmp_path):
  config = tiny.get_config()
  config.learner.batch_size = 100_000
  with pytest.raises(errors.BadInput, match=r"learner.batch_size=100000 is larger than the whole"
                     r" stream \(\d+ training samples\)"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_running_out_of_memory_is_exit_4_with_the_advice(tmp_path):
  def allocate():
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9999999999 bytes.")

  with pytest.raises(errors.OutOfMemory, match=r"the device ran out of memory \(RuntimeError:"
                     r" RESOURCE_EXHAUSTED.*lower learner.batch_size") as info:
    trainer._guarded(allocate, str(tmp_path))
  assert info.value.exit_code == errors.EXIT_ENVIRONMENT
  assert errors.out_of_memory(MemoryError()) and not errors.out_of_memory(ValueError("x"))


def test_a_full_disk_under_tensorstore_is_not_read_as_device_memory(tmp_path):
  """tensorstore reports ENOSPC with an allocation failure's status: still a full disk (exit 4,
  'free space'), not the out-of-memory advice (a changed batch size would be refused)."""
  def save():  # the text orbax raised when a checkpoint filled the disk (reproduced on a tmpfs)
    raise ValueError(
        'RESOURCE_EXHAUSTED: Error writing local file "DIR/checkpoints/12.orbax-checkpoint-tmp/'
        'arrays/_sharding": Failed writing: "DIR/_sharding.__lock": Failed to write 8598 bytes'
        " to file 17: No space left on device [os_error_code='28']")

  with pytest.raises(errors.EnvironmentFailure, match=r"\(No space left on device\); free space"
                     ) as info:
    trainer._guarded(save, str(tmp_path))
  assert not isinstance(info.value, errors.OutOfMemory)


# --- every defect of a user's dataset or manifest, named ---------------------------------------

USER_DATASET = '''
import numpy as np
def strings():
  return np.zeros((20, 8, 8, 1), np.uint8), np.array(["cat", "dog"] * 10)
def fractions():
  return np.zeros((20, 8, 8, 1), np.uint8), np.linspace(0, 1, 20)
def mixed():
  return ([np.zeros((8, 8, 1), np.uint8)] * 5 + [np.zeros((9, 8, 1), np.uint8)] * 5,
          np.arange(10) % 2)
def empty():
  return np.zeros((0, 8, 8, 1), np.uint8), np.zeros((0,), int)
def flat():
  return np.zeros((20, 64), np.uint8), np.arange(20) % 2
def three_classes():
  return np.zeros((30, 8, 8, 1), np.uint8), np.arange(30) % 3
def five_channels():
  return np.zeros((20, 8, 8, 5), np.uint8), np.arange(20) % 2
def floats():
  return np.zeros((20, 8, 8, 1)), np.arange(20) % 2
'''


@pytest.mark.parametrize("function,says", [
    ("strings", r"labels must be integers, got <U3 \(e.g. 'cat'\); map the class names"),
    ("fractions", r"labels must be integers, got float64 values that are not whole numbers"),
    ("mixed", r"the images have different shapes \(\(8, 8, 1\) at index 0, \(9, 8, 1\) at"
              r" index 5\); resize them"),
    ("empty", r"returned no examples \(0 images, 0 labels\)"),
    ("flat", r"images must be one array \(N, H, W, 1\|3\), got shape \(20, 64\)"),
    ("three_classes", r"data.n_tasks=5 must be >= 1 and divide the 3 classes evenly"),
    # The shape the function returned (20 images), not its training split's 16 after the run
    # split it (the line said "(train split) ... got shape (16, 8, 8, 5)").
    ("five_channels", r"five_channels': images must be \(N, H, W, 1\|3\), got shape"
                      r" \(20, 8, 8, 5\); convert them"),
    ("floats", r"floats': images must be uint8, got float64 \(shape \(20, 8, 8, 1\)\)"),
])
def test_each_user_dataset_defect_is_one_line_naming_the_function(tmp_path, function, says):
  (tmp_path / "mine.py").write_text(USER_DATASET)
  config = tiny.get_config()
  config.data.dataset = f"{tmp_path / 'mine.py'}:{function}"
  with pytest.raises(ValueError, match=says) as info:
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert "\n" not in str(info.value) and not (tmp_path / "run").exists()
  if function in ("strings", "mixed", "empty", "flat", "five_channels", "floats"):
    assert f"mine.py:{function}" in str(info.value)


def test_string_labels_through_the_command_line_are_exit_2(tmp_path, compilation_cache):
  (tmp_path / "mine.py").write_text(USER_DATASET)
  done = tiny_run.run(tmp_path / "run", compilation_cache,
                      f"--config.data.dataset={tmp_path / 'mine.py'}:strings")
  assert done.returncode == errors.EXIT_BAD_INPUT, done.stderr[-2000:]
  assert "labels must be integers" in last_line(done.stderr)


def test_a_manifest_repeating_ids_is_refused_within_a_step_and_counted_across(
    tmp_path, tiny_reference, caplog):
  manifest = json.loads((tiny_reference / "stream_manifest.json").read_text())
  within = json.loads(json.dumps(manifest))
  within["steps"][3][1] = within["steps"][3][0]
  within["step_labels"][3][1] = within["step_labels"][3][0]
  (tmp_path / "within.json").write_text(json.dumps(within))
  config = tiny_run.config()
  config.data.stream_manifest = str(tmp_path / "within.json")
  with pytest.raises(ValueError, match=r"step 3 lists example id \d+ 2 times; a batch holds"
                     r" distinct examples"):
    trainer.train_and_evaluate(config, str(tmp_path / "run1"), progress=False)
  across = json.loads(json.dumps(manifest))
  across["steps"][5][0] = across["steps"][1][0]
  across["step_labels"][5][0] = across["step_labels"][1][0]
  (tmp_path / "across.json").write_text(json.dumps(across))
  config.data.stream_manifest = str(tmp_path / "across.json")
  config.checkpoint_every = 0
  from olora_jax.data import manifest as manifest_lib
  from olora_jax.data import sources

  train, test = sources.load_sources(config.data, 8)
  manifest_lib.replay_stream(across, train, test, config.learner.batch_size,
                             str(tmp_path / "across.json"))
  assert "1 example id(s) occur in more steps than the stream's 1 pass(es)" in caplog.text


def test_a_refusal_inside_the_lock_leaves_no_workdir_it_made(tmp_path):
  """Exit 2 writes nothing: a workdir the lock made holds only the lock when a refusal comes, and
  both go (an oversized replay buffer once left DIR/.lock behind); an existing one is kept."""
  made = tmp_path / "new"
  with pytest.raises(errors.BadInput), workdir_lib.WorkdirLock(str(made)):
    raise errors.BadInput("refused")
  assert not made.exists()
  kept = tmp_path / "kept"
  kept.mkdir()
  with pytest.raises(errors.BadInput), workdir_lib.WorkdirLock(str(kept)):
    raise errors.BadInput("refused")
  assert kept.is_dir()


def test_an_oversized_state_is_refused_before_the_workdir_exists(tmp_path, monkeypatch):
  monkeypatch.setattr(compute, "device_memory_bytes", lambda: 1024)
  config = tiny_run.config()
  with pytest.raises(errors.BadInput, match="its state needs .* more than the 0.0 GiB"):
    trainer.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()
