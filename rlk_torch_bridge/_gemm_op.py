"""``rlk::det_mm``: rlk_jax's one det_gemm primitive, ``op(a) @ op(b)``, as a
PyTorch operator.

``det_mm(a, b, transpose_a, transpose_b, out_dtype, implementation)``: ``a``
is ``[..., K]`` (or ``[K, M]`` stored transposed), ``b`` is ``[K, N]`` (or
``[N, K]``). The forward and every backward product are calls of this op
with the products and operands of rlk_jax's own VJP (``_det_gemm._matmul_bwd``),
on the implementation the forward ran, so torch's gradients have JAX's bits.
This module holds the op's contract: its schema, fake kernel, autograd and
the choice of implementation (rlk_jax's own plan). The products run on the
implementation chosen in ``_gemm_routes``: on an SM90 GPU ``cuda_ffi``
launches the CUTLASS kernels on torch's stream (capturable in CUDA graphs),
``triton`` launches Triton's kernel there, every other implementation runs
one jitted JAX call through DLPack. Eager CUDA calls take the C++ route
with its autograd where it applies (``det_mm``; ``_sm90``).
"""

from __future__ import annotations

import functools

import jax
import torch

import cuda_ffi
from rlk_jax import _det_gemm
from rlk_torch_bridge import _cpp_extension, _gemm_routes, _library, _sm90
from rlk_torch_bridge._checks import jax_dtype, platform_of

SCHEMA = ("(Tensor a, Tensor b, bool transpose_a, bool transpose_b, "
          "ScalarType out_dtype, str? implementation) -> Tensor")


@functools.lru_cache(maxsize=4096)
def choose(a_shape: tuple, b_shape: tuple, transpose_a: bool,
           transpose_b: bool, dtype: torch.dtype, b_dtype: torch.dtype,
           out_dtype: torch.dtype, implementation: str | None,
           platform: str, generation: int = 0) -> str:
  """Checks a product (rlk_jax's checks and messages) and names the
  implementation that runs it. Cached: it runs on every call; `generation`
  (cuda_ffi.generation()) makes the choice again when a running build
  brings the library or kernels."""
  if not transpose_a:  # the forward: rlk_jax.det_gemm's own plan
    return _det_gemm.plan(
        jax.ShapeDtypeStruct(a_shape, jax_dtype(dtype)),
        jax.ShapeDtypeStruct(b_shape, jax_dtype(b_dtype)),
        out_dtype=jax_dtype(out_dtype), implementation=implementation,
        transpose_b=transpose_b, platform=platform).implementation
  if len(a_shape) != 2 or len(b_shape) != 2:  # backward products only
    raise ValueError(f"rlk::det_mm: a transposed product takes 2-D operands, "
                     f"got a {a_shape} and b {b_shape}.")
  return _det_gemm.TABLE.select(implementation, platform, operands=(
      _det_gemm.product_operands(a_shape, b_shape, True, transpose_b,
                                 jax_dtype(dtype), jax_dtype(out_dtype)))).name


def _choose_for(a, b, transpose_a, transpose_b, out_dtype, implementation):
  """`choose` for tensors. An empty product is checked by the reference,
  which takes any size: its result (zeros, or empty) needs no kernel."""
  a_shape, b_shape = _library.sizes(a), _library.sizes(b)
  if 0 in a_shape + b_shape:
    implementation = "xla"
  return choose(a_shape, b_shape, transpose_a, transpose_b, a.dtype, b.dtype,
                out_dtype, implementation, platform_of(a),
                cuda_ffi.generation())


_PLANS: dict = {}


def _kernel(a, b, transpose_a, transpose_b, out_dtype, implementation):
  key = (a.shape, b.shape, transpose_a, transpose_b, a.dtype, b.dtype,
         out_dtype, implementation, a.is_cuda, cuda_ffi.generation())
  return _gemm_routes.cached(_PLANS, key, a, lambda: _gemm_routes.plan(
      a, b, transpose_a, transpose_b, out_dtype,
      _choose_for(a, b, transpose_a, transpose_b, out_dtype,
                  implementation)))(a, b)


def _fake(a, b, transpose_a, transpose_b, out_dtype, implementation):
  _choose_for(a, b, transpose_a, transpose_b, out_dtype, implementation)
  lead, k, n = _gemm_routes.dims(a.shape, b.shape, transpose_a,
                                  transpose_b)
  torch._check(k == (b.shape[1] if transpose_b else b.shape[0]),
               lambda: f"rlk::det_mm: inner dimensions differ: a {a.shape}, "
                       f"b {b.shape}")
  return a.new_empty((*lead, n), dtype=out_dtype)


class DetMm(torch.autograd.Function):
  """The forward resolves the implementation once; the backward runs
  rlk_jax's four-case VJP products on it (the cotangent cast to a's dtype,
  as JAX does), skipping a gradient no input needs."""

  @staticmethod
  def forward(ctx, a, b, transpose_a, transpose_b, out_dtype, implementation):
    impl = _choose_for(a, b, transpose_a, transpose_b, out_dtype,
                       implementation)
    ctx.save_for_backward(a, b)
    ctx.flags = (transpose_a, transpose_b, impl)
    return _library.below_autograd(OP, a, b, transpose_a, transpose_b,
                                   out_dtype, impl)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    a, b = ctx.saved_tensors
    transpose_a, transpose_b, impl = ctx.flags
    g = g.to(a.dtype)
    product = functools.partial(_library.below_autograd, OP)
    need_a, need_b = ctx.needs_input_grad[:2]
    da = db = None
    if need_a:
      if transpose_a:
        da = product(b, g, transpose_b, True, a.dtype, impl)
      else:
        da = product(g, b, False, not transpose_b, a.dtype, impl)
    if need_b:
      if not transpose_a:  # the rows of a and g, flattened
        a = a.reshape(-1, a.shape[-1])
        g = g.reshape(-1, g.shape[-1])
      if transpose_b:
        db = product(g, a, True, transpose_a, b.dtype, impl)
      else:
        db = product(a, g, not transpose_a, False, b.dtype, impl)
    return da, db, None, None, None, None


OP = _library.define("det_mm", SCHEMA, _kernel, _fake, DetMm,
                     _library.first_args_need_grad(2))


def cpp_run(a: torch.Tensor, b: torch.Tensor, transpose_b: bool,
            out_dtype: torch.dtype, implementation: str | None):
  """``run(a, b)`` on the SM90 C++ route with its autograd for this eager
  CUDA call's signature, or None where that route does not take it
  (``_sm90.cpp_plan``)."""
  key = _sm90.cpp_key(a, b, transpose_b, out_dtype, implementation)
  run = _sm90.cpp_planned(key)
  if run is _sm90.NOT_PLANNED:
    run = _sm90.cpp_plan(key, a, b, transpose_b, out_dtype, implementation,
                         _choose_for(a, b, False, transpose_b, out_dtype,
                                     implementation))
  return run


def det_mm(a: torch.Tensor, b: torch.Tensor, transpose_b: bool,
           out_dtype: torch.dtype, implementation: str | None) -> torch.Tensor:
  """``a @ op(b)``, the public det_gemm's product: on the C++ route where it
  applies (eager CUDA calls whose plan names ``cuda_ffi``), else the
  ``rlk::det_mm`` operator."""
  if (a.is_cuda and _cpp_extension.enabled()
      and not torch.compiler.is_compiling()):
    run = cpp_run(a, b, transpose_b, out_dtype, implementation)
    if run is not None:
      return run(a, b)
  return _library.call(OP, a, b, False, transpose_b, out_dtype,
                       implementation)
