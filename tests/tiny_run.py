"""The tiny stream shared by the resume and failure tests: its config, its command line, and
comparisons with an uninterrupted run of it (the `tiny_reference` fixture in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from configs import tiny
from olora_jax import compute

ROOT = Path(__file__).resolve().parents[1]
# 46 steps; checkpoints at 4, 8, ..., 44, 46; these thresholds make plateaus (merges, Omega, the
# peak rule) fire at steps 4, 13, 20 and 30, so the kills below land between merges. No figures
# (an output-only key, 1.5-2 s of each run): the tests that need them ask for them.
OVERRIDES = {"checkpoint_every": 4, "max_to_keep": 2, "learner.mean_threshold": 6.0,
             "learner.var_threshold": 1.0, "eval.write_plots": False}
N_STEPS = 46


def config():
  c = tiny.get_config()
  for key, value in OVERRIDES.items():
    section, _, leaf = key.rpartition(".")
    setattr(c[section] if section else c, leaf, value)
  return c


def command(workdir: Path, *extra: str) -> list[str]:
  return [sys.executable, str(ROOT / "launch" / "run.py"), "--config",
          str(ROOT / "configs" / "tiny.py"), "--workdir", str(workdir),
          *(f"--config.{k}={v}" for k, v in OVERRIDES.items()), *extra]


# The tests compile on XLA's CPU backend at LLVM optimisation level 0: compiling, not running,
# dominates the tests' tiny programs, and this about halves it (one tiny run end to end, on a
# loaded 2-core machine: 46 s -> 24 s). Floats may differ in their last bits from those of XLA's
# default level (the tiny stream's losses do; its plateaus and accuracies are
# identical), and every comparison in the tests is between programs compiled alike. conftest.py
# sets it for the session and its subprocesses (which inherit XLA_FLAGS) unless XLA_FLAGS already
# names `--xla_backend_optimization_level` (that level is kept) or OLORA_TEST_XLA_OPT=default
# (XLA's own default level, as users run it; CI's second leg).
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
# XLA's CPU compiler emits fusions through its newer MLIR "fusion emitters"; jaxlib 0.10 still has
# the legacy emitters behind this flag, and they compile the tests' many small fusions faster (a
# cold Swin ER run of test_swin_run at level 0, 2 CPU cores: its train step's XLA compile 4.0 s ->
# 2.1 s, the whole run 16.4 s -> 12.7 s). jaxlib 0.12 dropped the flag and aborts on it as
# unknown, so the session adds it only where this jaxlib accepts it (xla_accepts); XLA's default
# level (CI's second leg) keeps XLA's own emitters.
LEGACY_FUSION_FLAG = "--xla_cpu_use_fusion_emitters=false"
XLA_OPT_ENV = "OLORA_TEST_XLA_OPT"
XLA_OPT_CHOICES = ("fast", "default")


def xla_accepts(flag: str, environ=None) -> bool:
  """Whether this Python's XLA starts with `flag` in XLA_FLAGS (it aborts on a flag it does not
  know): asked of a subprocess, once, before the session's own backend exists."""
  env = {**(os.environ if environ is None else environ), "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, timeout=120)
  return done.returncode == 0


def session_xla_env(environ, accepts=xla_accepts) -> dict:
  """What the test session sets in `environ` before JAX starts: XLA_FLAGS with FAST_COMPILE_FLAG
  (and LEGACY_FUSION_FLAG where `accepts` it) added, or nothing where `environ` names a level or
  asks for XLA's default."""
  choice = environ.get(XLA_OPT_ENV, "fast")
  if choice not in XLA_OPT_CHOICES:
    raise ValueError(f"{XLA_OPT_ENV}={choice!r}: expected one of {', '.join(XLA_OPT_CHOICES)}")
  flags = environ.get("XLA_FLAGS", "")
  if choice == "default" or "--xla_backend_optimization_level" in flags:
    return {}
  fast = [FAST_COMPILE_FLAG]
  if "--xla_cpu_use_fusion_emitters" not in flags and accepts(LEGACY_FUSION_FLAG, environ):
    fast.append(LEGACY_FUSION_FLAG)
  return {"XLA_FLAGS": " ".join([flags, *fast]).strip()}


# The level a convolutional network (the reduced ResNet-18) compiles at where the session compiles
# at FAST_COMPILE_FLAG: at level 0 its convolutions run several times slower than they compile
# faster (its ER run on the tiny stream: 124 s at level 0, 45 s at XLA's default), and level 1
# compiles in less time than the default for about the same running time (test_resnet's ER and
# GDumb runs, cold compilation cache, 2-core Intel Xeon, median of 3 alternated: 99.5 CPU-s at the
# default level with LEGACY_FUSION_FLAG, 75.8 at level 1).
CONV_COMPILE_FLAG = "--xla_backend_optimization_level=1"


def convolution_level_env() -> dict:
  """os.environ for a subprocess that runs a convolutional network: FAST_COMPILE_FLAG (the
  session's level 0, or level 0 named in XLA_FLAGS) becomes CONV_COMPILE_FLAG; a session at
  XLA's default level, or at another level named in XLA_FLAGS, keeps its own."""
  flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE_FLAG, CONV_COMPILE_FLAG).strip()
  return {**os.environ, "XLA_FLAGS": flags}


def xla_flags(*flags: str) -> str:
  """XLA_FLAGS for a subprocess: the session's (see session_xla_env) plus `flags`."""
  return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


def cache_env(cache: Path) -> dict:
  """The environment that points a subprocess's persistent compilation cache at `cache`."""
  return {"JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def env(cache: Path) -> dict:
  """A persistent compilation cache shared by the subprocesses: only the first one compiles."""
  return {**os.environ, **cache_env(cache)}


def run(workdir: Path, cache: Path, *extra: str, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run(command(workdir, *extra), cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=env(cache), **kwargs)


def keep_printed(workdir: Path, done: subprocess.CompletedProcess) -> None:
  """Keeps what a run printed beside its workdir (not in it: tests compare workdirs' files)."""
  for name in ("stdout", "stderr"):
    workdir.with_name(f"{workdir.name}.{name}").write_text(getattr(done, name))


def printed(workdir: Path) -> tuple[str, str]:
  """The (stdout, stderr) that keep_printed kept of the run in `workdir`."""
  return tuple(workdir.with_name(f"{workdir.name}.{n}").read_text() for n in ("stdout", "stderr"))


def steps(workdir: Path) -> list[int]:
  d = workdir / "checkpoints"
  return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if d.is_dir() else []


def stop_after_checkpoint(workdir: Path, at_least: int, sig: int, cache: Path,
                          *extra: str, times: int = 1) -> subprocess.CompletedProcess:
  """Starts the run (with `extra` flags), sends `sig` (`times` times back to back, as SLURM
  delivers one stop twice) once checkpoint `at_least` (or later) exists, waits for it."""
  proc = subprocess.Popen(command(workdir, *extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env(cache))
  deadline = time.time() + 300
  while proc.poll() is None and not (steps(workdir) and steps(workdir)[-1] >= at_least):
    assert time.time() < deadline, "the run made no checkpoint in time"
    time.sleep(0.005)
  assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
  for _ in range(times):
    proc.send_signal(sig)
  _, stderr = proc.communicate(timeout=300)
  assert not (workdir / "results.json").exists()
  return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def final_checksums(workdir: Path) -> dict:
  """The digest of every array of the final (newest) checkpoint: params, optimizer state, Omega,
  buffer."""
  path = workdir / "checkpoints" / str(steps(workdir)[-1]) / "checksums" / "metadata"
  return json.loads(path.read_text())["arrays"]


def results(workdir: Path) -> dict:
  out = json.loads((workdir / "results.json").read_text())
  for key in compute.MEASUREMENT_KEYS:
    del out[key]
  return out


def assert_same_run(workdir: Path, reference: Path) -> None:
  assert results(workdir) == results(reference)
  assert (workdir / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
  assert final_checksums(workdir) == final_checksums(reference)


def snapshot(workdir: Path, skip: tuple[str, ...] = ()) -> dict:
  """Every file's (mtime, bytes), but those named in `skip` (e.g. the lock file)."""
  return {str(p.relative_to(workdir)): (p.stat().st_mtime_ns, p.read_bytes())
          for p in workdir.rglob("*") if p.is_file() and p.name not in skip}


def last_line(stderr: str) -> str:
  lines = [line for line in stderr.splitlines() if line.strip()]
  return lines[-1] if lines else ""
