// The fp32 logits hidden @ weight.T of the CPU ops (sample_cpu.cpp, and flashsampling::_logits,
// which truncation.py materialises them with).
//
// Every logit is one dot product accumulated in fp32 in a fixed order that depends only on D
// and the kernel (instruction set) chosen, never on the vocabulary block, the batch tile, the
// thread or the thread count: the fused op and the materialised logits get the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace flashsampling {

// How the logits are computed (select_logits_kernel):
//   kGeneric     portable C++, 8 lanes of fp32 partial sums (separate multiply and add);
//   kAvx2        AVX2 + FMA, 8 lanes, the weight converted to fp32 as it is loaded;
//   kAvx512      AVX-512, 16 lanes, likewise;
//   kAvx512Bf16  bfloat16 inputs only: AVX-512 BF16 dot products (vdpbf16ps: pairs of
//                bf16 products, exact in fp32, added to 16 lanes of fp32 sums; denormal
//                inputs and results are flushed to zero); other dtypes as kAvx512.
enum class LogitsIsa { kGeneric, kAvx2, kAvx512, kAvx512Bf16 };

// The widest kernel this CPU runs, or the one FLASHSAMPLING_CPU_ISA pins
// (default | avx2 | avx512 | avx512bf16); an error when the CPU cannot run the pinned one.
LogitsIsa select_logits_isa();

class CpuLogits {
 public:
  // hidden [B, D] and weight [V, D] of one dtype (bf16, fp16 or fp32) on the CPU, already
  // validated (check_sample_args). Prepares a zero-padded copy of hidden (fp32, or bf16 for
  // kAvx512Bf16); the weight is read in place when its rows are contiguous.
  CpuLogits(const at::Tensor& hidden, const at::Tensor& weight);

  // out[b * ld + j] = logit of batch row b and vocabulary row begin + j, for b < B, j < n.
  // Thread-safe; call it on disjoint outputs from several threads.
  void compute(int64_t begin, int64_t n, float* out, int64_t ld) const;

  LogitsIsa isa() const { return isa_; }

 private:
  at::Tensor hidden_;  // [B, padded_dim], zero past D
  at::Tensor weight_;  // [V, D], unit stride along D
  LogitsIsa isa_;
  int64_t batch_, dim_, padded_dim_;
};

}  // namespace flashsampling
