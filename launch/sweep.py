"""Fills a table: runs methods x settings x seeds one after another on this machine.

    python launch/sweep.py --root ROOT --settings configs/demo.py,configs/demo_si_blurry.py \
        --methods pcr,lode,ema_der_pp,ema_rar --seeds 0,1,2 [-- --config.KEY=VALUE ...]
    python launch/sweep.py --status ROOT | --cancel ROOT    # --launcher slurm: one job array

The command line of the sweep API (olora_jax/sweep/): `--help` lists the flags, the docstring of
olora_jax/sweep/cli.py says what a sweep does; docs/how-to/sweep.md and docs/cluster.md.
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from olora_jax.sweep import cli  # noqa: E402

if __name__ == "__main__":
  sys.exit(cli.main(sys.argv[1:], launcher=os.path.abspath(__file__)))
