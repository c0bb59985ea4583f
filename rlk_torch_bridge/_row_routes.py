"""The row mean's and sum's native routes (``_row_mean_op`` chooses): the
cuda_ffi library's row kernel, through the C++ extension's operator
(``rlk::row_reduce_sm90``) or through ctypes where that does not load, and
Triton's row kernel (``triton_kernels.row_sum``), each on torch's current
stream on the rows' device."""

from __future__ import annotations

import functools

import torch

from rlk_torch_bridge import _cpp_extension
from rlk_torch_bridge._checks import start_jax
from rlk_torch_bridge._torch_stream import on_device


@functools.cache
def triton_importable() -> bool:
  from triton_kernels.backend import triton
  return triton is not None


@functools.cache
def library_kernel() -> bool:
  """Whether CUDA rows take the cuda_ffi library's kernel (an SM90 GPU with
  the library; the same condition as det_gemm's SM90 route)."""
  import cuda_ffi
  start_jax()  # the library's check asks JAX for its GPUs
  return cuda_ffi.unavailable_reason("gpu") is None


def _on_rows(x, divisor: int, launch):
  """A row kernel (``launch(rows, out, divisor)``) over x's rows: out in
  x's dtype, shape x.shape[:-1]."""
  rows = x.reshape(-1, x.shape[-1])
  rows = rows if rows.stride(-1) == 1 else rows.contiguous()
  out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
  if rows.shape[0]:
    with on_device(x.device.index):
      launch(rows, out, divisor)
  return out.reshape(x.shape[:-1])


def _library_launch(rows, out, divisor):
  import cuda_ffi
  cuda_ffi.launch_row_reduce(
      torch.cuda.current_stream().cuda_stream, rows.data_ptr(),
      out.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
      float(divisor), str(rows.dtype).removeprefix("torch."))


def through_ctypes(x, divisor: int):
  """The cuda_ffi row kernel through ctypes (where the C++ extension does
  not load)."""
  return _on_rows(x, divisor, _library_launch)


def library(x, divisor: int):
  """The cuda_ffi row kernel (the C++ decoding route calls it too)."""
  if _cpp_extension.enabled() and _cpp_extension.load():
    return torch.ops.rlk.row_reduce_sm90(x, float(divisor))
  return through_ctypes(x, divisor)


def triton(x, divisor: int):
  from triton_kernels.row_sum import row_mean_torch
  return _on_rows(x, divisor, row_mean_torch)
