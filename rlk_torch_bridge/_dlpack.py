"""torch <-> JAX without copies: the route of the ops no native kernel takes.

Stream order (GPU), with no host blocking either way:
- torch -> JAX: JAX adopts a foreign buffer with a "definition event"
  recorded on one of its external-ready streams, and its compute stream waits
  for that event before running anything that reads the buffer. A call makes
  that stream wait once for torch's current stream (an event recorded on
  torch's stream), then adopts its first tensor with the event. The call's
  other tensors, read by the same JAX computation, need no event of their
  own: that computation already waits for everything torch queued before
  the call (each event costs about 40 us of JAX host time on the H100).
- JAX -> torch: torch's current stream waits for the result's definition
  event, i.e. for the JAX computation that wrote it.

Lifetime: XLA's GPU client drops its view of an adopted tensor (and the
reference to torch's storage) as soon as the computation is enqueued, not
when the GPU is done with it. Every bridged op hands its results to torch
before it returns, which makes torch's current stream wait for the JAX
computation; torch's caching allocator reuses a freed block only for work
on the stream it belongs to, so on that stream the reuse runs after the JAX
kernels that read the block. (A tensor allocated on another stream needs
``record_stream``, as for any cross-stream use in torch.)

Speed: ``jax.dlpack.from_dlpack`` and ``torch.from_dlpack`` spend 20-90 us
a tensor in Python (a stream handshake and an event per tensor, an eager
dtype canonicalisation). The bridge calls the two jaxlib DLPack entry points
they are built on directly, with one handshake per call; `FAST_PATH` says
whether this jaxlib has them (else the public functions are used).
"""

from __future__ import annotations

import threading

import jax
import torch

from rlk_torch_bridge._checks import start_jax
from rlk_torch_bridge._torch_stream import current_stream_handle

try:  # The entry points jax.dlpack is built on.
  from jax._src.lib import _jax as _jaxlib
  from jax._src.lib import jaxlib_extension_version
  _to_buffer = _jaxlib.dlpack_managed_tensor_to_buffer
  _to_capsule = _jaxlib.buffer_to_dlpack_managed_tensor
  # 467 added the device-type argument that jax.dlpack passes from then on.
  FAST_PATH = jaxlib_extension_version >= 467
except (ImportError, AttributeError):
  FAST_PATH = False

_KDL_CPU, _KDL_CUDA = 1, 2
_LEGACY_STREAM = 1  # DLPack's name for CUDA's legacy default stream (handle 0)


class _DeviceState(threading.local):
  """Per thread: torch device -> JAX device and a reusable event; raw stream
  handle -> torch stream object."""

  def __init__(self):
    self.jax_device = {}
    self.event = {}
    self.stream = {}


_state = _DeviceState()


def _jax_device(device: torch.device):
  found = _state.jax_device.get(device)
  if found is None:
    if device.type == "cuda":
      start_jax()
      # (a tensor's CUDA device always carries its index)
      found = next(d for d in jax.local_devices(backend="gpu")
                   if d.local_hardware_id == device.index)
    else:
      found = jax.devices("cpu")[0]
    _state.jax_device[device] = found
  return found


def _stream_object(handle: int, index: int):
  """A torch stream object for a raw handle (torch's current stream, or one
  of JAX's), made once: torch.cuda.current_stream() costs ~8 us a call."""
  found = _state.stream.get(handle)
  if found is None:
    current = torch.cuda.current_stream(index)
    found = (current if current.cuda_stream == handle
             else torch.cuda.ExternalStream(handle, device=index))
    _state.stream[handle] = found
  return found


def _jax_stream_waits_for_torch(device: torch.device, jax_device) -> int:
  """Makes one of JAX's external-ready streams wait for torch's current
  stream; returns its handle, to adopt a tensor with an event on it.

  One event serves every call: a wait is bound to the event's most recent
  record at the time the wait is enqueued, so recording it again later does
  not disturb waits already queued."""
  index = device.index
  jax_stream = jax_device.get_stream_for_external_ready_events()
  event = _state.event.get(index)
  if event is None:
    event = _state.event[index] = torch.cuda.Event()
  event.record(_stream_object(current_stream_handle(index), index))
  _stream_object(jax_stream, index).wait_event(event)
  return jax_stream


def _canonical(t: torch.Tensor) -> bool:
  # Without x64 JAX narrows 8-byte dtypes on import (a copy): leave those to
  # the public route, which does exactly that.
  return t.element_size() < 8 or jax.config.jax_enable_x64


def to_jax_all(*tensors: torch.Tensor, one_computation: bool = False
               ) -> tuple[jax.Array, ...]:
  """JAX views of tensors on one device (detached; non-contiguous ones are
  copied first), with one stream handshake for all of them.

  `one_computation`: every returned array is read by the same JAX
  computation (the bridge's ops), so only the first carries the stream
  dependency on torch (see the module docstring)."""
  tensors = [t.detach() if t.is_contiguous() else t.detach().contiguous()
             for t in tensors]
  if not (FAST_PATH and all(map(_canonical, tensors))):
    return tuple(jax.dlpack.from_dlpack(t) for t in tensors)
  device = tensors[0].device
  jax_device = _jax_device(device)
  if device.type != "cuda":
    return tuple(_to_buffer(torch.utils.dlpack.to_dlpack(t), jax_device, None,
                            None, _KDL_CPU) for t in tensors)
  stream = _jax_stream_waits_for_torch(device, jax_device)
  arrays = []
  for i, t in enumerate(tensors):
    carries = i == 0 or not one_computation
    arrays.append(_to_buffer(torch.utils.dlpack.to_dlpack(t), jax_device,
                             stream if carries else None, None, _KDL_CUDA))
  return tuple(arrays)


def to_jax(t: torch.Tensor) -> jax.Array:
  """A JAX view of `t` (detached; a non-contiguous tensor is copied first)."""
  return to_jax_all(t)[0]


def to_torch_all(*arrays: jax.Array) -> tuple[torch.Tensor, ...]:
  """Torch views of single-device JAX arrays; torch's current stream waits
  for each array's producer (no host block)."""
  if not FAST_PATH:
    return tuple(torch.from_dlpack(a) for a in arrays)
  stream = None
  device = arrays[0].device if arrays else None
  if device is not None and device.platform == "gpu":
    # (arrays of one call share a device: the bridge's ops never mix them)
    stream = (current_stream_handle(device.local_hardware_id)
              or _LEGACY_STREAM)
  return tuple(torch.utils.dlpack.from_dlpack(_to_capsule(a, stream=stream))
               for a in arrays)


def to_torch(a: jax.Array) -> torch.Tensor:
  return to_torch_all(a)[0]


def refuse_capture(op: str, implementation: str, device: torch.device) -> None:
  """The JAX route runs on JAX's own stream and allocator: a torch CUDA graph
  cannot capture it. Say so instead of failing inside the capture."""
  if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
    raise RuntimeError(
        f"rlk_torch_bridge.{op}: implementation {implementation!r} runs "
        "through JAX, which a torch CUDA graph cannot capture; on an SM90 GPU "
        "the 'cuda_ffi' implementation launches on torch's stream and can be "
        "captured.")


def through_jax(op: str, implementation: str, fn,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
  """The DLPack route of a bridged op: `fn` (a jitted JAX function: the
  rlk_jax op itself, implementation `implementation`) on JAX views of
  `tensors` (one computation reads them all), its outputs back as torch
  views (a tuple)."""
  refuse_capture(op, implementation, tensors[0].device)
  out = fn(*to_jax_all(*tensors, one_computation=True))
  return to_torch_all(*(out if isinstance(out, (tuple, list)) else (out,)))
