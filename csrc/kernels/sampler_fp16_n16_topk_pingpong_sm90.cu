// Fused top-k pass (epilogue loop kTopCandidates), sm90a, fp16, CTA tile N = 16, pingpong
// schedule (up to 32 rows: two N tiles beyond 16).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::half_t, 16, true, SamplerLoop::kTopCandidates)
}  // namespace flashsampling
