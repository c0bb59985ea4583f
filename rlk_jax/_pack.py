"""pack / unpack: masked variable-length pack-and-pad that works inside jit.

``pack(x, mask)`` compacts the active rows of ``x`` (``mask != 0``, in the
row-major order of ``x[mask]``) into ``[capacity, *tail]``, pad rows equal to
``fill_value``; ``unpack`` scatters them back. Shapes are static (capacity is
a Python int), nothing syncs with the host, and the index metadata
(:class:`PackInfo`) comes from one prefix sum over the mask, computed once and
reusable for every tensor that shares the mask.

Both directions are one primitive, a row gather with fill, whose gradient is
the same gather through the inverse map:

* pack:   ``packed[r] = x[gather_map[r]]``   (-1: pad row, ``fill_value``)
* unpack: ``dense[p]  = packed[scatter_map[p]]`` (-1: inactive, ``fill_value``)

so d(pack) is unpack with zeros and d(unpack) is pack with zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import cuda_ffi
from pallas_kernels import row_gather
from triton_kernels import backend as triton_backend
from triton_kernels import row_gather as triton_row_gather
from rlk_jax import _dispatch, _validate, reference


# ----------------------------------------------------------------------------
# Metadata


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["cu_seqlens", "seq_lens", "total", "max_seqlen", "num_dropped",
                 "segment_ids", "positions", "valid", "gather_map",
                 "scatter_map"],
    meta_fields=["mask_shape", "capacity"])
@dataclasses.dataclass(frozen=True)
class PackInfo:
  """Everything a varlen consumer needs about one packing, as a pytree.

  Per sequence (the mask's first axis indexes sequences):
    cu_seqlens  int32 [n_seq + 1]  cumulative active counts, from the mask
    seq_lens    int32 [n_seq]      active rows of each sequence
  Scalars:
    total       int32 []  active rows in the mask
    max_seqlen  int32 []
    num_dropped int32 []  active rows that did not fit (``total - capacity``
                          when positive); nonzero only if capacity is too small
  Per packed row ([capacity]):
    segment_ids int32  sequence of the row, -1 on pad rows
    positions   int32  0-based position inside its sequence (restarting per
                       sequence), 0 on pad rows so it is safe as an index
    valid       bool   the row holds data
    gather_map  int32  flat source row (into ``mask.reshape(-1)``), -1 on pad
  Per source position (``mask_shape``):
    scatter_map int32  packed row of the position, -1 if inactive or dropped
  Static: ``mask_shape`` and ``capacity``.
  """
  cu_seqlens: jax.Array
  seq_lens: jax.Array
  total: jax.Array
  max_seqlen: jax.Array
  num_dropped: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  valid: jax.Array
  gather_map: jax.Array
  scatter_map: jax.Array
  mask_shape: tuple[int, ...]
  capacity: int


def pack_info(mask, *, capacity: int | None = None,
              implementation: str | None = None) -> PackInfo:
  """Computes the :class:`PackInfo` of `mask`, on the device, with no host sync.

  Plain XLA ops, fused by XLA into a few small kernels: one prefix sum (CUB on
  GPUs) and one elementwise pass over the packed rows. (A single-program
  Pallas kernel writing every field was measured slower on the H100: see
  benchmarks/results/experiments/h100-2026-11-21/.)

  Called eagerly with a concrete mask and ``capacity < mask.size``, it raises
  ``ValueError`` when the active rows do not fit. Under ``jit`` the overflow
  is reported in ``info.num_dropped`` (see :func:`check_no_overflow`).

  `implementation` ``"cuda_ffi"`` computes it with the CUDA kernels instead
  (the same integers; what ``pack(x, mask, implementation="cuda_ffi")``
  uses); any other value, or None, the XLA ops.
  """
  mask, capacity = _checked_mask(mask, capacity)
  if implementation == "cuda_ffi":
    return _cuda_pack_info(mask, capacity)
  return _pack_info(mask, capacity)


def _checked_mask(mask, capacity) -> tuple[jax.Array, int]:
  """The mask as an array and the static capacity, both checked; a concrete
  mask that does not fit raises here."""
  if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
    mask = np.asarray(mask)
  _validate.check_mask_dtype("pack", mask.dtype)
  mask_shape = tuple(int(d) for d in mask.shape)
  if len(mask_shape) == 0:
    raise ValueError("rlk_jax.pack: mask must have rank >= 1 (its first axis "
                     "indexes sequences), got a scalar of shape ().")
  size = math.prod(mask_shape)
  if size >= 2**31:
    raise ValueError(f"rlk_jax.pack: mask of shape {mask_shape} has {size} "
                     "positions; the int32 index maps need fewer than 2**31.")
  capacity = _validate.static_capacity("pack", capacity, size)
  if capacity < size and _validate.is_concrete(mask):
    check_fits("rlk_jax.pack", mask_shape,
               int(np.count_nonzero(np.asarray(mask))), capacity)
  return jnp.asarray(mask), capacity


def check_fits(op: str, mask_shape: tuple, active: int, capacity: int) -> None:
  """The eager overflow error: nothing is dropped silently."""
  if active > capacity:
    raise ValueError(
        f"{op}: the mask (shape {tuple(mask_shape)}) has {active} active "
        f"rows but capacity is {capacity}; raise capacity to at least "
        f"{active}. Nothing is dropped silently.")


@functools.partial(jax.jit, static_argnums=1)
def _pack_info(mask: jax.Array, capacity: int) -> PackInfo:
  mask_shape = mask.shape
  n_seq, size = mask_shape[0], mask.size
  seq_width = size // n_seq if n_seq else 0
  active = (mask != 0).reshape(-1)
  # The one prefix sum everything else is read from.
  inclusive = jnp.cumsum(active, dtype=jnp.int32)
  total = inclusive[-1] if size else jnp.zeros((), jnp.int32)
  if seq_width:
    seq_ends = inclusive.reshape(n_seq, seq_width)[:, -1]
  else:
    seq_ends = jnp.zeros((n_seq,), jnp.int32)
  cu_seqlens = jnp.concatenate([jnp.zeros((1,), jnp.int32), seq_ends])
  seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
  max_seqlen = jnp.max(seq_lens, initial=0)

  packed_row = inclusive - 1
  kept = active & (packed_row < capacity)
  scatter_flat = jnp.where(kept, packed_row, -1)

  rows = jnp.arange(capacity, dtype=jnp.int32)
  valid = rows < jnp.minimum(total, capacity)
  # Packed row r holds the (r+1)-th active position: the first p with
  # inclusive[p] >= r + 1. An unrolled binary search is elementwise over the
  # packed rows, so XLA fuses it with the fields below into one kernel (a
  # scatter would be a separate, serialised one).
  if size:
    found = jnp.searchsorted(inclusive, rows + 1, side="left",
                             method="scan_unrolled").astype(jnp.int32)
  else:
    found = jnp.zeros((capacity,), jnp.int32)
  gather_map = jnp.where(valid, found, -1)
  segment_ids = jnp.where(valid, found // max(seq_width, 1), -1)
  positions = jnp.where(
      valid, rows - cu_seqlens[jnp.clip(segment_ids, 0, max(n_seq - 1, 0))], 0)
  return PackInfo(
      cu_seqlens=cu_seqlens, seq_lens=seq_lens, total=total,
      max_seqlen=max_seqlen,
      num_dropped=jnp.maximum(total - capacity, 0).astype(jnp.int32),
      segment_ids=segment_ids.astype(jnp.int32), positions=positions,
      valid=valid, gather_map=gather_map,
      scatter_map=scatter_flat.reshape(mask_shape),
      mask_shape=tuple(mask_shape), capacity=capacity)


def _as_bool(mask):
  return mask if mask.dtype == jnp.bool_ else mask != 0


@functools.partial(jax.jit, static_argnums=1)
def _cuda_pack_info(mask: jax.Array, capacity: int) -> PackInfo:
  fields = cuda_ffi.pack_info(_as_bool(mask), capacity=capacity)
  return PackInfo(*fields, mask_shape=tuple(mask.shape), capacity=capacity)


def _cuda_pack_rows(fill, capacity, src, mask) -> tuple[jax.Array, PackInfo]:
  """pack from a mask as one CUDA call: small masks take one kernel for the
  rows and every field (the metadata costs no launches of its own)."""
  # The call itself is never differentiated: its integer fields must carry
  # no tangents (integer consumers downstream, an FFI or Pallas call fed
  # cu_seqlens or a gather map, would be asked for a JVP). The rows get
  # pack's gradient attached afterwards.
  packed, *fields = cuda_ffi.pack_rows(jax.lax.stop_gradient(src),
                                       _as_bool(mask), capacity=capacity,
                                       fill=fill)
  info = PackInfo(*fields, mask_shape=tuple(mask.shape), capacity=capacity)
  if jnp.issubdtype(src.dtype, jnp.inexact):
    packed = _with_pack_gradient(src, packed, info.gather_map,
                                 info.scatter_map.reshape(-1))
  return packed, info


@jax.custom_vjp
def _with_pack_gradient(src, packed, gather_map, scatter_map):
  """`packed`, with the gradient of packing `src` by these maps."""
  del src, gather_map, scatter_map
  return packed


def _with_pack_gradient_fwd(src, packed, gather_map, scatter_map):
  # Through the custom_vjp again, so a derivative of this rule (second
  # order) still sees `packed` depend on `src`.
  return (_with_pack_gradient(src, packed, gather_map, scatter_map),
          (gather_map, scatter_map))


def _with_pack_gradient_bwd(maps, g):
  gather_map, scatter_map = maps
  # As pack's: the packed rows' gradient scattered back, zeros elsewhere.
  return (_move_rows("cuda_ffi", 0, g, scatter_map, gather_map), None, None,
          None)


_with_pack_gradient.defvjp(_with_pack_gradient_fwd, _with_pack_gradient_bwd)


def check_no_overflow(info: PackInfo) -> None:
  """Raises at run time, also under ``jit``, if the packing dropped rows.

  This is the checked mode: it reads one int32 back to the host (a device to
  host transfer per call), so it is opt-in (``pack(..., checked=True)``).
  Under ``jit`` the error surfaces as a runtime error carrying this message.
  """
  jax.debug.callback(functools.partial(_raise_if_dropped, info.capacity),
                     info.num_dropped, info.total)


def _raise_if_dropped(capacity, num_dropped, total):
  if int(num_dropped) > 0:
    raise ValueError(
        f"rlk_jax.pack: {int(total)} active rows do not fit capacity "
        f"{capacity}: {int(num_dropped)} rows were dropped.")


# ----------------------------------------------------------------------------
# The row gather and its implementations


def _triton_gather_rows(src, idx, fill):
  n_out, = idx.shape
  n_src, width = src.shape
  if n_out == 0 or width == 0 or n_src == 0:
    # No launch for an empty grid (idx is all -1 when n_src == 0).
    return jnp.full((n_out, width), fill, src.dtype)
  # The Pallas kernel's block shapes: the same bytes per program.
  config = row_gather.default_config(n_out, width,
                                     jnp.dtype(src.dtype).itemsize)
  return triton_row_gather.gather_rows(src, idx, fill, config=config)


TABLE = _dispatch.register_reference_and_pallas(
    "pack",
    reference=reference.gather_rows,
    reference_doc="plain jax.numpy take + where; the oracle and the CPU default",
    pallas=row_gather.gather_rows,
    pallas_doc="Pallas row-gather kernel (Triton lowering on GPUs, the Pallas "
               "interpreter on CPUs)",
    gpu_first=[_dispatch.Implementation(
        "cuda_ffi", cuda_ffi.gather_rows, cuda_ffi.unavailable_reason,
        "CUDA kernels through XLA FFI (SM90 library): pack from a mask of up "
        "to 65536 positions in one kernel (rows and metadata), else the "
        "metadata kernels and the row gather; the torch bridge launches the "
        "same kernels without a JAX call"),
        _dispatch.Implementation(
        "triton", _triton_gather_rows, triton_backend.unavailable_reason,
        "the row gather as a @triton.jit kernel through jax-triton (CUDA "
        "GPUs); metadata by XLA ops")],
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_rows(impl_name: str, fill, src, idx, inverse_idx):
  return TABLE.implementations[impl_name].fn(src, idx, fill)


def _gather_rows_fwd(impl_name, fill, src, idx, inverse_idx):
  return _gather_rows(impl_name, fill, src, idx, inverse_idx), (idx, inverse_idx)


def _gather_rows_bwd(impl_name, fill, residuals, g):
  idx, inverse_idx = residuals
  # Rows never read (pad rows, inactive positions) get zero gradient.
  return (_gather_rows(impl_name, 0, g, inverse_idx, idx), None, None)


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _move_rows(impl_name, fill, src2d, idx, inverse_idx):
  if jnp.issubdtype(src2d.dtype, jnp.inexact):
    return _gather_rows(impl_name, fill, src2d, idx, inverse_idx)
  # Integer/bool data has no gradient; skip the custom_vjp wrapper.
  return TABLE.implementations[impl_name].fn(src2d, idx, fill)


# ----------------------------------------------------------------------------
# Public ops


def pack(x, mask_or_info, *, capacity: int | None = None, fill_value=0,
         implementation: str | None = None, checked: bool = False
         ) -> tuple[jax.Array, PackInfo]:
  """Packs the active rows of `x` into ``[capacity, *tail]``.

  Args:
    x: ``[*mask.shape, *tail]``.
    mask_or_info: the mask (rank >= 1, any dtype, nonzero = active; its first
      axis indexes sequences) or a :class:`PackInfo` from an earlier
      ``pack``/``pack_info`` of the same mask, which is then reused as is.
    capacity: static row count of the result; default ``mask.size``. With a
      PackInfo it must be None or equal to ``info.capacity``.
    fill_value: static scalar written to the pad rows.
    implementation: None (best available: ``"cuda_ffi"`` on SM90 GPUs with
      the library, else ``"pallas"`` on GPUs, ``"xla"`` on CPUs), or one of
      them by name.
    checked: also raise at run time (under jit too) if rows were dropped.

  Returns:
    ``(packed, info)``.
  """
  impl = TABLE.select(implementation).name
  if isinstance(mask_or_info, PackInfo):
    info, mask = mask_or_info, None
    check_reused_capacity("rlk_jax.pack", capacity, info.capacity)
    mask_shape = info.mask_shape
  else:
    mask, capacity = _checked_mask(mask_or_info, capacity)
    mask_shape = tuple(mask.shape)
  x = _as_array(x)
  dtype = _validate.check_packable_dtype("pack", "x", x.dtype)
  _check_prefix("pack", x.shape, mask_shape)
  fill = _validate.static_fill("pack", "fill_value", fill_value, dtype)
  tail = x.shape[len(mask_shape):]
  src = x.reshape(math.prod(mask_shape), math.prod(tail))
  if mask is not None and impl == "cuda_ffi":
    packed, info = _cuda_pack_rows(fill, capacity, src, mask)
  else:
    if mask is not None:
      info = _pack_info(mask, capacity)
    packed = _move_rows(impl, fill, src, info.gather_map,
                        info.scatter_map.reshape(-1))
  if checked:
    check_no_overflow(info)
  return packed.reshape((info.capacity, *tail)), info


def unpack(packed, info: PackInfo, *, fill_value=0,
           implementation: str | None = None) -> jax.Array:
  """Scatters packed rows back to ``[*mask.shape, *tail]``.

  Inactive (and dropped) positions get `fill_value`.
  """
  if not isinstance(info, PackInfo):
    raise TypeError("rlk_jax.unpack: info must be the PackInfo returned by "
                    f"rlk_jax.pack, got {type(info).__name__}.")
  packed = _as_array(packed)
  dtype = _validate.check_packable_dtype("unpack", "packed", packed.dtype)
  if packed.ndim < 1 or packed.shape[0] != info.capacity:
    raise ValueError(f"rlk_jax.unpack: packed has shape {packed.shape}; its "
                     f"first axis must be the capacity {info.capacity}.")
  fill = _validate.static_fill("unpack", "fill_value", fill_value, dtype)
  impl = TABLE.select(implementation).name
  tail = packed.shape[1:]
  src = packed.reshape(info.capacity, math.prod(tail))
  dense = _move_rows(impl, fill, src, info.scatter_map.reshape(-1),
                     info.gather_map)
  return dense.reshape((*info.mask_shape, *tail))


def check_reused_capacity(op: str, capacity, info_capacity: int) -> None:
  """A capacity given with a reused PackInfo must be that info's own."""
  if capacity is not None and capacity != info_capacity:
    raise ValueError(f"{op}: capacity={capacity} disagrees with the given "
                     f"PackInfo's capacity {info_capacity}.")


def _as_array(x):
  return x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)


def _check_prefix(op, x_shape, mask_shape):
  if tuple(x_shape[:len(mask_shape)]) != tuple(mask_shape):
    raise ValueError(f"rlk_jax.{op}: mask shape {tuple(mask_shape)} must be a "
                     f"prefix of x's shape {tuple(x_shape)}.")
