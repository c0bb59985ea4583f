// Row-gather kernel variants on the pack benchmark's shape (H100 experiment,
// not part of the library): which copy structure reaches copy bandwidth?
//   nvcc -O3 -std=c++17 -arch=sm_90a lab/cuda/gather_variants.cu -o /tmp/gv && /tmp/gv
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("CUDA error %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

constexpr int kUpr = 512;  // 8 KB rows of uint4

__global__ void OneRowPerBlock(const uint4* __restrict__ src, const int* __restrict__ idx, uint4* __restrict__ dst) {
  const int r = blockIdx.x, s = idx[r];
  for (int u = threadIdx.x; u < kUpr; u += blockDim.x) dst[(int64_t)r * kUpr + u] = src[(int64_t)s * kUpr + u];
}

template <int kUnroll, bool kStream>
__global__ void Flat(const uint4* __restrict__ src, const int* __restrict__ idx, uint4* __restrict__ dst, int rows, int rows_per_block) {
  const int r0 = blockIdx.x * rows_per_block;
  const int n = min(rows_per_block, rows - r0) * kUpr;
  for (int base = threadIdx.x; base < n; base += blockDim.x * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) {
        const int row = i / kUpr, s = idx[r0 + row];
        const uint4* p = src + (int64_t)s * kUpr + (i % kUpr);
        v[k] = kStream ? __ldcs(p) : *p;
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) {
        uint4* p = dst + (int64_t)r0 * kUpr + i;
        if (kStream) __stcs(p, v[k]); else *p = v[k];
      }
    }
  }
}

template <int kUnroll>
__global__ void WarpPerRow(const uint4* __restrict__ src, const int* __restrict__ idx, uint4* __restrict__ dst, int rows) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const uint4* in = src + (int64_t)idx[r] * kUpr;
    uint4* out = dst + (int64_t)r * kUpr;
    for (int u0 = 0; u0 < kUpr; u0 += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) v[k] = __ldcs(in + u0 + k * 32 + lane);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) __stcs(out + u0 + k * 32 + lane, v[k]);
    }
  }
}

// TMA bulk copies: each warp's lane 0 moves whole rows global -> shared ->
// global through a 2-deep ring of 8 KB buffers.
__device__ __forceinline__ uint32_t Smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

template <int kWarps>
__global__ void BulkRows(const uint4* __restrict__ src, const int* __restrict__ idx, uint4* __restrict__ dst, int rows) {
  extern __shared__ __align__(128) uint4 buf[];  // kWarps * 2 * kUpr
  __shared__ __align__(8) uint64_t bar[kWarps * 2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane != 0) return;
  uint4* mine = buf + warp * 2 * kUpr;
  uint64_t* mbar = bar + warp * 2;
  for (int b = 0; b < 2; ++b)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(Smem(mbar + b)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int total_warps = gridDim.x * kWarps;
  const uint32_t bytes = kUpr * 16;
  int k = 0;
  uint32_t phase[2] = {0, 0};
  for (int r = blockIdx.x * kWarps + warp; r < rows; r += total_warps, ++k) {
    const int b = k & 1;
    // the store that last read this buffer must be done reading it
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(Smem(mbar + b)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(Smem(mine + b * kUpr)), "l"(src + (int64_t)idx[r] * kUpr), "r"(bytes), "r"(Smem(mbar + b)) : "memory");
    // wait for the load, then store
    uint32_t done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(Smem(mbar + b)), "r"(phase[b]) : "memory");
    }
    phase[b] ^= 1;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst + (int64_t)r * kUpr), "r"(Smem(mine + b * kUpr)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  const int n_src = 32 * 1024, rows = 9856;
  std::vector<int> h_idx;
  std::mt19937 g(0);
  std::vector<int> perm(n_src);
  for (int i = 0; i < n_src; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g);
  h_idx.assign(perm.begin(), perm.begin() + rows);
  std::sort(h_idx.begin(), h_idx.end());  // a pack's gather map ascends
  uint4 *src, *dst; int* idx;
  CHECK(cudaMalloc(&src, (size_t)n_src * kUpr * 16));
  CHECK(cudaMalloc(&dst, (size_t)rows * kUpr * 16));
  CHECK(cudaMalloc(&idx, rows * 4));
  CHECK(cudaMemset(src, 1, (size_t)n_src * kUpr * 16));
  CHECK(cudaMemcpy(idx, h_idx.data(), rows * 4, cudaMemcpyHostToDevice));
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const double bytes = 2.0 * rows * kUpr * 16;
  auto time = [&](const char* name, auto launch) {
    for (int i = 0; i < 3; ++i) launch();
    cudaEventRecord(a);
    const int iters = 50;
    for (int i = 0; i < iters; ++i) launch();
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    cudaError_t e = cudaGetLastError();
    const double us = ms * 1e3 / iters;
    printf("%-44s %8.2f us  %7.1f GB/s  %s\n", name, us, bytes / us / 1e3, e == cudaSuccess ? "" : cudaGetErrorString(e));
  };
  time("memcpy of the same bytes (contiguous)", [&] { cudaMemcpyAsync(dst, src, (size_t)rows * kUpr * 16, cudaMemcpyDeviceToDevice); });
  time("one row per block, 256 thr", [&] { OneRowPerBlock<<<rows, 256>>>(src, idx, dst); });
  for (int rpb : {2, 4, 8, 16}) {
    char name[80];
    snprintf(name, 80, "flat 256 thr unroll4 %d rows/block", rpb);
    time(name, [&] { Flat<4, false><<<(rows + rpb - 1) / rpb, 256>>>(src, idx, dst, rows, rpb); });
    snprintf(name, 80, "flat 256 thr unroll8 stream %d rows/block", rpb);
    time(name, [&] { Flat<8, true><<<(rows + rpb - 1) / rpb, 256>>>(src, idx, dst, rows, rpb); });
    snprintf(name, 80, "flat 1024 thr unroll4 %d rows/block", rpb * 4);
    time(name, [&] { Flat<4, false><<<(rows + 4 * rpb - 1) / (4 * rpb), 1024>>>(src, idx, dst, rows, 4 * rpb); });
  }
  for (int blocks_per_sm : {2, 4, 8}) {
    char name[80];
    snprintf(name, 80, "warp per row unroll8, 512 thr, %d blocks/SM", blocks_per_sm);
    time(name, [&] { WarpPerRow<8><<<sms * blocks_per_sm, 512>>>(src, idx, dst, rows); });
    snprintf(name, 80, "warp per row unroll16, 256 thr, %d blocks/SM", blocks_per_sm);
    time(name, [&] { WarpPerRow<16><<<sms * blocks_per_sm, 256>>>(src, idx, dst, rows); });
  }
  {
    const int smem = 8 * 2 * kUpr * 16;  // 8 warps
    CHECK(cudaFuncSetAttribute(BulkRows<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (int blocks_per_sm : {1, 2}) {
      char name[80];
      snprintf(name, 80, "TMA bulk rows, 8 warps x 2 bufs, %d blocks/SM", blocks_per_sm);
      time(name, [&] { BulkRows<8><<<sms * blocks_per_sm, 256, smem>>>(src, idx, dst, rows); });
    }
    const int smem4 = 4 * 2 * kUpr * 16;
    CHECK(cudaFuncSetAttribute(BulkRows<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem4));
    for (int blocks_per_sm : {2, 3}) {
      char name[80];
      snprintf(name, 80, "TMA bulk rows, 4 warps x 2 bufs, %d blocks/SM", blocks_per_sm);
      time(name, [&] { BulkRows<4><<<sms * blocks_per_sm, 128, smem4>>>(src, idx, dst, rows); });
    }
  }
  // correctness of the last variant
  std::vector<uint4> h(kUpr);
  CHECK(cudaMemcpy(h.data(), dst + (int64_t)(rows - 1) * kUpr, kUpr * 16, cudaMemcpyDeviceToHost));
  printf("check: %s\n", h[0].x == 0x01010101u && h[kUpr - 1].w == 0x01010101u ? "ok" : "WRONG");
  return 0;
}
