// An XLA FFI handler that launches one Triton-compiled kernel (its cubin,
// compiled in Python by Triton's own compiler) on XLA's stream.
//
// Why not jax-triton's custom call: it is a legacy (API version 2) custom
// call, which XLA cannot capture into a command buffer. A decode step with
// one per layer was cut into a CUDA graph per layer, each launched from the
// host (9 graphs a step where plain XLA had 1; the step is host-bound).
// This handler only launches on the stream it is given and touches only
// the buffers XLA passes, so it declares itself command-buffer compatible.
//
// The kernel's parameters are Triton's launch convention for a kernel whose
// every non-pointer argument is a compile-time constant (as jax-triton
// compiles them): one pointer per operand, then per result, then the
// `trailing_pointers` scratch pointers Triton 3.x appends (global and
// profile scratch; null, as the Python side only sends kernels that use
// neither).

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ffi_traits.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace rlk {
namespace {

// Loaded kernels by (the cubin's content id, device): the id is a digest
// the Python side computes once, so no call hashes the cubin, and an id
// names one content whatever executable carries it.
std::mutex table_mutex;
std::map<std::pair<int64_t, int>, cudaKernel_t>& KernelTable() {
  static auto* table = new std::map<std::pair<int64_t, int>, cudaKernel_t>();
  return *table;
}

ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("rlk Triton launch: ") + what +
                              ": " + cudaGetErrorString(err));
}

ffi::ErrorOr<cudaKernel_t> KernelFor(int64_t id, ffi::Span<const uint8_t> cubin,
                                     std::string_view name,
                                     int64_t shared_bytes, int64_t threads) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return ffi::Unexpected(CudaError(err, "device"));
  std::lock_guard<std::mutex> lock(table_mutex);
  auto key = std::make_pair(id, device);
  auto found = KernelTable().find(key);
  if (found != KernelTable().end()) return found->second;
  // The first call of a kernel may run while XLA records a command buffer
  // (stream capture): loading a module is not a stream operation, so this
  // thread's capture mode is relaxed around it, then restored.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernel = nullptr;
  err = cudaLibraryLoadData(&library, cubin.begin(), nullptr, nullptr, 0,
                            nullptr, nullptr, 0);
  if (err == cudaSuccess)
    err = cudaLibraryGetKernel(&kernel, library, std::string(name).c_str());
  // Past 48 KB of shared memory, as Triton's own loader does: the opt-in
  // size, and the carveout that prefers shared memory to L1.
  if (err == cudaSuccess && shared_bytes > 48 * 1024)
    err = cudaKernelSetAttributeForDevice(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(shared_bytes), device);
  if (err == cudaSuccess && shared_bytes > 48 * 1024)
    err = cudaKernelSetAttributeForDevice(
        kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
        cudaSharedmemCarveoutMaxShared, device);
  // Loads the module into this device's context here, inside the relaxed
  // window (lazy loading would do it at the first launch, maybe under
  // capture), and says whether the block fits the compiled kernel.
  cudaFuncAttributes attributes{};
  if (err == cudaSuccess)
    err = cudaFuncGetAttributes(&attributes,
                                reinterpret_cast<const void*>(kernel));
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess)
    return ffi::Unexpected(CudaError(err, "loading the kernel"));
  if (attributes.maxThreadsPerBlock < threads)
    return ffi::Unexpected(ffi::Error::Internal(
        "rlk Triton launch: " + std::string(name) + " takes at most " +
        std::to_string(attributes.maxThreadsPerBlock) + " threads a block, "
        "launched with " + std::to_string(threads)));
  KernelTable().emplace(key, kernel);
  return kernel;
}

ffi::Error TritonLaunchFfi(cudaStream_t stream, ffi::RemainingArgs args,
                           ffi::RemainingRets rets,
                           ffi::Span<const uint8_t> cubin,
                           std::string_view name, int64_t kernel_id,
                           ffi::Span<const int64_t> grid, int64_t num_warps,
                           int64_t shared_bytes, int64_t trailing_pointers) {
  if (grid.size() != 3)
    return ffi::Error::InvalidArgument("rlk Triton launch: grid needs 3 dims");
  if (grid[0] * grid[1] * grid[2] == 0) return ffi::Error::Success();
  auto kernel = KernelFor(kernel_id, cubin, name, shared_bytes,
                          32 * num_warps);
  if (kernel.has_error()) return kernel.error();
  std::vector<void*> pointers;
  pointers.reserve(args.size() + rets.size() + trailing_pointers);
  for (size_t i = 0; i < args.size(); ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) return arg.error();
    pointers.push_back(arg->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return ret.error();
    pointers.push_back((*ret)->untyped_data());
  }
  for (int64_t i = 0; i < trailing_pointers; ++i) pointers.push_back(nullptr);
  std::vector<void*> params(pointers.size());
  for (size_t i = 0; i < pointers.size(); ++i) params[i] = &pointers[i];
  cudaError_t err = cudaLaunchKernel(
      reinterpret_cast<const void*>(*kernel),
      dim3(static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
           static_cast<unsigned>(grid[2])),
      dim3(static_cast<unsigned>(32 * num_warps)), params.data(),
      static_cast<size_t>(shared_bytes), stream);
  if (err != cudaSuccess) return CudaError(err, std::string(name).c_str());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rlk

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkTritonLaunch, rlk::TritonLaunchFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const uint8_t>>("cubin")
                                  .Attr<std::string_view>("name")
                                  .Attr<int64_t>("kernel_id")
                                  .Attr<ffi::Span<const int64_t>>("grid")
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("shared_bytes")
                                  .Attr<int64_t>("trailing_pointers"),
                              RLK_FFI_TRAITS);
