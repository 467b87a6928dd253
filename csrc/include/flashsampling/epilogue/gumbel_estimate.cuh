// A cheap bracket around the exact Gumbel noise, so the epilogue can rule out
// elements that cannot win before paying for the exact noise.
//
// fs_gumbel_from_bits (philox_gumbel.h) is the noise contract: two correctly
// rounded software logs, bit-identical on host and device, ~100 instructions per
// element. gumbel_estimate() computes the same quantity from the same bits with two
// MUFU.LG2 (lg2.approx) and a short series near u = 1, ~15 instructions, and
//
//   |gumbel_estimate(bits) - fs_gumbel_from_bits(bits)| <= kGumbelEstimateError
//
// for every bits value. Error budget: lg2.approx has absolute error <= 2^-22 on
// [0.5, 2] and <= 2 ulp elsewhere (CUDA C++ Programming Guide, __log2f). For
// u < 15/16, t = -ln u >= 0.0645, so its relative error stays below 3e-6; for
// u >= 15/16 the series w + w^2/2 + ... + w^5/5 (w = 1 - u, exact on the noise grid)
// has relative truncation error below 2e-7. Then g = -ln t adds at most 2^-22 ln 2
// (t in [0.5, 2]) or 2 ulp of |log2 t| <= 24 elsewhere: |estimate - g| < 8e-6, and
// fs_gumbel_from_bits is within 2.2e-6 of g (two logs of < 2 ulp). The bound used is
// 1e-4, ten times that; tests/test_sample_cuda.py checks it on the GPU over all
// 2^23 values the uniform can take (gumbel_estimate_max_error below).
//
// Exactness argument (used by the epilogue): with score = fl(x * s + g) and
// estimate e = fl(x * s + g_est), |score - e| <= kGumbelEstimateError + 2^-23 (|score|
// + |e|) <= score_margin(e). If some element's exact score is >= lower(e_a) and
// another element has upper(e_b) < that, the second element is strictly worse than
// the first and can never be the argmax (nor tie with it): skipping its exact noise
// leaves the winner, its score and its index unchanged.
#pragma once

#include <cstdint>

#include "flashsampling/philox_gumbel.h"

namespace flashsampling {

constexpr float kGumbelEstimateError = 1e-4f;

__device__ __forceinline__ float gumbel_estimate(uint32_t bits) {
  constexpr float kLn2 = 0.693147180559945f;
  float const u = fs_uniform_open01(bits);
  float const w = 1.0f - u;  // exact: u = (k + 1/2) / 2^23 lies in [1/2, 1) here
  // -ln(1 - w) = w + w^2 (1/2 + w (1/3 + w (1/4 + w / 5))) for w < 1/16.
  float const series = fmaf(w * w, fmaf(w, fmaf(w, fmaf(w, 0.2f, 0.25f), 0.333333343f), 0.5f), w);
  float const t = w < 0.0625f ? series : -__log2f(u) * kLn2;
  return -__log2f(t) * kLn2;
}

// Half-width of the bracket [e - margin, e + margin] around an estimated score e.
__device__ __forceinline__ float score_margin(float estimate) {
  return fmaf(fabsf(estimate), 9.5367431640625e-07f /* 2^-20 */, kGumbelEstimateError);
}

}  // namespace flashsampling
