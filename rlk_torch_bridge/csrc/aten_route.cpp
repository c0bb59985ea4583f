// The C++ part of batch_invariant_mode's aten route (_aten_route.py): while
// it is on, aten::linear and aten::mean.dim on CUDA tensors run det_gemm's
// forward product and the row kernel from C++ when a call needs no
// gradient.
//
// Why: an eager decode step is hundreds of small calls, so its time is the
// host's. The Python aten kernels cost each replaced call a Python frame,
// the handler's checks and a second dispatch; the two most frequent calls
// of a decoder layer (its seven products and two RMSNorm means) pay that
// here in neither.
//
// Bits: the same kernels with the same configs as the Python route. A
// product's config is the one the Python route planned for the shape
// (remember_linear, from _sm90._plan): until it has, or for any call
// this file does not take (a bias, another dtype, a gradient to record, an
// f32 product), the call goes to the kernel registered before this route,
// which is the Python route's handler.
//
// Registered on top of the Python route's kernels and removed before them
// (cpp_route_enter/exit), so the kernel each fallback calls is alive while
// this route is.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "rlk_torch.h"

namespace {

struct ProductKey {
  int64_t m, n, k;
  int dtype, device;
  bool operator==(const ProductKey& o) const {
    return m == o.m && n == o.n && k == o.k && dtype == o.dtype &&
           device == o.device;
  }
};

struct ProductKeyHash {
  size_t operator()(const ProductKey& p) const {
    size_t h = std::hash<int64_t>()(p.m);
    for (int64_t v : {p.n, p.k, int64_t(p.dtype), int64_t(p.device)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

std::mutex plans_mutex;
std::unordered_map<ProductKey, int64_t, ProductKeyHash> linear_plans;

// x [..., K] @ weight[N, K]ᵀ with `config` as its forward config, planned
// by the Python route for implementation=None (the mode's default). Never
// forgotten (the Python route's own cache may be, and does not plan a shape
// again until then): a shape past the bound stays on the Python route.
constexpr size_t kMaxPlans = 1 << 16;

void RememberLinear(int64_t m, int64_t n, int64_t k, at::ScalarType dtype,
                    int64_t device, int64_t config) {
  const std::lock_guard<std::mutex> lock(plans_mutex);
  if (linear_plans.size() < kMaxPlans)
    linear_plans[{m, n, k, int(dtype), int(device)}] = config;
}

std::optional<int64_t> LinearPlan(const ProductKey& key) {
  const std::lock_guard<std::mutex> lock(plans_mutex);
  const auto it = linear_plans.find(key);
  if (it == linear_plans.end()) return std::nullopt;
  return it->second;
}

bool NeedsGrad(const at::Tensor& t) {
  return at::GradMode::is_enabled() && t.requires_grad();
}

// The kernels each fallback calls (the Python route's), and this route's
// registrations.
std::optional<c10::SafeKernelFunction> previous_linear;
std::optional<c10::SafeKernelFunction> previous_mean_autograd;
std::optional<c10::SafeKernelFunction> previous_mean_cuda;
std::unique_ptr<torch::Library> at_autograd;
std::unique_ptr<torch::Library> at_cuda;

// aten::linear(Tensor input, Tensor weight, Tensor? bias=None)
void Linear(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
            torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const c10::IValue& bias = (*stack)[n - 1];
  const c10::IValue& xv = (*stack)[n - 3];
  const c10::IValue& wv = (*stack)[n - 2];
  if (bias.isNone() && xv.isTensor() && wv.isTensor()) {
    const at::Tensor& x = xv.toTensor();
    const at::Tensor& w = wv.toTensor();
    const at::ScalarType t = x.scalar_type();
    if ((t == at::kBFloat16 || t == at::kHalf) && w.scalar_type() == t &&
        x.is_cuda() && w.device() == x.device() && w.dim() == 2 &&
        x.dim() >= 1 && x.size(-1) > 1 && !NeedsGrad(x) && !NeedsGrad(w)) {
      const int64_t k = x.size(-1);
      const ProductKey key{x.numel() / k, w.size(0), k, int(t),
                           int(x.device().index())};
      if (key.m > 0 && w.size(1) == k) {
        if (const auto config = LinearPlan(key)) {
          at::Tensor out = rlk_torch::DetMmForward(x, w, true, t, *config);
          torch::jit::drop(*stack, 3);
          torch::jit::push(*stack, std::move(out));
          return;
        }
      }
    }
  }
  previous_linear->callBoxed(op, keys, stack);
}

// aten::mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *,
// ScalarType? dtype=None): the last dimension alone, no dtype.
bool MeanTakes(const torch::jit::Stack& stack) {
  const size_t n = stack.size();
  const c10::IValue& xv = stack[n - 4];
  const c10::IValue& dim = stack[n - 3];
  if (!xv.isTensor() || !stack[n - 1].isNone() || !dim.isIntList())
    return false;
  const at::Tensor& x = xv.toTensor();
  const at::ScalarType t = x.scalar_type();
  if (!(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) ||
      !x.is_cuda() || x.dim() < 1 || x.size(-1) == 0 || NeedsGrad(x))
    return false;
  const auto dims = dim.toIntList();
  return dims.size() == 1 && (dims[0] == -1 || dims[0] == x.dim() - 1);
}

void MeanOn(torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const at::Tensor x = (*stack)[n - 4].toTensor();
  const bool keepdim = (*stack)[n - 2].toBool();
  at::Tensor out = rlk_torch::RowReduce(x, static_cast<double>(x.size(-1)));
  torch::jit::drop(*stack, 4);
  torch::jit::push(*stack, keepdim ? out.unsqueeze(-1) : out);
}

// One kernel per dispatch key, each falling back to what was there before.
template <std::optional<c10::SafeKernelFunction>* previous>
void Mean(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
          torch::jit::Stack* stack) {
  if (MeanTakes(*stack)) return MeanOn(stack);
  (*previous)->callBoxed(op, keys, stack);
}

c10::SafeKernelFunction KernelBefore(const char* name, const char* overload,
                                     c10::DispatchKey key) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, overload)
      .getComputedKernelForDispatchKey(key);
}

void Exit() {
  at_autograd.reset();
  at_cuda.reset();
  previous_linear.reset();
  previous_mean_autograd.reset();
  previous_mean_cuda.reset();
}

void Enter() {
  TORCH_CHECK(!at_autograd, "rlk::cpp_route_enter: the route is already on");
  previous_linear = KernelBefore("aten::linear", "",
                                 c10::DispatchKey::AutogradCUDA);
  previous_mean_autograd = KernelBefore("aten::mean", "dim",
                                        c10::DispatchKey::AutogradCUDA);
  previous_mean_cuda = KernelBefore("aten::mean", "dim",
                                    c10::DispatchKey::CUDA);
  try {
    at_autograd = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", c10::DispatchKey::AutogradCUDA,
        __FILE__, __LINE__);
    at_autograd->impl("linear",
                      torch::CppFunction::makeFromBoxedFunction<&Linear>());
    at_autograd->impl(
        "mean.dim", torch::CppFunction::makeFromBoxedFunction<
                    &Mean<&previous_mean_autograd>>());
    at_cuda = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__,
        __LINE__);
    at_cuda->impl("mean.dim",
                  torch::CppFunction::makeFromBoxedFunction<
                    &Mean<&previous_mean_cuda>>());
  } catch (...) {
    Exit();
    throw;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlk, m) {
  m.def("remember_linear(int m, int n, int k, ScalarType dtype, int device, "
        "int config) -> ()", &RememberLinear);
  m.def("cpp_route_enter() -> ()", &Enter);
  m.def("cpp_route_exit() -> ()", &Exit);
}
