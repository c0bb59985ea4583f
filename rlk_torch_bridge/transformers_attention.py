"""transformers' attention functions on det_attention, for
:func:`~rlk_torch_bridge.batch_invariant_mode`.

A transformers attention module asks ``ALL_ATTENTION_FUNCTIONS.get_interface``
for the function of its ``config._attn_implementation`` (``"sdpa"``,
``"eager"``, ...) and calls it with itself, q ``[B, Hq, n, D]``, k and v
``[B, Hkv, S, D]`` (GQA not yet repeated), the mask transformers built, and
what the module knows: ``scaling``, ``sliding_window``, ``softcap``.
While the mode is on, ``get_interface`` answers :func:`attention_forward`
for the implementations in ``COVERED``: the model then runs det_attention,
with its window taken from the module (a mask alone cannot say where a
window-cut sequence starts, ``rlk_torch_bridge.sdpa`` explains why that
decides the bits). Calls it cannot take (a non-causal module, attention
weights asked for, dropout in training, a head dim above 256, attention
sinks, chunked attention, a keyword argument it does not know, in eager
code a mask it cannot express) go to the function transformers would have
used, with a ``BatchInvariantFallthrough`` warning: never silently other
arithmetic.

Why patch ``get_interface`` instead of registering an implementation name:
the mode is meant for unmodified models, whose configs name ``"sdpa"`` or
``"eager"``. The patch is installed once, reads one module global (so
torch.compile guards on it and recompiles when the mode is toggled) and is
process-wide while any thread has the mode on.

Packed sequences (position ids restarting, transformers' flash-attention
kwargs ``cu_seq_lens_q``/``cu_seq_lens_k``) run det_attention's packed
layout on those boundaries.
"""

from __future__ import annotations

import functools

import torch

from rlk_torch_bridge import sdpa
from rlk_torch_bridge._fallthroughs import report_fallthrough
from rlk_torch_bridge.attention import det_attention

COVERED = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")

_active = 0  # how many batch_invariant_mode contexts are open
_installed = False


# The keywords transformers' attention modules pass that leave the
# arithmetic as its named arguments say (bookkeeping, or read below). Any
# other (gpt-oss's attention sinks ``s_aux``, say) could change it, so the
# call goes to the model's own function rather than be silently wrong.
_KNOWN_KEYWORDS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_router_logits",
    "output_attentions", "past_key_values", "past_key_value", "layer_idx",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "is_causal", "target_dtype"})


def _chunk(module) -> int | None:
  """The key chunk of a layer of chunked attention (Llama 4's: each query
  sees only its own chunk's keys, which det_attention does not express);
  None for any other layer."""
  config = getattr(module, "config", None)
  chunk = getattr(config, "attention_chunk_size", None)
  types = getattr(config, "layer_types", None)
  index = getattr(module, "layer_idx", None)
  if chunk is not None and types is not None and index is not None and (
      0 <= index < len(types)):
    return chunk if types[index] == "chunked_attention" else None
  return chunk


def _reason(module, query, key, value, attention_mask, dropout, kwargs):
  if kwargs.get("s_aux") is not None:
    return "attention sinks (s_aux): det_attention has none"
  unknown = sorted(k for k, v in kwargs.items()
                   if k not in _KNOWN_KEYWORDS and v is not None)
  if unknown:
    return f"keyword arguments {unknown} whose effect rlk does not know"
  if kwargs.get("output_attentions"):
    return "output_attentions=True (det_attention returns no weights)"
  if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
    return "a non-causal attention module"
  chunk = _chunk(module)
  if chunk is not None:
    return f"chunked attention (attention_chunk_size={chunk})"
  if dropout and getattr(module, "training", False):
    return f"attention dropout {dropout} in training"
  packed = kwargs.get("cu_seq_lens_q") is not None
  if packed:
    if query.shape[0] != 1:
      return "cu_seq_lens_q with a batch of more than one row"
    mask = None
  elif attention_mask is not None and attention_mask.ndim == 2:
    mask = None  # flash-attention's [B, S] token mask, read below
  else:
    mask = attention_mask
  return sdpa.refusal(query, key, value, mask, 0.0,
                      mask is None and query.shape[2] > 1, True)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                      scaling=None, sliding_window=None, softcap=None, *,
                      fallback, implementation_name, **kwargs):
  """A transformers attention function on det_attention: returns
  ``(out [B, n, Hq, D], None)``."""
  def model_function(reason):
    report_fallthrough(
        f"transformers attention {implementation_name!r}", reason)
    return fallback(module, query, key, value, attention_mask,
                    dropout=dropout, scaling=scaling,
                    sliding_window=sliding_window, softcap=softcap, **kwargs)

  reason = _reason(module, query, key, value, attention_mask, dropout, kwargs)
  if reason is not None:
    return model_function(reason)
  # transformers' SDPA function drops softcap (SDPA has none): keep the
  # model's arithmetic as its implementation defines it.
  if implementation_name == "sdpa":
    softcap = None
  cu = kwargs.get("cu_seq_lens_q")
  if cu is not None:
    q, k, v, scale, d_v = sdpa.padded(query, key, value, scaling)
    out = det_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                        v[0].transpose(0, 1), cu_seqlens=cu,
                        scale=scale, sliding_window=sliding_window,
                        softcap=softcap)
    return out[None, ..., :d_v], None
  # Eager calls check the mask on the host and leave one det_attention
  # cannot express to the model's function; traced ones check on the device
  # (NaN rows where it does not fit), as the SDPA handler does.
  out = sdpa.attention(query, key, value, attention_mask, scale=scaling, sliding_window=sliding_window,
                       softcap=softcap, position_ids=kwargs.get("position_ids"),
                       check="device" if torch.compiler.is_compiling() else "host")
  if out is None:
    return model_function("a mask that is not causal with padding and the "
                          "module's window")
  return out, None


def _install() -> None:
  global _installed
  if _installed:
    return
  from transformers import modeling_utils
  interface = modeling_utils.AttentionInterface
  original = interface.get_interface

  def get_interface(self, attn_implementation, default):
    function = original(self, attn_implementation, default)
    if _active and attn_implementation in COVERED:
      return functools.partial(attention_forward, fallback=function,
                               implementation_name=attn_implementation)
    return function

  interface.get_interface = get_interface
  _installed = True


def enter() -> None:
  """The mode opened: redirect (installing the patch if transformers is
  imported; a model module imports it before it can ask)."""
  global _active
  import sys
  if "transformers.modeling_utils" in sys.modules:
    _install()
  _active += 1


def exit() -> None:  # noqa: A001 - the pair of enter
  global _active
  _active = max(0, _active - 1)
