"""linear_logp's ``cuda_ffi`` route launched straight from torch: the kernels
rlk_jax's ``"cuda_ffi"`` linear_logp runs through XLA FFI (an SM90 det_gemm
per vocabulary chunk, then the CUDA stats, finish and gradient kernels), on
the same operands in the same order, so the same bits, on torch's current
stream: no DLPack, no JAX dispatch, and capturable in a CUDA graph.

rlk_jax takes the weight as ``[H, V]``; torch's ``lm_head.weight`` is
``[V, H]``, and each chunk's rows ``weight[c0:c1]`` are one contiguous
``[chunk, H]`` block, read in place as the products' transposed operand: no
copy of the weight. The gradient of the weight is written as ``[V, H]``
(``dW_c = dlogitsᵀ @ hidden``, a contiguous row block per chunk), the
layout autograd accumulates into ``weight.grad`` without a copy. A product's
bits do not depend on its operands' layouts or on which operand is stored
transposed (each output element sums the same products in the same K order:
device-tested against rlk_jax's ``[H, V]`` products). Stream order and
lifetime hold as for det_gemm's direct route (``_sm90``): every kernel is
enqueued on torch's current stream on torch tensors, and the caching
allocator only reuses a freed temporary (a chunk's logits, say) behind the
kernels already enqueued on that stream.
"""

from __future__ import annotations

import math

import torch

import cuda_ffi
from rlk_jax import _linear_logp
from rlk_torch_bridge import _gemm_routes
from rlk_torch_bridge._torch_stream import current_stream_handle, on_device_of


def _product(a, b, transpose_a, transpose_b, out_dtype):
  """det_gemm's product on the SM90 implementation (the product rlk_jax's
  linear_logp asks det_gemm for)."""
  return _gemm_routes.product(a, b, transpose_a, transpose_b, out_dtype,
                              "cuda_ffi")


def _ptrs(*tensors):
  return [t.data_ptr() for t in tensors]


def _int32(targets):
  # The kernels read int32 ids (what the public function passes; a direct
  # call of the operator may hand int64 ones).
  return targets.to(torch.int32).contiguous()


def _f32(t):
  return t.to(torch.float32).contiguous()


def _chunks(v: int, chunk_size: int):
  return ((c0, min(c0 + chunk_size, v)) for c0 in range(0, v, chunk_size))




@on_device_of
def forward(hidden, weight, targets, temps, chunk_size: int,
            with_entropy: bool):
  """``(logp, entropy, lse)``, f32 ``[N]`` each: hidden ``[N, H]`` bf16,
  weight ``[V, H]``, targets int32 ``[N]`` (-1: ignored), temps f32 ``[N]``
  (each row's temperature); the entropy is NaN without `with_entropy`."""
  n, v = hidden.shape[0], weight.shape[0]
  rows = lambda fill: torch.full((n,), fill, dtype=torch.float32,
                                 device=hidden.device)
  if not n:
    return rows(0.0), rows(0.0), rows(0.0)
  stream = current_stream_handle(hidden.device.index)
  hidden, weight = hidden.contiguous(), weight.contiguous()
  targets, temps = _int32(targets), _f32(temps)
  # rlk_jax's initial stats (pallas_kernels.linear_logp): max -inf, sums 0.
  stats = (rows(-math.inf), rows(0.0), rows(0.0), rows(0.0))
  for c0, c1 in _chunks(v, chunk_size):
    chunk_targets = targets - c0
    for r0, r1 in _linear_logp.row_blocks(n, c1 - c0,
                                          _linear_logp.LOGITS_BLOCK_BYTES):
      logits = _product(hidden[r0:r1], weight[c0:c1], False, True,
                        torch.float32)
      cuda_ffi.launch_logits_stats(
          stream, logits.data_ptr(), chunk_targets[r0:r1].data_ptr(),
          temps[r0:r1].data_ptr(), _ptrs(*(s[r0:r1] for s in stats)),
          r1 - r0, c1 - c0, with_entropy)
      del logits  # one block of logits alive at a time
  logp, lse, entropy = (torch.empty_like(stats[0]) for _ in range(3))
  cuda_ffi.launch_logits_finish(stream, _ptrs(*stats), targets.data_ptr(), n,
                                v, with_entropy, _ptrs(logp, lse, entropy))
  return logp, entropy, lse


@on_device_of
def backward(hidden, weight, targets, temps, lse, entropy, g_logp, g_entropy,
             chunk_size: int, with_entropy: bool, dw_accumulator=None):
  """``(d hidden [N, H], d weight [V, H])``: rlk_jax's VJP
  (``_linear_logp.linear_logp_grads``), product for product. With an f32
  `dw_accumulator` ``[V, H]`` each chunk's weight gradient is taken in f32
  and added into it (the caller's micro-batch sum: no bf16 rounding per
  micro-batch, no second ``[V, H]`` buffer), and d weight is None."""
  (n, h), v = hidden.shape, weight.shape[0]
  if not n:  # a gradient of no rows
    return torch.zeros_like(hidden), (
        None if dw_accumulator is not None
        else hidden.new_zeros((v, h), dtype=weight.dtype))
  stream = current_stream_handle(hidden.device.index)
  hidden, weight = hidden.contiguous(), weight.contiguous()
  targets = _int32(targets)
  temps, lse, entropy, g_logp, g_entropy = (
      _f32(t) for t in (temps, lse, entropy, g_logp, g_entropy))
  # A select, as rlk_jax's: the same bits whatever g_logp holds.
  g_picked = torch.where((targets >= 0) & (targets < v), g_logp, 0.0)
  dh = torch.zeros((n, h), dtype=torch.float32, device=hidden.device)
  dw = (None if dw_accumulator is not None else
        torch.empty((v, h), dtype=weight.dtype, device=weight.device))  # every row written below
  for c0, c1 in _chunks(v, chunk_size):
    w_c = weight[c0:c1]  # [chunk, H], contiguous: read in place
    dlogits = torch.empty((n, c1 - c0), dtype=hidden.dtype,
                          device=hidden.device)
    chunk_targets = targets - c0
    for r0, r1 in _linear_logp.row_blocks(
        n, c1 - c0, _linear_logp.BACKWARD_LOGITS_BLOCK_BYTES):
      logits = _product(hidden[r0:r1], w_c, False, True, torch.float32)
      block = slice(r0, r1)
      cuda_ffi.launch_logits_grad(
          stream, logits.data_ptr(),
          _ptrs(*(t[block] for t in (chunk_targets, temps, lse, entropy,
                                     g_picked, g_entropy))),
          r1 - r0, c1 - c0, with_entropy, dlogits[block].data_ptr())
      del logits
      # rlk_jax sums dh over the chunks in vocabulary order, in f32: so
      # here (a row block's rows are the same rows of the whole product).
      dh[block] += _product(dlogits[block], w_c, False, False, torch.float32)
    if dw is not None:
      dw[c0:c1] = _product(dlogits, hidden, True, False, weight.dtype)
    else:
      dw_accumulator[c0:c1] += _product(dlogits, hidden, True, False,
                                        torch.float32)
  return dh.to(hidden.dtype), dw
