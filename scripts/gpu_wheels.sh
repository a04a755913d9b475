#!/usr/bin/env bash
# Fetch, into .whl/, the wheels scripts/gpu_check.sh installs on a GPU machine that has PyTorch
# but no package registry: the packages qiao needs that such an image lacks (pydantic and its
# needs), for CPython 3.12 on x86-64 Linux. Pass other versions as arguments.
#   scripts/gpu_wheels.sh [PYTHON_VERSION]      default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection typing-extensions
ls .whl
