"""Batch-invariant causal attention as ``@triton.jit`` kernels: one forward
kernel for prefill, packed varlen, padded batches and KV-cache decode, and a
deterministic backward (dK/dV per key tile, dQ per query tile, no atomics).

Why a query row's bits depend on nothing but its own q and its own
sequence's keys and values up to its position:

* A program owns ``BLOCK_M`` query rows of one sequence (and one KV head)
  and walks that sequence's keys in ``BLOCK_N`` blocks counted from the
  sequence's first key, in order. The blocks are the same whatever buffer,
  batch, pack offset or padding the sequence sits in, and whatever other
  rows share the program.
* Each row's arithmetic is its own: ``q k^T`` and ``p v`` are MMAs (every
  output element reduces over its own row and column only, the same
  instruction shape for every row), the row max is exact, the row sum
  walks the same register layout for every row of the tile, and the
  online-softmax update is elementwise.
* A key the row may not see (past its position, before its window, past
  the sequence) scores ``-inf``; a block the row cannot see at all is an
  exact no-op for it: the running max does not move (``alpha = 1``), ``p``
  is 0, ``l * 1 + 0 = l`` and ``acc * 1 + 0 = acc``. Before the row has
  seen any key, ``m_use = 0`` keeps ``-inf - -inf`` out (``alpha = 0``,
  ``l = acc = 0``), so a walk that starts blocks earlier gives the same
  bits as one that starts at the row's first visible block.
* Every ``FOLD`` keys (a chunk, counted from key 0) the chunk's state
  folds into a running total and the next chunk starts afresh (``_fold``;
  an empty chunk folds as nothing). The prefill folds in registers; a
  decode step runs its chunks in parallel programs and a second kernel
  folds their f32 partials in the same order with the same expression.
* Hence prefill of T tokens, chunked prefill and decode one token at a time
  against a cache give a token the same bits: its row walks the same
  blocks and chunks with the same arithmetic; only which blocks are skipped
  as empty differs. A decode program packs the query heads of one KV head
  into its rows (``HEADS_PER_TILE``) so the cache is read once per KV head:
  rows are independent, so this changes no bit.
* Two things the compiler would otherwise decide differently per kernel
  are pinned: products that meet a sum go through explicit FMAs
  (``fma(x, c, -m)``, the fold, the row-sum update), and the split decode's
  tiles are one warpgroup of 64 rows, the forward's row layout (16-row
  tiles over 4 warps summed a row in another order on the H200).

The configuration (``BLOCK_M``, ``BLOCK_N``, warps) is chosen from the head
dimension alone, never from the problem's size: a new size must not mean
new bits.

Two launchers per kernel share one source: ``*_jax`` (jax-triton) and
``*_torch`` (Triton's own launcher on torch's stream; with
``TRITON_INTERPRET=1`` on CPU tensors in Triton's interpreter, which is
how the CPU tests check the kernels).
"""

from __future__ import annotations

import dataclasses
import functools

from triton_kernels import jax_launch
from triton_kernels.backend import (cdiv, interpreted, Launcher,
                                    next_power_of_2, tile_bound, tl, triton)

__all__ = ["AttentionConfig", "config_for", "forward_jax", "forward_torch",
           "PreparedForward", "backward_jax", "backward_torch", "delta_jax",
           "delta_torch", "dq_jax", "dq_torch", "fill_outside_torch",
           "LOG2E"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  block_m: int      # query rows per forward program (tokens x heads)
  block_n: int      # keys per block: the unit of the online softmax
  num_warps: int
  num_stages: int
  # The backward's tiles: free (the backward's bits are not tied to the
  # forward's, nor to these: each gradient element sums its 16-wide MMA
  # steps into one accumulator in query or key order, whatever the block
  # that holds them), but fixed per head dimension all the same. dK/dV's
  # kernel: bwd_block_n keys a program, bwd_block_m queries a step.
  bwd_block_m: int
  bwd_block_n: int
  bwd_num_warps: int
  # Keys per chunk: each chunk's online softmax starts afresh and chunks
  # fold into the running total in order, so a decode step can run its
  # chunks in parallel programs and fold them after (the same bits).
  fold_keys: int = 512
  # The split decode's tiles (None: the forward's). Free only where the
  # device tests prove a row's bits the same as the forward's tiles give
  # (the same MMA per element, the same row-sum order).
  decode_block_m: int | None = None
  decode_num_warps: int | None = None
  # Software-pipelined stages of the dK/dV kernel's query loop, and dQ's
  # kernel: (query rows a program, keys a step, warps, stages); None: the
  # dK/dV tiles, one stage.
  bwd_num_stages: int = 1
  dq: tuple[int, int, int, int] | None = None

  def dq_tiles(self) -> tuple[int, int, int, int]:
    return self.dq or (self.bwd_block_m, self.bwd_block_n, self.bwd_num_warps,
                       1)

  def tile_rows(self, split: bool) -> int:
    """Query rows (tokens x heads) per forward program."""
    return (self.decode_block_m or self.block_m) if split else self.block_m

  def warps(self, split: bool) -> int:
    return (self.decode_num_warps or self.num_warps) if split else self.num_warps


# Per head dimension. The forward's block_n is part of the contract (it
# fixes the online softmax's blocks): changing it changes every bit.
_CONFIGS = {
    # The split decode's tiles: 64 rows, one warpgroup (the forward's
    # 128-row tiles are two of them, each with this row layout). Smaller
    # tiles ran faster but summed a row's probabilities in another order
    # (16 rows over 4 warps: the f32 lse an ulp off on the H200, the bf16
    # output mostly hiding it): the device tests compare lse too.
    64: AttentionConfig(128, 64, 4, 3, 64, 64, 4, decode_block_m=64,
                        decode_num_warps=4),
    # The backward's: the fastest of a sweep on the H100 (B 8-16, S
    # 2048-4096, 32/8 heads; 2026-11-27): dK/dV 1.09x, dQ 1.33x the
    # unpipelined 64 x 64 tiles.
    128: AttentionConfig(128, 64, 8, 3, 64, 64, 4, decode_block_m=64,
                         decode_num_warps=4, bwd_num_stages=2,
                         dq=(128, 64, 8, 3)),
    256: AttentionConfig(64, 32, 4, 2, 32, 32, 4),
}

HEAD_DIMS = tuple(sorted(_CONFIGS))


def config_for(head_dim: int) -> AttentionConfig:
  return _CONFIGS[head_dim]


def interpreter_config(head_dim: int) -> AttentionConfig:
  """Smaller tiles for Triton's interpreter (the CPU tests): the same code
  paths, a tenth of the time."""
  return AttentionConfig(32, 16, 4, 1, 16, 16, 4, fold_keys=32,
                         dq=(32, 16, 4, 1))


if triton is not None:
  from triton_kernels.det_matmul import mma_step

  # A @triton.jit function reads a module global only as a constexpr.
  _LOG2E = tl.constexpr(LOG2E)
  _LN2 = tl.constexpr(LN2)

  @triton.jit
  def _tile(tiles_ptr, seqs_ptr, n_seqs):
    """This program's tile: its sequence (-1: no work), its first row in
    the sequence, and the sequence's q_start, q_len, k_start, k_len."""
    tile = tl.program_id(0)
    seq = tl.load(tiles_ptr + tile)
    s = tl.maximum(seq, 0)
    return (seq, tl.load(tiles_ptr + tl.num_programs(0) + tile),
            tl.load(seqs_ptr + s), tl.load(seqs_ptr + n_seqs + s),
            tl.load(seqs_ptr + 2 * n_seqs + s),
            tl.load(seqs_ptr + 3 * n_seqs + s))

  @triton.jit
  def _scores(a, b, scale2, softcap2, BLOCK_A: tl.constexpr,
              BLOCK_B: tl.constexpr, SOFTCAP: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """(x, c, t): the log2-scaled logits are ``x * c``, and t is tanh of
    the capped logits (for the backward). Without a cap x is ``a @ b`` and
    c the scale times log2 e; with one, x is ``cap log2 e * tanh(s * scale /
    cap)`` (tanh through exp2) and c is 1. Callers scale x only inside an
    explicit FMA (``fma(x, c, -m)``): left to the compiler, ``x * c - m``
    fuses in one kernel and rounds twice in another (where a mask sits
    between the two), and a row's bits then depend on whether its block
    was masked."""
    s = mma_step(a, b, tl.zeros((BLOCK_A, BLOCK_B), tl.float32), INTERPRETED)
    if SOFTCAP:
      t = 1.0 - 2.0 / (tl.exp2(s * scale2) + 1.0)
      return t * softcap2, 1.0, t
    else:
      return s, scale2, s

  @triton.jit
  def _visible(pos, j, row_ok, window, WINDOWED: tl.constexpr):
    """Which keys (logical positions `j`, a row vector) each query
    (logical positions `pos`, a column) may see."""
    ok = (j[None, :] <= pos[:, None]) & row_ok[:, None]
    if WINDOWED:
      ok = ok & (j[None, :] > pos[:, None] - window)
    return ok

  @triton.jit
  def _table_entries(pages, logical, page_stride, ok, n_blocks):
    """Physical blocks of a sequence's logical blocks (its table row
    `pages`, one entry every `page_stride`). An entry outside the cache
    (input no host check saw: its rows come back NaN) still reads inside
    it."""
    block = tl.load(pages + logical * page_stride, mask=ok, other=0)
    return tl.minimum(tl.maximum(block, 0), n_blocks - 1)

  @triton.jit
  def _chunk_table(pages, c0, k_len, page_stride, n_blocks,
                   PAGE: tl.constexpr, TABLE: tl.constexpr):
    """(the table entries of the chunk starting at key c0, the first one's
    logical block): TABLE entries cover every key of the chunk."""
    first = c0 // PAGE
    logical = first + tl.arange(0, TABLE)
    return (_table_entries(pages, logical, page_stride,
                           logical * PAGE < k_len, n_blocks), first)

  @triton.jit
  def _fwd_block(q, m_i, l_i, acc, k_base, v_base, start, k_start, k_len,
                 pos, row_ok, d, stride_kt, stride_vt, scale2, softcap2,
                 window, pages, page_stride, n_blocks, table, first,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
                 MASKED: tl.constexpr, PAGE: tl.constexpr,
                 TABLE: tl.constexpr, INTERPRETED: tl.constexpr):
    """One key block of the online softmax for every row of the tile."""
    j = start + tl.arange(0, BLOCK_N)
    if PAGE == 0:
      kv_rows = (k_start + j).to(tl.int64)
    else:
      # A paged cache: the sequence's key j lies in its logical block
      # j // PAGE, which its table row maps to a physical block. Only
      # addresses change: the block walk and the arithmetic are a
      # contiguous cache's.
      if TABLE > 0:
        # The chunk's entries, loaded once (`_chunk_table`): no load waits
        # on another inside the key loop.
        at = tl.minimum(tl.maximum(j // PAGE - first, 0), TABLE - 1)
        block = tl.gather(table, at, 0)
      else:
        block = _table_entries(pages, j // PAGE, page_stride, j < k_len,
                               n_blocks)
      kv_rows = block.to(tl.int64) * PAGE + j % PAGE
    if MASKED:
      in_seq = j < k_len
      kt = tl.load(k_base + kv_rows[None, :] * stride_kt + d[:, None],
                   mask=in_seq[None, :], other=0.0)
    else:
      kt = tl.load(k_base + kv_rows[None, :] * stride_kt + d[:, None])
    x, c, _ = _scores(q, kt, scale2, softcap2, BLOCK_M, BLOCK_N, SOFTCAP,
                      INTERPRETED)
    if MASKED:
      x = tl.where(_visible(pos, j, row_ok, window, WINDOWED), x,
                   float("-inf"))
      # c > 0, and rounding is monotone: max(x) * c is the max of x * c.
      m_new = tl.maximum(m_i, tl.max(x, 1) * c)
      m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
      v = tl.load(v_base + kv_rows[:, None] * stride_vt + d[None, :],
                  mask=in_seq[:, None], other=0.0)
    else:
      m_new = tl.maximum(m_i, tl.max(x, 1) * c)
      m_use = m_new
      v = tl.load(v_base + kv_rows[:, None] * stride_vt + d[None, :])
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(tl.fma(x, c, -m_use[:, None]))
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))  # one rounding, in every kernel
    acc = mma_step(p.to(v.dtype), v, acc * alpha[:, None], INTERPRETED)
    return m_new, l_i, acc

  @triton.jit
  def _fwd_chunk(q, k_base, v_base, c_lo, c_hi, full, k_start, k_len, pos,
                 row_ok, d, stride_kt, stride_vt, scale2, softcap2, window,
                 pages, page_stride, n_blocks, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
                 PAGE: tl.constexpr, TABLE: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """(m, l, acc) of keys [c_lo, c_hi) for every row, from a fresh state.
    Blocks below `full` are visible to every row: no masks there (a mask
    that keeps every score changes none, and every row's running max is
    finite there)."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if TABLE > 0:
      table, first = _chunk_table(pages, c_lo, k_len, page_stride, n_blocks,
                                  PAGE, TABLE)
    else:
      table, first = 0, 0
    split = tl.minimum(tl.maximum(full, c_lo), c_hi)
    for start in range(c_lo, split, BLOCK_N):
      m_i, l_i, acc = _fwd_block(
          q, m_i, l_i, acc, k_base, v_base, start, k_start, k_len, pos,
          row_ok, d, stride_kt, stride_vt, scale2, softcap2, window, pages,
          page_stride, n_blocks, table, first, BLOCK_M, BLOCK_N, SOFTCAP,
          WINDOWED, False, PAGE, TABLE, INTERPRETED)
    for start in range(split, c_hi, BLOCK_N):
      m_i, l_i, acc = _fwd_block(
          q, m_i, l_i, acc, k_base, v_base, start, k_start, k_len, pos,
          row_ok, d, stride_kt, stride_vt, scale2, softcap2, window, pages,
          page_stride, n_blocks, table, first, BLOCK_M, BLOCK_N, SOFTCAP,
          WINDOWED, True, PAGE, TABLE, INTERPRETED)
    return m_i, l_i, acc

  @triton.jit
  def _fold(m_run, l_run, acc_run, m, l, acc):
    """The running total after one more chunk, in chunk order. A chunk no
    row's key reaches (m = -inf, l = 0, acc = 0) leaves it exactly as it
    was (scale 1 and 0), and the first real chunk replaces the empty start
    exactly (scale 0 and 1). The prefill folds in registers, a split decode
    in a second kernel from f32 partials: the same expression, the same
    bits."""
    m_new = tl.maximum(m_run, m)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_run - m_use)
    b = tl.exp2(m - m_use)
    # Explicit FMAs: left to the compiler, `x * a + y * b` may fuse either
    # product into the add, and the register fold and the f32 one from
    # memory fused them differently (the lse of 2 of 12 rows an ulp apart
    # on the H200).
    return (m_new, tl.fma(l_run, a, l * b),
            tl.fma(acc_run, a[:, None], acc * b[:, None]))

  @triton.jit
  def _finish(m, l):
    """(1 / the normaliser's guard, lse in natural log) per row; rows that
    saw no key get lse -inf and a 0 output, a NaN normaliser (a poisoned
    partial, `_paged_chunk_ok`) a NaN lse."""
    seen = l > 0.0
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, l, 1.0))) * _LN2,
                   tl.where(l == l, float("-inf"), l))
    return tl.where(seen, l, 1.0), lse

  @triton.jit
  def _paged_chunk_ok(pages, q_len, k_len, c0, n_table, page_stride,
                      n_blocks, FOLD: tl.constexpr, PAGE: tl.constexpr):
    """Whether a sequence's length fits its table and the entries its keys
    in [c0, c0 + FOLD) use name blocks inside the cache: input no host
    check saw (traced, or CUDA tensors in torch). Every used entry lies in
    one chunk, so the chunks' programs check them all between them, and
    a failed check makes the chunk's partial NaN, which the fold carries
    into every row of the sequence (no extra kernel, no host sync)."""
    ok = (k_len >= q_len) & (k_len <= n_table * PAGE)
    e_lo = c0 // PAGE
    e_hi = tl.minimum(tl.cdiv(tl.minimum(c0 + FOLD, k_len), PAGE), n_table)
    for e0 in range(e_lo, e_hi, 64):
      e = e0 + tl.arange(0, 64)
      block = tl.load(pages + e * page_stride, mask=e < e_hi, other=0)
      outside = ((block < 0) | (block >= n_blocks)).to(tl.int32)
      ok = ok & (tl.max(outside, 0) == 0)
    return ok

  @triton.jit
  def _fwd_rows(q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kh,
                stride_vh, i0, q_start, q_len, k_len, window,
                GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """A forward tile's rows: their q, heads, positions, and the keys they
    need: [lo, hi) and the fully visible [0, full)."""
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    r = tl.arange(0, BLOCK_M)
    i = i0 + r // HEADS_PER_TILE          # query index in the sequence
    head = tl.program_id(1) * HEADS_PER_TILE + r % HEADS_PER_TILE
    kv_head = (tl.program_id(1) * HEADS_PER_TILE) // GROUP
    row_ok = i < q_len
    pos = k_len - q_len + i                # logical position (causal)
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt
                + head[:, None].to(tl.int64) * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    # Keys from the first block any row can see to the last one's
    # position; blocks counted from the sequence's key 0.
    hi = k_len - q_len + tl.minimum(i0 + TOKENS, q_len)
    first = k_len - q_len + i0             # the tile's first position
    if WINDOWED:
      lo = tl.maximum(first - window + 1, 0)
      lo = (lo // BLOCK_N) * BLOCK_N
      full = lo                            # no block is seen by every row
    else:
      lo = first * 0
      full = ((first + 1) // BLOCK_N) * BLOCK_N
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    return q, head, row_ok, pos, d, q_rows, lo, hi, full, k_base, v_base

  @triton.jit
  def _fwd_kernel(q_ptr, k_ptr, v_ptr, seqs_ptr, tiles_ptr, o_ptr, lse_ptr,
                  n_seqs, stride_qt, stride_qh, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
                  scale2: tl.constexpr, softcap2: tl.constexpr,
                  window: tl.constexpr, GROUP: tl.constexpr,
                  HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  FOLD: tl.constexpr, SOFTCAP: tl.constexpr,
                  WINDOWED: tl.constexpr, INTERPRETED: tl.constexpr):
    # seqs: int32 [4, n_seqs] = q_start, q_len, k_start, k_len;
    # tiles: int32 [2, n_tiles] = sequence (-1: no work), first query.
    seq, i0, q_start, q_len, k_start, k_len = _tile(tiles_ptr, seqs_ptr,
                                                        n_seqs)
    if seq >= 0:
      q, head, row_ok, pos, d, q_rows, lo, hi, full, k_base, v_base = (
          _fwd_rows(q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kh,
                    stride_vh, i0, q_start, q_len, k_len, window, GROUP,
                    HEADS_PER_TILE, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOWED))
      m_run = tl.full((BLOCK_M,), float("-inf"), tl.float32)
      l_run = tl.zeros((BLOCK_M,), tl.float32)
      acc_run = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
      for c0 in range((lo // FOLD) * FOLD, hi, FOLD):
        m, l, acc = _fwd_chunk(
            q, k_base, v_base, tl.maximum(c0, lo), tl.minimum(c0 + FOLD, hi),
            full, k_start, k_len, pos, row_ok, d, stride_kt, stride_vt,
            scale2, softcap2, window, seqs_ptr, n_seqs, 1, BLOCK_M, BLOCK_N,
            HEAD_DIM, SOFTCAP, WINDOWED, 0, 0, INTERPRETED)
        m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m, l, acc)
      norm, lse = _finish(m_run, l_run)
      out = acc_run / norm[:, None]
      tl.store(o_ptr + q_rows[:, None] * stride_ot
               + head[:, None].to(tl.int64) * stride_oh + d[None, :],
               out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
      tl.store(lse_ptr + q_rows * stride_lt + head, lse, mask=row_ok)

  @triton.jit
  def _fwd_split_kernel(q_ptr, k_ptr, v_ptr, seqs_ptr, tiles_ptr, part_ptr,
                        ml_ptr, n_seqs, n_rows, n_blocks, n_table,
                        stride_qt, stride_qh,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        scale2: tl.constexpr, softcap2: tl.constexpr,
                        window: tl.constexpr, GROUP: tl.constexpr,
                        HEADS_PER_TILE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, FOLD: tl.constexpr,
                        SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
                        PAGE: tl.constexpr, TABLE: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    # One chunk (program axis 2) of one tile: its (m, l, acc) partials,
    # f32, [chunk, row, head] (a chunk outside the tile's keys: the empty
    # partial, which folds as nothing). PAGE > 0: k and v are a paged
    # cache's rows and seqs carries each sequence's block table after its
    # four rows ([4 + n_table, n_seqs]), naming blocks of n_blocks.
    seq, i0, q_start, q_len, k_start, k_len = _tile(tiles_ptr, seqs_ptr,
                                                        n_seqs)
    if seq >= 0:
      q, head, row_ok, pos, d, q_rows, lo, hi, full, k_base, v_base = (
          _fwd_rows(q_ptr, k_ptr, v_ptr, stride_qt, stride_qh, stride_kh,
                    stride_vh, i0, q_start, q_len, k_len, window, GROUP,
                    HEADS_PER_TILE, HEAD_DIM, BLOCK_M, BLOCK_N, WINDOWED))
      c0 = tl.program_id(2) * FOLD
      c_lo = tl.maximum(c0, lo)
      c_hi = tl.minimum(c0 + FOLD, hi)
      c_hi = tl.maximum(c_hi, c_lo)        # empty past the tile's keys
      pages = seqs_ptr + 4 * n_seqs + seq
      # Keys past the table (a length no host check saw: those rows come
      # back NaN) are read as outside the sequence, not past the table.
      k_keys = tl.minimum(k_len, n_table * PAGE) if PAGE > 0 else k_len
      m, l, acc = _fwd_chunk(
          q, k_base, v_base, c_lo, c_hi, full, k_start, k_keys, pos, row_ok,
          d, stride_kt, stride_vt, scale2, softcap2, window, pages, n_seqs,
          n_blocks, BLOCK_M, BLOCK_N, HEAD_DIM, SOFTCAP, WINDOWED, PAGE,
          TABLE, INTERPRETED)
      if PAGE > 0:
        ok = _paged_chunk_ok(pages, q_len, k_len, c0, n_table, n_seqs,
                             n_blocks, FOLD, PAGE)
        l = tl.where(ok, l, float("nan"))
        acc = tl.where(ok, acc, float("nan"))
      n_heads = tl.num_programs(1) * HEADS_PER_TILE
      slot = (tl.program_id(2).to(tl.int64) * n_rows + q_rows) * n_heads + head
      tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc,
               mask=row_ok[:, None])
      tl.store(ml_ptr + 2 * slot, m, mask=row_ok)
      tl.store(ml_ptr + 2 * slot + 1, l, mask=row_ok)

  @triton.jit
  def _fwd_combine_kernel(part_ptr, ml_ptr, o_ptr, lse_ptr, n_slots,
                          n_chunks, HEAD_DIM: tl.constexpr,
                          BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    # Folds each (row, head)'s chunk partials in chunk order: _fold, as the
    # prefill folds them. o and lse are [rows, heads] contiguous. Program
    # axis 1 takes a slice of the head dim (elementwise: no bit moves), so
    # a decode step's few rows still spread over the GPU.
    slot = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = slot < n_slots
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_run = tl.full((BLOCK,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK,), tl.float32)
    acc_run = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    for c in tl.range(0, n_chunks, num_stages=3):
      at = c * n_slots + slot
      m = tl.load(ml_ptr + 2 * at, mask=ok, other=float("-inf"))
      l = tl.load(ml_ptr + 2 * at + 1, mask=ok, other=0.0)
      acc = tl.load(part_ptr + at[:, None] * HEAD_DIM + d[None, :],
                    mask=ok[:, None], other=0.0)
      m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m, l, acc)
    norm, lse = _finish(m_run, l_run)
    out = acc_run / norm[:, None]
    tl.store(o_ptr + slot[:, None] * HEAD_DIM + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=ok[:, None])
    if tl.program_id(1) == 0:
      tl.store(lse_ptr + slot, lse, mask=ok)


  @triton.jit
  def _bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, n_rows, stride_ot,
                        stride_oh, stride_dt, stride_dh, n_heads,
                        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # delta[t, h] = sum_d o * do, f32, one row at a time in one layout.
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    t = (r // n_heads).to(tl.int64)
    h = (r % n_heads).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(o_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh
                + d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(do_ptr + t[:, None] * stride_dt + h[:, None] * stride_dh
                 + d[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + r, delta, mask=ok)

  @triton.jit
  def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
                       seqs_ptr, tiles_ptr, dk_ptr, dv_ptr, n_seqs,
                       stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh, stride_dot, stride_doh,
                       stride_lt, stride_dkt, stride_dkh, stride_dvt,
                       stride_dvh, scale: tl.constexpr,
                       scale2: tl.constexpr, softcap2: tl.constexpr,
                       window: tl.constexpr, GROUP: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                       WINDOWED: tl.constexpr, INTERPRETED: tl.constexpr):
    # One program: BLOCK_N keys of one sequence and one KV head. Its
    # query heads, then its queries in BLOCK_M blocks from the sequence's
    # first query, in order: no atomics, and a key's gradient sums over its
    # own sequence's queries in blocks that nothing else moves.
    seq, j0, q_start, q_len, k_start, k_len = _tile(tiles_ptr, seqs_ptr,
                                                        n_seqs)
    if seq >= 0:
      kv_head = tl.program_id(1)
      j = j0 + tl.arange(0, BLOCK_N)
      in_seq = j < k_len
      kv_rows = (k_start + j).to(tl.int64)
      d = tl.arange(0, HEAD_DIM)
      k = tl.load(k_ptr + kv_rows[:, None] * stride_kt
                  + kv_head.to(tl.int64) * stride_kh + d[None, :],
                  mask=in_seq[:, None], other=0.0)
      v = tl.load(v_ptr + kv_rows[:, None] * stride_vt
                  + kv_head.to(tl.int64) * stride_vh + d[None, :],
                  mask=in_seq[:, None], other=0.0)
      dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
      dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
      offset = k_len - q_len                 # position of query 0
      i_lo = tl.maximum(j0 - offset, 0)
      i_lo = (i_lo // BLOCK_M) * BLOCK_M
      i_hi = q_len
      if WINDOWED:
        i_hi = tl.minimum(q_len, j0 + BLOCK_N - 1 + window - offset)
      for g in range(GROUP):
        head = (kv_head * GROUP + g).to(tl.int64)
        for i0 in range(i_lo, i_hi, BLOCK_M):
          i = i0 + tl.arange(0, BLOCK_M)
          row_ok = i < q_len
          q_rows = (q_start + i).to(tl.int64)
          qt = tl.load(q_ptr + q_rows[None, :] * stride_qt + head * stride_qh
                       + d[:, None], mask=row_ok[None, :], other=0.0)
          do = tl.load(do_ptr + q_rows[:, None] * stride_dot
                       + head * stride_doh + d[None, :],
                       mask=row_ok[:, None], other=0.0)
          lse2 = tl.load(lse_ptr + q_rows * stride_lt + head, mask=row_ok,
                         other=0.0) * _LOG2E
          delta = tl.load(delta_ptr + q_rows * stride_lt + head, mask=row_ok,
                          other=0.0)
          xt, ct, tt = _scores(k, qt, scale2, softcap2, BLOCK_N, BLOCK_M,
                               SOFTCAP, INTERPRETED)
          # [keys, queries]: the forward's visibility, transposed.
          ok = (j[:, None] <= (offset + i)[None, :]) & row_ok[None, :]
          if WINDOWED:
            ok = ok & (j[:, None] > (offset + i)[None, :] - window)
          pt = tl.where(ok, tl.exp2(tl.fma(xt, ct, -lse2[None, :])), 0.0)
          dv = mma_step(pt.to(do.dtype), do, dv, INTERPRETED)
          dpt = mma_step(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M),
                                                   tl.float32), INTERPRETED)
          dst = pt * (dpt - delta[None, :])
          if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
          dk = mma_step(dst.to(do.dtype), tl.trans(qt), dk, INTERPRETED)
      tl.store(dk_ptr + kv_rows[:, None] * stride_dkt
               + kv_head.to(tl.int64) * stride_dkh + d[None, :],
               (dk * scale).to(dk_ptr.dtype.element_ty), mask=in_seq[:, None])
      tl.store(dv_ptr + kv_rows[:, None] * stride_dvt
               + kv_head.to(tl.int64) * stride_dvh + d[None, :],
               dv.to(dv_ptr.dtype.element_ty), mask=in_seq[:, None])

  @triton.jit
  def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
                     seqs_ptr, tiles_ptr, dq_ptr, n_seqs,
                     stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_dot, stride_doh, stride_lt,
                     stride_dqt, stride_dqh, scale: tl.constexpr,
                     scale2: tl.constexpr, softcap2: tl.constexpr,
                     window: tl.constexpr, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                     WINDOWED: tl.constexpr, INTERPRETED: tl.constexpr):
    # One program: BLOCK_M queries of one sequence and one head, walking
    # the sequence's keys in blocks from key 0 in order.
    seq, i0, q_start, q_len, k_start, k_len = _tile(tiles_ptr, seqs_ptr,
                                                        n_seqs)
    if seq >= 0:
      head = tl.program_id(1).to(tl.int64)
      kv_head = head // GROUP
      i = i0 + tl.arange(0, BLOCK_M)
      row_ok = i < q_len
      pos = k_len - q_len + i
      q_rows = (q_start + i).to(tl.int64)
      d = tl.arange(0, HEAD_DIM)
      q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh
                  + d[None, :], mask=row_ok[:, None], other=0.0)
      do = tl.load(do_ptr + q_rows[:, None] * stride_dot + head * stride_doh
                   + d[None, :], mask=row_ok[:, None], other=0.0)
      lse2 = tl.load(lse_ptr + q_rows * stride_lt + head, mask=row_ok,
                     other=0.0) * _LOG2E
      delta = tl.load(delta_ptr + q_rows * stride_lt + head, mask=row_ok,
                      other=0.0)
      hi = k_len - q_len + tl.minimum(i0 + BLOCK_M, q_len)
      lo = 0
      if WINDOWED:
        lo = tl.maximum(k_len - q_len + i0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
      dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
      for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        in_seq = j < k_len
        kv_rows = (k_start + j).to(tl.int64)
        kt = tl.load(k_ptr + kv_rows[None, :] * stride_kt
                     + kv_head * stride_kh + d[:, None],
                     mask=in_seq[None, :], other=0.0)
        vt = tl.load(v_ptr + kv_rows[None, :] * stride_vt
                     + kv_head * stride_vh + d[:, None],
                     mask=in_seq[None, :], other=0.0)
        x, c, t = _scores(q, kt, scale2, softcap2, BLOCK_M, BLOCK_N, SOFTCAP,
                          INTERPRETED)
        ok = _visible(pos, j, row_ok, window, WINDOWED)
        p = tl.where(ok, tl.exp2(tl.fma(x, c, -lse2[:, None])), 0.0)
        dp = mma_step(do, vt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32),
                      INTERPRETED)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
          ds = ds * (1.0 - t * t)
        dq = mma_step(ds.to(q.dtype), tl.trans(kt), dq, INTERPRETED)
      tl.store(dq_ptr + q_rows[:, None] * stride_dqt + head * stride_dqh
               + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
               mask=row_ok[:, None])


  @triton.jit
  def _tile_map_kernel(len_ptr, out_ptr, n_seqs, n_tiles,
                       ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    # The tile map (see tile_map_torch) for BLOCK_T tiles: tile t belongs to
    # the sequence whose tiles end first after t (the count of sequences
    # whose tiles end at or before t, as a right-sided search counts them)
    # and starts (t - that sequence's first tile) * ROWS rows into it.
    s = tl.arange(0, BLOCK_S)
    real = s < n_seqs
    lengths = tl.load(len_ptr + s, mask=real, other=0)
    per_seq = (lengths + ROWS - 1) // ROWS
    ends = tl.cumsum(per_seq, 0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    before = (ends[None, :] <= t[:, None]) & real[None, :]
    seq = tl.sum(before.to(tl.int32), 1)
    first_tile = tl.sum(tl.where(s[None, :] == seq[:, None],
                                 (ends - per_seq)[None, :], 0), 1)
    valid = seq < n_seqs
    ok = t < n_tiles
    tl.store(out_ptr + t, tl.where(valid, seq, -1), mask=ok)
    tl.store(out_ptr + n_tiles + t, tl.where(valid, (t - first_tile) * ROWS, 0),
             mask=ok)

  @triton.jit
  def _fill_outside_kernel(x_ptr, start_ptr, len_ptr, n_seqs, n_rows,
                           period, tokens, stride_r, stride_h, width, value,
                           HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # Rows of x in no sequence get `value`; a program tests BLOCK_R rows
    # against every sequence and writes only the rows outside all of them
    # (row r's element c is at r stride_r + (c / D) stride_h + c % D).
    # Only rows r with r % period < tokens are x's: in a [B, S, H, D] view
    # of a [B, H, S', D] cache the others alias other tokens' heads.
    s = tl.arange(0, BLOCK_S)
    real = s < n_seqs
    starts = tl.load(start_ptr + s, mask=real, other=0)
    ends = starts + tl.load(len_ptr + s, mask=real, other=0)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = (r[:, None] >= starts[None, :]) & (r[:, None] < ends[None, :])
    fill = ((r < n_rows) & (r % period < tokens)
            & (tl.max(inside.to(tl.int32), 1) == 0))
    if tl.max(fill.to(tl.int32), 0) > 0:
      for c0 in range(0, width, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        offsets = (r.to(tl.int64)[:, None] * stride_r
                   + (c // HEAD_DIM).to(tl.int64)[None, :] * stride_h
                   + (c % HEAD_DIM)[None, :])
        values = tl.zeros((BLOCK_R, BLOCK_C), tl.float32) + value
        tl.store(x_ptr + offsets, values.to(x_ptr.dtype.element_ty),
                 mask=fill[:, None] & (c < width)[None, :])


if triton is not None:
  _launch_fwd = Launcher(_fwd_kernel)
  _launch_split = Launcher(_fwd_split_kernel)
  _launch_combine = Launcher(_fwd_combine_kernel)
  # The backward's and the bookkeeping's launches from torch: a training
  # step's attention calls are a handful of launches each, and Triton's own
  # launch binds every argument again (tens of µs of host time each).
  _launch_delta = Launcher(_bwd_delta_kernel)
  _launch_dq = Launcher(_bwd_dq_kernel)
  _launch_dkdv = Launcher(_bwd_dkdv_kernel)
  _launch_tile_map = Launcher(_tile_map_kernel)
  _launch_fill_outside = Launcher(_fill_outside_kernel)


@dataclasses.dataclass(frozen=True)
class Statics:
  """What a launch compiles in: the model's attention settings."""
  group: int            # query heads per KV head
  head_dim: int
  scale: float
  softcap: float | None
  window: int | None

  def constants(self) -> dict:
    softcap = self.softcap or 0.0
    # Capped: s * scale / cap goes through exp2 as tanh's argument, doubled.
    scale2 = (2.0 * self.scale / softcap * LOG2E if self.softcap
              else self.scale * LOG2E)
    return dict(scale2=scale2, softcap2=softcap * LOG2E,
                window=self.window or 0, GROUP=self.group,
                HEAD_DIM=self.head_dim, SOFTCAP=bool(self.softcap),
                WINDOWED=self.window is not None)


def _strides(*arrays):
  """(token stride, head stride) of each [T, H, D] array (D contiguous)."""
  out = []
  for a in arrays:
    t, h, d = a.shape
    out += [h * d, d]
  return out


_COMBINE_BLOCK = 16
_COMBINE_BLOCK_D = 32


def _fwd_meta(statics, config, heads_per_tile, interpreted_, split,
              page=0):
  meta = dict(statics.constants(), HEADS_PER_TILE=heads_per_tile,
              BLOCK_M=config.tile_rows(split), BLOCK_N=config.block_n,
              FOLD=config.fold_keys, INTERPRETED=interpreted_)
  if split:  # (only the split kernel reads a paged cache)
    meta["PAGE"] = page
    meta["TABLE"] = _chunk_table_entries(config.fold_keys, page)
  elif page:
    raise ValueError("a paged KV cache is read by the split (decode) "
                     "kernels only")
  return meta


# A chunk's table entries held in registers at most (pages of 8 keys and
# more at 512-key chunks); smaller pages look each key's entry up in turn.
_MAX_CHUNK_TABLE = 64


def _chunk_table_entries(fold: int, page: int) -> int:
  """Entries (a power of two, for tl.arange) that cover a chunk's keys, or
  0: the kernel looks entries up key by key. A chunk starts at a multiple
  of `fold`; where pages divide it, it spans fold // page whole pages,
  otherwise one more, cut at both ends."""
  if not page:
    return 0
  span = fold // page if fold % page == 0 else -(-fold // page) + 1
  n = 1 << max(span - 1, 1).bit_length()
  return n if n <= _MAX_CHUNK_TABLE else 0


@functools.lru_cache(maxsize=256)
def _fwd_launch(statics, config, heads_per_tile, interpreted_, split,
                page=0):
  """(constexprs, the Launcher's key) of a torch forward launch: a decode
  step asks once per layer with the same settings."""
  meta = _fwd_meta(statics, config, heads_per_tile, interpreted_, split,
                   page)
  return meta, (tuple(meta.values()), config.warps(split), config.num_stages)


def _paged_blocks(k, page: int) -> int:
  """The blocks a paged cache's rows hold (1 for a contiguous cache: the
  split kernel's bound on a table entry, unused there)."""
  if not page:
    return 1
  rows = k.shape[0] if len(k.shape) == 3 else k.shape[0] * k.shape[1]
  return max(rows // page, 1)


def forward_jax(q, k, v, seqs, tiles, statics: Statics,
                config: AttentionConfig, heads_per_tile: int,
                split_chunks: int = 0, page: int = 0):
  """(out [Tq, Hq, D] in q's dtype, lse [Tq, Hq] f32). Rows no tile covers
  are not written (the caller masks them). `split_chunks` > 0: each tile's
  key chunks run in parallel programs (at most that many chunks a
  sequence) and a second kernel folds them: the same bits, for decode.
  `page` > 0 (split only): k and v are the rows of a paged cache of
  `page`-token blocks, and seqs is ``[4 + blocks, n_seqs]`` with each
  sequence's block table after its four rows."""
  import jax
  tq, hq, d = q.shape
  grid = (tiles.shape[1], hq // heads_per_tile)
  meta = _fwd_meta(statics, config, heads_per_tile, False, bool(split_chunks),
                   page)
  if not split_chunks:
    strides = dict(zip(("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                        "stride_vt", "stride_vh", "stride_ot", "stride_oh"),
                       _strides(q, k, v, q)))
    return jax_launch.triton_call(
        q, k, v, seqs, tiles, kernel=_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((tq, hq), "float32")),
        grid=grid, num_warps=config.num_warps, num_stages=config.num_stages,
        name="rlk_det_attention_fwd", n_seqs=seqs.shape[1], stride_lt=hq,
        **strides, **meta)
  strides = dict(zip(("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                      "stride_vt", "stride_vh"), _strides(q, k, v)))
  part, ml = jax_launch.triton_call(
      q, k, v, seqs, tiles, kernel=_fwd_split_kernel,
      out_shape=(jax.ShapeDtypeStruct((split_chunks, tq, hq, d), "float32"),
                 jax.ShapeDtypeStruct((split_chunks, tq, hq, 2), "float32")),
      grid=grid + (split_chunks,), num_warps=config.warps(True),
      num_stages=config.num_stages, name="rlk_det_attention_fwd_split",
      n_seqs=seqs.shape[1], n_rows=tq, n_blocks=_paged_blocks(k, page),
      n_table=seqs.shape[0] - 4, **strides, **meta)
  return jax_launch.triton_call(
      part, ml, kernel=_fwd_combine_kernel,
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((tq, hq), "float32")),
      grid=(cdiv(tq * hq, _COMBINE_BLOCK), d // _COMBINE_BLOCK_D),
      num_warps=4, name="rlk_det_attention_fwd_combine", n_slots=tq * hq,
      n_chunks=split_chunks, HEAD_DIM=d, BLOCK=_COMBINE_BLOCK,
      BLOCK_D=_COMBINE_BLOCK_D)


def row_strides(*tensors):
  """(token stride, head stride) of each torch tensor the kernels read as
  rows: ``[T, H, D]``, or ``[B, S, H, D]`` read in place, whose row ``b *
  stride(0) / stride(1) + t`` is token t of batch row b (a ``[B, H, S, D]``
  cache transposed: token stride D, head stride S D). D is contiguous."""
  out = []
  for t in tensors:
    out += [t.stride(-3), t.stride(-2)]
  return out


def forward_torch(q, k, v, seqs, tiles, out, lse, statics: Statics,
                  config: AttentionConfig, heads_per_tile: int,
                  split_chunks: int = 0, page: int = 0):
  """Writes out [Tq, Hq, D] and lse [Tq, Hq] (contiguous torch tensors);
  `split_chunks` and `page` as in forward_jax. q is [Tq, Hq, D] with any
  token and head strides; k and v are [Tk, Hkv, D] the same way or [B, S,
  Hkv, D] read in place (`row_strides`; `seqs` counts their rows so)."""
  PreparedForward(q, k, v, seqs, tiles, statics, config, heads_per_tile,
                  split_chunks, page)(q, k, v, out, lse)
  return out, lse


class PreparedForward:
  """forward_torch's launches for calls whose q, k, v, out and lse have
  the shapes and strides of the ones given here and differ only in where
  they lie: every layer of a decode step (a cache per layer, all of one
  shape). The sequence table, tile map, strides, grids, constexprs and
  the split's f32 workspace are settled once; a call passes the five
  tensors (any view starting at the same element: only their addresses
  are read). The workspace is reused in stream order: a call's combine
  reads it before the next call's split, queued after it, writes it."""

  def __init__(self, q, k, v, seqs, tiles, statics: Statics,
               config: AttentionConfig, heads_per_tile: int,
               split_chunks: int = 0, page: int = 0):
    tq, hq, d = q.shape
    grid = (tiles.shape[1], hq // heads_per_tile)
    split = bool(split_chunks)
    meta, key = _fwd_launch(statics, config, heads_per_tile, interpreted(),
                            split, page)
    strides = row_strides(q, k, v)
    self._tables = (seqs, tiles)
    self._split = self._work = None
    if not split:
      self._fwd = _launch_fwd.prepared(
          grid, key, (seqs.shape[1], *strides, hq * d, d, hq),
          num_warps=config.num_warps, num_stages=config.num_stages, **meta)
      return
    # One f32 workspace for the partials: acc [chunks, Tq, Hq, D], then
    # (m, l) [chunks, Tq, Hq, 2].
    self._n_acc = split_chunks * tq * hq * d
    self._n_work = self._n_acc + split_chunks * tq * hq * 2
    self._split = _launch_split.prepared(
        grid + (split_chunks,), key,
        (seqs.shape[1], tq, _paged_blocks(k, page), seqs.shape[0] - 4,
         *strides),
        num_warps=config.warps(True), num_stages=config.num_stages, **meta)
    self._combine = _launch_combine.prepared(
        (cdiv(tq * hq, _COMBINE_BLOCK), d // _COMBINE_BLOCK_D), (d,),
        (tq * hq, split_chunks), HEAD_DIM=d, BLOCK=_COMBINE_BLOCK,
        BLOCK_D=_COMBINE_BLOCK_D, num_warps=4)

  def __call__(self, q, k, v, out, lse):
    seqs, tiles = self._tables
    if self._split is None:
      self._fwd(q, k, v, seqs, tiles, out, lse)
      return
    work, ml = self._workspace(q)
    self._split(q, k, v, seqs, tiles, work, ml)
    self._combine(work, ml, out, lse)

  def _workspace(self, q):
    """(partials, their (m, l)), kept for calls on the stream that made
    them (another stream gets its own: nothing orders it after the last
    user)."""
    import torch
    stream = (torch._C._cuda_getCurrentRawStream(q.device.index)
              if q.is_cuda else None)
    if self._work is None or self._work[0] != stream:
      work = torch.empty(self._n_work, dtype=torch.float32, device=q.device)
      self._work = (stream, work, work[self._n_acc:])
    return self._work[1:]


_DELTA_BLOCK = 64


def _bwd_meta(statics):
  return dict(statics.constants(), scale=statics.scale)


def delta_jax(out, g):
  """f32 ``[Tq, Hq]``: sum(out * g) per row, the backward's first step."""
  import jax
  tq, hq, d = out.shape
  return jax_launch.triton_call(
      out, g, kernel=_bwd_delta_kernel,
      out_shape=jax.ShapeDtypeStruct((tq, hq), "float32"),
      grid=(cdiv(tq * hq, _DELTA_BLOCK),), num_warps=4,
      name="rlk_det_attention_bwd_delta", n_rows=tq * hq,
      stride_ot=hq * d, stride_oh=d, stride_dt=hq * d, stride_dh=d,
      n_heads=hq, HEAD_DIM=d, BLOCK=_DELTA_BLOCK)


def _bwd_common_jax(q, k, v, g, seqs, statics):
  return dict(zip(("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                   "stride_vt", "stride_vh", "stride_dot", "stride_doh"),
                  _strides(q, k, v, g)),
              n_seqs=seqs.shape[1], stride_lt=q.shape[1], INTERPRETED=False,
              **_bwd_meta(statics))


def dq_jax(q, k, v, g, lse, delta, seqs, q_tiles, statics: Statics,
           config: AttentionConfig):
  """dq in q's dtype (`q_tiles`: a map of config.dq_tiles()[0]-row tiles)."""
  import jax
  hq, d = q.shape[1:]
  dq_m, dq_n, dq_warps, dq_stages = config.dq_tiles()
  return jax_launch.triton_call(
      q, k, v, g, lse, delta, seqs, q_tiles, kernel=_bwd_dq_kernel,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(q_tiles.shape[1], hq), num_warps=dq_warps, num_stages=dq_stages,
      name="rlk_det_attention_bwd_dq", stride_dqt=hq * d, stride_dqh=d,
      BLOCK_M=dq_m, BLOCK_N=dq_n, **_bwd_common_jax(q, k, v, g, seqs,
                                                    statics))


def backward_jax(q, k, v, out, lse, g, seqs, q_tiles, k_tiles,
                 statics: Statics, config: AttentionConfig):
  """(dq, dk, dv) in the operands' dtypes. Rows no tile covers are not
  written (the caller masks them)."""
  import jax
  hkv, d = k.shape[1:]
  delta = delta_jax(out, g)
  dk, dv = jax_launch.triton_call(
      q, k, v, g, lse, delta, seqs, k_tiles, kernel=_bwd_dkdv_kernel,
      out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(k_tiles.shape[1], hkv), num_warps=config.bwd_num_warps,
      num_stages=config.bwd_num_stages, name="rlk_det_attention_bwd_dkdv",
      stride_dkt=hkv * d, stride_dkh=d, stride_dvt=hkv * d, stride_dvh=d,
      BLOCK_M=config.bwd_block_m, BLOCK_N=config.bwd_block_n,
      **_bwd_common_jax(q, k, v, g, seqs, statics))
  dq = dq_jax(q, k, v, g, lse, delta, seqs, q_tiles, statics, config)
  return dq, dk, dv


def delta_torch(out, g):
  """f32 ``[Tq, Hq]``: sum(out * g) per row (out, g contiguous)."""
  import torch
  tq, hq, d = out.shape
  delta = torch.empty((tq, hq), dtype=torch.float32, device=out.device)
  _launch_delta.launch(
      (cdiv(tq * hq, _DELTA_BLOCK),), out, g, delta, tq * hq, hq * d, d,
      hq * d, d, hq, HEAD_DIM=d, BLOCK=_DELTA_BLOCK, num_warps=4)
  return delta


def dq_torch(q, k, v, g, lse, delta, seqs, q_tiles, dq, statics: Statics,
             config: AttentionConfig):
  """Writes dq (rows as `forward_torch` reads q) and returns it."""
  dq_m, dq_n, dq_warps, dq_stages = config.dq_tiles()
  _launch_dq.launch(
      (q_tiles.shape[1], q.shape[1]), q, k, v, g, lse, delta, seqs, q_tiles,
      dq, seqs.shape[1], *row_strides(q, k, v, g), q.shape[1],
      *row_strides(dq),
      num_warps=dq_warps, num_stages=dq_stages, BLOCK_M=dq_m, BLOCK_N=dq_n,
      INTERPRETED=interpreted(), **_bwd_meta(statics))
  return dq


def backward_torch(q, k, v, out, lse, g, seqs, q_tiles, k_tiles, dq, dk, dv,
                   statics: Statics, config: AttentionConfig):
  """Writes dq, dk, dv and returns them. out and g are contiguous [Tq, Hq,
  D]; q, k, v, dq, dk, dv are rows as `forward_torch` reads them (dk and dv
  with k's and v's row numbering: `seqs` counts both)."""
  hq = q.shape[1]
  delta = delta_torch(out, g)
  _launch_dkdv.launch(
      (k_tiles.shape[1], k.shape[-2]), q, k, v, g, lse, delta, seqs,
      k_tiles, dk, dv, seqs.shape[1], *row_strides(q, k, v, g), hq,
      *row_strides(dk, dv),
      num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages,
      BLOCK_M=config.bwd_block_m, BLOCK_N=config.bwd_block_n,
      INTERPRETED=interpreted(), **_bwd_meta(statics))
  dq_torch(q, k, v, g, lse, delta, seqs, q_tiles, dq, statics, config)
  return dq, dk, dv


# Sequences the one-kernel tile map takes (its program holds a tile block
# against every sequence); more go through torch's ops.
TILE_MAP_MAX_SEQS = 1024


def tile_map_torch(lengths, rows_per_tile: int, n_tiles: int):
  """int32 [2, n_tiles]: each tile's sequence (-1: none) and first row, for
  sequences of `lengths` (int32 [B], B <= TILE_MAP_MAX_SEQS) cut into
  `rows_per_tile`-row tiles in order: rlk_jax._attention._tile_map's ints in
  one launch instead of a dozen small torch kernels before every call."""
  import torch
  n = lengths.shape[0]
  out = torch.empty((2, n_tiles), dtype=torch.int32, device=lengths.device)
  block_s = max(16, next_power_of_2(n))
  block_t = max(16, min(128, 16384 // block_s))
  _launch_tile_map.launch(
      (cdiv(n_tiles, block_t),), lengths, out, n, n_tiles,
      ROWS=rows_per_tile, BLOCK_S=block_s, BLOCK_T=block_t, num_warps=4)
  return out


def fill_outside_torch(x, starts, lengths, n_rows: int, value: float):
  """Sets x's rows that lie in no sequence ([starts, starts + lengths),
  int32 [B], B <= TILE_MAP_MAX_SEQS) to `value`, in place, touching only
  those rows: x is ``[T, H, D]`` or ``[T, H]`` rows, or ``[B, S, H, D]``
  read in place (`n_rows` rows in all, as `row_strides` numbers them).
  Returns x."""
  if x.ndim == 2:
    stride_r, stride_h, heads, d = x.stride(0), x.stride(1), x.shape[1], 1
  else:
    (stride_r, stride_h), heads, d = row_strides(x), x.shape[-2], x.shape[-1]
  # Batch rows of a view read in place: x.stride(0) / stride(1) rows apart,
  # x.shape[1] of them tokens.
  period, tokens = ((x.stride(0) // x.stride(1), x.shape[1]) if x.ndim == 4
                    else (n_rows, n_rows))
  block_s = max(16, next_power_of_2(starts.shape[0]))
  block_r = max(1, min(64, 8192 // block_s))
  _launch_fill_outside.launch(
      (cdiv(n_rows, block_r),), x, starts, lengths, starts.shape[0], n_rows,
      max(period, 1), tokens, stride_r, stride_h, heads * d, float(value),
      HEAD_DIM=d, BLOCK_R=block_r, BLOCK_S=block_s,
      BLOCK_C=min(1024, next_power_of_2(heads * d)), num_warps=4)
  return x


