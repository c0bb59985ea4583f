"""Row gather with fill as a ``@triton.jit`` kernel:
``out[i] = src[idx[i]] if idx[i] >= 0 else fill`` (pack and unpack, and
their gradients; ``pallas_kernels/row_gather.py`` says why one gather on the
output side serves all four). Every output row is written once by one
program: no atomics, no unwritten rows. Only bytes move, so the bits are
the source's.

Launchers: ``gather_rows`` (JAX arrays, through jax-triton) and
``gather_rows_torch`` (torch tensors, Triton's launcher; Triton's
interpreter with ``TRITON_INTERPRET=1``, which the CPU tests use).
"""

from __future__ import annotations

from triton_kernels import jax_launch
from triton_kernels.backend import cdiv, tl, triton

__all__ = ["gather_rows", "gather_rows_torch"]


if triton is not None:

  @triton.jit
  def _gather_rows_kernel(idx_ptr, src_ptr, out_ptr, n_out, width,
                          FILL: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    # A plain program offset + arange keeps Triton's contiguity analysis:
    # 16-byte vector loads and stores along a row.
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_in = rows < n_out
    col_in = cols[None, :] < width
    idx = tl.load(idx_ptr + rows, mask=row_in, other=-1)
    take = idx >= 0
    # Masked lanes are never read on a GPU; the interpreter evaluates their
    # addresses, so pad rows point at row 0. 64-bit: rows x width may pass
    # 2**31 elements.
    src_rows = tl.where(take, idx, 0).to(tl.int64)
    values = tl.load(src_ptr + src_rows[:, None] * width + cols[None, :],
                     mask=take[:, None] & col_in, other=FILL)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :],
             values, mask=row_in[:, None] & col_in)


def _grid(n_out, width, config):
  return (cdiv(n_out, config.block_rows),
          cdiv(width, config.block_cols))


def gather_rows(src, idx, fill, *, config):
  """``src`` [n_src, width], ``idx`` int32 [n_out] (-1 or in [0, n_src)) ->
  [n_out, width], JAX arrays through jax-triton; all sizes > 0. `config`:
  block_rows/block_cols/num_warps (the Pallas kernel's GatherConfig)."""
  import jax
  n_out, = idx.shape
  width = src.shape[1]
  # The output pointer comes after the positional inputs (out_ptr, third);
  # the sizes go as compile-time constants (det_matmul.matmul says why).
  return jax_launch.triton_call(
      idx, src, kernel=_gather_rows_kernel, n_out=n_out, width=width,
      out_shape=jax.ShapeDtypeStruct((n_out, width), src.dtype),
      grid=_grid(n_out, width, config), num_warps=config.num_warps,
      num_stages=1, name="rlk_gather_rows_triton", FILL=fill,
      BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols)


def gather_rows_torch(src, idx, fill, out, *, config):
  """The same into `out` ([n_out, width], contiguous) for torch tensors."""
  n_out, width = out.shape
  _gather_rows_kernel[_grid(n_out, width, config)](
      idx, src, out, n_out, width, FILL=fill, BLOCK_ROWS=config.block_rows,
      BLOCK_COLS=config.block_cols, num_warps=config.num_warps, num_stages=1)
  return out
