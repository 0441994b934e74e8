"""Benchmarks a method's train step per model size and fidelity on this machine:

    .venv/bin/python launch/bench.py --sizes tiny,vit_ti16,vit_s16 \
        --fidelities paper,reference --out bench.json
    .venv/bin/python launch/bench.py --suite accelerator --out suite.json

`--help` lists the flags. What each case measures, the columns of its table and the accelerator
suite's parts are described in olora_jax/benchmarks/bench.py, the command line this file runs
(olora_jax.benchmarks: the cases, the suite, its stream, the host input path, PyTorch's step).
A flag refused exits with one `error: ...` line before any compute.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# Before the imports (JAX's may start threads): glibc's malloc in one arena for every thread, as
# launch/run.py does (olora_jax/allocator.py); bench.main sets it again and records whether it did.
from olora_jax import allocator  # noqa: E402

allocator.keep_host_memory()

from olora_jax.benchmarks import bench  # noqa: E402

if __name__ == "__main__":
  bench.main()
