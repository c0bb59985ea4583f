"""det_attention's Hopper kernels launched from torch on its current stream
(C entries of the cuda_ffi library): the forward, and the dK/dV kernel of
the backward (the Triton kernels' bits; ``_triton_attention`` runs the rest
of the ``cuda_ffi`` backward)."""

from __future__ import annotations

import functools

import torch

import cuda_ffi
from rlk_jax import _attention
from rlk_torch_bridge import _attention_rows
from rlk_torch_bridge._torch_stream import current_stream_handle, on_device_of


def takes(q, k, v, s) -> bool:
  """Whether the Hopper kernels take this call: settings they support, and
  rows their TMA can read (else the Triton kernels, with the same bits)."""
  return _settings_taken(s, q.dtype) and _tma_aligned(q, k, v)


@functools.lru_cache(maxsize=256)
def _settings_taken(s, dtype) -> bool:
  return _attention.sm90_takes(s, _jax_dtype(dtype))


@functools.lru_cache(maxsize=256)
def _scale2(s) -> float:
  return _attention._statics(s).constants()["scale2"]


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
  tiles = _attention_rows.sequence_tiles(seqs, 1, cuda_ffi.ATTENTION_TILE_ROWS,
                                         q.shape[0])
  out = torch.empty_like(q)
  lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
  cuda_ffi.launch_attention_forward(
      current_stream_handle(q.device.index), q, k, v, seqs, tiles,
      out, lse, k_rows=_attention_rows.key_rows(k), scale2=_scale2(s),
      window=s.window,
      half=q.dtype == torch.float16)
  return out, lse


@on_device_of
def dkdv(q, k, v, seqs, lse, g, delta, dk, dv, s):
  """The Hopper dK/dV kernel (the Triton dK/dV kernel's bits) into dk, dv."""
  tiles = _attention_rows.sequence_tiles(
      seqs, 3, cuda_ffi.ATTENTION_DKDV_TILE_KEYS, _attention_rows.key_tokens(k))
  cuda_ffi.launch_attention_dkdv(
      current_stream_handle(q.device.index), q, k, v, g, lse,
      delta, seqs, tiles, dk, dv, k_rows=_attention_rows.key_rows(k),
      scale=s.scale, scale2=_scale2(s), window=s.window,
      half=q.dtype == torch.float16)
