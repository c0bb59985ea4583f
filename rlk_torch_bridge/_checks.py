"""The argument checks and dtype names every route of every bridged op
shares (the native kernels' routes and DLPack's alike)."""

from __future__ import annotations

import jax.numpy as jnp
import torch

_TO_JAX_DTYPE = {
    torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
    torch.float32: jnp.float32, torch.float64: jnp.float64,
    torch.int8: jnp.int8, torch.int16: jnp.int16, torch.int32: jnp.int32,
    torch.int64: jnp.int64, torch.uint8: jnp.uint8, torch.bool: jnp.bool_,
}


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
  first, *rest = tensors.values()
  if all(t.device == first.device for t in rest):
    return
  devices = {name: t.device for name, t in tensors.items()}
  if len(set(devices.values())) > 1:
    listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
    raise ValueError(f"rlk_torch_bridge.{op}: inputs on different devices: "
                     f"{listed}.")


def check_tensor(op: str, name: str, t) -> None:
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"rlk_torch_bridge.{op}: {name} must be a torch.Tensor, "
                    f"got {type(t).__name__}.")
