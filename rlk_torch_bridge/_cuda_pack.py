"""pack / unpack launched straight from torch: the cuda_ffi kernels that
rlk_jax's ``"cuda_ffi"`` pack implementation calls through XLA FFI (the
one-kernel pack from a mask, the metadata kernels, the row gather), so the
same integers and bytes,
without the DLPack round trip and the JAX dispatch (the bridge's per-call
cost). Stream order and lifetime hold by construction, as for det_gemm's
direct route (see ``_sm90``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

import cuda_ffi
from rlk_torch_bridge import _packinfo
from rlk_torch_bridge._dlpack import _current_stream_handle, jax_dtype
from rlk_torch_bridge._packinfo import PackInfo

_ALIGN = 16  # the scratch after the fields starts 16-byte aligned


@functools.lru_cache(maxsize=None)
def _info_plan(mask_shape: tuple, capacity: int):
  """(field addresses' offsets in FIELDS order, info bytes, scratch offset,
  total bytes) of the one allocation a pack launch writes its fields to."""
  nbytes = _packinfo.layout(mask_shape, capacity)[1]
  offsets = _packinfo.offsets(mask_shape, capacity)
  scratch_at = -(-nbytes // _ALIGN) * _ALIGN
  scratch = cuda_ffi.pack_info_scratch_bytes(math.prod(mask_shape))
  return (tuple(offsets[f] for f in _packinfo.FIELDS), nbytes, scratch_at,
          scratch_at + scratch)


def pack_from_mask(x: torch.Tensor, mask: torch.Tensor, capacity: int,
                   fill) -> tuple[torch.Tensor, PackInfo]:
  """``(packed [capacity, *tail], PackInfo)`` from the mask: the rows and
  every field in one kernel for masks of up to 65536 positions with 16-byte
  rows (the kernel rlk_jax's cuda_ffi pack runs), else the metadata kernels
  and the gather."""
  src = x.contiguous()
  mask_shape = tuple(mask.shape)
  tail = tuple(src.shape[mask.ndim:])
  out = torch.empty((capacity, *tail), dtype=src.dtype, device=src.device)
  active = (mask if mask.dtype == torch.bool else mask != 0).contiguous()
  n_seq = mask_shape[0]
  width = active.numel() // n_seq if n_seq else 0
  # The PackInfo fields and the kernels' scratch: one allocation.
  offsets, nbytes, scratch_at, total = _info_plan(mask_shape, capacity)
  buffer = torch.empty(total, dtype=torch.uint8, device=mask.device)
  base = buffer.data_ptr()
  cuda_ffi.launch_pack_rows(
      _current_stream_handle(src.device.index), src.data_ptr(),
      active.data_ptr(), n_seq, width, capacity,
      math.prod(tail) * src.element_size(), src.element_size(),
      _fill_bits(fill, src.dtype), base + scratch_at,
      [base + o for o in offsets], out.data_ptr())
  return out, PackInfo.from_buffer(buffer[:nbytes], None, mask_shape, capacity)


def _index_map(info: PackInfo, name: str) -> tuple[int, object]:
  """(device address, the tensor that owns it) of an int32 index map: the
  info buffer itself while its fields are untouched (no view is made)."""
  address = info.field_address(name)
  if address is not None:
    return address, info
  index = getattr(info, name).to(torch.int32).contiguous()
  return index.data_ptr(), index


@functools.lru_cache(maxsize=None)
def _fill_bits(fill, dtype: torch.dtype) -> int:
  return cuda_ffi.fill_bits(fill, np.dtype(jax_dtype(dtype)))


def gather_rows(src: torch.Tensor, index_address: int, out_shape: tuple,
                row_elems: int, fill) -> torch.Tensor:
  """``out[r] = src_rows[index[r]]`` or `fill` where ``index[r] < 0``, for
  the ``out_shape[0]`` rows of the int32 index at `index_address`, rows of
  `row_elems` elements."""
  src = src.contiguous()
  out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
  cuda_ffi.launch_gather_rows(
      _current_stream_handle(src.device.index), src.data_ptr(), index_address,
      out_shape[0], row_elems * src.element_size(), src.element_size(),
      _fill_bits(fill, src.dtype), out.data_ptr())
  return out


def move(x: torch.Tensor, info: PackInfo, direction: str, fill) -> torch.Tensor:
  """pack (``[*mask_shape, *tail]`` -> ``[capacity, *tail]``) or unpack."""
  if direction == "pack":
    tail = tuple(x.shape[len(info.mask_shape):])
    address, _owner = _index_map(info, "gather_map")
    return gather_rows(x, address, (info.capacity, *tail), math.prod(tail),
                       fill)
  tail = tuple(x.shape[1:])
  address, _owner = _index_map(info, "scatter_map")
  out = gather_rows(x, address, (math.prod(info.mask_shape), *tail),
                    math.prod(tail), fill)
  return out.view(*info.mask_shape, *tail)
