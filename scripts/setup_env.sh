#!/usr/bin/env bash
# Installs what flashsampling needs and is missing, then builds it in place
# (pip install -e). Downloads nothing when everything is present, so it also runs on
# the offline GPU machine, whose CUDA torch it keeps.
#   PYTHON   interpreter to use (default python3)
#   MAX_JOBS parallel compile jobs (default: all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

has_module() { "$PY" -c "import $1" 2>/dev/null; }

if ! has_module torch; then
  "$PY" -m pip install torch==2.13.0  # the CPU build where no torch is installed
fi
missing=()
for module in ninja pybind11 pytest numpy scipy; do
  has_module "$module" || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  "$PY" -m pip install "${missing[@]}"
fi
# Optional: the transformers integration and its tests (which skip without it). Offline
# and missing, the install fails with a warning only.
if ! "$PY" -c "import transformers, sys; sys.exit(int(transformers.__version__.split('.')[0]) < 5)" 2>/dev/null; then
  "$PY" -m pip install "transformers>=5.0" \
    || echo "setup_env.sh: could not install transformers>=5.0; the integration tests will skip" >&2
fi
if ! has_module cutlass_library; then
  "$PY" -m pip install --no-deps nvidia-cutlass==4.2.0.0  # CUTLASS headers only
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
