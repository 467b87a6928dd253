// Fused sampler, sm100a, bf16, CTA tile N = 256.
#include "sampler_gemm_sm100.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM100(cutlass::bfloat16_t, 256, false)
}  // namespace flashsampling
