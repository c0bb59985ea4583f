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


_JAX_STARTED: list[bool] = []


def platform_of(t: torch.Tensor) -> str:
  """"gpu" for a CUDA tensor (after starting JAX's GPU backend the first
  time, keeping torch's current device), else "cpu"."""
  if t.device.type != "cuda":
    return "cpu"
  start_jax()
  return "gpu"


def start_jax() -> None:
  """Starts JAX's backends (once), keeping torch's current CUDA device:
  every bridge path that may be the first to ask JAX something calls this
  first."""
  if _JAX_STARTED or not torch.cuda.is_available():
    return  # (on a machine without CUDA there is no torch device to keep)
  # JAX's GPU backend, started lazily by whatever first asks it something,
  # makes a context on every visible GPU and leaves the last one current:
  # in a process of a multi-GPU job (torchrun: one rank per GPU, every GPU
  # visible) torch's later allocations and NCCL calls would go to that GPU
  # (seen on 4 H200s, 2026-11-28: "Tensor found on device cuda:3 but
  # backend constrained to cuda:0"). Started here, before any bridged op
  # asks, with torch's device set back after.
  import jax
  device = torch.cuda.current_device()
  try:
    jax.devices()
  finally:
    torch.cuda.set_device(device)
  _JAX_STARTED.append(True)


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
