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
           "interpreted", "cdiv", "next_power_of_2"]


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


def cdiv(a: int, b: int) -> int:
  """Ceiling division for host code (grids): ``triton.cdiv`` is a constexpr
  function in Triton 3.6, ~8 µs a call from the host (H200, 2026-11-29),
  which an eager decode step pays per launch."""
  return -(-a // b)


def tile_bound(rows: int, runs: int, rows_per_tile: int) -> int:
  """Tiles enough, from static sizes alone, for `rows` rows cut into
  `runs` runs of any lengths (det_attention's sequences, a mixture of
  experts' groups), `rows_per_tile` rows a tile: sum ceil(len / r) <=
  rows / r + runs."""
  return max(1, cdiv(rows, rows_per_tile) + runs)


def next_power_of_2(n: int) -> int:
  """The least power of two >= n (1 for n <= 1), for host code:
  ``triton.next_power_of_2`` is a constexpr function, as slow as ``cdiv``'s
  (above) from the host."""
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


def _hooked(hook) -> bool:
  """Whether a Triton launch hook is set (Triton 3.6 keeps an empty
  ``HookChain`` there; older versions None)."""
  return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
  """Launches one ``@triton.jit`` kernel from torch with less host time per
  call than ``kernel[grid](...)``, for eager decode steps whose few-µs
  kernels wait on the host.

  Triton's own launch binds and specialises every argument again on each
  call (``row_sum_torch`` took 22 µs of host time a call on the H200's
  host, 2026-11-26). Here the compiled
  kernel is looked up from a key the caller builds from what decides the
  compilation (its shapes, strides and constexprs) plus each tensor's
  16-byte alignment and each int's 1, 16-divisibility and width (Triton's
  own specialisation), then launched directly: the same binary, the same
  arguments, so the same bits. The first call of a key, the interpreter,
  launch hooks (a profiler) and Triton versions without this interface
  take Triton's own launch.

  ``launcher(grid, key, *args, **constexprs_and_options)``: ``args`` are
  the kernel's non-constexpr parameters, positionally in order; keyword
  arguments are its constexprs and launch options (``num_warps``...).
  ``key`` must name every constexpr and option.
  """

  _MAX_ENTRIES = 1024

  def __init__(self, kernel):
    self.kernel = kernel
    self._compiled: dict = {}

  @staticmethod
  def _specialisation(args) -> tuple:
    spec = []
    for a in args:
      if isinstance(a, int):
        spec.append((a == 1, a % 16 == 0, -2**31 <= a < 2**31))
      elif hasattr(a, "data_ptr"):
        spec.append((a.dtype, a.data_ptr() % 16 == 0))
    return tuple(spec)

  @staticmethod
  def _device() -> int:
    # A compiled kernel's function handle is its GPU's (Triton keeps one
    # per device too): a process driving several GPUs keys them apart.
    import torch
    get = getattr(torch._C, "_cuda_getDevice", None)
    return get() if get is not None and torch.cuda.is_initialized() else -1

  def __call__(self, grid, key, *args, **kwargs):
    knobs = getattr(triton, "knobs", None)
    fast_key = (key, self._specialisation(args), self._device())
    entry = self._compiled.get(fast_key)
    # (Nothing is kept under the interpreter, so entry is None there.)
    if (entry is None or knobs is None
        or _hooked(knobs.runtime.launch_enter_hook)
        or _hooked(knobs.runtime.launch_exit_hook)):
      compiled = self.kernel[grid](*args, **kwargs)
      if entry is None and not interpreted():
        self._remember(fast_key, compiled, len(args), kwargs)
      return
    compiled, tail = entry
    import torch
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    g = tuple(grid) + (1,) * (3 - len(grid))
    compiled.run(g[0], g[1], g[2], stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)

  def launch(self, grid, *args, **kwargs):
    """``__call__`` keyed by every keyword given (constexprs and launch
    options, all of them, so no two compilations share a key): for call
    sites that pass them all by keyword."""
    self(grid, tuple(kwargs.items()), *args, **kwargs)

  def prepared(self, grid, key, scalars, **kwargs):
    """``launch(*tensors)`` for calls that differ from one another in their
    tensor parameters alone (a decode step's layers: the same shapes and
    strides, other buffers), which come first in the kernel's signature.
    The scalars after them, the grid and the constexprs are fixed here,
    and the scalars' specialisation is worked out once; each call still
    checks its tensors' (dtype, alignment) and any launch hook, as
    ``__call__`` does. Triton reads a tensor argument through
    ``data_ptr()`` alone."""
    import torch
    scalars = tuple(scalars)
    scalar_spec = self._specialisation(scalars)
    g = tuple(grid) + (1,) * (3 - len(grid))
    knobs = getattr(triton, "knobs", None)
    current_device = torch.cuda.current_device

    def launch(*tensors):
      entry = self._compiled.get(
          (key, self._specialisation(tensors) + scalar_spec, self._device()))
      if (entry is None or knobs is None
          or _hooked(knobs.runtime.launch_enter_hook)
          or _hooked(knobs.runtime.launch_exit_hook)):
        return self(grid, key, *tensors, *scalars, **kwargs)
      compiled, tail = entry
      stream = torch._C._cuda_getCurrentRawStream(current_device())
      compiled.run(g[0], g[1], g[2], stream,
                   compiled.function, compiled.packed_metadata, None, None,
                   None, *tensors, *scalars, *tail)
    return launch

  def _remember(self, fast_key, compiled, n_args, kwargs):
    # The launcher takes every parameter in signature order (it skips the
    # constexprs' values): the keyword ones follow the positional ones.
    names = getattr(self.kernel, "arg_names", None)
    if (names is None or not hasattr(compiled, "packed_metadata")
        or len(self._compiled) >= self._MAX_ENTRIES
        or any(n not in kwargs for n in names[n_args:])):
      return
    self._compiled[fast_key] = (compiled,
                                tuple(kwargs[n] for n in names[n_args:]))
