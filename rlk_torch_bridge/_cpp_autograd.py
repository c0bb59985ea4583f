"""det_gemm's eager SM90 route with its autograd in C++ (``rlk::det_mm_sm90``,
``csrc/det_mm_sm90.cpp``): the backward's products launch from C++ on the
autograd thread, where the Python ``autograd.Function`` route pays a Python
autograd node (about 0.1 ms of host time per forward + backward on the
H100's host; ``docs/torch_bridge.md``). The same kernels, so the same bits.
The same extension holds the row kernel's operator (``csrc/row_reduce.cpp``)
and the C++ kernels of the decoding route (``csrc/aten_route.cpp``,
``_aten_route``), which replay the forward configs planned here.

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
import math
import os
import pathlib
import warnings

import torch

from rlk_torch_bridge import _library

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


_PLANS: dict = {}
# Signatures whose products are still on trial (``_in_situ``): their plan
# waits here until every trial has kept a config.
_PENDING: dict = {}


def product(a: torch.Tensor, b: torch.Tensor, transpose_b: bool,
            out_dtype: torch.dtype, implementation: str | None):
  """``run(a, b)`` on the C++ route for this call's signature, or None
  where the route does not apply (another implementation, an empty
  product, a config that needs a workspace, a capture in progress) or not
  yet (a call that records a gradient while the products are on trial:
  the Python route runs the backward's products, where their trials
  time them)."""
  import cuda_ffi
  # The library's generation: kernels a running build adds are taken up.
  key = (a.shape, b.shape, transpose_b, a.dtype, b.dtype, out_dtype,
         implementation, a.device.index, cuda_ffi.generation())
  if key in _PLANS:
    return _PLANS[key]
  if torch.cuda.is_current_stream_capturing():
    return None  # configs are chosen by measurement, outside a capture
  plan = _PENDING.pop(key, None) or _plan(a, b, transpose_b, out_dtype,
                                          implementation)
  if plan is None or plan.settled():
    if len(_PLANS) > 4096:
      _PLANS.clear()
    run = _PLANS[key] = None if plan is None else plan.fixed()
    return run
  if len(_PENDING) > 4096:
    _PENDING.clear()
  _PENDING[key] = plan
  if _library.needs_grad(a, b):
    return None
  return plan.forward_run


def _products(m, n, k, transpose_b, out_f32):
  """(m, n, k, transpose_a, transpose_b, out_f32) of the forward, dA and
  dB products (rlk_jax's VJP, as ``_gemm_op.DetMm.backward`` runs it)."""
  return ((m, n, k, False, transpose_b, out_f32),
          (m, k, n, False, not transpose_b, False),
          (n, k, m, True, False, False) if transpose_b
          else (k, n, m, True, False, False))


class _NotBuilt(Exception):
  """A product's kernel config is still building (cuda_ffi.build)."""


class _Plan:
  """A signature's three products: their configs once their trials have
  kept them (``fixed``), and meanwhile the forward's trial (``forward_run``,
  for calls that record no gradient: they launch the forward alone)."""

  def __init__(self, m, n, k, transpose_b, out_dtype, dtype, device_index,
               linear, products):
    import cuda_ffi
    from rlk_jax import _gemm_tuning
    from rlk_torch_bridge import _in_situ
    self.shape = (m, n, k)
    self.transpose_b, self.out_dtype = transpose_b, out_dtype
    self.dtype, self.device_index, self.linear = dtype, device_index, linear
    self.products = products
    chosen = [_gemm_tuning.choose_config(pm, pn, pk, transpose_a=ta,
                                         transpose_b=tb, out_f32=f32)
              for pm, pn, pk, ta, tb, f32 in products]
    if None in chosen:  # a kernel still building: the Python route for now
      raise _NotBuilt
    self.launchable = all(_in_situ.launchable(*p, c)
                          for p, c in zip(products, chosen))
    self.trials = [_in_situ.trial(*p, c) for p, c in zip(products, chosen)]
    self.codes = [cuda_ffi.CONFIGS[c] for c in chosen]
    forward, launch = self.trials[0], self._launch
    if forward is not None and forward.best is None:
      forward.on_keep.append(self._remember)
      self.forward_run = lambda a, b: forward.run(launch, a, b)
    else:
      self._remember(chosen[0])
      self.forward_run = lambda a, b: launch(a, b, chosen[0])

  def _launch(self, a, b, config):
    import cuda_ffi
    return torch.ops.rlk.det_mm_sm90.default(
        a, b, self.transpose_b, self.out_dtype, cuda_ffi.CONFIGS[config],
        *self.codes[1:])

  def _remember(self, config):
    import cuda_ffi
    # Only once the build is whole: the C++ route never asks Python again,
    # so it would keep a config chosen among part of the kernels.
    if self.linear and cuda_ffi.build_complete():
      # A bias-free nn.Linear's product: the C++ decoding route takes it
      # from now on with this config (csrc/aten_route.cpp).
      torch.ops.rlk.remember_linear(*self.shape, self.dtype,
                                    self.device_index,
                                    cuda_ffi.CONFIGS[config])

  def settled(self) -> bool:
    return all(t is None or t.best is not None for t in self.trials)

  def fixed(self):
    """``run(a, b)`` on the configs kept now (the trials' where they kept
    one: ``choose_config`` reads what they kept)."""
    import cuda_ffi
    from rlk_jax import _gemm_tuning
    configs = [_gemm_tuning.choose_config(pm, pn, pk, transpose_a=ta,
                                          transpose_b=tb, out_f32=f32)
               for pm, pn, pk, ta, tb, f32 in self.products]
    if None in configs:
      return None
    self._remember(configs[0])
    codes = [cuda_ffi.CONFIGS[c] for c in configs]
    op = torch.ops.rlk.det_mm_sm90.default
    transpose_b, out_dtype = self.transpose_b, self.out_dtype
    return lambda a, b: op(a, b, transpose_b, out_dtype, *codes)


def _plan(a, b, transpose_b, out_dtype, implementation):
  from rlk_torch_bridge import _gemm_op
  impl = _gemm_op._choose_for(a, b, False, transpose_b, out_dtype,
                              implementation)
  k = a.shape[-1]
  m, n = math.prod(a.shape[:-1]), b.shape[0] if transpose_b else b.shape[1]
  if impl != "cuda_ffi" or not (m and n and k) or not load():
    return None
  linear = (implementation is None and transpose_b and out_dtype == a.dtype
            and a.dtype in (torch.bfloat16, torch.float16))
  try:
    plan = _Plan(m, n, k, transpose_b, out_dtype, a.dtype, a.device.index,
                 linear, _products(m, n, k, transpose_b,
                                   out_dtype == torch.float32))
  except _NotBuilt:
    return None
  return plan if plan.launchable else None
