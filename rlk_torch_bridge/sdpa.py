"""``F.scaled_dot_product_attention`` calls of causal decoders, on
det_attention: what :func:`batch_invariant_mode` runs for SDPA and for
transformers' attention functions.

SDPA describes which keys a query row sees with ``is_causal`` or a mask;
det_attention with where each sequence's tokens lie. A decoder's mask is
causal, cut by padding (left or right) and perhaps a sliding window, so it
is read back into that description on the device:

- q length == key length (a prefill, a training forward): key j is a token
  iff the mask's diagonal says so (a token always sees itself, padding never
  does); det_attention's padded layout with that row mask.
- q length < key length (a KV-cache step): row i sits at slot
  ``end - n + i``, where ``end`` is one past the last key the last row sees;
  a sequence starts at the first key the last row sees, or, under a sliding
  window that may have cut it, at that slot minus the row's position id.
  det_attention's KV-cache layout.

Why anchoring matters for the bits: det_attention walks key blocks from each
sequence's first key, so a rollout's decode rows get the prefill's bits only
if both anchor at the same token.

The description is then turned back into a mask and compared with the given
one, on the device. Where they differ (a mask that is not causal with
padding and this window) the sequence's rows come back NaN in ``"device"``
checking (no host sync: CUDA graphs and compile keep working), or the call
is refused (``None``) in ``"host"`` checking, which reads one flag back.
"""

from __future__ import annotations

import math
import weakref

import torch

from rlk_jax import _attention
from rlk_torch_bridge import _attention_op, _attention_rows, _cache_step, _library
from rlk_torch_bridge.attention import det_attention


_refusals: dict = {}


def refusal(query, key, value, attn_mask, dropout_p, is_causal,
            enable_gqa) -> str | None:
  """Why det_attention cannot compute this SDPA call (None: it can),
  judged from shapes, dtypes and flags alone (so remembered for them: a
  decoder's layers ask the same question each step)."""
  if torch.compiler.is_compiling():  # traced once; sizes may be symbolic
    return _refusal(query, key, value, attn_mask, dropout_p, is_causal,
                    enable_gqa)
  signature = (query.shape, key.shape, value.shape, query.dtype, key.dtype,
               value.dtype, None if attn_mask is None else attn_mask.shape,
               dropout_p, is_causal, enable_gqa)
  answer = _refusals.get(signature, _refusals)
  if answer is _refusals:
    if len(_refusals) >= 4096:
      _refusals.clear()
    answer = _refusals[signature] = _refusal(
        query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
  return answer


def _refusal(query, key, value, attn_mask, dropout_p, is_causal,
             enable_gqa) -> str | None:
  if dropout_p:
    return f"dropout_p={dropout_p} (det_attention has no dropout)"
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    return (f"q/k/v of ranks {query.ndim}/{key.ndim}/{value.ndim} (det_attention"
            " takes [B, H, S, D])")
  b, hq, n, d = query.shape
  s_k = key.shape[2]
  hk = key.shape[1]
  # One key head broadcasts over the query heads in SDPA itself (Falcon's
  # multi-query attention passes it so): det_attention's GQA of one group.
  if hk != hq and hk != 1 and not enable_gqa:
    return f"{hq} query heads against {hk} key heads without enable_gqa"
  if key.shape[0] != b or value.shape[0] != b:
    return (f"batch sizes q {b}, k {key.shape[0]}, v {value.shape[0]} differ")
  if attn_mask is None and not is_causal and n > 1:
    return "no mask and is_causal=False with several query rows (not causal)"
  if attn_mask is None and is_causal and n != s_k:
    return (f"is_causal with q length {n} != key length {s_k} (SDPA aligns "
            "that mask top-left; a decoder's rows end at the last key)")
  if attn_mask is not None:
    if attn_mask.ndim != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[0] not in (
        1, b) or tuple(attn_mask.shape[2:]) != (n, s_k):
      return (f"a mask of shape {tuple(attn_mask.shape)} (det_attention reads"
              f" [B or 1, 1, {n}, {s_k}])")
    if is_causal:
      return "both a mask and is_causal"
  if key.shape[-1] != d:
    return f"q head dim {d} and k head dim {key.shape[-1]} differ"
  run_d = run_head_dim(d, value.shape[-1])
  if run_d is None:
    return (f"head dims q/k {d}, v {value.shape[-1]} (det_attention takes "
            f"up to {max(_attention.HEAD_DIMS)})")
  try:
    _attention.check_operands(
        (b, n, hq, run_d), (b, s_k, hk, run_d), (b, s_k, hk, run_d),
        tuple(str(x.dtype).removeprefix("torch.") for x in (query, key, value)),
        "padded" if n == s_k else "kv cache")
  except (NotImplementedError, ValueError, TypeError) as e:
    return str(e)
  return None


def run_head_dim(d_qk: int, d_v: int) -> int | None:
  """The head dim det_attention runs a call of these at: the smallest it
  takes that holds both (None: none does). Appended zeros change nothing a
  row computes but its cost: each score gains products of 0 (adding +0 to a
  sum leaves it), and v's zero columns come out 0 and are cut off. So
  Phi-2's 80, GPT-NeoX-20B's 96 and DeepSeek's 192/128 (q and k / v) run,
  a rollout and its trainer padded alike."""
  need = max(d_qk, d_v)
  return next((d for d in _attention.HEAD_DIMS if d >= need), None)


def padded(query, key, value, scale):
  """(q, k, v with head dims det_attention takes, the softmax scale of the
  unpadded head dim, v's own head dim)."""
  d, d_v = query.shape[-1], value.shape[-1]
  run_d = run_head_dim(d, d_v)
  pad = lambda x: (x if x.shape[-1] == run_d else
                   torch.nn.functional.pad(x, (0, run_d - x.shape[-1])))
  return (pad(query), pad(key), pad(value),
          1.0 / math.sqrt(d) if scale is None else scale, d_v)


def _seen_and_hidden(mask: torch.Tensor):
  """A bool or additive float mask as (seen, hidden) bools; hidden is None
  for a bool mask (it is ~seen). Additive entries must be 0 (seen) or very
  negative (hidden); anything else is a bias det_attention cannot add, so
  it is neither and the check fails."""
  if mask.dtype == torch.bool:
    return mask, None
  return mask == 0, mask <= torch.finfo(mask.dtype).min / 2


def _first_true(x: torch.Tensor) -> torch.Tensor:
  """Index of the first True along the last dim (0 where none)."""
  return x.int().argmax(-1)


def _window_rows(cols, slots, window):
  """Keys [slot - window + 1, slot] for each query slot (all keys up to the
  slot without a window): [B, n, S_k] bool."""
  seen = cols[None, None, :] <= slots[:, :, None]
  if window is not None:
    seen &= cols[None, None, :] > slots[:, :, None] - window
  return seen


def attention(query, key, value, attn_mask=None, scale=None, *, sliding_window=None, softcap=None, position_ids=None,
              check="device", implementation=None):
  """SDPA's computation for a causal decoder's call (``refusal`` says
  None), on det_attention: query ``[B, Hq, n, D]``, key and value ``[B,
  Hkv, S, D]``; returns ``[B, n, Hq, D]`` (the layout transformers'
  attention functions return; SDPA's is its transpose). ``check`` is
  ``"device"`` or ``"host"`` (module docstring); with ``"host"`` a mask
  that does not fit gives None. Head dims det_attention does not take run
  padded with zeros (``run_head_dim``)."""
  if not (query.shape[-1] == key.shape[-1] == value.shape[-1]
          and query.shape[-1] in _attention.HEAD_DIMS):
    q, k, v, scale, d_v = padded(query, key, value, scale)
    out = attention(q, k, v, attn_mask, scale, sliding_window=sliding_window,
                    softcap=softcap, position_ids=position_ids, check=check,
                    implementation=implementation)
    return None if out is None else out[..., :d_v]
  b, _, n, _ = query.shape
  s_k = key.shape[2]
  opts = dict(scale=scale, sliding_window=sliding_window, softcap=softcap,
              implementation=implementation)
  if attn_mask is not None and attn_mask.ndim != 2:
    layout, fits, memo = _layout(attn_mask, position_ids, b, n, s_k,
                                 sliding_window, query.device)
    if check == "host":
      # Read back once per mask (every layer of a forward shares it).
      fits_all = memo.get("fits_all")
      if fits_all is None:
        fits_all = memo["fits_all"] = bool(fits.all())
      if not fits_all:
        return None
    if n < s_k:
      step = _step(memo, query, key, value, layout, fits, scale, softcap,
                   sliding_window, implementation)
      if step is not None:
        return step(query, key, value)
  q, k, v = (x.transpose(1, 2) for x in (query, key, value))
  if attn_mask is None:
    if n == s_k:
      return det_attention(q, k, v, **opts)
    # One new row against all keys (refusal admits nothing else here).
    full, = _attention_rows.static_rows(q.device, (("full", b, s_k),))
    if _cache_step.eligible(query, key, value, implementation):
      return _cache_step.run(query, key, value, _cache_step.sequence_table(
          key, n, None, full), scale, softcap, sliding_window)
    return det_attention(q, k, v, kv_lens=full, **opts)
  if attn_mask.ndim == 2:
    return _with_tokens(q, k, v, attn_mask.to(q.device).bool(), opts)
  out = det_attention(q, k, v, **layout, **opts)
  return out.masked_fill(~fits[:, None, None, None], float("nan"))


_NOT_MADE = object()


def _step(memo, query, key, value, layout, fits, scale, softcap, window,
          implementation):
  """The KV-cache step (``_cache_step.Step``) for this call, or None where
  it does not apply (``_cache_step.eligible``; not in a CUDA-graph
  capture, whose allocations belong to the graph). Every layer of a
  forward shares the mask, so each signature's step is made once a
  forward and kept in the mask's memo."""
  if (not query.is_cuda or _library.needs_grad(query, key, value)
      or torch.cuda.is_current_stream_capturing()):
    return None
  signature = ("step", query.shape, query.stride(), key.shape, key.stride(),
               value.shape, value.stride(), query.dtype, key.dtype,
               value.dtype, query.device, scale, softcap, window,
               implementation)
  step = memo.get(signature, _NOT_MADE)
  if step is _NOT_MADE:
    step = memo[signature] = None
    if _cache_step.eligible(query, key, value, implementation):
      step = memo[signature] = _cache_step.Step(
          query, key, value, _cache_step.sequence_table(
              key, query.shape[2], layout["kv_start"], layout["kv_lens"]),
          ~fits[:, None, None, None], scale, softcap, window)
  return step


# The last masks read back: transformers hands every layer of a forward the
# same mask object (one per attention kind: Gemma's sliding and full layers
# alternate), so eager calls read each once per forward, not per layer.
_recent_layouts: list = []
_RECENT = 4


def _layout(attn_mask, position_ids, b, n, s_k, window, device):
  """det_attention's layout arguments for a 4-D mask, whether each
  sequence's mask is the one they imply (bool [B]), and a dict the caller
  may keep what it derives from them in (cleared with the mask)."""
  # Traced, nothing is remembered: and id() of a tensor made inside the
  # graph (transformers' position ids when the caller gives none) is a
  # graph break that made Dynamo skip the model's forward.
  # (Nor an inference tensor: it has no version to key it by.)
  remember = (not torch.compiler.is_compiling()
              and not attn_mask.is_inference())
  if remember:
    key = (b, n, s_k, window, attn_mask._version, id(position_ids))
    for ref, cached_key, cached in _recent_layouts:
      if ref() is attn_mask and cached_key == key:
        return cached
  seen, hidden = (None if m is None else m.expand(b, 1, n, s_k)[:, 0]
                  for m in _seen_and_hidden(attn_mask))
  cols = torch.arange(s_k, device=device)
  if n == s_k:
    tokens = seen.diagonal(dim1=1, dim2=2)
    want = _window_rows(cols, cols.expand(b, n), window) & tokens[:, None, :]
    # Rows that are padding may see anything: their output is 0.
    fits = ~(_differs(seen, hidden, want) & tokens[:, :, None]).any(
        -1).any(-1)
    layout = dict(mask=tokens)
  else:
    last = seen[:, -1]
    end = (s_k - _first_true(last.flip(-1))).to(torch.int32)
    start = _first_true(last).to(torch.int32)
    if window is not None and position_ids is not None:
      pos = position_ids.to(device).expand(b, -1)[:, -1].to(torch.int32)
      start = end - 1 - pos
    slots = (end - n)[:, None] + torch.arange(n, device=device)[None]
    want = (_window_rows(cols, slots, window)
            & (cols[None, None, :] >= start[:, None, None]))
    fits = ~_differs(seen, hidden, want).any(-1).any(-1)
    fits &= last.any(-1) & (end - start >= n) & (start >= 0)
    layout = dict(kv_lens=torch.where(fits, end - start, n),
                  kv_start=torch.where(fits, start, 0))
  result = (layout, fits, {})
  if remember:
    _recent_layouts.insert(0, (weakref.ref(attn_mask), key, result))
    del _recent_layouts[_RECENT:]
  return result


def _differs(seen, hidden, want):
  """Where the mask is not `want` (seen where want says hidden, or, for an
  additive mask, not hidden where want says so). XOR, not ==: Inductor's
  value-range pass fails on == between two bool expressions it derived
  from aranges."""
  differs = seen ^ want
  return differs if hidden is None else differs | ~(hidden ^ want)


def _with_tokens(q, k, v, tokens, opts):
  """A [B, S] token mask (flash-attention's form: 1 = token, padding left
  or right): the sequence is its run of tokens, so nothing is to check
  beyond what det_attention checks itself."""
  b, n = q.shape[:2]
  s_k = k.shape[1]
  if n == s_k:
    return det_attention(q, k, v, mask=tokens, **opts)
  start = _first_true(tokens).to(torch.int32)
  end = (s_k - _first_true(tokens.flip(-1))).to(torch.int32)
  return det_attention(q, k, v, kv_lens=end - start, kv_start=start, **opts)
