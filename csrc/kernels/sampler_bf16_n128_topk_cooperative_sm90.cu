// Fused top-k pass (epilogue loop kTopCandidates), sm90a, bf16, CTA tile N = 128, cooperative
// schedule (more than 64 rows).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::bfloat16_t, 128, false, SamplerLoop::kTopCandidates)
}  // namespace flashsampling
