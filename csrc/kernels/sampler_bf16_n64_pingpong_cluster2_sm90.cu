// Fused sampler, sm90a, bf16, CTA tile N = 64, pingpong schedule, clusters of two CTAs along the
// vocabulary that receive each hidden tile by TMA multicast (3-5% faster at B = 64 on H200 than
// one CTA per cluster: benchmarks/NOTES.md, v9).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(cutlass::bfloat16_t, 64, true, SamplerLoop::kPlain, 2)
}  // namespace flashsampling
