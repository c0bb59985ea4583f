"""torch <-> JAX without copies, and the checks every bridged op shares.

Stream order (GPU): ``jax.dlpack.from_dlpack(t)`` hands JAX's stream to
``t.__dlpack__``, and torch makes that stream wait for t's producer;
``torch.from_dlpack(a)`` hands torch's current stream to JAX, which makes it
wait for a's producer. Neither direction blocks the host.

Lifetime: the DLPack capsule holds a reference to the torch storage until
JAX frees its buffer, and JAX frees a buffer only after the computations
reading it finished, so torch's caching allocator cannot hand an input's
memory out while a JAX kernel still reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

_TO_JAX_DTYPE = {
    torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
    torch.float32: jnp.float32, torch.float64: jnp.float64,
    torch.int8: jnp.int8, torch.int16: jnp.int16, torch.int32: jnp.int32,
    torch.int64: jnp.int64, torch.uint8: jnp.uint8, torch.bool: jnp.bool_,
}


def to_jax(t: torch.Tensor) -> jax.Array:
  """A JAX view of `t` (detached; a non-contiguous tensor is copied first)."""
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  return jax.dlpack.from_dlpack(t)


def to_torch(a: jax.Array) -> torch.Tensor:
  return torch.from_dlpack(a)


def jax_dtype(dtype):
  if dtype is None:
    return None
  try:
    return _TO_JAX_DTYPE[dtype]
  except KeyError:
    raise TypeError(f"rlk_torch_bridge: unsupported dtype {dtype}.") from None


def torch_dtype(dtype) -> torch.dtype:
  dtype = jnp.dtype(dtype)
  for t, j in _TO_JAX_DTYPE.items():
    if jnp.dtype(j) == dtype:
      return t
  raise TypeError(f"rlk_torch_bridge: no torch dtype for {dtype}.")


def platform_of(t: torch.Tensor) -> str:
  return "gpu" if t.device.type == "cuda" else "cpu"


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
  devices = {name: t.device for name, t in tensors.items()}
  if len(set(devices.values())) > 1:
    listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
    raise ValueError(f"rlk_torch_bridge.{op}: inputs on different devices: "
                     f"{listed}.")


def check_tensor(op: str, name: str, t) -> None:
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"rlk_torch_bridge.{op}: {name} must be a torch.Tensor, "
                    f"got {type(t).__name__}.")
