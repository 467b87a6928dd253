// Stage 2 of the fused sampler: per (batch row, sample), the best packed candidate
// over all vocabulary tiles, decoded to a token id. Candidates are tiny
// ([samples][tiles][B] x 8 bytes, ~2.4 MB at B=256, V=152k) and still in L2.
#include <cstdint>

#include "flashsampling/philox_gumbel.h"
#include "sampler_config.h"

namespace flashsampling {
namespace {

constexpr int kReduceThreads = 128;

__global__ void __launch_bounds__(kReduceThreads)
reduce_candidates_kernel(PackedCandidate const* __restrict__ candidates, int64_t num_tiles, int64_t batch_size,
                         int num_samples, int64_t* __restrict__ tokens) {
  int64_t const row = blockIdx.x;
  int const sample = blockIdx.y;
  PackedCandidate const* column = candidates + static_cast<int64_t>(sample) * num_tiles * batch_size + row;

  PackedCandidate best = 0;
  for (int64_t tile = threadIdx.x; tile < num_tiles; tile += kReduceThreads) {
    PackedCandidate const c = column[tile * batch_size];
    best = c > best ? c : best;
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    PackedCandidate const other = __shfl_xor_sync(0xFFFFFFFF, best, delta);
    best = other > best ? other : best;
  }
  __shared__ PackedCandidate warp_best[kReduceThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_best[threadIdx.x / 32] = best;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kReduceThreads / 32; ++w) {
      best = warp_best[w] > best ? warp_best[w] : best;
    }
    // Low word holds ~index; "no candidate" (every score NaN) decodes to -1.
    int32_t const index = static_cast<int32_t>(~static_cast<uint32_t>(best));
    tokens[row * num_samples + sample] = (best == 0 || index == kNoCandidate) ? -1 : index;
  }
}

}  // namespace

cudaError_t launch_reduce_candidates(PackedCandidate const* candidates, int64_t num_tiles, int64_t batch_size,
                                     int num_samples, int64_t* tokens, cudaStream_t stream) {
  if (batch_size == 0) {
    return cudaSuccess;
  }
  dim3 const grid(static_cast<unsigned>(batch_size), static_cast<unsigned>(num_samples));
  reduce_candidates_kernel<<<grid, kReduceThreads, 0, stream>>>(candidates, num_tiles, batch_size, num_samples,
                                                                 tokens);
  return cudaGetLastError();
}

}  // namespace flashsampling
