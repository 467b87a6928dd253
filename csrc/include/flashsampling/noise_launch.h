// Torch-free launchers of the noise transforms of philox_gumbel.h on the GPU
// (csrc/kernels/noise_transforms.cu), behind the CUDA impls of flashsampling._logf,
// _gumbel_from_bits and _gumbel_upper_bound: tests compare them bit for bit with the CPU ops,
// over every input the noise can take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashsampling {

// out[i] = fs_logf(x[i]), four lanes per thread (fs_logf_lanes<4>, as the epilogue runs it).
cudaError_t launch_logf(float const* x, float* out, int64_t n, cudaStream_t stream);

// out[i] = fs_model_logit(x[i], scale, softcap, inv_softcap): the logits route's scale and
// soft-cap (flashsampling._model_logits), the bits the fused epilogue computes.
cudaError_t launch_model_logits(float const* x, float* out, int64_t n, float scale, float softcap, float inv_softcap,
                                cudaStream_t stream);

// out[i] = fs_gumbel_from_bits(uint32(bits[i])), four lanes per thread.
cudaError_t launch_gumbel_from_bits(int64_t const* bits, float* out, int64_t n, cudaStream_t stream);

// out[i] = fs_gumbel_upper_bound_from_bits(uint32(bits[i])), the bound the fused kernels skip
// the exact noise by (tests check it lies above fs_gumbel_from_bits on every input).
cudaError_t launch_gumbel_upper_bound(int64_t const* bits, float* out, int64_t n, cudaStream_t stream);

// out[i] = fs_uniform_noise(seed[i], offset[i], stream[i], sample[i], vocab_index[i]) (uint64
// seed and offset, the others' low 32 bits).
cudaError_t launch_uniform_noise(int64_t const* seed, int64_t const* offset, int64_t const* stream,
                                 int64_t const* sample, int64_t const* vocab_index, float* out, int64_t n,
                                 cudaStream_t stream_handle);

}  // namespace flashsampling
