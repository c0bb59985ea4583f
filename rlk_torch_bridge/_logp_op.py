"""``rlk::linear_logp`` and its backward, ``rlk::linear_logp_backward``:
rlk_jax's linear_logp forward and VJP as PyTorch operators.

The forward returns ``(logp, entropy, lse)`` (lse is the residual the
backward needs); the backward returns ``(d hidden, d weight [V, H])`` (the weight's own layout,
so autograd accumulates it without a copy). On an
SM90 GPU the ``cuda_ffi`` implementation launches rlk_jax's kernels itself,
in rlk_jax's order, on torch's stream (``_sm90_logp``: capturable in CUDA
graphs); every other implementation runs rlk_jax's own forward and VJP
functions through one jitted JAX call each (DLPack). Either way the bits are
the JAX op's. ``weight`` is ``lm_head.weight``, ``[V, H]``: the SM90 route
reads it in place; JAX gets a contiguous ``[H, V]`` copy (one weight read
and write per call).
"""

from __future__ import annotations

import functools

import jax
import torch

from rlk_jax import _linear_logp
from rlk_torch_bridge import _library, _sm90_logp
from rlk_torch_bridge._dlpack import (jax_dtype, platform_of, to_jax_all,
                                      to_torch_all)

FORWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, "
                  "float temperature, int chunk_size, str? implementation) "
                  "-> (Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, Tensor lse, "
                   "Tensor entropy, Tensor g_logp, Tensor g_entropy, "
                   "float temperature, int chunk_size, str implementation) "
                   "-> (Tensor, Tensor)")


def choose(hidden, weight, chunk_size, implementation) -> str:
  """rlk_jax's choice for these operands (hidden [N, H], weight [V, H])."""
  (n, _), (v, h) = _library.sizes(hidden), _library.sizes(weight)
  return _choose(n, h, v, hidden.dtype, chunk_size, implementation,
                 platform_of(hidden))


@functools.lru_cache(maxsize=1024)
def _choose(n, h, v, dtype, chunk_size, implementation, platform):
  return _linear_logp.TABLE.select(implementation, platform, operands=(
      n, h, v, jax_dtype(dtype), chunk_size)).name


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jax_forward(impl, temperature, chunk_size, hidden, weight_hv, targets):
  return _linear_logp._forward(impl, temperature, chunk_size, hidden,
                               weight_hv, targets)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jax_backward(impl, temperature, chunk_size, hidden, weight_hv, targets,
                  lse, entropy, g_logp, g_entropy):
  dh, dw_hv = _linear_logp._logp_bwd(impl, temperature, chunk_size,
                                     (hidden, weight_hv, targets, lse,
                                      entropy), (g_logp, g_entropy))[:2]
  return dh, dw_hv.T  # [V, H], lm_head.weight's layout


def _forward_kernel(hidden, weight, targets, temperature, chunk_size,
                    implementation):
  impl = choose(hidden, weight, chunk_size, implementation)
  if impl == "cuda_ffi" and hidden.is_cuda:
    return _sm90_logp.forward(hidden, weight, targets, temperature, chunk_size)
  _library.refuse_capture("linear_logp", impl, hidden.device)
  logp, lse, entropy = _jax_forward(
      impl, temperature, chunk_size,
      *to_jax_all(hidden, weight.t(), targets, one_computation=True))
  logp, entropy, lse = to_torch_all(logp, entropy, lse)
  return logp, entropy, lse


def _forward_fake(hidden, weight, targets, temperature, chunk_size,
                  implementation):
  n = hidden.shape[0]
  return tuple(hidden.new_empty((n,), dtype=torch.float32) for _ in range(3))


def _backward_kernel(hidden, weight, targets, lse, entropy, g_logp, g_entropy,
                     temperature, chunk_size, implementation):
  if implementation == "cuda_ffi" and hidden.is_cuda:
    return _sm90_logp.backward(hidden, weight, targets, lse, entropy, g_logp,
                               g_entropy, temperature, chunk_size)
  _library.refuse_capture("linear_logp", implementation, hidden.device)
  dh, dw = _jax_backward(
      implementation, temperature, chunk_size,
      *to_jax_all(hidden, weight.t(), targets, lse, entropy, g_logp, g_entropy,
                  one_computation=True))
  return to_torch_all(dh, dw)


def _backward_fake(hidden, weight, targets, lse, entropy, g_logp, g_entropy,
                   temperature, chunk_size, implementation):
  return torch.empty_like(hidden), weight.new_empty(weight.shape)


class LinearLogp(torch.autograd.Function):

  @staticmethod
  def forward(ctx, hidden, weight, targets, temperature, chunk_size,
              implementation):
    impl = choose(hidden, weight, chunk_size, implementation)
    logp, entropy, lse = _library.below_autograd(
        FORWARD, hidden, weight, targets, temperature, chunk_size, impl)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)
    ctx.static = (temperature, chunk_size, impl)
    return logp, entropy, lse

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g_logp, g_entropy, _):
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    # An output nobody used has no cotangent: it contributes zero.
    g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
    g_entropy = torch.zeros_like(lse) if g_entropy is None else g_entropy
    dh, dw = _library.below_autograd(
        BACKWARD, hidden, weight, targets, lse, entropy,
        g_logp.float().contiguous(), g_entropy.float().contiguous(),
        *ctx.static)
    return dh, dw, None, None, None, None


def _differentiable(hidden, weight, *_):
  return _library.needs_grad(hidden, weight)


FORWARD = _library.define("linear_logp", FORWARD_SCHEMA, _forward_kernel,
                          _forward_fake, LinearLogp, _differentiable)
BACKWARD = _library.define("linear_logp_backward", BACKWARD_SCHEMA,
                           _backward_kernel, _backward_fake)
