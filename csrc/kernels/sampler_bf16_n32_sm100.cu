// Fused sampler, sm100a, bf16, CTA tile N = 32.
#include "sampler_gemm_sm100.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM100(cutlass::bfloat16_t, 32, SamplerLoop::kPlain)
}  // namespace flashsampling
