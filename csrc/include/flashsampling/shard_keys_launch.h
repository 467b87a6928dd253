// Torch-free launchers of the tensor-parallel exchange's key kernels (csrc/kernels/shard_keys.cu)
// behind the CUDA impls of flashsampling._shard_keys and _merge_shard_keys: one kernel each
// where the torch expression took about ten.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashsampling {

// keys[i] = fs_shard_key(tokens[i], scores[i]), i < n.
cudaError_t launch_shard_keys(int64_t const* tokens, float const* scores, int64_t* keys, int64_t n,
                              cudaStream_t stream);

// gathered: [world, rows, row_stride] int64 (each rank's keys in the first `samples` of a row);
// best, winner, tokens: [rows, samples], by fs_merge_shard_keys.
cudaError_t launch_merge_shard_keys(int64_t const* gathered, int64_t world, int64_t rows, int64_t row_stride,
                                    int64_t samples, int64_t mask_empty_token, int64_t* best, int64_t* winner,
                                    int64_t* tokens, cudaStream_t stream);

}  // namespace flashsampling
