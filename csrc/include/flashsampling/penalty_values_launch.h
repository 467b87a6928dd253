// Torch-free launcher of the kernel behind flashsampling._penalty_values (csrc/kernels/
// penalty_values.cu): what step 3 of the penalties adds to each seen token's logit, from a
// PenaltyState's ids and output counts, in one launch instead of a dozen elementwise torch ops
// (flashsampling_cuda/penalties.py, fused_penalty_args, has the same steps in torch ops: the CPU's,
// and the kernel's reference in the tests).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashsampling {

// out[b, k] = fl(-q + 0) with q = fl(fl(0 + fl(f_b * c)) + fl(p_b * (c > 0))), c = counts[b, k],
// where ids[b, k] >= 0 and c > 0 (a term only where its penalty is on); -0.0f elsewhere (leaves x
// as it is). f_b: frequencies[b] or the host frequency; p_b likewise.
struct PenaltyValuesParams {
  int64_t batch = 0, capacity = 0;
  const int64_t* ids = nullptr;        // [B, C]
  const int32_t* counts = nullptr;     // [B, C]
  bool frequency_on = false, presence_on = false;
  float frequency = 0.0f, presence = 0.0f;
  const float* frequencies = nullptr;  // [B]; wins over frequency
  const float* presences = nullptr;    // [B]; wins over presence
  float* out = nullptr;                // [B, C]
};
cudaError_t launch_penalty_values(PenaltyValuesParams const& p, cudaStream_t stream);

}  // namespace flashsampling
