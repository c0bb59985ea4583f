"""Where det_attention's rows lie, in torch: the tile maps the kernels walk
(rlk_jax._attention's, the same ints), shape-only bookkeeping made once per
device, rows in no sequence, and how many rows a key tensor read in place
addresses. Shared by the native routes (``_triton_attention``,
``_sm90_attention``) and the operator (``_attention_op``)."""

from __future__ import annotations

import torch

from rlk_torch_bridge import _tables
from rlk_torch_bridge._torch_stream import on_device_of

@on_device_of
def tile_map(lengths, rows_per_tile, n_tiles):
  """rlk_jax._attention._tile_map in torch (the same ints): on CUDA one
  Triton kernel, elsewhere (and for very many sequences) torch's ops."""
  from triton_kernels import attention as kernels
  from triton_kernels import backend
  if (lengths.is_cuda and backend.triton is not None
      and lengths.shape[0] <= kernels.TILE_MAP_MAX_SEQS):
    return kernels.tile_map_torch(lengths.contiguous(), rows_per_tile, n_tiles)
  return tile_map_ops(lengths, rows_per_tile, n_tiles)


def tile_map_ops(lengths, rows_per_tile, n_tiles):
  per_seq = (lengths + rows_per_tile - 1) // rows_per_tile
  ends = torch.cumsum(per_seq, 0, dtype=torch.int32)
  t = torch.arange(n_tiles, dtype=torch.int32, device=lengths.device)
  seq = torch.searchsorted(ends, t, right=True).to(torch.int32)
  valid = seq < lengths.shape[0]
  seq_c = seq.clamp(max=lengths.shape[0] - 1).long()
  first = (t - (ends[seq_c] - per_seq[seq_c])) * rows_per_tile
  return torch.stack([torch.where(valid, seq, -1),
                      torch.where(valid, first, 0)]).to(torch.int32)


# ids of the kept ("padded", ...) tables: every q and k row lies in one of
# their sequences. (Kept tables live as long as the process: ids stay theirs.)
_ALL_ROWS_IN: set = set()


def _made(device, spec):
  kind, *args = spec
  if kind == "arange":
    return torch.arange(args[0], dtype=torch.int32, device=device) * args[1]
  if kind == "full":
    return torch.full((args[0],), args[1], dtype=torch.int32, device=device)
  if kind == "padded":
    b, s, k_rows = args
    base = torch.arange(b, dtype=torch.int32, device=device)
    full = torch.full((b,), s, dtype=torch.int32, device=device)
    return torch.stack([base * s, full, base * k_rows, full])
  # tiles: sequence b's tiles in order, `rows` query rows each
  b, per_seq, rows = args
  t = torch.arange(b * per_seq, dtype=torch.int32, device=device)
  return torch.stack([t // per_seq, (t % per_seq) * rows]).to(torch.int32)


def static_rows(device, specs):
  """int32 tensors that depend on shapes alone (("arange", n, step): 0,
  step, 2 step...; ("full", n, value); ("tiles", b, per_seq, rows): a
  uniform tile map; ("padded", b, s, k_rows): the sequence table of a
  padded batch without a mask, batch row b's keys from key row b *
  k_rows), made once per device and stream (``_tables.static``): a decode
  step's bookkeeping then launches no kernels of its own, and a training
  forward's layers share one table (and so the tile maps
  ``sequence_tiles`` keeps with it)."""
  out = []
  for spec in specs:
    t = _tables.static(device, spec, lambda spec=spec: _made(device, spec))
    if spec[0] == "padded" and _tables.is_kept(t):
      _ALL_ROWS_IN.add(id(t))
    out.append(t)
  return out


def all_rows_in(seqs) -> bool:
  """Whether every q and k row lies in one of these sequences (a kept
  padded table): the kernels then leave no row unwritten, and nothing is
  to be filled after them."""
  return not torch.compiler.is_compiling() and id(seqs) in _ALL_ROWS_IN


def sequence_tiles(seqs, which: int, rows_per_tile: int, n_rows: int):
  """The tile map of the sequences' q (which=1) or k (which=3) rows,
  `rows_per_tile` rows a tile, bounded by `n_rows` rows in all: made once
  per table, stream and tiling (``_tables.derived``; the layers of a
  forward, and their backward, share one table: ``static_rows``, or the
  memo of ``attention.det_attention``)."""
  from triton_kernels import attention as kernels
  n_tiles = kernels.tile_bound(n_rows, seqs.shape[1], rows_per_tile)
  return _tables.derived(
      seqs, ("tiles", which, rows_per_tile, n_tiles),
      lambda: tile_map(seqs[which], rows_per_tile, n_tiles))


def decode_tiles(device, b: int, n: int, tokens: int):
  """A KV-cache call's tile map (`tokens` query rows a tile): every
  sequence has the same `n` q rows, so it is a function of shapes (the same
  ints as _tile_map's), made once."""
  tiles, = static_rows(device, (("tiles", b, -(-n // tokens), tokens),))
  return tiles


def covered(starts, lengths, n):
  """rlk_jax._attention.covered_rows in torch."""
  edges = torch.zeros((n + 1,), dtype=torch.int32, device=starts.device)
  edges.index_add_(0, starts.clamp(0, n).long(), torch.ones_like(starts))
  edges.index_add_(0, (starts + lengths).clamp(0, n).long(),
                   -torch.ones_like(starts))
  return torch.cumsum(edges, 0)[:n] > 0


def in_place(k) -> bool:
  """Whether k (or v) is the ``[B, S, Hkv, D]`` form read in place."""
  return k.ndim == 4


@on_device_of
def fill_outside(x, starts, lengths, n_rows, value):
  """x's rows in no sequence ([starts, starts + lengths)) set to `value`,
  in place; x is rows ([T, H, D] or [T, H]) or [B, S, H, D] read in place
  (`n_rows` rows as the kernels number them). On CUDA one Triton kernel
  writes only those rows (rather than a pass over all of x); elsewhere
  torch's ops."""
  from triton_kernels import attention as kernels
  if x.is_cuda and starts.shape[0] <= kernels.TILE_MAP_MAX_SEQS:
    return kernels.fill_outside_torch(x, starts, lengths, n_rows, value)
  if not in_place(x):
    covered = covered(starts, lengths, n_rows)
    return x.masked_fill_(~covered.view((-1,) + (1,) * (x.ndim - 1)), value)
  b, s = x.shape[:2]
  first = starts - torch.arange(b, dtype=torch.int32, device=x.device) * (
      x.stride(0) // x.stride(1))
  t = torch.arange(s, device=x.device)[None]
  covered = (t >= first[:, None]) & (t < (first + lengths)[:, None])
  return x.masked_fill_(~covered[:, :, None, None], value)


def key_rows(k) -> int:
  """How many rows the kernels may address in k: [Tk, Hkv, D] rows, or a
  [B, S, Hkv, D] view read in place (batch row b's token t is row b *
  stride(0) / stride(1) + t)."""
  if not in_place(k):
    return k.shape[0]
  return (k.shape[0] - 1) * (k.stride(0) // k.stride(1)) + k.shape[1]


def key_tokens(k) -> int:
  """How many key tokens k holds ([Tk, Hkv, D] or [B, S, Hkv, D]): what
  bounds the key tiles its sequences need."""
  return k.numel() // k.shape[-1] // k.shape[-2]
