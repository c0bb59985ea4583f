"""``rlk_jax.linear_logp`` for torch: per-token log-probs from hidden states
and ``lm_head.weight``, never holding ``[N, V]`` logits, the same bits as the
JAX op on the same device."""

from __future__ import annotations

import torch

import jax

from rlk_jax import _linear_logp, _tree_reduction
from rlk_torch_bridge import (_library, _logp_op, _process_group,
                              _vocab_logp)
from rlk_torch_bridge._checks import check_same_device, check_tensor, jax_dtype


def _spec(t: torch.Tensor, transposed: bool = False) -> jax.ShapeDtypeStruct:
  """What rlk_jax's checks read of a tensor (the weight as JAX's [H, V])."""
  shape = tuple(t.shape)
  return jax.ShapeDtypeStruct(shape[::-1] if transposed else shape,
                              jax_dtype(t.dtype))


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor, *,
                temperature: float | torch.Tensor = 1.0,
                chunk_size: int = 8192, return_entropy: bool = False,
                ignore_index: int = -100, implementation: str | None = None,
                weight_grad_accumulator: torch.Tensor | None = None):
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

  `temperature` is a number or a float tensor broadcastable to the targets'
  shape (per sample, ``[B, 1]`` for ``[B, S]`` targets, or per token), on
  the targets' device; no gradient flows to it (a tensor that requires one
  is refused). Without `return_entropy` no entropy is computed, forward or
  backward. `weight_grad_accumulator`, an f32 tensor of the weight's shape:
  the weight's gradient is added into it, in f32, in the backward (micro-
  batches summed without a bf16 rounding each and without a second
  ``[V, H]`` buffer), and ``weight.grad`` is left alone, as Megatron's
  ``main_grad``; the operator ``torch.ops.rlk.linear_logp_backward_accumulate``.
  """
  lead, bad, targets, temps = _inputs(hidden, weight, targets, temperature,
                                      chunk_size, ignore_index,
                                      weight.shape[0] if weight.ndim else 0)
  if weight_grad_accumulator is not None:
    _check_accumulator(weight, weight_grad_accumulator)
  args = (hidden.reshape(-1, hidden.shape[-1]), weight, targets, temps,
          int(chunk_size), bool(return_entropy), implementation)
  if (weight_grad_accumulator is not None
      and _library.needs_grad(hidden, weight)):
    logp, entropy, _ = _logp_op.LinearLogp.apply(*args,
                                                 weight_grad_accumulator)
  else:
    logp, entropy, _ = _library.call(_logp_op.FORWARD, *args)
  logp = torch.where(bad, torch.nan, logp.view(lead))
  return (logp, entropy.view(lead)) if return_entropy else logp


def vocab_parallel_linear_logp(hidden: torch.Tensor, weight: torch.Tensor,
                               targets: torch.Tensor, group=None, *,
                               vocab_chunks: int,
                               temperature: float | torch.Tensor = 1.0,
                               chunk_size: int = 8192,
                               return_entropy: bool = False,
                               ignore_index: int = -100,
                               implementation: str | None = None):
  """`linear_logp` with the vocabulary split over `group`'s t ranks
  (Megatron's vocab-parallel ``lm_head``): `weight` is this rank's rows of
  ``lm_head.weight``, ``[V/t, H]`` (rank r holds rows ``r V/t .. (r+1) V/t``),
  `hidden` and `targets` (ids in the whole vocabulary) the same on every
  rank. Every rank returns the whole log-probs (and entropy).

  `vocab_chunks` C (a power of two that t divides): rlk_jax's
  ``linear_logp(..., vocab_chunks=C)``. V is cut into C chunks whose row
  statistics combine in one fixed binary tree, each rank the subtree of its
  C/t chunks and the roots gathered in rank order, so the bits are those of
  one process with the whole weight and of the JAX op, at every t. d hidden
  sums the chunks' products in the same tree and comes back whole on every
  rank; d weight is this rank's rows. Runs rlk_jax's functions through
  DLPack. `group` None: one process, the whole weight.
  """
  op = "rlk_torch_bridge.vocab_parallel_linear_logp"
  check_tensor("linear_logp", "weight", weight)
  _tree_reduction.check_power_of_two(vocab_chunks, op, "vocab_chunks")
  t = _process_group.size(group)
  _tree_reduction.check_ranks(vocab_chunks, t, op, "vocab_chunks")
  if weight.ndim != 2:
    raise ValueError(f"{op}: weight must be this rank's rows of "
                     f"lm_head.weight [V/t, H], got shape "
                     f"{tuple(weight.shape)}.")
  local_v = weight.shape[0]
  if local_v * t % vocab_chunks or local_v % (vocab_chunks // t):
    raise ValueError(
        f"{op}: this rank's {local_v} vocabulary rows (weight "
        f"{tuple(weight.shape)}) of V={local_v * t} over {t} ranks must hold "
        f"whole chunks: vocab_chunks={vocab_chunks} must divide V.")
  lead, bad, targets, temps = _inputs(hidden, weight, targets, temperature,
                                      chunk_size, ignore_index, local_v * t)
  hidden2 = hidden.reshape(-1, hidden.shape[-1])
  width = local_v * t // vocab_chunks
  chunk_size = min(int(chunk_size), width)
  impl = _logp_op.choose(hidden2, weight[:width], chunk_size, implementation)
  logp, entropy = _vocab_logp.VocabTreeLogp.apply(
      hidden2, weight, targets, temps, impl, chunk_size, bool(return_entropy),
      vocab_chunks, group)
  logp = torch.where(bad, torch.nan, logp.view(lead))
  return (logp, entropy.view(lead)) if return_entropy else logp


def _inputs(hidden, weight, targets, temperature, chunk_size, ignore_index, v):
  """The checks every linear_logp entry makes (`v`: the whole vocabulary),
  and its operands as the kernels take them: (the rows' shape, where a
  target is out of range, int32 targets [N] with ignored ones -1, f32
  temperatures [N])."""
  for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
    check_tensor("linear_logp", name, t)
  check_same_device("linear_logp", hidden=hidden, weight=weight, targets=targets)
  if weight.ndim != 2:
    raise ValueError(f"rlk_torch_bridge.linear_logp: weight must be "
                     f"lm_head.weight [V, H], got shape {tuple(weight.shape)}.")
  if weight.dtype != hidden.dtype:
    raise TypeError(f"rlk_torch_bridge.linear_logp: weight ({weight.dtype}) "
                    f"must have hidden's dtype ({hidden.dtype}); for an f32 "
                    f"weight gradient pass weight_grad_accumulator.")
  if targets.dtype.is_floating_point or targets.dtype == torch.bool:
    raise TypeError(f"rlk_torch_bridge.linear_logp: targets must be integers, "
                    f"got {targets.dtype}.")
  if not torch.compiler.is_compiling():  # JAX's dtypes: not for the tracer
    _linear_logp._check(_spec(hidden), _spec(weight, transposed=True),
                        _spec(targets), chunk_size)
    _check_temperature(temperature, targets)
  lead = hidden.shape[:-1]
  if not torch.compiler.is_compiling() and targets.device.type == "cpu":
    _linear_logp.check_target_ids(targets, v, ignore_index,
                                  "rlk_torch_bridge.linear_logp")
  bad = _linear_logp.out_of_range(targets, v, ignore_index)
  # Token ids fit int32; JAX without x64 has no int64.
  targets = torch.where(targets == ignore_index, -1, targets).to(torch.int32)
  # A number is filled on the device (no host copy: CUDA-graph capturable).
  temps = (temperature.to(device=targets.device, dtype=torch.float32)
           .expand(lead).reshape(-1)
           if isinstance(temperature, torch.Tensor) else
           torch.full((targets.numel(),), float(temperature),
                      dtype=torch.float32, device=targets.device))
  return lead, bad, targets.reshape(-1), temps


def _check_temperature(temperature, targets):
  op = "rlk_torch_bridge.linear_logp"
  host = None
  if isinstance(temperature, torch.Tensor):
    if temperature.requires_grad:
      raise ValueError(f"{op}: temperature requires grad, but no gradient "
                       "flows to it; pass temperature.detach().")
    check_same_device("linear_logp", temperature=temperature, targets=targets)
    if temperature.device.type == "cpu":
      host = temperature.float().numpy()
  else:
    host = temperature
  _linear_logp.check_temperature(temperature, host, tuple(targets.shape), op)


def _check_accumulator(weight, accumulator):
  if accumulator.dtype != torch.float32 or accumulator.shape != weight.shape:
    raise ValueError(
        f"rlk_torch_bridge.linear_logp: weight_grad_accumulator must be f32 "
        f"of the weight's shape {tuple(weight.shape)}, got "
        f"{accumulator.dtype} {tuple(accumulator.shape)}.")
  check_same_device("linear_logp", weight=weight,
                    weight_grad_accumulator=accumulator)
