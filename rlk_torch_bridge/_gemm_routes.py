"""det_gemm's products on an implementation already chosen: the SM90 kernels
(``_sm90``), Triton's (``_triton_native``) or rlk_jax's own through DLPack
(``_dlpack``). Every route runs the kernel rlk_jax's implementation of that
name runs, so each gives that implementation's bits. Used by the
``rlk::det_mm`` operator (``_gemm_op``) and by linear_logp's SM90 route."""

from __future__ import annotations

import functools
import math

import jax
import torch

import cuda_ffi
from rlk_jax import _det_gemm
from rlk_torch_bridge import _dlpack, _sm90, _triton_native
from rlk_torch_bridge._checks import jax_dtype


def dims(a_shape, b_shape, transpose_a, transpose_b):
  """(leading shape of the result, K, N)."""
  lead = (a_shape[1],) if transpose_a else tuple(a_shape[:-1])
  k = a_shape[0] if transpose_a else a_shape[-1]
  n = b_shape[0] if transpose_b else b_shape[1]
  return lead, k, n


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _jax_product(implementation, transpose_a, transpose_b, out_dtype, a, b):
  # rlk_jax's primitive itself (its custom_vjp forward): the JAX op's bits.
  return _det_gemm._matmul(implementation, transpose_a, transpose_b, out_dtype,
                           a, b)


def cached(plans: dict, key, a: torch.Tensor, make):
  """The run `plans` keeps under `key`, made by `make()` on a miss:
  everything a signature decides (checks, implementation, sizes, config,
  launcher) is worked out once, since the eager per-call cost is most of
  what a small product costs."""
  run = plans.get(key)
  if run is None:
    if len(plans) > 4096:
      plans.clear()
    run = make()
    # A plan made while recording a CUDA graph chose its kernel config
    # without measuring (tuning never runs inside a capture): kept for this
    # call only, so the next eager call may still tune.
    if not (a.is_cuda and torch.cuda.is_current_stream_capturing()):
      plans[key] = run
  return run


_PLANS: dict = {}


def product(a, b, transpose_a, transpose_b, out_dtype, implementation):
  """``op(a) @ op(b)`` on `implementation`, planned once per signature."""
  key = (a.shape, b.shape, transpose_a, transpose_b, a.dtype, b.dtype,
         out_dtype, implementation, a.is_cuda, cuda_ffi.generation())
  return cached(_PLANS, key, a, lambda: plan(
      a, b, transpose_a, transpose_b, out_dtype, implementation))(a, b)


def plan(a, b, transpose_a, transpose_b, out_dtype, implementation):
  """``run(a, b)`` for the signature of this call."""
  lead, k, n = dims(a.shape, b.shape, transpose_a, transpose_b)
  m = math.prod(lead)
  out_shape = (*lead, n)
  if not (m and n and k):  # a backward over zero rows, say: an empty sum
    return lambda a, b: a.new_zeros(out_shape, dtype=out_dtype)
  flat = (lambda a: a) if transpose_a or a.ndim == 2 else (
      lambda a: a.reshape(m, k))
  # Leading dimensions restored in place (``resize_`` of a fresh, packed
  # result to its own size), not by ``view``: det_mm's autograd function
  # would return a view made inside it, which autograd forbids to modify in
  # place (Falcon's ``mlp_output += attention_output`` failed so in
  # training).
  shaped = (lambda c: c) if len(lead) == 1 else (
      lambda c: c.resize_(out_shape) if c.is_contiguous() else
      c.reshape(out_shape))
  impl = implementation
  if impl == "cuda_ffi" and a.is_cuda:
    product = _sm90.planned_product(m, n, k, transpose_a, transpose_b,
                                    out_dtype)
    if product is not None:
      return lambda a, b: shaped(product(flat(a), b))
    # Its kernel is still building (cuda_ffi.build): the next
    # implementation meanwhile, which gives the same bits. (The plan is
    # keyed by the library's generation: a later call takes the kernel.)
    impl = _det_gemm.while_building(_det_gemm.product_operands(
        (m, k) if not transpose_a else (k, m), b.shape, transpose_a,
        transpose_b, jax_dtype(a.dtype), jax_dtype(out_dtype))).name
  if impl == "triton" and a.is_cuda:
    product = _triton_native.product(m, n, k, transpose_a, transpose_b,
                                     a.dtype, out_dtype)
    return lambda a, b: shaped(product(flat(a), b))
  static = (impl, transpose_a, transpose_b, jax_dtype(out_dtype))
  return lambda a, b: shaped(_dlpack.through_jax(
      "det_gemm", impl, functools.partial(_jax_product, *static),
      flat(a), b)[0])
