"""The torch side of ``rlk_jax.PackInfo``, carried across DLPack as one buffer.

A PackInfo has ten arrays. The pack op writes them into one byte buffer
(int32 fields first, so every int32 view is 4-byte aligned, then ``valid``
as bytes): one output of the ``rlk::pack`` operator (one DLPack import on the
JAX route, one allocation on the CUDA route), one input of ``rlk::move_rows``.
The torch fields are views into it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import torch

import rlk_jax
from rlk_torch_bridge._dlpack import to_jax_all

FIELDS = tuple(f.name for f in dataclasses.fields(rlk_jax.PackInfo)
               if f.name not in ("mask_shape", "capacity"))
_BOOL_FIELD = "valid"


def layout(mask_shape: tuple, capacity: int) -> tuple:
  """``(field, shape, byte offset)`` of each field in the buffer, and the
  buffer's size in bytes (cached for concrete sizes; torch.compile's
  symbolic sizes are computed afresh)."""
  if all(isinstance(d, int) for d in (*mask_shape, capacity)):
    return _layout(tuple(mask_shape), capacity)
  return _layout.__wrapped__(tuple(mask_shape), capacity)


@functools.lru_cache(maxsize=None)
def _layout(mask_shape: tuple, capacity: int) -> tuple:
  n_seq = mask_shape[0]
  shapes = {"cu_seqlens": (n_seq + 1,), "seq_lens": (n_seq,), "total": (),
            "max_seqlen": (), "num_dropped": (), "segment_ids": (capacity,),
            "positions": (capacity,), "gather_map": (capacity,),
            "scatter_map": tuple(mask_shape), _BOOL_FIELD: (capacity,)}
  placed, offset = [], 0
  for name in sorted(FIELDS, key=lambda f: f == _BOOL_FIELD):  # bool last
    placed.append((name, shapes[name], offset))
    offset += math.prod(shapes[name]) * (1 if name == _BOOL_FIELD else 4)
  return tuple(placed), offset


@functools.lru_cache(maxsize=None)
def offsets(mask_shape: tuple, capacity: int) -> dict:
  """Each field's byte offset in the buffer (concrete sizes)."""
  return {name: offset for name, _, offset in _layout(mask_shape, capacity)[0]}


def info_to_bytes(info: rlk_jax.PackInfo) -> jax.Array:
  """Inside jit: the fields of `info` as one uint8 buffer (see `layout`)."""
  parts = []
  for name, _, _ in layout(info.mask_shape, info.capacity)[0]:
    value = getattr(info, name).reshape(-1)
    if name == _BOOL_FIELD:
      parts.append(value.astype(jnp.uint8))
    else:
      parts.append(jax.lax.bitcast_convert_type(value, jnp.uint8).reshape(-1))
  return jnp.concatenate(parts)


def info_from_bytes(buffer: jax.Array, mask_shape: tuple,
                    capacity: int) -> rlk_jax.PackInfo:
  """Inside jit: the inverse of `info_to_bytes`."""
  fields = {}
  for name, shape, offset in layout(mask_shape, capacity)[0]:
    n = math.prod(shape)
    if name == _BOOL_FIELD:
      fields[name] = buffer[offset:offset + n].reshape(shape) != 0
    else:
      words = buffer[offset:offset + 4 * n].reshape(n, 4)
      fields[name] = jax.lax.bitcast_convert_type(words, jnp.int32).reshape(shape)
  return rlk_jax.PackInfo(**fields, mask_shape=mask_shape, capacity=capacity)


_info_from_bytes = jax.jit(info_from_bytes, static_argnums=(1, 2))


def _field(info: "PackInfo", name: str) -> torch.Tensor:
  placed = {f: (shape, offset) for f, shape, offset
            in layout(info.mask_shape, info.capacity)[0]}
  shape, offset = placed[name]
  n = math.prod(shape)
  if name == _BOOL_FIELD:
    return info.buffer[offset:offset + n].view(torch.bool).view(shape)
  return info.buffer[offset:offset + 4 * n].view(torch.int32).view(shape)


@dataclasses.dataclass(frozen=True, eq=False)
class PackInfo:
  """The torch side of ``rlk_jax.PackInfo``: the same fields as int32 (bool
  ``valid``) tensors, ``cu_seqlens, seq_lens, total, max_seqlen,
  num_dropped, segment_ids, positions, valid, gather_map, scatter_map``,
  plus ``mask_shape`` and ``capacity``. Reusable: ``pack(y, info)`` packs
  another tensor with it, ``unpack(packed, info)`` scatters back.

  The fields are views of one uint8 ``buffer`` (see `layout`), the pack
  op's second output: read them, do not write them (a write changes what
  later moves with this info do).
  """
  buffer: torch.Tensor
  mask_shape: tuple
  capacity: int

  def to_jax(self) -> rlk_jax.PackInfo:
    """The ``rlk_jax.PackInfo`` with these fields (one DLPack import)."""
    return _info_from_bytes(to_jax_all(self.buffer)[0], tuple(self.mask_shape),
                            self.capacity)


def _field_property(name: str) -> property:
  return property(lambda info: _field(info, name), doc=f"rlk_jax.PackInfo.{name}")


for _name in FIELDS:
  setattr(PackInfo, _name, _field_property(_name))
