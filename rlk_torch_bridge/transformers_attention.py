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
weights asked for, dropout in training, an unsupported head dim) go to the
function transformers would have used, with a ``BatchInvariantFallthrough``
warning.

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

from rlk_torch_bridge import sdpa
from rlk_torch_bridge._fallthroughs import report_fallthrough
from rlk_torch_bridge.attention import det_attention

COVERED = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")

_active = 0  # how many batch_invariant_mode contexts are open
_installed = False


def _reason(module, query, key, value, attention_mask, dropout, kwargs):
  if kwargs.get("output_attentions"):
    return "output_attentions=True (det_attention returns no weights)"
  if not getattr(module, "is_causal", True):
    return "a non-causal attention module"
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
  reason = _reason(module, query, key, value, attention_mask, dropout, kwargs)
  if reason is not None:
    report_fallthrough(
        f"transformers attention {implementation_name!r}", reason)
    return fallback(module, query, key, value, attention_mask,
                    dropout=dropout, scaling=scaling,
                    sliding_window=sliding_window, softcap=softcap, **kwargs)
  # transformers' SDPA function drops softcap (SDPA has none): keep the
  # model's arithmetic as its implementation defines it.
  if implementation_name == "sdpa":
    softcap = None
  cu = kwargs.get("cu_seq_lens_q")
  if cu is not None:
    out = det_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                        value[0].transpose(0, 1), cu_seqlens=cu,
                        scale=scaling, sliding_window=sliding_window,
                        softcap=softcap)
    return out[None], None
  out = sdpa.attention(query, key, value, attention_mask, scale=scaling, sliding_window=sliding_window,
                       softcap=softcap, position_ids=kwargs.get("position_ids"),
                       check="device")
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
