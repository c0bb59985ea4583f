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
from rlk_torch_bridge._torch_stream import current_stream_handle

_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _aligned(t: torch.Tensor) -> torch.Tensor:
  # TMA reads from 16-byte aligned addresses; a view at an odd offset is
  # copied (values unchanged, so bits unchanged).
  t = t.contiguous()
  return t if t.data_ptr() % 16 == 0 else t.clone()


def product_launcher(m: int, n: int, k: int, transpose_a: bool,
                     transpose_b: bool, out_dtype: torch.dtype,
                     config: str = "auto"):
  """``product(a, b) -> op(a) @ op(b)`` for one signature (a and b 2-D
  row-major, on a's device, on torch's current stream), on the named
  kernel config (every config gives the same bits)."""
  launch = cuda_ffi.launcher(m, n, k, transpose_a=transpose_a,
                             transpose_b=transpose_b,
                             out_f32=out_dtype == torch.float32,
                             config=config)

  def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _aligned(a), _aligned(b)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    index = a.device.index
    with on_device(index):
      launch(a.data_ptr(), b.data_ptr(), c.data_ptr(),
             current_stream_handle(index))
    return c
  return product


def on_device(index: int):
  """A context in which `index` is the current CUDA device. The library
  launches on the current device (what its TMA descriptors and SM count are
  read for); switching costs a few us, so only when it is another."""
  if _current_device() == index:
    return contextlib.nullcontext()
  return torch.cuda.device(index)

