"""Deterministic, batch-invariant tiled matmul as a ``@triton.jit`` kernel.

The same arithmetic as ``pallas_kernels.det_matmul`` (whose docstring gives
the invariance argument): one program per ``[BLOCK_M, BLOCK_N]`` output
tile walks all of K in ``BLOCK_K`` steps, in order, into one f32
accumulator (``tl.dot(a, b, acc)``: the MMA accumulates in place); edges
load as zeros. Operands are read through strides, so the backward's
transposed products read the forward operands in place.

Two launchers share the kernel: ``matmul`` (JAX arrays, through
``jax_launch.triton_call``) and ``matmul_torch`` (torch tensors, Triton's
own launcher on torch's current stream; with ``TRITON_INTERPRET=1`` it
runs on CPU tensors in Triton's interpreter, which is how the CPU tests
check the arithmetic).
"""

from __future__ import annotations

from triton_kernels import jax_launch
from triton_kernels.backend import cdiv, interpreted, Launcher, tl, triton

__all__ = ["matmul", "matmul_torch", "mma_step", "strides", "tile_product",
           "chunked_matmul", "chunked_matmul_torch", "chunked_matmul_plan",
           "MAX_CHUNKS"]

# The tree finish below is written out for up to this many chunks.
MAX_CHUNKS = 16


def strides(m: int, n: int, k: int, transpose_a: bool, transpose_b: bool):
  """Element strides of row-major operands: A ``[M, K]`` (``[K, M]`` if
  transposed), B ``[K, N]`` (``[N, K]``), C ``[M, N]``, as (am, ak, bk, bn,
  cm, cn)."""
  am, ak = (1, m) if transpose_a else (k, 1)
  bk, bn = (1, k) if transpose_b else (n, 1)
  return am, ak, bk, bn, n, 1


if triton is not None:

  @triton.jit
  def mma_step(a, b, acc, INTERPRETED: tl.constexpr):
    if INTERPRETED:
      # Triton's interpreter (CPU tests) has two stand-ins for the MMA:
      # tl.dot multiplies bf16 bit patterns as uint16 integers (triton
      # 3.6), and it is numpy's BLAS, whose bits for a row depend on the
      # row's place in the tile (OpenBLAS sums rows in blocks of a few,
      # each place of a block in its own order). Widened operands (exact
      # from bf16/f16) and a broadcast product summed over K give every
      # output element one order of its own: a row's bits depend on
      # nothing else, as the tensor cores' do.
      a = a.to(tl.float32)
      b = b.to(tl.float32)
      return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
      # ieee: f32 operands are not rounded to TF32 (2-byte ones are exact).
      return tl.dot(a, b, acc, input_precision="ieee")

  @triton.jit
  def tile_product(a_ptr, b_ptr, rm, rn, K, stride_am, stride_ak, stride_bk,
                   stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                   EVEN_K: tl.constexpr = False):
    """The f32 ``[BLOCK_M, BLOCK_N]`` product of rows `rm` and columns `rn`
    (64-bit offsets, every one in range: callers wrap a tile's overhang
    onto real rows and columns, whose results they never store): all of K
    in ``BLOCK_K`` steps, in order, into one accumulator. Only the last,
    partial K step is masked (beyond K loads as zeros): the full steps load
    without predicates, the same values, so the same bits. det_matmul and
    linear_logp share it. ``EVEN_K`` (the caller knows BLOCK_K divides K):
    the masked step is not compiled at all. It would never run then, but
    its code alone costs registers: a 128x256 tile reading B K-major
    spilled ~1.2 KB at 255 registers with it and used 176 without (sm_90a,
    Triton 3.6), and ran at a fifth of cuBLAS's speed on an H200."""
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_full = K - K % BLOCK_K
    for _ in range(0, k_full, BLOCK_K):
      acc = mma_step(tl.load(a_ptrs), tl.load(b_ptrs), acc, INTERPRETED)
      a_ptrs += BLOCK_K * stride_ak
      b_ptrs += BLOCK_K * stride_bk
    if not EVEN_K:
      if k_full < K:
        kk = k_full + rk
        acc = mma_step(tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0),
                       tl.load(b_ptrs, mask=kk[:, None] < K, other=0.0),
                       acc, INTERPRETED)
    return acc

  @triton.jit
  def _tile_rows_and_columns(M, N, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows and columns (64-bit: a vocabulary-wide
    operand passes 2**31 elements), tiles taken in grouped order (only L2
    reuse depends on it, never a bit)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    in_group = pid % per_group
    tile_m = first_m + in_group % rows_in_group
    tile_n = in_group // rows_in_group
    return ((tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64),
            (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64))

  @triton.jit
  def _det_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                         stride_am, stride_ak, stride_bk, stride_bn,
                         stride_cm, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         INTERPRETED: tl.constexpr = False,
                         EVEN_K: tl.constexpr = False):
    rm, rn = _tile_rows_and_columns(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row_in = rm[:, None] < M
    col_in = rn[None, :] < N
    # The tile's overhang past M or N loads wrapped, real rows and columns
    # (never stored): no row or column masks on the loads.
    acc = tile_product(a_ptr, b_ptr, rm % M, rn % N, K, stride_am,
                       stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N,
                       BLOCK_K, INTERPRETED, EVEN_K)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c,
             mask=row_in & col_in)


  # The tensor-parallel-invariant mode (rlk_jax._tree_reduction gives the
  # order): K cut into CHUNKS equal chunks, each an f32 product from a fresh
  # accumulator, the partials added in one binary tree. One launch computes
  # every chunk of every tile (the chunks are the grid's second axis: at
  # decode sizes they are the parallelism a product of M=8 lacks), a second
  # adds the partials. Each chunk's walk is `tile_product`'s, det_matmul's
  # own, so a chunk has the bits of det_matmul on that slice of K.
  @triton.jit
  def _chunk_partials_kernel(a_ptr, b_ptr, w_ptr, M, N, K_CHUNK,
                             stride_am, stride_ak, stride_bk, stride_bn,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             INTERPRETED: tl.constexpr = False,
                             EVEN_K: tl.constexpr = False):
    rm, rn = _tile_rows_and_columns(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    chunk = tl.program_id(1).to(tl.int64)
    start = chunk * K_CHUNK
    acc = tile_product(a_ptr + start * stride_ak, b_ptr + start * stride_bk,
                       rm % M, rn % N, K_CHUNK, stride_am, stride_ak,
                       stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K,
                       INTERPRETED, EVEN_K)
    w = w_ptr + chunk * M * N + rm[:, None] * N + rn[None, :]
    tl.store(w, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

  @triton.jit
  def _pair(w_ptr, offs, mask, SIZE, FIRST: tl.constexpr, COUNT: tl.constexpr):
    """The tree over partials FIRST .. FIRST + COUNT - 1 (COUNT a power of
    two up to MAX_CHUNKS): neighbours first, the earlier on the left."""
    if COUNT == 1:
      s = tl.load(w_ptr + FIRST * SIZE + offs, mask=mask)
    elif COUNT == 2:
      s = (tl.load(w_ptr + FIRST * SIZE + offs, mask=mask)
           + tl.load(w_ptr + (FIRST + 1) * SIZE + offs, mask=mask))
    elif COUNT == 4:
      s = (_pair(w_ptr, offs, mask, SIZE, FIRST, 2)
           + _pair(w_ptr, offs, mask, SIZE, FIRST + 2, 2))
    elif COUNT == 8:
      s = (_pair(w_ptr, offs, mask, SIZE, FIRST, 4)
           + _pair(w_ptr, offs, mask, SIZE, FIRST + 4, 4))
    else:
      tl.static_assert(COUNT == 16)
      s = (_pair(w_ptr, offs, mask, SIZE, FIRST, 8)
           + _pair(w_ptr, offs, mask, SIZE, FIRST + 8, 8))
    return s

  @triton.jit
  def _tree_finish_kernel(w_ptr, out_ptr, SIZE, CHUNKS: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    # 64-bit: the partials of a vocabulary-wide product pass 2**31.
    s = _pair(w_ptr, offs, mask, tl.cast(SIZE, tl.int64), 0, CHUNKS)
    tl.store(out_ptr + offs, s.to(out_ptr.dtype.element_ty), mask=mask)

  # Decode-sized calls wait on the host: Triton's own launch re-binds every
  # argument each call.
  _launch_partials = Launcher(_chunk_partials_kernel)
  _launch_finish = Launcher(_tree_finish_kernel)


def _grid(m, n, config):
  return (cdiv(m, config.block_m) * cdiv(n, config.block_n),)


def _meta(config, k: int):
  """The constexprs of a product whose reduction is `k` long."""
  return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n,
              BLOCK_K=config.block_k, GROUP_M=config.group_m,
              EVEN_K=k % config.block_k == 0)


def _dims(a_shape, b_shape, transpose_a, transpose_b):
  m, k = a_shape[::-1] if transpose_a else a_shape
  n = b_shape[0] if transpose_b else b_shape[1]
  return m, n, k


def matmul(a, b, *, transpose_a: bool, transpose_b: bool, out_dtype, config):
  """``op(a) @ op(b)`` for 2-D JAX arrays through jax-triton. `config`: an
  object with block_m/block_n/block_k/group_m/num_warps/num_stages (the
  Pallas kernel's MatmulConfig); m, n, k > 0."""
  import jax
  m, n, k = _dims(a.shape, b.shape, transpose_a, transpose_b)
  # jax-triton hands the kernel its output pointer after the positional
  # inputs (c_ptr, third), and compiles one kernel per call site anyway: so
  # the sizes and strides go as keywords, compile-time constants. As runtime
  # scalars they would carry no divisibility facts (jax-triton specializes
  # none), every mask would split vector loads into single elements, and
  # the kernel ran at 0.05-0.2x cuBLAS (H100, 2026-11-23).
  sizes = dict(zip(("stride_am", "stride_ak", "stride_bk", "stride_bn",
                    "stride_cm", "stride_cn"),
                   strides(m, n, k, transpose_a, transpose_b)))
  return jax_launch.triton_call(
      a, b, kernel=_det_matmul_kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=_grid(m, n, config), num_warps=config.num_warps,
      num_stages=config.num_stages, name="rlk_det_matmul_triton",
      M=m, N=n, K=k, **sizes, **_meta(config, k))


def matmul_torch(a, b, out, *, transpose_a: bool, transpose_b: bool, config):
  """Writes ``op(a) @ op(b)`` into `out` (torch tensors; a and b contiguous
  in their stored layout, out ``[M, N]`` contiguous). m, n, k > 0."""
  m, n, k = _dims(tuple(a.shape), tuple(b.shape), transpose_a, transpose_b)
  _det_matmul_kernel[_grid(m, n, config)](
      a, b, out, m, n, k, *strides(m, n, k, transpose_a, transpose_b),
      num_warps=config.num_warps, num_stages=config.num_stages,
      INTERPRETED=interpreted(), **_meta(config, k))
  return out


_FINISH_BLOCK = 1024
_FINISH_WARPS = 4


def chunked_matmul(a, b, *, transpose_a: bool, transpose_b: bool, chunks: int,
                   config):
  """The f32 tree-summed ``op(a) @ op(b)`` of `chunks` equal K chunks for 2-D
  JAX arrays through ``jax_launch.triton_call``: `chunked_matmul_torch`'s
  two launches (every chunk's partial, then the tree)."""
  import jax
  import jax.numpy as jnp
  m, n, k = _dims(a.shape, b.shape, transpose_a, transpose_b)
  grid, sizes, meta, finish_grid = _chunked_launches(
      m, n, k, transpose_a, transpose_b, chunks, config)
  partials = jax_launch.triton_call(
      a, b, kernel=_chunk_partials_kernel,
      out_shape=jax.ShapeDtypeStruct((chunks, m, n), jnp.float32),
      grid=grid, num_warps=config.num_warps, num_stages=config.num_stages,
      name="rlk_det_matmul_chunks_triton", **sizes, **meta)
  return jax_launch.triton_call(
      partials, kernel=_tree_finish_kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=finish_grid,
      num_warps=_FINISH_WARPS, num_stages=1, name="rlk_det_matmul_tree_triton",
      SIZE=m * n, CHUNKS=chunks, BLOCK=_FINISH_BLOCK)


def _chunked_launches(m, n, k, transpose_a, transpose_b, chunks, config):
  """The two launches of a chunked product, after checking the split: (the
  partials' grid, their kernel's sizes and strides by name in signature
  order, its constexprs, the tree's grid)."""
  if chunks < 1 or chunks & (chunks - 1) or chunks > MAX_CHUNKS or k % chunks:
    raise ValueError(f"det_matmul: chunks={chunks} must be a power of two up "
                     f"to {MAX_CHUNKS} dividing K={k}.")
  am, ak, bk, bn, _, _ = strides(m, n, k, transpose_a, transpose_b)
  sizes = dict(M=m, N=n, K_CHUNK=k // chunks, stride_am=am, stride_ak=ak,
               stride_bk=bk, stride_bn=bn)
  return ((_grid(m, n, config)[0], chunks), sizes, _meta(config, k // chunks),
          (cdiv(m * n, _FINISH_BLOCK),))


def chunked_matmul_torch(a, b, out, *, transpose_a: bool, transpose_b: bool,
                         chunks: int, config):
  """Writes the tree-summed ``op(a) @ op(b)`` of `chunks` equal K chunks
  into `out` (``[M, N]`` contiguous, f32 for a subtree's root that other
  ranks' roots will join, else the output dtype: one rounding of the root).
  a and b contiguous in their stored layout; `config` tiles one chunk's
  product ``[M, K / chunks]``."""
  import torch
  m, n, k = _dims(tuple(a.shape), tuple(b.shape), transpose_a, transpose_b)
  partials = torch.empty((chunks, m, n), dtype=torch.float32, device=a.device)
  chunked_matmul_plan(m, n, k, transpose_a=transpose_a,
                      transpose_b=transpose_b, chunks=chunks,
                      config=config)(a, b, partials, out)
  return out


def chunked_matmul_plan(m: int, n: int, k: int, *, transpose_a: bool,
                        transpose_b: bool, chunks: int, config):
  """``run(a, b, partials, out)``: `chunked_matmul_torch` for one signature,
  its launches prepared (grids, scalars and their specialisation worked out
  once: a decode step's eager call is mostly host time). `partials`: f32
  ``[chunks, M, N]`` scratch."""
  grid, sizes, meta, finish_grid = _chunked_launches(
      m, n, k, transpose_a, transpose_b, chunks, config)
  meta["INTERPRETED"] = interpreted()
  partials_launch = _launch_partials.prepared(
      grid, (tuple(meta.items()), config.num_warps, config.num_stages),
      tuple(sizes.values()), num_warps=config.num_warps,
      num_stages=config.num_stages, **meta)
  finish_launch = _launch_finish.prepared(
      finish_grid, (chunks,), (m * n,), CHUNKS=chunks, BLOCK=_FINISH_BLOCK,
      num_warps=_FINISH_WARPS)

  def run(a, b, partials, out):
    partials_launch(a, b, partials)
    finish_launch(partials, out)
  return run
