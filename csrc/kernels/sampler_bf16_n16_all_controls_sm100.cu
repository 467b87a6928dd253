// Fused sampler with the epilogue loop for every control (sparse bias, per-row seeds, several
// samples per pass), sm100a, bf16, CTA tile N = 16.
#include "sampler_gemm_sm100.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM100(cutlass::bfloat16_t, 16, SamplerLoop::kAllControls)
}  // namespace flashsampling
