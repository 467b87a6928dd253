// Device helpers shared by the epilogue node (stage 1) and the candidate reduction
// (stage 2): the packed candidate encoding and the online log-sum-exp merge. Both
// stages must agree bit for bit, so they live here once.
#pragma once

#include <cstdint>

#include "flashsampling/philox_gumbel.h"
#include "flashsampling/sampler_params.h"

namespace flashsampling {

// The stored logits of the fused truncation stay in L2 while the GEMM streams the weight past
// them (evict_last): written back to HBM during the GEMM, they slowed its weight reads, and the
// kernels after it read them from L2.
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void store_with_l2_policy(float4* address, float4 value, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(address), "f"(value.x),
               "f"(value.y), "f"(value.z), "f"(value.w), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void store_with_l2_policy(float* address, float value, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(address), "f"(value), "l"(policy) : "memory");
}

// Whether the top-k scan stores row `row`'s x where the call stores logits: every row's, but with
// per-row top_k (SamplerParams::row_logits_by_top_k: `row_top_ks` given) not those stage 2 decides
// from the candidates alone, which never read theirs (top_k_decides_row_from_candidates).
__device__ __forceinline__ bool scan_stores_row_logits(int64_t const* row_top_ks, uint32_t row) {
  return row_top_ks == nullptr || !top_k_decides_row_from_candidates(__ldg(row_top_ks + row));
}

// Reads seed/offset from device memory when the caller passed pointers (CUDA-graph
// replay sees fresh values), else uses the values. Stage 1 and stage 2 of the fused top-k
// pass both draw noise, so both resolve it here.
__device__ __forceinline__ void resolve_noise_source(NoiseSource const& src, uint64_t& seed, uint64_t& offset) {
  seed = src.seed_device ? static_cast<uint64_t>(*src.seed_device) : src.seed;
  offset = src.offset_device ? static_cast<uint64_t>(*src.offset_device) + src.offset_device_add
                             : src.offset;
}

// The noise key of sample `sample` of batch row `row` (philox_gumbel.h's contract), given the
// batch-wide seed / offset resolve_noise_source read: the row's own seed and / or offset where the
// call has per-row ones, counted on by the sample; the row's own stream where the call has them,
// else stream 0 with a per-row seed, else the row.
struct RowNoiseKey {
  uint64_t seed;
  uint64_t offset;  // offset + sample
  uint32_t stream;
};
__device__ __forceinline__ RowNoiseKey row_noise_key(NoiseSource const& src, uint64_t seed, uint64_t offset,
                                                     uint32_t row, uint32_t sample) {
  return {src.row_seeds ? static_cast<uint64_t>(__ldg(src.row_seeds + row)) : seed,
          (src.row_offsets ? static_cast<uint64_t>(__ldg(src.row_offsets + row)) : offset) + sample,
          src.row_streams ? static_cast<uint32_t>(__ldg(src.row_streams + row)) : src.row_seeds ? 0u : row};
}

// fl(1 / T) of batch row `row` (0 marks a greedy row): the [B] array launch_sampler prepared
// when it did (SamplerParams::prepare_inv_temperatures), else the row's temperature divided here
// (the same fs_inv_temperature, so the same bits), else the call's value. For loops that load it
// once per column; the others get the prepared array.
__device__ __forceinline__ float row_inv_temperature(SamplingControls const& c, uint32_t row,
                                                     float call_inv_temperature) {
  if (c.inv_temperatures) return __ldg(c.inv_temperatures + row);
  if (c.temperatures) return fs_inv_temperature(__ldg(c.temperatures + row));
  return call_inv_temperature;
}

// Appends `row` to a device row list (a count, then the rows; the count zeroed before the kernels
// that append): the cut kernel's list, which stage 2 and the plain pass's reduction fill, and the
// top_p rounds' lists.
__device__ __forceinline__ void append_to_row_list(int32_t* list, int64_t row) {
  int const at = atomicAdd(list, 1);
  list[1 + at] = static_cast<int32_t>(row);
}

// Order-preserving bits of a number: unsigned order of the bits = numeric order of the floats.
// +0.0f folds -0 into +0: the two compare equal as floats, so must as keys. NaN has no place in
// that order; each key below gives it a code of its own under every number's bits (>= 2).
__host__ __device__ __forceinline__ uint32_t number_order_bits(float value) {
  uint32_t const bits = fs_float_as_uint(value + 0.0f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Inverse of number_order_bits; NaN for the codes 0 and 1.
__host__ __device__ __forceinline__ float from_order_bits(uint32_t hi) {
  if (hi <= 1u) return fs_uint_as_float(0x7fc00000u);
  return fs_uint_as_float((hi & 0x80000000u) ? (hi & 0x7fffffffu) : ~hi);
}

// Packs a candidate so that unsigned max == "better" of philox_gumbel.h: NaN scores get 0 and
// lose to everything, like fs_candidate_better.
__device__ __forceinline__ PackedCandidate pack_candidate(float score, int32_t index) {
  uint32_t const bits = (score != score) ? 0u : number_order_bits(score);
  return (static_cast<PackedCandidate>(bits) << 32) | static_cast<uint32_t>(~index);
}

// The score of a packed candidate (NaN for the "no candidate" key 0).
__device__ __forceinline__ float unpack_score(PackedCandidate c) { return from_order_bits(static_cast<uint32_t>(c >> 32)); }

// The fused top-k pass (SamplerLoop::kTopCandidates) keeps, per (vocabulary tile, row), the
// kTopCandidatesPerTile largest transformed logits as keys whose unsigned order is the
// truncation order: larger value first, exact ties to the smaller index. Hi 32 bits:
// number_order_bits of the value, 1 for NaN (after every number), 0 for "no token" (excluded
// by the mask, or past the vocabulary); lo: ~index.
__host__ __device__ __forceinline__ uint32_t order_bits(float value) {
  return (value != value) ? 1u : number_order_bits(value);
}

__host__ __device__ __forceinline__ PackedCandidate pack_top_candidate(float value, uint32_t index) {
  return (static_cast<PackedCandidate>(order_bits(value)) << 32) | static_cast<uint32_t>(~index);
}

__host__ __device__ __forceinline__ uint32_t top_candidate_index(PackedCandidate key) {
  return ~static_cast<uint32_t>(key);
}

// Inserts `key` into the descending list top[0..N): one max / min pair per slot, no branch
// (the epilogue runs it for every element).
template <int N>
__device__ __forceinline__ void insert_top_candidate(PackedCandidate (&top)[N], PackedCandidate key) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    PackedCandidate const hi = top[i] > key ? top[i] : key;
    key = top[i] > key ? key : top[i];
    top[i] = hi;
  }
}

// The N largest of two descending lists, descending, into `a` (a bitonic merge: the pairwise
// maxima of a and reversed b are the N largest, in bitonic order; then sort them).
template <int N>
__device__ __forceinline__ void merge_top_candidates(PackedCandidate (&a)[N], PackedCandidate const (&b)[N]) {
  static_assert(N == 4, "the bitonic sort below is written for four");
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = a[i] > b[N - 1 - i] ? a[i] : b[N - 1 - i];
  auto order = [](PackedCandidate& x, PackedCandidate& y) {
    PackedCandidate const hi = x > y ? x : y;
    y = x > y ? y : x;
    x = hi;
  };
  order(a[0], a[2]);
  order(a[1], a[3]);
  order(a[0], a[1]);
  order(a[2], a[3]);
}

// The fused truncation's stored x of a token the mask excludes (or past the vocabulary): a NaN
// bit pattern no arithmetic produces (NaN logits are canonicalised to 0x7fc00000), so a reader
// of the stored logits tells excluded tokens from NaN logits.
constexpr uint32_t kExcludedLogitBits = 0xFFFFFFFFu;

// The top-k scan (the fused truncation's stage 1 on sm90): the visitor's scan
// (sm90_visitor_gumbel_argmax.hpp, reduce_top_candidates_scan) and the epilogue-warpgroup
// kernel's (kernel/sm90_sampler_epilogue_warpgroups.hpp) must give the same candidates, stored
// logits and log-mass parts bit for bit, so each per-element step they share is written once,
// here.

// The value the scan keeps of a transformed logit x: x, the canonical NaN for a NaN logit, or
// kExcludedLogitBits where the mask excludes the token (or it lies past the problem).
__device__ __forceinline__ float top_scan_value(float x, bool keep) {
  return __uint_as_float(!keep ? kExcludedLogitBits : x != x ? 0x7fc00000u : __float_as_uint(x));
}

// The candidate key of a scanned value at vocabulary id `index` (0: excluded, never a candidate).
__device__ __forceinline__ PackedCandidate top_scan_key(float value, uint32_t index) {
  return __float_as_uint(value) == kExcludedLogitBits ? PackedCandidate{0} : pack_top_candidate(value, index);
}

// log2(e) / T of a batch row, the factor from x to the log-masses' values in log2 units (y; greedy
// rows: y = x; x itself where the call asks for masses of x).
__device__ __forceinline__ float top_scan_log2_scale(SamplingControls const& c, uint32_t row,
                                                     float call_inv_temperature) {
  constexpr float kLog2e = 1.4426950408889634f;  // (the epilogue's epilogue::kLog2e)
  if (c.top_scan_masses_of_x) return kLog2e;
  float const inv_t = row_inv_temperature(c, row, call_inv_temperature);
  return (inv_t == 0.0f ? 1.0f : inv_t) * kLog2e;
}

// 2^x on the MUFU unit: flushes results below 2^-126 to 0 (terms that small do not move
// a log-sum-exp at the 1e-4 the contract asks for), 2^-inf = 0, 2^NaN = NaN.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2 on the MUFU unit: log2(0) = -inf, log2(+inf) = +inf, NaN stays NaN.
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online log-sum-exp in log2 units: (max, sum of 2^(y2 - max)); empty = (-inf, 0). A part
// whose max equals the merged max keeps its scale 1, so +inf maxima stay +inf (2^(inf - inf)
// would be NaN) and two empty parts stay empty; a NaN sum stays NaN. No branches: the
// epilogue runs lse_add for every element.
__device__ __forceinline__ void lse_merge(float& max2, float& sum, float other_max2, float other_sum) {
  float const m = fmaxf(max2, other_max2);
  float const scale = exp2_approx(max2 == m ? 0.0f : max2 - m);
  float const other_scale = exp2_approx(other_max2 == m ? 0.0f : other_max2 - m);
  sum = fmaf(sum, scale, other_sum * other_scale);
  max2 = m;
}

// Adds the term 2^y2 when `adds`: y2 = -inf adds nothing, NaN makes the sum NaN, +inf makes
// the max +inf.
__device__ __forceinline__ void lse_add(float& max2, float& sum, float y2, bool adds = true) {
  adds = adds && y2 != -INFINITY;
  float const m = fmaxf(max2, y2);  // y2 NaN: max2, and the sum turns NaN below
  float const s = fmaf(sum, exp2_approx(max2 == m ? 0.0f : max2 - m), exp2_approx(y2 == m ? 0.0f : y2 - m));
  sum = adds ? s : sum;
  max2 = adds ? m : max2;
}

// A scan run's mass of y = x / T (or of x: top_scan_log2_scale; log2 units: y2 = x * y2_scale)
// merged into (max2, sum): the
// run's max first, then its terms 2^(y2 - max) summed in run order (one exponential an element),
// then one lse_merge. Excluded tokens and NaN logits carry no mass (as in stage 2). The order of
// every operation is part of the result's bits: both scans run this one function on runs of the
// same rows.
template <int kRunValues>
__device__ __forceinline__ void add_top_scan_run_mass(float const (&values)[kRunValues], float y2_scale, float& max2,
                                                      float& sum) {
  float y2[kRunValues];
  float run_max2 = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRunValues; ++i) {
    y2[i] = values[i] == values[i] ? values[i] * y2_scale : -INFINITY;
    run_max2 = fmaxf(run_max2, y2[i]);
  }
  if (run_max2 == -INFINITY) return;
  float run_sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kRunValues; ++i) run_sum += exp2_approx(y2[i] - run_max2);
  lse_merge(max2, sum, run_max2, run_sum);
}

}  // namespace flashsampling
