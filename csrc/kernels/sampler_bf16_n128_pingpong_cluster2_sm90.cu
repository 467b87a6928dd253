// Fused sampler, sm90a, bf16, CTA tile N = 128 for 65-128 GEMM columns (one N tile): pingpong
// schedule, clusters of two CTAs multicasting the hidden tile (7-11% faster at B = 128 on H200
// than the cooperative tile; slower with two N tiles: benchmarks/NOTES.md, v9).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(cutlass::bfloat16_t, 128, true, SamplerLoop::kPlain, 2)
}  // namespace flashsampling
