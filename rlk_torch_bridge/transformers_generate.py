"""transformers' ``generate`` under :func:`~rlk_torch_bridge.batch_invariant_mode`:
eager decoding runs on the mode's aten route (``_aten_route``) instead of
through the torch-function mode.

Why: an eager decode step is hundreds of small torch calls around a few µs
of GPU work each, so its time is the host's. The torch-function mode sees
every one of those calls in Python, the ones it leaves alone included; the
aten route replaces only its ops, with the same handlers (the same bits).

When: ``generate`` is called with the mode as the innermost torch-function
mode and a forward that will run eagerly. transformers compiles the
forward itself for a compileable cache (a static cache), and a user may
have compiled it; those keep the mode, which torch.compile traces. The
patch is installed once, on the first mode entered after transformers is
imported, and does nothing outside the mode. The aten kernels are
process-wide while such a ``generate`` runs: another thread's products in
that time take det_gemm too (the same values up to rounding, slower).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

_installed = False
_mode_type = None  # the batch-invariant mode's class, given by install
_ABSENT = object()


def _compiled(model, kwargs) -> bool:
  """Whether this ``generate`` call runs a compiled forward."""
  forward = getattr(model, "forward", None)
  if hasattr(forward, "_torchdynamo_orig_callable") or hasattr(
      model, "_orig_mod"):
    return True
  config = kwargs.get("generation_config") or getattr(
      model, "generation_config", None)
  if getattr(config, "disable_compile", False):
    return False
  implementation = kwargs.get("cache_implementation",
                              getattr(config, "cache_implementation", None))
  if implementation not in (None, "dynamic"):
    return True
  cache = kwargs.get("past_key_values")
  return (cache is not None and bool(getattr(cache, "is_compileable", False))
          and type(cache).__name__ != "DynamicCache")


@contextlib.contextmanager
def _experts_kept(model):
  """Keeps a mixture of experts on its grouped product while decoding.

  On a GPU transformers decodes experts on ``batched_mm`` instead
  (``_optimize_model_for_decode``): each token's expert weights gathered
  into a ``[S, N, K]`` copy and one ``bmm`` against the token's column.
  Under the mode that is det_gemm of a one-column product, S times: a
  Qwen3-MoE decoded at 5.5x plain torch's time per token (H200,
  2026-11-29). The grouped product is det_gemm on each expert's rows with
  the weights read in place, the call the prefill and the trainer make:
  the same bits, at a grouped product's cost."""
  name = "_optimize_model_for_decode"
  if not hasattr(model, name):
    yield
    return
  # What the instance held before (a generate inside generate on the same
  # model, transformers' early-exit assistant, sets it again): put back.
  before = vars(model).get(name, _ABSENT)
  setattr(model, name, contextlib.nullcontext)
  try:
    yield
  finally:
    if before is _ABSENT:
      vars(model).pop(name, None)
    else:
      setattr(model, name, before)


@contextlib.contextmanager
def decoding_route(model, kwargs):
  """Runs the block on the aten route if the innermost torch-function mode
  is a batch-invariant mode and the forward runs eagerly; under such a
  mode, compiled or not, experts stay grouped (`_experts_kept`)."""
  depth = torch._C._len_torch_function_stack()
  mode = torch._C._get_function_stack_at(depth - 1) if depth else None
  if _mode_type is None or not isinstance(mode, _mode_type):
    yield
    return
  with _experts_kept(model):
    if _compiled(model, kwargs):
      yield
      return
    popped = torch._C._pop_torch_function_stack()
    try:
      with mode.aten_route():
        yield
    finally:
      torch._C._push_on_torch_function_stack(popped)


def install(mode_type: type) -> None:
  """Wraps ``GenerationMixin.generate`` (once; transformers must be
  imported, as any model class imports it): under a `mode_type` mode (the
  batch-invariant mode, which calls this) its eager decoding takes the aten
  route, and a mixture of experts decodes on its grouped product."""
  global _installed, _mode_type
  _mode_type = mode_type
  if _installed or "transformers.generation.utils" not in sys.modules:
    return
  from transformers.generation import utils
  original = utils.GenerationMixin.generate

  @functools.wraps(original)
  def generate(self, *args, **kwargs):
    with decoding_route(self, kwargs):
      return original(self, *args, **kwargs)

  utils.GenerationMixin.generate = generate
  _installed = True
