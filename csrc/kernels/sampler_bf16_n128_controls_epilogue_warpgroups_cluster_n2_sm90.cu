// Fused sampler, sm90a, bf16, CTA tile N = 128, common controls' loop on epilogue warpgroups of its own,
// clusters of two CTAs on neighbouring column tiles sharing each W tile by TMA multicast (the default
// for an even number of column tiles, v25).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS_CLUSTER(cutlass::bfloat16_t, 128, SamplerLoop::kCommonControls, 1, 2)
}  // namespace flashsampling
