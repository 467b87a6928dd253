// The tensor-parallel exchange's key encoding and merge (flashsampling/shard_keys.h) as one
// elementwise kernel each (flashsampling._shard_keys / _merge_shard_keys on CUDA tensors).
#include <cstdint>

#include "flashsampling/shard_keys.h"
#include "flashsampling/shard_keys_launch.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 256;

__global__ void shard_keys_kernel(int64_t const* __restrict__ tokens, float const* __restrict__ scores,
                                  int64_t* __restrict__ keys, int64_t n) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) keys[i] = fs_shard_key(tokens[i], scores[i]);
}

__global__ void merge_shard_keys_kernel(int64_t const* __restrict__ gathered, int64_t world, int64_t rows,
                                        int64_t row_stride, int64_t samples, int64_t mask_empty_token,
                                        int64_t* __restrict__ best, int64_t* __restrict__ winner,
                                        int64_t* __restrict__ tokens) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * samples) return;
  int64_t const row = i / samples, sample = i - row * samples;
  fs_merge_shard_keys(gathered + row * row_stride + sample, rows * row_stride, world, mask_empty_token, best[i],
                      winner[i], tokens[i]);
}

unsigned int num_blocks(int64_t n) { return static_cast<unsigned int>((n + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t launch_shard_keys(int64_t const* tokens, float const* scores, int64_t* keys, int64_t n,
                              cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  shard_keys_kernel<<<num_blocks(n), kThreads, 0, stream>>>(tokens, scores, keys, n);
  return cudaGetLastError();
}

cudaError_t launch_merge_shard_keys(int64_t const* gathered, int64_t world, int64_t rows, int64_t row_stride,
                                    int64_t samples, int64_t mask_empty_token, int64_t* best, int64_t* winner,
                                    int64_t* tokens, cudaStream_t stream) {
  if (rows * samples == 0) return cudaSuccess;
  merge_shard_keys_kernel<<<num_blocks(rows * samples), kThreads, 0, stream>>>(
      gathered, world, rows, row_stride, samples, mask_empty_token, best, winner, tokens);
  return cudaGetLastError();
}

}  // namespace flashsampling
