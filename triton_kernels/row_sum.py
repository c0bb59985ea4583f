"""Mean (or sum) over the last dimension, one row per program, as a
``@triton.jit`` kernel (what an RMSNorm's ``x.pow(2).mean(-1)`` reduces,
and its scale's gradient sums).

Why it is batch-invariant: a row's sum is read in ``BLOCK``-wide slices,
in order, into a ``BLOCK``-lane float32 accumulator, then the lanes are
added by one ``tl.sum`` tree. ``BLOCK`` and the warp count depend on the row
length alone, never on the number of rows, so every row of a given length
is summed in the same order whatever the batch. (torch's CUDA reduction
sizes its thread groups from the number of outputs as well, so there a
row's bits can change with the batch.)

The float32 sum is divided by the row length (1 for a sum: exact) with
IEEE rounding and rounded once to the output's dtype: torch's ``(sum /
k).to(dtype)``, in the kernel, so a mean is one launch (an eager decode
step waits on the host).

Launcher: ``row_mean_torch`` (torch tensors; Triton's interpreter under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from triton_kernels.backend import Launcher, triton, tl

__all__ = ["block_for", "row_mean_torch"]

_MAX_BLOCK = 1024
_NUM_WARPS = 4


def block_for(k: int) -> int:
  """The slice width for rows of length `k` (a power of two, at most
  1024): the one choice that fixes a row's summation order."""
  return min(_MAX_BLOCK, max(16, 1 << (max(k, 1) - 1).bit_length()))


if triton is not None:

  @triton.jit
  def _row_mean_kernel(x_ptr, out_ptr, k, row_stride, divisor,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
      cols = start + lanes
      acc += tl.load(x_ptr + row * row_stride + cols, mask=cols < k,
                     other=0.0).to(tl.float32)
    mean = tl.math.div_rn(tl.sum(acc, axis=0), divisor)
    tl.store(out_ptr + row, mean.to(out_ptr.dtype.element_ty))

  _launch = Launcher(_row_mean_kernel)


def row_mean_torch(x, out, divisor: int | None = None):
  """out[r] = sum of x[r, :] / divisor (float32 sum and division, one
  rounding to out's dtype; divisor K, the mean, by default, 1 for the sum);
  x [R, K] with unit column stride, out [R]; R, K > 0 (K < 2**24)."""
  rows, k = x.shape
  block = block_for(k)
  _launch((rows,), (block, _NUM_WARPS), x, out, k, x.stride(0),
          float(k if divisor is None else divisor), BLOCK=block,
          num_warps=_NUM_WARPS)
  return out
