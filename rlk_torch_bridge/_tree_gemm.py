"""det_gemm's tensor-parallel-invariant mode for torch tensors: rlk_jax's
``reduction_chunks`` (its order: ``rlk_jax._tree_reduction``), each chunk an
f32 product (Triton's fused launch of every chunk and the tree, where rlk_jax's
rule takes it; else one ``rlk::det_mm`` per chunk, summed with the same
``tree_sum``); optionally across the ranks of a process group.

A product's reduction may be split over a group: K in the forward (a
row-parallel layer's weight holds K/t of the input features), N in the input
gradient (a column-parallel layer's weight holds N/t of the outputs). Each
rank sums the subtree of its C/t neighbouring chunks; the t roots are
gathered in rank order (``all_gather``, not ``all_reduce``, whose order is
the collective's) and every rank finishes the same tree. The bits are those
of one process with the whole weight, and of rlk_jax's mode.
"""

from __future__ import annotations

import math

import jax
import torch

import cuda_ffi
from rlk_jax import _det_gemm, _tree_reduction
from rlk_torch_bridge import (_gemm_op, _gemm_routes, _library,
                              _process_group, _triton_native)
from rlk_torch_bridge._checks import (check_same_device, check_tensor,
                                     jax_dtype, platform_of)
from triton_kernels import backend


def plan(m, k, n, transpose_b, dtype, out_dtype, implementation, chunks,
         platform) -> str:
  """rlk_jax's checks and implementation choice for the whole (unsplit)
  product, whose chunks every rank's products are."""
  a = jax.ShapeDtypeStruct((m, k), jax_dtype(dtype))
  b = jax.ShapeDtypeStruct((n, k) if transpose_b else (k, n), jax_dtype(dtype))
  return _det_gemm.plan(a, b, out_dtype=jax_dtype(out_dtype),
                        implementation=implementation, transpose_b=transpose_b,
                        platform=platform,
                        reduction_chunks=chunks).implementation


def _columns(x, c, size):
  return x[:, c * size:(c + 1) * size].contiguous()


def _rows(x, c, size):
  return x[c * size:(c + 1) * size]


_fused = {}


def _fused_route(impl, chunks, a) -> bool:
  """rlk_jax's rule for Triton's fused launch of the chunks, where torch
  can launch Triton."""
  return (a.is_cuda and backend.IMPORT_ERROR is None
          and _det_gemm.fused_chunks(impl, chunks))


def _subtree(a, b, transpose_b, chunks, impl, out_dtype=torch.float32):
  """The root of `chunks` neighbouring chunks of ``a [M, K] @ op(b)``, K cut
  into equal chunks: in f32 (a rank's subtree, which others' roots join),
  or rounded once to `out_dtype` (the whole tree)."""
  (m, k), n = a.shape, b.shape[0] if transpose_b else b.shape[1]
  if _fused_route(impl, chunks, a):
    key = (m, n, k, transpose_b, a.dtype, out_dtype, chunks)
    return _gemm_routes.cached(_fused, key, a, lambda: (
        _triton_native.chunked_product(m, n, k, False, transpose_b, a.dtype,
                                       out_dtype, chunks)))(a, b)
  size = k // chunks
  b_chunk = _columns if transpose_b else _rows
  return _tree_reduction.tree_sum(
      _library.below_autograd(_gemm_op.OP, _columns(a, c, size),
                              b_chunk(b, c, size), False, transpose_b,
                              torch.float32, impl)
      for c in range(chunks)).to(out_dtype)


def _tree_product(a, b, transpose_b, chunks, impl, group, out_dtype):
  """The whole tree of ``a @ op(b)`` whose reduction `group` splits: this
  rank's subtree, then the tree's top levels across the ranks' roots, in
  rank order."""
  t = _process_group.size(group)
  if t == 1:
    return _subtree(a, b, transpose_b, chunks, impl, out_dtype)
  partial = _subtree(a, b, transpose_b, chunks // t, impl)
  return _tree_reduction.tree_sum(
      _process_group.gathered(partial, group)).to(out_dtype)


class TreeMm(torch.autograd.Function):
  """``a [M, K_local] @ op(b)`` with its reductions in the fixed tree:
  forward over K (split over `k_group`), the input gradient over N (split
  over `n_group`); the weight gradient reduces over rows: the default
  det_mm, local to each rank."""

  @staticmethod
  def forward(ctx, a, b, transpose_b, out_dtype, impl, chunks, k_group,
              n_group):
    ctx.save_for_backward(a, b)
    ctx.flags = (transpose_b, impl, chunks, n_group)
    return _tree_product(a, b, transpose_b, chunks, impl, k_group, out_dtype)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    a, b = ctx.saved_tensors
    transpose_b, impl, chunks, n_group = ctx.flags
    g = g.to(a.dtype).contiguous()
    da = db = None
    if ctx.needs_input_grad[0]:
      # da = g @ op(b)^T: b [N, K] read as [K_bwd = N, K] or b [K, N] read
      # transposed; N cut into chunks.
      da = _tree_product(g, b, not transpose_b, chunks, impl, n_group,
                         a.dtype)
    if ctx.needs_input_grad[1]:
      product = lambda x, y, ta, tb: _library.below_autograd(
          _gemm_op.OP, x, y, ta, tb, b.dtype, impl)
      db = product(g, a, True, False) if transpose_b else product(
          a, g, True, False)
    return da, db, None, None, None, None, None, None


_PLANS: dict = {}


def tree_gemm(a, b, *, transpose_b, out_dtype, implementation, chunks,
              k_group=None, n_group=None, whole_k=None, whole_n=None):
  """`a [..., K_local]` through `TreeMm`; `whole_k`/`whole_n`: the unsplit
  sizes, for the checks and the implementation choice."""
  check_tensor("det_gemm", "a", a)
  check_tensor("det_gemm", "b", b)
  check_same_device("det_gemm", a=a, b=b)
  k_ranks, n_ranks = _process_group.size(k_group), _process_group.size(n_group)
  key = (a.shape, b.shape, a.dtype, b.dtype, out_dtype, transpose_b,
         implementation, chunks, k_ranks, n_ranks, whole_k, whole_n, a.device,
         cuda_ffi.generation())
  # The checks and the implementation choice are the signature's: worked
  # out once (a decode step's layer waits on the host otherwise).
  impl = _gemm_routes.cached(_PLANS, key, a, lambda: _plan_call(
      a, b, transpose_b, out_dtype, implementation, chunks, k_ranks, n_ranks,
      whole_k, whole_n))
  lead = a.shape[:-1]
  a2 = a.reshape(-1, a.shape[-1])
  if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
    out = TreeMm.apply(a2, b, transpose_b, out_dtype, impl, chunks, k_group,
                       n_group)
  else:  # (a rollout's decode step: no autograd node to build)
    out = _tree_product(a2, b, transpose_b, chunks, impl, k_group, out_dtype)
  return out.reshape(*lead, out.shape[-1])


def _plan_call(a, b, transpose_b, out_dtype, implementation, chunks, k_ranks,
               n_ranks, whole_k, whole_n) -> str:
  _tree_reduction.check_power_of_two(chunks, "rlk_torch_bridge.det_gemm")
  if a.dtype != b.dtype:  # (the plan below reads a's dtype for both)
    raise TypeError(f"rlk_torch_bridge.det_gemm: a and b must have the same "
                    f"dtype, got {a.dtype} and {b.dtype}.")
  n_local, k_b = (b.shape if transpose_b else b.shape[::-1])
  if k_b != a.shape[-1]:
    raise ValueError(f"rlk_torch_bridge.det_gemm: inner dimensions differ: a "
                     f"has shape {tuple(a.shape)} and b {tuple(b.shape)} "
                     f"(transpose_b={transpose_b}).")
  for name, t in (("K", k_ranks), ("N", n_ranks)):
    _tree_reduction.check_ranks(chunks, t, f"rlk_torch_bridge ({name} split)")
  return plan(math.prod(a.shape[:-1]), whole_k or k_b * k_ranks,
              whole_n or n_local * n_ranks, transpose_b, a.dtype, out_dtype,
              implementation, chunks, platform_of(a))
