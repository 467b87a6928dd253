// An upper bound of the contract's Gumbel noise, for the exact skip of the epilogue-warpgroup
// loops (kernel/sm90_sampler_epilogue_warpgroups.hpp, benchmarks/NOTES.md v24).
//
// Once a column has a candidate of exact score s* (a score some element of that column really
// drew), an element whose score cannot reach s* cannot be the column's sample, so it needs no
// exact noise. With ub(bits) >= fs_gumbel_from_bits(bits) for every input and fma's rounding
// monotone in its addend, fma(x, 1/T, ub) < s* implies fma(x, 1/T, g) < s*: the skip never
// changes a token (a strict test, so ties still go to the exact path). ub costs two MUFU lg2
// and a few fmas; the exact noise two software logs with an IEEE division each.
#pragma once

#include <cstdint>

#include "flashsampling/philox_gumbel.h"

namespace flashsampling::epilogue {

__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ub(bits) >= fs_gumbel_from_bits(bits) for all 2^23 uniforms the contract draws (the bits'
// top 23), by about 1.2e-3 (tests/test_noise_cuda.py checks every one of them on the GPU).
// g = -ln(a), a = -ln(u): a is estimated to a relative error far below 2^-10 (for u >= 15/16
// by four terms of -ln(1 - t) = t + t^2/2 + ..., t = 1 - u exact, truncation < t^4/4 relative;
// below by lg2.approx, absolute error ~2^-22 on |lg2 u| >= 0.09), lowered by 2^-10 relative,
// and -ln of that, plus 2^-12, stays above g by more than lg2.approx's error and fs_logf's
// 2 ulp.
__device__ __forceinline__ float gumbel_upper_bound_from_bits(uint32_t bits) {
  constexpr float kLn2 = 0.6931471805599453f;
  float const u = fs_uniform_open01(bits);
  float const t = 1.0f - u;
  float const series = t * fmaf(t, fmaf(t, fmaf(t, 0.25f, 1.0f / 3.0f), 0.5f), 1.0f);
  float const minus_ln_u = u >= 0.9375f ? series : -kLn2 * lg2_approx(u);
  float const low = minus_ln_u * (1.0f - 1.0f / 1024.0f);
  return fmaf(-kLn2, lg2_approx(low), 1.0f / 4096.0f);
}

}  // namespace flashsampling::epilogue
