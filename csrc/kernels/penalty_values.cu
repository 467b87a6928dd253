// flashsampling/penalty_values_launch.h: step 3's added value per seen token, elementwise.
#include <cstdint>

#include "flashsampling/penalty_values_launch.h"
#include "flashsampling/philox_gumbel.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 256;

__global__ void penalty_values_kernel(PenaltyValuesParams p) {
  int64_t const total = p.batch * p.capacity;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t const b = i / p.capacity;
    int32_t const c = p.counts[i];
    float q = 0.0f;
    if (p.frequency_on) q = fs_add(q, fs_mul(p.frequencies ? p.frequencies[b] : p.frequency, static_cast<float>(c)));
    if (p.presence_on) q = fs_add(q, fs_mul(p.presences ? p.presences[b] : p.presence, c > 0 ? 1.0f : 0.0f));
    p.out[i] = p.ids[i] >= 0 && c > 0 ? fs_add(-q, 0.0f) : -0.0f;
  }
}

}  // namespace

cudaError_t launch_penalty_values(PenaltyValuesParams const& p, cudaStream_t stream) {
  int64_t const total = p.batch * p.capacity;
  if (total == 0) return cudaSuccess;
  int64_t const blocks = (total + kThreads - 1) / kThreads;
  penalty_values_kernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashsampling
