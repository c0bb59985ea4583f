"""``rlk_jax.linear_logp`` for torch: per-token log-probs from hidden states
and ``lm_head.weight``, never holding ``[N, V]`` logits, the same bits as the
JAX op on the same device."""

from __future__ import annotations

import functools

import jax
import torch

import rlk_jax
from rlk_torch_bridge._dlpack import (check_same_device, check_tensor,
                                      platform_of, to_jax_all, to_torch_all)

_STATIC = ("temperature", "chunk_size", "implementation")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _logp_vjp(hidden, weight_hv, targets, *, temperature, chunk_size,
              implementation):
  def f(h, w):
    return rlk_jax.linear_logp(h, w, targets, temperature=temperature,
                               chunk_size=chunk_size, return_entropy=True,
                               implementation=implementation)
  return jax.vjp(f, hidden, weight_hv)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _logp_forward(hidden, weight_hv, targets, *, temperature, chunk_size,
                  implementation):
  return rlk_jax.linear_logp(hidden, weight_hv, targets,
                             temperature=temperature, chunk_size=chunk_size,
                             return_entropy=True, implementation=implementation)


@jax.jit
def _apply(vjp, g_logp, g_entropy):
  return vjp((g_logp, g_entropy))


class _LinearLogp(torch.autograd.Function):

  @staticmethod
  def forward(ctx, hidden, weight, targets, kwargs):
    (logp, entropy), ctx.vjp = _logp_vjp(
        *to_jax_all(hidden, weight.t(), targets,
                    one_computation=True), **kwargs)
    return to_torch_all(logp, entropy)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g_logp, g_entropy):
    grads = to_jax_all(g_logp, g_entropy, one_computation=True)
    dh, dw_hv = to_torch_all(*_apply(ctx.vjp, *grads))
    # The weight is [V, H]: its gradient is the [H, V] one transposed (a view).
    return dh, dw_hv.t(), None, None


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor, *, temperature: float = 1.0,
                chunk_size: int = 8192, return_entropy: bool = False,
                ignore_index: int = -100, implementation: str | None = None):
  """f32 log-probs of `targets` under ``softmax(hidden @ weight.T / T)``.

  `weight` is ``lm_head.weight``, ``[V, H]`` (torch's layout; rlk_jax takes
  ``[H, V]``: the bridge hands JAX a contiguous ``[H, V]`` copy, one weight
  read and write per call). `hidden` is ``[..., H]``, `targets` integer
  ``[...]`` (`ignore_index` gives 0 and no gradient). Gradients flow to
  `hidden` and `weight`.
  """
  for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
    check_tensor("linear_logp", name, t)
  check_same_device("linear_logp", hidden=hidden, weight=weight, targets=targets)
  if weight.ndim != 2:
    raise ValueError(f"rlk_torch_bridge.linear_logp: weight must be "
                     f"lm_head.weight [V, H], got shape {tuple(weight.shape)}.")
  if targets.dtype.is_floating_point or targets.dtype == torch.bool:
    raise TypeError(f"rlk_torch_bridge.linear_logp: targets must be integers, "
                    f"got {targets.dtype}.")
  # Token ids fit int32; JAX without x64 has no int64.
  targets = torch.where(targets == ignore_index, -1, targets).to(torch.int32)
  kwargs = dict(temperature=float(temperature), chunk_size=int(chunk_size),
                implementation=rlk_jax.selected_implementation(
                    "linear_logp", implementation, platform=platform_of(hidden)))
  if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
    logp, entropy = _LinearLogp.apply(hidden, weight, targets, kwargs)
  else:
    logp, entropy = to_torch_all(*_logp_forward(
        *to_jax_all(hidden, weight.t(), targets,
                    one_computation=True), **kwargs))
  return (logp, entropy) if return_entropy else logp
