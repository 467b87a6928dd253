// Fused sampler with the common controls' epilogue loop, sm100a, fp16, CTA tile N = 32.
#include "sampler_gemm_sm100.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM100(cutlass::half_t, 32, SamplerLoop::kCommonControls)
}  // namespace flashsampling
