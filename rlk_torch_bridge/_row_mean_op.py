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

import torch

from rlk_torch_bridge import _gemm_op, _library, _row_routes


def _reduce(x, divisor: int):
  if x.is_cuda and _row_routes.library_kernel():
    return _row_routes.library(x, divisor)
  if x.is_cuda and _row_routes.triton_importable():
    return _row_routes.triton(x, divisor)
  k = x.shape[-1]
  ones = torch.ones(k, 1, dtype=x.dtype, device=x.device)
  total = _gemm_op.det_mm(x.reshape(-1, k), ones, False, torch.float32,
                          None)[:, 0]
  return (total / divisor).to(x.dtype).reshape(x.shape[:-1])


def _fake(x):
  return x.new_empty(x.shape[:-1])


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
                       RowReduction,
                       _library.first_args_need_grad(1))
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
