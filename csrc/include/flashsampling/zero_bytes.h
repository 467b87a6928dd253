// Zeroes a device buffer on a stream with a kernel. The samplers zero their small workspaces
// (counters, flags, row lists) this way rather than with cudaMemsetAsync: captured in a CUDA
// graph, a memset node hands over to the next kernel several times more slowly than a kernel does
// (benchmarks/probes/profile_truncation.py --timeline shows the gaps; CHANGELOG has the numbers).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashsampling {

cudaError_t launch_zero_bytes(void* bytes, size_t n, cudaStream_t stream);

}  // namespace flashsampling
