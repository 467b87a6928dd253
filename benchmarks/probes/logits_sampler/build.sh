#!/usr/bin/env bash
# Builds the logits-sampler harness (harness.cu) with the working tree's kernel and a
# reference build of it from a git revision (REF, default HEAD), for sm90a, into $BUILD:
#   REF=HEAD benchmarks/probes/logits_sampler/build.sh && /tmp/logits_sampler/harness --batches 1,64,256
# EXTRA_FLAGS adds nvcc flags to the working tree's kernel (e.g. -D of a variant under test).
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
BUILD=${BUILD:-/tmp/logits_sampler}
REF=${REF:-HEAD}
mkdir -p "$BUILD"
git -C "$root" show "$REF:csrc/kernels/sample_from_logits.cu" > "$BUILD/reference_kernel.cu"
mkdir -p "$BUILD/reference_include/flashsampling"  # the reference's own header first
git -C "$root" show "$REF:csrc/include/flashsampling/sample_from_logits.h" \
  > "$BUILD/reference_include/flashsampling/sample_from_logits.h"
flags=(-O3 -std=c++17 -arch=sm_90a -I "$root/csrc/include" -I "$root/csrc/kernels")
nvcc -I "$BUILD/reference_include" "${flags[@]}" -Dlaunch_sample_from_logits=launch_sample_from_logits_reference \
  -c "$BUILD/reference_kernel.cu" -o "$BUILD/reference_kernel.o" &
nvcc "${flags[@]}" ${EXTRA_FLAGS:-} -c "$root/csrc/kernels/sample_from_logits.cu" -o "$BUILD/kernel.o" &
nvcc "${flags[@]}" -c "$root/benchmarks/probes/logits_sampler/harness.cu" -o "$BUILD/harness.o" &
wait
nvcc -arch=sm_90a "$BUILD/harness.o" "$BUILD/kernel.o" "$BUILD/reference_kernel.o" -o "$BUILD/harness"
echo "$BUILD/harness"
