// Zeroes a device buffer on a stream with a kernel. The samplers zero their small workspaces
// (counters, flags, row lists) this way rather than with cudaMemsetAsync: captured in a CUDA
// graph, a memset node's hand-over to the next kernel took 3-5 µs on an H200 where a kernel's took
// under 1 (benchmarks/probes/profile_truncation.py --timeline).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashsampling {

cudaError_t launch_zero_bytes(void* bytes, size_t n, cudaStream_t stream);

}  // namespace flashsampling
