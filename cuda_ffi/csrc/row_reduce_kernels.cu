// The sum (or mean) of each row of a bf16, f16 or f32 matrix over its last
// dimension, in float32, divided once and rounded once to the input's dtype:
// an RMSNorm's x.pow(2).mean(-1), and the gradient of its per-row scale.
// The torch bridge runs it (rlk::det_row_mean, rlk::det_row_sum) from Python
// and from its C++ decoding route, so both give the same bits.
//
// Invariance: one block of kThreads threads per row. Thread t adds columns
// t, t + kThreads, ... in order into its own float32 sum; each warp merges
// its 32 sums by an xor butterfly (lane 0's result is read); thread 0 adds
// the warps' sums in warp order and divides with IEEE rounding (__fdiv_rn).
// Every step depends on the row's length and its own values only, never on
// the number of rows, so a row gives the same bits in any batch. There are
// only additions and one division: no contraction into FMAs can change a
// result.
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace rlk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

__device__ __forceinline__ void Store(float* out, float v) { *out = v; }
__device__ __forceinline__ void Store(__nv_bfloat16* out, float v) {
  *out = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void Store(__half* out, float v) {
  *out = __float2half_rn(v);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    RowReduceKernel(const T* __restrict__ x, T* __restrict__ out, int64_t k,
                    int64_t row_stride, float divisor) {
  const T* row = x + static_cast<int64_t>(blockIdx.x) * row_stride;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < k; c += kThreads) sum += ToFloat(row[c]);
  for (int offset = 16; offset > 0; offset >>= 1)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kWarps];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = warp_sums[0];
    for (int w = 1; w < kWarps; ++w) total += warp_sums[w];
    Store(out + blockIdx.x, __fdiv_rn(total, divisor));
  }
}

template <typename T>
cudaError_t Launch(cudaStream_t stream, const void* x, void* out, int64_t rows,
                   int64_t k, int64_t row_stride, float divisor) {
  RowReduceKernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<T*>(out), k, row_stride, divisor);
  return cudaGetLastError();
}

thread_local std::string row_reduce_error;

const char* Error(const std::string& message) {
  row_reduce_error = "rlk cuda_ffi row_reduce: " + message;
  return row_reduce_error.c_str();
}

}  // namespace
}  // namespace rlk

extern "C" {

// out[r] = (sum of x[r, 0:k]) / divisor for r < rows, launched on `stream`
// (torch's current stream). dtype: 0 float32, 1 bfloat16, 2 float16 (x and
// out alike). Returns NULL, or a message valid until the next call on this
// thread.
const char* rlk_row_reduce(void* stream, const void* x, void* out,
                           int64_t rows, int64_t k, int64_t row_stride,
                           float divisor, int dtype) {
  if (rows <= 0 || rows > 0x7fffffff || k <= 0)
    return rlk::Error("needs 0 < rows < 2**31 and k > 0, got rows " +
                      std::to_string(rows) + ", k " + std::to_string(k));
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t status;
  switch (dtype) {
    case 0:
      status = rlk::Launch<float>(s, x, out, rows, k, row_stride, divisor);
      break;
    case 1:
      status = rlk::Launch<__nv_bfloat16>(s, x, out, rows, k, row_stride,
                                          divisor);
      break;
    case 2:
      status = rlk::Launch<__half>(s, x, out, rows, k, row_stride, divisor);
      break;
    default:
      return rlk::Error("dtype code " + std::to_string(dtype) +
                        " is not 0 (f32), 1 (bf16) or 2 (f16)");
  }
  return status == cudaSuccess ? nullptr : rlk::Error(cudaGetErrorString(status));
}

}  // extern "C"
