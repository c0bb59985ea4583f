"""``rlk_jax.batch_invariant_sampler(sampler)``: Tunix's KV-cache sampler
with its prefill and its decode loop under ``batch_invariant``.

Why the whole step and not only the model: the sampler computes each
sampled token's log-prob itself (``log_softmax`` of the step's logits,
after its forbidden-token mask and temperature), outside the model. Left
to XLA, that row's normaliser is summed as a ``[B, V]`` array's shape
decides, while the trainer sums ``[B, T, V]``: the rollout's log-prob and
the trainer's recomputation could differ even with equal logits. Under the
transformation both sums are rlk's row sum, so equal logits give equal
log-probs.

The sampler keeps its two jitted step functions as attributes
(``_compiled_prefill_fn``, ``_compiled_decode_fn``, made in its
``__init__`` from ``_prefill_fn`` and ``_decode_fn``; google-tunix 0.1.7).
They are replaced by the same functions transformed, jitted with the same
donation and static arguments; everything else about the sampler (its
tokenizer, cache, sampling modes, outputs) is Tunix's.
"""

from __future__ import annotations

import functools

import jax

from rlk_jax._batch_invariant import batch_invariant

__all__ = ["batch_invariant_sampler"]

_STEPS = ("_prefill_fn", "_decode_fn", "_compiled_prefill_fn",
          "_compiled_decode_fn")


def batch_invariant_sampler(sampler, *, implementation: str | None = None,
                            attention: str = "det_attention"):
  """Make a ``tunix.generate.sampler.Sampler``'s steps batch-invariant, in
  place, and return it: a prompt's tokens and log-probs do not depend on
  the other prompts of its batch, and equal the trainer's recomputation
  under ``batch_invariant`` bit for bit. `implementation` and `attention`
  are ``batch_invariant``'s (give the trainer the same)."""
  missing = [name for name in _STEPS if not hasattr(sampler, name)]
  if missing:
    raise TypeError(
        f"batch_invariant_sampler takes a Tunix Sampler (google-tunix "
        f"0.1.7's step functions); {type(sampler).__name__} has no "
        f"{', '.join(missing)}")
  prefill_fn, decode_fn = sampler._prefill_fn, sampler._decode_fn

  def prefill(params, state, images=None, echo=True):
    # `echo` decides the traced program (Tunix's jit has it static), so it
    # is bound before the transformation traces the rest.
    step = functools.partial(prefill_fn, echo=echo)
    return batch_invariant(step, implementation=implementation,
                           attention=attention)(params, state, images)

  # Donating the sampling state (argument 1) as Tunix does: its KV cache
  # is updated in place.
  sampler._compiled_prefill_fn = jax.jit(prefill, donate_argnums=(1,),
                                         static_argnames=("echo",))
  sampler._compiled_decode_fn = jax.jit(
      batch_invariant(decode_fn, implementation=implementation,
                      attention=attention),
      donate_argnums=(1,))
  return sampler
