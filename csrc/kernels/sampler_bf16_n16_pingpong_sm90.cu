// Fused sampler, sm90a, bf16, CTA tile N = 16, pingpong schedule.
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::bfloat16_t, 16, true, SamplerLoop::kPlain)
}  // namespace flashsampling
