// Fused sampler, sm90a, fp16, CTA tile N = 64, plain loop on epilogue warpgroups of its own
// (A/B knob FLASHSAMPLING_PLAIN_N64_SCHEDULE=epilogue_warpgroups; measured no better, v18).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS(cutlass::half_t, 64, SamplerLoop::kPlain)
}  // namespace flashsampling
