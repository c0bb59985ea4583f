// rlk::row_reduce_sm90: the cuda_ffi library's row kernel
// (row_reduce_kernels.cu: each row's bits its own whatever the batch) for
// torch tensors, on torch's current stream. rlk::det_row_mean and
// rlk::det_row_sum call it from Python and the C++ decoding route
// (aten_route.cpp) from C++: one kernel, so one set of bits.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#include "rlk_torch.h"

namespace {

using Entry = const char* (*)(void* stream, const void* x, void* out,
                              int64_t rows, int64_t k, int64_t row_stride,
                              float divisor, int dtype);

std::atomic<Entry> row_reduce_entry{nullptr};

void SetRowReduceEntry(int64_t address) {
  row_reduce_entry.store(reinterpret_cast<Entry>(address));
}

int DtypeCode(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

at::Tensor RowReduceOp(const at::Tensor& x, double divisor) {
  return rlk_torch::RowReduce(x, divisor);
}

}  // namespace

namespace rlk_torch {

at::Tensor RowReduce(const at::Tensor& x, double divisor) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0,
              "rlk::row_reduce_sm90: needs rows of at least one element, got ",
              x.sizes());
  const int code = DtypeCode(x.scalar_type());
  TORCH_CHECK(code >= 0, "rlk::row_reduce_sm90: float32, bfloat16 or "
              "float16 rows, got ", x.scalar_type());
  const int64_t k = x.size(-1);
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(-1) != 1) rows = rows.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor out = at::empty(shape, x.options());
  if (rows.size(0) == 0) return out;
  const Entry entry = row_reduce_entry.load();
  TORCH_CHECK(entry != nullptr,
              "rlk::row_reduce_sm90: the cuda_ffi library's entry is not set");
  const c10::cuda::CUDAGuard guard(x.device());
  const char* error = entry(
      c10::cuda::getCurrentCUDAStream(x.device().index()).stream(),
      rows.data_ptr(), out.data_ptr(), rows.size(0), k, rows.stride(0),
      static_cast<float>(divisor), code);
  TORCH_CHECK(error == nullptr, error);
  return out;
}

}  // namespace rlk_torch

TORCH_LIBRARY_FRAGMENT(rlk, m) {
  m.def("row_reduce_sm90(Tensor x, float divisor) -> Tensor");
  m.def("set_row_reduce_entry(int address) -> ()", &SetRowReduceEntry);
}

TORCH_LIBRARY_IMPL(rlk, CUDA, m) { m.impl("row_reduce_sm90", &RowReduceOp); }
