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
from rlk_torch_bridge._checks import jax_dtype
from rlk_torch_bridge._torch_stream import current_stream_handle, on_device_of


@functools.lru_cache(maxsize=None)
def _info_plan(mask_shape: tuple, capacity: int):
  """(the fields' byte offsets in FIELDS order, the info's bytes, the
  metadata kernels' scratch bytes)."""
  offsets = _packinfo.offsets(mask_shape, capacity)
  return (tuple(offsets[f] for f in _packinfo.FIELDS),
          _packinfo.layout(mask_shape, capacity)[1],
          cuda_ffi.pack_info_scratch_bytes(math.prod(mask_shape)))


@on_device_of
def pack_from_mask(x: torch.Tensor, mask: torch.Tensor, capacity: int,
                   fill) -> tuple[torch.Tensor, torch.Tensor]:
  """``(packed [capacity, *tail], the PackInfo buffer)`` from the mask: the
  rows and every field in one kernel for masks of up to 65536 positions with
  16-byte rows (the kernel rlk_jax's cuda_ffi pack runs), else the metadata
  kernels and the gather."""
  src = x.contiguous()
  mask_shape = tuple(mask.shape)
  tail = tuple(src.shape[mask.ndim:])
  out = torch.empty((capacity, *tail), dtype=src.dtype, device=src.device)
  active = (mask if mask.dtype == torch.bool else mask != 0).contiguous()
  n_seq = mask_shape[0]
  width = active.numel() // n_seq if n_seq else 0
  offsets, nbytes, scratch_bytes = _info_plan(mask_shape, capacity)
  info = torch.empty(nbytes, dtype=torch.uint8, device=mask.device)
  # Scratch only the kernels use: freed after the launch, reused by torch's
  # stream-ordered allocator only behind them.
  scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=mask.device)
  base = info.data_ptr()
  cuda_ffi.launch_pack_rows(
      current_stream_handle(src.device.index), src.data_ptr(),
      active.data_ptr(), n_seq, width, capacity,
      math.prod(tail) * src.element_size(), src.element_size(),
      _fill_bits(fill, src.dtype), scratch.data_ptr(),
      [base + o for o in offsets], out.data_ptr())
  return out, info


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
      current_stream_handle(src.device.index), src.data_ptr(), index_address,
      out_shape[0], row_elems * src.element_size(), src.element_size(),
      _fill_bits(fill, src.dtype), out.data_ptr())
  return out


@on_device_of
def move(x: torch.Tensor, info: torch.Tensor, mask_shape: tuple,
         capacity: int, to_packed: bool, fill) -> torch.Tensor:
  """pack (``[*mask_shape, *tail]`` -> ``[capacity, *tail]``) or unpack with
  the index map inside the PackInfo buffer `info` (read in place)."""
  offset = _packinfo.offsets(mask_shape, capacity)[
      "gather_map" if to_packed else "scatter_map"]
  if to_packed:
    tail = tuple(x.shape[len(mask_shape):])
    return gather_rows(x, info.data_ptr() + offset, (capacity, *tail),
                       math.prod(tail), fill)
  tail = tuple(x.shape[1:])
  out = gather_rows(x, info.data_ptr() + offset,
                    (math.prod(mask_shape), *tail), math.prod(tail), fill)
  return out.view(*mask_shape, *tail)
