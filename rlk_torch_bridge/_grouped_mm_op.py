"""``rlk::det_grouped_mm``: a mixture-of-experts layer's grouped product,
``torch._grouped_mm(a [S, K], b [E, K, N], offs [E])``, on det_gemm: the
rows ``offs[e-1]:offs[e]`` (sorted by expert, as transformers' experts
sort them) times expert e's weight, each expert's rows one det_gemm call.

Why: transformers 5 runs its MoE experts on ``torch._grouped_mm`` by
default, and torch's kernel promises nothing about a row's bits when the
other experts' row counts change. Here a row's output is a det_gemm row
of its own expert's product, so it depends on its own row and weight only.

On a GPU (implementation None or ``"triton"``) the forward, dA and dB are
one launch each of ``triton_kernels.grouped_matmul``: the groups read on
the device from a tile map, no host sync and no launch per expert, and
each element det_gemm's K walk, so the bits of det_gemm on each expert's
rows (a device test checks them against the Hopper products bit for bit).
Elsewhere, and with another implementation named, the group ends are read
on the host once a call (as transformers' own fallback reads them) and
each expert's rows are one det_gemm call. (That read is a host sync: a
CUDA-graph capture of an MoE layer on that route fails there, with
torch's error, rather than replay stale group ends.)

An operator with a fake kernel and autograd, so a compiled model keeps it
as one opaque call, as transformers does its fallback. Rows past the last
group's end come back 0.
"""

import functools
from typing import Optional

import torch

from rlk_torch_bridge import (_attention_rows, _gemm_op, _library,
                              _triton_native)
from rlk_torch_bridge._gemm_op import det_mm
from rlk_torch_bridge._torch_stream import on_device_of


def _expert_weight(b: torch.Tensor, e: int):
  """(w, transpose_b) with ``a @ op(w) == a @ b[e]``: b's experts stored
  transposed (``[E, N, K]`` viewed as ``[E, K, N]``) are read as such."""
  w = b[e]
  if w.stride(-2) == 1 and w.stride(-1) != 1:
    return w.t().contiguous(), True
  return w.contiguous(), False


def _groups(offs: torch.Tensor):
  start = 0
  for e, end in enumerate(offs.tolist()):
    yield e, start, end
    start = max(start, end)


def _on_grouped_kernel(a, implementation) -> bool:
  """Whether the grouped Triton kernels run this call: CUDA tensors, with
  no implementation named or ``"triton"``."""
  if not a.is_cuda or implementation not in (None, "triton"):
    return False
  from triton_kernels import backend
  return backend.triton is not None


def _device_groups(offs: torch.Tensor, rows: int,
                   device: torch.device) -> torch.Tensor:
  """int32 ``[3, E]`` on `device`, no host read: expert e's rows are
  ``starts[e]:ends[e]`` (rows 0 and 1; row 2 their lengths), `_groups`'
  reading of `offs` (a group ending before an earlier one's end is
  empty), cut at the `rows` rows there are (as the loop's slices of them
  are). Made afresh each call: inside the operator `offs` may be a
  compiled graph's buffer, reused for other values without a version
  bump, so nothing is remembered by its identity."""
  ends = offs.to(device=device, dtype=torch.int32).clamp(0, rows)
  starts = torch.cat([ends.new_zeros(1), ends[:-1]]).cummax(0).values
  ends = torch.maximum(ends, starts)
  return torch.stack([starts, ends, ends - starts])


def _config(m, n, k, transpose_a, dtype, like: torch.Tensor):
  """The Triton tile config of a product, from the table of `like`'s
  device by torch's name for it (no JAX backend started here)."""
  device = (_device_name(like.device.index) if like.is_cuda
            else like.device.type)
  return _triton_native.tile_config(m, n, k, transpose_a, False, dtype,
                                    device)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
  return torch.cuda.get_device_name(index)


def _rows_per_expert(a, experts: int) -> int:
  return max(1, a.shape[0] // max(1, experts))


@on_device_of
def grouped_product(a, b, groups, transpose_b: bool, out_dtype):
  """``out[r] = a[r] @ op(b[e])`` for each row r of expert e, rows past the
  last group 0: one grouped Triton launch. b ``[E, K, N]`` (``[E, N, K]``
  with `transpose_b`) is read through its strides, in place; `groups`:
  `_device_groups`' table."""
  from triton_kernels import grouped_matmul
  e = b.shape[0]
  k, n = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
  config = _config(_rows_per_expert(a, e), n, k, False, a.dtype, a)
  starts, ends, _ = groups
  # Each expert's row tiles in order, as det_attention numbers a
  # sequence's query tiles.
  tiles = _attention_rows.tile_map(
      groups[2], config.block_m,
      grouped_matmul.tile_bound(a.shape[0], e, config.block_m))
  out = a.new_zeros((a.shape[0], n), dtype=out_dtype)
  return grouped_matmul.grouped_matmul_torch(
      a.contiguous(), b, out, tiles, starts, ends, transpose_b=transpose_b,
      config=config)


@on_device_of
def grouped_weight_grad(a, g, groups, dtype):
  """``db[e] = a[rows of e]^T @ g[rows of e]``: one grouped Triton launch."""
  from triton_kernels import grouped_matmul
  starts, ends, _ = groups
  e = starts.shape[0]
  config = _config(a.shape[1], g.shape[1], _rows_per_expert(a, e), True,
                   a.dtype, a)
  db = torch.empty((e, a.shape[1], g.shape[1]), dtype=dtype, device=a.device)
  return grouped_matmul.grouped_weight_grad_torch(a, g, db, starts, ends,
                                                  config=config)


FORWARD_SCHEMA = ("(Tensor a, Tensor b, Tensor offs, ScalarType out_dtype, "
                  "str? implementation) -> Tensor")
BACKWARD_SCHEMA = ("(Tensor a, Tensor b, Tensor offs, Tensor g, bool need_a, "
                   "bool need_b, str? implementation) -> (Tensor, Tensor)")


def _forward_kernel(a, b, offs, out_dtype, implementation):
  _check_shapes(a, b, offs)
  if _on_grouped_kernel(a, implementation):
    return grouped_product(a, b, _device_groups(offs, a.shape[0], a.device),
                           False, out_dtype)
  out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=out_dtype)
  with torch.no_grad():
    for e, start, end in _groups(offs):
      if end > start:
        w, transpose = _expert_weight(b, e)
        out[start:end] = det_mm(a[start:end], w, transpose, out_dtype,
                                implementation)
  return out


def _check_shapes(a, b, offs):
  shapes = (f"rlk::det_grouped_mm takes a [S, K], b [E, K, N] and offs [E]; "
            f"got a {tuple(a.shape)}, b {tuple(b.shape)}, offs "
            f"{tuple(offs.shape)}")
  torch._check(a.ndim == 2 and b.ndim == 3 and offs.ndim == 1,
               lambda: shapes)
  torch._check(a.shape[1] == b.shape[1] and offs.shape[0] == b.shape[0],
               lambda: shapes)


def _forward_fake(a, b, offs, out_dtype, implementation):
  _check_shapes(a, b, offs)
  return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)


def _backward_kernel(a, b, offs, g, need_a, need_b, implementation):
  """(dA, dB), an empty tensor for a gradient not needed. An operator of
  its own: torch.compile traces an autograd function's backward, where
  kernels would be handed fake tensors and the group ends could not be
  read.

  On the grouped kernels, dA rows are g @ b[e]^T (b read transposed, in
  place) and dB[e] each expert's own sum over its rows. Otherwise each
  expert's products run as det_mm's own backward runs them (dB[e] its
  transposed product, aᵀ read in place). Either way dA rows are
  row-invariant and dB[e] a fixed-order sum over that expert's rows."""
  if _on_grouped_kernel(a, implementation):
    groups = _device_groups(offs, a.shape[0], a.device)
    da = (grouped_product(g, b, groups, True, a.dtype) if need_a
          else a.new_empty(0))
    db = (grouped_weight_grad(a, g.contiguous(), groups, b.dtype) if need_b
          else b.new_empty(0))
    return da, db
  da = torch.zeros_like(a) if need_a else a.new_empty(0)
  db = (torch.zeros(b.shape, dtype=b.dtype, device=b.device) if need_b
        else b.new_empty(0))
  for e, start, end in _groups(offs):
    if end <= start:
      continue
    rows, g_rows = a[start:end], g[start:end]
    if need_a:
      w, transpose = _expert_weight(b, e)
      da[start:end] = det_mm(g_rows, w, not transpose, a.dtype,
                             implementation)
    if need_b:
      db[e] = _library.below_autograd(_gemm_op.OP, rows, g_rows, True,
                                      False, b.dtype, implementation)
  return da, db


def _backward_fake(a, b, offs, g, need_a, need_b, implementation):
  return (a.new_empty(a.shape) if need_a else a.new_empty(0),
          b.new_empty(b.shape) if need_b else b.new_empty(0))


class DetGroupedMm(torch.autograd.Function):

  @staticmethod
  def forward(ctx, a, b, offs, out_dtype, implementation):
    ctx.save_for_backward(a, b, offs)
    ctx.implementation = implementation
    return _library.below_autograd(FORWARD, a, b, offs, out_dtype,
                                   implementation)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    da, db = _library.below_autograd(BACKWARD, a, b, offs, g.to(a.dtype),
                                     need_a, need_b, ctx.implementation)
    return (da if need_a else None), (db if need_b else None), None, None, None


FORWARD = _library.define("det_grouped_mm", FORWARD_SCHEMA, _forward_kernel,
                          _forward_fake, DetGroupedMm,
                          _library.first_args_need_grad(2))
BACKWARD = _library.define("det_grouped_mm_backward", BACKWARD_SCHEMA,
                           _backward_kernel, _backward_fake)


def det_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                   out_dtype: torch.dtype,
                   implementation: Optional[str] = None) -> torch.Tensor:
  """``torch.ops.rlk.det_grouped_mm``: ``out[r] = a[r] @ b[e]`` for each
  row r of expert e (module docstring), with its autograd."""
  return _library.call(FORWARD, a, b, offs, out_dtype, implementation)
