// Fused sampler, sm90a, bf16, CTA tile N = 32, the common controls' loop on epilogue
// warpgroups of its own (the default for common-controls passes of 17-32 columns, v35).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS(cutlass::bfloat16_t, 32, SamplerLoop::kCommonControls)
}  // namespace flashsampling
