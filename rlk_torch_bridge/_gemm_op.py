"""``rlk::det_mm``: rlk_jax's one det_gemm primitive, ``op(a) @ op(b)``, as a
PyTorch operator.

``det_mm(a, b, transpose_a, transpose_b, out_dtype, implementation)``: ``a``
is ``[..., K]`` (or ``[K, M]`` stored transposed), ``b`` is ``[K, N]`` (or
``[N, K]``). The forward and every backward product are calls of this op
with the products and operands of rlk_jax's own VJP (``_det_gemm._matmul_bwd``),
on the implementation the forward ran, so torch's gradients have JAX's bits.
On an SM90 GPU ``cuda_ffi`` launches the CUTLASS kernels on torch's stream
(capturable in CUDA graphs); every other implementation runs one jitted JAX
call through DLPack.
"""

from __future__ import annotations

import functools
import math

import jax
import torch

import cuda_ffi
from rlk_jax import _det_gemm, _gemm_tuning
from rlk_torch_bridge import _in_situ, _library, _sm90
from triton_kernels import det_matmul as triton_det_matmul
from rlk_torch_bridge._checks import jax_dtype, platform_of
from rlk_torch_bridge._dlpack import to_jax_all, to_torch

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


def _dims(a_shape, b_shape, transpose_a, transpose_b):
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
  # Everything a signature decides (checks, implementation, sizes, the
  # launcher) is worked out once: the eager per-call cost is most of what a
  # small product costs.
  key = (a.shape, b.shape, transpose_a, transpose_b, a.dtype, b.dtype,
         out_dtype, implementation, a.is_cuda, cuda_ffi.generation())
  run = _PLANS.get(key)
  if run is None:
    if len(_PLANS) > 4096:
      _PLANS.clear()
    run = _plan(a, b, transpose_a, transpose_b, out_dtype, implementation)
    # A plan made while recording a CUDA graph chose its kernel config
    # without measuring (tuning never runs inside a capture): kept for this
    # call only, so the next eager call may still tune.
    if not (a.is_cuda and torch.cuda.is_current_stream_capturing()):
      _PLANS[key] = run
  return run(a, b)


def _plan(a, b, transpose_a, transpose_b, out_dtype, implementation):
  """``run(a, b)`` for the signature of this call."""
  lead, k, n = _dims(a.shape, b.shape, transpose_a, transpose_b)
  m = math.prod(lead)
  out_shape = (*lead, n)
  impl = _choose_for(a, b, transpose_a, transpose_b, out_dtype, implementation)
  if not (m and n and k):  # a backward over zero rows, say: an empty sum
    return lambda a, b: a.new_zeros(out_shape, dtype=out_dtype)
  flat = (lambda a: a) if transpose_a or a.ndim == 2 else (
      lambda a: a.reshape(m, k))
  shaped = (lambda c: c) if len(lead) == 1 else (lambda c: c.view(out_shape))
  config = None
  if impl == "cuda_ffi" and a.is_cuda:
    capturing = torch.cuda.is_current_stream_capturing()
    out_f32 = out_dtype == torch.float32
    config = _gemm_tuning.choose_config(
        m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
        out_f32=out_f32, may_tune=not capturing)
    if config is None:
      # Its kernel is still building (cuda_ffi.build): the next
      # implementation meanwhile, which gives the same bits. (The plan is
      # keyed by the library's generation: a later call takes the kernel.)
      impl = _det_gemm.while_building(_det_gemm.product_operands(
          (m, k) if not transpose_a else (k, m), b.shape, transpose_a,
          transpose_b, jax_dtype(a.dtype), jax_dtype(out_dtype))).name
  if config is not None:
    trial = None if capturing else _in_situ.trial(
        m, n, k, transpose_a, transpose_b, out_f32, config)
    if trial is None or trial.best is not None:
      product = _sm90.product_launcher(m, n, k, transpose_a, transpose_b,
                                       out_dtype, config)
      return lambda a, b: shaped(product(flat(a), b))
    # Its first calls time the trial's configs (every one gives the same
    # bits); the trial keeps the fastest.
    products = {c: _sm90.product_launcher(m, n, k, transpose_a, transpose_b,
                                          out_dtype, c)
                for c in trial.configs}
    launch = lambda a, b, c: products[c](a, b)
    return lambda a, b: shaped(trial.run(launch, flat(a), b))
  if impl == "triton" and a.is_cuda:
    # The kernel JAX launches through jax-triton, launched by Triton itself
    # on torch's current stream: one kernel source and specialization, no
    # DLPack.
    config = _gemm_tuning.choose_pallas_config(
        m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
        dtype=jax_dtype(a.dtype))

    def native(a, b):
      out = torch.empty((m, n), dtype=out_dtype, device=a.device)
      triton_det_matmul.matmul_torch(
          flat(a).contiguous(), b.contiguous(), out, transpose_a=transpose_a,
          transpose_b=transpose_b, config=config)
      return shaped(out)
    return native
  jax_out_dtype = jax_dtype(out_dtype)

  def through_jax(a, b):
    _library.refuse_capture("det_gemm", impl, a.device)
    out = _jax_product(impl, transpose_a, transpose_b, jax_out_dtype,
                       *to_jax_all(flat(a), b, one_computation=True))
    return shaped(to_torch(out))
  return through_jax


def _fake(a, b, transpose_a, transpose_b, out_dtype, implementation):
  _choose_for(a, b, transpose_a, transpose_b, out_dtype, implementation)
  lead, k, n = _dims(a.shape, b.shape, transpose_a, transpose_b)
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


def _differentiable(a, b, *_):
  return _library.needs_grad(a, b)


OP = _library.define("det_mm", SCHEMA, _kernel, _fake, DetMm, _differentiable)
