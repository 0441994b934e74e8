"""One command for a GPU lent for minutes: does the project run there, how fast, and do its
results agree with the CPU's?

    bash scripts/device_check.sh --out_dir DIR      # or: OUT=DIR bash scripts/device_check.sh
    python launch/device_check.py --out_dir DIR     # with the project installed

`--help` lists the flags. The parts (versions, peaks, demo, stream, steps, torch), the budget
they share and what the report holds are described in olora_jax/benchmarks/device_check.py, the
command line this file runs. A flag refused exits with one `error: ...` line, as does a machine
where JAX sees no GPU (unless --allow_cpu).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from olora_jax.benchmarks import device_check  # noqa: E402

if __name__ == "__main__":
  device_check.main()
