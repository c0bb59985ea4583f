// CUTLASS SM90 instantiations of the det_gemm forward that the library does
// not ship, for timing against the shipped one and cuBLAS on the M=4096
// projections (H100 experiment, not part of the library). Every variant
// walks K in 64-wide tiles, in order, into one f32 accumulator, so all of
// them must give the library's bits; det_gemm_variants.py checks that before
// it times anything. One shared library per variant (they compile in
// parallel), each exporting the same two C symbols:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//     -Xcompiler -fPIC -shared -DRLK_VARIANT=<n> -I cuda_ffi/csrc \
//     -isystem <cutlass>/include -isystem <cutlass>/tools/util/include \
//     benchmarks/cuda/det_gemm_variants.cu -o variant_<n>.so
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

// kTransposeB: B stored [N, K] (the dA layout) instead of [K, N].
#if RLK_VARIANT == 0
constexpr const char* kName = "coop128x256_c2x1 (shipped)";  // its epilogue:
// 128x32 until 2026-11-22, 128x128 since
constexpr bool kTransposeB = false;
using Config = Cooperative128x256;
#elif RLK_VARIANT == 1
constexpr const char* kName = "coop128x256_c1x2";
constexpr bool kTransposeB = false;
using Config = Variant<128, 256, 1, 2, false>;
#elif RLK_VARIANT == 2
constexpr const char* kName = "coop128x256_c1x1";
constexpr bool kTransposeB = false;
using Config = Variant<128, 256, 1, 1, false>;
#elif RLK_VARIANT == 3
constexpr const char* kName = "coop256x128_c1x2";
constexpr bool kTransposeB = false;
using Config = Variant<256, 128, 1, 2, false>;
#elif RLK_VARIANT == 4
constexpr const char* kName = "coop256x128_c2x1";
constexpr bool kTransposeB = false;
using Config = Variant<256, 128, 2, 1, false>;
#elif RLK_VARIANT == 5
constexpr const char* kName = "pp128x128_c1x2";
constexpr bool kTransposeB = false;
using Config = Variant<128, 128, 1, 2, true>;
#elif RLK_VARIANT == 6
constexpr const char* kName = "pp128x128_c2x1";
constexpr bool kTransposeB = false;
using Config = Variant<128, 128, 2, 1, true>;
#elif RLK_VARIANT == 7
constexpr const char* kName = "pp128x128_c1x1";
constexpr bool kTransposeB = false;
using Config = Variant<128, 128, 1, 1, true>;
#elif RLK_VARIANT == 8
constexpr const char* kName = "coop128x256_c2x1_nosmem_epi";
constexpr bool kTransposeB = false;
using Config = Variant<128, 256, 2, 1, false, true>;
#elif RLK_VARIANT == 9
constexpr const char* kName = "coop128x256_c2x1 B[N,K]";
constexpr bool kTransposeB = true;
using Config = Cooperative128x256;
#elif RLK_VARIANT == 10
constexpr const char* kName = "coop128x128_c2x1";
constexpr bool kTransposeB = false;
using Config = Variant<128, 128, 2, 1, false>;
#elif RLK_VARIANT == 11
constexpr const char* kName = "pp64x256_c1x2";
constexpr bool kTransposeB = false;
using Config = Variant<64, 256, 1, 2, true>;
#elif RLK_VARIANT == 12
constexpr const char* kName = "coop128x256_c2x2";
constexpr bool kTransposeB = false;
using Config = Variant<128, 256, 2, 2, false>;
#elif RLK_VARIANT == 13
constexpr const char* kName = "coop256x128_c2x2";
constexpr bool kTransposeB = false;
using Config = Variant<256, 128, 2, 2, false>;
#elif RLK_VARIANT == 14
constexpr const char* kName = "coop128x256_c4x1";
constexpr bool kTransposeB = false;
using Config = Variant<128, 256, 4, 1, false>;
#elif RLK_VARIANT == 15
constexpr const char* kName = "coop256x128_c1x4";
constexpr bool kTransposeB = false;
using Config = Variant<256, 128, 1, 4, false>;
#elif RLK_VARIANT == 16
constexpr const char* kName = "coop128x256_c2x1_epi128x64";
constexpr bool kTransposeB = false;
struct Config : Cooperative128x256 {
  template <class>
  using EpilogueTile = Shape<_128, _64>;
};
#elif RLK_VARIANT == 17
constexpr const char* kName = "pp64x32 (shipped decode)";
constexpr bool kTransposeB = false;
using Config = Pingpong64x32;
#elif RLK_VARIANT == 18
constexpr const char* kName = "pp64x32_k128";
constexpr bool kTransposeB = false;
using Config = Variant<64, 32, 1, 1, true, false, 128>;
#elif RLK_VARIANT == 19
constexpr const char* kName = "pp64x16";
constexpr bool kTransposeB = false;
using Config = Variant<64, 16, 1, 1, true>;
#elif RLK_VARIANT == 20
constexpr const char* kName = "pp64x64";
constexpr bool kTransposeB = false;
using Config = Variant<64, 64, 1, 1, true>;
#elif RLK_VARIANT == 21
constexpr const char* kName = "pp64x128 (shipped small M)";
constexpr bool kTransposeB = false;
using Config = Pingpong64x128;
#elif RLK_VARIANT == 22
constexpr const char* kName = "pp64x64_k128";
constexpr bool kTransposeB = false;
using Config = Variant<64, 64, 1, 1, true, false, 128>;
#elif RLK_VARIANT == 23
constexpr const char* kName = "pp64x16_k128";
constexpr bool kTransposeB = false;
using Config = Variant<64, 16, 1, 1, true, false, 128>;
#elif RLK_VARIANT == 24  // the shipped config since 2026-11-22
constexpr const char* kName = "coop128x256_c2x1_epi128x128";
constexpr bool kTransposeB = false;
struct Config : Cooperative128x256 {
  template <class>
  using EpilogueTile = Shape<_128, _128>;
};
#elif RLK_VARIANT == 25
constexpr const char* kName = "coop256x128_c1x2_epi128x64";
constexpr bool kTransposeB = false;
struct Config : Variant<256, 128, 1, 2, false> {
  template <class>
  using EpilogueTile = Shape<_128, _64>;
};
#elif RLK_VARIANT == 26
constexpr const char* kName = "coop128x256_c1x2_epi128x64";
constexpr bool kTransposeB = false;
struct Config : Variant<128, 256, 1, 2, false> {
  template <class>
  using EpilogueTile = Shape<_128, _64>;
};
#else
#error "unknown RLK_VARIANT"
#endif

}  // namespace
}  // namespace rlk

extern "C" const char* rlk_variant_name() { return rlk::kName; }

extern "C" int rlk_variant_transpose_b() { return rlk::kTransposeB ? 1 : 0; }

// Returns 0, or -1 with the reason in *message. c == nullptr: a workspace
// query only. swizzle, raster: GemmProblem's tile order (0, 0: CUTLASS's).
extern "C" int rlk_variant_run(const void* a, const void* b, void* c,
                               int64_t m, int64_t n, int64_t k, int sm_count,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, int swizzle, int raster,
                               size_t* workspace_needed,
                               const char** message) {
  rlk::GemmProblem p{a, b, c, m, n, k, sm_count, workspace, workspace_bytes,
                     stream, swizzle, raster};
  rlk::LaunchStatus s =
      rlk::Run<rlk::Gemm<false, rlk::kTransposeB, false, rlk::Config>>(
          p, workspace_needed);
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
