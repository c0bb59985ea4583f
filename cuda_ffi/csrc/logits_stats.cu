// linear_logp's online logsumexp over one chunk of precomputed f32 logits,
// as a CUDA kernel behind an XLA FFI handler: the second half of the SM90
// route (the first is det_gemm's logits of a vocabulary chunk). As an FFI
// call it can sit in XLA's command buffers with the det_gemm calls around
// it; the jax-triton kernel it would replace is a legacy custom call, which
// XLA runs between graphs.
//
// Invariance: one warp owns one row. Lane j folds columns j, j + 32, ... in
// order into its own running (max, sum of exp, sum of exp * logit), then the
// warp merges the 32 partial states by an xor butterfly. Every step depends
// only on the row's own logits and the fixed lane mapping, never on the
// number of rows, so a row's stats are the same bits in any batch. The merge
// is commutative bit for bit (IEEE sums and products are), so every lane
// ends with the same state.
#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "ffi_traits.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace rlk {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;

// Running softmax statistics of the logits seen so far: the max, the sum of
// exp(x - max) and the sum of exp(x - max) * x.
struct Stats {
  float max, sum, weighted;
};

__device__ inline void Fold(Stats& a, float x) {
  if (x > a.max) {  // also the first element, while a.max is -inf
    const float scale = expf(a.max - x);
    a.sum = a.sum * scale + 1.0f;
    a.weighted = a.weighted * scale + x;
    a.max = x;
  } else {
    const float e = expf(x - a.max);
    a.sum += e;
    a.weighted += e * x;
  }
}

__device__ inline Stats Merge(const Stats& a, const Stats& b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return a;  // both empty
  const float sa = expf(a.max - max), sb = expf(b.max - max);
  return {max, a.sum * sa + b.sum * sb, a.weighted * sa + b.weighted * sb};
}

// Folds logits [n, c] (row-major, already this chunk's) into the running
// stats; `targets` index this chunk (outside [0, c): nothing picked). The
// outputs may alias the inputs: each row is read, then written, by one lane.
__global__ void LogitsStatsKernel(const float* logits, const int32_t* targets,
                                  const float* max_in, const float* sum_in,
                                  const float* picked_in,
                                  const float* weighted_in, float* max_out,
                                  float* sum_out, float* picked_out,
                                  float* weighted_out, int64_t n, int64_t c,
                                  float temperature) {
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;  // a whole warp: the shuffles below stay converged
  const float* x = logits + row * c;
  Stats own{-INFINITY, 0.0f, 0.0f};
  for (int64_t j = lane; j < c; j += kWarp) Fold(own, x[j] / temperature);
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const Stats other{__shfl_xor_sync(0xffffffffu, own.max, offset),
                      __shfl_xor_sync(0xffffffffu, own.sum, offset),
                      __shfl_xor_sync(0xffffffffu, own.weighted, offset)};
    own = Merge(own, other);
  }
  if (lane != 0) return;
  const Stats all = Merge({max_in[row], sum_in[row], weighted_in[row]}, own);
  const int32_t t = targets[row];
  const float picked = (t >= 0 && t < c) ? x[t] / temperature : 0.0f;
  max_out[row] = all.max;
  sum_out[row] = all.sum;
  weighted_out[row] = all.weighted;
  picked_out[row] = picked_in[row] + picked;
}

using F32 = ffi::Buffer<ffi::F32>;
using F32Out = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error LogitsStatsFfi(cudaStream_t stream, F32 logits,
                          ffi::Buffer<ffi::S32> targets, F32 max_in,
                          F32 sum_in, F32 picked_in, F32 weighted_in,
                          F32Out max_out, F32Out sum_out, F32Out picked_out,
                          F32Out weighted_out, float temperature) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi logits_stats: logits must be [N, C]");
  }
  const int64_t n = dims[0], c = dims[1];
  for (const F32* stat : {&max_in, &sum_in, &picked_in, &weighted_in}) {
    if (static_cast<int64_t>(stat->element_count()) != n) {
      return ffi::Error::InvalidArgument(
          "rlk cuda_ffi logits_stats: each running stat must have N = " +
          std::to_string(n) + " elements");
    }
  }
  if (static_cast<int64_t>(targets.element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi logits_stats: targets must have N = " +
        std::to_string(n) + " elements");
  }
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  LogitsStatsKernel<<<static_cast<unsigned>(blocks), kRowsPerBlock * kWarp, 0,
                      stream>>>(
      logits.typed_data(), targets.typed_data(), max_in.typed_data(),
      sum_in.typed_data(), picked_in.typed_data(), weighted_in.typed_data(),
      max_out->typed_data(), sum_out->typed_data(), picked_out->typed_data(),
      weighted_out->typed_data(), n, c, temperature);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("rlk cuda_ffi logits_stats: ") +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rlk

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkLogitsStats, rlk::LogitsStatsFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<rlk::F32>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("temperature"),
                              RLK_FFI_TRAITS);
