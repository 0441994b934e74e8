"""glibc's malloc set to keep freed host memory for reuse, before a run starts any thread.

    keep_host_memory    one arena, no mmap, no trimming; $OLORA_KEEP_HOST_MEMORY=0 turns it off

XLA:CPU allocates each execution's temporary buffer afresh and frees it when the execution ends:
119 MiB for the demo's `reference` train step, 4.7 GiB for ViT-S/16's (batch 8, 40 images).
glibc serves a block that large with a fresh mmap, so every step would page-fault the whole
buffer in again and the kernel zero it. With one arena, no mmap and no trimming, the freed block
is reused by the next step (docs/performance-internals.md, "Host memory on CPU").

This module imports nothing but the standard library's ctypes, os, platform and sys, so that
launch/run.py can call it before it starts its first thread (the signal watcher) and before its
slow imports: a thread's arena is fixed at its first allocation, and glibc keeps the arenas
threads made before the call. An arena that is not the main one holds at most 64 MiB and maps
any larger block afresh whatever the mmap setting, so an XLA worker thread handed such an arena
(glibc deals the existing arenas out to new threads in turn) faulted the step's buffer in at
every step: issue 78's storm, ten times the page faults and 12-15 s more system time, in the
runs where the signal watcher's arena fell to XLA's busiest worker thread.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# glibc's mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Set to 0 to leave glibc's malloc as it is (keep_host_memory does nothing).
KEEP_HOST_MEMORY_ENV = "OLORA_KEEP_HOST_MEMORY"


def keep_host_memory() -> bool:
  """Makes glibc's malloc keep freed memory for reuse instead of giving it back to the OS.

  XLA:CPU allocates each execution's temporary buffer afresh and frees it when the execution
  ends: 119 MiB for the demo's `reference` train step, 4.7 GiB for ViT-S/16's (batch 8, 40
  images). glibc serves a block that large with a fresh mmap (always, from a worker thread's
  arena), so every step page-faults the whole buffer in again and the kernel zeroes it: ~1.9M
  minor faults and ~5-6 s of system time per ViT-S/16 `reference` step on a 2-core CPU. With one
  arena, no mmap and no trimming, the freed block is reused by the next step. The program, its
  kernels and so every result are unchanged; the process keeps its peak memory until it exits.

  Call it before the process starts any thread (launch/run.py does, first thing; launch/bench.py
  before JAX's backend starts): every thread then shares the main arena. A thread that allocated
  before keeps an arena of its own, which glibc later hands to other threads as well. Returns
  whether it applied: False off Linux/glibc, or with $OLORA_KEEP_HOST_MEMORY=0.
  """
  if os.environ.get(KEEP_HOST_MEMORY_ENV, "1") == "0":
    return False
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return False
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):
    return False
  # -1 turns trimming off (mallopt(3)); each call returns 1 on success.
  return all(mallopt(param, value) == 1 for param, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
