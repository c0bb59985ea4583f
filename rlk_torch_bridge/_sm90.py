"""det_gemm's SM90 kernels launched straight from torch: the same compiled
CUTLASS kernels the ``cuda_ffi`` JAX implementation calls, so the same bits,
without the DLPack round trip and the JAX dispatch (the bridge's per-call
cost).

Stream order and lifetime hold by construction: every kernel is enqueued on
torch's current stream and reads and writes torch tensors, so torch's caching
allocator, which is stream-ordered, cannot reuse an input's memory before the
kernel that reads it ran.
"""

from __future__ import annotations

import torch

import cuda_ffi


def _aligned(t: torch.Tensor) -> torch.Tensor:
  # TMA reads from 16-byte aligned addresses; a view at an odd offset is
  # copied (values unchanged, so bits unchanged).
  t = t.contiguous()
  return t if t.data_ptr() % 16 == 0 else t.clone()


def product(a: torch.Tensor, b: torch.Tensor, transpose_a: bool,
            transpose_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
  """``op(a) @ op(b)``, both row-major 2-D, on a's device and torch's stream."""
  a, b = _aligned(a), _aligned(b)
  m, k = a.shape[::-1] if transpose_a else a.shape
  n = b.shape[0] if transpose_b else b.shape[1]
  c = torch.empty((m, n), dtype=out_dtype, device=a.device)
  with torch.cuda.device(a.device):
    cuda_ffi.launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k,
                    transpose_a=transpose_a, transpose_b=transpose_b,
                    out_f32=out_dtype == torch.float32,
                    stream=torch.cuda.current_stream(a.device).cuda_stream)
  return c


class DetGemm(torch.autograd.Function):
  """The forward and the backward products of rlk_jax's det_gemm VJP, in the
  same order with the same operands (so gradients match JAX's bits too)."""

  @staticmethod
  def forward(ctx, a2d, b, out_dtype, transpose_b):
    ctx.save_for_backward(a2d, b)
    ctx.transpose_b = transpose_b
    return product(a2d, b, False, transpose_b, out_dtype)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    a, b = ctx.saved_tensors
    g = g.to(a.dtype)
    da = product(g, b, False, not ctx.transpose_b, a.dtype)
    if ctx.transpose_b:
      db = product(g, a, True, False, b.dtype)
    else:
      db = product(a, g, True, False, b.dtype)
    return da, db, None, None


def det_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
             transpose_b: bool, m: int, n: int, k: int) -> torch.Tensor:
  a2d = a.reshape(m, k)
  if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
    c = DetGemm.apply(a2d, b, out_dtype, transpose_b)
  else:
    c = product(a2d, b, False, transpose_b, out_dtype)
  return c.reshape(*a.shape[:-1], n)
