// pack / unpack as CUDA kernels: the PackInfo of a mask and the row gather
// every move (pack, unpack and their gradients) is made of. Integer
// bookkeeping and byte copies only, so any correct implementation gives the
// same bits; these exist to be launched from torch without a JAX call (the
// torch bridge's per-call cost) and from JAX through XLA FFI.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace rlk {

// The fields of rlk_jax.PackInfo (int32 except `valid`, one byte 0/1).
struct PackInfoOut {
  int32_t* cu_seqlens;   // [n_seq + 1]
  int32_t* seq_lens;     // [n_seq]
  int32_t* total;        // []
  int32_t* max_seqlen;   // []
  int32_t* num_dropped;  // []
  int32_t* segment_ids;  // [capacity]
  int32_t* positions;    // [capacity]
  uint8_t* valid;        // [capacity]
  int32_t* gather_map;   // [capacity]
  int32_t* scatter_map;  // [n_seq * width]
};

// Scratch bytes PackInfoFromMask needs for a mask of `size` positions.
int64_t PackInfoScratchBytes(int64_t size);

// `active`: n_seq * width bytes, 0 or 1 (sequence-major; PackRows relies on
// it too). Four kernels on
// `stream`: per-tile counts, one scan over the tiles, the per-position and
// per-row fields, then the pad rows and per-sequence fields.
cudaError_t PackInfoFromMask(cudaStream_t stream, const uint8_t* active,
                             int64_t n_seq, int64_t width, int64_t capacity,
                             void* scratch, const PackInfoOut& out);

// dst[r] = idx[r] >= 0 ? src[idx[r]] : a row of `fill` (the element's bytes,
// `elem_bytes` of them), for r < out_rows; rows are `row_bytes` long.
cudaError_t GatherRows(cudaStream_t stream, const void* src,
                       const int32_t* idx, int64_t out_rows, int64_t row_bytes,
                       int64_t elem_bytes, uint64_t fill_bits, void* dst);

// pack from a mask: dst [capacity rows] and every PackInfo field. Masks of
// up to 65536 positions and 4096 sequences with 16-byte rows take one
// kernel; others the PackInfoFromMask kernels and GatherRows (`scratch`:
// PackInfoScratchBytes(n_seq * width) bytes).
cudaError_t PackRows(cudaStream_t stream, const void* src,
                     const uint8_t* active, int64_t n_seq, int64_t width,
                     int64_t capacity, int64_t row_bytes, int64_t elem_bytes,
                     uint64_t fill_bits, void* scratch, const PackInfoOut& out,
                     void* dst);

}  // namespace rlk
