// flashsampling/zero_bytes.h: 16-byte stores over the aligned middle of the buffer, bytes at its
// ends, a grid-stride loop.
#include <cstdint>

#include "flashsampling/zero_bytes.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 256;

__global__ void zero_bytes_kernel(uint8_t* bytes, size_t head, size_t words, size_t n) {
  size_t const stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t const first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint4* middle = reinterpret_cast<uint4*>(bytes + head);
  for (size_t i = first; i < words; i += stride) middle[i] = make_uint4(0u, 0u, 0u, 0u);
  size_t const tail = head + words * sizeof(uint4);
  for (size_t i = first; i < head + (n - tail); i += stride) bytes[i < head ? i : tail + (i - head)] = 0;
}

}  // namespace

cudaError_t launch_zero_bytes(void* bytes, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  auto* const b = static_cast<uint8_t*>(bytes);
  size_t const misalignment = reinterpret_cast<uintptr_t>(b) % sizeof(uint4);
  size_t head = misalignment == 0 ? 0 : sizeof(uint4) - misalignment;
  if (head > n) head = n;
  size_t const words = (n - head) / sizeof(uint4);
  size_t const end_bytes = n - words * sizeof(uint4);  // before and after the words
  size_t const items = words > end_bytes ? words : end_bytes;
  size_t blocks = (items + kThreads - 1) / kThreads;
  if (blocks > 1024) blocks = 1024;
  zero_bytes_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(b, head, words, n);
  return cudaGetLastError();
}

}  // namespace flashsampling
