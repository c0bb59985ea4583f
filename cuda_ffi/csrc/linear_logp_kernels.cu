// linear_logp's row arithmetic on the SM90 route, as CUDA kernels: the
// online logsumexp over one chunk of precomputed f32 logits (the chunk's
// logits come from det_gemm), the finish of a row's folded statistics into
// (logp, lse, entropy), and the backward's d logits of one chunk. Each has an
// XLA FFI handler (JAX: command-buffer compatible, so it sits in XLA's CUDA
// graphs with the det_gemm calls around it) and a plain C entry (the torch
// bridge, on torch's stream). JAX and torch run these same compiled kernels
// and the same det_gemm kernels in the same order: the same bits, and every
// transcendental (expf, logf) is this file's, not a framework's.
//
// Invariance: the stats kernel gives one warp to one row. Lane j reads the
// row's float4 groups j, j + 32, ... ; each step of the loop takes kUnroll
// such groups a lane (16 logits, loads in flight together: the kernel is
// bound by memory, and one dependent load at a time left it at half the
// bandwidth), takes their max with the lane's running max, rescales the
// running sums once and adds the 16 exps in column order. Then the warp
// merges the 32 partial states by an xor butterfly. Every step depends only
// on the row's own logits and the fixed lane mapping, never on the number
// of rows, so a row's stats are the same bits in any batch. Only lane 0's
// state is stored, merged in a fixed order (nvcc may contract the merge into
// FMAs, so other lanes can hold other bits; none is read). The finish and
// gradient kernels are elementwise over a row's own values.
//
// Temperature is per row (`temps`, f32 [N]: a sampler's per-sample
// temperatures; a call-wide one is a filled vector), read by the row's own
// threads. Entropy is optional work: without it (`kEntropy` false) the
// stats kernel skips the sum of exp * logit (passing it through as it
// came), the finish writes NaN
// entropies, and the gradient kernel drops the entropy term, whose
// cotangent would be zero anyway (the log-prob's bits and gradients are the
// same either way, but for the sign of a zero).
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_bf16.h>
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

__device__ inline Stats Merge(const Stats& a, const Stats& b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return a;  // both empty
  const float sa = expf(a.max - max), sb = expf(b.max - max);
  return {max, a.sum * sa + b.sum * sb, a.weighted * sa + b.weighted * sb};
}

constexpr int kVector = 4;  // logits per load (float4)
constexpr int kUnroll = 4;  // float4 loads in flight per lane and step

// Folds logits [n, c] (row-major, already this chunk's; c a multiple of 4)
// into the running stats; `targets` index this chunk (outside [0, c):
// nothing picked). The outputs may alias the inputs: each row is read, then
// written, by one lane.
template <bool kEntropy>
__global__ void LogitsStatsKernel(const float* logits, const int32_t* targets,
                                  const float* temps,
                                  const float* max_in, const float* sum_in,
                                  const float* picked_in,
                                  const float* weighted_in, float* max_out,
                                  float* sum_out, float* picked_out,
                                  float* weighted_out, int64_t n, int64_t c) {
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= n) return;  // a whole warp: the shuffles below stay converged
  const float temperature = temps[row];
  const float* x = logits + row * c;
  const float4* groups = reinterpret_cast<const float4*>(x);
  const int64_t count = c / kVector;
  Stats own{-INFINITY, 0.0f, 0.0f};
  for (int64_t base = 0; base < count; base += kWarp * kUnroll) {
    float v[kUnroll * kVector];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = base + u * kWarp + lane;
      valid[u] = g < count;
      const float4 q = valid[u] ? groups[g] : make_float4(0.f, 0.f, 0.f, 0.f);
      v[u * kVector + 0] = q.x / temperature;
      v[u * kVector + 1] = q.y / temperature;
      v[u * kVector + 2] = q.z / temperature;
      v[u * kVector + 3] = q.w / temperature;
    }
    float m = own.max;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;
#pragma unroll
      for (int e = 0; e < kVector; ++e) m = fmaxf(m, v[u * kVector + e]);
    }
    if (m == -INFINITY) continue;  // no column of this step for this lane
    const float scale = expf(own.max - m);  // 0 while own is empty
    float sum = own.sum * scale, weighted = own.weighted * scale;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;
#pragma unroll
      for (int e = 0; e < kVector; ++e) {
        const float xe = v[u * kVector + e];
        const float p = expf(xe - m);
        sum += p;
        if (kEntropy) weighted += p * xe;
      }
    }
    own = {m, sum, weighted};
  }
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
  weighted_out[row] = kEntropy ? all.weighted : weighted_in[row];
  picked_out[row] = picked_in[row] + picked;
}

// The finish of a row: lse = max + log(sum); a target outside [0, V) gives
// log-prob 0; entropy = lse - E[logit] (NaN where it was not folded). One
// thread per row.
__global__ void LogitsFinishKernel(const float* max, const float* sum,
                                   const float* picked, const float* weighted,
                                   const int32_t* targets, int64_t n,
                                   int64_t v, bool with_entropy, float* logp,
                                   float* lse, float* entropy) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                      threadIdx.x;
  if (row >= n) return;
  const float s = sum[row];
  const float l = max[row] + logf(s);
  const int32_t t = targets[row];
  logp[row] = (t >= 0 && t < v) ? picked[row] - l : 0.0f;
  lse[row] = l;
  entropy[row] = with_entropy ? l - weighted[row] / s : NAN;
}

constexpr int kGradVector = 4;  // columns per thread: one float4 load

// d loss / d logits of one vocabulary chunk, as the dtype of the next
// products (bf16), from the raw f32 logits [n, c] (det_gemm's, before the
// temperature) and each row's lse, entropy and cotangents:
//   x = logit / T, p = exp(x - lse),
//   d = g_picked * (onehot - p) - g_entropy * p * (x - (lse - entropy)),
// divided by T (the row's). `targets` index this chunk (outside [0, c): no
// one-hot); `g_picked` is already 0 on rows whose target is outside the
// vocabulary. Without entropy, `entropy` and `g_entropy` are not read.
// Every element reads only its own row's values: row-invariant.
template <bool kEntropy>
__global__ void LogitsGradKernel(const float* logits, const int32_t* targets,
                                 const float* temps, const float* lse,
                                 const float* entropy, const float* g_picked,
                                 const float* g_entropy, int64_t n, int64_t c,
                                 __nv_bfloat16* dlogits) {
  const int64_t vectors = n * (c / kGradVector);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x;
  if (i >= vectors) return;
  const int64_t row = i / (c / kGradVector);
  const int64_t col = (i % (c / kGradVector)) * kGradVector;
  const float4 raw = *reinterpret_cast<const float4*>(logits + row * c + col);
  const float xs[kGradVector] = {raw.x, raw.y, raw.z, raw.w};
  const float temperature = temps[row];
  const float row_lse = lse[row];
  const float mean = kEntropy ? row_lse - entropy[row] : 0.0f;
  const float gp = g_picked[row], ge = kEntropy ? g_entropy[row] : 0.0f;
  const int32_t t = targets[row];
  __nv_bfloat16 out[kGradVector];
  for (int j = 0; j < kGradVector; ++j) {
    const float x = xs[j] / temperature;
    const float p = expf(x - row_lse);
    const float onehot = (t == col + j) ? 1.0f : 0.0f;
    float d = gp * (onehot - p);
    if (kEntropy) d = d - ge * p * (x - mean);
    out[j] = __float2bfloat16_rn(d / temperature);
  }
  *reinterpret_cast<uint2*>(dlogits + row * c + col) =
      *reinterpret_cast<const uint2*>(out);
}

constexpr int kThreads = 256;

int64_t Blocks(int64_t work, int64_t per_block) {
  return (work + per_block - 1) / per_block;
}

// The launches both entries share. A zero-row launch launches nothing.
cudaError_t LaunchStats(cudaStream_t stream, const float* logits,
                        const int32_t* targets, const float* temps,
                        const float* max_in, const float* sum_in,
                        const float* picked_in, const float* weighted_in,
                        float* max_out, float* sum_out, float* picked_out,
                        float* weighted_out, int64_t n, int64_t c,
                        bool with_entropy) {
  if (n == 0) return cudaSuccess;
  const auto kernel = with_entropy ? LogitsStatsKernel<true>
                                   : LogitsStatsKernel<false>;
  kernel<<<static_cast<unsigned>(Blocks(n, kRowsPerBlock)),
           kRowsPerBlock * kWarp, 0, stream>>>(
      logits, targets, temps, max_in, sum_in, picked_in, weighted_in, max_out,
      sum_out, picked_out, weighted_out, n, c);
  return cudaGetLastError();
}

cudaError_t LaunchFinish(cudaStream_t stream, const float* max,
                         const float* sum, const float* picked,
                         const float* weighted, const int32_t* targets,
                         int64_t n, int64_t v, bool with_entropy, float* logp,
                         float* lse, float* entropy) {
  if (n == 0) return cudaSuccess;
  LogitsFinishKernel<<<static_cast<unsigned>(Blocks(n, kThreads)), kThreads, 0,
                       stream>>>(max, sum, picked, weighted, targets, n, v,
                                 with_entropy, logp, lse, entropy);
  return cudaGetLastError();
}

cudaError_t LaunchGrad(cudaStream_t stream, const float* logits,
                       const int32_t* targets, const float* temps,
                       const float* lse, const float* entropy,
                       const float* g_picked, const float* g_entropy,
                       int64_t n, int64_t c, bool with_entropy,
                       __nv_bfloat16* dlogits) {
  if (n == 0 || c == 0) return cudaSuccess;
  const auto kernel = with_entropy ? LogitsGradKernel<true>
                                   : LogitsGradKernel<false>;
  kernel<<<static_cast<unsigned>(Blocks(n * (c / kGradVector), kThreads)),
           kThreads, 0, stream>>>(logits, targets, temps, lse, entropy,
                                  g_picked, g_entropy, n, c, dlogits);
  return cudaGetLastError();
}

// Checks shared by both entries; the message, or nullptr.
const char* GradShapeError(int64_t c) {
  return c % kGradVector
             ? "rlk cuda_ffi logits_grad: the chunk's columns must be a "
               "multiple of 4 (vector loads)"
             : nullptr;
}

const char* StatsShapeError(int64_t c) {
  return c % kVector
             ? "rlk cuda_ffi logits_stats: the chunk's columns must be a "
               "multiple of 4 (vector loads)"
             : nullptr;
}

thread_local std::string logp_error;

const char* ErrorOf(cudaError_t status, const char* op) {
  if (status == cudaSuccess) return nullptr;
  logp_error = std::string("rlk cuda_ffi ") + op + ": " +
               cudaGetErrorString(status);
  return logp_error.c_str();
}

ffi::Error FfiError(const char* error) {
  return error ? ffi::Error::Internal(error) : ffi::Error::Success();
}

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using F32Out = ffi::Result<ffi::Buffer<ffi::F32>>;

// (n, c) of a [N, C] logits chunk; the message, or nullptr.
const char* LogitsShape(const char* op, const F32& logits, int64_t& n,
                        int64_t& c) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) {
    logp_error = std::string("rlk cuda_ffi ") + op + ": logits must be [N, C]";
    return logp_error.c_str();
  }
  n = dims[0];
  c = dims[1];
  return nullptr;
}

// Each [N] operand must have N elements; the message, or nullptr.
const char* RowsError(const char* op, int64_t n,
                      std::initializer_list<size_t> counts) {
  for (size_t count : counts) {
    if (static_cast<int64_t>(count) != n) {
      logp_error = std::string("rlk cuda_ffi ") + op +
                   ": each per-row operand must have N = " +
                   std::to_string(n) + " elements";
      return logp_error.c_str();
    }
  }
  return nullptr;
}

ffi::Error LogitsStatsFfi(cudaStream_t stream, F32 logits, S32 targets,
                          F32 temps, F32 max_in, F32 sum_in, F32 picked_in,
                          F32 weighted_in, F32Out max_out, F32Out sum_out,
                          F32Out picked_out, F32Out weighted_out,
                          bool with_entropy) {
  int64_t n, c;
  if (const char* e = LogitsShape("logits_stats", logits, n, c)) {
    return ffi::Error::InvalidArgument(e);
  }
  if (const char* e = RowsError("logits_stats", n,
                                {max_in.element_count(), sum_in.element_count(),
                                 picked_in.element_count(),
                                 weighted_in.element_count(),
                                 targets.element_count(),
                                 temps.element_count()})) {
    return ffi::Error::InvalidArgument(e);
  }
  if (const char* e = StatsShapeError(c)) return ffi::Error::InvalidArgument(e);
  return FfiError(ErrorOf(
      LaunchStats(stream, logits.typed_data(), targets.typed_data(),
                  temps.typed_data(), max_in.typed_data(), sum_in.typed_data(),
                  picked_in.typed_data(), weighted_in.typed_data(),
                  max_out->typed_data(), sum_out->typed_data(),
                  picked_out->typed_data(), weighted_out->typed_data(), n, c,
                  with_entropy),
      "logits_stats"));
}

ffi::Error LogitsFinishFfi(cudaStream_t stream, F32 max, F32 sum, F32 picked,
                           F32 weighted, S32 targets, F32Out logp, F32Out lse,
                           F32Out entropy, int64_t vocab, bool with_entropy) {
  const int64_t n = static_cast<int64_t>(max.element_count());
  if (const char* e = RowsError("logits_finish", n,
                                {sum.element_count(), picked.element_count(),
                                 weighted.element_count(),
                                 targets.element_count()})) {
    return ffi::Error::InvalidArgument(e);
  }
  return FfiError(ErrorOf(
      LaunchFinish(stream, max.typed_data(), sum.typed_data(),
                   picked.typed_data(), weighted.typed_data(),
                   targets.typed_data(), n, vocab, with_entropy,
                   logp->typed_data(), lse->typed_data(),
                   entropy->typed_data()),
      "logits_finish"));
}

ffi::Error LogitsGradFfi(cudaStream_t stream, F32 logits, S32 targets,
                         F32 temps, F32 lse, F32 entropy, F32 g_picked,
                         F32 g_entropy,
                         ffi::Result<ffi::Buffer<ffi::BF16>> dlogits,
                         bool with_entropy) {
  int64_t n, c;
  if (const char* e = LogitsShape("logits_grad", logits, n, c)) {
    return ffi::Error::InvalidArgument(e);
  }
  if (const char* e = RowsError("logits_grad", n,
                                {targets.element_count(), temps.element_count(),
                                 lse.element_count(),
                                 entropy.element_count(),
                                 g_picked.element_count(),
                                 g_entropy.element_count()})) {
    return ffi::Error::InvalidArgument(e);
  }
  if (const char* e = GradShapeError(c)) return ffi::Error::InvalidArgument(e);
  return FfiError(ErrorOf(
      LaunchGrad(stream, logits.typed_data(), targets.typed_data(),
                 temps.typed_data(), lse.typed_data(), entropy.typed_data(),
                 g_picked.typed_data(), g_entropy.typed_data(), n, c,
                 with_entropy,
                 reinterpret_cast<__nv_bfloat16*>(dlogits->untyped_data())),
      "logits_grad"));
}

}  // namespace
}  // namespace rlk

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkLogitsStats, rlk::LogitsStatsFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::S32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("entropy"),
                              RLK_FFI_TRAITS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkLogitsFinish, rlk::LogitsFinishFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::S32>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("vocab")
                                  .Attr<bool>("entropy"),
                              RLK_FFI_TRAITS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkLogitsGrad, rlk::LogitsGradFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::S32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Arg<rlk::F32>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<bool>("entropy"),
                              RLK_FFI_TRAITS);

extern "C" {

// The torch bridge's entries: launch on `stream` (torch's current stream).
// Return NULL, or a message valid until the next call on this thread. The
// stats are updated in place (`stats`: max, sum, picked, weighted);
// `temps` are the rows' temperatures; `with_entropy` 0 or 1.

const char* rlk_logits_stats(void* stream, const float* logits,
                             const int32_t* targets, const float* temps,
                             float* max, float* sum, float* picked,
                             float* weighted, int64_t n, int64_t c,
                             int with_entropy) {
  if (const char* e = rlk::StatsShapeError(c)) return e;
  return rlk::ErrorOf(
      rlk::LaunchStats(static_cast<cudaStream_t>(stream), logits, targets,
                       temps, max, sum, picked, weighted, max, sum, picked,
                       weighted, n, c, with_entropy != 0),
      "logits_stats");
}

const char* rlk_logits_finish(void* stream, const float* max, const float* sum,
                              const float* picked, const float* weighted,
                              const int32_t* targets, int64_t n, int64_t v,
                              int with_entropy, float* logp, float* lse,
                              float* entropy) {
  return rlk::ErrorOf(
      rlk::LaunchFinish(static_cast<cudaStream_t>(stream), max, sum, picked,
                        weighted, targets, n, v, with_entropy != 0, logp, lse,
                        entropy),
      "logits_finish");
}

const char* rlk_logits_grad(void* stream, const float* logits,
                            const int32_t* targets, const float* temps,
                            const float* lse, const float* entropy,
                            const float* g_picked, const float* g_entropy,
                            int64_t n, int64_t c, int with_entropy,
                            void* dlogits) {
  if (const char* e = rlk::GradShapeError(c)) return e;
  return rlk::ErrorOf(
      rlk::LaunchGrad(static_cast<cudaStream_t>(stream), logits, targets,
                      temps, lse, entropy, g_picked, g_entropy, n, c,
                      with_entropy != 0, static_cast<__nv_bfloat16*>(dlogits)),
      "logits_grad");
}

}  // extern "C"
