"""The device check's machinery (launch/device_check.py): its wall-time budget shared by the
parts, each part's processes run within their share, and the versions it reports.

    Budget        the check's deadline and each part's share of what is left when it starts
    run_process   a command run for at most its seconds: SIGTERM, then SIGKILL; its exit code,
                  seconds and output
    last_line     a process's last stderr line that is not a progress bar, and how it was stopped
    cache_dir     the persistent compilation cache of a part's runs
    versions      Python's and the libraries' versions
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import signal
import subprocess
import threading
import time

from olora_jax.benchmarks import ROOT

# In the order they run: what is cut first when time runs short comes last (docs/performance.md).
PARTS = ("demo", "stream", "steps", "torch")
# Each part's share of the budget left when it starts, against the parts still to run.
SHARES = {"demo": 0.25, "stream": 0.45, "steps": 0.25, "torch": 0.05}
RESERVE_SECONDS = 8.0  # kept back for writing the report
GRACE_SECONDS = 30.0  # after a SIGTERM, before SIGKILL
VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-collections",
            "torch")


def versions() -> dict:
  out = {"python": platform.python_version()}
  for name in VERSIONS:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


class Budget:
  """The check's deadline and each part's share of what is left when the part starts."""

  def __init__(self, seconds: float, parts: list[str]):
    self.deadline = time.monotonic() + seconds
    self.pending = list(parts)

  def left(self) -> float:
    return self.deadline - time.monotonic() - RESERVE_SECONDS

  def start(self, part: str) -> float:
    """The seconds `part` may use: its share of what is left among the parts not yet run."""
    share = SHARES[part] / sum(SHARES[p] for p in self.pending)
    self.pending.remove(part)
    return max(0.0, self.left() * share)


def run_process(command: list[str], seconds: float, env: dict | None = None,
                stop_when=None, watch=None) -> dict:
  """Runs `command` for at most `seconds`: then SIGTERM (a run checkpoints and exits 143), and
  SIGKILL GRACE_SECONDS later. `stop_when()`, polled every 50 ms, may ask for the SIGTERM
  earlier (True); `watch(line, elapsed)` sees each stderr line as it comes. Returns its exit
  code, seconds, whether it was stopped, its stderr lines (with the seconds each came at) and
  stdout."""
  start = time.monotonic()
  proc = subprocess.Popen(command, cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, errors="replace")
  lines: list[tuple[float, str]] = []

  def read_stderr():
    for line in proc.stderr:
      elapsed = time.monotonic() - start
      lines.append((elapsed, line.rstrip("\n")))
      if watch is not None:
        watch(line, elapsed)

  reader = threading.Thread(target=read_stderr, daemon=True)
  reader.start()
  out_chunks: list[str] = []
  out_reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
  out_reader.start()
  stopped = False
  while proc.poll() is None:
    if time.monotonic() - start > seconds or (stop_when is not None and stop_when()):
      stopped = True
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(GRACE_SECONDS)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
      break
    time.sleep(0.05)
  reader.join(5)
  out_reader.join(5)
  return {"rc": proc.returncode, "seconds": time.monotonic() - start, "stopped": stopped,
          "stderr": lines, "stdout": "".join(out_chunks)}


PROGRESS_BAR = re.compile(r"\d+/\d+ \[")  # a tqdm update: "  3%|...| 25/790 [00:04<...]"


def last_line(done: dict) -> str:
  """The process's last stderr line that is not a progress bar's update, after how the check
  stopped it if it did."""
  lines = [part for _, line in done["stderr"] for part in line.split("\r")
           if part.strip() and not PROGRESS_BAR.search(part)]
  text = lines[-1][:300] if lines else "(no output)"
  if done["stopped"]:
    how = "SIGKILL" if done["rc"] == -signal.SIGKILL else "SIGTERM"
    text = f"stopped by the check ({how} after {done['seconds']:.0f} s): {text}"
  return text


def cache_dir(args: argparse.Namespace, work: str, name: str) -> str:
  """The persistent compilation cache of a part's runs: --compilation_cache, or a fresh one in
  the check's temporary directory (the first run compiles cold, as a user's first run does)."""
  return args.compilation_cache or os.path.join(work, f"cache_{name}")
