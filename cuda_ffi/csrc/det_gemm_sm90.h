// The det_gemm SM90 kernels as the rest of the library sees them: a problem,
// a config, and one launch function per (operand layout, output dtype). No
// CUTLASS types leak out of here, so the FFI and C entry points compile fast.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace rlk {

// C = op(A) @ op(B), all row-major and densely packed:
//   A is [M, K], or [K, M] when transpose_a; B is [K, N], or [N, K] when
//   transpose_b; C is [M, N]. bf16 operands, f32 accumulation.
struct GemmProblem {
  const void* a;
  const void* b;
  void* c;
  int64_t m, n, k;
  int sm_count;
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
  // The persistent scheduler's tile order: which output tile a CTA takes
  // next. It moves L2 reuse, never the bits (each tile is still computed
  // whole, K in order). 0 = CUTLASS's default (swizzle 1, its heuristic
  // raster: along M when there are more N tiles); a sweep of every order on
  // the H100 found none faster beyond run-to-run noise.
  // (A swapped config's scheduler sees C^T: its M is our N.)
  int swizzle = 0;  // 1, 2, 4 or 8 tiles per swizzle band
  int raster = 0;   // 1: along M, 2: along N
  // Programmatic dependent launch: the kernel may be scheduled while the
  // previous kernel on the stream drains, and runs its prologue (barriers,
  // TMA descriptor prefetch) there; every global read and write still
  // waits for that kernel to finish and flush (griddepcontrol.wait, which
  // det_gemm_kernels.cu compiles in). Scheduling only: the bits never move.
  bool pdl = true;
  // Elements between consecutive stored rows of B and of C; 0 = densely
  // packed. A column block of a larger product (kSplit256x192And128x256)
  // keeps the whole product's row pitch.
  int64_t b_pitch = 0;
  int64_t c_pitch = 0;
};

// Kernel instantiations. Every one walks K in order, one k16 MMA after
// another (in K tiles of 64, or 32 for the _K32 config: how deep a pipeline
// stage is), into a single f32 accumulator per output element (no split-K,
// no stream-K), so they all round identically: which one runs changes the
// speed, never the bits (proven per config by the device tests). The codes
// are stable (cuda_ffi.CONFIGS names them; the tuning caches store names).
enum class GemmConfig : int {
  kAuto = 0,
  kCooperative128x256 = 1,  // 2x1 cluster: the large-M projections
  kPingpong64x128 = 2,      // small M: narrow tiles, more of them
  kPingpong64x32 = 3,       // decode with few output columns: enough tiles
  kPingpong64x64 = 4,       // to keep several SMs streaming the weight
  kSwapPingpong64x32 = 5,   // decode rows: C^T = B^T A^T, 64 columns x 32 rows
  kCooperative256x192 = 6,  // 2x1 cluster: large products, N in 192s
  // Two kernels, one after the other: the first SplitColumns(m, n) columns
  // with 256x192 tiles, the rest with 128x256, so that neither persistent
  // grid ends on a mostly empty wave.
  kSplit256x192And128x256 = 7,
  kPingpong128x128 = 8,      // mid M: twice 128x256's tiles, full-speed MMA
  kCooperative128x128 = 9,   // 2x1 cluster
  kCooperative256x128 = 10,  // 2x1 cluster: tall tiles for narrow N
  kCooperative128x192 = 11,  // 2x1 cluster: N in 192s at mid M
  kPingpong64x256 = 12,      // a few hundred rows, wide N
  kCooperative128x256Cluster1x2 = 13,  // A shared along N: short, wide
  kPingpong64x128Cluster2x1 = 14,  // B shared by two row tiles: a few
  kPingpong64x64Cluster2x1 = 15,   // hundred rows, a long K
  kPingpong64x128Cluster4x2 = 16,  // B shared by four row tiles, A by two
  kPingpong64x64Cluster1x2 = 17,   // A shared along N: short K, few rows
  kCooperative128x320 = 18,        // 2x1 cluster: N in 320s, M 512-1024
  kPingpong64x320Cluster2x1 = 19,  // N in 320s, few row tiles
  kPingpong128x96Cluster2x4 = 20,  // M ~256, a long K: B to two row tiles,
                                   // A to four column tiles
  kPingpong128x128Cluster1x2 = 21, // A shared along N (dB, most of all)
  // C^T = B^T A^T: 256 weight columns x 192 rows, each warpgroup 128 of the
  // columns; 1x2 cluster (B^T's tile shared by two row tiles): M >= 3072
  kSwapCooperative256x192Cluster1x2 = 22,
  kCooperative128x96 = 23,  // 2x1 cluster: one wave of N=3072 at M=512
  // No cluster: probed on M=512 products of one wave with a long K, where
  // a 2x1 pair refills a multicast stage only when both CTAs are done with
  // it; the H100 table also takes the 128x128 one at M 256-1024 elsewhere.
  kPingpong64x320 = 24,
  kCooperative128x128Cluster1x1 = 25,
  kCooperative128x320K32 = 26,  // 32-deep K tiles: more, smaller stages
  // 1x2 clusters (A shared by two column tiles): an odd number of row
  // tiles (M=384, say) pads to no extra row of CTAs.
  kCooperative128x192Cluster1x2 = 27,
  kCooperative128x96Cluster1x2 = 28,
  // Tile widths that only CUTLASS's extended GMMA atoms cover in one
  // instruction (RLK_EXTENDED_MMA_CONFIGS below), each a one-wave tiling of
  // a common N at M 384-1024: 144 and 80 are the widths cuBLAS ran where
  // the library's tiles fell below 0.90x (held-out families' dA); 160 makes
  // 128 tiles of N=5120 at M=512, 224 of N=3584 at M=1024.
  kCooperative128x144 = 29,  // 2x1 cluster
  kCooperative128x160 = 30,  // 2x1 cluster
  kCooperative128x224 = 31,  // 2x1 cluster
  kCooperative128x80 = 32,   // 2x1 cluster
  kCooperative128x144Cluster1x2 = 33,  // odd row-tile counts (M=384)
  // 192-row tiles, B shared by both row tiles of M=384: 128 tiles of
  // N=8192 (x128) or N=6144 (x96), where 128-row tiles make three rows
  // (cuBLAS runs cooperative 192-row tiles there). Ping-pong: one
  // warpgroup, three 64-row MMAs per k16 step.
  kPingpong192x128Cluster2x1 = 34,
  kPingpong192x96Cluster2x1 = 35,
  // The same 192x128 tile cooperative, swapped (C^T = B^T A^T): each
  // warpgroup 64 weight columns x 192 rows in one 64x192 MMA.
  kSwapCooperative128x192Cluster1x2 = 36,
  kLastConfig = kSwapCooperative128x192Cluster1x2,
};

// Every config that is one kernel (all but kAuto and the split), for the
// dispatch below; cuda_ffi/build.py compiles one object per (layout, output
// dtype, config) from this enum.
#define RLK_KERNEL_CONFIGS(X)                                             \
  X(kCooperative128x256) X(kPingpong64x128) X(kPingpong64x32)            \
  X(kPingpong64x64) X(kSwapPingpong64x32) X(kCooperative256x192)         \
  X(kPingpong128x128) X(kCooperative128x128) X(kCooperative256x128)      \
  X(kCooperative128x192) X(kPingpong64x256) X(kCooperative128x256Cluster1x2) \
  X(kPingpong64x128Cluster2x1) X(kPingpong64x64Cluster2x1)              \
  X(kPingpong64x128Cluster4x2) X(kPingpong64x64Cluster1x2)              \
  X(kCooperative128x320) X(kPingpong64x320Cluster2x1)                    \
  X(kPingpong128x96Cluster2x4) X(kPingpong128x128Cluster1x2)            \
  X(kSwapCooperative256x192Cluster1x2) X(kCooperative128x96)            \
  X(kPingpong64x320) X(kCooperative128x128Cluster1x1)                   \
  X(kCooperative128x320K32) X(kCooperative128x192Cluster1x2)            \
  X(kCooperative128x96Cluster1x2) X(kPingpong192x128Cluster2x1)          \
  X(kPingpong192x96Cluster2x1) X(kSwapCooperative128x192Cluster1x2)       \
  RLK_EXTENDED_MMA_CONFIGS(X)

// The configs whose tile N takes one of CUTLASS's extended GMMA atoms
// (64 x N x 16 for an N of 8-256 other than 8, 16, 32, 64, 96, 128, 192
// and 256, which CUTLASS otherwise covers with narrower atoms, 32-wide for
// 160 and 224, 16-wide for 144, 80). cuda_ffi/build.py
// compiles their objects, and only theirs, with
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (det_gemm_kernels.cu says why).
#define RLK_EXTENDED_MMA_CONFIGS(X)                                       \
  X(kCooperative128x144) X(kCooperative128x160) X(kCooperative128x224)   \
  X(kCooperative128x80) X(kCooperative128x144Cluster1x2)

// Deterministic, from the shape and the SM count only, so JAX and torch
// callers of one problem always pick the same instantiation.
GemmConfig ChooseConfig(int64_t m, int64_t n, int64_t k, int sm_count);

// The columns kSplit256x192And128x256 gives its 256x192 kernel: a multiple
// of 192, less than n (0 when n <= 192: the 128x256 kernel takes all).
int64_t SplitColumns(int64_t m, int64_t n, int sm_count);

// Status of a launch: ok, or a message (never a silent wrong answer).
struct LaunchStatus {
  bool ok;
  const char* message;  // static storage
};

// One kernel config for one (layout, output dtype): defined in
// det_gemm_kernels.cu, which the build compiles once per combination.
template <bool kTransposeA, bool kTransposeB, bool kOutF32, GemmConfig kConfig>
LaunchStatus LaunchGemmConfig(const GemmProblem& problem,
                              size_t* workspace_needed);

template <bool kTransposeA, bool kTransposeB, bool kOutF32>
LaunchStatus LaunchGemm(const GemmProblem& problem, GemmConfig config,
                        size_t* workspace_needed) {
  switch (config) {
#define RLK_CONFIG_CASE(NAME)                                            \
  case GemmConfig::NAME:                                                 \
    return LaunchGemmConfig<kTransposeA, kTransposeB, kOutF32,           \
                            GemmConfig::NAME>(problem, workspace_needed);
    RLK_KERNEL_CONFIGS(RLK_CONFIG_CASE)
#undef RLK_CONFIG_CASE
    default:
      return {false, "unknown det_gemm config"};
  }
}

}  // namespace rlk
