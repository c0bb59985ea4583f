"""det_gemm's SM90 kernels launched straight from torch: the same compiled
CUTLASS kernels the ``cuda_ffi`` JAX implementation calls, so the same bits,
without the DLPack round trip and the JAX dispatch (the bridge's per-call
cost).

Stream order and lifetime hold by construction: every kernel is enqueued on
torch's current stream and reads and writes torch tensors, so torch's caching
allocator, which is stream-ordered, cannot reuse an input's memory before the
kernel that reads it ran.
"""

from __future__ import annotations

import contextlib

import torch

import cuda_ffi
from rlk_torch_bridge._dlpack import _current_stream_handle


def _aligned(t: torch.Tensor) -> torch.Tensor:
  # TMA reads from 16-byte aligned addresses; a view at an odd offset is
  # copied (values unchanged, so bits unchanged).
  t = t.contiguous()
  return t if t.data_ptr() % 16 == 0 else t.clone()


def product(a: torch.Tensor, b: torch.Tensor, transpose_a: bool,
            transpose_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
  """``op(a) @ op(b)``, both row-major 2-D, on a's device and torch's stream."""
  a, b = _aligned(a), _aligned(b)
  m, k = a.shape[::-1] if transpose_a else a.shape
  n = b.shape[0] if transpose_b else b.shape[1]
  c = torch.empty((m, n), dtype=out_dtype, device=a.device)
  index = a.device.index
  # The library launches on the current device (what its TMA descriptors
  # and SM count are read for): make it a's only when it is not already.
  with (contextlib.nullcontext() if torch.cuda.current_device() == index
        else torch.cuda.device(index)):
    cuda_ffi.launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k,
                    transpose_a=transpose_a, transpose_b=transpose_b,
                    out_f32=out_dtype == torch.float32,
                    stream=_current_stream_handle(index))
  return c
