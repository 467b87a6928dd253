// The noise transforms of philox_gumbel.h as elementwise GPU kernels (flashsampling._logf and
// _gumbel_from_bits on CUDA tensors), and its model-side transforms (_model_logits). The noise
// kernels run the four-lane forms the fused epilogue calls, so a bit-for-bit comparison with the
// CPU ops covers the device code of the noise (tests/test_noise_cuda.py).
#include <cstdint>

#include "flashsampling/noise_launch.h"
#include "flashsampling/philox_gumbel.h"

namespace flashsampling {
namespace {

constexpr int kLanes = 4;
constexpr int kThreads = 256;

__global__ void logf_kernel(float const* __restrict__ x, float* __restrict__ out, int64_t n) {
  int64_t const first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kLanes;
  float in[kLanes], result[kLanes];
#pragma unroll
  for (int j = 0; j < kLanes; ++j) in[j] = first + j < n ? x[first + j] : 1.0f;
  fs_logf_lanes<kLanes>(in, result);
#pragma unroll
  for (int j = 0; j < kLanes; ++j) {
    if (first + j < n) out[first + j] = result[j];
  }
}

__global__ void model_logits_kernel(float const* __restrict__ x, float* __restrict__ out, int64_t n, float scale,
                                    float softcap, float inv_softcap) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fs_model_logit(x[i], scale, softcap, inv_softcap);
}

__global__ void gumbel_from_bits_kernel(int64_t const* __restrict__ bits, float* __restrict__ out, int64_t n) {
  int64_t const first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kLanes;
  uint32_t in[kLanes];
  float result[kLanes];
#pragma unroll
  for (int j = 0; j < kLanes; ++j) in[j] = first + j < n ? static_cast<uint32_t>(bits[first + j]) : 0u;
  fs_gumbel_from_bits_lanes<kLanes>(in, result);
#pragma unroll
  for (int j = 0; j < kLanes; ++j) {
    if (first + j < n) out[first + j] = result[j];
  }
}

__global__ void gumbel_upper_bound_kernel(int64_t const* __restrict__ bits, float* __restrict__ out, int64_t n) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fs_gumbel_upper_bound_from_bits(static_cast<uint32_t>(bits[i]));
}

__global__ void uniform_noise_kernel(int64_t const* __restrict__ seed, int64_t const* __restrict__ offset,
                                     int64_t const* __restrict__ stream, int64_t const* __restrict__ sample,
                                     int64_t const* __restrict__ vocab_index, float* __restrict__ out, int64_t n) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = fs_uniform_noise(static_cast<uint64_t>(seed[i]), static_cast<uint64_t>(offset[i]),
                              static_cast<uint32_t>(stream[i]), static_cast<uint32_t>(sample[i]),
                              static_cast<uint32_t>(vocab_index[i]));
  }
}

unsigned int num_blocks(int64_t n) {
  return static_cast<unsigned int>((n + int64_t{kThreads} * kLanes - 1) / (int64_t{kThreads} * kLanes));
}

}  // namespace

cudaError_t launch_logf(float const* x, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  logf_kernel<<<num_blocks(n), kThreads, 0, stream>>>(x, out, n);
  return cudaGetLastError();
}

cudaError_t launch_model_logits(float const* x, float* out, int64_t n, float scale, float softcap, float inv_softcap,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  model_logits_kernel<<<static_cast<unsigned int>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      x, out, n, scale, softcap, inv_softcap);
  return cudaGetLastError();
}

cudaError_t launch_gumbel_from_bits(int64_t const* bits, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  gumbel_from_bits_kernel<<<num_blocks(n), kThreads, 0, stream>>>(bits, out, n);
  return cudaGetLastError();
}

cudaError_t launch_gumbel_upper_bound(int64_t const* bits, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  gumbel_upper_bound_kernel<<<static_cast<unsigned int>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      bits, out, n);
  return cudaGetLastError();
}

cudaError_t launch_uniform_noise(int64_t const* seed, int64_t const* offset, int64_t const* stream,
                                 int64_t const* sample, int64_t const* vocab_index, float* out, int64_t n,
                                 cudaStream_t stream_handle) {
  if (n == 0) return cudaSuccess;
  uniform_noise_kernel<<<static_cast<unsigned int>((n + kThreads - 1) / kThreads), kThreads, 0, stream_handle>>>(
      seed, offset, stream, sample, vocab_index, out, n);
  return cudaGetLastError();
}

}  // namespace flashsampling
