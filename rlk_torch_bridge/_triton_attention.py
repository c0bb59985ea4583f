"""det_attention's Triton kernels launched by Triton itself on torch's
current stream: the ``@triton.jit`` kernels rlk_jax launches through
jax-triton, with the same tile maps (``_attention_rows``), so the same
bits, and no DLPack."""

from __future__ import annotations

import torch

from rlk_jax import _attention
from rlk_torch_bridge import _attention_rows
from rlk_torch_bridge._torch_stream import on_device_of


@on_device_of
def forward(q, k, v, seqs, s, heads_per_tile, split_chunks, page=0):
  """(out, lse); rows in no sequence are left unwritten."""
  from triton_kernels import attention as kernels
  config = kernels.config_for(s.head_dim)
  tokens = config.tile_rows(bool(split_chunks)) // heads_per_tile
  if split_chunks:
    b = seqs.shape[1]
    tiles = _attention_rows.decode_tiles(q.device, b, q.shape[0] // b, tokens)
  else:
    tiles = _attention_rows.sequence_tiles(seqs, 1, tokens, q.shape[0])
  out = torch.empty_like(q)
  lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
  kernels.forward_torch(q, k, v, seqs, tiles, out, lse,
                        _attention._statics(s), config, heads_per_tile,
                        split_chunks, page)
  return out, lse


@on_device_of
def backward(q, k, v, seqs, out, lse, g, s, hopper_dkdv=None):
  """(dq, dk, dv), zero in rows outside every sequence. With `hopper_dkdv`
  (``_sm90_attention.dkdv``: the Triton dK/dV kernel's bits) dK and dV come
  from it, dQ from the Triton kernel."""
  from triton_kernels import attention as kernels
  config = kernels.config_for(s.head_dim)
  statics = _attention._statics(s)
  g = g.contiguous()
  q_tiles = _attention_rows.sequence_tiles(seqs, 1, config.dq_tiles()[0],
                                           q.shape[0])
  # dk and dv number their rows as k and v do (seqs counts them so).
  like = lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                       device=x.device)
  dq, dk, dv = torch.empty_like(q), like(k), like(v)
  if hopper_dkdv is not None:
    delta = kernels.delta_torch(out, g)
    hopper_dkdv(q, k, v, seqs, lse, g, delta, dk, dv, s)
    kernels.dq_torch(q, k, v, g, lse, delta, seqs, q_tiles, dq, statics,
                     config)
  else:
    k_tiles = _attention_rows.sequence_tiles(seqs, 3, config.bwd_block_n,
                                             _attention_rows.key_tokens(k))
    kernels.backward_torch(q, k, v, out, lse, g, seqs, q_tiles, k_tiles,
                           dq, dk, dv, statics, config)
  # Rows outside every sequence are left unwritten by the kernels.
  if _attention_rows.all_rows_in(seqs):
    return dq, dk, dv
  k_rows = _attention_rows.key_rows(k)
  fill = _attention_rows.fill_outside
  return (fill(dq, seqs[0], seqs[1], q.shape[0], 0.0),
          fill(dk, seqs[2], seqs[3], k_rows, 0.0),
          fill(dv, seqs[2], seqs[3], k_rows, 0.0))
