"""det_gemm's SM90 route: the same compiled CUTLASS kernels the ``cuda_ffi``
JAX implementation calls, so the same bits, launched straight from torch
without the DLPack round trip and the JAX dispatch (the bridge's per-call
cost). Two ways in: ``product_launcher`` (one product, from Python: the
``rlk::det_mm`` operator's kernel and its autograd's products) and
``cpp_plan`` (an eager call's forward and both backward products planned
once, then launched from C++ with their autograd: ``rlk::det_mm_sm90``).
Configs are chosen by the tuning tables and by timing the caller's own
calls (``_in_situ``); every config gives the same bits.

Stream order and lifetime hold by construction: every kernel is enqueued on
torch's current stream and reads and writes torch tensors, so torch's caching
allocator, which is stream-ordered, cannot reuse an input's memory before the
kernel that reads it ran.
"""

from __future__ import annotations

import math

import torch

import cuda_ffi
from rlk_jax import _gemm_tuning
from rlk_torch_bridge import _cpp_extension, _in_situ, _library
from rlk_torch_bridge._torch_stream import current_stream_handle, on_device

def _aligned(t: torch.Tensor) -> torch.Tensor:
  # TMA reads from 16-byte aligned addresses; a view at an odd offset is
  # copied (values unchanged, so bits unchanged).
  t = t.contiguous()
  return t if t.data_ptr() % 16 == 0 else t.clone()


def product_launcher(m: int, n: int, k: int, transpose_a: bool,
                     transpose_b: bool, out_dtype: torch.dtype,
                     config: str = "auto"):
  """``product(a, b) -> op(a) @ op(b)`` for one signature (a and b 2-D
  row-major, on a's device, on torch's current stream), on the named
  kernel config (every config gives the same bits)."""
  launch = cuda_ffi.launcher(m, n, k, transpose_a=transpose_a,
                             transpose_b=transpose_b,
                             out_f32=out_dtype == torch.float32,
                             config=config)

  def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _aligned(a), _aligned(b)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    index = a.device.index
    with on_device(index):
      launch(a.data_ptr(), b.data_ptr(), c.data_ptr(),
             current_stream_handle(index))
    return c
  return product


def planned_product(m: int, n: int, k: int, transpose_a: bool,
                    transpose_b: bool, out_dtype: torch.dtype):
  """``product(a, b)`` (2-D operands) on the config the tables choose, or
  while the caller's first calls time the trial's configs, on each in turn
  (``_in_situ``); None while its kernel is still building
  (``cuda_ffi.build``)."""
  capturing = torch.cuda.is_current_stream_capturing()
  out_f32 = out_dtype == torch.float32
  config = _gemm_tuning.choose_config(
      m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
      out_f32=out_f32, may_tune=not capturing)
  if config is None:
    return None
  trial = None if capturing else _in_situ.trial(
      m, n, k, transpose_a, transpose_b, out_f32, config)
  if trial is None or trial.best is not None:
    return product_launcher(m, n, k, transpose_a, transpose_b, out_dtype,
                            config)
  products = {c: product_launcher(m, n, k, transpose_a, transpose_b,
                                  out_dtype, c)
              for c in trial.configs}
  launch = lambda a, b, c: products[c](a, b)
  return lambda a, b: trial.run(launch, a, b)


# The C++ route (``rlk::det_mm_sm90``): a signature's plan, looked up by
# ``cpp_key`` on every eager call, made by ``cpp_plan`` on a miss.
NOT_PLANNED = object()
_PLANS: dict = {}
# Signatures whose products are still on trial (``_in_situ``): their plan
# waits here until every trial has kept a config.
_PENDING: dict = {}


def cpp_key(a: torch.Tensor, b: torch.Tensor, transpose_b: bool,
            out_dtype: torch.dtype, implementation: str | None) -> tuple:
  # The library's generation: kernels a running build adds are taken up.
  return (a.shape, b.shape, transpose_b, a.dtype, b.dtype, out_dtype,
          implementation, a.device.index, cuda_ffi.generation())


def cpp_planned(key: tuple):
  """The run a signature's settled plan keeps (None: the route does not
  apply), or NOT_PLANNED."""
  return _PLANS.get(key, NOT_PLANNED)


def cpp_plan(key: tuple, a: torch.Tensor, b: torch.Tensor, transpose_b: bool,
             out_dtype: torch.dtype, implementation: str | None, chosen: str):
  """``run(a, b)`` on the C++ route for this call's signature (`chosen`:
  the implementation rlk_jax's plan names for it), or None where the route
  does not apply (another implementation, an empty product, a config that
  needs a workspace, a capture in progress) or not yet (a call that records
  a gradient while the products are on trial: the Python route runs the
  backward's products, where their trials time them)."""
  if torch.cuda.is_current_stream_capturing():
    return None  # configs are chosen by measurement, outside a capture
  plan = _PENDING.pop(key, None) or _plan(a, b, transpose_b, out_dtype,
                                          implementation, chosen)
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
    return torch.ops.rlk.det_mm_sm90.default(
        a, b, self.transpose_b, self.out_dtype, cuda_ffi.CONFIGS[config],
        *self.codes[1:])

  def _remember(self, config):
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


def _plan(a, b, transpose_b, out_dtype, implementation, chosen):
  k = a.shape[-1]
  m, n = math.prod(a.shape[:-1]), b.shape[0] if transpose_b else b.shape[1]
  if chosen != "cuda_ffi" or not (m and n and k) or not _cpp_extension.load():
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
