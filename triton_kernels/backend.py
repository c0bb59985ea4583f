"""Where the @triton.jit kernels can launch: triton for every route,
jax-triton for JAX's."""

from __future__ import annotations

try:
  import triton
  import triton.language as tl
  IMPORT_ERROR = None
except ImportError as e:  # noqa: F841 - reported by unavailable_reason
  triton = tl = None
  IMPORT_ERROR = f"triton is not installed ({e})"

__all__ = ["triton", "tl", "IMPORT_ERROR", "unavailable_reason"]


def unavailable_reason(platform: str) -> str | None:
  """Why the JAX route cannot launch on `platform` (None: it can)."""
  if IMPORT_ERROR:
    return IMPORT_ERROR
  if platform != "gpu":
    return ("jax-triton launches on CUDA GPUs only (the CPU tests run the "
            "kernels in Triton's interpreter from torch)")
  try:
    import jax_triton  # noqa: F401
  except Exception as e:  # noqa: BLE001 - any import failure is the reason
    return f"jax-triton is not importable ({type(e).__name__}: {e})"
  return None
