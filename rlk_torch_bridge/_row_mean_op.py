"""``rlk::det_row_mean`` and ``rlk::det_row_sum``: the mean (an RMSNorm's
``x.pow(2).mean(-1)``) and the sum (the gradient of an RMSNorm's per-row
scale) over the last dimension of a bf16, f16 or f32 tensor, each row's
bits its own whatever the batch.

On a GPU where the cuda_ffi library runs (SM90) the row kernel is its
``row_reduce_kernels.cu``, one launch on torch's stream: through the C++
extension (``rlk::row_reduce_sm90``) where it loads, else through ctypes;
the C++ decoding route (``csrc/aten_route.cpp``) calls the same kernel, so
every route gives the same bits. On other GPUs the row kernel of
``triton_kernels.row_sum``. Both fix a summation order per row length
(their modules say why). Elsewhere, or without Triton, the row is a
det_gemm product with a ones vector (``x @ ones[K, 1]``), row-invariant by
det_gemm's contract. Each way the float32 sum is divided by K (the mean;
by 1, exactly, for the sum) and rounded once to x's dtype, as torch's own
mean does. (The two kernels need not give each other's bits: a process
uses one of them on a given device.)
"""

from __future__ import annotations

import functools

import torch

from rlk_torch_bridge import _cpp_extension, _gemm_op, _library
from rlk_torch_bridge._checks import start_jax
from rlk_torch_bridge._torch_stream import on_device


@functools.cache
def _triton_importable() -> bool:
  from triton_kernels.backend import triton
  return triton is not None


@functools.cache
def _library_kernel() -> bool:
  """Whether CUDA rows take the cuda_ffi library's kernel (an SM90 GPU with
  the library; the same condition as det_gemm's SM90 route)."""
  import cuda_ffi
  start_jax()  # the library's check asks JAX for its GPUs
  return cuda_ffi.unavailable_reason("gpu") is None


def _on_row_kernel(x: torch.Tensor) -> bool:
  return x.is_cuda and _triton_importable()


def _on_rows(x, divisor: int, launch):
  """A row kernel (``launch(rows, out, divisor)``) over x's rows: out in
  x's dtype, shape x.shape[:-1]."""
  rows = x.reshape(-1, x.shape[-1])
  rows = rows if rows.stride(-1) == 1 else rows.contiguous()
  out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
  if rows.shape[0]:
    with on_device(x.device.index):
      launch(rows, out, divisor)
  return out.reshape(x.shape[:-1])


def _library_launch(rows, out, divisor):
  import cuda_ffi
  with torch.cuda.device(rows.device):
    cuda_ffi.launch_row_reduce(
        torch.cuda.current_stream().cuda_stream, rows.data_ptr(),
        out.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
        float(divisor), str(rows.dtype).removeprefix("torch."))


def _through_ctypes(x, divisor: int):
  """The cuda_ffi row kernel through ctypes (where the C++ extension does
  not load)."""
  return _on_rows(x, divisor, _library_launch)


def _reduce(x, divisor: int):
  if x.is_cuda and _library_kernel():
    if _cpp_extension.enabled() and _cpp_extension.load():
      return torch.ops.rlk.row_reduce_sm90(x, float(divisor))
    return _through_ctypes(x, divisor)
  if _on_row_kernel(x):
    from triton_kernels.row_sum import row_mean_torch
    return _on_rows(x, divisor, row_mean_torch)
  k = x.shape[-1]
  ones = torch.ones(k, 1, dtype=x.dtype, device=x.device)
  total = _gemm_op.det_mm(x.reshape(-1, k), ones, False, torch.float32,
                          None)[:, 0]
  return (total / divisor).to(x.dtype).reshape(x.shape[:-1])


def _fake(x):
  return x.new_empty(x.shape[:-1])


def _differentiable(x):
  return _library.needs_grad(x)


def _define(name: str, mean: bool):
  """``rlk::name``: the row mean (``mean``) or sum, with its autograd."""

  class RowReduction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x):
      ctx.shape = x.shape
      return _library.below_autograd(op, x)

    @staticmethod
    def backward(ctx, g):
      # d out / d x is 1/K (mean) or 1 (sum) for every element: no
      # reduction, so no order.
      g = g / ctx.shape[-1] if mean else g
      return g.unsqueeze(-1).expand(ctx.shape)

  def kernel(x):
    return _reduce(x, x.shape[-1] if mean else 1)

  op = _library.define(name, "(Tensor x) -> Tensor", kernel, _fake,
                       RowReduction, _differentiable)
  return op


OP = _define("det_row_mean", mean=True)
SUM_OP = _define("det_row_sum", mean=False)


def det_row_mean(x: torch.Tensor) -> torch.Tensor:
  """Mean over x's last dimension (K > 0), batch-invariant per row."""
  return _library.call(OP, x)


def det_row_sum(x: torch.Tensor) -> torch.Tensor:
  """Sum over x's last dimension (K > 0), batch-invariant per row."""
  return _library.call(SUM_OP, x)


class RowScaled(torch.autograd.Function):
  """``x * s`` with ``s [..., 1]`` one scale per row of ``x [..., K]`` (an
  RMSNorm's ``x * rsqrt(var)``). The product is torch's (elementwise: exact
  and invariant as it is). The scale's gradient sums ``g * x`` over the row:
  torch's broadcast backward does that with its own reduction, whose order
  can follow the number of rows; here it is ``det_row_sum``, so each row's
  gradient is its own whatever the batch."""

  @staticmethod
  def forward(ctx, x, s):
    ctx.save_for_backward(x, s)
    return x * s

  @staticmethod
  def backward(ctx, g):
    x, s = ctx.saved_tensors
    gx = g * s if ctx.needs_input_grad[0] else None
    gs = (det_row_sum(g * x).unsqueeze(-1) if ctx.needs_input_grad[1]
          else None)
    return gx, gs
