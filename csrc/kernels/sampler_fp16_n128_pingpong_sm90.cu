// Fused sampler, sm90a, fp16, CTA tile N = 128, pingpong schedule (A/B only:
// FLASHSAMPLING_PLAIN_SCHEDULE=pingpong; the shipped 128-wide tile is cooperative).
#include "sampler_gemm_sm90.cuh"

namespace flashsampling {
FLASHSAMPLING_INSTANTIATE_SM90(cutlass::half_t, 128, true, false)
}  // namespace flashsampling
