// The CUDA bindings' (*_cuda.cpp) check of a launcher's result: an error naming the op.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace flashsampling {

inline void check_cuda_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace flashsampling
