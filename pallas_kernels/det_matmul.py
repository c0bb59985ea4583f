"""Deterministic, batch-invariant tiled matmul (Pallas, Triton lowering).

``C[i, j] = sum_k A[i, k] B[k, j]`` with f32 accumulation, where A may be
stored transposed (``[K, I]``) and B may be stored transposed (``[J, K]``), so
the backward products ``g @ b.T`` and ``a.T @ g`` read the forward operands in
place instead of materialising transposes.

Why a row of C never depends on the other rows: one program owns one
``[BM, BN]`` output tile and walks the whole K range itself (no split-K, no
atomics), in the same ``BK`` steps, in the same order, with the same block
shapes whatever the problem size; rows and columns past the edge are loaded
as zeros, so a row's dot products see exactly the operands they would see in
any other batch. The tile shape is one fixed constant, not a per-size choice.
K past the edge is zero-padded too: the accumulator starts at +0.0 and adding
+0.0 products leaves every finite sum's bits unchanged.

For ``A^T B`` (the weight gradient, a reduction over rows) the same argument
gives a fixed blocked order over rows, and appended zero rows only add +0.0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton_backend import IMPORT_ERROR, pltriton

__all__ = ["MatmulConfig", "DEFAULT_CONFIG", "matmul", "tile_product"]


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3


# One config for every problem size: choosing tiles by size is only allowed
# where a device test proves every choice gives the same bits.
DEFAULT_CONFIG = MatmulConfig()


def tile_product(a_ref, b_ref, r0, c0, *, m, n, k, block_m, block_n, block_k,
                 transpose_a=False, transpose_b=False):
  """The f32 ``[block_m, block_n]`` tile of ``op(A) @ op(B)`` at (r0, c0):
  all of K in fixed ``block_k`` steps, in order, edges loaded as zeros. Every
  rlk kernel that needs a product tile calls this one loop, so they round
  alike."""
  bm, bn, bk = block_m, block_n, block_k
  row_in = r0 + jnp.arange(bm, dtype=jnp.int32) < m
  col_in = c0 + jnp.arange(bn, dtype=jnp.int32) < n
  rows, cols = pl.ds(r0, bm), pl.ds(c0, bn)

  def k_step(step, acc):
    k0 = step * bk
    k_in = k0 + jnp.arange(bk, dtype=jnp.int32) < k
    ks = pl.ds(k0, bk)
    if transpose_a:  # A stored [K, M]: a [bk, bm] tile, contract dim 0.
      a = pltriton.load(a_ref.at[ks, rows], mask=k_in[:, None] & row_in[None, :],
                        other=jnp.zeros((), a_ref.dtype))
      a_dim = 0
    else:
      a = pltriton.load(a_ref.at[rows, ks], mask=row_in[:, None] & k_in[None, :],
                        other=jnp.zeros((), a_ref.dtype))
      a_dim = 1
    if transpose_b:  # B stored [N, K]: a [bn, bk] tile, contract dim 1.
      b = pltriton.load(b_ref.at[cols, ks], mask=col_in[:, None] & k_in[None, :],
                        other=jnp.zeros((), b_ref.dtype))
      b_dim = 1
    else:
      b = pltriton.load(b_ref.at[ks, cols], mask=k_in[:, None] & col_in[None, :],
                        other=jnp.zeros((), b_ref.dtype))
      b_dim = 0
    # HIGHEST: f32 operands must not be rounded to TF32 (the Triton
    # lowering's DEFAULT); bf16/f16 operands are unaffected.
    return acc + jax.lax.dot_general(
        a, b, (((a_dim,), (b_dim,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32)

  return jax.lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(k, bk)), k_step,
                           jnp.zeros((bm, bn), jnp.float32))


def _kernel(a_ref, b_ref, c_ref, *, m, n, k, transpose_a, transpose_b, cfg):
  bm, bn = cfg.block_m, cfg.block_n
  r0 = pl.program_id(0) * bm
  c0 = pl.program_id(1) * bn
  acc = tile_product(a_ref, b_ref, r0, c0, m=m, n=n, k=k, block_m=bm,
                     block_n=bn, block_k=cfg.block_k, transpose_a=transpose_a,
                     transpose_b=transpose_b)
  row_in = r0 + jnp.arange(bm, dtype=jnp.int32) < m
  col_in = c0 + jnp.arange(bn, dtype=jnp.int32) < n
  pltriton.store(c_ref.at[pl.ds(r0, bm), pl.ds(c0, bn)], acc.astype(c_ref.dtype),
                 mask=row_in[:, None] & col_in[None, :])


def matmul(a: jax.Array, b: jax.Array, *, transpose_a: bool = False,
           transpose_b: bool = False, out_dtype=None, interpret: bool = False,
           config: MatmulConfig = DEFAULT_CONFIG) -> jax.Array:
  """``op(a) @ op(b)`` with op = transpose where asked; f32 accumulation.

  ``a``: ``[M, K]`` (``[K, M]`` if transpose_a), ``b``: ``[K, N]`` (``[N, K]``
  if transpose_b), same dtype. Returns ``[M, N]`` in `out_dtype`.
  """
  if pltriton is None:
    raise RuntimeError(IMPORT_ERROR)
  m, k = a.shape[::-1] if transpose_a else a.shape
  n = b.shape[0] if transpose_b else b.shape[1]
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if m == 0 or n == 0 or k == 0:
    # No launch for an empty grid; an empty sum is +0.0.
    return jnp.zeros((m, n), out_dtype)
  kernel = functools.partial(_kernel, m=m, n=n, k=k, transpose_a=transpose_a,
                             transpose_b=transpose_b, cfg=config)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(pl.cdiv(m, config.block_m), pl.cdiv(n, config.block_n)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      name="rlk_det_matmul",
  )(a, b)
