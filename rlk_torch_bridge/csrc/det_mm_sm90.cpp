// rlk::det_mm_sm90: det_gemm's SM90 kernels for torch with the autograd in
// C++. The Python autograd.Function route costs a Python autograd node per
// product in the backward (about 0.1 ms of host time per forward + backward
// on the H100's host, as much as the same node costs around torch's own
// products); here the backward's two products launch from C++ on the
// autograd thread, with no Python and no GIL.
//
// The kernels are the cuda_ffi library's (its C entry rlk_det_gemm_sm90,
// handed over as an address by set_sm90_entry), so the bits are those of
// rlk::det_mm and rlk_jax: every config returns the same bits, and the
// backward runs rlk_jax's VJP products in the same layouts (the cotangent
// cast to a's dtype first, as JAX does). The configs of the three products
// come from Python, where the autotuner and the tuned tables live.
//
// Stream order holds by construction: every launch is on torch's current
// stream and reads and writes torch tensors, which the stream-ordered
// caching allocator cannot hand out again before the kernel ran.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#include "rlk_torch.h"

namespace {

using Entry = const char* (*)(int transpose_a, int transpose_b, int out_f32,
                              const void* a, const void* b, void* c,
                              int64_t m, int64_t n, int64_t k, int64_t config,
                              void* workspace, size_t workspace_bytes,
                              void* stream);

std::atomic<Entry> sm90_entry{nullptr};

void set_sm90_entry(int64_t address) {
  sm90_entry.store(reinterpret_cast<Entry>(address));
}

// TMA reads from 16-byte aligned addresses: a view at an odd offset is
// copied (values, so bits, unchanged).
at::Tensor Aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// op(a) @ op(b) for 2-D operands stored row-major: a [M, K] ([K, M] when
// transpose_a), b [K, N] ([N, K] when transpose_b).
at::Tensor Product(const at::Tensor& a_in, const at::Tensor& b_in,
                   bool transpose_a, bool transpose_b,
                   at::ScalarType out_dtype, int64_t config) {
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2,
              "rlk::det_mm_sm90: 2-D products only, got a ", a_in.sizes(),
              " and b ", b_in.sizes());
  const int64_t m = transpose_a ? a_in.size(1) : a_in.size(0);
  const int64_t k = transpose_a ? a_in.size(0) : a_in.size(1);
  const int64_t n = transpose_b ? b_in.size(0) : b_in.size(1);
  TORCH_CHECK(k == (transpose_b ? b_in.size(1) : b_in.size(0)),
              "rlk::det_mm_sm90: inner dimensions differ: a ", a_in.sizes(),
              ", b ", b_in.sizes());
  at::Tensor c = at::empty({m, n}, a_in.options().dtype(out_dtype));
  if (m == 0 || n == 0) return c;
  if (k == 0) return c.zero_();  // an empty sum
  const at::Tensor a = Aligned(a_in), b = Aligned(b_in);
  const Entry entry = sm90_entry.load();
  TORCH_CHECK(entry != nullptr,
              "rlk::det_mm_sm90: the cuda_ffi library's entry is not set");
  const c10::cuda::CUDAGuard guard(a.device());
  const char* error = entry(
      transpose_a, transpose_b, out_dtype == at::kFloat, a.data_ptr(),
      b.data_ptr(), c.data_ptr(), m, n, k, config, nullptr, 0,
      c10::cuda::getCurrentCUDAStream(a.device().index()).stream());
  TORCH_CHECK(error == nullptr, error);
  return c;
}

at::Tensor DetMmKernel(const at::Tensor& a, const at::Tensor& b,
                       bool transpose_b, at::ScalarType out_dtype,
                       int64_t config, int64_t config_da, int64_t config_db) {
  (void)config_da;
  (void)config_db;
  return rlk_torch::DetMmForward(a, b, transpose_b, out_dtype, config);
}

class DetMmSm90 : public torch::autograd::Function<DetMmSm90> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& a, const at::Tensor& b,
                            bool transpose_b, at::ScalarType out_dtype,
                            int64_t config, int64_t config_da,
                            int64_t config_db) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["transpose_b"] = transpose_b;
    ctx->saved_data["config_da"] = config_da;
    ctx->saved_data["config_db"] = config_db;
    const at::AutoDispatchBelowADInplaceOrView below;
    return rlk_torch::DetMmForward(a, b, transpose_b, out_dtype, config);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    // The products below record no graph. Where a second derivative could
    // flow through them (a differentiable cotangent under create_graph) it
    // would be silently missing, so that is refused, as the Python route's
    // once_differentiable does.
    TORCH_CHECK(!(at::GradMode::is_enabled() && grads[0].requires_grad()),
                "rlk::det_mm_sm90: double backward is not supported");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const bool transpose_b = ctx->saved_data["transpose_b"].toBool();
    const int64_t config_da = ctx->saved_data["config_da"].toInt();
    const int64_t config_db = ctx->saved_data["config_db"].toInt();
    const at::Tensor g = grads[0].to(a.scalar_type()).reshape(
        {-1, grads[0].size(-1)});
    at::Tensor da, db;
    if (ctx->needs_input_grad(0)) {  // g @ op(b)ᵀ, a's rows
      da = Product(g, b, false, !transpose_b, a.scalar_type(), config_da)
               .view(a.sizes());
    }
    if (ctx->needs_input_grad(1)) {  // a's rows ᵀ-multiplied, b's layout
      const at::Tensor rows = a.reshape({-1, a.size(-1)});
      db = transpose_b
               ? Product(g, rows, true, false, b.scalar_type(), config_db)
               : Product(rows, g, true, false, b.scalar_type(), config_db);
    }
    return {da, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor DetMmAutograd(const at::Tensor& a, const at::Tensor& b,
                         bool transpose_b, at::ScalarType out_dtype,
                         int64_t config, int64_t config_da,
                         int64_t config_db) {
  return DetMmSm90::apply(a, b, transpose_b, out_dtype, config, config_da,
                          config_db);
}

}  // namespace

namespace rlk_torch {

// The forward: a [..., K] (rows flattened) @ op(b).
at::Tensor DetMmForward(const at::Tensor& a, const at::Tensor& b,
                        bool transpose_b, at::ScalarType out_dtype,
                        int64_t config) {
  TORCH_CHECK(a.dim() >= 1, "rlk::det_mm_sm90: a needs a K dimension");
  const at::Tensor rows = a.reshape({-1, a.size(-1)});
  at::Tensor c = Product(rows, b, false, transpose_b, out_dtype, config);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(c.size(1));
  // In place, not a view: autograd forbids modifying in place a view that
  // an autograd function made (Falcon's `mlp_output += attention_output`).
  return c.resize_(shape);
}

}  // namespace rlk_torch

TORCH_LIBRARY_FRAGMENT(rlk, m) {
  m.def("det_mm_sm90(Tensor a, Tensor b, bool transpose_b, "
        "ScalarType out_dtype, int config, int config_da, int config_db) "
        "-> Tensor");
  m.def("set_sm90_entry(int address) -> ()", &set_sm90_entry);
}

TORCH_LIBRARY_IMPL(rlk, CUDA, m) { m.impl("det_mm_sm90", &DetMmKernel); }

TORCH_LIBRARY_IMPL(rlk, Autograd, m) {
  m.impl("det_mm_sm90", &DetMmAutograd);
}
