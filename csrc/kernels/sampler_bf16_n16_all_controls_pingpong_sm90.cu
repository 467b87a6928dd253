// Fused sampler with the epilogue loop for every control (sparse bias, per-row seeds, several
// samples per pass), sm90a, bf16, CTA tile N = 16, pingpong schedule.
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::bfloat16_t, 16, true, SamplerLoop::kAllControls)
}  // namespace flashsampling
