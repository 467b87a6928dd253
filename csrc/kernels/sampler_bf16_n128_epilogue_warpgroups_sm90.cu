// Fused sampler, sm90a, bf16, CTA tile N = 128, plain loop on epilogue warpgroups of its own.
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS(cutlass::bfloat16_t, 128, SamplerLoop::kPlain)
}  // namespace flashsampling
