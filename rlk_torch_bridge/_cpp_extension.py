"""The bridge's C++ extension: det_gemm's eager SM90 route with its autograd
in C++ (``rlk::det_mm_sm90``, ``csrc/det_mm_sm90.cpp``; planned in
``_sm90``), the row kernel's operator (``csrc/row_reduce.cpp``) and the C++
kernels of the decoding route (``csrc/aten_route.cpp``, ``_aten_route``),
which replay the forward configs ``_sm90`` planned. The backward's products
launch from C++ on the autograd thread, where the Python
``autograd.Function`` route pays a Python autograd node (about 0.1 ms of
host time per forward + backward on the H100's host;
``docs/torch_bridge.md``). The same kernels, so the same bits.

Built on first use by torch's ``cpp_extension`` against the installed torch
(about a minute, ninja needed, then cached by torch under
``~/.cache/torch_extensions``); where it cannot build, one warning and the
Python route. On by default (H100, 2026-11-23: the same bits as the Python
route, forward +4 µs per call over torch.matmul, forward + backward faster
than torch's); ``RLK_TORCH_CPP_AUTOGRAD=0`` or ``set_enabled(False)`` turns
it off. Eager calls only: traced ones (torch.compile, export) keep
``rlk::det_mm``; a CUDA-graph capture replays a plan made before it (configs
are chosen by measurement, never inside a capture).
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import warnings

import torch

from rlk_torch_bridge._checks import start_jax

ENV = "RLK_TORCH_CPP_AUTOGRAD"
# The products with their autograd, the row kernel, the decoding route's
# aten kernels (``csrc/aten_route.cpp``, ``_aten_route``): one extension.
SOURCES = [pathlib.Path(__file__).resolve().parent / "csrc" / name
           for name in ("det_mm_sm90.cpp", "row_reduce.cpp", "aten_route.cpp")]


_switch = [os.environ.get(ENV, "1") != "0"]


def enabled() -> bool:
  """Whether eager CUDA det_gemm calls take this route (on unless
  RLK_TORCH_CPP_AUTOGRAD=0 at import; then :func:`set_enabled`)."""
  return _switch[0]


def set_enabled(on: bool) -> None:
  _switch[0] = bool(on)


def load() -> bool:
  """Builds (once) and loads the operators and hands them the cuda_ffi
  library's entries. False, with one warning, where it cannot; False
  without one while the cuda_ffi library is still building (asked again
  on later calls)."""
  if _load.cache_info().currsize:  # asked on hot paths: settled, cheap
    return _load()
  import cuda_ffi
  start_jax()  # the library's check asks JAX for its GPUs
  if cuda_ffi.unavailable_reason("gpu", wait=False) is not None:
    return False
  return _load()


@functools.cache
def _load() -> bool:
  try:
    import cuda_ffi
    from torch.utils import cpp_extension
    cpp_extension.load(name="rlk_det_mm_sm90",
                       sources=[str(s) for s in SOURCES],
                       extra_cflags=["-O2"], with_cuda=True,
                       is_python_module=False)
    entry = ctypes.cast(cuda_ffi.library().rlk_det_gemm_sm90,
                        ctypes.c_void_p).value
    torch.ops.rlk.set_sm90_entry(entry)
    torch.ops.rlk.set_row_reduce_entry(cuda_ffi.row_reduce_entry())
    torch.library.register_fake("rlk::det_mm_sm90")(_fake)
  except Exception as e:  # noqa: BLE001 - the Python route gives the same bits
    warnings.warn(f"rlk_torch_bridge: the C++ autograd route is unavailable "
                  f"({type(e).__name__}: {e}); det_gemm keeps the Python "
                  f"route (the same kernels and bits)")
    return False
  return True


def _fake(a, b, transpose_b, out_dtype, config, config_da, config_db):
  n = b.shape[0] if transpose_b else b.shape[1]
  return a.new_empty((*a.shape[:-1], n), dtype=out_dtype)


