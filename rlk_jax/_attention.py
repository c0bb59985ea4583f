"""det_attention: causal attention whose every query row is bitwise the same
whatever batch, pack, padding or call it rides in, so a decode step against
a KV cache gives the prefill's bits and a rollout's attention equals its
training forward's.

One call, three layouts (chosen by the arguments):

* packed varlen: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with ``cu_seqlens``
  ``[B + 1]`` or ``info`` (rlk's ``PackInfo``, as ``pack`` returns it);
  without either, one sequence;
* padded: ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` with an optional
  key padding ``mask [B, S]`` (each row's valid tokens contiguous: left or
  right padding);
* KV cache: ``q [B, n, Hq, D]`` (the n newest tokens of each sequence)
  against ``k, v [B, S_cache, Hkv, D]`` with ``kv_lens [B]`` valid keys
  (the n new ones included) from ``kv_start [B]`` (default 0);
* paged KV cache (vLLM's layout): the same queries against ``k, v
  [num_blocks, page, Hkv, D]`` with ``kv_lens [B]`` and ``block_tables
  [B, blocks]`` (sequence b's key j in block ``block_tables[b, j //
  page]``); the kernels read the blocks where they lie, with a contiguous
  cache's bits; forward only;
* masked: ``q [B, n, Hq, D]`` against ``k, v [B, S, Hkv, D]`` with a dense
  ``attn_mask [B, n, S]`` (True: the row sees the key), as a model builds
  it for a prefill, a training forward or a decode step against a cache;
  read back into sequences on the device (``_masked_seqs``).

Every layout reduces to one description, ``seqs = [q_start, q_len, k_start,
k_len]`` per sequence over flattened rows (a paged cache's block tables
follow as more rows), which both the kernels and the reference consume; the contract and its reasoning are in
``triton_kernels.attention``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rlk_jax import _dispatch, reference
from triton_kernels import backend as triton_backend

HEAD_DIMS = (64, 128, 256)


def _kernels():
  from triton_kernels import attention
  return attention


@dataclasses.dataclass(frozen=True)
class Settings:
  """The static part of a call: what the model fixes."""
  group: int
  head_dim: int
  scale: float
  softcap: float | None
  window: int | None
  heads_per_tile: int
  split_chunks: int = 0   # decode: key chunks in parallel programs
  # Every q and k row lies in a sequence (a padded batch without a mask,
  # one packed sequence): no rows outside them to zero.
  all_rows_in: bool = False
  # > 0: k and v are the rows of a paged cache of `page`-token blocks, and
  # seqs carries each sequence's block table after its four rows.
  page: int = 0


def _blocks(head_dim: int) -> tuple[int, int, int]:
  """(decode tile rows, block_n, fold_keys) of the kernels: the reference
  walks the kernels' blocks and chunks (the interpreter's in CPU tests of
  the kernels are smaller; bits are not promised between the reference and
  the kernels). The config table imports without Triton."""
  c = _kernels().config_for(head_dim)
  return c.tile_rows(True), c.block_n, c.fold_keys


def _contiguous(k, v, seqs, page: int):
  """A paged cache's sequences copied out as contiguous rows (sequence b's
  keys from row ``b * blocks * page``), and seqs to match: what the
  reference reads (the kernels read the blocks where they lie)."""
  tables = seqs[4:].T                                   # [n_seqs, blocks]
  n_seqs, blocks = tables.shape
  rows = (tables[:, :, None] * page
          + jnp.arange(page, dtype=jnp.int32)).reshape(-1)
  starts = jnp.arange(n_seqs, dtype=jnp.int32) * (blocks * page)
  return k[rows], v[rows], seqs[:4].at[2].set(starts)


def _reference_fwd(q, k, v, seqs, settings: Settings):
  _, block_n, fold_keys = _blocks(settings.head_dim)
  if settings.page:
    k, v, seqs = _contiguous(k, v, seqs, settings.page)
  return reference.attention(q, k, v, seqs, scale=settings.scale,
                             block_n=block_n, fold_keys=fold_keys,
                             softcap=settings.softcap, window=settings.window)


def _tile_map(q_len, rows_per_tile: int, n_tiles: int):
  """int32 [2, n_tiles]: each tile's sequence (-1: none) and first row."""
  per_seq = (q_len + rows_per_tile - 1) // rows_per_tile
  ends = jnp.cumsum(per_seq)
  t = jnp.arange(n_tiles, dtype=jnp.int32)
  # Unrolled: the default search is a loop, which XLA:GPU runs one
  # iteration a launch with the trip test read back by the host (a decode
  # step's attention took 230 us for microseconds of work).
  seq = jnp.searchsorted(ends, t, side="right",
                         method="scan_unrolled").astype(jnp.int32)
  valid = seq < q_len.shape[0]
  seq_c = jnp.minimum(seq, q_len.shape[0] - 1)
  first = (t - (ends[seq_c] - per_seq[seq_c])) * rows_per_tile
  return jnp.stack([jnp.where(valid, seq, -1),
                    jnp.where(valid, first, 0)]).astype(jnp.int32)


def _tiles(seqs, which: int, rows_per_tile: int, n_rows: int,
           settings: Settings):
  """The tile map of the sequences' q (which=1) or k (which=3) rows,
  `rows_per_tile` a tile, bounded by `n_rows` rows in all. Where every
  row lies in a sequence, all of one length (settings.all_rows_in), it is
  a constant of the shapes, made here rather than on the device."""
  n_seqs = seqs.shape[1]
  n_tiles = _kernels().tile_bound(n_rows, n_seqs, rows_per_tile)
  if not settings.all_rows_in:
    return _tile_map(seqs[which], rows_per_tile, n_tiles)
  per_seq = -(-(n_rows // n_seqs) // rows_per_tile)
  t = np.arange(n_tiles)
  valid = t < n_seqs * per_seq
  return jnp.asarray(np.stack([np.where(valid, t // per_seq, -1),
                               np.where(valid, t % per_seq * rows_per_tile,
                                        0)]).astype(np.int32))


def _triton_fwd(q, k, v, seqs, settings: Settings):
  kernels = _kernels()
  config = kernels.config_for(settings.head_dim)
  hpt = settings.heads_per_tile
  tokens = config.tile_rows(bool(settings.split_chunks)) // hpt
  tiles = _tiles(seqs, 1, tokens, q.shape[0], settings)
  return kernels.forward_jax(q, k, v, seqs, tiles, _statics(settings),
                             config, hpt, settings.split_chunks,
                             settings.page)


def sm90_takes(settings: Settings, dtype) -> bool:
  """Whether the Hopper forward runs this call (else the Triton kernels:
  the same bits). It takes the training and prefill forward, not a split
  decode step, a paged cache or a logit softcap, at head dims 64 and
  128."""
  import cuda_ffi
  return (settings.split_chunks == 0 and settings.page == 0
          and settings.softcap is None
          and settings.heads_per_tile == 1
          and settings.head_dim in cuda_ffi.ATTENTION_HEAD_DIMS
          and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))


def _sm90_fwd(q, k, v, seqs, settings: Settings):
  if not sm90_takes(settings, q.dtype):
    return _triton_fwd(q, k, v, seqs, settings)
  import cuda_ffi
  kernels = _kernels()
  tiles = _tiles(seqs, 1, cuda_ffi.ATTENTION_TILE_ROWS, q.shape[0], settings)
  return cuda_ffi.attention_forward(
      q, k, v, seqs, tiles, scale2=_statics(settings).constants()["scale2"],
      window=settings.window)


def _sm90_reason(platform: str) -> str | None:
  import cuda_ffi
  return cuda_ffi.unavailable_reason(platform) or triton_backend.unavailable_reason(platform)


def covered_rows(starts, lengths, n: int):
  """bool [n]: rows inside some [start, start + length) (sequences never
  overlap): a difference array and its prefix sum, O(n + B)."""
  edges = jnp.zeros((n + 1,), jnp.int32)
  edges = edges.at[jnp.clip(starts, 0, n)].add(1)
  edges = edges.at[jnp.clip(starts + lengths, 0, n)].add(-1)
  return jnp.cumsum(edges)[:n] > 0


def _outside_zeroed(q, k, seqs, settings, dq, dk, dv):
  """The gradients with rows outside every sequence (which the kernels
  leave unwritten) zeroed: a pass over each, unless there are none."""
  if settings.all_rows_in:
    return dq, dk, dv
  q_in = covered_rows(seqs[0], seqs[1], q.shape[0])[:, None, None]
  k_in = covered_rows(seqs[2], seqs[3], k.shape[0])[:, None, None]
  zero = jnp.zeros((), q.dtype)
  return (jnp.where(q_in, dq, zero), jnp.where(k_in, dk, zero),
          jnp.where(k_in, dv, zero))


def _triton_bwd(q, k, v, seqs, settings, out, lse, g):
  kernels = _kernels()
  config = kernels.config_for(settings.head_dim)
  grads = kernels.backward_jax(
      q, k, v, out, lse, g, seqs,
      _tiles(seqs, 1, config.dq_tiles()[0], q.shape[0], settings),
      _tiles(seqs, 3, config.bwd_block_n, k.shape[0], settings),
      _statics(settings), config)
  return _outside_zeroed(q, k, seqs, settings, *grads)


def _sm90_bwd(q, k, v, seqs, settings, out, lse, g):
  """The Hopper dK/dV kernel (the Triton dK/dV kernel's bits) between the
  Triton delta and dQ kernels, where the Hopper forward runs."""
  if not sm90_takes(settings, q.dtype):
    return _triton_bwd(q, k, v, seqs, settings, out, lse, g)
  import cuda_ffi
  kernels = _kernels()
  config = kernels.config_for(settings.head_dim)
  statics = _statics(settings)
  delta = kernels.delta_jax(out, g)
  k_tiles = _tiles(seqs, 3, cuda_ffi.ATTENTION_DKDV_TILE_KEYS, k.shape[0],
                   settings)
  dk, dv = cuda_ffi.attention_dkdv(
      q, k, v, g, lse, delta, seqs, k_tiles, scale=settings.scale,
      scale2=statics.constants()["scale2"], window=settings.window)
  dq = kernels.dq_jax(
      q, k, v, g, lse, delta, seqs,
      _tiles(seqs, 1, config.dq_tiles()[0], q.shape[0], settings), statics,
      config)
  return _outside_zeroed(q, k, seqs, settings, dq, dk, dv)


def _reference_bwd(q, k, v, seqs, settings, out, lse, g):
  # The reference's own VJP (reverse mode through its loops): deterministic
  # on CPUs; on GPUs XLA's scatter-add of the key gradients uses atomics
  # (name "triton" there for a deterministic backward).
  _, vjp = jax.vjp(lambda q, k, v: _reference_fwd(q, k, v, seqs, settings)[0],
                   q, k, v)
  return vjp(g)


@functools.lru_cache(maxsize=256)
def _statics(settings: Settings):
  return _kernels().Statics(settings.group, settings.head_dim, settings.scale,
                            settings.softcap, settings.window)


TABLE = _dispatch.register(_dispatch.OpTable(
    op="det_attention",
    implementations={
        "xla": _dispatch.Implementation(
            "xla", (_reference_fwd, _reference_bwd), lambda platform: None,
            "plain jnp: the kernels' blocks with explicit loops; the oracle "
            "and the CPU default"),
        "triton": _dispatch.Implementation(
            "triton", (_triton_fwd, _triton_bwd),
            triton_backend.unavailable_reason,
            "@triton.jit flash-style kernels through jax-triton (and natively "
            "from torch); CUDA GPUs"),
        "cuda_ffi": _dispatch.Implementation(
            "cuda_ffi", (_sm90_fwd, _sm90_bwd), _sm90_reason,
            "Hopper (sm_90a): warp-specialised wgmma/TMA kernels for the "
            "forward and the backward's dK/dV with the Triton kernels' bits "
            "(the Triton kernels for the rest: decode steps, softcap, head "
            "dim 256, the backward's delta and dQ)"),
    },
    preference={"cpu": ("xla",), "gpu": ("cuda_ffi", "triton", "xla")},
))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(impl, settings, q, k, v, seqs):
  return TABLE.implementations[impl].fn[0](q, k, v, seqs, settings)


def _attention_fwd(impl, settings, q, k, v, seqs):
  out, lse = _attention(impl, settings, q, k, v, seqs)
  return (out, lse), (q, k, v, seqs, out, lse)


def _attention_bwd(impl, settings, residuals, cotangents):
  q, k, v, seqs, out, lse = residuals
  g, _ = cotangents  # lse is returned for inspection, not differentiated
  dq, dk, dv = rlk_attention_backward(impl, settings, q, k, v, seqs, out, lse,
                                      g.astype(q.dtype))
  return dq, dk, dv, None


@functools.partial(jax.jit, static_argnums=(0, 1))
def rlk_attention_backward(impl, settings, q, k, v, seqs, out, lse, g):
  """The backward as one named call: ``batch_invariant`` binds a jit named
  ``rlk_...`` whole when it rewrites a traced backward, so these bits stay
  the kernels' own."""
  if settings.page:
    raise NotImplementedError(PAGED_NO_GRADIENT)
  return TABLE.implementations[impl].fn[1](q, k, v, seqs, settings, out, lse,
                                           g)


_attention.defvjp(_attention_fwd, _attention_bwd)
# Eager calls run compiled (an eager custom_vjp re-traces its loops every
# call: half a second for the reference); under an outer jit it inlines.
_attention_jit = jax.jit(_attention, static_argnums=(0, 1))


# ----------------------------------------------------------------- layouts


def _i32(x, what):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"det_attention: {what} must be integers, got {x.dtype}")
  return x.astype(jnp.int32)


def _packed_seqs(t: int, cu_seqlens):
  cu = _i32(cu_seqlens, "cu_seqlens")
  if cu.ndim != 1 or cu.shape[0] < 2:
    raise ValueError("det_attention: cu_seqlens must be [B + 1] with B >= 1, "
                     f"got shape {cu.shape}")
  # A pack that dropped rows past its capacity keeps what fits.
  start = jnp.minimum(cu[:-1], t)
  length = jnp.minimum(cu[1:], t) - start
  return jnp.stack([start, length, start, length])


def _padded_seqs(b: int, s: int, mask):
  """Sequences of a padded batch, and which rows break the contiguity the
  layout needs (they come back NaN, never silently wrong)."""
  if mask is None:
    start = jnp.arange(b, dtype=jnp.int32) * s
    length = jnp.full((b,), s, jnp.int32)
    return jnp.stack([start, length, start, length]), None
  mask = jnp.asarray(mask)
  if mask.shape != (b, s) or mask.dtype != jnp.bool_:
    raise ValueError(f"det_attention: mask must be bool [B, S] = [{b}, {s}], "
                     f"got {mask.dtype} {mask.shape}")
  length = jnp.sum(mask, axis=1, dtype=jnp.int32)
  first = jnp.where(length > 0, jnp.argmax(mask, axis=1), 0).astype(jnp.int32)
  cols = jnp.arange(s)[None]
  contiguous = jnp.all(mask == ((cols >= first[:, None]) &
                                (cols < (first + length)[:, None])), axis=1)
  if not isinstance(contiguous, jax.core.Tracer) and not bool(
      jnp.all(contiguous)):
    bad = [int(i) for i in jnp.nonzero(~contiguous)[0]]
    raise ValueError(
        "det_attention: a padded batch's mask must mark one contiguous run "
        f"of tokens per row (left or right padding); rows {bad} have gaps")
  start = jnp.arange(b, dtype=jnp.int32) * s + first
  return jnp.stack([start, length, start, length]), contiguous


def _cache_seqs(b: int, n: int, s_cache: int, kv_lens, kv_start):
  kv_lens = _i32(kv_lens, "kv_lens")
  if kv_lens.shape != (b,):
    raise ValueError(f"det_attention: kv_lens must be [B] = [{b}], got "
                     f"{kv_lens.shape}")
  kv_start = (jnp.zeros((b,), jnp.int32) if kv_start is None
              else _i32(kv_start, "kv_start"))
  if kv_start.shape != (b,):
    raise ValueError(f"det_attention: kv_start must be [B] = [{b}], got "
                     f"{kv_start.shape}")
  if not isinstance(kv_lens, jax.core.Tracer) and not isinstance(
      kv_start, jax.core.Tracer):
    if bool(jnp.any(kv_lens < n)) or bool(jnp.any(kv_start + kv_lens > s_cache)):
      raise ValueError(
          f"det_attention: each sequence needs n={n} <= kv_lens and "
          f"kv_start + kv_lens <= the cache's {s_cache} slots; got kv_lens "
          f"{kv_lens.tolist()}, kv_start {kv_start.tolist()}")
  q_start = jnp.arange(b, dtype=jnp.int32) * n
  return jnp.stack([q_start, jnp.full((b,), n, jnp.int32),
                    jnp.arange(b, dtype=jnp.int32) * s_cache + kv_start,
                    kv_lens])


def _paged_seqs(b: int, n: int, n_blocks: int, page: int, kv_lens,
                block_tables):
  """A paged cache's sequences: each one's four rows (its keys counted
  from 0 in its own blocks) and then its block table, ``[4 + blocks,
  B]``: the kernels read sequence s's logical block j at ``seqs[4 + j,
  s]``. And which sequences are well formed: concrete input that is not
  raises; traced input's bad sequences come back NaN (never a read outside
  the cache: the kernel bounds both)."""
  kv_lens = _i32(kv_lens, "kv_lens")
  tables = _i32(block_tables, "block_tables")
  if kv_lens.shape != (b,):
    raise ValueError(f"det_attention: kv_lens must be [B] = [{b}], got "
                     f"{kv_lens.shape}")
  if tables.ndim != 2 or tables.shape[0] != b or tables.shape[1] < 1:
    raise ValueError(f"det_attention: block_tables must be [B, blocks] = "
                     f"[{b}, >= 1], got {tables.shape}")
  slots = tables.shape[1] * page
  lengths_ok = (kv_lens >= n) & (kv_lens <= slots)
  # Blocks a sequence uses (past its length the table is not read).
  used = (jnp.arange(tables.shape[1])[None] * page) < kv_lens[:, None]
  blocks_ok = ~jnp.any(used & ((tables < 0) | (tables >= n_blocks)), axis=1)
  if not isinstance(lengths_ok, jax.core.Tracer) and not bool(
      jnp.all(lengths_ok)):
    raise ValueError(
        f"det_attention: each sequence needs n={n} <= kv_lens <= its "
        f"{tables.shape[1]} blocks x {page} = {slots} slots; got kv_lens "
        f"{kv_lens.tolist()}")
  if not isinstance(blocks_ok, jax.core.Tracer) and not bool(
      jnp.all(blocks_ok)):
    raise ValueError(
        f"det_attention: block_tables name blocks outside the cache's "
        f"{n_blocks} (rows {jnp.nonzero(~blocks_ok)[0].tolist()})")
  zeros = jnp.zeros((b,), jnp.int32)
  seqs = jnp.concatenate([
      jnp.stack([jnp.arange(b, dtype=jnp.int32) * n,
                 jnp.full((b,), n, jnp.int32), zeros, kv_lens]),
      tables.T])
  return seqs, lengths_ok & blocks_ok


def _masked_seqs(mask, segments: int):
  """Sequences of a dense ``[B, n, S]`` mask, at most `segments` a batch
  row, and whether each batch row's mask is the one they imply.

  A causal row sees its own slot last, so the rows' slots lie on one line,
  ``slot = c + row``, fixed by the first row that sees the furthest key
  (rows after it that see no further, right padding, are not on it). A row
  is a token iff it sees its slot; consecutive tokens that see from the
  same first key are one sequence, its keys from that first key to the
  last row's slot. Rows that are not tokens (padding) may see anything:
  their output is 0. A token that sees other keys than its sequence's
  causal run, or a sequence past `segments`, marks its batch row as not
  fitting (its rows come back NaN). All of it per batch row: no row's
  sequence depends on another batch row, so the bits do not either."""
  b, n, s = mask.shape
  rows = jnp.arange(n, dtype=jnp.int32)
  cols = jnp.arange(s, dtype=jnp.int32)
  sees = jnp.any(mask, axis=-1)
  first = jnp.argmax(mask, axis=-1).astype(jnp.int32)
  last = jnp.where(sees, s - 1 - jnp.argmax(mask[..., ::-1], axis=-1), -1)
  anchor = jnp.argmax(last, axis=-1)                    # first furthest row
  c = jnp.take_along_axis(last, anchor[:, None], 1) - anchor[:, None]
  slot = c + rows[None]                                 # [B, n]
  at_slot = jnp.take_along_axis(mask, jnp.clip(slot, 0, s - 1)[..., None],
                                -1)[..., 0]
  token = (slot >= 0) & (slot < s) & at_slot
  prev_token = jnp.pad(token[:, :-1], ((0, 0), (1, 0)))
  prev_first = jnp.pad(first[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = token & ~(prev_token & (prev_first == first))
  run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
  want = (token[..., None] & (cols >= first[..., None])
          & (cols <= slot[..., None]))
  fits = ~jnp.any(token[..., None] & (mask != want), axis=(1, 2))
  fits &= ~jnp.any(token & (run >= segments), axis=1)
  cols_of = []
  for r in range(segments):
    member = token & (run == r)
    q_len = jnp.sum(member, axis=1, dtype=jnp.int32)
    i0 = jnp.argmax(member, axis=1).astype(jnp.int32)
    key0 = jnp.take_along_axis(first, i0[:, None], 1)[:, 0]
    k_len = jnp.where(q_len > 0, c[:, 0] + i0 + q_len - key0, 0)
    base = jnp.arange(b, dtype=jnp.int32)
    cols_of.append(jnp.stack([base * n + i0, q_len, base * s + key0, k_len]))
  seqs = jnp.stack(cols_of, axis=-1).reshape(4, b * segments)
  return seqs.astype(jnp.int32), fits


# Both front ends' answer to a gradient through a paged cache.
PAGED_NO_GRADIENT = (
    "det_attention: no gradients through a paged KV cache (a rollout's "
    "cache); the training forward takes the packed, padded or "
    "contiguous-cache layouts, which give the same bits")


def decode_plan(layout: str, q_shape, k_shape, group: int) -> tuple[int, int]:
  """(query heads per forward program, key chunks run in parallel). Both
  change no bit: rows are independent, and parallel chunks fold as one
  program folds them. Only a KV-cache call uses them: its few query rows
  would leave most of the GPU idle walking long contexts one block at a
  time (and it runs the split kernels, whose tiles suit few rows, even for
  one chunk). A power-of-two group packs into one program's rows (its
  cache read once) when there is work enough to fill the GPU without."""
  block_m, _, fold = _blocks(q_shape[-1])
  b, n, s_cache, hkv = q_shape[0], q_shape[1], k_shape[1], k_shape[2]
  # A masked call of a few rows against more keys is a cache step.
  if layout not in ("kv cache", "paged cache") and not (
      layout == "masked" and n < s_cache and n * group <= block_m):
    return 1, 0
  chunks = -(-s_cache // fold)
  hpt = 1
  if (group & (group - 1) == 0 and n * group <= block_m
      and b * hkv * chunks >= 256):
    hpt = group
  return hpt, chunks


def layout_of(q_ndim: int, cu_seqlens, info, mask, kv_lens, kv_start,
              attn_mask=None, block_tables=None):
  """(layout name, cu_seqlens) from which layout arguments a call gives."""
  if block_tables is not None:
    if kv_lens is None or q_ndim != 4:
      raise ValueError("det_attention: block_tables (a paged KV cache) go "
                       "with [B, n, H, D] queries and kv_lens")
    if kv_start is not None:
      raise ValueError("det_attention: a paged cache's sequences start at "
                       "their first block; kv_start is for a contiguous "
                       "cache")
    if any(x is not None for x in (cu_seqlens, info, mask, attn_mask)):
      raise ValueError("det_attention: block_tables go with kv_lens alone")
    return "paged cache", None
  if sum(x is not None for x in (cu_seqlens, info, mask, kv_lens,
                                 attn_mask)) > 1:
    raise ValueError("det_attention: give at most one of cu_seqlens, info, "
                     "mask, kv_lens and attn_mask (they name the layout)")
  if attn_mask is not None:
    if q_ndim != 4:
      raise ValueError("det_attention: attn_mask goes with [B, n, H, D] "
                       "queries against [B, S, H, D] keys")
    return "masked", None
  if kv_start is not None and kv_lens is None:
    raise ValueError("det_attention: kv_start needs kv_lens (the KV-cache "
                     "layout)")
  if info is not None:
    cu_seqlens = info.cu_seqlens
  layout = ("kv cache" if kv_lens is not None else
            "packed" if q_ndim == 3 else "padded")
  if layout == "packed" and mask is not None:
    raise ValueError("det_attention: mask goes with the padded [B, S, H, D] "
                     "layout; packed rows take cu_seqlens or info")
  if layout == "padded" and cu_seqlens is not None:
    raise ValueError("det_attention: cu_seqlens goes with packed [T, H, D] "
                     "rows, not a padded [B, S, H, D] batch")
  return layout, cu_seqlens


def check_operands(q_shape, k_shape, v_shape, dtypes, layout: str, *,
                   causal=True, sliding_window=None, softcap=None) -> None:
  """Every route's checks, on plain shapes and dtype names (no framework
  objects: torch.compile traces the bridge's call of it)."""
  if not causal:
    raise NotImplementedError(
        "det_attention: only causal attention is implemented (causal=False "
        "is not)")
  q_shape, k_shape, v_shape = (tuple(s) for s in (q_shape, k_shape, v_shape))
  if dtypes[0] not in ("bfloat16", "float16") or len(set(dtypes)) != 1:
    raise TypeError("det_attention: q, k, v must share one dtype of "
                    f"bfloat16/float16, got {', '.join(dtypes)}")
  if k_shape != v_shape:
    raise ValueError(f"det_attention: k {k_shape} and v {v_shape} differ")
  if len(q_shape) not in (3, 4) or len(k_shape) != len(q_shape):
    raise ValueError(
        f"det_attention ({layout}): q and k must both be [T, H, D] or [B, S, "
        f"H, D], got q {q_shape}, k {k_shape}")
  lead = len(q_shape) - 2
  hq, d = q_shape[-2:]
  hkv = k_shape[-2]
  if k_shape[-1] != d:
    raise ValueError(f"det_attention: head dims differ: q {q_shape}, k "
                     f"{k_shape}")
  if d not in HEAD_DIMS:
    raise NotImplementedError(
        f"det_attention: head dim {d} is not supported (supported: "
        f"{HEAD_DIMS})")
  if hkv == 0 or hq % hkv:
    raise ValueError(f"det_attention: {hq} query heads are not a multiple of "
                     f"{hkv} KV heads")
  if (layout not in ("kv cache", "masked", "paged cache")
      and k_shape[:lead] != q_shape[:lead]):
    raise ValueError(f"det_attention ({layout}): q {q_shape} and k {k_shape} "
                     "must have the same tokens")
  if layout in ("kv cache", "masked") and k_shape[0] != q_shape[0]:
    raise ValueError(f"det_attention: q {q_shape} and the cache {k_shape} "
                     "must have the same batch")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"det_attention: sliding_window must be >= 1, got "
                     f"{sliding_window}")
  if softcap is not None and not softcap > 0:
    raise ValueError(f"det_attention: softcap must be > 0, got {softcap}")


def det_attention(q, k, v, *, cu_seqlens=None, info=None, mask=None,
                  kv_lens=None, kv_start=None, block_tables=None,
                  attn_mask=None,
                  segments_per_row: int = 1, scale: float | None = None,
                  causal: bool = True, sliding_window: int | None = None,
                  softcap: float | None = None, return_lse: bool = False,
                  implementation: str | None = None):
  """Batch-invariant causal attention (see the module docstring for the
  layouts).

  Every query row's output is bitwise a function of its own q and its own
  sequence's keys and values up to its position: the same alone, in a
  batch, at any place in a pack, with any padding on either side, and
  whether its sequence is computed in one call, in chunks, or one token at
  a time against a KV cache. (Per implementation and device; the ``xla``
  reference and the kernels round differently.)

  Args:
    q, k, v: bf16 or f16; Hq a multiple of Hkv (GQA/MQA); head dim 64, 128
      or 256.
    scale: softmax scale, default ``1/sqrt(D)``.
    sliding_window: W: a query at position p sees keys above p - W
      (Mistral's, Gemma 2/3's local layers).
    softcap: logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    attn_mask: bool ``[B, n, S]`` (or broadcastable to it): the masked
      layout. Each batch row's mask must be causal runs cut by padding: a
      token (a row that sees its own slot) sees its sequence's keys up to
      its slot; up to `segments_per_row` sequences a batch row (a pack).
      Rows that are not tokens give 0; a batch row whose mask is anything
      else gives NaN rows (a sliding window is not read from a mask).
    block_tables: int ``[B, blocks]``, with ``kv_lens``: a paged KV cache
      as vLLM lays it out, k and v ``[num_blocks, page, Hkv, D]``; sequence
      b's key j lies in block ``block_tables[b, j // page]`` at slot ``j %
      page``. The same bits as the keys in a contiguous cache; forward
      only (a rollout's cache).
    return_lse: also return the f32 log-sum-exp per row and head, shaped
      like q without its last axis (what the backward uses).

  Returns ``out`` shaped like q (and ``lse``). Rows outside every sequence
  (padding, a pack's spare capacity) are 0 (lse -inf). Differentiable in q,
  k and v (reverse mode), with deterministic gradients that do not depend on
  what else shares the batch.
  """
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  layout, cu_seqlens = layout_of(q.ndim, cu_seqlens, info, mask, kv_lens,
                                 kv_start, attn_mask, block_tables)
  check_operands(q.shape, k.shape, v.shape,
                 tuple(str(x.dtype) for x in (q, k, v)), layout,
                 causal=causal, sliding_window=sliding_window, softcap=softcap)
  hq, d = q.shape[-2:]
  hkv = k.shape[-2]
  group = hq // hkv
  bad_rows = None
  if layout == "packed":
    t = q.shape[0]
    seqs = _packed_seqs(t, jnp.array([0, t]) if cu_seqlens is None
                        else cu_seqlens)
  elif layout == "padded":
    b, s = q.shape[:2]
    seqs, contiguous = _padded_seqs(b, s, mask)
    if contiguous is not None:
      bad_rows = jnp.repeat(~contiguous, s)
  elif layout == "masked":
    b, n = q.shape[:2]
    s_k = k.shape[1]
    attn_mask = jnp.asarray(attn_mask)
    if attn_mask.dtype != jnp.bool_ or attn_mask.ndim > 3 or not all(
        m in (1, w) for m, w in zip(attn_mask.shape[::-1], (s_k, n, b))):
      raise ValueError(f"det_attention: attn_mask must be bool [B, n, S] = "
                       f"[{b}, {n}, {s_k}] (or broadcast to it), got "
                       f"{attn_mask.dtype} {attn_mask.shape}")
    if int(segments_per_row) < 1:
      raise ValueError(f"det_attention: segments_per_row must be >= 1, got "
                       f"{segments_per_row}")
    seqs, fits = _masked_seqs(jnp.broadcast_to(attn_mask, (b, n, s_k)),
                              int(segments_per_row))
    bad_rows = jnp.repeat(~fits, n)
  elif layout == "paged cache":
    b, n = q.shape[:2]
    page = k.shape[1]
    seqs, fits = _paged_seqs(b, n, k.shape[0], page, kv_lens, block_tables)
    bad_rows = jnp.repeat(~fits, n)
  else:
    b, n = q.shape[:2]
    seqs = _cache_seqs(b, n, k.shape[1], kv_lens, kv_start)
  # A KV-cache call splits its keys over programs and may pack a KV head's
  # query heads into one program (decode_plan): neither moves a bit. A
  # paged cache is planned as the contiguous cache of its tables' slots.
  cache_shape = ((b, (seqs.shape[0] - 4) * k.shape[1]) + k.shape[2:]
                 if layout == "paged cache" else k.shape)
  heads_per_tile, split_chunks = decode_plan(layout, q.shape, cache_shape,
                                             group)
  # A padded batch without a mask and one packed sequence leave no row
  # outside a sequence; a KV-cache step none among its queries.
  all_rows_in = ((layout == "padded" and mask is None)
                 or (layout == "packed" and cu_seqlens is None))
  settings = Settings(group, d, float(1.0 / math.sqrt(d) if scale is None
                                      else scale),
                      None if softcap is None else float(softcap),
                      None if sliding_window is None else int(sliding_window),
                      heads_per_tile, split_chunks, all_rows_in,
                      k.shape[1] if layout == "paged cache" else 0)
  impl = TABLE.select(implementation).name
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  out, lse = _attention_jit(impl, settings, flat(q), flat(k), flat(v), seqs)
  if not (all_rows_in or layout in ("kv cache", "paged cache")):
    # Rows no sequence covers: 0 (the kernels leave them unwritten).
    covered = covered_rows(seqs[0], seqs[1], out.shape[0])
    out = jnp.where(covered[:, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(covered[:, None], lse, -jnp.inf)
  if bad_rows is not None:
    out = jnp.where(bad_rows[:, None, None], jnp.nan, out)
    lse = jnp.where(bad_rows[:, None], jnp.nan, lse)
  out = out.reshape(q.shape)
  lse = lse.reshape(q.shape[:-1])
  return (out, lse) if return_lse else out
