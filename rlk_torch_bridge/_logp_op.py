"""``rlk::linear_logp`` and its backward, ``rlk::linear_logp_backward``:
rlk_jax's linear_logp forward and VJP as PyTorch operators.

The forward returns ``(logp, entropy, lse)`` (lse is the residual the
backward needs; without ``with_entropy`` the entropy is empty, and none of
its work is done); ``temperature`` is f32 ``[N]``, each row's. The backward
returns ``(d hidden, d weight [V, H])`` (the weight's own layout, so
autograd accumulates it without a copy);
``rlk::linear_logp_backward_accumulate`` instead adds d weight, in f32, into
a caller's ``[V, H]`` buffer (micro-batch accumulation) and returns d
hidden. On an
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
from rlk_torch_bridge import _dlpack, _library, _sm90_logp
from rlk_torch_bridge._checks import jax_dtype, platform_of

FORWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, "
                  "Tensor temperature, int chunk_size, bool with_entropy, "
                  "str? implementation) -> (Tensor, Tensor, Tensor)")
_BACKWARD_ARGS = ("(Tensor hidden, Tensor weight, Tensor targets, "
                  "Tensor temperature, Tensor lse, Tensor entropy, "
                  "Tensor g_logp, Tensor g_entropy, int chunk_size, "
                  "bool with_entropy, str implementation")
BACKWARD_SCHEMA = _BACKWARD_ARGS + ") -> (Tensor, Tensor)"
# The micro-batch form: d weight added, in f32, into the caller's buffer.
ACCUMULATE_SCHEMA = (_BACKWARD_ARGS
                     + ", Tensor(a!) weight_grad_accumulator) -> Tensor")


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
def _jax_forward(impl, chunk_size, with_entropy, hidden, weight_hv, targets,
                 temps):
  return _linear_logp._forward(impl, chunk_size, with_entropy, hidden,
                               weight_hv, targets, temps)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _jax_backward(impl, chunk_size, with_entropy, dw_dtype, *args):
  dh, dw_hv = _linear_logp.linear_logp_grads(impl, chunk_size, with_entropy,
                                             *args, dw_dtype=dw_dtype)
  return dh, dw_hv.T  # [V, H], lm_head.weight's layout


def _forward_kernel(hidden, weight, targets, temps, chunk_size, with_entropy,
                    implementation):
  impl = choose(hidden, weight, chunk_size, implementation)
  if impl == "cuda_ffi" and hidden.is_cuda:
    logp, entropy, lse = _sm90_logp.forward(hidden, weight, targets, temps,
                                            chunk_size, with_entropy)
  else:
    logp, lse, entropy = _dlpack.through_jax(
        "linear_logp", impl,
        functools.partial(_jax_forward, impl, chunk_size, with_entropy),
        hidden, weight.t(), targets, temps)
  return logp, _entropy_output(entropy, with_entropy), lse


def _entropy_output(entropy, with_entropy):
  # Not computed, not returned: an empty tensor, not N values to misread.
  return entropy if with_entropy else entropy.new_empty((0,))


def _forward_fake(hidden, weight, targets, temps, chunk_size, with_entropy,
                  implementation):
  n = hidden.shape[0]
  logp, lse = (hidden.new_empty((n,), dtype=torch.float32) for _ in range(2))
  return logp, _entropy_output(torch.empty_like(lse), with_entropy), lse


def _grads(hidden, weight, targets, temps, lse, entropy, g_logp, g_entropy,
           chunk_size, with_entropy, implementation, dw_accumulator=None):
  """(d hidden, d weight [V, H]); with `dw_accumulator` d weight is added
  into it in f32 and None is returned in its place."""
  if implementation == "cuda_ffi" and hidden.is_cuda:
    return _sm90_logp.backward(hidden, weight, targets, temps, lse, entropy,
                               g_logp, g_entropy, chunk_size, with_entropy,
                               dw_accumulator)
  if not with_entropy:  # unread; JAX's routes take N rows
    entropy, g_entropy = lse, torch.zeros_like(lse)
  dw_dtype = None if dw_accumulator is None else jax.numpy.float32
  dh, dw = _dlpack.through_jax(
      "linear_logp", implementation,
      functools.partial(_jax_backward, implementation, chunk_size,
                        with_entropy, dw_dtype),
      hidden, weight.t(), targets, temps, lse, entropy, g_logp, g_entropy)
  if dw_accumulator is None:
    return dh, dw
  dw_accumulator += dw
  return dh, None


def _backward_fake(hidden, weight, *_):
  return torch.empty_like(hidden), weight.new_empty(weight.shape)


def _accumulate_kernel(*args):
  return _grads(*args[:-1], dw_accumulator=args[-1])[0]


def _accumulate_fake(hidden, *_):
  return torch.empty_like(hidden)


class LinearLogp(torch.autograd.Function):
  """The op's autograd. With a `dw_accumulator` (the public function's
  weight_grad_accumulator) the weight's gradient is added into it in the
  backward and autograd gets none for the weight (Megatron's main_grad
  contract)."""

  @staticmethod
  def forward(ctx, hidden, weight, targets, temps, chunk_size, with_entropy,
              implementation, dw_accumulator=None):
    impl = choose(hidden, weight, chunk_size, implementation)
    logp, entropy, lse = _library.below_autograd(
        FORWARD, hidden, weight, targets, temps, chunk_size, with_entropy,
        impl)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, targets, temps, lse, entropy)
    ctx.static = (chunk_size, with_entropy, impl)
    ctx.dw_accumulator = dw_accumulator
    return logp, entropy, lse

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g_logp, g_entropy, _):
    hidden, weight, targets, temps, lse, entropy = ctx.saved_tensors
    # An output nobody used has no cotangent: it contributes zero.
    g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
    g_entropy = torch.zeros_like(entropy) if g_entropy is None else g_entropy
    args = (hidden, weight, targets, temps, lse, entropy,
            g_logp.float().contiguous(), g_entropy.float().contiguous(),
            *ctx.static)
    if ctx.dw_accumulator is not None:
      dh = _library.below_autograd(ACCUMULATE, *args, ctx.dw_accumulator)
      return dh, None, None, None, None, None, None, None
    dh, dw = _library.below_autograd(BACKWARD, *args)
    return dh, dw, None, None, None, None, None, None


FORWARD = _library.define("linear_logp", FORWARD_SCHEMA, _forward_kernel,
                          _forward_fake, LinearLogp,
                          _library.first_args_need_grad(2))
BACKWARD = _library.define("linear_logp_backward", BACKWARD_SCHEMA,
                           _grads, _backward_fake)
ACCUMULATE = _library.define("linear_logp_backward_accumulate",
                             ACCUMULATE_SCHEMA, _accumulate_kernel,
                             _accumulate_fake)
