// fp32 logits on the CPU (logits_cpu.h): register-tiled dot products, one kernel per
// instruction set, and the op flashsampling::_logits that materialises them.
#include "logits_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "checks.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FS_LOGITS_X86 1
#endif

#if defined(__GNUC__)
#define FS_LOGITS_INLINE inline __attribute__((always_inline))
#define FS_LOGITS_UNROLL _Pragma("GCC unroll 8")
#else
#define FS_LOGITS_INLINE inline
#define FS_LOGITS_UNROLL
#endif

namespace flashsampling {
namespace {

// Hidden rows are zero-padded to a multiple of this (the widest step, 32 bf16).
constexpr int64_t kDimAlign = 32;

struct Bf16Bits {
  uint16_t bits;
};
struct Fp16Bits {
  uint16_t bits;
};

// One call: the logits of all B rows for n consecutive vocabulary rows.
struct KernelArgs {
  const void* hidden;  // [batch, ldh] prepared hidden, zero past dim
  int64_t ldh;
  int64_t batch;
  const void* weight;  // the first of the n vocabulary rows; rows ldw elements apart
  int64_t ldw;
  int64_t dim;
  int64_t n;
  float* out;  // out[b * ldo + j]
  int64_t ldo;
};
using KernelFn = void (*)(const KernelArgs&);

// Kernels for weight dtypes float, bf16, fp16 (nullptr: not this instruction set).
struct KernelSet {
  KernelFn f32, bf16, f16;
};

// ---------------------------------------------------------------- generic C++

namespace generic {
struct Lanes {
  float v[8];
};
struct Ops {
  using HScalar = float;
  using Acc = Lanes;
  static constexpr int kStep = 8, kRows = 2, kCols = 4;
  static Acc zero() { return Lanes{}; }
  static Lanes load_h(const float* p) {
    Lanes r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static Lanes load_w(const float* p) { return load_h(p); }
  static Lanes load_w(const Bf16Bits* p) {
    Lanes r;
    for (int i = 0; i < 8; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[i].bits) << 16;
      std::memcpy(&r.v[i], &bits, sizeof(float));
    }
    return r;
  }
  static Lanes load_w(const Fp16Bits* p) {
    Lanes r;
    for (int i = 0; i < 8; ++i) r.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[i].bits);
    return r;
  }
  static Acc madd(Acc acc, const Lanes& h, const Lanes& w) {
    for (int i = 0; i < 8; ++i) acc.v[i] = acc.v[i] + h.v[i] * w.v[i];  // two roundings (no contraction)
    return acc;
  }
  static float reduce(const Acc& a) {
    return ((a.v[0] + a.v[4]) + (a.v[2] + a.v[6])) + ((a.v[1] + a.v[5]) + (a.v[3] + a.v[7]));
  }
};
#include "logits_cpu_tile.inc"
}  // namespace generic

#ifdef FS_LOGITS_X86
// ---------------------------------------------------------------- AVX2 + FMA (+ F16C)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Ops {
  using HScalar = float;
  using Acc = __m256;
  static constexpr int kStep = 8, kRows = 2, kCols = 4;  // 8 accumulators of 16 registers
  static Acc zero() { return _mm256_setzero_ps(); }
  static __m256 load_h(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load_w(const Bf16Bits* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static __m256 load_w(const Fp16Bits* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Acc madd(Acc acc, __m256 h, __m256 w) { return _mm256_fmadd_ps(h, w, acc); }
  static float reduce(Acc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#include "logits_cpu_tile.inc"
}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX-512

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
namespace avx512 {
struct Ops {
  using HScalar = float;
  using Acc = __m512;
  static constexpr int kStep = 16, kRows = 4, kCols = 4;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512 load_h(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w(const Bf16Bits* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static __m512 load_w(const Fp16Bits* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Acc madd(Acc acc, __m512 h, __m512 w) { return _mm512_fmadd_ps(h, w, acc); }
  static float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
};
#include "logits_cpu_tile.inc"
}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX-512 BF16 (bf16 only)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma")
namespace avx512bf16 {
struct Ops {
  using HScalar = Bf16Bits;
  using Acc = __m512;
  static constexpr int kStep = 32, kRows = 4, kCols = 4;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512bh load_h(const Bf16Bits* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh load_w(const Bf16Bits* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Acc madd(Acc acc, __m512bh h, __m512bh w) { return _mm512_dpbf16_ps(acc, h, w); }
  static float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
};
#include "logits_cpu_tile.inc"
}  // namespace avx512bf16
#pragma GCC pop_options
#endif  // FS_LOGITS_X86

KernelSet kernels_for(LogitsIsa isa) {
  switch (isa) {
#ifdef FS_LOGITS_X86
    case LogitsIsa::kAvx512Bf16:
      return {avx512::logits_kernel<float>, avx512bf16::logits_kernel<Bf16Bits>, avx512::logits_kernel<Fp16Bits>};
    case LogitsIsa::kAvx512:
      return {avx512::logits_kernel<float>, avx512::logits_kernel<Bf16Bits>, avx512::logits_kernel<Fp16Bits>};
    case LogitsIsa::kAvx2:
      return {avx2::logits_kernel<float>, avx2::logits_kernel<Bf16Bits>, avx2::logits_kernel<Fp16Bits>};
#endif
    default:
      return {generic::logits_kernel<float>, generic::logits_kernel<Bf16Bits>, generic::logits_kernel<Fp16Bits>};
  }
}

// Vocabulary rows per parallel work item of _logits.
constexpr int64_t kLogitsBlock = 256;

at::Tensor logits_cpu(const at::Tensor& hidden, const at::Tensor& weight) {
  check_sample_args(hidden, weight, SampleArgs{});
  const int64_t batch = hidden.size(0), vocab = weight.size(0);
  at::Tensor out = at::empty({batch, vocab}, hidden.options().dtype(at::kFloat));
  if (batch == 0) return out;
  const CpuLogits logits(hidden, weight);
  float* data = out.mutable_data_ptr<float>();
  const int64_t blocks = (vocab + kLogitsBlock - 1) / kLogitsBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t begin = block * kLogitsBlock;
      logits.compute(begin, std::min(kLogitsBlock, vocab - begin), data + begin, vocab);
    }
  });
  return out;
}

}  // namespace

LogitsIsa select_logits_isa() {
  const char* env = std::getenv("FLASHSAMPLING_CPU_ISA");
  const std::string wanted = env != nullptr ? env : "";
  LogitsIsa widest = LogitsIsa::kGeneric;
#ifdef FS_LOGITS_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    widest = LogitsIsa::kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
      widest = LogitsIsa::kAvx512;
      if (__builtin_cpu_supports("avx512bf16")) widest = LogitsIsa::kAvx512Bf16;
    }
  }
#endif
  if (wanted.empty()) return widest;
  const struct {
    const char* name;
    LogitsIsa isa;
  } names[] = {{"default", LogitsIsa::kGeneric},
               {"avx2", LogitsIsa::kAvx2},
               {"avx512", LogitsIsa::kAvx512},
               {"avx512bf16", LogitsIsa::kAvx512Bf16}};
  for (const auto& n : names) {
    if (wanted == n.name && static_cast<int>(n.isa) <= static_cast<int>(widest)) return n.isa;
  }
  TORCH_CHECK(false, "flashsampling.sample: FLASHSAMPLING_CPU_ISA=", wanted,
              " is not default, avx2, avx512 or avx512bf16, or this CPU cannot run it");
}

CpuLogits::CpuLogits(const at::Tensor& hidden, const at::Tensor& weight)
    : isa_(select_logits_isa()), batch_(hidden.size(0)), dim_(hidden.size(1)) {
  padded_dim_ = std::max<int64_t>(kDimAlign, (dim_ + kDimAlign - 1) / kDimAlign * kDimAlign);
  const bool bf16_dot = isa_ == LogitsIsa::kAvx512Bf16 && hidden.scalar_type() == at::kBFloat16;
  hidden_ = at::zeros({batch_, padded_dim_}, hidden.options().dtype(bf16_dot ? at::kBFloat16 : at::kFloat));
  hidden_.narrow(1, 0, dim_).copy_(hidden);  // exact: every input dtype converts to fp32 exactly
  weight_ = weight.size(1) <= 1 || weight.stride(1) == 1 ? weight : weight.contiguous();
}

void CpuLogits::compute(int64_t begin, int64_t n, float* out, int64_t ld) const {
  if (n <= 0 || batch_ == 0) return;
  const KernelSet set = kernels_for(isa_);
  const auto dtype = weight_.scalar_type();
  const KernelFn fn = dtype == at::kFloat ? set.f32 : dtype == at::kBFloat16 ? set.bf16 : set.f16;
  const int64_t ldw = weight_.stride(0);
  const auto* row = static_cast<const char*>(weight_.const_data_ptr()) + begin * ldw * weight_.element_size();
  fn(KernelArgs{hidden_.const_data_ptr(), padded_dim_, batch_, row, ldw, dim_, n, out, ld});
}

TORCH_LIBRARY_IMPL(flashsampling, CPU, m) { m.impl("_logits", &logits_cpu); }

}  // namespace flashsampling
