"""Where an eager rlk_torch_bridge.det_gemm call spends its host time, on a
GPU: per-piece timings and a cProfile of forward and forward + backward
loops at a launch-bound size. `python lab/profile_torch_ops.py`."""

import cProfile
import pstats
import time

import torch

import cuda_ffi
import rlk_torch_bridge as rtb
from rlk_torch_bridge import _gemm_op, _sm90


def per_call_us(fn, n=2000):
  for _ in range(50):
    fn()
  torch.cuda.synchronize()
  start = time.perf_counter()
  for _ in range(n):
    fn()
  torch.cuda.synchronize()
  return (time.perf_counter() - start) / n * 1e6


x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
c = torch.empty(16, 256, device="cuda", dtype=torch.bfloat16)
xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
g = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
stream = torch.cuda.current_stream().cuda_stream
lib = cuda_ffi.library()
product = _sm90.product_launcher(16, 256, 256, False, True, torch.bfloat16)


class _PyLinear(torch.autograd.Function):
  """torch's own products behind a Python autograd.Function: what the
  Python backward route itself costs, without rlk."""

  @staticmethod
  def forward(ctx, a, b):
    ctx.save_for_backward(a, b)
    return torch.nn.functional.linear(a, b)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    a, b = ctx.saved_tensors
    return g @ b, g.t() @ a


def _main_thread_backward():
  # rlk's forward and its two backward launches, no autograd engine.
  rtb.det_gemm(x, w, transpose_b=True)
  _gemm_op._kernel(g, w, False, False, torch.bfloat16, "cuda_ffi")
  _gemm_op._kernel(g, x, True, False, torch.bfloat16, "cuda_ffi")


pieces = {
    "torch F.linear": lambda: torch.nn.functional.linear(x, w),
    "torch.empty": lambda: torch.empty(16, 256, device="cuda", dtype=torch.bfloat16),
    "raw ctypes launch": lambda: lib.rlk_det_gemm_sm90(
        0, 1, 0, x.data_ptr(), w.data_ptr(), c.data_ptr(), 16, 256, 256, 0,
        None, 0, stream),
    "cuda_ffi.launch": lambda: cuda_ffi.launch(
        x.data_ptr(), w.data_ptr(), c.data_ptr(), 16, 256, 256,
        transpose_a=False, transpose_b=True, out_f32=False, stream=stream),
    "_sm90 product": lambda: product(x, w),
    "op below autograd": lambda: _gemm_op.OP(x, w, False, True, torch.bfloat16, None),
    "rtb.det_gemm": lambda: rtb.det_gemm(x, w, transpose_b=True),
    "torch fwd+bwd": lambda: torch.nn.functional.linear(xg, wg).backward(g),
    "rtb fwd+bwd": lambda: rtb.det_gemm(xg, wg, transpose_b=True).backward(g),
    # The backward's two products, called below autograd on the main thread.
    "py Function fwd+bwd": lambda: _PyLinear.apply(xg, wg).backward(g),
    "rlk 3 launches, no engine": _main_thread_backward,
    "dA product (g @ w)": lambda: _gemm_op._kernel(
        g, w, False, False, torch.bfloat16, "cuda_ffi"),
    "dB product (g^T @ x)": lambda: _gemm_op._kernel(
        g, x, True, False, torch.bfloat16, "cuda_ffi"),
}
import threading
print("python threads:", [t.name for t in threading.enumerate()])
for name, fn in pieces.items():
  print(f"{name:24s} {per_call_us(fn):8.1f} us")

for name in ("rtb.det_gemm", "rtb fwd+bwd"):
  profile = cProfile.Profile()
  profile.enable()
  per_call_us(pieces[name], n=1000)
  profile.disable()
  print(f"--- {name}")
  pstats.Stats(profile).sort_stats("tottime").print_stats(18)

# The GPU's side: each kernel's device time in forward + backward steps.
for name in ("torch fwd+bwd", "rtb fwd+bwd"):
  with torch.profiler.profile(activities=[
      torch.profiler.ProfilerActivity.CPU,
      torch.profiler.ProfilerActivity.CUDA]) as prof:
    per_call_us(pieces[name], n=200)
  print(f"--- {name}: kernels")
  print(prof.key_averages().table(sort_by="self_device_time_total",
                                   row_limit=12))
