// Fused sampler with the common controls' epilogue loop, sm90a, bf16, CTA tile N = 32, pingpong
// schedule, clusters of two CTAs along the vocabulary (the plain loop's config for this bucket).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(cutlass::bfloat16_t, 32, true, SamplerLoop::kCommonControls, 2)
}  // namespace flashsampling
