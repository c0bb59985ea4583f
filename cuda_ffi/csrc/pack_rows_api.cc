// Entry points of the pack kernels: XLA FFI handlers (JAX) and plain C
// functions (the torch bridge, on torch's current stream). Both launch the
// same kernels (pack_rows.h).
// The handlers are command-buffer compatible (ffi_traits.h): the scratch
// is an XLA-allocated result.
#include <cstdint>
#include <string>
#include <utility>

#include <cuda_runtime.h>

#include "ffi_traits.h"
#include "pack_rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace rlk {
namespace {

thread_local std::string pack_error;

const char* ErrorOf(cudaError_t status) {
  if (status == cudaSuccess) return nullptr;
  pack_error = std::string("rlk cuda_ffi pack: ") + cudaGetErrorString(status);
  return pack_error.c_str();
}

using Field = ffi::Result<ffi::AnyBuffer>;

PackInfoOut InfoOut(Field& cu, Field& seq_lens, Field& total, Field& max_seqlen,
                    Field& num_dropped, Field& segment_ids, Field& positions,
                    Field& valid, Field& gather_map, Field& scatter_map) {
  auto i32 = [](Field& b) { return static_cast<int32_t*>(b->untyped_data()); };
  return PackInfoOut{i32(cu), i32(seq_lens), i32(total), i32(max_seqlen),
                     i32(num_dropped), i32(segment_ids), i32(positions),
                     static_cast<uint8_t*>(valid->untyped_data()),
                     i32(gather_map), i32(scatter_map)};
}

// What both pack handlers need of their mask and scratch: a bool mask of
// n_seq * width elements, and PackInfoScratchBytes of it in the scratch.
ffi::Error CheckMask(ffi::AnyBuffer& active, Field& scratch, int64_t n_seq,
                     int64_t width, const char* who) {
  if (active.element_type() != ffi::PRED ||
      static_cast<int64_t>(active.element_count()) != n_seq * width) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": the mask must be bool with n_seq * width = " +
        std::to_string(n_seq * width) + " elements");
  }
  const int64_t needed = PackInfoScratchBytes(n_seq * width);
  if (static_cast<int64_t>(scratch->size_bytes()) < needed) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": the scratch result needs " +
        std::to_string(needed) + " bytes, got " +
        std::to_string(scratch->size_bytes()));
  }
  return ffi::Error::Success();
}

ffi::Error PackInfoFfi(cudaStream_t stream, ffi::AnyBuffer active, Field cu,
                       Field seq_lens, Field total, Field max_seqlen,
                       Field num_dropped, Field segment_ids, Field positions,
                       Field valid, Field gather_map, Field scatter_map,
                       Field scratch, int64_t n_seq, int64_t width,
                       int64_t capacity) {
  if (auto e = CheckMask(active, scratch, n_seq, width,
                         "rlk cuda_ffi pack_info");
      e.failure()) {
    return e;
  }
  const PackInfoOut out = InfoOut(cu, seq_lens, total, max_seqlen, num_dropped,
                                  segment_ids, positions, valid, gather_map,
                                  scatter_map);
  const char* error = ErrorOf(PackInfoFromMask(
      stream, static_cast<const uint8_t*>(active.untyped_data()), n_seq, width,
      capacity, scratch->untyped_data(), out));
  return error ? ffi::Error::Internal(error) : ffi::Error::Success();
}

ffi::Error PackRowsFfi(cudaStream_t stream, ffi::AnyBuffer src,
                       ffi::AnyBuffer active, Field dst, Field cu,
                       Field seq_lens, Field total, Field max_seqlen,
                       Field num_dropped, Field segment_ids, Field positions,
                       Field valid, Field gather_map, Field scatter_map,
                       Field scratch, int64_t n_seq, int64_t width,
                       int64_t capacity, int64_t fill_bits) {
  if (auto e = CheckMask(active, scratch, n_seq, width,
                         "rlk cuda_ffi pack_rows");
      e.failure()) {
    return e;
  }
  auto ds = src.dimensions(), dd = dst->dimensions();
  if (ds.size() != 2 || dd.size() != 2 || ds[0] != n_seq * width ||
      ds[1] != dd[1] || dd[0] != capacity ||
      src.element_type() != dst->element_type()) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi pack_rows: src [n_seq * width, D] and dst [capacity, D] "
        "of src's dtype expected");
  }
  const int64_t elem_bytes = ffi::ByteWidth(src.element_type());
  const char* error = ErrorOf(PackRows(
      stream, src.untyped_data(),
      static_cast<const uint8_t*>(active.untyped_data()), n_seq, width,
      capacity, ds[1] * elem_bytes, elem_bytes, static_cast<uint64_t>(fill_bits),
      scratch->untyped_data(),
      InfoOut(cu, seq_lens, total, max_seqlen, num_dropped, segment_ids,
              positions, valid, gather_map, scatter_map),
      dst->untyped_data()));
  return error ? ffi::Error::Internal(error) : ffi::Error::Success();
}

ffi::Error GatherRowsFfi(cudaStream_t stream, ffi::AnyBuffer src,
                         ffi::Buffer<ffi::S32> idx,
                         ffi::Result<ffi::AnyBuffer> dst, int64_t fill_bits) {
  auto ds = src.dimensions(), dd = dst->dimensions();
  if (ds.size() != 2 || dd.size() != 2 || ds[1] != dd[1] ||
      src.element_type() != dst->element_type() ||
      static_cast<int64_t>(idx.element_count()) != dd[0]) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi gather_rows: src [N, D], idx [M] and dst [M, D] of one "
        "dtype expected");
  }
  const int64_t elem_bytes = ffi::ByteWidth(src.element_type());
  const char* error = ErrorOf(GatherRows(
      stream, src.untyped_data(), idx.typed_data(), dd[0], dd[1] * elem_bytes,
      elem_bytes, static_cast<uint64_t>(fill_bits), dst->untyped_data()));
  return error ? ffi::Error::Internal(error) : ffi::Error::Success();
}

}  // namespace
}  // namespace rlk


namespace {

// The ten PackInfo fields (rlk_jax.PackInfo's order) and the scratch as
// results, then the mask's shape and the capacity as attributes.
template <typename Binding>
auto WithPackInfo(Binding&& binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()  // scratch
      .template Attr<int64_t>("n_seq")
      .template Attr<int64_t>("width")
      .template Attr<int64_t>("capacity");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkPackInfo, rlk::PackInfoFfi,
                              WithPackInfo(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()),
                              RLK_FFI_TRAITS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkPackRows, rlk::PackRowsFfi,
                              WithPackInfo(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("fill_bits"),
                              RLK_FFI_TRAITS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkGatherRows, rlk::GatherRowsFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fill_bits"),
                              RLK_FFI_TRAITS);

namespace rlk {
namespace {

// The C entries' ten field pointers, in PackInfoOut's order.
PackInfoOut InfoOutOf(void* cu_seqlens, void* seq_lens, void* total,
                      void* max_seqlen, void* num_dropped, void* segment_ids,
                      void* positions, void* valid, void* gather_map,
                      void* scatter_map) {
  auto i32 = [](void* p) { return static_cast<int32_t*>(p); };
  return PackInfoOut{i32(cu_seqlens), i32(seq_lens), i32(total),
                     i32(max_seqlen), i32(num_dropped), i32(segment_ids),
                     i32(positions), static_cast<uint8_t*>(valid),
                     i32(gather_map), i32(scatter_map)};
}

}  // namespace
}  // namespace rlk

extern "C" {

// The torch bridge's entries: launch on `stream` (torch's current stream).
// Return NULL, or a message valid until the next call on this thread.

int64_t rlk_pack_info_scratch_bytes(int64_t size) {
  return rlk::PackInfoScratchBytes(size);
}

const char* rlk_pack_rows(void* stream, const void* src, const void* active,
                          int64_t n_seq, int64_t width, int64_t capacity,
                          int64_t row_bytes, int64_t elem_bytes,
                          uint64_t fill_bits, void* scratch, void* cu_seqlens,
                          void* seq_lens, void* total, void* max_seqlen,
                          void* num_dropped, void* segment_ids,
                          void* positions, void* valid, void* gather_map,
                          void* scatter_map, void* dst) {
  using namespace rlk;
  const PackInfoOut out =
      InfoOutOf(cu_seqlens, seq_lens, total, max_seqlen, num_dropped,
                segment_ids, positions, valid, gather_map, scatter_map);
  return ErrorOf(PackRows(static_cast<cudaStream_t>(stream), src,
                          static_cast<const uint8_t*>(active), n_seq, width,
                          capacity, row_bytes, elem_bytes, fill_bits, scratch,
                          out, dst));
}

const char* rlk_gather_rows(void* stream, const void* src, const void* idx,
                            int64_t out_rows, int64_t row_bytes,
                            int64_t elem_bytes, uint64_t fill_bits,
                            void* dst) {
  using namespace rlk;
  return ErrorOf(GatherRows(static_cast<cudaStream_t>(stream), src,
                            static_cast<const int32_t*>(idx), out_rows,
                            row_bytes, elem_bytes, fill_bits, dst));
}

}  // extern "C"
