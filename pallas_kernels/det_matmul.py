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
any other batch. The tile shape may vary with the problem size (`choose_config`)
only among configs a device test proves bit-identical to each other: they
share BK and the K order, and every wgmma-based product that walks K in
order into one f32 accumulator rounds alike. The order in which programs
visit tiles (`group_m`) is free: it moves no bit, only L2 reuse.
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

__all__ = ["MatmulConfig", "DEFAULT_CONFIG", "CONFIGS", "NAMED_CONFIGS",
           "choose_config",
           "matmul", "tile_product"]


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3
  # Programs walk `group_m` row tiles down each column of tiles before
  # moving right, so a wave of programs shares A and B tiles in L2.
  group_m: int = 8


# BK is shared by every config: it fixes the K order, hence the bits.
DEFAULT_CONFIG = MatmulConfig()
# What choose_config may pick for 2-byte operands on a GPU, from the H100
# sweep (benchmarks/results/experiments/h100-2026-11-22/): 128x256 tiles
# run the M=4096 projections at 0.83-0.90x cuBLAS (128x128: 0.67-0.78x);
# decode rows want many narrow tiles to spread the weight's bytes over
# the SMs (M=16, N=4096: 17 us with 64x32 against 38 us with 128x128).
# tests/test_det_gemm_gpu.py proves them bit-identical to each other.
WIDE_CONFIG = MatmulConfig(block_m=128, block_n=256, num_warps=8, num_stages=3)
DECODE_NARROW_CONFIG = MatmulConfig(block_m=64, block_n=32, num_warps=4,
                                    num_stages=6, group_m=1)
DECODE_WIDE_CONFIG = MatmulConfig(block_m=64, block_n=128, num_warps=4,
                                  num_stages=4, group_m=1)
CONFIGS = (DEFAULT_CONFIG, WIDE_CONFIG, DECODE_NARROW_CONFIG, DECODE_WIDE_CONFIG)
# The same configs by name (the tuned tables store names), in the order
# that settles ties between measured configs.
NAMED_CONFIGS = {"128x128": DEFAULT_CONFIG, "128x256": WIDE_CONFIG,
                 "64x32": DECODE_NARROW_CONFIG, "64x128": DECODE_WIDE_CONFIG}
_SMS = 132  # H100 SXM; only the speed of the choice depends on it


def choose_config(m: int, n: int, dtype) -> MatmulConfig:
  """The tile config for an ``[m, n]`` product of `dtype` operands on a GPU,
  by rule (rlk_jax prefers a measured choice where it has one).

  Only 2-byte operands get a choice: f32 tiles of 128x256 overflow shared
  memory, and f32 gets no bit-identity promise across tile shapes.
  """
  if jnp.dtype(dtype).itemsize != 2:
    return DEFAULT_CONFIG
  if m <= 64:  # decode: one row tile; enough column tiles to fill the SMs
    return DECODE_NARROW_CONFIG if n <= 64 * _SMS else DECODE_WIDE_CONFIG
  if pl.cdiv(m, 128) * pl.cdiv(n, 256) >= _SMS:
    return WIDE_CONFIG
  return DEFAULT_CONFIG


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


def _tile_of_program(pid, tiles_m, tiles_n, group_m):
  """(row tile, column tile) of program `pid` in grouped order."""
  per_group = group_m * tiles_n
  first_m = (pid // per_group) * group_m
  rows_in_group = jnp.minimum(tiles_m - first_m, group_m)
  in_group = pid % per_group
  return first_m + in_group % rows_in_group, in_group // rows_in_group


def _kernel(a_ref, b_ref, c_ref, *, m, n, k, transpose_a, transpose_b, cfg):
  bm, bn = cfg.block_m, cfg.block_n
  tile_m, tile_n = _tile_of_program(pl.program_id(0), pl.cdiv(m, bm),
                                    pl.cdiv(n, bn), cfg.group_m)
  r0 = tile_m * bm
  c0 = tile_n * bn
  acc = tile_product(a_ref, b_ref, r0, c0, m=m, n=n, k=k, block_m=bm,
                     block_n=bn, block_k=cfg.block_k, transpose_a=transpose_a,
                     transpose_b=transpose_b)
  row_in = r0 + jnp.arange(bm, dtype=jnp.int32) < m
  col_in = c0 + jnp.arange(bn, dtype=jnp.int32) < n
  pltriton.store(c_ref.at[pl.ds(r0, bm), pl.ds(c0, bn)], acc.astype(c_ref.dtype),
                 mask=row_in[:, None] & col_in[None, :])


def matmul(a: jax.Array, b: jax.Array, *, transpose_a: bool = False,
           transpose_b: bool = False, out_dtype=None, interpret: bool = False,
           config: MatmulConfig | None = None) -> jax.Array:
  """``op(a) @ op(b)`` with op = transpose where asked; f32 accumulation.

  ``a``: ``[M, K]`` (``[K, M]`` if transpose_a), ``b``: ``[K, N]`` (``[N, K]``
  if transpose_b), same dtype. Returns ``[M, N]`` in `out_dtype`. `config`
  None: `choose_config` on a GPU; the default config when interpreted
  (the CPU's dot rounds f32 tiles of other shapes differently).
  """
  if pltriton is None:
    raise RuntimeError(IMPORT_ERROR)
  m, k = a.shape[::-1] if transpose_a else a.shape
  n = b.shape[0] if transpose_b else b.shape[1]
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if m == 0 or n == 0 or k == 0:
    # No launch for an empty grid; an empty sum is +0.0.
    return jnp.zeros((m, n), out_dtype)
  if config is None:
    config = DEFAULT_CONFIG if interpret else choose_config(m, n, a.dtype)
  kernel = functools.partial(_kernel, m=m, n=n, k=k, transpose_a=transpose_a,
                             transpose_b=transpose_b, cfg=config)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(pl.cdiv(m, config.block_m) * pl.cdiv(n, config.block_n),),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      name="rlk_det_matmul",
  )(a, b)
