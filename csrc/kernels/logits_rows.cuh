// What the two kernels of the logits sampler share (sample_from_logits.cu: the cut path for rows
// with top_k / top_p / min_p; streaming_rows.cu: rows without them, and min_p rows whose first y
// the fused truncation's stage 2 knows): how an element of a row reads, the
// min_p test, the noise, which rows stream, and how a row's outputs are written. Both kernels
// must give a row the same bits, so these live here once.
#pragma once

#include <cmath>
#include <cstdint>

#include "flashsampling/epilogue/candidate_math.cuh"
#include "flashsampling/philox_gumbel.h"
#include "flashsampling/sample_from_logits.h"

namespace flashsampling {

// The largest over the warp's lanes (every lane gets it): of packed candidates (the best
// candidate) and of floats.
__device__ __forceinline__ PackedCandidate warp_max(PackedCandidate v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    PackedCandidate const o = __shfl_xor_sync(0xFFFFFFFFu, v, d);
    v = o > v ? o : v;
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, d));
  return v;
}

// What an element of the row is: its transformed logit x, y and truncation key (0: excluded).
struct RowInput {
  const float* logits;
  const float* bias;
  const uint32_t* mask;  // the row's words
  float inv_t;
  bool greedy;
  uint32_t vocab_start;

  __device__ __forceinline__ PackedCandidate key(int64_t v, bool in_range, float raw, float& x, float& y) const {
    x = bias ? fs_add(raw, __ldg(bias + (in_range ? v : 0))) : raw;  // lanes past the row read a valid bias
    y = greedy ? x : fs_mul(x, inv_t);
    bool const allowed = in_range && (mask == nullptr || ((__ldg(mask + (v >> 5)) >> (v & 31)) & 1u));
    return allowed ? pack_top_candidate(y, vocab_start + static_cast<uint32_t>(v)) : PackedCandidate{0};
  }

  // key() of token `index` (a global id the row allows: a sample's, a candidate's), read again.
  __device__ __forceinline__ PackedCandidate token(uint32_t index, float& x, float& y) const {
    int64_t const v = static_cast<int64_t>(index) - vocab_start;
    return key(v, true, __ldg(logits + v), x, y);
  }
};

// fl(1 / T) of a row: its own temperature where the call gives them (0: greedy, NaN: invalid).
__device__ __forceinline__ float row_inv_t(LogitsSamplerParams const& p, int64_t row) {
  return p.temperatures ? fs_inv_temperature(__ldg(p.temperatures + row)) : p.inv_temperature;
}

// How row `row` of the call reads, at the scale inv_t (row_inv_t).
__device__ __forceinline__ RowInput row_input(LogitsSamplerParams const& p, int64_t row, float inv_t) {
  return {p.logits + row * p.logits_row_stride, p.logit_bias,
          p.allowed_mask ? p.allowed_mask + row * p.mask_words : nullptr, inv_t, inv_t == 0.0f,
          static_cast<uint32_t>(p.vocab_start)};
}

// The row's top_p (the per-row value where given).
__device__ __forceinline__ double row_top_p(LogitsSamplerParams const& p, int64_t row) {
  return p.top_ps ? __ldg(p.top_ps + row) : p.top_p;
}

// Probability mass relative to the row's first token (<= 1) in fixed point with 41 fraction
// bits: at most 2^41 an element, and at most 2^22 * 2^41 = 2^63 for a row (kLogitsSamplerMaxVocab).
// Integer sums are exact in any order, so every kernel that decides a top_p cut (the cut path's
// histograms, sorted list and winner-first passes; the streaming rows' top_p rounds) sums the
// same integers and keeps the same tokens.
using FixedMass = unsigned long long;
constexpr float kFixedOne = 2199023255552.0f;  // 2^41

// exp(y - y0) of a finite y0 in fp32 (NaN y: no mass), for top_p's and the log-sum-exp's sums.
// y0 is a row's first y (a float, passed widened), so y - y0 in fp32 is the float64 difference
// rounded to fp32 (that difference is exact, or the smaller operand lies far below half an ulp of
// the larger and both give the larger): one instruction an element instead of three conversions.
__device__ __forceinline__ float mass_of(float y, double y0) {
  return expf(y != y ? -INFINITY : y - static_cast<float>(y0));  // a select, not a branch, an element
}

__device__ __forceinline__ FixedMass fixed_mass(float y, double y0) {
  return __float2ull_rn(mass_of(y, y0) * kFixedOne);
}

// top_p's test of a prefix of the truncation order: its fixed-point mass `mass` reaches top_p of
// the row's `total` (> 0). A key survives iff its predecessor's inclusive mass does not reach
// top_p; every top_p decision of the logits sampler is this comparison on the same integers.
__device__ __forceinline__ bool top_p_reached(FixedMass mass, FixedMass total, double top_p) {
  return static_cast<double>(mass) / static_cast<double>(total) >= top_p;
}

// min_p's test of a survivor: exp(y - y0) >= min_p in float64 (truncation.py), NaN y as -inf.
// Decided from the difference alone where it is far from log(min_p), and before that from two
// floats around the row's threshold y0 + log(min_p), so that a pass over a whole row pays one
// float comparison for most of its elements.
struct MinP {
  bool on;
  double value, log_value, y0;
  bool y0_finite;
  // y < surely_below fails, y >= surely_above passes; NaN where the row has no such floats (min_p
  // off or not a positive number, or a first y that is not finite or above 1e6 in magnitude,
  // where 1e-8 would come near the rounding of y0 + log(min_p) in double).
  float surely_below, surely_above;

  __device__ __forceinline__ void set_first(double first_y, bool first_y_finite) {
    y0 = first_y;
    y0_finite = first_y_finite;
    surely_below = surely_above = __int_as_float(0x7fc00000);
    if (on && y0_finite && value > 0.0 && fabs(y0) < 1e6) {
      surely_below = __double2float_rd(y0 + log_value - 1e-8);
      surely_above = __double2float_ru(y0 + log_value + 1e-8);
    }
  }

  __device__ __forceinline__ bool keeps(float y) const {
    if (!on) return true;
    if (y < surely_below) return false;
    if (y >= surely_above) return true;
    double const ys = y != y ? -INFINITY : static_cast<double>(y);
    if (y0_finite && value > 0.0) {
      double const d = ys - y0;
      if (d > log_value + 1e-9) return true;
      if (d < log_value - 1e-9) return false;
    }
    return exp(ys - y0) >= value;
  }
};

// The test of a min_p `value` (`on`: the call has min_p); set_first once the row's first token is
// known.
__device__ __forceinline__ MinP min_p_test(bool on, double value) {
  MinP min_p{};
  min_p.on = on;
  min_p.value = value;
  min_p.log_value = value > 0.0 ? log(value) : -INFINITY;
  min_p.set_first(0.0, false);
  return min_p;
}

// The row's min_p (min_p_test).
__device__ __forceinline__ MinP row_min_p(LogitsSamplerParams const& p, int64_t row) {
  return min_p_test(p.min_ps != nullptr || p.min_p > 0.0, p.min_ps ? __ldg(p.min_ps + row) : p.min_p);
}

// A streaming row keeps every allowed token: no top_k cut (off, or at least V), no top_p cut
// (off, or >= 1; NaN cuts) and no min_p given for the call; or, with a row list, it is one of
// streamed_first_y's (where a min_p row's first y is known, its min_p test is one comparison an
// element; a top_p row's pass is verified in rounds, which hand the rows they leave undecided
// back by clearing their entry). Its sample needs one pass over the row with noise, which
// streaming_rows.cu runs over many CTAs a row; the cut path's kernel leaves these rows to it
// (LogitsSamplerParams::streaming_rows).
__device__ __forceinline__ bool is_streaming_row(LogitsSamplerParams const& p, int64_t row) {
  if (p.streamed_first_y != nullptr) return !isnan(__ldg(p.streamed_first_y + row));
  if (p.min_ps != nullptr || p.min_p > 0.0) return false;
  int64_t const k = p.top_ks ? __ldg(p.top_ks + row) : p.top_k;
  bool const top_p_on = p.top_ps != nullptr || p.top_p < 1.0;
  double const top_p = row_top_p(p, row);
  return (k < 1 || k >= p.vocab_size) && (!top_p_on || top_p >= 1.0);
}

// The perturbed score of token `index` (global) in sample `s`: x plus the noise of plain sampling
// over T, or x itself in a greedy row. Every pass that draws a token's noise draws it alike.
__device__ __forceinline__ float perturbed_score(RowInput const& in, RowNoiseKey const& noise, uint32_t s,
                                                 uint32_t index, float x) {
  return in.greedy ? x
                   : fs_perturbed_score(x, in.inv_t, fs_gumbel_noise(noise.seed, noise.offset, noise.stream, s, index));
}

// The outputs of a row without a sample (nothing allowed, or an invalid temperature), written by
// the threads `thread` of `threads`.
__device__ __forceinline__ void write_row_without_sample(LogitsSamplerParams const& p, int64_t row, int thread,
                                                         int threads, int64_t token, float lse) {
  for (int s = thread; s < p.num_samples; s += threads) {
    int64_t const out = row * p.num_samples + s;
    p.tokens[out] = token;
    if (p.scores) p.scores[out] = -INFINITY;
    if (p.token_logprobs) p.token_logprobs[out] = __uint_as_float(0x7fc00000u);
  }
  if (thread == 0 && p.logsumexp) p.logsumexp[row] = lse;
}

// Sample s of the row: its token, score, log-probability and (s = 0) the log-sum-exp over the
// survivors of mass `kept_mass` relative to y0.
__device__ __forceinline__ void write_sample(LogitsSamplerParams const& p, int64_t row, int s, float best_score,
                                             int32_t best_index, double best_y, double y0, bool y0_finite,
                                             double kept_mass) {
  // Without a finite first y the log-sum-exp is that y (+-inf, or NaN), or NaN with a NaN term.
  double const lse = y0_finite ? y0 + log(kept_mass) : kept_mass != kept_mass ? kept_mass : y0;
  bool const found = best_index != kNoCandidate;
  int64_t const out = row * p.num_samples + s;
  p.tokens[out] = found ? best_index : -1;
  if (p.scores) p.scores[out] = found ? best_score : -INFINITY;
  if (p.token_logprobs) {
    p.token_logprobs[out] = found ? static_cast<float>(best_y - lse) : __uint_as_float(0x7fc00000u);
    if (s == 0) p.logsumexp[row] = static_cast<float>(lse);
  }
}

// The streaming rows' kernels (streaming_rows.cu), for the rows is_streaming_row takes; the
// launcher of the logits sampler calls them before the cut path's kernel.
cudaError_t launch_streaming_rows(LogitsSamplerParams const& params, void* workspace, int sm_count,
                                  cudaStream_t stream);

}  // namespace flashsampling
