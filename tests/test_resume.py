"""Kill and resume: a run killed (SIGKILL, SIGTERM) at different steps ends bit-identical to an
uninterrupted one: same results.json (but wall time), same metrics.jsonl, same final state."""

from __future__ import annotations

import json
import shutil
import signal

import jax
import legacy_checkpoint
import pytest
import tiny_run
from tiny_run import N_STEPS, assert_same_run, snapshot, steps, stop_after_checkpoint

from olora_jax import checkpointing, trainer


def test_sigkill_at_two_steps_then_sigterm_then_resume_is_bit_exact(tmp_path, tiny_reference,
                                                                  compilation_cache):
  reference, cache = tiny_reference, compilation_cache
  workdir = tmp_path / "run"
  killed = stop_after_checkpoint(workdir, 8, signal.SIGKILL, cache)
  assert killed.returncode == -signal.SIGKILL
  first = steps(workdir)[-1]
  killed = stop_after_checkpoint(workdir, 24, signal.SIGKILL, cache)
  assert killed.returncode == -signal.SIGKILL
  second = steps(workdir)[-1]
  assert 8 <= first < 24 <= second < N_STEPS

  # SIGTERM: the process checkpoints the end of the step it is in, then exits with 128 + 15.
  # Sent twice at once, as SLURM delivers one stop (slurmstepd's and the sweep runner's): one
  # stop, not "a second signal, at once" that would lose the step.
  stopped = stop_after_checkpoint(workdir, 36, signal.SIGTERM, cache, times=2)
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
  assert "stopped by signal 15 after stream step" in stopped.stderr
  assert "second signal" not in stopped.stderr
  last = steps(workdir)[-1]
  assert 36 <= last < N_STEPS
  events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert events[-1]["step"] == last - 1  # nothing logged past the checkpointed step

  host = json.loads((workdir / "checkpoints" / str(last) / "host" / "metadata").read_text())
  before = host["progress"]["compute"]  # the ledger of the three stopped processes

  done = tiny_run.run(workdir, cache)
  assert done.returncode == 0, done.stderr[-2000:]
  assert_same_run(workdir, reference)  # the compute ledger is left out of the comparison
  after = json.loads((workdir / "results.json").read_text())["compute"]
  assert after["step_seconds"] > before["step_seconds"] > 0  # the last process added its part
  assert after["n_compilations"] > before["n_compilations"] > 0


def test_resume_falls_back_over_a_damaged_newest_checkpoint(tmp_path, tiny_reference, caplog):
  reference = tiny_reference
  """End to end (tests/test_checkpointing.py also truncates files and edits the host record)."""
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "results.json").unlink()  # as if killed between the last checkpoint and results
  files = [p for p in (workdir / "checkpoints" / str(N_STEPS) / "arrays").rglob("*")
           if p.is_file()]
  target = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(target.read_bytes())
  for i in range(64, len(data), 401):  # bytes spread over the file: some hold array data
    data[i] ^= 0x5A
  target.write_bytes(bytes(data))
  trainer.train_and_evaluate(tiny_run.config(), str(workdir), progress=False)
  assert "checkpoint 46" in caplog.text and "damaged" in caplog.text
  assert (workdir / "corrupt_checkpoints" / str(N_STEPS)).is_dir()
  assert_same_run(workdir, reference)  # steps 44 and 45 redone in this process


def test_a_workdir_of_sha256_checkpoints_resumes_bit_exact(tmp_path, tiny_reference, caplog):
  """A workdir whose checkpoints predate device digests (tests/legacy_checkpoint.py) resumes
  from them and ends as the uninterrupted run."""
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  (workdir / "results.json").unlink()
  shutil.rmtree(workdir / "checkpoints" / str(N_STEPS))  # killed before the last checkpoint
  config = tiny_run.config()
  setup = trainer.Setup(config)
  init_key, method_key = jax.random.split(jax.random.key(setup.config.seed))
  params = trainer.initial_params(setup, setup.config, init_key)
  initial = trainer.initial_state(setup.method, method_key, params, setup.mesh)
  ckpt = checkpointing.Checkpointer(str(workdir), config.max_to_keep, initial=initial)
  step = ckpt.steps()[-1]
  arrays, host = ckpt.restore_latest(initial)
  shutil.rmtree(workdir / "checkpoints" / str(step))
  ckpt._manager.reload()
  legacy_checkpoint.save(ckpt, step, arrays, host, initial=initial)
  ckpt.close()
  sums = json.loads((workdir / "checkpoints" / str(step) / "checksums" / "metadata").read_text())
  assert "digest" not in sums and sums["from_initial"] and step < N_STEPS
  trainer.train_and_evaluate(config, str(workdir), progress=False)
  assert f"at stream step {step} of" in caplog.text  # resumed from it, not started over
  assert not (workdir / "corrupt_checkpoints").exists()
  assert_same_run(workdir, tiny_reference)


def test_a_different_config_is_refused_and_the_workdir_left_as_it_was(tmp_path, tiny_reference):
  reference = tiny_reference
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "results.json").unlink()
  before = snapshot(workdir)
  c = tiny_run.config()
  c.learner.learning_rate = 0.01
  with pytest.raises(checkpointing.WorkdirError,
                     match=r"different config \(learner.learning_rate: 0.003 -> 0.01\)"):
    trainer.train_and_evaluate(c, str(workdir), progress=False)
  assert snapshot(workdir) == before


def test_a_finished_run_returns_its_results_untouched(tmp_path, tiny_reference):
  workdir = tmp_path / "run"
  shutil.copytree(tiny_reference, workdir)
  before = snapshot(workdir, skip=(".lock",))
  c = tiny_run.config()
  c.checkpoint_every = 10  # operational: may differ
  results = trainer.train_and_evaluate(c, str(workdir), progress=False)
  assert results.pop("already_finished")  # when its results.json was written
  assert results == json.loads((tiny_reference / "results.json").read_text())
  assert snapshot(workdir, skip=(".lock",)) == before
