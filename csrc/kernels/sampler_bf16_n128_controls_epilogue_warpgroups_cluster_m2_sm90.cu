// Fused sampler, sm90a, bf16, CTA tile N = 128, common controls' loop on epilogue warpgroups of its own,
// clusters of two along the vocabulary (hidden tile multicast).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS_CLUSTER(cutlass::bfloat16_t, 128, SamplerLoop::kCommonControls, 2, 1)
}  // namespace flashsampling
