#!/usr/bin/env bash
# Same-run A/B of two builds on the GPU machine (ab_builds.py): builds the tree at BASE (a
# copy of the "before" commit, e.g. `git archive <rev> | tar -x -C .ab_base`, carried) and this
# tree side by side, times them in ROUNDS alternating rounds, writes the after/before table.
#   carry: .whl (nvidia-cutlass wheel), the BASE folder
#   Both builds compile the bf16 units only (FLASHSAMPLING_ELEMENT_TYPES, where BASE's build_config.py knows it:
#   about half the fused-GEMM units, the builds' time roughly halved); every timed form is bf16.
#   usage: bash benchmarks/probes/ab_builds.sh BASE STEM "before description" "after description"
#   PROFILE_ARGS: also profile_truncation.py with these options on each build, compared per kernel
#   (ab_builds.py compare-profiles); ROUNDS=0 skips the kernel benchmark's rounds; AB_ARGS: the rounds'
#   options, e.g. "--suite truncation --shapes 4096x151936 --batches 1,16,64" (graph replays of the forms)
set -uo pipefail
BASE=$1 STEM=$2
OUT=${OUT:-/tmp/ab_out}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT/ab"
export PYTHONUNBUFFERED=1
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ NVCC_CCBIN=/usr/bin/g++; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
build() {  # tree label
  (cd "$1" && MAX_JOBS=${MAX_JOBS:-8} FLASHSAMPLING_CUDA_ARCHS=90a FLASHSAMPLING_ELEMENT_TYPES=bf16 FLASHSAMPLING_WITH_CUDA=1 PYTHONPATH=/tmp/site \
    python3 setup.py build_ext --inplace > "$OUT/build_$2.log" 2>&1) || { tail -30 "$OUT/build_$2.log"; return 1; }
}
t0=$(date +%s)
build "$BASE" before & pid_before=$!
build . after & pid_after=$!
wait $pid_before || exit 1
wait $pid_after || exit 1
echo "builds: $(( $(date +%s) - t0 )) s"
for round in $(seq 0 $(( ROUNDS - 1 ))); do
  for label in before after; do
    tree=.; [ $label = before ] && tree=$BASE
    PYTHONPATH="$tree:/tmp/site" python3 benchmarks/probes/ab_builds.py time --label $label --round $round \
      --out "$OUT/ab" ${AB_ARGS:-} || exit 1
  done
done
if [ "$ROUNDS" -gt 0 ]; then
  python3 benchmarks/probes/ab_builds.py compare --out "$OUT/ab" --stem "$STEM" --before-desc "$3" --after-desc "$4"
fi
if [ -n "${PROFILE_ARGS:-}" ]; then
  for label in before after; do
    tree=.; [ $label = before ] && tree=$BASE
    eval "PYTHONPATH=\"$tree:/tmp/site\" python3 benchmarks/probes/profile_truncation.py $PROFILE_ARGS" \
      > "$OUT/ab/profile_$label.log" 2>&1 || { tail -20 "$OUT/ab/profile_$label.log"; exit 1; }
  done
  python3 benchmarks/probes/ab_builds.py compare-profiles "$OUT/ab/profile_before.log" "$OUT/ab/profile_after.log" \
    | tee "$OUT/ab/${STEM}_profiles.txt"
fi
