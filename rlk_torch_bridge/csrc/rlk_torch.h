// What the extension's files share: det_gemm's forward product and the row
// reduction, each on the cuda_ffi library's kernels (so on the same bits
// as every other route to them).
#pragma once

#include <ATen/ATen.h>

namespace rlk_torch {

// a [..., K] (rows flattened) @ op(b), b [K, N] ([N, K] with transpose_b),
// with the forward config `config`: det_mm_sm90.cpp.
at::Tensor DetMmForward(const at::Tensor& a, const at::Tensor& b,
                        bool transpose_b, at::ScalarType out_dtype,
                        int64_t config);

// sum(x[..., :]) / divisor over the last dimension, x's dtype (float32,
// bfloat16 or float16), shape x.shape[:-1]: row_reduce.cpp.
at::Tensor RowReduce(const at::Tensor& x, double divisor);

}  // namespace rlk_torch
