#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels scripts/device_check.sh installs on a GPU machine
# that has JAX with CUDA, flax, optax, orbax-checkpoint, PyTorch, timm, scikit-learn, matplotlib
# and the rest of the project's needs but no network: the project's dependencies such a machine
# lacks, at the versions constraints.txt pins, for Python 3.12 on x86-64 Linux (or $PY_VERSION).
#
#     bash scripts/device_wheels.sh          # then carry .whl/ to the machine with the repository
#
# Each wheel is pure Python; their dependencies (absl-py, PyYAML, protobuf, numpy, scipy,
# pandas, scikit-learn, matplotlib, joblib) are on such a machine already.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(ml_collections mlxtend tensorboardX)  # names as constraints.txt spells them
py_version="${PY_VERSION:-3.12}"
pins=()
for name in "${PACKAGES[@]}"; do
  pin=$(grep -i "^${name}==" constraints.txt) || { echo "error: constraints.txt pins no ${name}" >&2; exit 2; }
  pins+=("$pin")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "${pins[@]}"
ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "$(ls .whl/*.whl | wc -l) wheels, ${total} bytes in all (a device call carries at most 64 MiB)"
