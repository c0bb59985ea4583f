"""Where the @triton.jit kernels can launch: triton for every route,
jax-triton for JAX's."""

from __future__ import annotations

import os

try:
  import triton
  import triton.language as tl
  IMPORT_ERROR = None
except ImportError as e:  # noqa: F841 - reported by unavailable_reason
  triton = tl = None
  IMPORT_ERROR = f"triton is not installed ({e})"

__all__ = ["triton", "tl", "IMPORT_ERROR", "unavailable_reason", "jax_triton",
           "interpreted"]


def jax_triton():
  """The jax_triton module, imported without its side effect on the rest of
  the process: jax-triton 0.3.1 sets ``TRITON_CACHE_DIR=""`` on import (it
  compiles through its own path, which never reads Triton's file cache), and
  with that empty value every later Triton launch from torch fails with
  "Could not create or locate cache dir". The previous value comes back."""
  before = os.environ.get("TRITON_CACHE_DIR")
  import jax_triton as module
  if before is None:
    if os.environ.get("TRITON_CACHE_DIR") == "":
      del os.environ["TRITON_CACHE_DIR"]
  else:
    os.environ["TRITON_CACHE_DIR"] = before
  return module


def interpreted() -> bool:
  """Whether torch launches run in Triton's interpreter (the CPU tests): the
  kernels' ``INTERPRETED`` switch, which replaces what the interpreter
  cannot do the GPU's way."""
  return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(platform: str) -> str | None:
  """Why the JAX route cannot launch on `platform` (None: it can)."""
  if IMPORT_ERROR:
    return IMPORT_ERROR
  if platform != "gpu":
    return ("jax-triton launches on CUDA GPUs only (the CPU tests run the "
            "kernels in Triton's interpreter from torch)")
  try:
    jax_triton()
  except Exception as e:  # noqa: BLE001 - any import failure is the reason
    return f"jax-triton is not importable ({type(e).__name__}: {e})"
  return None
