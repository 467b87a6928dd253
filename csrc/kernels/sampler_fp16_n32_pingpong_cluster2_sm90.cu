// Fused sampler, sm90a, fp16, CTA tile N = 32, pingpong schedule, clusters of two CTAs along the
// vocabulary that receive each hidden tile by TMA multicast (4% faster at B = 32 on H200 than
// one CTA per cluster: benchmarks/NOTES.md, v9).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(cutlass::half_t, 32, true, SamplerLoop::kPlain, 2)
}  // namespace flashsampling
