#!/usr/bin/env bash
# One call on the GPU machine (see docs/benchmarking.md): install the carried wheels,
# build the CUDA extension, run the GPU tests, compute-sanitizer on odd shapes, then
# the kernel benchmark. Logs and results go to $OUT; a short summary prints last.
#   carry: .whl (nvidia-cutlass wheel), .fi (offline FlashInfer, optional)
#   STEPS: any of "build tests sanitizer bench truncation controls decode logprobs penalties speculative
#   serving serving_smoke ncu truncprof tp" (default: build tests sanitizer bench); truncation runs
#   bench_truncation.py (TRUNCATION_ARGS adds options); logprobs, penalties and speculative run
#   bench_logprobs.py, bench_penalties.py and bench_speculative.py (LOGPROBS_ARGS, PENALTIES_ARGS,
#   SPECULATIVE_ARGS add options); serving runs their CUDA tests, probes/profile_serving.py and the
#   three at D = 4096, each within SERVING_BENCH_TIMEOUT s (default 150; records are written one by
#   one, so a timeout keeps what ran; SERVING_BENCH_ARGS adds options to all three, e.g.
#   --batches 1,16,64); serving_smoke runs those three with --tiny --timing graph (minutes,
#   mostly torch.compile: graph capture, compile and FlashInfer on tiny shapes, nothing written);
#   PYTEST_TARGETS picks test files (default: tests), PYTEST_SELECT the tests in them (default:
#   -m requires_cuda; "-k cuda" also takes the device-parametrised tests' CUDA cases);
#   tp runs bench_tp.py over 1, 2, 4 (and 8) GPUs as the machine has them (TP_ARGS adds options)
#   BENCH_COMMIT: the commit the result files name (wins over the copied tree's .git, which may be stale)
set -uo pipefail
OUT=${OUT:-/tmp/flashsampling_out}
STEPS=${STEPS:-"build tests sanitizer bench"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# The image's default g++ (/opt/gcc) links part of libstdc++ statically, which breaks
# torch's number formatting inside our error messages: build with the system compiler.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ NVCC_CCBIN=/usr/bin/g++; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
if [ -d .fi ]; then bash .fi/setup.sh > /tmp/fi_exports.sh 2> "$OUT/fi_setup.log" && . /tmp/fi_exports.sh; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
summary=()
has_step() { [[ " $STEPS " == *" $1 "* ]]; }  # whole words: "truncprof" is not "truncation"
serving_bench() {  # serving_bench NAME ARGS...: bench_NAME.py; checks and tables print, records go to the log
  local name=$1; shift
  python3 "benchmarks/bench_$name.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\[bench\] {"
  summary+=("$name: rc=${PIPESTATUS[0]}")
}
if has_step build; then
  t0=$(date +%s)
  if ! MAX_JOBS=${MAX_JOBS:-16} FLASHSAMPLING_CUDA_ARCHS=${FLASHSAMPLING_CUDA_ARCHS:-90a} FLASHSAMPLING_WITH_CUDA=1 \
      python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1
  fi
  summary+=("build: ok in $(( $(date +%s) - t0 )) s")
fi
if has_step tests; then
  python3 -m pytest ${PYTEST_TARGETS:-tests} ${PYTEST_SELECT:--m requires_cuda} -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/tests_gpu.log" | tail -40
  summary+=("gpu tests: $(tail -1 "$OUT/tests_gpu.log")")
fi
if has_step sanitizer; then
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    compute-sanitizer --tool $tool --error-exitcode 3 python3 benchmarks/probes/sanitizer_shapes.py > "$OUT/sanitizer_$tool.log" 2>&1
    summary+=("compute-sanitizer $tool: rc=$? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1))")
  done
fi
if has_step bench; then
  python3 benchmarks/bench_sampler.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^\[bench\] {"
fi
if has_step truncation; then
  python3 benchmarks/bench_truncation.py --out "$OUT" ${TRUNCATION_ARGS:-} 2>&1 | tee "$OUT/truncation.log" \
    | grep -v "^\[bench\] {"
fi
if has_step controls; then
  python3 benchmarks/bench_controls.py --out "$OUT" ${CONTROLS_ARGS:-} 2>&1 | tee "$OUT/controls.log" | grep -v "^\[bench\] {"
fi
if has_step serving_smoke; then
  for name in logprobs penalties speculative; do
    python3 "benchmarks/bench_$name.py" --tiny --timing graph 2>&1 | grep -v "^\[bench\] {"
    summary+=("serving_smoke $name: rc=${PIPESTATUS[0]}")
  done
fi
if has_step serving; then  # the serving features in one call: their CUDA tests, where the time goes, their benchmarks
  python3 -m pytest tests/test_logprobs.py tests/test_speculative.py tests/test_penalties.py tests/test_noise_cuda.py \
    -k cuda -q -p no:cacheprovider 2>&1 | tee "$OUT/tests_serving.log" | tail -3
  summary+=("serving tests: $(tail -1 "$OUT/tests_serving.log")")
  (cd benchmarks/probes && timeout 60 python3 profile_serving.py --batches 1,64 --calls 5 2>&1 | grep "^B=") \
    | tee "$OUT/profile_serving.txt"
  for name in logprobs speculative penalties; do
    timeout ${SERVING_BENCH_TIMEOUT:-150} python3 "benchmarks/bench_$name.py" --out "$OUT" --shapes 4096x151936 \
      ${SERVING_BENCH_ARGS:-} 2>&1 | tee "$OUT/$name.log" | grep "^| " | tail -30
    summary+=("$name: rc=${PIPESTATUS[0]}")
  done
  # The device tool returns a few files a call: keep the records (the .md and .png are rebuilt
  # from the .json here, docs/benchmarking.md) and the two short logs.
  rm -f "$OUT"/*.png "$OUT"/*.md "$OUT"/{logprobs,speculative,penalties}.log "$OUT"/fi_setup.log
fi
if has_step logprobs; then serving_bench logprobs ${LOGPROBS_ARGS:-}; fi
if has_step penalties; then serving_bench penalties ${PENALTIES_ARGS:-}; fi
if has_step speculative; then serving_bench speculative ${SPECULATIVE_ARGS:-}; fi
if has_step decode; then
  python3 benchmarks/bench_decode.py --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | tail -30
fi
if has_step ncu; then  # stall reasons and source counters of the plain kernel (NCU_ARGS: shape)
  ncu --kernel-name device_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --section InstructionStats \
    python3 benchmarks/probes/profile_kernel.py ${NCU_ARGS:---batch 256 --dim 4096} > "$OUT/ncu.txt" 2>&1
  summary+=("ncu: rc=$? ($(wc -l < "$OUT/ncu.txt") lines in ncu.txt)")
fi
if has_step truncprof; then  # per-kernel times of the truncation forms, ncu of the selection kernel
  python3 benchmarks/probes/profile_truncation.py ${TRUNCPROF_ARGS:-} 2>&1 | tee "$OUT/truncprof.log" | tail -60
  ncu --kernel-name sample_from_logits_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
    python3 benchmarks/probes/profile_truncation.py --batches ${NCU_BATCH:-64} --regimes flat --forms "p0.9 [B]" \
    --path logits --calls 1 > "$OUT/ncu_logits.txt" 2>&1
  summary+=("ncu logits kernel: rc=$? ($(wc -l < "$OUT/ncu_logits.txt") lines)")
fi
if has_step tp; then
  gpus=$(nvidia-smi -L | wc -l)
  sizes=1; for w in 2 4 8; do [ "$gpus" -ge "$w" ] && sizes="$sizes,$w"; done
  python3 benchmarks/bench_tp.py --world-sizes "$sizes" --runs 3 --iters 10 --out "$OUT" ${TP_ARGS:-} 2>&1 \
    | tee "$OUT/tp.log" | grep "^|"
fi
printf '%s\n' "${summary[@]}"
