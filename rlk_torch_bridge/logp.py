"""``rlk_jax.linear_logp`` for torch: per-token log-probs from hidden states
and ``lm_head.weight``, never holding ``[N, V]`` logits, the same bits as the
JAX op on the same device."""

from __future__ import annotations

import torch

import jax

from rlk_jax import _linear_logp
from rlk_torch_bridge import _library, _logp_op
from rlk_torch_bridge._dlpack import check_same_device, check_tensor, jax_dtype


def _spec(t: torch.Tensor, transposed: bool = False) -> jax.ShapeDtypeStruct:
  """What rlk_jax's checks read of a tensor (the weight as JAX's [H, V])."""
  shape = tuple(t.shape)
  return jax.ShapeDtypeStruct(shape[::-1] if transposed else shape,
                              jax_dtype(t.dtype))


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor, *, temperature: float = 1.0,
                chunk_size: int = 8192, return_entropy: bool = False,
                ignore_index: int = -100, implementation: str | None = None):
  """f32 log-probs of `targets` under ``softmax(hidden @ weight.T / T)``.

  `weight` is ``lm_head.weight``, ``[V, H]`` (torch's layout, read in place
  on an SM90 GPU; rlk_jax takes ``[H, V]``, so the other routes hand JAX a
  contiguous ``[H, V]`` copy, one weight read and write per call); its
  gradient comes back in that ``[V, H]`` layout. `hidden` is ``[..., H]``, `targets` integer
  ``[...]`` (`ignore_index` gives 0 and no gradient; any other id outside
  [0, V) gives NaN, or a ValueError naming it where the targets are on the
  CPU, so no device sync). Gradients flow to
  `hidden` and `weight`. Runs as the operators ``torch.ops.rlk.linear_logp``
  and ``torch.ops.rlk.linear_logp_backward``.
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
  if not torch.compiler.is_compiling():  # JAX's dtypes: not for the tracer
    _linear_logp._check(_spec(hidden), _spec(weight, transposed=True),
                        _spec(targets), temperature, chunk_size)
  lead = hidden.shape[:-1]
  v = weight.shape[0]
  if not torch.compiler.is_compiling() and targets.device.type == "cpu":
    _linear_logp.check_target_ids(targets, v, ignore_index,
                                  "rlk_torch_bridge.linear_logp")
  bad = _linear_logp.out_of_range(targets, v, ignore_index)
  # Token ids fit int32; JAX without x64 has no int64.
  targets = torch.where(targets == ignore_index, -1, targets).to(torch.int32)
  logp, entropy, _ = _library.call(
      _logp_op.FORWARD, hidden.reshape(-1, hidden.shape[-1]), weight,
      targets.reshape(-1), float(temperature), int(chunk_size), implementation)
  logp, entropy = logp.view(lead), entropy.view(lead)
  logp = torch.where(bad, torch.nan, logp)
  return (logp, entropy) if return_entropy else logp
