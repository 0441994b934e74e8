"""olora_jax/allocator.py: glibc's malloc keeps one arena for every thread when launch/run.py sets
it before its first thread (issue 78's page-fault storm: an XLA worker thread handed another
thread's arena mapped the train step's large buffer afresh at every step). Each case is a bare
Python subprocess (no JAX) that counts the arenas in glibc's own account (malloc_info)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# argv[1]: "before" starts a thread that allocates (and stays) before keep_host_memory, "none"
# skips the call. Then four threads alive at once, each allocating; then the arena count.
COUNT_ARENAS = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    barrier = threading.Barrier(6 if sys.argv[1] == "before" else 5)
    def work():
      blocks = [bytearray(4096) for _ in range(100)]  # malloc, from this thread's arena
      barrier.wait()
      barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(5 if sys.argv[1] == "before" else 4)]
    if sys.argv[1] == "before":
      threads[4].start()
    if sys.argv[1] != "none":
      from olora_jax import allocator
      allocator.keep_host_memory()
    for t in threads[:4]:
      t.start()
    barrier.wait()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    path = os.path.join(tempfile.mkdtemp(), "info.xml")
    stream = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    barrier.wait()
    print(open(path).read().count("<heap nr="))
""")


def _arenas(mode: str, **env) -> int:
  done = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], capture_output=True,
                        text=True, timeout=60, check=True,
                        env={**{k: v for k, v in os.environ.items()
                                if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES",
                                             "OLORA_KEEP_HOST_MEMORY")},
                             "PYTHONPATH": str(ROOT), **env})
  return int(done.stdout)


glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
    reason="glibc's malloc only")


@glibc
def test_threads_started_after_it_share_the_main_arena():
  assert _arenas("none") > 1  # glibc's own choice: an arena per thread, here
  assert _arenas("first") == 1
  assert _arenas("first", OLORA_KEEP_HOST_MEMORY="0") > 1  # turned off: malloc as it is


@glibc
def test_a_thread_started_before_it_keeps_an_arena_of_its_own():
  """Why launch/run.py calls it before anything else: glibc keeps an earlier thread's arena and
  deals it out to later threads too (then a step's buffer there is mapped afresh every time)."""
  assert _arenas("before") == 2


@pytest.mark.parametrize("launcher, first_thread", [("run.py", "signal_watch.watch()"),
                                                     ("bench.py", "from olora_jax.benchmarks")])
def test_the_launchers_set_it_before_any_thread_starts(launcher, first_thread):
  source = (ROOT / "launch" / launcher).read_text()
  assert 0 < source.index("allocator.keep_host_memory()") < source.index(first_thread)
