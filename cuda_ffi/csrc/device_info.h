// Per-device properties the launch paths need, queried once per device (so
// no launch makes a driver query), shared by the det_gemm and pack entries.
#pragma once

#include <deque>
#include <mutex>

#include <cuda_runtime.h>

namespace rlk {

struct DeviceInfo {
  int major = 0, minor = 0, sm_count = 0;
};

// A deque: growing it for a new device keeps the references already handed
// out valid.
inline const DeviceInfo& InfoOf(int device) {
  static std::mutex mu;
  static std::deque<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1);
  DeviceInfo& info = cache[device];
  if (info.sm_count == 0) {
    cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor,
                           device);
    cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor,
                           device);
    cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount,
                           device);
  }
  return info;
}

inline const DeviceInfo& CurrentDeviceInfo() {
  int device = 0;
  cudaGetDevice(&device);
  return InfoOf(device);
}

}  // namespace rlk
