#!/usr/bin/env bash
# Installs what flashsampling needs and is missing, then builds it in place (pip install -e)
# unless the build in place is current. Downloads nothing when everything is present, so it
# also runs on the offline GPU machine, whose CUDA torch it keeps.
#
# What it installs where missing (README, "Two commands"):
#   torch==2.13.0 (CPU build; only where no torch is installed), ninja, pybind11, pytest,
#   numpy, scipy; nvidia-cutlass==4.2.0.0 (CUTLASS headers only, --no-deps);
#   transformers>=5.0,<5.25 (the tested range) with its dependencies, for the integration and
#   its tests; matplotlib, for the benchmarks' plots. The last two are optional: offline,
#   their install fails with a warning only.
# The build is skipped when the extension in flashsampling_cuda/ is newer than every source
# (csrc/, setup.py, pyproject.toml, tools/build_config.py), was built for this interpreter,
# torch and FLASHSAMPLING_* settings (build/setup_env.stamp), and imports from this checkout.
#   PYTHON   interpreter to use (default python3)
#   MAX_JOBS parallel compile jobs (default: all cores)
#   FLASHSAMPLING_REBUILD=1  build even when current
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TRANSFORMERS_RANGE=">=5.0,<5.25"

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
if ! has_module cutlass_library; then
  "$PY" -m pip install --no-deps nvidia-cutlass==4.2.0.0  # CUTLASS headers only
fi
# Optional: the transformers integration and its tests (which skip without it).
if ! "$PY" - "$TRANSFORMERS_RANGE" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
from packaging.specifiers import SpecifierSet
sys.exit(version("transformers") not in SpecifierSet(sys.argv[1]))
EOF
then
  "$PY" -m pip install "transformers$TRANSFORMERS_RANGE" \
    || echo "setup_env.sh: could not install transformers$TRANSFORMERS_RANGE; the integration tests will skip" >&2
fi
# Optional: the benchmarks' plots (they write their tables without it).
if ! has_module matplotlib; then
  "$PY" -m pip install matplotlib \
    || echo "setup_env.sh: could not install matplotlib; the benchmarks will write no plots" >&2
fi

# The build's identity: interpreter, torch and the settings setup.py reads.
stamp_file=build/setup_env.stamp
stamp=$("$PY" -c 'import os, sys, torch
print(sys.executable, torch.__version__, torch.version.cuda,
      *("%s=%s" % (k, os.environ.get(k, "")) for k in ("FLASHSAMPLING_WITH_CUDA", "FLASHSAMPLING_CUDA_ARCHS", "CUDA_HOME")))')
built() {
  local so
  so=$(ls flashsampling_cuda/_C*.so 2>/dev/null | head -n 1)
  [ -n "$so" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] || return 1
  [ -z "$(find csrc setup.py pyproject.toml tools/build_config.py -type f -newer "$so" 2>/dev/null | head -n 1)" ] \
    || return 1
  # The installed package is this checkout (an editable install of another tree would win).
  local here
  here=$(pwd -P)
  (cd / && "$PY" -c 'import os, sys, flashsampling_cuda as fs
sys.exit(os.path.realpath(os.path.dirname(fs.__file__)) != os.path.join(sys.argv[1], "flashsampling_cuda"))' "$here") \
    2>/dev/null
}
if [ "${FLASHSAMPLING_REBUILD:-0}" != "1" ] && built; then
  echo "setup_env.sh: flashsampling_cuda is built and current; not rebuilding (FLASHSAMPLING_REBUILD=1 forces it)" >&2
  exit 0
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
mkdir -p build
echo "$stamp" > "$stamp_file"
