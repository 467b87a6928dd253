#!/usr/bin/env bash
# Sets up (scripts/setup_env.sh) and runs every test: the CPU suite, the nvcc compile
# checks of the CUDA kernels (skipped without nvcc) and the GPU tests (skipped without
# a GPU). Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not compile_check"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
status=0
"${PYTHON:-python3}" -m pytest tests -ra "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$status"
