"""linear_logp's vocabulary-parallel mode for torch tensors over a process
group: rlk_jax's ``vocab_chunks`` (its order: ``rlk_jax._tree_reduction``).

Each rank holds ``lm_head.weight``'s rows of C/t neighbouring vocabulary
chunks (Megatron's vocab-parallel layout) and the whole hidden states. It
sums its chunks' row statistics in their subtree (rlk_jax's own functions,
through DLPack); the t roots are gathered in rank order (``all_gather``, not
``all_reduce``: the order stays rlk's) and every rank finishes the same tree,
so every rank holds the whole log-probs and entropy, with the bits of one
process with the whole weight, and of rlk_jax's mode. The backward is the
same per chunk: d hidden's f32 subtree roots gathered and summed in the
tree (every rank gets the whole d hidden), d weight this rank's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch

from rlk_jax import _linear_logp, _tree_reduction
from rlk_torch_bridge import _dlpack, _process_group
from rlk_torch_bridge._checks import jax_dtype


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _jax_subtree_stats(impl, chunk_size, with_entropy, local, first, hidden,
                       weight_vh, targets, temps):
  # rlk_jax's weight is [H, V]: this rank's rows of lm_head.weight,
  # transposed.
  stats = _linear_logp.subtree_stats(impl, chunk_size, with_entropy, local,
                                     first, hidden, weight_vh.T, targets,
                                     temps)
  return jnp.stack(stats)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jax_finish(with_entropy, v, roots, targets):
  """The tree's top over the ranks' roots ``[t, 4, N]``, in rank order, and
  the outputs (log-probs, lse, entropy)."""
  stats = _tree_reduction.tree_reduce(
      [tuple(roots[r, i] for i in range(4)) for r in range(roots.shape[0])],
      _tree_reduction.combine_row_stats)
  return _linear_logp._vocab_outputs(stats, with_entropy, targets, v)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _jax_subtree_grads(impl, chunk_size, with_entropy, chunks, local, first,
                       dw_dtype, hidden, weight_vh, *args):
  dh, dw_hv = _linear_logp.subtree_grads(impl, chunk_size, with_entropy,
                                         chunks, local, first, dw_dtype,
                                         hidden, weight_vh.T, *args)
  return dh, dw_hv.T  # [V/t, H], this rank's rows of lm_head.weight


class VocabTreeLogp(torch.autograd.Function):
  """(log-probs, entropy) of rows `hidden [N, H]` against this rank's
  vocabulary rows `weight [V/t, H]` of `group`, in the fixed tree."""

  @staticmethod
  def forward(ctx, hidden, weight, targets, temps, impl, chunk_size,
              with_entropy, chunks, group):
    t, local = _process_group.size(group), chunks // _process_group.size(group)
    first = _process_group.rank(group) * local
    roots = _dlpack.through_jax(
        "linear_logp", impl,
        functools.partial(_jax_subtree_stats, impl, chunk_size, with_entropy,
                          local, first),
        hidden, weight, targets, temps)[0]
    logp, lse, entropy = _dlpack.through_jax(
        "linear_logp", impl,
        functools.partial(_jax_finish, with_entropy, weight.shape[0] * t),
        torch.stack(_process_group.gathered(roots, group)), targets)
    ctx.save_for_backward(hidden, weight, targets, temps, lse, entropy)
    ctx.flags = (impl, chunk_size, with_entropy, chunks, group)
    return logp, entropy

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g_logp, g_entropy):
    hidden, weight, targets, temps, lse, entropy = ctx.saved_tensors
    impl, chunk_size, with_entropy, chunks, group = ctx.flags
    local = chunks // _process_group.size(group)
    zeros = torch.zeros_like(lse)
    g_logp = zeros if g_logp is None else g_logp.float().contiguous()
    g_entropy = (zeros if g_entropy is None or not with_entropy
                 else g_entropy.float().contiguous())
    dh_root, dw = _dlpack.through_jax(
        "linear_logp", impl,
        functools.partial(_jax_subtree_grads, impl, chunk_size, with_entropy,
                          chunks, local, _process_group.rank(group) * local,
                          jax_dtype(weight.dtype)),
        hidden, weight, targets, temps, lse, entropy, g_logp, g_entropy)
    dh = _tree_reduction.tree_sum(_process_group.gathered(dh_root, group)).to(hidden.dtype)
    return dh, dw, None, None, None, None, None, None, None
