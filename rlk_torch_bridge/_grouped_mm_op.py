"""``rlk::det_grouped_mm``: a mixture-of-experts layer's grouped product,
``torch._grouped_mm(a [S, K], b [E, K, N], offs [E])``, on det_gemm: the
rows ``offs[e-1]:offs[e]`` (sorted by expert, as transformers' experts
sort them) times expert e's weight, each expert's rows one det_gemm call.

Why: transformers 5 runs its MoE experts on ``torch._grouped_mm`` by
default, and torch's kernel promises nothing about a row's bits when the
other experts' row counts change. Here a row's output is a det_gemm row
of its own expert's product, so it depends on its own row and weight only.

The group ends are read on the host once a call (as transformers' own
fallback reads them); an operator with a fake kernel and autograd, so a
compiled model keeps it as one opaque call, as transformers does its
fallback. Rows past the last group's end come back 0. (The read is a
host sync: a CUDA-graph capture of an MoE layer under the mode fails
there, with torch's error, rather than replay stale group ends.)
"""

from typing import Optional

import torch

from rlk_torch_bridge import _gemm_op, _library
from rlk_torch_bridge._gemm_op import det_mm


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


@torch.library.custom_op("rlk::det_grouped_mm", mutates_args=())
def det_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                   out_dtype: torch.dtype, implementation: Optional[str]
                   ) -> torch.Tensor:
  out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=out_dtype)
  with torch.no_grad():
    for e, start, end in _groups(offs):
      if end > start:
        w, transpose = _expert_weight(b, e)
        out[start:end] = det_mm(a[start:end], w, transpose, out_dtype,
                                implementation)
  return out


@det_grouped_mm.register_fake
def _fake(a, b, offs, out_dtype, implementation):
  torch._check(a.ndim == 2 and b.ndim == 3 and offs.ndim == 1,
               lambda: "rlk::det_grouped_mm: a [S, K], b [E, K, N], offs [E]")
  torch._check(a.shape[1] == b.shape[1],
               lambda: f"rlk::det_grouped_mm: a {a.shape}, b {b.shape}")
  return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)


def _setup(ctx, inputs, output):
  a, b, offs, _, implementation = inputs
  ctx.save_for_backward(a, b, offs)
  ctx.implementation = implementation


def _backward(ctx, g):
  # Each expert's products as det_mm's own backward runs them (dB[e] its
  # transposed product, aᵀ read in place): dA rows row-invariant, dB[e] a
  # fixed-order sum over that expert's rows.
  a, b, offs = ctx.saved_tensors
  impl = ctx.implementation
  need_a, need_b = ctx.needs_input_grad[:2]
  da = torch.zeros_like(a) if need_a else None
  db = torch.zeros(b.shape, dtype=b.dtype, device=b.device) if need_b else None
  g = g.to(a.dtype)
  for e, start, end in _groups(offs):
    if end <= start:
      continue
    rows, g_rows = a[start:end], g[start:end]
    if need_a:
      w, transpose = _expert_weight(b, e)
      da[start:end] = det_mm(g_rows, w, not transpose, a.dtype, impl)
    if need_b:
      db[e] = _library.below_autograd(_gemm_op.OP, rows, g_rows, True, False,
                                      b.dtype, impl)
  return da, db, None, None, None


det_grouped_mm.register_autograd(_backward, setup_context=_setup)
