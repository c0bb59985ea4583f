"""``rlk_jax.det_attention`` for torch: batch-invariant causal attention in
the same layouts (packed, padded, KV cache, paged KV cache), the same bits
as the JAX op on the same device, as the operators
``torch.ops.rlk.det_attention`` and ``torch.ops.rlk.det_attention_backward``.
"""

from __future__ import annotations

import math

import torch

from rlk_jax import _attention
from rlk_torch_bridge import (_attention_op, _attention_rows, _library,
                              _tables)
from rlk_torch_bridge._checks import check_same_device, check_tensor


def _ints(t, what, device):
  t = torch.as_tensor(t, device=device)
  if t.dtype.is_floating_point or t.dtype == torch.bool:
    raise TypeError(f"det_attention: {what} must be integers, got {t.dtype}")
  return t.to(torch.int32)


def _seqs(layout, q, k, cu_seqlens, mask, kv_lens, kv_start, k_rows):
  """rlk_jax.det_attention's per-sequence description, in torch (batch row
  b's keys from key row ``b * k_rows``); and the padded rows that break
  contiguity (None if none can)."""
  dev = q.device
  if layout == "packed":
    t = q.shape[0]
    if cu_seqlens is None:  # one sequence: a padded batch of one row
      table, = _attention_rows.static_rows(dev, (("padded", 1, t, t),))
      return table, None
    cu = _ints(cu_seqlens, "cu_seqlens", dev)
    if cu.ndim != 1 or cu.shape[0] < 2:
      raise ValueError("det_attention: cu_seqlens must be [B + 1] with B >= 1,"
                       f" got shape {tuple(cu.shape)}")
    start = cu[:-1].clamp(max=t)
    length = cu[1:].clamp(max=t) - start
    return torch.stack([start, length, start, length]), None
  b, s = q.shape[:2]
  if layout == "padded":
    if mask is None:
      table, = _attention_rows.static_rows(dev, (("padded", b, s, k_rows),))
      return table, None
    if tuple(mask.shape) != (b, s) or mask.dtype != torch.bool:
      raise ValueError(f"det_attention: mask must be bool [B, S] = [{b}, {s}],"
                       f" got {mask.dtype} {tuple(mask.shape)}")
    mask = mask.to(dev)
    length = mask.sum(1, dtype=torch.int32)
    first = torch.where(length > 0, mask.int().argmax(1), 0).to(torch.int32)
    cols = torch.arange(s, device=dev)[None]
    contiguous = (mask == ((cols >= first[:, None])
                           & (cols < (first + length)[:, None]))).all(1)
    base = torch.arange(b, dtype=torch.int32, device=dev)
    if not dev.type == "cuda" and not bool(contiguous.all()):
      bad = torch.nonzero(~contiguous)[:, 0].tolist()
      raise ValueError(
          "det_attention: a padded batch's mask must mark one contiguous run "
          f"of tokens per row (left or right padding); rows {bad} have gaps")
    return torch.stack([base * s + first, length, base * k_rows + first,
                        length]), contiguous
  n, s_cache = q.shape[1], k.shape[1]
  kv_lens = _ints(kv_lens, "kv_lens", dev)
  q_start, q_len, k_base = _attention_rows.static_rows(
      dev, (("arange", b, n), ("full", b, n), ("arange", b, k_rows)))
  if kv_start is None:  # a decode step: two small kernels, not a dozen
    if tuple(kv_lens.shape) != (b,):
      raise ValueError(f"det_attention: kv_lens must be [B] = [{b}], got "
                       f"{tuple(kv_lens.shape)}")
    if not dev.type == "cuda" and (bool((kv_lens < n).any()) or bool(
        (kv_lens > s_cache).any())):
      raise ValueError(
          f"det_attention: each sequence needs n={n} <= kv_lens and kv_start "
          f"+ kv_lens <= the cache's {s_cache} slots; got kv_lens "
          f"{kv_lens.tolist()}, kv_start None")
    return torch.stack([q_start, q_len, k_base, kv_lens]), None
  kv_start = _ints(kv_start, "kv_start", dev)
  for name, t in (("kv_lens", kv_lens), ("kv_start", kv_start)):
    if tuple(t.shape) != (b,):
      raise ValueError(f"det_attention: {name} must be [B] = [{b}], got "
                       f"{tuple(t.shape)}")
  if not dev.type == "cuda" and (bool((kv_lens < n).any()) or bool(
      (kv_start + kv_lens > s_cache).any())):
    raise ValueError(
        f"det_attention: each sequence needs n={n} <= kv_lens and kv_start + "
        f"kv_lens <= the cache's {s_cache} slots; got kv_lens "
        f"{kv_lens.tolist()}, kv_start {kv_start.tolist()}")
  return torch.stack([q_start, q_len, k_base + kv_start, kv_lens]), None


# A model's layers hand every call the same mask, cu_seqlens or cache
# lengths: they share one table (and the tile maps kept with it).
_recent_tables = _tables.Recent(8)


def _table(layout, q, k, cu_seqlens, mask, kv_lens, kv_start, k_rows):
  """``_seqs``'s answer, remembered for the tensors it was made from
  (``_tables.Recent``)."""
  sources = tuple(x for x in (cu_seqlens, mask, kv_lens, kv_start)
                  if x is not None)
  make = lambda: _seqs(layout, q, k, cu_seqlens, mask, kv_lens, kv_start,
                       k_rows)
  if not sources:
    return make()
  return _recent_tables.get(q, sources, (layout, q.shape, k.shape, k_rows),
                            make)


def _paged_seqs(q, k, kv_lens, block_tables, kernel_checks: bool):
  """rlk_jax's paged-cache sequences in torch: each sequence's four rows,
  then its block table (``[4 + blocks, B]``); and which sequences are well
  formed (on CUDA not checked on the host: a bad one's rows come back NaN,
  and the kernel reads inside the cache whatever the table says). None
  where `kernel_checks`: the split kernel checks each sequence itself and
  makes a bad one NaN (a decode step's dozen small kernels saved)."""
  dev = q.device
  b, n = q.shape[:2]
  n_blocks, page = k.shape[:2]
  kv_lens = _ints(kv_lens, "kv_lens", dev)
  tables = _ints(block_tables, "block_tables", dev)
  if tuple(kv_lens.shape) != (b,):
    raise ValueError(f"det_attention: kv_lens must be [B] = [{b}], got "
                     f"{tuple(kv_lens.shape)}")
  if tables.ndim != 2 or tables.shape[0] != b or tables.shape[1] < 1:
    raise ValueError(f"det_attention: block_tables must be [B, blocks] = "
                     f"[{b}, >= 1], got {tuple(tables.shape)}")
  q_start, q_len, zeros = _attention_rows.static_rows(
      dev, (("arange", b, n), ("full", b, n), ("full", b, 0)))
  seqs = torch.cat([torch.stack([q_start, q_len, zeros, kv_lens]), tables.T])
  if kernel_checks:
    return seqs, None
  slots = tables.shape[1] * page
  lengths_ok = (kv_lens >= n) & (kv_lens <= slots)
  used = (torch.arange(tables.shape[1], device=dev)[None] * page
          < kv_lens[:, None])
  blocks_ok = ~(used & ((tables < 0) | (tables >= n_blocks))).any(1)
  if dev.type != "cuda":  # (on CUDA: no host sync, as for kv_lens)
    if not bool(lengths_ok.all()):
      raise ValueError(
          f"det_attention: each sequence needs n={n} <= kv_lens <= its "
          f"{tables.shape[1]} blocks x {page} = {slots} slots; got kv_lens "
          f"{kv_lens.tolist()}")
    if not bool(blocks_ok.all()):
      raise ValueError(
          f"det_attention: block_tables name blocks outside the cache's "
          f"{n_blocks} (rows {torch.nonzero(~blocks_ok)[:, 0].tolist()})")
  return seqs, lengths_ok & blocks_ok


def det_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  cu_seqlens=None, info=None, mask=None, kv_lens=None,
                  kv_start=None, block_tables=None,
                  scale: float | None = None,
                  causal: bool = True, sliding_window: int | None = None,
                  softcap: float | None = None, return_lse: bool = False,
                  implementation: str | None = None):
  """Batch-invariant causal attention; arguments, layouts and contract as
  ``rlk_jax.det_attention`` (q, k, v ``[T, H, D]`` packed or ``[B, S, H,
  D]`` padded / against a KV cache; ``info`` is the bridge's ``PackInfo``).
  On CUDA tensors the masks' checks run on the device (a gap in a padded
  row's mask makes that row NaN instead of raising: no host sync)."""
  for name, t in (("q", q), ("k", k), ("v", v)):
    check_tensor("det_attention", name, t)
  check_same_device("det_attention", q=q, k=k, v=v)
  layout, cu_seqlens = _attention.layout_of(q.ndim, cu_seqlens, info, mask,
                                            kv_lens, kv_start,
                                            block_tables=block_tables)
  _attention.check_operands(
      q.shape, k.shape, v.shape,
      tuple(str(x.dtype).removeprefix("torch.") for x in (q, k, v)), layout,
      causal=causal, sliding_window=sliding_window, softcap=softcap)
  hq, d = q.shape[-2:]
  flat = lambda x: x.reshape((-1,) + tuple(x.shape[-2:])).contiguous()
  page = k.shape[1] if layout == "paged cache" else 0
  in_place = layout not in ("packed", "paged cache") and (
      _attention_op.readable_in_place(k, v, implementation))
  if page:
    # (`contiguous`: which sequences are well formed, as for a mask.)
    seqs, contiguous = _paged_seqs(
        q, k, kv_lens, block_tables, q.is_cuda and _attention_op.choose(
            implementation, "gpu") in _attention_op.KERNEL_ROUTES)
  else:
    seqs, contiguous = _table(
        layout, q, k, cu_seqlens, mask, kv_lens, kv_start,
        k.stride(0) // k.stride(1) if in_place else k.shape[1])
  # A paged cache is planned as the contiguous cache of its tables' slots.
  cache_shape = ((q.shape[0], (seqs.shape[0] - 4) * page) + tuple(k.shape[2:])
                 if page else k.shape)
  heads_per_tile, split_chunks = _attention.decode_plan(
      layout, q.shape, cache_shape, hq // k.shape[-2])
  if not in_place:
    k, v = flat(k), flat(v)
  # Rows outside every sequence (a pack's spare capacity, padding) come
  # back 0 with lse -inf; a table known to hold every row has none.
  out, lse = _library.call(
      _attention_op.FORWARD, flat(q), k, v, seqs.contiguous(),
      float(1.0 / math.sqrt(d) if scale is None else scale),
      None if softcap is None else float(softcap),
      None if sliding_window is None else int(sliding_window),
      heads_per_tile, split_chunks,
      (layout == "packed" or mask is not None)
      and not _attention_rows.all_rows_in(seqs),
      implementation, page)
  if contiguous is not None:
    bad = (~contiguous).repeat_interleave(q.shape[1])
    out = out.masked_fill(bad[:, None, None], float("nan"))
    lse = lse.masked_fill(bad[:, None], float("nan"))
  out = out.reshape(q.shape)
  lse = lse.reshape(q.shape[:-1])
  return (out, lse) if return_lse else out
