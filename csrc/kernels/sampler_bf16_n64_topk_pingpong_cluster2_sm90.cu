// Fused top-k pass (epilogue loop kTopCandidates), sm90a, bf16, CTA tile N = 64, pingpong
// schedule, clusters of two CTAs along the vocabulary (17 to 64 rows).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(cutlass::bfloat16_t, 64, true, SamplerLoop::kTopCandidates, 2)
}  // namespace flashsampling
