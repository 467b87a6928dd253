// Fused sampler with the sampling controls' epilogue loop, sm90a, bf16, CTA tile N = 32, pingpong schedule.
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::bfloat16_t, 32, true, true)
}  // namespace flashsampling
