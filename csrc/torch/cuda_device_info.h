// The CUDA bindings' (*_cuda.cpp) view of a device: its architecture and SM count, read once
// per device (the attributes cannot change while the process runs), so a call costs no driver
// query.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <mutex>

namespace flashsampling {

struct DeviceInfo {
  int arch = 0;  // major * 10 + minor
  int sm_count = 0;
};

inline DeviceInfo device_info(int device) {
  static std::array<DeviceInfo, 64> cache{};
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  DeviceInfo& info = cache.at(static_cast<size_t>(device));
  if (info.arch == 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
    info.arch = major * 10 + minor;
  }
  return info;
}

}  // namespace flashsampling
