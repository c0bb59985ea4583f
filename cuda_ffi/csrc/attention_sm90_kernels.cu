// det_attention's forward on Hopper (sm_90a): the arithmetic of
// triton_kernels/attention.py's forward, instruction for instruction, in a
// warp-specialised kernel (TMA loads by a producer warp, wgmma by two
// consumer warpgroups of 64 query rows each).
//
// Why a row's bits equal the Triton kernel's (and so its decode's):
// * The tile is theirs: 128 query rows of one sequence and head, keys in
//   64-key blocks counted from the sequence's key 0, chunks of 512 keys
//   folded in order, the same blocks masked and the same rows.
// * The products are the same instructions: q k^T is wgmma m64n64k16 with
//   both operands K-major in 128-byte swizzled shared memory, its first
//   k-step ignoring the accumulator (scale-d 0), D/16 k-steps in order; p v
//   is wgmma m64nDk16 with p in registers (rounded by cvt.rn to the input
//   dtype) and v MN-major, onto the accumulator already scaled by alpha.
//   Each output element is one hardware dot product per k-step, the same
//   for every tile shape whose warpgroup holds 64 rows.
// * The scalar arithmetic is the Triton kernel's PTX: ex2.approx.ftz,
//   explicit fma.rn where it fuses (`fma(x, c, -m)`, `fma(l, alpha, sum)`,
//   the fold), separate mul/add/sub elsewhere (the __f*_rn intrinsics:
//   nvcc never contracts them), div.full.f32 for the normalisation, and
//   libdevice's ftz log2 polynomial for the log-sum-exp (Log2Ftz).
// * A row's sum runs over its own registers in register order (columns
//   0, 1, 8, 9, 16, ...: p0 + p1, then + p8 ...) and then across its quad
//   by xor-2 and xor-1 shuffles: the order Triton's reduction emits for
//   this layout. The max is exact in any order.
// * Keys a row may not see score -inf (in masked blocks only, as there):
//   a block no row can see leaves a row's state exactly as it was.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "ffi_traits.h"

namespace ffi = xla::ffi;

namespace rlk {
namespace {

constexpr int kBlockM = 128;  // query rows a CTA: two consumer warpgroups
constexpr int kBlockN = 64;   // keys a block: the online softmax's unit
constexpr int kFold = 512;    // keys a chunk: folded into the total in order
constexpr int kThreads = 384;  // producer warpgroup + two consumers
constexpr int kAtom = 64;     // 2-byte elements in one 128-byte swizzled row
constexpr int kRowBytes = 128;

// Key/value stages in shared memory (each 2 x 64 x D x 2 bytes).
template <int D>
constexpr int Stages() { return D == 128 ? 3 : 4; }

template <int D>
struct SharedStorage {
  alignas(1024) uint16_t q[kBlockM * D];  // [D / 64][128 rows][64]
  alignas(1024) uint16_t k[Stages<D>()][kBlockN * D];  // [D / 64][64][64]
  alignas(1024) uint16_t v[Stages<D>()][kBlockN * D];
  alignas(8) uint64_t q_full;
  uint64_t k_full[Stages<D>()];
  uint64_t v_full[Stages<D>()];
  uint64_t empty[Stages<D>()];
};

struct Params {
  const int32_t* seqs;   // [4, n_seqs]: q_start, q_len, k_start, k_len
  const int32_t* tiles;  // [2, n_tiles]: sequence (-1: no work), first row
  void* out;             // [Tq, Hq, D] contiguous
  float* lse;            // [Tq, Hq]
  int n_seqs, n_tiles, group, hq;
  float scale2;          // softmax scale times log2(e)
  int window;            // sliding window (keys), when windowed
};

// ---- PTX -----------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(count));
}

__device__ __forceinline__ void BarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
          SmemAddr(bar)),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void BarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar))
               : "memory");
}

__device__ __forceinline__ void BarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void TmaLoad(void* dst, const CUtensorMap* map,
                                        uint64_t* bar, int col, int head,
                                        int row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(SmemAddr(bar)), "r"(col), "r"(head), "r"(row)
      : "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Named barriers 1 and 2: a consumer warpgroup's turn to issue products
// (its own 128 threads sync, the other warpgroup's 128 arrive).
__device__ __forceinline__ void NamedSync(int id) {
  asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void NamedArrive(int id) {
  asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}

// Keeps registers a wgmma reads or writes asynchronously live (and
// unmoved) up to here, so the compiler neither reuses them for other values
// while the product runs nor serialises the products to be safe.
template <int N>
__device__ __forceinline__ void FenceRegs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void FenceRegs(uint32_t (&r)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// Rows of a 64-row tile past the sequence's end (the forward's keys in a v
// tile, the backward's queries in q and do tiles) hold another sequence's
// rows, a padded batch's junk or a pack's spare rows: their weights are 0,
// but 0 times a non-finite value is NaN, so the rows are zeroed before a
// product reads them (the Triton kernels load them as zeros: the same
// bits). Both warpgroups write the same zeros; each makes its own writes
// (generic proxy) visible to its products (async proxy) before issuing them.
template <int D>
__device__ __forceinline__ void ZeroTailRows(uint16_t* tile, int from, int t,
                                             int wg) {
  constexpr int kChunks = (D / kAtom) * kBlockN * 8;  // 16-byte chunks
  for (int c = t; c < kChunks; c += 128) {
    if ((c / 8) % kBlockN >= from) {
      reinterpret_cast<uint4*>(tile)[c] = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync %0, 128;" ::"r"(3 + wg) : "memory");
}

// The dynamic shared memory as T, aligned for 128-byte swizzled tiles.
template <typename T>
__device__ __forceinline__ T& AlignedShared() {
  extern __shared__ uint8_t raw_smem[];
  return *reinterpret_cast<T*>(
      (reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t{1023});
}

// A sequence's rows, from the [4, n_seqs] table the Triton kernels read.
struct SeqRows {
  int q_start, q_len, k_start, k_len;
  __device__ __forceinline__ SeqRows(const int32_t* seqs, int n, int seq)
      : q_start(seqs[seq]), q_len(seqs[n + seq]), k_start(seqs[2 * n + seq]),
        k_len(seqs[3 * n + seq]) {}
};

template <int S>
__device__ __forceinline__ void Advance(int& stage, uint32_t& phase) {
  if (++stage == S) {
    stage = 0;
    phase ^= 1;
  }
}

// A consumer warp is done with a stage (its products have completed).
__device__ __forceinline__ void Release(uint64_t* empty, int lane) {
  __syncwarp();
  if (lane == 0) BarArrive(empty);
}

// A shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t lbo,
                                         uint32_t sbo) {
  return (uint64_t{1} << 62) | (uint64_t((sbo >> 4) & 0x3FFF) << 32) |
         (uint64_t((lbo >> 4) & 0x3FFF) << 16) | uint64_t((addr >> 4) & 0x3FFF);
}

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float DivFull(float x, float y) {
  float z;
  asm("div.full.f32 %0, %1, %2;" : "=f"(z) : "f"(x), "f"(y));
  return z;
}

__device__ __forceinline__ float FmaFtz(float a, float b, float c) {
  float d;
  asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// libdevice's __nv_log2f as Triton builds it (the ftz variant), step for
// step: the Triton kernel's lse goes through it.
__device__ __forceinline__ float Log2Ftz(float x) {
  const bool tiny = x < __int_as_float(0x00800000);
  const float x2 = tiny ? __fmul_rn(x, __int_as_float(0x4B000000)) : x;
  const float e_adj = tiny ? __int_as_float(0xC1B80000) : 0.0f;
  const int bits = __float_as_int(x2);
  const int e = (bits - 1060439283) & static_cast<int>(0xFF800000u);
  const float mant = __int_as_float(bits - e);
  const float base =
      FmaFtz(static_cast<float>(e), __int_as_float(0x34000000), e_adj);
  const float f = __fadd_rn(mant, __int_as_float(0xBF800000));
  float poly = FmaFtz(__int_as_float(0x3DC6B27F), f, __int_as_float(0xBE2C7F30));
  poly = FmaFtz(poly, f, __int_as_float(0x3E2FCF2A));
  poly = FmaFtz(poly, f, __int_as_float(0xBE374E43));
  poly = FmaFtz(poly, f, __int_as_float(0x3E520BF4));
  poly = FmaFtz(poly, f, __int_as_float(0xBE763C8B));
  poly = FmaFtz(poly, f, __int_as_float(0x3E93BF99));
  poly = FmaFtz(poly, f, __int_as_float(0xBEB8AA49));
  poly = FmaFtz(poly, f, __int_as_float(0x3EF6384A));
  poly = FmaFtz(poly, f, __int_as_float(0xBF38AA3B));
  const float t = __fmul_rn(f, __fmul_rn(f, poly));
  float r = __fadd_rn(base, FmaFtz(f, __int_as_float(0x3FB8AA3B), t));
  if (!(static_cast<uint32_t>(bits) < 0x7F800000u)) {
    r = FmaFtz(x2, __int_as_float(0x7F800000), __int_as_float(0x7F800000));
  }
  return x2 == 0.0f ? __int_as_float(0xFF800000) : r;
}

template <bool kHalf>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  uint32_t r;
  if constexpr (kHalf) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// ---- wgmma ---------------------------------------------------------------
// The three instruction shapes the kernels issue, for bf16 and f16 (TY):
// scores (both operands in shared memory; kScaleD 0 ignores the
// accumulator) and p v (p in registers, v MN-major).

#define RLK_WGMMA_SS_M64N64(TY) \
template <int kScaleD> \
__device__ __forceinline__ void WgmmaSS_m64n64k16_##TY(float* d, uint64_t a, uint64_t b) { \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." #TY "." #TY " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, %34, 1, 1, 0, 0;\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(a), "l"(b), "n"(kScaleD)); \
}

#define RLK_WGMMA_RS_M64N64(TY) \
__device__ __forceinline__ void WgmmaRS_m64n64k16_##TY(float* d, const uint32_t* a, \
                                                uint64_t b) { \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." #TY "." #TY " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
}

#define RLK_WGMMA_RS_M64N128(TY) \
__device__ __forceinline__ void WgmmaRS_m64n128k16_##TY(float* d, const uint32_t* a, \
                                                uint64_t b) { \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." #TY "." #TY " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
}

RLK_WGMMA_SS_M64N64(bf16)
RLK_WGMMA_SS_M64N64(f16)
RLK_WGMMA_RS_M64N64(bf16)
RLK_WGMMA_RS_M64N64(f16)
RLK_WGMMA_RS_M64N128(bf16)
RLK_WGMMA_RS_M64N128(f16)
#undef RLK_WGMMA_SS_M64N64
#undef RLK_WGMMA_RS_M64N64
#undef RLK_WGMMA_RS_M64N128

// kAccumulate 0: the step ignores the accumulator (scale-d 0, as Triton's
// first step), 1: adds onto it.
template <bool kHalf, int kAccumulate>
__device__ __forceinline__ void ScoresStep(float* d, uint64_t a, uint64_t b) {
  if constexpr (kHalf) WgmmaSS_m64n64k16_f16<kAccumulate>(d, a, b);
  else WgmmaSS_m64n64k16_bf16<kAccumulate>(d, a, b);
}

template <int D, bool kHalf>
__device__ __forceinline__ void ValuesStep(float* d, const uint32_t* a,
                                           uint64_t b) {
  if constexpr (D == 128) {
    if constexpr (kHalf) WgmmaRS_m64n128k16_f16(d, a, b);
    else WgmmaRS_m64n128k16_bf16(d, a, b);
  } else {
    if constexpr (kHalf) WgmmaRS_m64n64k16_f16(d, a, b);
    else WgmmaRS_m64n64k16_bf16(d, a, b);
  }
}

// The products' shared-memory descriptors, made before the products are
// issued (the measured kernel; descriptors made at each step compile
// without serialising the products too).
// Scores: q is [D / 64][128 rows][64] (this warpgroup's rows at q_addr),
// k [D / 64][64 keys][64], both K-major; D / 16 k-steps of 32 bytes.
template <int D>
struct ScoreDescs {
  uint64_t q[D / 16], k[D / 16];
  __device__ __forceinline__ ScoreDescs(uint32_t q_addr, uint32_t k_addr) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t step = (kk % 4) * 32;
      q[kk] = Desc(q_addr + (kk / 4) * kBlockM * kRowBytes + step, 0, 1024);
      k[kk] = Desc(k_addr + (kk / 4) * kBlockN * kRowBytes + step, 0, 1024);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      asm volatile("" : "+l"(q[kk]), "+l"(k[kk]));
    }
  }
};

// Values: v is [D / 64][64 keys][64], MN-major (its two 64-column halves
// 64 rows apart); four k-steps of 16 keys.
struct ValueDescs {
  uint64_t v[4];
  __device__ __forceinline__ explicit ValueDescs(uint32_t v_addr) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      v[kk] = Desc(v_addr + kk * 16 * kRowBytes, kBlockN * kRowBytes, 1024);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) asm volatile("" : "+l"(v[kk]));
  }
};

// s = q k^T for this warpgroup's 64 rows, the first k-step ignoring the
// accumulator.
template <int D, bool kHalf>
__device__ __forceinline__ void IssueScores(float* s, const ScoreDescs<D>& d) {
  ScoresStep<kHalf, 0>(s, d.q[0], d.k[0]);
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk) ScoresStep<kHalf, 1>(s, d.q[kk], d.k[kk]);
}

// o += p v.
template <int D, bool kHalf>
__device__ __forceinline__ void IssueValues(float* o, const uint32_t (&p)[4][4],
                                            const ValueDescs& d) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) ValuesStep<D, kHalf>(o, p[kk], d.v[kk]);
}

constexpr float kNegInf = -__builtin_huge_valf();

// A row's reduction of a block (h = 0: row r, h = 1: row r + 8) in the
// order Triton's emits for this layout: the thread's own registers in
// register order (columns 0, 1, 8, 9, 16, ...), then across its quad by
// xor-2 and xor-1 shuffles. (For the max any order would do; the sum's
// bits depend on it.)
template <typename Op>
__device__ __forceinline__ void RowReduce(const float (&s)[32], float (&out)[2],
                                          Op op) {
#pragma unroll
  for (int h = 0; h < 2; ++h) out[h] = op(s[2 * h], s[2 * h + 1]);
#pragma unroll
  for (int i = 1; i < 8; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      out[h] = op(out[h], s[4 * i + 2 * h]);
      out[h] = op(out[h], s[4 * i + 2 * h + 1]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    out[h] = op(out[h], __shfl_xor_sync(0xFFFFFFFFu, out[h], 2));
    out[h] = op(out[h], __shfl_xor_sync(0xFFFFFFFFu, out[h], 1));
  }
}

// One key block of the online softmax for this thread's two rows (h = 0:
// row r, h = 1: row r + 8). s holds the block's scores in the wgmma
// accumulator layout: s[4i + 2h + c] is row h's column 8i + 2 quad + c.
template <bool kWindowed>
__device__ __forceinline__ void SoftmaxBlock(
    float (&s)[32], float (&m)[2], float (&l)[2], float (&alpha)[2],
    bool masked, int start, int quad, const int (&pos)[2],
    const bool (&row_ok)[2], float scale2, int window) {
  if (masked) {
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int h = (e / 2) % 2;
      const int j = start + 8 * (e / 4) + 2 * quad + e % 2;
      bool visible = j <= pos[h] && row_ok[h];
      if constexpr (kWindowed) visible = visible && j > pos[h] - window;
      if (!visible) s[e] = kNegInf;
    }
  }
  float mx[2];
  RowReduce(s, mx, [](float a, float b) { return fmaxf(a, b); });
  float neg[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // c > 0 and rounding is monotone: max(x) * c is the max of x * c.
    const float m_new = fmaxf(m[h], __fmul_rn(mx[h], scale2));
    const float m_use = (masked && m_new == kNegInf) ? 0.0f : m_new;
    alpha[h] = Ex2(__fsub_rn(m[h], m_use));
    neg[h] = __fsub_rn(0.0f, m_use);
    m[h] = m_new;
  }
#pragma unroll
  for (int e = 0; e < 32; ++e) s[e] = Ex2(__fmaf_rn(s[e], scale2, neg[(e / 2) % 2]));
  float sum[2];
  RowReduce(s, sum, [](float a, float b) { return __fadd_rn(a, b); });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = __fmaf_rn(l[h], alpha[h], sum[h]);
  }
}

// p, rounded to the inputs' dtype, as wgmma's A fragments: k-step kk takes
// keys 16 kk ... 16 kk + 15, i.e. s[8 kk ... 8 kk + 7] (cvt.rn, as Triton).
template <bool kHalf>
__device__ __forceinline__ void PackP(const float (&s)[32], uint32_t (&p)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) p[kk][r] = Pack<kHalf>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
  }
}

template <int D>
__device__ __forceinline__ void Fold(float (&m_run)[2], float (&l_run)[2],
                                     float (&o_run)[D / 2], const float (&m)[2],
                                     const float (&l)[2], const float (&o)[D / 2]) {
  float a[2], b[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m_run[h], m[h]);
    const float m_use = m_new == kNegInf ? 0.0f : m_new;
    a[h] = Ex2(__fsub_rn(m_run[h], m_use));
    b[h] = Ex2(__fsub_rn(m[h], m_use));
    l_run[h] = __fmaf_rn(l_run[h], a[h], __fmul_rn(l[h], b[h]));
    m_run[h] = m_new;
  }
#pragma unroll
  for (int e = 0; e < D / 2; ++e) {
    const int h = (e / 2) % 2;
    o_run[e] = __fmaf_rn(o_run[e], a[h], __fmul_rn(o[e], b[h]));
  }
}

template <int D, bool kHalf, bool kWindowed>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionForwardKernel(const __grid_constant__ CUtensorMap q_map,
                           const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map,
                           const Params params) {
  constexpr int S = Stages<D>();
  constexpr int kAtoms = D / kAtom;
  auto& smem = AlignedShared<SharedStorage<D>>();
  // The last tiles first: in a causal walk a sequence's later tiles have
  // the most keys, and starting them first shortens the grid's tail.
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int seq = params.tiles[tile];
  if (seq < 0) return;  // the whole CTA, before any barrier
  const int i0 = params.tiles[params.n_tiles + tile];
  const auto [q_start, q_len, k_start, k_len] =
      SeqRows(params.seqs, params.n_seqs, seq);
  const int offset = k_len - q_len;  // position of query 0
  // Keys from the first block any row can see to the last row's position,
  // in blocks counted from the sequence's key 0; [0, full) every row sees.
  const int hi = offset + min(i0 + kBlockM, q_len);
  const int first = offset + i0;
  int lo = 0, full = (first + 1) / kBlockN * kBlockN;
  if constexpr (kWindowed) {
    lo = max(first - params.window + 1, 0) / kBlockN * kBlockN;
    full = lo;
  }
  // Broadcast from lane 0 so the compiler sees it warp-uniform: the
  // products' shared-memory descriptors derived from it then live in
  // uniform registers, and nothing redefines a product's inputs while the
  // products run (which would serialise them).
  const int warpgroup = __shfl_sync(0xFFFFFFFFu, threadIdx.x / 128, 0);

  if (threadIdx.x == 0) {
    BarInit(&smem.q_full, 1);
    for (int i = 0; i < S; ++i) {
      BarInit(&smem.k_full[i], 1);
      BarInit(&smem.v_full[i], 1);
      BarInit(&smem.empty[i], 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: one thread issues every load, in the consumers' order.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      BarExpectTx(&smem.q_full, kBlockM * D * 2);
      for (int a = 0; a < kAtoms; ++a) {
        for (int half = 0; half < 2; ++half) {
          TmaLoad(&smem.q[(a * kBlockM + half * 64) * kAtom], &q_map,
                  &smem.q_full, a * kAtom, head, q_start + i0 + half * 64);
        }
      }
      const int kv_head = head / params.group;
      int stage = 0;
      uint32_t phase = 0;
      for (int start = lo; start < hi; start += kBlockN) {
        BarWait(&smem.empty[stage], phase ^ 1);
        BarExpectTx(&smem.k_full[stage], kBlockN * D * 2);
        for (int a = 0; a < kAtoms; ++a) {
          TmaLoad(&smem.k[stage][a * kBlockN * kAtom], &k_map,
                  &smem.k_full[stage], a * kAtom, kv_head, k_start + start);
        }
        BarExpectTx(&smem.v_full[stage], kBlockN * D * 2);
        for (int a = 0; a < kAtoms; ++a) {
          TmaLoad(&smem.v[stage][a * kBlockN * kAtom], &v_map,
                  &smem.v_full[stage], a * kAtom, kv_head, k_start + start);
        }
        if (++stage == S) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int wg = warpgroup - 1;  // rows wg * 64 ... of the tile
  const int t = threadIdx.x % 128;
  const int lane = t % 32, quad = lane % 4;
  const int row0 = wg * 64 + (t / 32) * 16 + lane / 4;  // and row0 + 8
  int pos[2];
  bool row_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + row0 + 8 * h;
    row_ok[h] = i < q_len;
    pos[h] = offset + i;
  }
  const uint32_t q_addr = SmemAddr(smem.q) + wg * 64 * kRowBytes;
  float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.0f, 0.0f};
  float o_run[D / 2];
#pragma unroll
  for (int e = 0; e < D / 2; ++e) o_run[e] = 0.0f;
  BarWait(&smem.q_full, 0);
  // Ping-pong: the two consumer warpgroups take turns to issue their
  // products (named barriers 1 and 2), so one's softmax runs while the
  // other's products hold the tensor cores. Both walk the same blocks, so
  // their turns pair up. Within a warpgroup, block b's scores are issued
  // with block b - 1's p v: o = o * alpha_{b-1} + p_{b-1} v_{b-1} as before,
  // only issued later (bits unchanged).
  if (wg == 1) NamedArrive(1);
  int stage = 0;
  uint32_t phase = 0;
  for (int c0 = lo / kFold * kFold; c0 < hi; c0 += kFold) {
    const int c_lo = max(c0, lo), c_hi = min(c0 + kFold, hi);
    float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
    float o[D / 2];
#pragma unroll
    for (int e = 0; e < D / 2; ++e) o[e] = 0.0f;
    uint32_t p[4][4];
    float s[32];
    float alpha[2];
    // The chunk's first block: its scores alone.
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] = 0.0f;
    BarWait(&smem.k_full[stage], phase);
    const ScoreDescs<D> first_descs(q_addr, SmemAddr(smem.k[stage]));
    NamedSync(1 + wg);
    WgmmaFence();
    IssueScores<D, kHalf>(s, first_descs);
    WgmmaCommit();
    NamedArrive(2 - wg);
    WgmmaWait<0>();
    // (o is 0: its rescale by alpha would leave it 0.)
    SoftmaxBlock<kWindowed>(s, m, l, alpha, kWindowed || c_lo >= full, c_lo,
                            quad, pos, row_ok, params.scale2, params.window);
    PackP<kHalf>(s, p);
    int prev_stage = stage, prev_start = c_lo;
    uint32_t prev_phase = phase;
    Advance<S>(stage, phase);
    for (int start = c_lo + kBlockN; start < c_hi; start += kBlockN) {
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] = 0.0f;
      BarWait(&smem.k_full[stage], phase);
      BarWait(&smem.v_full[prev_stage], prev_phase);
      if (prev_start + kBlockN > k_len) {
        ZeroTailRows<D>(smem.v[prev_stage], k_len - prev_start, t, wg);
      }
      const ScoreDescs<D> score_descs(q_addr, SmemAddr(smem.k[stage]));
      const ValueDescs value_descs(SmemAddr(smem.v[prev_stage]));
      NamedSync(1 + wg);
      FenceRegs(s);
      FenceRegs(o);
      FenceRegs(p);
      WgmmaFence();
      IssueScores<D, kHalf>(s, score_descs);
      WgmmaCommit();
      IssueValues<D, kHalf>(o, p, value_descs);
      WgmmaCommit();
      NamedArrive(2 - wg);
      WgmmaWait<1>();  // the scores (the older group)
      FenceRegs(s);
      SoftmaxBlock<kWindowed>(s, m, l, alpha, kWindowed || start >= full,
                              start, quad, pos, row_ok, params.scale2,
                              params.window);
      WgmmaWait<0>();  // p v of the block before
      FenceRegs(o);
      FenceRegs(p);
      Release(&smem.empty[prev_stage], lane);
#pragma unroll
      for (int e = 0; e < D / 2; ++e) o[e] = __fmul_rn(o[e], alpha[(e / 2) % 2]);
      // p's registers are free only now (the p v that read them is done).
      PackP<kHalf>(s, p);
      prev_stage = stage;
      prev_phase = phase;
      prev_start = start;
      Advance<S>(stage, phase);
    }
    // The chunk's last p v, then its fold.
    BarWait(&smem.v_full[prev_stage], prev_phase);
    if (prev_start + kBlockN > k_len) {
      ZeroTailRows<D>(smem.v[prev_stage], k_len - prev_start, t, wg);
    }
    const ValueDescs last_descs(SmemAddr(smem.v[prev_stage]));
    NamedSync(1 + wg);
    WgmmaFence();
    IssueValues<D, kHalf>(o, p, last_descs);
    WgmmaCommit();
    NamedArrive(2 - wg);
    WgmmaWait<0>();
    Release(&smem.empty[prev_stage], lane);
    Fold<D>(m_run, l_run, o_run, m, l, o);
  }

  // (1 / the normaliser's guard, lse in natural log): rows that saw no key
  // get lse -inf and a 0 output.
  using T = std::conditional_t<kHalf, __half, __nv_bfloat16>;
  T* out = static_cast<T*>(params.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!row_ok[h]) continue;
    const bool seen = l_run[h] > 0.0f;
    const float norm = seen ? l_run[h] : 1.0f;
    const float lse =
        seen ? __fmul_rn(__fadd_rn(m_run[h], Log2Ftz(norm)),
                         __int_as_float(0x3F317218))
             : kNegInf;
    const int64_t row = q_start + i0 + row0 + 8 * h;
    T* dst = out + (row * params.hq + head) * D + 2 * quad;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const uint32_t pair = Pack<kHalf>(DivFull(o_run[4 * i + 2 * h], norm),
                                        DivFull(o_run[4 * i + 2 * h + 1], norm));
      *reinterpret_cast<uint32_t*>(dst + 8 * i) = pair;
    }
    if (quad == 0) params.lse[row * params.hq + head] = lse;
  }
}

// ---- The backward's dK/dV -------------------------------------------------
// triton_kernels/attention.py's _bwd_dkdv_kernel, instruction for
// instruction, two of its programs (64 keys each) to a CTA sharing their
// query blocks' loads. Why each key's gradient has that kernel's bits:
// * A warpgroup owns the Triton program's 64 keys and walks the same query
//   blocks (64 rows) in the same order: its group's query heads in turn,
//   each from the block holding the first query that may see its first key
//   (the window's last, windowed) to the sequence's end. Blocks the other
//   warpgroup needs and this one does not are skipped, as that program
//   never visits them.
// * The products are the same instructions: k q^T and v do^T are wgmma
//   m64n64k16 from 128-byte swizzled shared memory (both K-major), the
//   first of their D / 16 k-steps ignoring the accumulator; dv += p do and
//   dk += ds q are wgmma m64nDk16 with p and ds in registers (cvt.rn) and do
//   and q MN-major, onto accumulators that start at zero.
// * The scalar steps are that kernel's PTX: -lse log2(e) as fma.rn(lse,
//   -log2 e, 0), p = ex2.approx.ftz(fma.rn(x, scale2, -lse2)) where the key
//   is visible (else 0), ds = p * (dp - delta) (sub, then mul), dk * scale
//   at the end.
// * Query rows past the sequence's end read as zeros there; here they hold
//   another sequence's rows or junk, so they are zeroed in shared memory
//   (and their lse and delta are 0) before a product reads them.

constexpr int kDkdvKeys = 128;  // keys a CTA: 64 per consumer warpgroup
constexpr int kDkdvRows = 64;   // query rows a step (the Triton BLOCK_M)

template <int D>
constexpr int DkdvStages() { return D == 128 ? 3 : 4; }

template <int D>
struct DkdvStorage {
  alignas(1024) uint16_t k[kDkdvKeys * D];  // [D / 64][128 keys][64]
  alignas(1024) uint16_t v[kDkdvKeys * D];
  alignas(1024) uint16_t q[DkdvStages<D>()][kDkdvRows * D];  // [D / 64][64][64]
  alignas(1024) uint16_t dout[DkdvStages<D>()][kDkdvRows * D];
  float neg_lse2[DkdvStages<D>()][kDkdvRows];
  float delta[DkdvStages<D>()][kDkdvRows];
  alignas(8) uint64_t kv_full;
  uint64_t full[DkdvStages<D>()];
  uint64_t empty[DkdvStages<D>()];
};

struct DkdvParams {
  const int32_t* seqs;   // [4, n_seqs]: q_start, q_len, k_start, k_len
  const int32_t* tiles;  // [2, n_tiles]: sequence (-1: none), first key
  const float* lse;      // [Tq, Hq]
  const float* delta;    // [Tq, Hq]: sum(o * do) per row
  void* dk;
  void* dv;
  int64_t dk_token_stride, dk_head_stride, dv_token_stride, dv_head_stride;
  int n_seqs, n_tiles, group, hq;
  float scale, scale2;
  int window;
};

// The query blocks [lo, hi) the Triton program of 64 keys from `j0` walks.
template <bool kWindowed>
__device__ __forceinline__ void DkdvBlocks(int j0, int offset, int q_len,
                                           int k_len, int window, int& lo,
                                           int& hi) {
  lo = max(j0 - offset, 0) / kDkdvRows * kDkdvRows;
  hi = q_len;
  if constexpr (kWindowed) hi = min(q_len, j0 + 63 + window - offset);
  if (j0 >= k_len) hi = lo;  // no keys: a warpgroup past the sequence's end
}

template <int D, bool kHalf, bool kWindowed>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionDkdvKernel(const __grid_constant__ CUtensorMap q_map,
                        const __grid_constant__ CUtensorMap k_map,
                        const __grid_constant__ CUtensorMap v_map,
                        const __grid_constant__ CUtensorMap do_map,
                        const DkdvParams params) {
  constexpr int S = DkdvStages<D>();
  constexpr int kAtoms = D / kAtom;
  auto& smem = AlignedShared<DkdvStorage<D>>();
  const int tile = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int seq = params.tiles[tile];
  if (seq < 0) return;  // the whole CTA, before any barrier
  const int j0 = params.tiles[params.n_tiles + tile];
  const auto [q_start, q_len, k_start, k_len] =
      SeqRows(params.seqs, params.n_seqs, seq);
  const int offset = k_len - q_len;  // position of query 0
  int lo[2], hi[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    DkdvBlocks<kWindowed>(j0 + w * 64, offset, q_len, k_len, params.window,
                          lo[w], hi[w]);
  }
  // Both warpgroups' blocks, loaded once (lo[0] <= lo[1]).
  const int all_lo = lo[0], all_hi = max(hi[0], hi[1]);
  const int warpgroup = __shfl_sync(0xFFFFFFFFu, threadIdx.x / 128, 0);

  if (threadIdx.x == 0) {
    BarInit(&smem.kv_full, 1);
    for (int i = 0; i < S; ++i) {
      BarInit(&smem.full[i], 33);  // the TMA thread's expect_tx + 32 lanes
      BarInit(&smem.empty[i], 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: lane 0 of warp 0 issues the TMA loads; the warp's lanes
    // load each block's lse and delta (two rows each).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {
      BarExpectTx(&smem.kv_full, 2 * kDkdvKeys * D * 2);
      for (int a = 0; a < kAtoms; ++a) {
        for (int half = 0; half < 2; ++half) {
          const int dst = (a * kDkdvKeys + half * 64) * kAtom;
          const int row = k_start + j0 + half * 64;
          TmaLoad(&smem.k[dst], &k_map, &smem.kv_full, a * kAtom, kv_head, row);
          TmaLoad(&smem.v[dst], &v_map, &smem.kv_full, a * kAtom, kv_head, row);
        }
      }
    }
    int stage = 0;
    uint32_t phase = 0;
    for (int g = 0; g < params.group; ++g) {
      const int head = kv_head * params.group + g;
      for (int i0 = all_lo; i0 < all_hi; i0 += kDkdvRows) {
        BarWait(&smem.empty[stage], phase ^ 1);
        if (lane == 0) {
          BarExpectTx(&smem.full[stage], 2 * kDkdvRows * D * 2);
          for (int a = 0; a < kAtoms; ++a) {
            TmaLoad(&smem.q[stage][a * kDkdvRows * kAtom], &q_map,
                    &smem.full[stage], a * kAtom, head, q_start + i0);
            TmaLoad(&smem.dout[stage][a * kDkdvRows * kAtom], &do_map,
                    &smem.full[stage], a * kAtom, head, q_start + i0);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = i0 + 2 * lane + r;
          const int64_t row = int64_t(q_start + i) * params.hq + head;
          const bool ok = i < q_len;
          const float lse = ok ? params.lse[row] : 0.0f;
          smem.neg_lse2[stage][2 * lane + r] =
              __fmaf_rn(lse, -1.4426950408889634f, 0.0f);
          smem.delta[stage][2 * lane + r] = ok ? params.delta[row] : 0.0f;
        }
        BarArrive(&smem.full[stage]);
        Advance<S>(stage, phase);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  const int wg = warpgroup - 1;  // keys j0 + 64 wg ...
  const int t = threadIdx.x % 128;
  const int lane = t % 32, quad = lane % 4;
  const int jw = j0 + wg * 64;
  const int key0 = jw + (t / 32) * 16 + lane / 4;  // and key0 + 8
  const uint32_t k_addr = SmemAddr(smem.k) + wg * 64 * kRowBytes;
  const uint32_t v_addr = SmemAddr(smem.v) + wg * 64 * kRowBytes;
  const int my_lo = wg == 0 ? lo[0] : lo[1], my_hi = wg == 0 ? hi[0] : hi[1];
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int e = 0; e < D / 2; ++e) dk[e] = dv[e] = 0.0f;
  BarWait(&smem.kv_full, 0);
  int stage = 0;
  uint32_t phase = 0;
  for (int g = 0; g < params.group; ++g) {
    for (int i0 = all_lo; i0 < all_hi; i0 += kDkdvRows) {
      BarWait(&smem.full[stage], phase);
      if (i0 >= my_lo && i0 < my_hi) {
        if (i0 + kDkdvRows > q_len) {
          ZeroTailRows<D>(smem.q[stage], q_len - i0, t, wg);
          ZeroTailRows<D>(smem.dout[stage], q_len - i0, t, wg);
        }
        float s[32], dp[32];
        const ScoreDescs<D> score_descs(k_addr, SmemAddr(smem.q[stage]));
        const ScoreDescs<D> dp_descs(v_addr, SmemAddr(smem.dout[stage]));
        WgmmaFence();
        IssueScores<D, kHalf>(s, score_descs);
        IssueScores<D, kHalf>(dp, dp_descs);
        WgmmaCommit();
        WgmmaWait<0>();
        FenceRegs(s);
        FenceRegs(dp);
        // Every key of the warpgroup sees every row of the block: no mask
        // (the mask would pick the same values).
        const bool all_visible = !kWindowed && i0 + offset >= jw + 63 &&
                                 i0 + kDkdvRows <= q_len;
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          const int col = 8 * (e / 4) + 2 * quad + e % 2;
          float p = Ex2(__fmaf_rn(s[e], params.scale2,
                                  smem.neg_lse2[stage][col]));
          if (!all_visible) {
            const int i = i0 + col, key = key0 + 8 * ((e / 2) % 2);
            bool visible = key <= offset + i && i < q_len;
            if constexpr (kWindowed) visible = visible && key > offset + i - params.window;
            if (!visible) p = 0.0f;
          }
          dp[e] = __fmul_rn(p, __fsub_rn(dp[e], smem.delta[stage][col]));
          s[e] = p;
        }
        uint32_t p[4][4], ds[4][4];
        PackP<kHalf>(s, p);
        PackP<kHalf>(dp, ds);
        const ValueDescs do_descs(SmemAddr(smem.dout[stage]));
        const ValueDescs q_descs(SmemAddr(smem.q[stage]));
        WgmmaFence();
        IssueValues<D, kHalf>(dv, p, do_descs);
        IssueValues<D, kHalf>(dk, ds, q_descs);
        WgmmaCommit();
        WgmmaWait<0>();
        FenceRegs(dv);
        FenceRegs(dk);
        FenceRegs(p);
        FenceRegs(ds);
      }
      Release(&smem.empty[stage], lane);
      Advance<S>(stage, phase);
    }
  }

  using T = std::conditional_t<kHalf, __half, __nv_bfloat16>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    if (key >= k_len) continue;
    const int64_t row = k_start + key;
    T* dk_row = static_cast<T*>(params.dk) + row * params.dk_token_stride +
                kv_head * params.dk_head_stride + 2 * quad;
    T* dv_row = static_cast<T*>(params.dv) + row * params.dv_token_stride +
                kv_head * params.dv_head_stride + 2 * quad;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int e = 4 * i + 2 * h;
      *reinterpret_cast<uint32_t*>(dk_row + 8 * i) = Pack<kHalf>(
          __fmul_rn(dk[e], params.scale), __fmul_rn(dk[e + 1], params.scale));
      *reinterpret_cast<uint32_t*>(dv_row + 8 * i) =
          Pack<kHalf>(dv[e], dv[e + 1]);
    }
  }
}

// ---- Host -----------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                         cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A [rows, heads, D] view (strides in elements; D contiguous) read in boxes
// of 64 rows x one head x 64 columns, 128-byte swizzled; rows past `rows`
// read as zeros.
bool RowsMap(CUtensorMap* map, const void* base, bool half, int64_t rows,
             int64_t heads, int64_t d, int64_t token_stride,
             int64_t head_stride) {
  auto encode = EncodeTiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d),
                              static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride * 2),
                                 static_cast<cuuint64_t>(token_stride * 2)};
  const cuuint32_t box[3] = {kAtom, 1, 64};
  const cuuint32_t unit[3] = {1, 1, 1};
  return encode(map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                          : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3, const_cast<void*>(base), dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Runs f(D, half, windowed) with the three as compile-time constants
// (std::integral_constant / bool_constant), for the head dims 64 and 128.
template <typename F>
cudaError_t Dispatch(int64_t d, bool half, bool windowed, F&& f) {
  auto flags = [&](auto dim) {
    if (half) {
      return windowed ? f(dim, std::true_type{}, std::true_type{})
                      : f(dim, std::true_type{}, std::false_type{});
    }
    return windowed ? f(dim, std::false_type{}, std::true_type{})
                    : f(dim, std::false_type{}, std::false_type{});
  };
  return d == 128 ? flags(std::integral_constant<int, 128>{})
                  : flags(std::integral_constant<int, 64>{});
}

// Launches kKernel with `bytes` of dynamic shared memory (its attribute set
// once per kernel: a template argument, so each instantiation has its own).
template <auto kKernel, typename... Args>
cudaError_t LaunchWithSmem(int bytes, dim3 grid, cudaStream_t stream,
                           const Args&... args) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (attr != cudaSuccess) return attr;
  kKernel<<<grid, kThreads, bytes, stream>>>(args...);
  return cudaGetLastError();
}

thread_local std::string last_error;

const char* Error(const char* entry, const std::string& message) {
  last_error = std::string(entry) + ": " + message;
  return last_error.c_str();
}

// What both kernels refuse: head dims other than 64 and 128, query heads
// that are not a multiple of the key heads.
const char* CheckHeads(const char* entry, int64_t d, int64_t hq, int64_t hkv) {
  if (d != 64 && d != 128) {
    return Error(entry, "head dim " + std::to_string(d) + " (64 or 128 only)");
  }
  if (hkv <= 0 || hq % hkv != 0) {
    return Error(entry, "hq = " + std::to_string(hq) +
                            " is not a multiple of hkv = " + std::to_string(hkv));
  }
  return nullptr;
}

constexpr char kForward[] = "rlk_attention_forward_sm90";
constexpr char kDkdv[] = "rlk_attention_dkdv_sm90";
constexpr char kRefusedMap[] =
    "cuTensorMapEncodeTiled refused an operand (addresses and strides must "
    "be multiples of 16 bytes)";

// Checks, maps the operands and launches; NULL or an error message.
const char* LaunchForward(cudaStream_t stream, const void* q, const void* k,
                          const void* v, const int32_t* seqs,
                          const int32_t* tiles, void* out, float* lse,
                          int64_t n_seqs, int64_t n_tiles, int64_t hq,
                          int64_t hkv, int64_t d, int64_t q_rows,
                          int64_t q_token_stride, int64_t q_head_stride,
                          int64_t k_rows, int64_t k_token_stride,
                          int64_t k_head_stride, int64_t v_token_stride,
                          int64_t v_head_stride, float scale2, int64_t window,
                          bool half) {
  if (const char* e = CheckHeads(kForward, d, hq, hkv)) return e;
  if (n_tiles == 0 || q_rows == 0) return nullptr;
  CUtensorMap q_map, k_map, v_map;
  if (!RowsMap(&q_map, q, half, q_rows, hq, d, q_token_stride, q_head_stride) ||
      !RowsMap(&k_map, k, half, k_rows, hkv, d, k_token_stride, k_head_stride) ||
      !RowsMap(&v_map, v, half, k_rows, hkv, d, v_token_stride, v_head_stride)) {
    return Error(kForward, kRefusedMap);
  }
  const Params params{seqs, tiles, out, lse, static_cast<int>(n_seqs),
                      static_cast<int>(n_tiles), static_cast<int>(hq / hkv),
                      static_cast<int>(hq), scale2, static_cast<int>(window)};
  const cudaError_t err = Dispatch(d, half, window > 0, [&](auto dim, auto h, auto w) {
    constexpr int D = decltype(dim)::value;
    return LaunchWithSmem<AttentionForwardKernel<D, decltype(h)::value,
                                                 decltype(w)::value>>(
        sizeof(SharedStorage<D>) + 1024, dim3(params.n_tiles, params.hq),
        stream, q_map, k_map, v_map, params);
  });
  return err == cudaSuccess ? nullptr : Error(kForward, cudaGetErrorString(err));
}

// The backward's dK/dV: q and do [q_rows, hq, D] (do contiguous), k and v
// [k_rows, hkv, D] (token and head strides in elements), lse and delta f32
// [q_rows, hq] contiguous, tiles the map of 128-key tiles; dk and dv written
// with their own strides. NULL or an error message.
const char* LaunchDkdv(cudaStream_t stream, const void* q, const void* k,
                       const void* v, const void* dout, const float* lse,
                       const float* delta, const int32_t* seqs,
                       const int32_t* tiles, void* dk, void* dv,
                       int64_t n_seqs, int64_t n_tiles, int64_t hq,
                       int64_t hkv, int64_t d, int64_t q_rows,
                       int64_t q_token_stride, int64_t q_head_stride,
                       int64_t k_rows, int64_t k_token_stride,
                       int64_t k_head_stride, int64_t v_token_stride,
                       int64_t v_head_stride, int64_t dk_token_stride,
                       int64_t dk_head_stride, int64_t dv_token_stride,
                       int64_t dv_head_stride, float scale, float scale2,
                       int64_t window, bool half) {
  if (const char* e = CheckHeads(kDkdv, d, hq, hkv)) return e;
  if (n_tiles == 0 || k_rows == 0) return nullptr;
  CUtensorMap q_map, k_map, v_map, do_map;
  if (!RowsMap(&q_map, q, half, q_rows, hq, d, q_token_stride, q_head_stride) ||
      !RowsMap(&do_map, dout, half, q_rows, hq, d, hq * d, d) ||
      !RowsMap(&k_map, k, half, k_rows, hkv, d, k_token_stride, k_head_stride) ||
      !RowsMap(&v_map, v, half, k_rows, hkv, d, v_token_stride, v_head_stride)) {
    return Error(kDkdv, kRefusedMap);
  }
  const DkdvParams params{seqs, tiles, lse, delta, dk, dv, dk_token_stride,
                          dk_head_stride, dv_token_stride, dv_head_stride,
                          static_cast<int>(n_seqs), static_cast<int>(n_tiles),
                          static_cast<int>(hq / hkv), static_cast<int>(hq),
                          scale, scale2, static_cast<int>(window)};
  const cudaError_t err = Dispatch(d, half, window > 0, [&](auto dim, auto h, auto w) {
    constexpr int D = decltype(dim)::value;
    return LaunchWithSmem<AttentionDkdvKernel<D, decltype(h)::value,
                                              decltype(w)::value>>(
        sizeof(DkdvStorage<D>) + 1024,
        dim3(params.n_tiles, static_cast<unsigned>(hkv)), stream, q_map,
        k_map, v_map, do_map, params);
  });
  return err == cudaSuccess ? nullptr : Error(kDkdv, cudaGetErrorString(err));
}

// XLA: q [Tq, Hq, D], k and v [Tk, Hkv, D] rows (contiguous), seqs int32
// [4, B], tiles int32 [2, n_tiles]; out [Tq, Hq, D] in q's dtype and lse
// f32 [Tq, Hq].
ffi::Error AttentionForwardFfi(cudaStream_t stream, ffi::AnyBuffer q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> seqs,
                               ffi::Buffer<ffi::S32> tiles,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse,
                               float scale2, int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || seqs.dimensions().size() != 2 ||
      tiles.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        "rlk_attention_forward_sm90: q, k, v must be [T, H, D] rows and "
        "seqs, tiles 2-d");
  }
  const bool half = q.element_type() == ffi::F16;
  if (!half && q.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument(
        "rlk_attention_forward_sm90: q, k, v must be bf16 or f16");
  }
  const int64_t hq = qd[1], d = qd[2], hkv = kd[1];
  if (const char* e = LaunchForward(
          stream, q.untyped_data(), k.untyped_data(), v.untyped_data(),
          seqs.typed_data(), tiles.typed_data(), out->untyped_data(),
          lse->typed_data(), seqs.dimensions()[1], tiles.dimensions()[1], hq,
          hkv, d, qd[0], hq * d, d, kd[0], hkv * d, d, hkv * d, d, scale2,
          window, half)) {
    return ffi::Error::Internal(e);
  }
  return ffi::Error::Success();
}

// XLA: the backward's dK/dV. q and do [Tq, Hq, D], k and v [Tk, Hkv, D]
// rows (contiguous), lse and delta f32 [Tq, Hq], seqs int32 [4, B], tiles
// int32 [2, n_tiles] (128-key tiles); dk and dv [Tk, Hkv, D] in k's dtype
// (rows no tile covers are not written).
ffi::Error AttentionDkdvFfi(cudaStream_t stream, ffi::AnyBuffer q,
                            ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                            ffi::Buffer<ffi::F32> delta,
                            ffi::Buffer<ffi::S32> seqs,
                            ffi::Buffer<ffi::S32> tiles,
                            ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, float scale,
                            float scale2, int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || seqs.dimensions().size() != 2 ||
      tiles.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        std::string(kDkdv) + ": q, k, v, do must be [T, H, D] rows and seqs, "
        "tiles 2-d");
  }
  const bool half = q.element_type() == ffi::F16;
  if (!half && q.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument(std::string(kDkdv) +
                                       ": q, k, v, do must be bf16 or f16");
  }
  const int64_t hq = qd[1], d = qd[2], hkv = kd[1];
  if (const char* e = LaunchDkdv(
          stream, q.untyped_data(), k.untyped_data(), v.untyped_data(),
          dout.untyped_data(), lse.typed_data(), delta.typed_data(),
          seqs.typed_data(), tiles.typed_data(), dk->untyped_data(),
          dv->untyped_data(), seqs.dimensions()[1], tiles.dimensions()[1], hq,
          hkv, d, qd[0], hq * d, d, kd[0], hkv * d, d, hkv * d, d, hkv * d, d,
          hkv * d, d, scale, scale2, window, half)) {
    return ffi::Error::Internal(e);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rlk

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkAttentionForwardSm90,
                              rlk::AttentionForwardFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale2")
                                  .Attr<int64_t>("window"),
                              RLK_FFI_TRAITS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkAttentionDkdvSm90, rlk::AttentionDkdvFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("scale2")
                                  .Attr<int64_t>("window"),
                              RLK_FFI_TRAITS);

extern "C" {

// The torch bridge's entry: det_attention's forward (the Triton forward's
// bits) on `stream`. q [q_rows, hq, D], k and v [k_rows, hkv, D] with the
// given token and head strides (elements; D contiguous; 16-byte aligned);
// out [q_rows, hq, D] and lse [q_rows, hq] contiguous; seqs int32 [4,
// n_seqs] and tiles int32 [2, n_tiles] as the Triton kernel reads them
// (128-row tiles). `is_half`: f16 (else bf16). `window` > 0: a sliding
// window of that many keys. Returns NULL, or a message valid until the
// next call on this thread.
const char* rlk_attention_forward_sm90(
    void* stream, const void* q, const void* k, const void* v,
    const int32_t* seqs, const int32_t* tiles, void* out, float* lse,
    int64_t n_seqs, int64_t n_tiles, int64_t hq, int64_t hkv, int64_t d,
    int64_t q_rows, int64_t q_token_stride, int64_t q_head_stride,
    int64_t k_rows, int64_t k_token_stride, int64_t k_head_stride,
    int64_t v_token_stride, int64_t v_head_stride, float scale2,
    int64_t window, int is_half) {
  return rlk::LaunchForward(
      static_cast<cudaStream_t>(stream), q, k, v, seqs, tiles, out, lse,
      n_seqs, n_tiles, hq, hkv, d, q_rows, q_token_stride, q_head_stride,
      k_rows, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
      scale2, window, is_half != 0);
}


// The torch bridge's entry for the backward's dK/dV (the Triton dK/dV
// kernel's bits) on `stream`: q [q_rows, hq, D] and k, v [k_rows, hkv, D]
// with the given strides (elements; D contiguous; 16-byte aligned), do
// [q_rows, hq, D] contiguous, lse and delta f32 [q_rows, hq] contiguous
// (delta = sum(o * do) as the Triton delta kernel gives it), seqs and tiles
// (128-key tiles) as the Triton kernels read them, dk and dv with their own
// strides. `scale` is the softmax scale, `scale2` it times log2(e). NULL or a
// message valid until the next call on this thread.
const char* rlk_attention_dkdv_sm90(
    void* stream, const void* q, const void* k, const void* v,
    const void* dout, const float* lse, const float* delta,
    const int32_t* seqs, const int32_t* tiles, void* dk, void* dv,
    int64_t n_seqs, int64_t n_tiles, int64_t hq, int64_t hkv, int64_t d,
    int64_t q_rows, int64_t q_token_stride, int64_t q_head_stride,
    int64_t k_rows, int64_t k_token_stride, int64_t k_head_stride,
    int64_t v_token_stride, int64_t v_head_stride, int64_t dk_token_stride,
    int64_t dk_head_stride, int64_t dv_token_stride, int64_t dv_head_stride,
    float scale, float scale2, int64_t window, int is_half) {
  return rlk::LaunchDkdv(
      static_cast<cudaStream_t>(stream), q, k, v, dout, lse, delta, seqs,
      tiles, dk, dv, n_seqs, n_tiles, hq, hkv, d, q_rows, q_token_stride,
      q_head_stride, k_rows, k_token_stride, k_head_stride, v_token_stride,
      v_head_stride, dk_token_stride, dk_head_stride, dv_token_stride,
      dv_head_stride, scale, scale2, window, is_half != 0);
}

}  // extern "C"
