// CUTLASS SM90 instantiations of the det_gemm forward, shipped or not, for
// timing against each other and cuBLAS (H100 experiment, not part of the
// library). Every variant walks K in order into one f32 accumulator, so all
// of them must give the library's bits; det_gemm_variants.py checks that
// before it times anything. One shared library per variant (they compile in
// parallel), each exporting the same C symbols, built with the library's
// nvcc flags by
//   python lab/cuda/build_det_gemm_variants.py <dir> <n,n,...>
// (n = 0..85, see Entry below), then
//   python lab/cuda/det_gemm_variants.py <dir> [n,n,...] [shapes]
#define RLK_KERNEL_TEMPLATES_ONLY
#include "../../cuda_ffi/csrc/det_gemm_kernels.cu"

namespace rlk {
namespace {

template <int kM, int kN, int kClusterM, int kClusterN, bool kPingpong,
          bool kNoSmemEpilogue = false, int kK = 64>
struct Variant {
  // kK: the K tile. The mainloop issues its k16 MMAs into one accumulator
  // in K order whatever the tile, so a wider one must keep the bits (the
  // driver checks).
  using Tile = Shape<Int<kM>, Int<kN>, Int<kK>>;
  using Cluster = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
  using Kernel = std::conditional_t<
      kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epilogue = std::conditional_t<
      kNoSmemEpilogue, cutlass::epilogue::NoSmemWarpSpecialized,
      std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                         cutlass::epilogue::TmaWarpSpecializedCooperative>>;
};

template <int kRows, int kColumns, class Base>
struct WithEpilogue : Base {
  template <class>
  using EpilogueTile = Shape<Int<kRows>, Int<kColumns>>;
};

// The mainloop of a built collective, its MMAs issued accumulator by
// accumulator: every k16 MMA of a K tile into one 64xN accumulator, then
// the next accumulator, as cuBLASLt's nvjet 320x64 issues its five 64x64
// chains (its SASS, det_gemm_refined_picks-6259b4a). CUTLASS's mainloop
// issues k16 by k16 across all accumulators. Each accumulator still takes
// its k16 MMAs in K order, so the bits cannot move. kEarlyWait: the first
// chain of a K tile is committed alone and the previous tile's MMAs are
// waited for (and its buffer released) right after it, as nvjet places
// its wait, instead of after the whole tile is issued.
template <class Built, bool kEarlyWait>
struct ChainedMainloop : Built {
  template <class Accumulators>
  CUTLASS_DEVICE void mma(typename Built::MainloopPipeline pipeline,
                          typename Built::PipelineState read,
                          Accumulators& accum, int k_tile_count,
                          int thread_idx,
                          typename Built::TensorStorage& shared_tensors,
                          typename Built::Params const&) {
    using TiledMma = typename Built::TiledMma;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Built::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Built::SmemLayoutB{});
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    auto warp_groups = make_layout(Int<kWarpGroups>{},
                                   Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group =
        __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    constexpr int kChains = size<1>(Accumulators{}) * size<2>(Accumulators{});
    // Chains [first, last) of one K tile; `zero`: the tile is the first,
    // so each chain's first k16 MMA overwrites its accumulator.
    auto issue = [&](int stage, bool zero, int first, int last) {
      CUTLASS_PRAGMA_UNROLL
      for (int chain = 0; chain < kChains; ++chain) {
        if (chain < first || chain >= last) continue;
        const int n = chain / size<1>(accum), m = chain % size<1>(accum);
        CUTLASS_PRAGMA_UNROLL
        for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
          tiled_mma.accumulate_ = zero && k_block == 0 ? GMMA::ScaleOut::Zero
                                                       : GMMA::ScaleOut::One;
          cute::gemm(tiled_mma, tCrA(_, m, k_block, stage),
                     tCrB(_, n, k_block, stage), accum(_, m, n));
        }
      }
    };
    static_assert(Built::K_PIPE_MMAS == 1);
    auto release = read;
    cute::warpgroup_fence_operand(accum);
    pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
    cute::warpgroup_arrive();
    issue(read.index(), true, 0, kChains);
    cute::warpgroup_commit_batch();
    ++read;
    cute::warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (--k_tile_count; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
      cute::warpgroup_fence_operand(accum);
      cute::warpgroup_arrive();
      if constexpr (kEarlyWait) {
        issue(read.index(), false, 0, 1);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<1>();
        cute::warpgroup_fence_operand(accum);
        pipeline.consumer_release(release);
        cute::warpgroup_arrive();
        issue(read.index(), false, 1, kChains);
        cute::warpgroup_commit_batch();
      } else {
        issue(read.index(), false, 0, kChains);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<1>();
        cute::warpgroup_fence_operand(accum);
        pipeline.consumer_release(release);
      }
      ++read;
      ++release;
    }
    cute::warpgroup_fence_operand(accum);
  }
};

template <class Config, class = void>
struct ChainedOf {
  static constexpr int value = 0;  // CUTLASS's own mainloop
};
template <class Config>
struct ChainedOf<Config, std::void_t<decltype(Config::kChained)>> {
  static constexpr int value = Config::kChained;
};

// The library's Gemm, or the same with ChainedMainloop (kChained 1: wait
// after the whole tile, 2: nvjet's early wait).
template <bool kTransposeB, class Config, int kChained = ChainedOf<Config>::value>
struct VariantGemm : Gemm<false, kTransposeB, false, Config> {
  using Base = Gemm<false, kTransposeB, false, Config>;
  using Mainloop = ChainedMainloop<typename Base::Mainloop, kChained == 2>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      Shape<int, int, int, int>, Mainloop, typename Base::Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
template <bool kTransposeB, class Config>
struct VariantGemm<kTransposeB, Config, 0>
    : Gemm<false, kTransposeB, false, Config> {};

template <int kChainedMode, class Base>
struct Chained : Base {
  static constexpr int kChained = kChainedMode;
};

// Variant n: its name, whether B is stored [N, K] (the dA layout) instead of
// [K, N], and its config. Only the one compiled (RLK_VARIANT) instantiates
// a kernel.
template <int n>
struct Entry;
#pragma nv_diag_suppress 177  // the entries not compiled go unreferenced
#define RLK_ENTRY(n, name, transpose_b, ...)                 \
  template <>                                                \
  struct Entry<n> {                                          \
    static constexpr const char* kName = name;               \
    static constexpr bool kTransposeB = transpose_b;         \
    using Config = __VA_ARGS__;                              \
  };
// The shipped config's epilogue was 128x32 until 2026-11-22, 128x128 since
// (as variant 24).
RLK_ENTRY(0, "coop128x256_c2x1 (shipped)", false, Cooperative128x256)
RLK_ENTRY(1, "coop128x256_c1x2", false, Variant<128, 256, 1, 2, false>)
RLK_ENTRY(2, "coop128x256_c1x1", false, Variant<128, 256, 1, 1, false>)
RLK_ENTRY(3, "coop256x128_c1x2", false, Variant<256, 128, 1, 2, false>)
RLK_ENTRY(4, "coop256x128_c2x1", false, Variant<256, 128, 2, 1, false>)
RLK_ENTRY(5, "pp128x128_c1x2", false, Variant<128, 128, 1, 2, true>)
RLK_ENTRY(6, "pp128x128_c2x1", false, Variant<128, 128, 2, 1, true>)
RLK_ENTRY(7, "pp128x128_c1x1", false, Variant<128, 128, 1, 1, true>)
RLK_ENTRY(8, "coop128x256_c2x1_nosmem_epi", false,
          Variant<128, 256, 2, 1, false, true>)
RLK_ENTRY(9, "coop128x256_c2x1 B[N,K]", true, Cooperative128x256)
RLK_ENTRY(10, "coop128x128_c2x1", false, Variant<128, 128, 2, 1, false>)
RLK_ENTRY(11, "pp64x256_c1x2", false, Variant<64, 256, 1, 2, true>)
RLK_ENTRY(12, "coop128x256_c2x2", false, Variant<128, 256, 2, 2, false>)
RLK_ENTRY(13, "coop256x128_c2x2", false, Variant<256, 128, 2, 2, false>)
RLK_ENTRY(14, "coop128x256_c4x1", false, Variant<128, 256, 4, 1, false>)
RLK_ENTRY(15, "coop256x128_c1x4", false, Variant<256, 128, 1, 4, false>)
RLK_ENTRY(16, "coop128x256_c2x1_epi128x64", false,
          WithEpilogue<128, 64, Cooperative128x256>)
RLK_ENTRY(17, "pp64x32 (shipped decode)", false, Pingpong64x32)
RLK_ENTRY(18, "pp64x32_k128", false, Variant<64, 32, 1, 1, true, false, 128>)
RLK_ENTRY(19, "pp64x16", false, Variant<64, 16, 1, 1, true>)
RLK_ENTRY(20, "pp64x64", false, Variant<64, 64, 1, 1, true>)
RLK_ENTRY(21, "pp64x128 (shipped small M)", false, Pingpong64x128)
RLK_ENTRY(22, "pp64x64_k128", false, Variant<64, 64, 1, 1, true, false, 128>)
RLK_ENTRY(23, "pp64x16_k128", false, Variant<64, 16, 1, 1, true, false, 128>)
RLK_ENTRY(24, "coop128x256_c2x1_epi128x128", false,
          WithEpilogue<128, 128, Cooperative128x256>)
RLK_ENTRY(25, "coop256x128_c1x2_epi128x64", false,
          WithEpilogue<128, 64, Variant<256, 128, 1, 2, false>>)
RLK_ENTRY(26, "coop128x256_c1x2_epi128x64", false,
          WithEpilogue<128, 64, Variant<128, 256, 1, 2, false>>)
RLK_ENTRY(27, "swap pp64x16", false, Swapped<Variant<64, 16, 1, 1, true>>)
RLK_ENTRY(28, "swap pp64x8", false, Swapped<Variant<64, 8, 1, 1, true>>)
RLK_ENTRY(29, "swap pp64x32", false, Swapped<Variant<64, 32, 1, 1, true>>)
RLK_ENTRY(30, "swap pp64x64", false, Swapped<Variant<64, 64, 1, 1, true>>)
RLK_ENTRY(31, "swap coop128x16", false,
          Swapped<Variant<128, 16, 1, 1, false>>)
RLK_ENTRY(32, "swap pp64x16_c2x1", false,
          Swapped<Variant<64, 16, 2, 1, true>>)
// 256x192: each consumer warpgroup holds 128x192 (192 f32 registers), and
// with A shared across a 1x2 cluster a CTA reads 0.81 bytes from L2 per
// output per K tile (128x256 2x1: 0.98; cuBLAS's 320x128 1x2: 0.88).
RLK_ENTRY(33, "coop256x192_c1x2", false, Variant<256, 192, 1, 2, false>)
RLK_ENTRY(34, "coop256x192_c2x1 (shipped for some N)", false, Cooperative256x192)
// Narrower 256-row tiles: 160 columns cut gate_up (N=28672) into 180 tiles
// a row (21.8 waves of 132 against 27.2 for 128x256), 176 into 163.
RLK_ENTRY(35, "coop256x160_c1x2", false, Variant<256, 160, 1, 2, false>)
RLK_ENTRY(36, "coop256x160_c2x1", false, Variant<256, 160, 2, 1, false>)
RLK_ENTRY(37, "coop256x176_c2x1", false, Variant<256, 176, 2, 1, false>)
// cuBLAS's nvjet tiles where rlk fell below 0.90x (H100, det_gemm_graph_tuner
// 9cd4f50), in rlk's M x N (cuBLAS names the weight's columns first): 320
// weight columns per CTA (5 x n64 MMAs per warpgroup; the TMA box splits
// 320 rows into 8 x 40), and 96- and 160-wide tiles in large clusters.
RLK_ENTRY(38, "coop128x320_c2x1", false, Variant<128, 320, 2, 1, false>)
RLK_ENTRY(39, "coop128x320_c1x1", false, Variant<128, 320, 1, 1, false>)
RLK_ENTRY(40, "coop128x320_c4x1", false, Variant<128, 320, 4, 1, false>)
RLK_ENTRY(41, "pp64x320_c2x1", false, Variant<64, 320, 2, 1, true>)
RLK_ENTRY(42, "pp64x320_c4x1", false, Variant<64, 320, 4, 1, true>)
RLK_ENTRY(43, "pp128x96_c2x4", false, Variant<128, 96, 2, 4, true>)
RLK_ENTRY(44, "pp128x96_c1x2", false, Variant<128, 96, 1, 2, true>)
RLK_ENTRY(45, "pp64x160_c4x2", false, Variant<64, 160, 4, 2, true>)
RLK_ENTRY(46, "pp64x160_c2x1", false, Variant<64, 160, 2, 1, true>)
RLK_ENTRY(47, "pp64x96_c2x4", false, Variant<64, 96, 2, 4, true>)
RLK_ENTRY(48, "coop128x96_c2x4", false, Variant<128, 96, 2, 4, false>)
RLK_ENTRY(49, "coop128x320_c2x1 B[N,K]", true, Variant<128, 320, 2, 1, false>)
// A shared too (2x2), and a 128x64 epilogue subtile (320 = 5 x 64).
RLK_ENTRY(50, "coop128x320_c2x2", false, Variant<128, 320, 2, 2, false>)
RLK_ENTRY(51, "coop128x320_c2x1_epi128x64", false,
          WithEpilogue<128, 64, Variant<128, 320, 2, 1, false>>)
RLK_ENTRY(52, "pp64x320_c2x2", false, Variant<64, 320, 2, 2, true>)
// cuBLASLt's coopA tiles (nvjet 256x128 1x2 coopA, from M=256 up: 256
// weight columns, each warpgroup 128 of them) in its orientation, C^T =
// B^T A^T: the cluster's first mode runs along our N. (Its coopB tiles
// split our rows between the warpgroups: 320x128 is cooperative_128x320,
// but 192x192 gives each 96 rows, not a whole number of 64-row MMAs; the
// swapped form would need CUTLASS's cooperative builder to split its N,
// which it does not, and its cooperative epilogue needs 128-row subtiles,
// which 192 rows do not divide.)
RLK_ENTRY(53, "swap coop256x128_c1x2", false,
          Swapped<Variant<256, 128, 1, 2, false>>)
RLK_ENTRY(54, "swap coop256x128_c2x1", false,
          Swapped<Variant<256, 128, 2, 1, false>>)
RLK_ENTRY(55, "swap coop256x192_c1x2", false,
          Swapped<Variant<256, 192, 1, 2, false>>)
// cuBLASLt's kernels on the M=512 products that stayed at 0.87-0.93x
// (H100, det_gemm_tuner_fidelity-a13bde9): nvjet 320x64 1x2 (nemo's down
// and o), its 96x128 2x1 (llama3.2-3b's down, N=3072). Swapped, the
// weight's 320 columns are five whole 64-row MMAs over 128-byte swizzle
// atoms (rlk's 64x320 was then thought to use two n160 MMAs, each starting
// or ending mid-atom; it uses five n64 ones too, see entry 74); 64x192 and
// 192x64 give N=3072 its 128 tiles.
RLK_ENTRY(56, "swap pp320x64_c1x2", false,
          Swapped<Variant<320, 64, 1, 2, true>>)
RLK_ENTRY(57, "swap pp320x64_c1x1", false,
          Swapped<Variant<320, 64, 1, 1, true>>)
RLK_ENTRY(58, "pp64x192_c2x1", false, Variant<64, 192, 2, 1, true>)
RLK_ENTRY(59, "swap pp192x64_c1x2", false,
          Swapped<Variant<192, 64, 1, 2, true>>)
RLK_ENTRY(60, "swap pp256x64_c1x2", false,
          Swapped<Variant<256, 64, 1, 2, true>>)
RLK_ENTRY(61, "coop128x192_c2x1 (shipped for some N)", false, Cooperative128x192)
RLK_ENTRY(62, "swap pp320x128_c1x2", false,
          Swapped<Variant<320, 128, 1, 2, true>>)
// nvjet's 320x64 runs 384 threads, read at first as both consumer
// warpgroups on one tile, 160 weight columns each (Nsight Compute's
// occupancy, H100). Its SASS later showed one warpgroup on the whole tile,
// as CUTLASS's ping-pong 64x320 (det_gemm_refined_picks-6259b4a). The
// work per warpgroup of that reading with M split: 128x160 tiles, 64x160
// per warpgroup, 128 tiles at M=512, N=5120 (one wave of 132); 128x96 for
// N=3072.
RLK_ENTRY(63, "coop128x160_c2x1", false, Variant<128, 160, 2, 1, false>)
RLK_ENTRY(64, "coop128x160_c1x2", false, Variant<128, 160, 1, 2, false>)
RLK_ENTRY(65, "coop128x160_c2x1 B[N,K]", true, Variant<128, 160, 2, 1, false>)
RLK_ENTRY(66, "coop128x96_c2x1", false, Variant<128, 96, 2, 1, false>)
RLK_ENTRY(67, "coop128x96_c1x2", false, Variant<128, 96, 1, 2, false>)
RLK_ENTRY(68, "coop128x160_c1x1", false, Variant<128, 160, 1, 1, false>)
// 69-72: a column-split kernel of rlk's own over CUTLASS's collectives
// (two consumer warpgroups side by side in N: 64x320, 64x256, 64x384),
// left out: 0.55-0.67x cuBLAS (benchmarks/results/experiments/
// h100-2026-11-24/README.md; its code is in commit 9e6664c).
RLK_ENTRY(73, "coop128x96 (library)", false, Cooperative128x96)
// The nvjet issue order (ChainedMainloop) on the 320-wide tiles, whose
// warpgroups hold five 64x64 accumulators each (CUTLASS's builder takes
// n64 MMAs for N=320: n160 is an extended shape, off by default).
RLK_ENTRY(74, "pp64x320_c2x1 chained", false,
          Chained<1, Pingpong64x320Cluster2x1>)
RLK_ENTRY(75, "pp64x320_c2x1 chained early wait", false,
          Chained<2, Pingpong64x320Cluster2x1>)
RLK_ENTRY(76, "coop128x320_c2x1 chained", false,
          Chained<1, Cooperative128x320>)
RLK_ENTRY(77, "coop128x320_c2x1 chained early wait", false,
          Chained<2, Cooperative128x320>)
RLK_ENTRY(78, "pp64x320_c2x1 (library)", false, Pingpong64x320Cluster2x1)
// A 32-deep K tile: half the bytes per pipeline stage, so about twice as
// many stages, and a buffer handed back to the producer after half the
// MMAs. The k16 MMAs
// still run in K order into one accumulator.
RLK_ENTRY(79, "pp64x320_c2x1_k32", false, Variant<64, 320, 2, 1, true, false, 32>)
RLK_ENTRY(80, "coop128x192_c2x1_k32", false,
          Variant<128, 192, 2, 1, false, false, 32>)
RLK_ENTRY(81, "coop128x320_c2x1_k32", false,
          Variant<128, 320, 2, 1, false, false, 32>)
RLK_ENTRY(82, "pp64x320_c1x1", false, Variant<64, 320, 1, 1, true>)
// No cluster on the one-wave M=512 products (pp64x320_c1x1 ran nemo's
// down 7-13% and its o 2-6% faster than the 2x1 pair).
RLK_ENTRY(83, "coop128x192_c1x1", false, Variant<128, 192, 1, 1, false>)
RLK_ENTRY(84, "coop128x128_c1x1", false, Variant<128, 128, 1, 1, false>)
RLK_ENTRY(85, "coop128x96_c1x1", false, Variant<128, 96, 1, 1, false>)
#undef RLK_ENTRY

using Chosen = Entry<RLK_VARIANT>;

}  // namespace
}  // namespace rlk

extern "C" const char* rlk_variant_name() { return rlk::Chosen::kName; }

extern "C" int rlk_variant_transpose_b() {
  return rlk::Chosen::kTransposeB ? 1 : 0;
}

// Programmatic dependent launch on (1, the library's way) or off (0) for
// the calls that follow, to time what it gains.
static bool launch_with_pdl = true;
extern "C" void rlk_variant_set_pdl(int on) { launch_with_pdl = on != 0; }

// Returns 0, or -1 with the reason in *message. c == nullptr: a workspace
// query only. swizzle, raster: GemmProblem's tile order (0, 0: CUTLASS's).
extern "C" int rlk_variant_run(const void* a, const void* b, void* c,
                               int64_t m, int64_t n, int64_t k, int sm_count,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, int swizzle, int raster,
                               size_t* workspace_needed,
                               const char** message) {
  rlk::GemmProblem p{a, b, c, m, n, k, sm_count, workspace, workspace_bytes,
                     stream, swizzle, raster, launch_with_pdl};
  rlk::LaunchStatus s =
      rlk::Run<rlk::VariantGemm<rlk::Chosen::kTransposeB,
                                rlk::Chosen::Config>>(p, workspace_needed);
  if (!s.ok) {
    *message = s.message;
    return -1;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    *message = cudaGetErrorString(e);
    return -1;
  }
  return 0;
}
