// CUTLASS 3.x SM90 TMA warp-specialized GEMMs: one kernel config for one
// (layout, out dtype) variant, chosen at compile time with -DRLK_TA, -DRLK_TB,
// -DRLK_OUT_F32 and -DRLK_CONFIG (a GemmConfig code): the build compiles this
// file once per combination, in parallel.
#include "det_gemm_sm90.h"

#include <atomic>
#include <cstdint>

// CUTLASS's SM90 kernels wait on the previous grid (griddepcontrol.wait)
// before their first global access only when this is defined; a kernel
// launched with programmatic dependent launch (GemmProblem::pdl) must
// have it, or it could read its inputs before their producer finished.
#define CUTLASS_ENABLE_GDC_FOR_SM90 1

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

// Run() launches with programmatic dependent launch: the device code must
// wait on the previous grid, which CUTLASS compiles in only when the define
// above came before its headers and the target is sm_90a.
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "CUTLASS_GDC_ENABLED is off: these kernels would not wait for their inputs"
#endif

// RLK_KERNEL_TEMPLATES_ONLY: the experiment harnesses under
// benchmarks/cuda include this file for its templates and instantiate their
// own variants.
#if !defined(RLK_TA) && !defined(RLK_KERNEL_TEMPLATES_ONLY)
#error "compile with -DRLK_TA=0|1 -DRLK_TB=0|1 -DRLK_OUT_F32=0|1 -DRLK_CONFIG=n"
#endif

namespace rlk {
namespace {

using namespace cute;

// The two warp-specialized schedules: cooperative (both consumer
// warpgroups on one tile) and ping-pong (each on its own tile, alternating
// mainloop and epilogue).
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

// A config: kM x kN output tiles, a cluster, a schedule and the K tile
// (how deep one pipeline stage is). Whatever the K tile, the mainloop issues
// the k16 MMAs of each accumulator in K order, so every config gives the
// same bits (device-tested).
template <int kM, int kN, int kClusterM, int kClusterN, class Schedule,
          int kK = 64>
struct Tiles : Schedule {
  using Tile = Shape<Int<kM>, Int<kN>, Int<kK>>;
  using Cluster = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
};

// Epilogue subtiles of 128 rows x 256 bytes (128 bf16 or 64 f32 columns)
// instead of CUTLASS's 128x32: a quarter (f32: half) of the store rounds
// between the mainloops of two tiles, for one mainloop stage fewer (3 of 48
// KB, not 4). The tensor cores idle through a cooperative epilogue; on the
// H100 this ran the five M=4096 projections 0.3-2.5% faster in interleaved
// rounds (benchmarks/cuda/det_gemm_variants.py; 128x64 gained about half).
template <class ElementD>
using WideEpilogueTile = Shape<_128, Int<256 / sizeof(ElementD)>>;

// 2x1 cluster: the large-M projections.
struct Cooperative128x256 : Tiles<128, 256, 2, 1, Cooperative> {
  template <class ElementD>
  using EpilogueTile = WideEpilogueTile<ElementD>;
};

// Large products whose N splits into whole 192-column tiles, and the first
// column block of a kSplit256x192And128x256 product. Each consumer
// warpgroup holds a 128x192 accumulator (192 f32 registers; ptxas spills
// none), and with B shared across the 2x1 cluster a CTA reads 0.90 bytes
// from L2 per output per K tile against 0.98 for 128x256. On the H100, in
// interleaved rounds against cuBLAS on two machines, it ran qkv
// (4096x4096x6144) 2.2% and 4.1% faster than 128x256, lm_head (N=128256)
// 2.9% and 2.0% faster (benchmarks/cuda/det_gemm_variants.py, variant 34).
// CUTLASS's default epilogue subtile: 128x256 bytes of subtile would leave
// two mainloop stages of 56 KB, not three.
using Cooperative256x192 = Tiles<256, 192, 2, 1, Cooperative>;

// Small M: narrow tiles, more of them; decode with few output columns:
// enough tiles to keep several SMs streaming the weight.
using Pingpong64x128 = Tiles<64, 128, 1, 1, Pingpong>;
using Pingpong64x64 = Tiles<64, 64, 1, 1, Pingpong>;
using Pingpong64x32 = Tiles<64, 32, 1, 1, Pingpong>;

// A config that computes C^T = B^T A^T (SwapABOf below): its tile's M
// runs along our N.
template <class Config>
struct Swapped : Config {
  static constexpr bool kSwapAB = true;
};

// Decode rows, swapped: 64 columns of C fill the MMA's 64 rows and up to
// 32 rows of A its N side, so a row of A costs 32 of MMA width instead of
// 64 rows, and the weight streams through twice as many CTAs as 64x128
// tiles would give.
using SwapPingpong64x32 = Swapped<Tiles<64, 32, 1, 1, Pingpong>>;

// The wider set the autotuner chooses from (rlk_jax/_gemm_tuning.py): the
// H100 sweep of open models' projections showed M=1024 products at
// 0.38-0.81x cuBLAS with the configs above alone, where a 128-row tile
// fills one wave that 64x128 needs many thin ones for.
using Pingpong128x128 = Tiles<128, 128, 1, 1, Pingpong>;
using Cooperative128x128 = Tiles<128, 128, 2, 1, Cooperative>;
using Cooperative256x128 = Tiles<256, 128, 2, 1, Cooperative>;  // narrow N
using Cooperative128x192 = Tiles<128, 192, 2, 1, Cooperative>;
using Pingpong64x256 = Tiles<64, 256, 1, 1, Pingpong>;  // a few hundred rows
// The 1x2 cluster multicasts A's tile to two CTAs side by side in N: for
// few row tiles and many column tiles, where the 2x1 cluster would pair a
// real row tile with padding.
struct Cooperative128x256Cluster1x2 : Tiles<128, 256, 1, 2, Cooperative> {
  template <class ElementD>
  using EpilogueTile = WideEpilogueTile<ElementD>;
};

// 64-row tiles in 2x1 clusters: each weight tile is read from L2 once for
// two row tiles (TMA multicast). At M=256-1024 with a long K the 64-row
// tiles give enough CTAs but read the weight M/64 times; cuBLASLt's
// non-split kernels there (nvjet 64xN tiles in clusters) ran with rlk's
// bits at up to 1.5x rlk's speed (H100, det_gemm_sweep_recipe-d9c2514).
using Pingpong64x128Cluster2x1 = Tiles<64, 128, 2, 1, Pingpong>;
using Pingpong64x64Cluster2x1 = Tiles<64, 64, 2, 1, Pingpong>;
// The shapes cuBLASLt's non-split kernels took where the 2x1 pairs did not
// close the gap (H100, det_gemm_sweep 0cba778, kernel names in its rows):
// M=256 with a long K and N ~ 4k (gemma2/llama down and o: nvjet 64x128
// tiles in 4x2 clusters, our M x N, so the weight tile is read once for all
// four row tiles of M=256), and the MoE expert's short K=768 (64x64 tiles
// in 1x2 clusters).
using Pingpong64x128Cluster4x2 = Tiles<64, 128, 4, 2, Pingpong>;
using Pingpong64x64Cluster1x2 = Tiles<64, 64, 1, 2, Pingpong>;
// cuBLASLt's nvjet tiles on the products still below 0.90x cuBLAS with the
// configs above (H100, det_gemm_graph_tuner-9cd4f50), in our M x N:
// 320 weight columns per CTA where N is a multiple of 320 or close to one
// (N = 5120 and 10240 are 16 and 32 of them, where 256x192 leaves a third
// of a tile at the edge, and at M=1024, N=5120 the 128 tiles of 128x320
// fill one wave of 132 CTAs where 128x256's 160 take 1.2). CUTLASS
// builds the tile from five 64x64 MMAs per warpgroup (n160 is one of the
// extended MMA shapes, off by default), each output still one f32 sum in
// K order, and loads B's 320 columns as a 3-D TMA box (a box is at most
// 256 wide). The 96-column tiles in 2x4 clusters are its
// M=256 kernel for a long K with N ~ 5120: each weight tile is read once
// for both row tiles and each A tile once for four column tiles. The
// variant probe (benchmarks/cuda/det_gemm_variants.py, entries 38-52) ran
// each 1.05-1.3x faster than the best older config it ran on the products
// named (0.99-1.10x on 2048x2048x5120, where 128x128 in a 1x2 cluster won).
using Cooperative128x320 = Tiles<128, 320, 2, 1, Cooperative>;
using Pingpong64x320Cluster2x1 = Tiles<64, 320, 2, 1, Pingpong>;
using Pingpong128x96Cluster2x4 = Tiles<128, 96, 2, 4, Pingpong>;
using Pingpong128x128Cluster1x2 = Tiles<128, 128, 1, 2, Pingpong>;
// cuBLASLt's 256x128 coopA tiles (its M is our N) split the weight's 256
// columns between the two warpgroups. Swapped (SwapABOf), CUTLASS's
// cooperative split of its M does the same: 256 weight columns, 128 per
// warpgroup, by 192 rows (as its 192x192 tiles at M=16384 have), the
// weight tile shared by the 1x2 cluster's two row tiles. The variant probe
// (entry 55) ran it at 0.94-1.06x cuBLAS on nine products at M
// 4096-16384, the fastest config it ran on five (1.15x the best older one
// on 16384x3072x16384).
using SwapCooperative256x192Cluster1x2 =
    Swapped<Tiles<256, 192, 1, 2, Cooperative>>;

// 128x96, each warpgroup 64 rows: at M=512 the 128 tiles of N=3072 fill
// one wave of 132 SMs where 128x128's 96 leave a quarter idle and 64-row
// ping-pong tiles run one warpgroup each. Timed the sweep's way (H100,
// benchmarks/results/experiments/h100-2026-11-24): llama3.2-3b down
// (512x8192x3072) 1.06-1.13x cuBLAS where 128x128 ran 0.90x, qwen3-1.7b
// down (N=2048) 0.91-0.99x against at most 0.80x, llama3.1-8b down at
// M=256 (N=4096) 1.00x. Its B tile is 96 wide, a 64-byte swizzle.
using Cooperative128x96 = Tiles<128, 96, 2, 1, Cooperative>;

// No cluster, for products of one wave with a long K at M=512. In a 2x1
// cluster both CTAs read each B tile from one multicast load, so a stage
// is refilled only when both are done with it (the likely cost; not
// profiled). Timed the sweep's way (H100, interleaved rounds,
// benchmarks/results/experiments/h100-2026-11-24): 64x320 ran
// mistral-nemo-12b's down (512x14336x5120) 7-13% faster than the 2x1 pair
// and its o 2-6% (two machines); 128x128 ran llama3.1-8b's down
// (512x14336x4096) 6-7% faster (one machine).
using Pingpong64x320 = Tiles<64, 320, 1, 1, Pingpong>;
using Cooperative128x128Cluster1x1 = Tiles<128, 128, 1, 1, Cooperative>;
// 128x320 in 32-deep K tiles: a 64-deep stage of this tile is 56 KB, so
// only three fit beside the epilogue; at 28 KB more fit, which likely keeps
// TMA loads further ahead of the MMAs (not profiled). 2-8% faster than
// 64-deep on 512x8192x10240 and 1024 x 4096-14336 x 5120 (same probe, one
// machine); 64x320 ping-pong, with four stages already, and 128x192 lost
// up to 18% the same way.
using Cooperative128x320K32 = Tiles<128, 320, 2, 1, Cooperative, 32>;
// 128x192 and 128x96 with A multicast along N instead of B along M. A 2x1
// cluster pairs row tiles, so an odd count of them gets a row of idle
// CTAs: at M=384 three row tiles of 128x192 take four rows, 152 CTAs for
// 114 tiles at N=7168, two waves on 132 SMs. On model families no table
// was built from, as a user's first step (H100, det_gemm_held_out-90118d9),
// the 12 products whose tuning took one of these ran 0.885x cuBLAS where
// they had run 0.806x: qwen2.5-14b and phi3-medium qkv at M=384 (128x256
// tiles before) 0.74-0.76x -> 0.95x.
using Cooperative128x192Cluster1x2 = Tiles<128, 192, 1, 2, Cooperative>;
using Cooperative128x96Cluster1x2 = Tiles<128, 96, 1, 2, Cooperative>;
// Widths of one extended GMMA atom (RLK_EXTENDED_MMA_CONFIGS): each makes
// about one wave of 128-row tiles of a common N at M 384-1024, where the
// widths above leave a partial wave or a quarter of the SMs idle.
using Cooperative128x144 = Tiles<128, 144, 2, 1, Cooperative>;
using Cooperative128x160 = Tiles<128, 160, 2, 1, Cooperative>;
using Cooperative128x224 = Tiles<128, 224, 2, 1, Cooperative>;
using Cooperative128x80 = Tiles<128, 80, 2, 1, Cooperative>;
using Cooperative128x144Cluster1x2 = Tiles<128, 144, 1, 2, Cooperative>;
// 192-row tiles for M=384, where 128-row tiles make three rows of tiles and
// cuBLAS runs cooperative 192-row ones (nvjet 128x192 coopB, its M our N).
// CUTLASS's cooperative kernel splits our rows between its two warpgroups
// in 64-row atoms, which 192 rows are not two of. Two ways round it:
// - ping-pong, one warpgroup issuing three 64-row MMAs per k16 step; 1.5 x
//   N accumulator registers per thread (192 at N=128, as
//   Cooperative256x192's warpgroups hold); at 128 tiles on 132 SMs each CTA
//   has one tile, so its second warpgroup idles;
// - swapped (C^T = B^T A^T), cooperative: each warpgroup takes 64 weight
//   columns x 192 rows in one 64x192 MMA, both on the same tile.
// Each output element is still one accumulator, K in order. The clusters
// pair the two row tiles of M=384, sharing the weight tile.
using Pingpong192x128Cluster2x1 = Tiles<192, 128, 2, 1, Pingpong>;
using Pingpong192x96Cluster2x1 = Tiles<192, 96, 2, 1, Pingpong>;
using SwapCooperative128x192Cluster1x2 =
    Swapped<Tiles<128, 192, 1, 2, Cooperative>>;

// A config may name its epilogue subtile per output type
// (EpilogueTile<ElementD>); CUTLASS picks one otherwise. The epilogue only
// rounds and stores: it never moves a bit.
template <class Config, class ElementD, class = void>
struct EpilogueTileOf {
  using type = cutlass::epilogue::collective::EpilogueTileAuto;
};
template <class Config, class ElementD>
struct EpilogueTileOf<
    Config, ElementD,
    std::void_t<typename Config::template EpilogueTile<ElementD>>> {
  using type = typename Config::template EpilogueTile<ElementD>;
};

// A config computes C^T = B^T A^T instead of C = A B when it says
// kSwapAB (decode rows: the weight's N fills the 64-row MMA atom and the
// few rows of A its narrow N side, where C = A B would pad M to 64). Each
// output element is still one f32 sum of the same products, K in order, in
// the same k16 MMA groups, so the bits do not move (device-tested per
// config).
template <class Config, class = void>
struct SwapABOf : std::false_type {};
template <class Config>
struct SwapABOf<Config, std::void_t<decltype(Config::kSwapAB)>>
    : std::bool_constant<Config::kSwapAB> {};

// CUTLASS covers a tile N with the widest of its standard GMMA atoms that
// divides it (N = 160: five 32-wide MMAs per k16 step, each reading the
// A tile from shared memory again) unless CUTE_SM90_EXTENDED_MMA_SHAPES_
// ENABLED lets one atom be the whole N. The build defines it for the
// objects of RLK_EXTENDED_MMA_CONFIGS only: in every other config it would
// change the atoms (a 320-wide tile: two 160-wide instead of five 64-wide),
// so the kernels the tuned tables were measured on. Atoms of any width
// issue the same k16 products in K order into each output element's
// accumulator: the bits do not move (device-tested per config).
constexpr bool StandardGmmaWidth(int n) {
  return n == 8 || n == 16 || n == 32 || n == 64 || n == 96 || n == 128 ||
         n == 192 || n == 256;
}
template <class Config>
constexpr bool CompiledWithItsAtoms() {
  constexpr int n = cute::size<1>(typename Config::Tile{});
#if defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
  return n <= 256 && !StandardGmmaWidth(n);
#else
  return n > 256 || StandardGmmaWidth(n);
#endif
}

// Row-major storage in our terms, as CUTLASS layout tags: A [M, K] is
// K-major (RowMajor), A stored [K, M] is M-major (ColumnMajor); CUTLASS reads
// B as K x N, so B [K, N] is RowMajor and B stored [N, K] is ColumnMajor.
// Swapped, CUTLASS's A is our B^T ([N, K]: K-major when B is stored [N, K])
// and its B is our A^T ([K, M]: K-major when A is stored [M, K]); its D is
// C^T, so our row-major C is a column-major D.
template <bool kTransposeA, bool kTransposeB, bool kOutF32, class Config>
struct Gemm {
  static_assert(CompiledWithItsAtoms<Config>(),
                "a config of an extended GMMA width is compiled with "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, every other without "
                "(RLK_EXTENDED_MMA_CONFIGS in det_gemm_sm90.h)");
  static constexpr bool kSwapAB = SwapABOf<Config>::value;
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = std::conditional_t<kOutF32, float, cutlass::bfloat16_t>;
  using LayoutA = std::conditional_t<
      kSwapAB ? !kTransposeB : kTransposeA, cutlass::layout::ColumnMajor,
      cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<
      kSwapAB ? !kTransposeA : kTransposeB, cutlass::layout::ColumnMajor,
      cutlass::layout::RowMajor>;
  using LayoutD = std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 8;  // 16-byte TMA rows of bf16
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  // D = 1 * acc (no C operand): the f32 accumulator is rounded once, to
  // nearest even, exactly as the Pallas kernel's astype does.
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, typename EpilogueTileOf<Config, ElementD>::type,
      float, float, void, LayoutD, kAlignD, ElementD, LayoutD, kAlignD,
      typename Config::Epilogue>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA,
      kAlignAB, ElementB, LayoutB, kAlignAB, float, typename Config::Tile,
      typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;

  // The default tile scheduler of these kernels is the persistent one: each
  // output tile is computed whole by one CTA (no split-K, no stream-K).
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,
                                                      Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Gives a packed CuTe stride of a 2-D operand the row pitch of a larger
// matrix: the pitch is whichever of the first two modes is not the static 1.
template <class Stride>
void SetPitch(Stride& stride, int64_t pitch) {
  if (pitch == 0) return;  // packed
  using First = cute::remove_cvref_t<decltype(cute::get<0>(stride))>;
  if constexpr (cute::is_static<First>::value) {
    cute::get<1>(stride) = pitch;
  } else {
    cute::get<0>(stride) = pitch;
  }
}

template <class G>
LaunchStatus Run(const GemmProblem& p, size_t* workspace_needed) {
  using Device = typename G::Device;
  using Kernel = typename G::Kernel;
  // CUTLASS's problem: ours, or its transpose (G::kSwapAB).
  const int m = static_cast<int>(G::kSwapAB ? p.n : p.m),
            n = static_cast<int>(G::kSwapAB ? p.m : p.n),
            k = static_cast<int>(p.k);
  const void* operand_a = G::kSwapAB ? p.b : p.a;
  const void* operand_b = G::kSwapAB ? p.a : p.b;
  auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{},
                                                   cute::make_shape(m, k, 1));
  auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{},
                                                   cute::make_shape(n, k, 1));
  auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{},
                                                   cute::make_shape(m, n, 1));
  // Our B is CUTLASS's A when swapped; our C is its D either way.
  if constexpr (G::kSwapAB) {
    SetPitch(stride_a, p.b_pitch);
  } else {
    SetPitch(stride_b, p.b_pitch);
  }
  SetPitch(stride_d, p.c_pitch);
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = p.sm_count;
  typename Device::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const typename G::ElementA*>(operand_a), stride_a,
       static_cast<const typename G::ElementB*>(operand_b), stride_b},
      // alpha and beta as values: the epilogue would read pointers to them
      // before the mainloop's griddepcontrol.wait.
      {{1.0f, 0.0f},
       nullptr,
       typename Kernel::StrideC{},
       static_cast<typename G::ElementD*>(p.c),
       stride_d},
      hw};
  using RasterOrder = decltype(args.scheduler.raster_order);
  if (p.swizzle != 0) args.scheduler.max_swizzle_size = p.swizzle;
  args.scheduler.raster_order =
      p.raster == 1   ? RasterOrder::AlongM
      : p.raster == 2 ? RasterOrder::AlongN
                      : RasterOrder::Heuristic;
  Device gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return {false, "CUTLASS cannot implement this problem (row strides must "
                   "be multiples of 16 bytes)"};
  }
  const size_t needed = Device::get_workspace_size(args);
  if (workspace_needed != nullptr) *workspace_needed = needed;
  if (p.c == nullptr) return {true, nullptr};  // a workspace query only
  if (needed > p.workspace_bytes) {
    return {false, "the CUTLASS kernel needs more workspace than was given"};
  }
  // initialize() also sets the kernel's dynamic shared-memory attribute,
  // a driver call (about 2-5 us of host time) on every launch; the attribute
  // lasts per device, so after the first launch on a device a launch that
  // needs no workspace only rebuilds the params (update(): the TMA
  // descriptors of these operands). A launch that needs a workspace still
  // initializes it every time.
  static std::atomic<uint64_t> attribute_set_on{0};  // one bit per device
  const uint64_t bit = hw.device_id < 64 ? uint64_t{1} << hw.device_id : 0;
  const bool attribute_set =
      needed == 0 && bit != 0 && (attribute_set_on.load() & bit) != 0;
  if ((attribute_set ? gemm.update(args, p.workspace)
                     : gemm.initialize(args, p.workspace, p.stream)) !=
      cutlass::Status::kSuccess) {
    return {false, "CUTLASS initialize failed"};
  }
  if (!attribute_set) attribute_set_on.fetch_or(bit);
  if (gemm.run(p.stream, /*cuda_adapter=*/nullptr, p.pdl) !=
      cutlass::Status::kSuccess) {
    return {false, "CUTLASS kernel launch failed"};
  }
  return {true, nullptr};
}

// The config struct of each GemmConfig code.
template <GemmConfig> struct ConfigOf;
#define RLK_CONFIG_OF(NAME)                             \
  template <> struct ConfigOf<GemmConfig::k##NAME> {    \
    using type = NAME;                                  \
  };
RLK_CONFIG_OF(Cooperative128x256)
RLK_CONFIG_OF(Cooperative256x192)
RLK_CONFIG_OF(Pingpong64x128)
RLK_CONFIG_OF(Pingpong64x64)
RLK_CONFIG_OF(Pingpong64x32)
RLK_CONFIG_OF(SwapPingpong64x32)
RLK_CONFIG_OF(Pingpong128x128)
RLK_CONFIG_OF(Cooperative128x128)
RLK_CONFIG_OF(Cooperative256x128)
RLK_CONFIG_OF(Cooperative128x192)
RLK_CONFIG_OF(Pingpong64x256)
RLK_CONFIG_OF(Cooperative128x256Cluster1x2)
RLK_CONFIG_OF(Pingpong64x128Cluster2x1)
RLK_CONFIG_OF(Pingpong64x64Cluster2x1)
RLK_CONFIG_OF(Pingpong64x128Cluster4x2)
RLK_CONFIG_OF(Pingpong64x64Cluster1x2)
RLK_CONFIG_OF(Cooperative128x320)
RLK_CONFIG_OF(Pingpong64x320Cluster2x1)
RLK_CONFIG_OF(Pingpong128x96Cluster2x4)
RLK_CONFIG_OF(Pingpong128x128Cluster1x2)
RLK_CONFIG_OF(SwapCooperative256x192Cluster1x2)
RLK_CONFIG_OF(Cooperative128x96)
RLK_CONFIG_OF(Pingpong64x320)
RLK_CONFIG_OF(Cooperative128x128Cluster1x1)
RLK_CONFIG_OF(Cooperative128x320K32)
RLK_CONFIG_OF(Cooperative128x192Cluster1x2)
RLK_CONFIG_OF(Cooperative128x96Cluster1x2)
RLK_CONFIG_OF(Cooperative128x144)
RLK_CONFIG_OF(Cooperative128x160)
RLK_CONFIG_OF(Cooperative128x224)
RLK_CONFIG_OF(Cooperative128x80)
RLK_CONFIG_OF(Cooperative128x144Cluster1x2)
RLK_CONFIG_OF(Pingpong192x128Cluster2x1)
RLK_CONFIG_OF(Pingpong192x96Cluster2x1)
RLK_CONFIG_OF(SwapCooperative128x192Cluster1x2)
#undef RLK_CONFIG_OF


}  // namespace

template <bool kTransposeA, bool kTransposeB, bool kOutF32, GemmConfig kConfig>
LaunchStatus LaunchGemmConfig(const GemmProblem& problem,
                              size_t* workspace_needed) {
  using Config = typename ConfigOf<kConfig>::type;
  return Run<Gemm<kTransposeA, kTransposeB, kOutF32, Config>>(
      problem, workspace_needed);
}

#ifdef RLK_TA
template LaunchStatus
LaunchGemmConfig<RLK_TA, RLK_TB, RLK_OUT_F32, static_cast<GemmConfig>(RLK_CONFIG)>(
    const GemmProblem&, size_t*);
#endif

}  // namespace rlk
