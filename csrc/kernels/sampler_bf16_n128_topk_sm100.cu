// Fused top-k pass (epilogue loop kTopCandidates), sm100a, bf16, CTA tile N = 128.
#include "sampler_gemm_sm100.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM100(cutlass::bfloat16_t, 128, SamplerLoop::kTopCandidates)
}  // namespace flashsampling
