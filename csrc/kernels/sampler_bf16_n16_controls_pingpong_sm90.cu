// Fused sampler with the common controls' epilogue loop, sm90a, bf16, CTA tile N = 16, pingpong
// schedule (the plain loop's config for this bucket).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::bfloat16_t, 16, true, SamplerLoop::kCommonControls)
}  // namespace flashsampling
