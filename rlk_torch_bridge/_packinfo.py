"""The torch side of ``rlk_jax.PackInfo``, carried across DLPack as one buffer.

A PackInfo has ten arrays; handing each across DLPack separately would cost
ten imports per pack. The bridge's jitted pack writes them into one byte
buffer instead (int32 fields first, so every int32 view is 4-byte aligned,
then ``valid`` as bytes), moves that one buffer, and the torch fields are
views into it, made on first access. Later packs and unpacks with the same
info hand the JAX buffer back to JAX (no import at all).
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


@functools.lru_cache(maxsize=None)
def layout(mask_shape: tuple, capacity: int) -> tuple:
  """``(field, shape, byte offset)`` of each field in the buffer, and the
  buffer's size in bytes."""
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
_info_to_bytes = jax.jit(info_to_bytes)


def _views(buffer: torch.Tensor, mask_shape: tuple, capacity: int) -> dict:
  placed, nbytes = layout(mask_shape, capacity)
  words = buffer[:placed[-1][2]].view(torch.int32)  # the int32 fields
  sizes = [math.prod(shape) for _, shape, _ in placed[:-1]]
  views = {name: part.view(shape) for (name, shape, _), part
           in zip(placed[:-1], words.split(sizes))}
  name, shape, offset = placed[-1]  # valid, one byte per row
  views[name] = buffer[offset:nbytes].view(torch.bool).view(shape)
  return views


@functools.lru_cache(maxsize=None)
def offsets(mask_shape: tuple, capacity: int) -> dict:
  return {name: offset for name, _, offset in layout(mask_shape, capacity)[0]}


@dataclasses.dataclass
class PackInfo:
  """The torch side of ``rlk_jax.PackInfo``: the same fields, as tensors
  (cu_seqlens, seq_lens, total, max_seqlen, num_dropped, segment_ids,
  positions, valid, gather_map, scatter_map), plus ``mask_shape`` and
  ``capacity``. Reusable: ``pack(y, info)`` packs another tensor with it.

  From ``rlk_torch_bridge.pack`` the fields are zero-copy views of the
  buffer JAX wrote, made on first access; treat them as read-only (they
  alias JAX's memory). Later calls hand JAX its own buffer back unless a
  field was replaced, in which case the replaced fields are used.
  """
  cu_seqlens: torch.Tensor
  seq_lens: torch.Tensor
  total: torch.Tensor
  max_seqlen: torch.Tensor
  num_dropped: torch.Tensor
  segment_ids: torch.Tensor
  positions: torch.Tensor
  valid: torch.Tensor
  gather_map: torch.Tensor
  scatter_map: torch.Tensor
  mask_shape: tuple
  capacity: int

  @classmethod
  def from_buffer(cls, torch_buffer: torch.Tensor, jax_buffer: jax.Array | None,
                  mask_shape: tuple, capacity: int) -> "PackInfo":
    """A PackInfo viewing `torch_buffer` (see `layout`); `jax_buffer` is the
    same memory as a JAX array, or None to import it when first needed."""
    info = cls.__new__(cls)
    info.__dict__.update(mask_shape=tuple(mask_shape), capacity=capacity,
                         _buffers=(torch_buffer, jax_buffer))
    return info

  def __getattr__(self, name):
    # Only reached for attributes not set yet: the lazily made field views.
    state = self.__dict__
    if name in FIELDS and "_buffers" in state and "_views" not in state:
      state["_views"] = _views(state["_buffers"][0], state["mask_shape"],
                               state["capacity"])
      for field, view in state["_views"].items():
        state.setdefault(field, view)
      return state[name]
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  def _intact(self) -> bool:
    """Whether every field still is the view of the buffer that we made."""
    state = self.__dict__
    if "_buffers" not in state:
      return False
    views = state.get("_views", {})
    return not any(name in state and state[name] is not views.get(name)
                   for name in FIELDS)

  def field_address(self, name: str) -> int | None:
    """The device address of field `name` inside the buffer (no view made),
    or None if the fields were replaced."""
    if not self._intact():
      return None
    return (self.__dict__["_buffers"][0].data_ptr()
            + offsets(self.mask_shape, self.capacity)[name])

  def _own_buffer(self) -> jax.Array | None:
    """JAX's buffer, if every field still is the view of it that we made."""
    if not self._intact():
      return None
    state = self.__dict__
    torch_buffer, jax_buffer = state["_buffers"]
    if jax_buffer is None:  # written by the CUDA kernels: import it once
      jax_buffer = to_jax_all(torch_buffer)[0]
      state["_buffers"] = (torch_buffer, jax_buffer)
    return jax_buffer

  def jax_buffer(self) -> jax.Array:
    """The fields as the one JAX byte buffer the bridge's jitted ops read."""
    own = self._own_buffer()
    return own if own is not None else _info_to_bytes(self.to_jax())

  def to_jax(self) -> rlk_jax.PackInfo:
    """The ``rlk_jax.PackInfo`` (cached while the fields are unchanged)."""
    state = self.__dict__
    key = tuple(id(getattr(self, f)) for f in FIELDS)
    cached = state.get("_jax_info")
    if cached is not None and cached[0] == key:
      return cached[1]
    own = self._own_buffer()
    if own is not None:
      info = _info_from_bytes(own, self.mask_shape, self.capacity)
    else:
      arrays = to_jax_all(*(getattr(self, f) for f in FIELDS))
      info = rlk_jax.PackInfo(**dict(zip(FIELDS, arrays)),
                              mask_shape=tuple(self.mask_shape),
                              capacity=self.capacity)
    state["_jax_info"] = (key, info)
    return info
