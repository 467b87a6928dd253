// Fused top-k pass (epilogue loop kTopCandidates), sm100a, fp16, CTA tile N = 16.
#include "sampler_gemm_sm100.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM100(cutlass::half_t, 16, SamplerLoop::kTopCandidates)
}  // namespace flashsampling
