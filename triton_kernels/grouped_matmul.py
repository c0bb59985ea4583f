"""A mixture of experts' grouped products as ``@triton.jit`` kernels, each
expert's rows det_matmul's arithmetic, in one launch whose groups are read
on the device.

Rows ``starts[e]:ends[e]`` of A belong to expert e (sorted by expert, as
torch's ``_grouped_mm`` takes them). A tile map (``tiles [2, T]``: the
expert of each row tile, or -1, and its first row within the expert's
rows, as det_attention's tile maps number a sequence's query tiles) says
which rows each program computes, so the launch needs no group size on the
host: no host sync, one launch, capturable in a CUDA graph.

Why the bits are det_matmul's: every output element is ``tile_product``'s
walk over all of K in ``BLOCK_K`` steps, in order, into one f32
accumulator, the walk det_matmul's kernel runs. A row's element depends on
its own row and its expert's weight only; rows of other experts in the
tile's overhang load as the tile's first row (never stored), as
det_matmul wraps its overhang onto real rows.

- ``grouped_matmul_torch``: ``out[r] = a[r] @ op(b[e])`` for each row r of
  expert e (the forward, and the input gradient with op transposed).
- ``grouped_weight_grad_torch``: ``db[e] = a[rows of e]^T @ g[rows of e]``,
  the reduction over the expert's rows from its first row in ``BLOCK_K``
  steps: det_matmul's transposed product on those rows.
"""

from __future__ import annotations

from triton_kernels.backend import (cdiv, interpreted, Launcher, tile_bound,
                                    tl, triton)
from triton_kernels.det_matmul import tile_product

__all__ = ["grouped_matmul_torch", "grouped_weight_grad_torch", "tile_bound"]


if triton is not None:

  @triton.jit
  def _grouped_kernel(a_ptr, b_ptr, c_ptr, tiles_ptr, starts_ptr, ends_ptr,
                      N, K, N_TILES_M, stride_am, stride_ak, stride_be,
                      stride_bk, stride_bn, stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr = False,
                      EVEN_K: tl.constexpr = False):
    t = tl.program_id(0)
    e = tl.load(tiles_ptr + t)
    if e >= 0:
      first = tl.load(starts_ptr + e) + tl.load(tiles_ptr + N_TILES_M + t)
      end = tl.load(ends_ptr + e)
      rm = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
      rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
      row_in = rm < end
      acc = tile_product(a_ptr, b_ptr + e.to(tl.int64) * stride_be,
                         tl.where(row_in, rm, first.to(tl.int64)), rn % N, K,
                         stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M,
                         BLOCK_N, BLOCK_K, INTERPRETED, EVEN_K)
      tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
               acc.to(c_ptr.dtype.element_ty),
               mask=row_in[:, None] & (rn[None, :] < N))

  @triton.jit
  def _weight_grad_kernel(a_ptr, g_ptr, d_ptr, starts_ptr, ends_ptr, KD, N,
                          stride_ar, stride_ac, stride_gr, stride_gc,
                          stride_de, stride_dk, stride_dn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr,
                          INTERPRETED: tl.constexpr = False):
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    rm = ((tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = ((tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    start = tl.load(starts_ptr + e).to(tl.int64)
    rows = tl.maximum(tl.load(ends_ptr + e).to(tl.int64) - start, 0)
    # The reduction runs over the expert's rows, from its first, in BLOCK_K
    # steps (the last one masked): an expert with no rows gets zeros.
    acc = tile_product(a_ptr + start * stride_ar, g_ptr + start * stride_gr,
                       rm % KD, rn % N, rows, stride_ac, stride_ar,
                       stride_gr, stride_gc, BLOCK_M, BLOCK_N, BLOCK_K,
                       INTERPRETED)
    d = d_ptr + e.to(tl.int64) * stride_de
    tl.store(d + rm[:, None] * stride_dk + rn[None, :] * stride_dn,
             acc.to(d_ptr.dtype.element_ty),
             mask=(rm[:, None] < KD) & (rn[None, :] < N))

  # Decode steps launch these per layer: Triton's own launch re-binds every
  # argument each call (backend.Launcher).
  _launch_grouped = Launcher(_grouped_kernel)
  _launch_weight_grad = Launcher(_weight_grad_kernel)


def _meta(config, k=None):
  meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n,
              BLOCK_K=config.block_k, INTERPRETED=interpreted(),
              num_warps=config.num_warps, num_stages=config.num_stages)
  if k is not None:
    meta["EVEN_K"] = k % config.block_k == 0
  return meta


def grouped_matmul_torch(a, b, out, tiles, starts, ends, *, transpose_b: bool,
                         config):
  """Writes ``a[r] @ op(b[e])`` into ``out[r]`` for every row r of every
  expert e (`tiles`: ``[2, T]`` int32, T row tiles of ``config.block_m``
  rows; `starts`, `ends`: int32 ``[E]``). a ``[S, K]``, b ``[E, K, N]``
  (``[E, N, K]`` if `transpose_b`) and out ``[S, N]`` are read through
  their strides; rows in no tile are left as they are."""
  n = b.shape[-2] if transpose_b else b.shape[-1]
  k = a.shape[1]
  bk, bn = (b.stride(2), b.stride(1)) if transpose_b else (b.stride(1),
                                                           b.stride(2))
  _launch_grouped.launch(
      (tiles.shape[1], cdiv(n, config.block_n)), a, b, out, tiles, starts,
      ends, n, k, tiles.shape[1], a.stride(0), a.stride(1), b.stride(0), bk,
      bn, out.stride(0), out.stride(1), **_meta(config, k))
  return out


def grouped_weight_grad_torch(a, g, db, starts, ends, *, config):
  """Writes ``a[starts[e]:ends[e]]^T @ g[starts[e]:ends[e]]`` into ``db[e]``
  for every expert (a ``[S, KD]``, g ``[S, N]``, db ``[E, KD, N]``, any
  strides): each expert's sum over its own rows, from its first."""
  kd, n = a.shape[1], g.shape[1]
  _launch_weight_grad.launch(
      (cdiv(kd, config.block_m) * cdiv(n, config.block_n), db.shape[0]), a,
      g, db, starts, ends, kd, n, a.stride(0), a.stride(1), g.stride(0),
      g.stride(1), db.stride(0), db.stride(1), db.stride(2), **_meta(config))
  return db
