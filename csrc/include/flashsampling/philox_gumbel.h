// Philox4x32-10 counter-based RNG and the Gumbel noise of FlashSampling.
//
// One header for host and device: the CPU path and every GPU kernel call the
// same functions, so they draw bit-identical noise. Every floating-point step is
// written with explicit fma / round-to-nearest operations so that neither nvcc's
// default contraction nor a host compiler can change a single bit.
//
// Noise contract (documented in docs/noise.md):
//
//   key     = (lo32(seed), hi32(seed))
//   counter = (vocab_index, stream >> 2, lo32(offset + sample), hi32(offset + sample))
//   bits    = Philox4x32_10(key, counter)[stream & 3]
//   u       = (floor(bits / 2^9) + 1/2) / 2^23          -- strictly inside (0, 1)
//   g       = -log(-log(u))                               -- fp32, fs_logf below
//
// `stream` is the batch row for a batch-wide seed and 0 for a per-row seed, so a
// request with its own seed draws noise that does not depend on its row.
// Four consecutive batch rows share one Philox call (the kernels keep a batch
// column pair / quad per thread), which amortises the 10 rounds.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FS_HOST_DEVICE inline
#endif

#if defined(__CUDA_ARCH__)
#define FS_PRAGMA_UNROLL _Pragma("unroll")
#else
#define FS_PRAGMA_UNROLL
#endif

namespace flashsampling {

struct Philox4 {
  uint32_t x, y, z, w;
};

FS_HOST_DEVICE uint32_t fs_float_as_uint(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FS_HOST_DEVICE float fs_uint_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Correctly rounded single operations, never contracted into an fma.
FS_HOST_DEVICE float fs_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host TUs build with -ffp-contract=off (setup.py, CMakeLists.txt)
#endif
}

FS_HOST_DEVICE float fs_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FS_HOST_DEVICE float fs_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

FS_HOST_DEVICE float fs_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FS_HOST_DEVICE void fs_mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  lo = static_cast<uint32_t>(p);
  hi = static_cast<uint32_t>(p >> 32);
#endif
}

// Philox4x32 with 10 rounds (Salmon et al., SC'11), the generator of curand and
// torch's CUDA RNG; known-answer tests in tests/test_noise.py.
FS_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    fs_mulhilo32(kMul0, ctr.x, hi0, lo0);
    fs_mulhilo32(kMul1, ctr.z, hi1, lo1);
    ctr = Philox4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// 23 random bits onto the grid (k + 1/2) / 2^23, k in [0, 2^23): every value is
// exact in fp32 and lies in [2^-24, 1 - 2^-24], so the noise is always finite.
FS_HOST_DEVICE float fs_uniform_open01(uint32_t bits) {
  return fs_mul(fs_add(static_cast<float>(bits >> 9), 0.5f), 1.1920928955078125e-07f);
}

// Natural log for positive normal floats, |error| < 2 ulp (tests/test_noise.py checks
// it against float64 over the whole range the noise uses). Range reduction to
// m in [sqrt(1/2), sqrt(2)), then log(1+f) = 2 atanh(s), s = f / (2 + f), with a
// degree-8 odd polynomial (the fdlibm/musl logf scheme).
//
// Written over N independent lanes, one step at a time across the lanes: each lane runs
// exactly the operations of the one-lane form, so every N gives the same bits, and the
// compiler sees N independent dependency chains side by side. The fused epilogue needs
// that: its noise is latency-bound (Nsight Compute: docs/kernel.md).
template <int N>
FS_HOST_DEVICE void fs_logf_lanes(float const (&x)[N], float (&result)[N]) {
  constexpr float kLg1 = 0.66666662693f, kLg2 = 0.40000972152f;
  constexpr float kLg3 = 0.28498786688f, kLg4 = 0.24279078841f;
  constexpr float kLn2Hi = 6.9313812256e-01f, kLn2Lo = 9.0580006145e-06f;
  float f[N], s[N], dk[N];
  FS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) {
    uint32_t ix = fs_float_as_uint(x[j]);
    ix += 0x3f800000u - 0x3f3504f3u;
    dk[j] = static_cast<float>(static_cast<int>(ix >> 23) - 0x7f);
    ix = (ix & 0x007fffffu) + 0x3f3504f3u;
    f[j] = fs_add(fs_uint_as_float(ix), -1.0f);  // exact (Sterbenz)
  }
  FS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) {
    s[j] = fs_div(f[j], fs_add(2.0f, f[j]));
  }
  FS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) {
    const float z = fs_mul(s[j], s[j]);
    const float w = fs_mul(z, z);
    const float t1 = fs_mul(w, fs_fma(w, kLg4, kLg2));
    const float t2 = fs_mul(z, fs_fma(w, kLg3, kLg1));
    const float r = fs_add(t2, t1);
    const float hfsq = fs_mul(fs_mul(0.5f, f[j]), f[j]);
    float acc = fs_fma(s[j], fs_add(hfsq, r), fs_mul(dk[j], kLn2Lo));
    acc = fs_add(acc, -hfsq);
    acc = fs_add(acc, f[j]);
    result[j] = fs_fma(dk[j], kLn2Hi, acc);
  }
}

FS_HOST_DEVICE float fs_logf(float x) {
  const float in[1] = {x};
  float out[1];
  fs_logf_lanes<1>(in, out);
  return out[0];
}

// tanh for every float, |error| < 2.5 ulp: measured against float64 on every float of (0, 11]
// (2.42 ulp at worst, near x = 0.0078; ~11% of the floats of [2^-30, 11] above 1 ulp), not
// proved; tests/test_noise.py checks a sample of them and the special values. The soft-cap of
// the fused epilogue and of the logits route both call it, so the CPU and GPU transform logits
// to the same bits; a library tanh differs between the two.
//
// tanh |x| = E / (E + 2) with E = expm1(2 |x|): exp's reduction 2 |x| = k ln 2 + r, |r| <= ln 2 / 2
// (Cody-Waite, the rounding to k by the 1.5 * 2^23 trick: no float-to-int conversion, so NaN is
// no undefined behaviour on the host), expm1(r) by its Taylor series to r^7 (the rest < 2^-26
// relative on that interval), E = 2^k expm1(r) + (2^k - 1) in one fma, which keeps small |x|
// (k = 0: E = expm1(r)) free of cancellation. |x| > 9.5 is taken as 9.5, where tanh rounds to 1
// already; NaN stays NaN (the clamp's compare is false for it), +-inf gives +-1, the sign of x
// (-0 included) is copied back. Branch-free; one division.
FS_HOST_DEVICE float fs_tanhf(float x) {
  constexpr float kClamp = 9.5f;
  constexpr float kLog2e = 1.44269502162933349609375f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
  constexpr float kC2 = 0.5f, kC3 = 1.66666671633720397949e-01f, kC4 = 4.16666679084300994873e-02f;
  constexpr float kC5 = 8.33333376795053482056e-03f, kC6 = 1.38888892251998186111e-03f;
  constexpr float kC7 = 1.98412701138295233250e-04f;
  const uint32_t sign = fs_float_as_uint(x) & 0x80000000u;
  float ax = fs_uint_as_float(fs_float_as_uint(x) & 0x7fffffffu);
  ax = ax > kClamp ? kClamp : ax;
  const float y = fs_add(ax, ax);                                   // exact
  const float shifted = fs_fma(y, kLog2e, kRound);                  // kRound + round(y / ln 2)
  const float k = fs_add(shifted, -kRound);                         // exact
  const uint32_t k_bits = fs_float_as_uint(shifted) - 0x4B400000u;  // k in [0, 28]
  float r = fs_fma(k, -kLn2Hi, y);                                  // exact
  r = fs_fma(k, -kLn2Lo, r);
  float q = fs_fma(kC7, r, kC6);
  q = fs_fma(q, r, kC5);
  q = fs_fma(q, r, kC4);
  q = fs_fma(q, r, kC3);
  q = fs_fma(q, r, kC2);
  const float expm1_r = fs_fma(fs_mul(r, r), q, r);
  const float two_k = fs_uint_as_float((k_bits + 127u) << 23);
  const float e = fs_fma(two_k, expm1_r, fs_add(two_k, -1.0f));    // expm1(y)
  const float t = fs_div(e, fs_add(e, 2.0f));
  return fs_uint_as_float(fs_float_as_uint(t) | sign);
}

// The model-side transforms of a raw logit l (docs/penalties.md, step 1): l = fl(l * scale), then
// the soft-cap l = fl(cap * fs_tanhf(fl(l * fl(1 / cap)))), inv_softcap = fs_div(1, cap); a
// softcap of 0 is off, and so is a scale of 1 (no multiply: x * 1 keeps x's bits but a NaN's
// payload). A product with the reciprocal, not a division: the epilogue runs it per element,
// and the reciprocal's rounding moves tanh's argument by at most an ulp, below fs_tanhf's own
// error. The fused op (CPU and GPU) and the logits route's _model_logits call this.
FS_HOST_DEVICE float fs_model_logit(float logit, float scale, float softcap, float inv_softcap) {
  if (scale != 1.0f) logit = fs_mul(logit, scale);
  if (softcap != 0.0f) logit = fs_mul(softcap, fs_tanhf(fs_mul(logit, inv_softcap)));
  return logit;
}

// An upper bound of fs_model_logit's soft-cap of `logit` (already scaled), without its tanh, for
// the exact skip of the noise (the plain epilogue-warpgroup kernel): cap * tanh(l / cap) <= l and
// <= cap for l > 0, <= 0 for l <= 0 (fs_tanhf keeps the sign). The margins, 2^-16 relative and
// cap * 2^-60 absolute, cover the roundings of l * (1 / cap) and of the product and fs_tanhf's
// error (a few ulp; where l / cap is subnormal, an absolute error far below cap * 2^-60). NaN
// stays NaN (a NaN bound counts as reaching).
FS_HOST_DEVICE float fs_softcap_upper_bound(float logit, float softcap) {
  if (!(logit > 0.0f)) return logit != logit ? logit : 0.0f;
  return fs_fma(logit < softcap ? logit : softcap, 1.0f + 0x1p-16f, fs_mul(softcap, 0x1p-60f));
}

// The penalties of a token the row has seen (docs/penalties.md step 3, vLLM's order): the
// repetition penalty r (x / r where x > 0, x * r elsewhere; r = 1 leaves x as it is), then
// x + add (add = -0.0f leaves x as it is, signed zeros and NaN included). A division, not a
// product with 1 / r: the logits route divides (torch's `x / r`), and both routes must give the
// same bits. The fused op (CPU transform pass, CUDA epilogue) calls this.
FS_HOST_DEVICE float fs_penalized_logit(float x, float r, float add) {
  x = x > 0.0f ? fs_div(x, r) : fs_mul(x, r);
  return fs_add(x, add);
}

// Standard Gumbel noise from 32 random bits: g = -log(-log(u)), over N lanes as above.
template <int N>
FS_HOST_DEVICE void fs_gumbel_from_bits_lanes(const uint32_t (&bits)[N], float (&gumbel)[N]) {
  float u[N], log_u[N], minus_log_u[N];
  FS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) u[j] = fs_uniform_open01(bits[j]);
  fs_logf_lanes<N>(u, log_u);
  FS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) minus_log_u[j] = -log_u[j];
  fs_logf_lanes<N>(minus_log_u, gumbel);
  FS_PRAGMA_UNROLL
  for (int j = 0; j < N; ++j) gumbel[j] = -gumbel[j];
}

FS_HOST_DEVICE float fs_gumbel_from_bits(uint32_t bits) {
  const uint32_t in[1] = {bits};
  float out[1];
  fs_gumbel_from_bits_lanes<1>(in, out);
  return out[0];
}

FS_HOST_DEVICE uint32_t fs_count_leading_zeros(uint32_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  uint32_t n;  // one FLO.SH (__clz is FLO and a subtraction)
  asm("bfind.shiftamt.u32 %0, %1;" : "=r"(n) : "r"(x));
  return n;
#else
  return static_cast<uint32_t>(__builtin_clz(x));
#endif
}

// An upper bound of fs_gumbel_from_bits(bits), for the exact skip of the epilogue-warpgroup
// kernels (kernel/sm90_sampler_epilogue_warpgroups.hpp, docs/noise.md): an element
// whose score with this bound in place of g stays below a score its column has already drawn
// cannot be the column's sample, so it needs no logs.
//
// g = -ln(-ln u) < -ln(1 - u), since -ln u > 1 - u on (0, 1). The top 23 bits of ~bits are
// c = 2^23 - 1 - floor(bits / 2^9), and 1 - u = (c + 1/2) / 2^23, so -ln(1 - u) < (23 -
// floor(log2 c)) ln 2 for c >= 1 and = 24 ln 2 for c = 0: both (n + 1) ln 2 with n =
// clz(~bits | 0x1FF) in [0, 23], the leading one bits of the uniform. ln 2 is rounded up, and
// 2^-10 covers the fma's rounding and fs_logf's (a few 1e-6). Integer work and two float ops (a
// tighter bound costs two lg2.approx and a series); at most ln 2 looser than g where the skip matters
// (u near 1), so a column has up to twice as many elements within reach of its floor.
// Host and device give the same bits; tests check it against every one of the 2^23 uniforms.
FS_HOST_DEVICE float fs_gumbel_upper_bound_from_bits(uint32_t bits) {
  constexpr float kLn2Up = 0.693147182464599609375f;  // fl(ln 2) > ln 2
  constexpr float kMargin = 1.0f / 1024.0f;
  const uint32_t leading_ones = fs_count_leading_zeros(~bits | 0x1FFu);
  const float n = fs_add(fs_uint_as_float(0x4B000000u | leading_ones), -8388608.0f);  // exact
  return fs_fma(n, kLn2Up, kLn2Up + kMargin);
}

FS_HOST_DEVICE uint32_t fs_philox_lane(const Philox4& r, uint32_t lane) {
  return lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
}

// The Philox block holding the noise of streams 4q .. 4q+3 at one vocab index.
FS_HOST_DEVICE Philox4 fs_noise_block(uint64_t seed, uint64_t offset_plus_sample,
                                      uint32_t vocab_index, uint32_t stream_quad) {
  return philox4x32_10(
      Philox4{vocab_index, stream_quad, static_cast<uint32_t>(offset_plus_sample),
              static_cast<uint32_t>(offset_plus_sample >> 32)},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The Gumbel noise of one element: a pure function of its coordinates.
FS_HOST_DEVICE float fs_gumbel_noise(uint64_t seed, uint64_t offset, uint32_t stream,
                                     uint32_t sample, uint32_t vocab_index) {
  const Philox4 r = fs_noise_block(seed, offset + sample, vocab_index, stream >> 2);
  return fs_gumbel_from_bits(fs_philox_lane(r, stream & 3u));
}

// The uniform in (0, 1) under fs_gumbel_noise at the same coordinates (speculative
// verification's acceptance draws, at a vocab_index no token has).
FS_HOST_DEVICE float fs_uniform_noise(uint64_t seed, uint64_t offset, uint32_t stream,
                                      uint32_t sample, uint32_t vocab_index) {
  const Philox4 r = fs_noise_block(seed, offset + sample, vocab_index, stream >> 2);
  return fs_uniform_open01(fs_philox_lane(r, stream & 3u));
}

// The perturbed score Gumbel-Max takes the argmax of: logit / T + g, computed as
// one fma with inv_temperature = 1 / T rounded to fp32 (fs_div). T = 0 (greedy)
// is expressed by the caller as "no noise": score = logit.
FS_HOST_DEVICE float fs_perturbed_score(float logit, float inv_temperature, float gumbel) {
  return fs_fma(logit, inv_temperature, gumbel);
}

// The scale of a row's logits, fl32(1 / T): 0 marks greedy (T == 0, no noise) and NaN an
// invalid temperature (negative, NaN, infinite, or subnormal: 1 / T may overflow, and x / T
// would not be monotone in x), which gives the row no candidate.
FS_HOST_DEVICE float fs_inv_temperature(float temperature) {
  if (temperature == 0.0f) return 0.0f;
  const bool finite_positive = temperature >= 1.17549435e-38f && temperature <= 3.40282347e+38f;
  if (!finite_positive) return fs_uint_as_float(0x7fc00000u);
  return fs_div(1.0f, temperature);
}

// Total order of candidates: larger score first, exact ties to the smaller index.
// NaN scores never win. With this order every partition of the vocabulary
// (tiles, CTAs, shards) yields the same winner.
FS_HOST_DEVICE bool fs_candidate_better(float score_a, int32_t index_a, float score_b,
                                        int32_t index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

// Index that marks "no candidate yet"; loses every tie. A row whose scores are all
// NaN ends with it and is reported as token -1.
constexpr int32_t kNoCandidate = 0x7fffffff;

}  // namespace flashsampling
