"""Every PackInfo field from one prefix sum, in one single-program launch.

The metadata of a pack is tiny next to the rows it moves (a [32, 1024] mask
against 80 MB of hidden states), so what it costs is launches, not bytes: as
XLA ops it is a convert, a CUB scan and a fusion or two. Here it is one
program that walks the flat mask in chunks:

1. inclusive prefix sum of ``mask != 0`` (carry across chunks); the scatter
   map is ``inclusive - 1`` where active and within capacity; each kept
   position writes its own index into the gather map (a scattered store:
   kept positions have distinct packed rows, so no two lanes collide);
2. per sequence, ``cu_seqlens`` and ``seq_lens`` read off the prefix sum at
   sequence ends, and their maximum;
3. per packed row, ``valid``, ``segment_ids`` (gather map // sequence width),
   ``positions`` (row - cu_seqlens[segment]) and the pad rows' fills.

Passes 2 and 3 read what earlier passes wrote to global memory, which one
program's block barrier makes visible. The interpreter runs the body
sequentially and needs no barrier.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.row_gather import pltriton

# Above this many mask positions one program walking the mask becomes the
# critical path; callers use the XLA metadata instead.
MAX_POSITIONS = 1 << 20
_CHUNK = 8192
_NUM_WARPS = 16


def _barrier(interpret):
  if not interpret:
    pltriton.debug_barrier()


def _kernel(mask_ref, inclusive_ref, scatter_ref, gather_ref, segment_ref,
            position_ref, valid_ref, cu_ref, seq_len_ref, stats_ref, *,
            size, n_seq, seq_width, capacity, interpret):
  i32 = jnp.int32
  lanes = jnp.arange(_CHUNK, dtype=i32)

  # Pass 1: the one prefix sum; scatter map; gather map of the kept rows.
  def scan_chunk(k, carry):
    start = k * _CHUNK
    pos = start + lanes
    in_range = pos < size
    m = pltriton.load(mask_ref.at[pl.ds(start, _CHUNK)], mask=in_range,
                      other=jnp.zeros((), mask_ref.dtype))
    active = (m != 0) & in_range
    inclusive = jnp.cumsum(active.astype(i32), dtype=i32) + carry
    pltriton.store(inclusive_ref.at[pl.ds(start, _CHUNK)], inclusive,
                   mask=in_range)
    row = inclusive - 1
    kept = active & (row < capacity)
    pltriton.store(scatter_ref.at[pl.ds(start, _CHUNK)],
                   jnp.where(kept, row, -1), mask=in_range)
    # Masked-off lanes aim past the end: never dereferenced on the GPU, and
    # dropped (not a colliding write) by the interpreter's scatter.
    pltriton.store(gather_ref.at[jnp.where(kept, row, capacity)], pos,
                   mask=kept)
    return carry + jnp.sum(active.astype(i32), dtype=i32)

  total = jax.lax.fori_loop(i32(0), i32(pl.cdiv(size, _CHUNK)),
                            scan_chunk, i32(0))
  _barrier(interpret)

  # Pass 2: cu_seqlens[i] = inclusive[i * seq_width - 1] (0 for i == 0).
  def seq_chunk(k, longest):
    i = k * _CHUNK + lanes
    end = i * seq_width - 1
    has_end = (i > 0) & (i <= n_seq)
    cu = pltriton.load(inclusive_ref.at[jnp.where(has_end, end, 0)],
                       mask=has_end, other=i32(0))
    pltriton.store(cu_ref.at[pl.ds(k * _CHUNK, _CHUNK)], cu, mask=i <= n_seq)
    has_prev = (i > 0) & (i < n_seq)
    prev = pltriton.load(inclusive_ref.at[jnp.where(has_prev, end, 0)],
                         mask=has_prev, other=i32(0))
    own_end = (i + 1) * seq_width - 1
    has_own = i < n_seq
    own = pltriton.load(inclusive_ref.at[jnp.where(has_own, own_end, 0)],
                        mask=has_own, other=i32(0))
    seq_len = own - prev
    pltriton.store(seq_len_ref.at[pl.ds(k * _CHUNK, _CHUNK)], seq_len,
                   mask=i < n_seq)
    return jnp.maximum(longest, jnp.max(jnp.where(i < n_seq, seq_len, i32(0))))

  longest = jax.lax.fori_loop(i32(0), i32(pl.cdiv(n_seq + 1, _CHUNK)),
                              seq_chunk, i32(0))
  _barrier(interpret)

  # Pass 3: per packed row.
  n_valid = jnp.minimum(total, capacity)

  def row_chunk(k, unused):
    r = k * _CHUNK + lanes
    in_range = r < capacity
    valid = r < n_valid
    source = pltriton.load(gather_ref.at[jnp.where(valid, r, 0)], mask=valid,
                           other=i32(0))
    segment = source // seq_width
    seq_start = pltriton.load(cu_ref.at[jnp.where(valid, segment, 0)],
                              mask=valid, other=i32(0))
    rows = pl.ds(k * _CHUNK, _CHUNK)
    pltriton.store(segment_ref.at[rows], jnp.where(valid, segment, -1),
                   mask=in_range)
    pltriton.store(position_ref.at[rows], jnp.where(valid, r - seq_start, 0),
                   mask=in_range)
    pltriton.store(valid_ref.at[rows], valid, mask=in_range)
    pltriton.store(gather_ref.at[rows], jnp.full((_CHUNK,), -1, i32),
                   mask=in_range & ~valid)
    return unused

  jax.lax.fori_loop(i32(0), i32(pl.cdiv(capacity, _CHUNK)), row_chunk, i32(0))

  stat_lanes = jnp.arange(4, dtype=i32)
  stats = jnp.where(stat_lanes == 0, total,
                    jnp.where(stat_lanes == 1, longest,
                              jnp.where(stat_lanes == 2,
                                        jnp.maximum(total - capacity, 0), 0)))
  pltriton.store(stats_ref.at[pl.ds(0, 4)], stats)


def pack_metadata(mask_flat: jax.Array, *, n_seq: int, capacity: int,
                  interpret: bool = False):
  """Metadata of a flat mask ([n_seq * seq_width], any dtype).

  Needs ``0 < size <= MAX_POSITIONS`` and ``capacity > 0``. Returns
  ``(scatter_map [size], gather_map, segment_ids, positions, valid
  [capacity], cu_seqlens [n_seq + 1], seq_lens [n_seq],
  stats [4] = (total, max_seqlen, num_dropped, 0))``.
  """
  if pltriton is None:
    raise RuntimeError("the Pallas Triton lowering is unavailable")
  size, = mask_flat.shape
  assert 0 < size <= MAX_POSITIONS and capacity > 0 and n_seq > 0
  i32 = jnp.int32
  out_shape = (
      jax.ShapeDtypeStruct((size,), i32),           # inclusive (scratch)
      jax.ShapeDtypeStruct((size,), i32),           # scatter map
      jax.ShapeDtypeStruct((capacity,), i32),       # gather map
      jax.ShapeDtypeStruct((capacity,), i32),       # segment ids
      jax.ShapeDtypeStruct((capacity,), i32),       # positions
      jax.ShapeDtypeStruct((capacity,), jnp.bool_),  # valid
      jax.ShapeDtypeStruct((n_seq + 1,), i32),      # cu_seqlens
      jax.ShapeDtypeStruct((n_seq,), i32),          # seq_lens
      jax.ShapeDtypeStruct((4,), i32),              # stats
  )
  kernel = functools.partial(_kernel, size=size, n_seq=n_seq,
                             seq_width=size // n_seq, capacity=capacity,
                             interpret=interpret)
  _, *outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(1,), interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS,
                                              num_stages=1),
      name="rlk_pack_metadata",
  )(mask_flat)
  return tuple(outs)
