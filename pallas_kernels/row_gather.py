"""Row gather with fill: ``out[i] = src[idx[i]] if idx[i] >= 0 else fill``.

This one kernel is both directions of pack/unpack (and both of their
gradients): packing gathers active rows by the gather map, unpacking gathers
packed rows back by the scatter map. Written as a gather on the *output* side,
every output row is written exactly once by exactly one program, so there are
no write conflicts, no atomics and no unwritten (garbage) rows.

Lowered through Pallas' Triton backend on GPUs: a pure data-movement kernel
needs masked vector loads/stores with per-row addresses, which the Triton
lowering expresses directly (no TMA descriptors per gathered row). The same
body runs under ``interpret=True`` on the CPU.

JAX deprecated the Pallas Triton backend in 0.11 (it warns, still works on
0.11.2). Measured on the H100 this kernel moves rows at 1.06-1.2x the copy
byte floor, so a port to Mosaic GPU is about longevity, not speed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton_backend import IMPORT_ERROR, pltriton


@dataclasses.dataclass(frozen=True)
class GatherConfig:
  block_rows: int
  block_cols: int
  num_warps: int


# Bytes one program moves. 16 KiB per program keeps enough loads in flight
# per SM on Hopper while leaving many programs for the tail of ragged sizes.
_BYTES_PER_PROGRAM = 16 * 1024
_MAX_BLOCK_COLS = 4096


def default_config(n_out: int, width: int, itemsize: int) -> GatherConfig:
  elems = max(1, _BYTES_PER_PROGRAM // itemsize)
  block_cols = min(pl.next_power_of_2(max(width, 1)), _MAX_BLOCK_COLS, elems)
  block_rows = max(1, elems // block_cols)
  block_rows = min(block_rows, pl.next_power_of_2(max(n_out, 1)))
  num_warps = 8 if block_rows * block_cols * itemsize >= 8192 else 4
  return GatherConfig(block_rows, block_cols, num_warps)


def _gather_rows_kernel(idx_ref, src_ref, out_ref, *, n_out, width, fill,
                        block_rows, block_cols):
  r0 = pl.program_id(0) * block_rows
  c0 = pl.program_id(1) * block_cols
  rows = r0 + jnp.arange(block_rows, dtype=jnp.int32)
  cols = c0 + jnp.arange(block_cols, dtype=jnp.int32)
  row_in = rows < n_out
  col_in = cols < width
  idx = pltriton.load(idx_ref.at[pl.ds(r0, block_rows)], mask=row_in,
                      other=jnp.array(-1, idx_ref.dtype))
  take = idx >= 0
  # Masked-off lanes are never dereferenced on the GPU; the interpreter
  # evaluates them, so pad rows read row 0 there. Columns stay unclamped: a
  # plain `c0 + arange` keeps Triton's contiguity analysis, which is what
  # gives 16-byte vector loads.
  src_rows = jnp.where(take, idx, 0)
  values = pltriton.load(
      src_ref.at[src_rows[:, None], cols[None, :]],
      mask=take[:, None] & col_in[None, :],
      other=jnp.array(fill, src_ref.dtype),
  )
  pltriton.store(
      out_ref.at[pl.ds(r0, block_rows), pl.ds(c0, block_cols)],
      values,
      mask=row_in[:, None] & col_in[None, :],
  )


def gather_rows(src: jax.Array, idx: jax.Array, fill, *,
                interpret: bool = False,
                config: GatherConfig | None = None) -> jax.Array:
  """``src`` [n_src, width], ``idx`` int32 [n_out] -> [n_out, width].

  Indices must be -1 (take ``fill``) or in ``[0, n_src)``; the caller owns
  that contract. ``fill`` is a static Python scalar.
  """
  if pltriton is None:
    raise RuntimeError(IMPORT_ERROR)
  n_out, = idx.shape
  n_src, width = src.shape
  if n_out == 0 or width == 0 or n_src == 0:
    # Nothing to read: every output row is fill (the caller guarantees idx is
    # all -1 when n_src == 0). A zero-size grid is not a valid launch.
    return jnp.full((n_out, width), fill, src.dtype)
  cfg = config or default_config(n_out, width, jnp.dtype(src.dtype).itemsize)
  kernel = functools.partial(
      _gather_rows_kernel, n_out=n_out, width=width, fill=fill,
      block_rows=cfg.block_rows, block_cols=cfg.block_cols)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((n_out, width), src.dtype),
      grid=(pl.cdiv(n_out, cfg.block_rows), pl.cdiv(width, cfg.block_cols)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=1),
      name="rlk_gather_rows",
  )(idx, src)
