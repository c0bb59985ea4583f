"""det_attention's Hopper kernels launched from torch on its current stream
(C entries of the cuda_ffi library): the forward, and the dK/dV kernel of
the backward (the Triton kernels' bits; ``_triton_attention`` runs the rest
of the ``cuda_ffi`` backward)."""

from __future__ import annotations

import torch

import cuda_ffi
from rlk_jax import _attention
from rlk_torch_bridge import _attention_rows
from rlk_torch_bridge._torch_stream import on_device_of


def takes(q, k, v, s) -> bool:
  """Whether the Hopper kernels take this call: settings they support, and
  rows their TMA can read (else the Triton kernels, with the same bits)."""
  return (_attention.sm90_takes(s, _jax_dtype(q.dtype))
          and _tma_aligned(q, k, v))


def _jax_dtype(dtype):
  return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
      dtype, "float32")


def _tma_aligned(*tensors) -> bool:
  """Whether the Hopper forward's TMA can read these rows: 16-byte aligned
  addresses and token and head strides (a view that is not runs the Triton
  kernels: the same bits)."""
  return all(t.data_ptr() % 16 == 0 and t.stride(-3) % 8 == 0
             and t.stride(-2) % 8 == 0 for t in tensors)


@on_device_of
def forward(q, k, v, seqs, s):
  """(out, lse) of the Hopper forward (the Triton forward's bits)."""
  from triton_kernels import attention as kernels
  rows = cuda_ffi.ATTENTION_TILE_ROWS
  tiles = _attention_rows.tile_map(seqs[1], rows, kernels.tile_bound(
      q.shape[0], seqs.shape[1], rows))
  out = torch.empty_like(q)
  lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
  cuda_ffi.launch_attention_forward(
      torch.cuda.current_stream(q.device).cuda_stream, q, k, v, seqs, tiles,
      out, lse, k_rows=_attention_rows.key_rows(k),
      scale2=_attention._statics(s).constants()["scale2"], window=s.window,
      half=q.dtype == torch.float16)
  return out, lse


@on_device_of
def dkdv(q, k, v, seqs, lse, g, delta, dk, dv, s):
  """The Hopper dK/dV kernel (the Triton dK/dV kernel's bits) into dk, dv."""
  from triton_kernels import attention as kernels
  keys = cuda_ffi.ATTENTION_DKDV_TILE_KEYS
  tiles = _attention_rows.tile_map(seqs[3], keys, kernels.tile_bound(
      _attention_rows.key_tokens(k), seqs.shape[1], keys))
  cuda_ffi.launch_attention_dkdv(
      torch.cuda.current_stream(q.device).cuda_stream, q, k, v, g, lse,
      delta, seqs, tiles, dk, dv, k_rows=_attention_rows.key_rows(k), scale=s.scale,
      scale2=_attention._statics(s).constants()["scale2"], window=s.window,
      half=q.dtype == torch.float16)
