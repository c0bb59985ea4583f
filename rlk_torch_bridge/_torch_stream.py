"""torch's current CUDA device and stream: the device a native kernel
launches on (the cuda_ffi library's entries and Triton's launcher both take
the current device) and the stream handle it launches on, which DLPack's
hand-over also waits for."""

from __future__ import annotations

import contextlib
import functools

import torch

_current_device = (getattr(torch._C, "_cuda_getDevice", None)
                   or torch.cuda.current_device)

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(index: int) -> int:
  """The raw handle of torch's current stream on device `index` (torch's
  private accessor where it exists: torch.cuda.current_stream() costs about
  8 us a call)."""
  if _raw_stream is not None:
    return _raw_stream(index)
  return torch.cuda.current_stream(index).cuda_stream


def on_device(index: int):
  """A context in which `index` is the current CUDA device. The native
  kernels launch on the current device (what the library's TMA descriptors
  and SM count are read for, and where Triton's launcher finds its stream);
  in a process that sees several GPUs it need not be the tensors' (JAX's
  start, another library, the caller may have moved it). Switching costs a
  few us, so only when it is another."""
  if index is None or _current_device() == index:  # (None: not a GPU's)
    return contextlib.nullcontext()
  return torch.cuda.device(index)


def on_device_of(fn):
  """`fn(first, ...)` run with its first argument's GPU as the current
  device (`on_device`)."""
  @functools.wraps(fn)
  def run(first, *args, **kwargs):
    with on_device(first.device.index):
      return fn(first, *args, **kwargs)
  return run
