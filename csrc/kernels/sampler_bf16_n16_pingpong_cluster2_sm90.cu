// Fused sampler, sm90a, bf16, CTA tile N = 16, pingpong schedule, clusters of two CTAs along
// the vocabulary multicasting the hidden tile (A/B only: FLASHSAMPLING_PLAIN_CLUSTER_M=2).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(cutlass::bfloat16_t, 16, true, false, 2)
}  // namespace flashsampling
