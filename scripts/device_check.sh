#!/usr/bin/env bash
# The device check on a GPU machine, run from the repository root as one command:
#
#     bash scripts/device_check.sh --out_dir DIR     # or OUT=DIR bash scripts/device_check.sh
#
# Installs only the wheels carried in .whl/ (scripts/device_wheels.sh) into a temporary directory,
# puts it and the repository on PYTHONPATH, and runs launch/device_check.py with $PYTHON (default
# python3), passing every flag on: --budget SECONDS (default 540), --parts, --size, --allow_cpu
# (rehearse on a CPU); `python3 launch/device_check.py --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    .whl/*.whl
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Each part runs in processes of its own: none may hold the GPU's memory for the others.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
"$python" launch/device_check.py "$@"
