// Device helpers shared by the epilogue node (stage 1) and the candidate reduction
// (stage 2): the packed candidate encoding and the online log-sum-exp merge. Both
// stages must agree bit for bit, so they live here once.
#pragma once

#include <cstdint>

#include "flashsampling/sampler_params.h"

namespace flashsampling {

// Packs a candidate so that unsigned max == "better" of philox_gumbel.h.
__device__ __forceinline__ PackedCandidate pack_candidate(float score, int32_t index) {
  // +0.0f folds -0 into +0: the two compare equal as floats, so must as keys.
  uint32_t bits = __float_as_uint(score + 0.0f);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  bits = (score != score) ? 0u : bits;  // NaN loses to everything, like fs_candidate_better
  return (static_cast<PackedCandidate>(bits) << 32) | static_cast<uint32_t>(~index);
}

// Inverse of pack_candidate's score bits (NaN for the "no candidate" key 0).
__device__ __forceinline__ float unpack_score(PackedCandidate c) {
  uint32_t const bits = static_cast<uint32_t>(c >> 32);
  if (bits == 0u) return __uint_as_float(0x7fc00000u);
  return __uint_as_float((bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits);
}

// Online log-sum-exp in log2 units: (max, sum of 2^(y2 - max)). -inf terms add
// nothing; a NaN term makes the sum NaN.
__device__ __forceinline__ void lse_add(float& max2, float& sum, float y2) {
  if (y2 > max2) {
    sum = sum * exp2f(max2 - y2) + 1.0f;
    max2 = y2;
  } else if (y2 > -INFINITY) {
    sum += exp2f(y2 - max2);
  } else if (y2 != y2) {
    sum = y2;
  }
}

__device__ __forceinline__ void lse_merge(float& max2, float& sum, float other_max2, float other_sum) {
  float const m = fmaxf(max2, other_max2);
  if (m == -INFINITY) {
    sum = sum + other_sum;  // both empty (0), or NaN
    return;
  }
  sum = sum * exp2f(max2 - m) + other_sum * exp2f(other_max2 - m);
  max2 = m;
}

}  // namespace flashsampling
