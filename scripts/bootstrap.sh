#!/usr/bin/env bash
# Creates ./.venv (if needed) and installs radixserve with everything it needs to serve and test.
# Idempotent: a second run only checks that the pinned packages are present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
# The CPU build of torch must come first: an unpinned torch requirement would pull CUDA wheels.
pip install -q --disable-pip-version-check "torch==2.13.0"
pip install -q --disable-pip-version-check -e ".[serve,bench,test]"
pip install -q --disable-pip-version-check --no-deps -r requirements/no-deps.txt
# The native CPU kernels compile once per machine (~1-2 min, cached under ~/.cache/radixserve/kernels): build
# them now rather than inside the first server start or test.
python -m runtime.kernels.build
