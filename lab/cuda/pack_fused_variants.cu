// The one-kernel pack (PackRowsFused) on the pack benchmark's shape, by
// block size and rows per block, against the library's own row gather with
// a ready gather map and a plain memcpy of the same bytes (H100 experiment,
// not part of the library). It compiles the library's kernel source itself:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//     -DRLK_FUSED_THREADS=512 -I cuda_ffi/csrc lab/cuda/pack_fused_variants.cu -o /tmp/pfv
#include "../../cuda_ffi/csrc/pack_rows_kernels.cu"

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("CUDA error %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)

__global__ void FillRandom(uint4* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = make_uint4(h, h * 3u + 1u, h ^ 0x9e3779b9u, ~h);
  }
}


// The fused kernel's copy alone (no mask scan), rows from a ready map.
__global__ void CopyOnly(const uint4* __restrict__ src, const int32_t* __restrict__ idx,
                         int64_t rows, int64_t upr, int64_t rows_per_block, uint4* __restrict__ dst) {
  const int64_t r0 = blockIdx.x * rows_per_block;
  const int n = (int)min(rows_per_block, rows - r0);
  if (n > 0) rlk::CopyRows(src, dst, upr, r0, n, uint4{}, [=](int64_t r) { return (int64_t)idx[r]; });
}

// Software-pipelined: the loads of the next batch are issued before the
// stores of this one, so a thread always has loads in flight.
template <int kU>
__global__ void CopyPipelined(const uint4* __restrict__ src, const int32_t* __restrict__ idx,
                              int64_t rows, int64_t upr64, int64_t rows_per_block, uint4* __restrict__ dst) {
  const int upr = (int)upr64;
  const int64_t r0 = blockIdx.x * rows_per_block;
  const int n = (int)min(rows_per_block, rows - r0) * upr;
  const int step = blockDim.x * kU;
  uint4 cur[kU], nxt[kU];
  auto load = [&](int base, uint4* v) {
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) {
        const int row = i / upr;
        const int64_t s = idx[r0 + row];
        v[k] = s < 0 ? uint4{} : __ldcs(src + s * upr + (i - row * upr));
      }
    }
  };
  int base = threadIdx.x;
  if (base < n) load(base, cur);
  for (; base < n; base += step) {
    if (base + step < n) load(base + step, nxt);
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) __stcs(dst + r0 * upr + i, cur[k]);
    }
#pragma unroll
    for (int k = 0; k < kU; ++k) cur[k] = nxt[k];
  }
}

int main() {
  constexpr int kSets = 4;
  const int64_t n_seq = 32, width = 1024, size = n_seq * width, upr = 512;
  const int64_t active = (int64_t)(0.3 * size), capacity = (active + 127) / 128 * 128;
  std::mt19937 g(0);
  std::vector<std::vector<uint8_t>> masks(kSets, std::vector<uint8_t>(size, 0));
  for (auto& m : masks) {
    std::vector<int> perm(size);
    for (int i = 0; i < size; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), g);
    for (int i = 0; i < active; ++i) m[perm[i]] = 1;
  }
  uint4 *src[kSets], *dst;
  uint8_t* mask_d[kSets];
  for (int i = 0; i < kSets; ++i) {
    CHECK(cudaMalloc(&src[i], size * upr * 16));
    FillRandom<<<1024, 256>>>(src[i], size * upr, 1234u + i);
    CHECK(cudaMalloc(&mask_d[i], size));
    CHECK(cudaMemcpy(mask_d[i], masks[i].data(), size, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMalloc(&dst, capacity * upr * 16));
  int32_t* fields;
  uint8_t* valid;
  const int64_t n_i32 = (n_seq + 1) + n_seq + 3 + 4 * capacity + size;
  CHECK(cudaMalloc(&fields, n_i32 * 4));
  CHECK(cudaMalloc(&valid, capacity));
  rlk::PackInfoOut out;
  int32_t* f = fields;
  out.cu_seqlens = f; f += n_seq + 1;
  out.seq_lens = f; f += n_seq;
  out.total = f++; out.max_seqlen = f++; out.num_dropped = f++;
  out.segment_ids = f; f += capacity;
  out.positions = f; f += capacity;
  out.gather_map = f; f += capacity;
  int32_t* gather_ref = f; f += capacity;
  out.scatter_map = f;
  out.valid = valid;
  // The reference gather map of set 0, and its packed rows from the gather.
  std::vector<int32_t> h_gather(capacity, -1);
  for (int64_t p = 0, r = 0; p < size; ++p) if (masks[0][p]) h_gather[r++] = (int32_t)p;
  CHECK(cudaMemcpy(gather_ref, h_gather.data(), capacity * 4, cudaMemcpyHostToDevice));
  uint4* want;
  CHECK(cudaMalloc(&want, capacity * upr * 16));
  CHECK(rlk::GatherRows(0, src[0], gather_ref, capacity, upr * 16, 2, 0, want));
  CHECK(cudaDeviceSynchronize());

  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  const double bytes = (double)(active + capacity) * upr * 16;
  double memcpy_us = 0;
  auto time = [&](const char* name, auto launch) {
    for (int i = 0; i < 8; ++i) launch(i % kSets);
    const int iters = 200;
    cudaEventRecord(a);
    for (int i = 0; i < iters; ++i) launch(i % kSets);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    const double us = ms * 1e3 / iters;
    if (memcpy_us == 0) memcpy_us = us;
    cudaError_t e = cudaGetLastError();
    printf("%-52s %8.2f us  %7.1f GB/s  %5.2fx memcpy %s\n", name, us,
           bytes / us / 1e3, us / memcpy_us, e == cudaSuccess ? "" : cudaGetErrorString(e));
  };
  // The same bytes as the pack moves: read `active` rows, write `capacity`.
  time("memcpy of the same bytes (contiguous)", [&](int i) {
    cudaMemcpyAsync(dst, src[i], (size_t)bytes / 2, cudaMemcpyDeviceToDevice);
  });
  time("gather with a ready map (GatherRows)", [&](int i) {
    rlk::GatherRows(0, src[i], gather_ref, capacity, upr * 16, 2, 0, dst);
  });
  int failures = 0;
  int sms0;
  cudaDeviceGetAttribute(&sms0, cudaDevAttrMultiProcessorCount, 0);
  for (int threads : {1024, 512, 256}) {
    for (int per_sm : {1, 2, 4, 8}) {
      if (threads * per_sm > 2048) continue;
      const int64_t grid = (int64_t)per_sm * sms0;
      const int64_t rpb = (capacity + grid - 1) / grid;
      const int64_t blocks = (capacity + rpb - 1) / rpb;
      char name[96];
      snprintf(name, sizeof name, "copy only %d thr x %d/SM, %lld rows/block", threads, per_sm, (long long)rpb);
      time(name, [&](int i) { CopyOnly<<<(unsigned)blocks, threads>>>(src[i], gather_ref, capacity, upr, rpb, dst); });
      snprintf(name, sizeof name, "pipelined u4 %d thr x %d/SM, %lld rows/block", threads, per_sm, (long long)rpb);
      time(name, [&](int i) { CopyPipelined<4><<<(unsigned)blocks, threads>>>(src[i], gather_ref, capacity, upr, rpb, dst); });
    }
  }
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int per_sm = 1024 / rlk::kFusedThreads;  // resident blocks an SM
  std::vector<int64_t> grids;
  for (int waves : {1, 2, 3, 4, 6}) grids.push_back((int64_t)waves * per_sm * sms);
  for (int64_t rows : {8, 16, 32}) grids.push_back((capacity + rows - 1) / rows);
  for (int64_t grid : grids) {
    const rlk::FusedGeometry geo = rlk::ChooseFusedGeometry(size, capacity, grid);
    const int64_t blocks = geo.blocks;
    auto launch = [&](int i) {
      rlk::PackRowsFused<uint4><<<(unsigned)blocks, rlk::kFusedThreads>>>(
          src[i], mask_d[i], n_seq, width, capacity, upr, geo, uint4{}, out, dst);
    };
    char name[96];
    snprintf(name, sizeof name, "fused %d thr, %lld rows/block (%lld blocks)",
             rlk::kFusedThreads, (long long)geo.rows_per_block, (long long)blocks);
    time(name, launch);
    launch(0);
    CHECK(cudaDeviceSynchronize());
    std::vector<int32_t> got(capacity);
    CHECK(cudaMemcpy(got.data(), out.gather_map, capacity * 4, cudaMemcpyDeviceToHost));
    std::vector<uint4> rows_got(capacity * upr), rows_want(capacity * upr);
    CHECK(cudaMemcpy(rows_got.data(), dst, capacity * upr * 16, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(rows_want.data(), want, capacity * upr * 16, cudaMemcpyDeviceToHost));
    const bool ok = got == h_gather &&
        memcmp(rows_got.data(), rows_want.data(), capacity * upr * 16) == 0;
    if (!ok) { printf("   MISMATCH against the reference gather\n"); ++failures; }
  }
  printf("check: %s\n", failures ? "FAILED" : "ok");
  return failures != 0;
}
