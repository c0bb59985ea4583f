// The kernels behind pack_rows.h. Masks are read as tiles of kTile
// positions: a tile's active count, an exclusive scan over the tiles, then
// each tile rescans its own positions from its offset, so every field is
// written by exactly one thread (no atomics except the order-free max).
// Masks of up to 16384 positions take one block for all three steps.
#include <algorithm>
#include <cstring>

#include "device_info.h"
#include "pack_rows.h"

namespace rlk {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;
constexpr int64_t kTile = kThreads * kPerThread;
constexpr int kScanThreads = 1024;
// CopyRows indexes a block's units in int: rows of at most this many units
// take the per-block kernels (wider ones the flat kernel).
constexpr int64_t kMaxUnitsPerRow = 1 << 20;

int64_t NumTiles(int64_t size) { return (size + kTile - 1) / kTile; }

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most
// 1024 threads); `*block_total` gets the sum.
__device__ int BlockExclusiveScan(int value, int* block_total) {
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    int up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x >> 5;
    int s = lane < n_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int up = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += up;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const int warp_offset = warp == 0 ? 0 : warp_sums[warp - 1];
  *block_total = warp_sums[(blockDim.x >> 5) - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return warp_offset + inclusive - value;
}

// One thread's kPerThread consecutive positions, read once into registers.
struct ThreadBits {
  uint8_t bits[kPerThread];
  int count;
};

__device__ ThreadBits LoadThreadBits(const uint8_t* active, int64_t size,
                                     int64_t first) {
  ThreadBits t;
  t.count = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t p = first + j;
    t.bits[j] = (p < size && active[p]) ? 1 : 0;
    t.count += t.bits[j];
  }
  return t;
}

__global__ void TileCounts(const uint8_t* active, int64_t size,
                           int32_t* tile_counts) {
  const int64_t first =
      blockIdx.x * kTile + static_cast<int64_t>(threadIdx.x) * kPerThread;
  int total;
  BlockExclusiveScan(LoadThreadBits(active, size, first).count, &total);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

// The scalars every path writes once the active total is known; an empty
// mask's cu_seqlens too (no position writes them).
__device__ void WriteTotals(int total, int64_t capacity, int64_t n_seq,
                            int64_t size, const PackInfoOut& out) {
  if (threadIdx.x == 0) {
    *out.total = total;
    *out.num_dropped = total > capacity ? static_cast<int32_t>(total - capacity) : 0;
    *out.max_seqlen = 0;
    out.cu_seqlens[0] = 0;
  }
  if (size == 0) {
    for (int64_t s = threadIdx.x; s < n_seq; s += blockDim.x) {
      out.cu_seqlens[s + 1] = 0;
    }
  }
}

// One block: tile offsets and the totals.
__global__ void ScanTiles(const int32_t* tile_counts, int64_t n_tiles,
                          int64_t capacity, int64_t n_seq, int64_t size,
                          int32_t* tile_offsets, PackInfoOut out) {
  int carry = 0;
  for (int64_t base = 0; base < n_tiles; base += kScanThreads) {
    const int64_t t = base + threadIdx.x;
    const int count = t < n_tiles ? tile_counts[t] : 0;
    int chunk_total;
    const int offset = BlockExclusiveScan(count, &chunk_total);
    if (t < n_tiles) tile_offsets[t] = carry + offset;
    carry += chunk_total;
  }
  WriteTotals(carry, capacity, n_seq, size, out);
}

// The per-position and per-kept-row fields of one thread's positions, the
// first of which is the `running`-th active position of the mask.
__device__ void WriteFields(const ThreadBits& t, int64_t first, int64_t size,
                            int64_t width, int64_t capacity, int running,
                            const PackInfoOut& out) {
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t p = first + j;
    if (p < size) {
      const int row = running;  // the packed row of p, if it is active
      running += t.bits[j];
      const bool kept = t.bits[j] && row < capacity;
      out.scatter_map[p] = kept ? row : -1;
      if (kept) {
        out.gather_map[row] = static_cast<int32_t>(p);
        out.segment_ids[row] = static_cast<int32_t>(p / width);
        out.valid[row] = 1;
      }
      if ((p + 1) % width == 0) out.cu_seqlens[p / width + 1] = running;
    }
  }
}

__global__ void TileFields(const uint8_t* active, int64_t size, int64_t width,
                           int64_t capacity, const int32_t* tile_offsets,
                           PackInfoOut out) {
  const int64_t first =
      blockIdx.x * kTile + static_cast<int64_t>(threadIdx.x) * kPerThread;
  const ThreadBits t = LoadThreadBits(active, size, first);
  int unused;
  const int running =
      tile_offsets[blockIdx.x] + BlockExclusiveScan(t.count, &unused);
  WriteFields(t, first, size, width, capacity, running, out);
}

// Masks of at most kSmallMask positions: counts, scan and fields in one
// block (one launch instead of three).
constexpr int64_t kSmallMask = kScanThreads * kPerThread;

__global__ void SmallMaskFields(const uint8_t* active, int64_t n_seq,
                                int64_t width, int64_t capacity,
                                PackInfoOut out) {
  const int64_t size = n_seq * width;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * kPerThread;
  const ThreadBits t = LoadThreadBits(active, size, first);
  int total;
  const int running = BlockExclusiveScan(t.count, &total);
  WriteTotals(total, capacity, n_seq, size, out);
  WriteFields(t, first, size, width, capacity, running, out);
}

// Per packed row: positions of the kept rows, the pad rows' fields; per
// sequence: seq_lens and max_seqlen.
__global__ void FinishFields(int64_t n_seq, int64_t capacity, PackInfoOut out) {
  const int64_t kept = min(static_cast<int64_t>(*out.total), capacity);
  const int64_t n = max(capacity, n_seq);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < capacity) {
      if (i < kept) {
        out.positions[i] =
            static_cast<int32_t>(i) - out.cu_seqlens[out.segment_ids[i]];
      } else {
        out.gather_map[i] = -1;
        out.segment_ids[i] = -1;
        out.positions[i] = 0;
        out.valid[i] = 0;
      }
    }
    if (i < n_seq) {
      const int32_t len = out.cu_seqlens[i + 1] - out.cu_seqlens[i];
      out.seq_lens[i] = len;
      atomicMax(out.max_seqlen, len);  // a max: the same whatever the order
    }
  }
}

// Copies rows [row_begin, row_begin + n_rows) of dst, `units_per_row` units
// each, from the rows `source(r)` of src (a row of `fill` where it is < 0).
// The block's (row, unit) pairs are flattened over its threads and each
// thread issues kUnroll loads before its stores, so enough bytes are in
// flight to run at copy bandwidth whatever the row width; the loads and
// stores are marked streaming (each byte is touched once). On the H100
// this structure copied the benchmark's rows at memcpy speed
// (benchmarks/results/experiments/h100-2026-11-22/gather_variants.txt).
constexpr int kUnroll = 8;

template <typename Unit, typename Source>
__device__ void CopyRows(const Unit* __restrict__ src, Unit* __restrict__ dst,
                         int64_t units_per_row, int64_t row_begin, int n_rows,
                         Unit fill, Source source) {
  const int upr = static_cast<int>(units_per_row);
  const int n = n_rows * upr;
  const int step = blockDim.x * kUnroll;
  for (int base = threadIdx.x; base < n; base += step) {
    Unit v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) {
        const int row = i / upr;
        const int64_t s = source(row_begin + row);
        v[k] = s < 0 ? fill : __ldcs(src + s * units_per_row + (i - row * upr));
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) __stcs(dst + row_begin * units_per_row + i, v[k]);
    }
  }
}

template <typename Unit>
__global__ void GatherRowsPerBlock(const Unit* __restrict__ src,
                                   const int32_t* __restrict__ idx,
                                   int64_t out_rows, int64_t units_per_row,
                                   int rows_per_block, Unit fill,
                                   Unit* __restrict__ dst) {
  // Wide rows (hidden states): a few whole rows per block.
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int n_rows = static_cast<int>(
      min(static_cast<int64_t>(rows_per_block), out_rows - first));
  CopyRows(src, dst, units_per_row, first, n_rows, fill,
           [idx](int64_t r) { return static_cast<int64_t>(idx[r]); });
}

template <typename Unit>
__global__ void GatherRowsFlat(const Unit* src, const int32_t* idx,
                               int64_t out_rows, int64_t units_per_row,
                               Unit fill, Unit* dst) {
  // Narrow rows (ids, labels, log-probs): threads over all output units.
  const int64_t n = out_rows * units_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / units_per_row, u = i - r * units_per_row;
    const int32_t s = idx[r];
    dst[i] = s < 0 ? fill : src[static_cast<int64_t>(s) * units_per_row + u];
  }
}

// ---------------------------------------------------------------------------
// pack from a small mask in one launch. Every block scans the whole mask
// itself (at most kFusedMaxMask bytes, L2-resident after the first block
// reads it), so no block waits for another and one kernel writes the packed
// rows and every PackInfo field: the metadata costs no launches of its own.
// Each field is still written by exactly one thread of one block.

// A block's threads hold the whole mask as bits, one 64-bit word a thread.
// At <= 64 registers a 1024-thread block fills an SM; 512-thread
// blocks two to an SM were slower (the H100 experiment below).
#ifndef RLK_FUSED_THREADS  // other block sizes only for experiments
#define RLK_FUSED_THREADS 1024
#endif
constexpr int kFusedThreads = RLK_FUSED_THREADS;
constexpr int64_t kFusedMaxPerThread = 64;
constexpr int64_t kFusedMaxMask = kFusedMaxPerThread * kFusedThreads;  // 65536
constexpr int64_t kFusedMaxSeq = 4096;                 // cu_seqlens in smem
constexpr int kFusedMaxRowsPerBlock = 1024;

struct FusedGeometry {
  int64_t blocks;
  int64_t rows_per_block;
  int64_t positions_per_block;  // of the scatter map
  int per_thread;  // positions a thread scans: a multiple of 16, at most 64
};

// Bits of `count` consecutive mask bytes from `first` (16-byte aligned;
// XLA's bool bytes are 0 or 1, so one multiply gathers four of them).
__device__ uint64_t LoadMaskBits(const uint8_t* __restrict__ active,
                                 int64_t size, int64_t first, int count) {
  uint64_t bits = 0;
#pragma unroll
  for (int c = 0; c < kFusedMaxPerThread; c += 16) {
    if (c >= count) break;
    const int64_t p = first + c;
    if (p + 16 <= size) {
      const uint4 v = *reinterpret_cast<const uint4*>(active + p);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        bits |= static_cast<uint64_t>((words[w] * 0x10204080u) >> 28) << (c + 4 * w);
      }
    } else {
      for (int k = 0; k < 16 && p + k < size; ++k) {
        if (active[p + k]) bits |= 1ull << (c + k);
      }
    }
  }
  return bits;
}

template <typename Unit>
__global__ void __launch_bounds__(kFusedThreads, 1024 / kFusedThreads)
PackRowsFused(const Unit* __restrict__ src, const uint8_t* __restrict__ active,
              int64_t n_seq, int64_t width, int64_t capacity,
              int64_t units_per_row, FusedGeometry geo, Unit fill,
              PackInfoOut out, Unit* __restrict__ dst) {
  __shared__ int32_t cu[kFusedMaxSeq + 1];
  __shared__ int32_t source_of[kFusedMaxRowsPerBlock];
  __shared__ int32_t longest;
  const int64_t size = n_seq * width;
  const int per = geo.per_thread;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * per;
  const int64_t last = min(first + per, size);  // this thread's positions
  const uint64_t bits = first < size ? LoadMaskBits(active, size, first, per) : 0;
  const int count = __popcll(bits);
  int total;
  const int before = BlockExclusiveScan(count, &total);
  const int64_t kept = min(static_cast<int64_t>(total), capacity);
  const int64_t r0 = blockIdx.x * geo.rows_per_block;
  const int64_t r1 = min(r0 + geo.rows_per_block, capacity);
  // Only bit counts for most threads: the sequence starts in its positions,
  // and a walk over its set bits only where they are this block's rows.
  const int64_t seq0 = (first + width - 1) / width;
  for (int64_t s = seq0; s * width < last; ++s) {
    const int offset = static_cast<int>(s * width - first);  // < 64
    cu[s] = before + __popcll(bits & ((1ull << offset) - 1));
  }
  if (before < r1 && before + count > r0) {
    int row = before;
    for (uint64_t b = bits; b; b &= b - 1, ++row) {
      if (row >= r0 && row < r1) {
        source_of[row - r0] = static_cast<int32_t>(first + __ffsll(b) - 1);
      }
    }
  }
  // The scatter map: each block writes one slice of the positions.
  const int64_t p0 = blockIdx.x * geo.positions_per_block;
  const int64_t p1 = min(p0 + geo.positions_per_block, size);
  if (first < p1 && last > p0) {
    int row = before;
    for (int64_t p = first; p < last; ++p) {
      const bool on = (bits >> (p - first)) & 1u;
      if (p >= p0 && p < p1) out.scatter_map[p] = on && row < capacity ? row : -1;
      row += on;
    }
  }
  if (threadIdx.x == 0) {
    cu[n_seq] = total;
    longest = 0;
  }
  __syncthreads();

  if (blockIdx.x == 0) {  // the per-sequence fields and the scalars
    for (int64_t s = threadIdx.x; s <= n_seq; s += blockDim.x) {
      out.cu_seqlens[s] = cu[s];
      if (s < n_seq) {
        const int32_t len = cu[s + 1] - cu[s];
        out.seq_lens[s] = len;
        atomicMax(&longest, len);  // a max: the same whatever the order
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      *out.total = total;
      *out.num_dropped = total > capacity ? static_cast<int32_t>(total - capacity) : 0;
      *out.max_seqlen = longest;
    }
  }
  for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
    if (r < kept) {
      const int32_t p = source_of[r - r0];
      const int32_t s = static_cast<int32_t>(p / width);
      out.gather_map[r] = p;
      out.segment_ids[r] = s;
      out.positions[r] = static_cast<int32_t>(r) - cu[s];
      out.valid[r] = 1;
    } else {
      out.gather_map[r] = -1;
      out.segment_ids[r] = -1;
      out.positions[r] = 0;
      out.valid[r] = 0;
    }
  }
  if (r1 > r0) {
    CopyRows(src, dst, units_per_row, r0, static_cast<int>(r1 - r0), fill,
             [=](int64_t r) -> int64_t {
               return r < kept ? source_of[r - r0] : -1;
             });
  }
}

// Rows per block: `capacity` split evenly over `blocks` blocks (at most
// kFusedMaxRowsPerBlock rows each, the size of source_of).
FusedGeometry ChooseFusedGeometry(int64_t size, int64_t capacity,
                                  int64_t blocks) {
  FusedGeometry geo;
  geo.per_thread = static_cast<int>(
      ((size + kFusedThreads - 1) / kFusedThreads + 15) / 16 * 16);
  geo.rows_per_block = std::max<int64_t>(1, std::min<int64_t>(
      kFusedMaxRowsPerBlock, (capacity + blocks - 1) / blocks));
  geo.blocks = (capacity + geo.rows_per_block - 1) / geo.rows_per_block;
  geo.positions_per_block = (size + geo.blocks - 1) / geo.blocks;
  return geo;
}

template <typename Unit>
cudaError_t LaunchGather(cudaStream_t stream, const void* src,
                         const int32_t* idx, int64_t out_rows,
                         int64_t units_per_row, const uint8_t* pattern,
                         void* dst) {
  Unit fill;
  std::memcpy(&fill, pattern, sizeof(Unit));
  if (units_per_row >= 128 && units_per_row <= kMaxUnitsPerRow) {
    // About 1024 units per block (16 KB of 16-byte units).
    const int rows_per_block =
        static_cast<int>(std::max<int64_t>(1, 1024 / units_per_row));
    const int64_t blocks = (out_rows + rows_per_block - 1) / rows_per_block;
    GatherRowsPerBlock<Unit><<<static_cast<unsigned>(blocks), kThreads, 0,
                               stream>>>(static_cast<const Unit*>(src), idx,
                                         out_rows, units_per_row,
                                         rows_per_block, fill,
                                         static_cast<Unit*>(dst));
  } else {
    const int64_t n = out_rows * units_per_row;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
    GatherRowsFlat<Unit><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const Unit*>(src), idx, out_rows, units_per_row, fill,
        static_cast<Unit*>(dst));
  }
  return cudaGetLastError();
}

}  // namespace

int64_t PackInfoScratchBytes(int64_t size) {
  return 2 * sizeof(int32_t) * std::max<int64_t>(NumTiles(size), 1);
}

cudaError_t PackInfoFromMask(cudaStream_t stream, const uint8_t* active,
                             int64_t n_seq, int64_t width, int64_t capacity,
                             void* scratch, const PackInfoOut& out) {
  const int64_t size = n_seq * width;
  const int64_t n_tiles = NumTiles(size);
  if (size <= kSmallMask) {
    SmallMaskFields<<<1, kScanThreads, 0, stream>>>(active, n_seq, width,
                                                    capacity, out);
  } else {
    int32_t* tile_counts = static_cast<int32_t*>(scratch);
    int32_t* tile_offsets = tile_counts + n_tiles;
    TileCounts<<<static_cast<unsigned>(n_tiles), kThreads, 0, stream>>>(
        active, size, tile_counts);
    ScanTiles<<<1, kScanThreads, 0, stream>>>(tile_counts, n_tiles, capacity,
                                              n_seq, size, tile_offsets, out);
    TileFields<<<static_cast<unsigned>(n_tiles), kThreads, 0, stream>>>(
        active, size, width, capacity, tile_offsets, out);
  }
  const int64_t n = std::max(capacity, n_seq);
  if (n > 0) {
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
    FinishFields<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        n_seq, capacity, out);
  }
  return cudaGetLastError();
}

namespace {

// The fill as 16 bytes: the element's bytes repeated.
void FillPattern(uint64_t fill_bits, int64_t elem_bytes, uint8_t pattern[16]) {
  for (int i = 0; i < 16; ++i) {
    pattern[i] = static_cast<uint8_t>(fill_bits >> (8 * (i % elem_bytes)));
  }
}

}  // namespace

cudaError_t GatherRows(cudaStream_t stream, const void* src,
                       const int32_t* idx, int64_t out_rows, int64_t row_bytes,
                       int64_t elem_bytes, uint64_t fill_bits, void* dst) {
  if (out_rows == 0 || row_bytes == 0) return cudaSuccess;
  // The widest unit that divides the rows, is aligned in both buffers and
  // holds whole elements.
  uint8_t pattern[16];
  FillPattern(fill_bits, elem_bytes, pattern);
  const uintptr_t align =
      reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  for (int64_t unit : {16, 8, 4, 2, 1}) {
    if (unit < elem_bytes || row_bytes % unit != 0 || align % unit != 0) continue;
    const int64_t upr = row_bytes / unit;
    switch (unit) {
      case 16: return LaunchGather<uint4>(stream, src, idx, out_rows, upr, pattern, dst);
      case 8: return LaunchGather<uint2>(stream, src, idx, out_rows, upr, pattern, dst);
      case 4: return LaunchGather<uint32_t>(stream, src, idx, out_rows, upr, pattern, dst);
      case 2: return LaunchGather<uint16_t>(stream, src, idx, out_rows, upr, pattern, dst);
      default: return LaunchGather<uint8_t>(stream, src, idx, out_rows, upr, pattern, dst);
    }
  }
  return cudaErrorInvalidValue;  // rows not a whole number of elements
}

cudaError_t PackRows(cudaStream_t stream, const void* src,
                     const uint8_t* active, int64_t n_seq, int64_t width,
                     int64_t capacity, int64_t row_bytes, int64_t elem_bytes,
                     uint64_t fill_bits, void* scratch, const PackInfoOut& out,
                     void* dst) {
  const int64_t size = n_seq * width;
  const uintptr_t align = reinterpret_cast<uintptr_t>(src) |
                          reinterpret_cast<uintptr_t>(dst) |
                          reinterpret_cast<uintptr_t>(active);
  const bool fused = size > 0 && size <= kFusedMaxMask &&
                     n_seq <= kFusedMaxSeq && capacity > 0 && elem_bytes <= 16 &&
                     row_bytes > 0 && row_bytes % 16 == 0 && align % 16 == 0 &&
                     row_bytes / 16 <= kMaxUnitsPerRow;
  if (!fused) {  // the metadata kernels, then the gather
    cudaError_t status =
        PackInfoFromMask(stream, active, n_seq, width, capacity, scratch, out);
    if (status != cudaSuccess) return status;
    return GatherRows(stream, src, out.gather_map, capacity, row_bytes,
                      elem_bytes, fill_bits, dst);
  }
  // One wave of blocks, the rows split evenly: each block pays for its scan
  // of the mask once, while its SM copies nothing. On the H100 benchmark
  // shape: 65.3 us, against 67.8 us with 16 rows a block (4.7 waves, a scan
  // per 16 rows), 60.8 us for the same copy without the scan and 57.8 us for
  // GatherRows (benchmarks/results/experiments/h100-2026-11-22/
  // pack_fused_variants.txt).
  const FusedGeometry geo = ChooseFusedGeometry(
      size, capacity,
      static_cast<int64_t>(std::max(CurrentDeviceInfo().sm_count, 1)) *
          (1024 / kFusedThreads));
  const int64_t upr = row_bytes / 16;
  uint8_t pattern[16];
  FillPattern(fill_bits, elem_bytes, pattern);
  uint4 fill;
  std::memcpy(&fill, pattern, sizeof(fill));
  PackRowsFused<uint4><<<static_cast<unsigned>(geo.blocks), kFusedThreads, 0,
                         stream>>>(static_cast<const uint4*>(src), active, n_seq,
                                   width, capacity, upr, geo, fill,
                                   out, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

}  // namespace rlk
