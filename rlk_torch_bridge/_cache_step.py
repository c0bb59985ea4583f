"""One KV-cache step of det_attention read straight from SDPA's cache
layout, for eager decoding (what ``rlk_torch_bridge.sdpa`` runs when a
transformers model decodes under ``batch_invariant_mode``).

Why a second entry: a decode step's attention is a few µs of GPU work, so
an eager rollout waits on the host. The general path
(``attention.det_attention``) checks its operands, builds the sequence
table and goes through the operator: about ten times SDPA's host time.
Here the kernels read the cache where it lies (the kernels' in-place form,
as the general path's: token stride = the cache's slot stride, head stride
= its head stride, sequence b's first row ``b * batch_stride /
slot_stride``), the caller builds the sequence table once per forward
(every layer shares it) and the kernels launch through
``triton_kernels.backend.Launcher``.

Bits: the same kernels with the same tiles, heads per program and key
chunks as the general path (``decode_plan`` of the same shapes); only the
addresses they read differ. A device test compares the two bitwise.

Eager, gradient-free CUDA calls on the Triton kernels only; the rest (CPU,
torch.compile, autograd, other implementations) take the general path.
"""

from __future__ import annotations

import functools
import math

import torch

from rlk_jax import _attention
from rlk_torch_bridge import (_attention_op, _attention_rows, _library,
                              _row_routes)
from rlk_torch_bridge._torch_stream import on_device


def eligible(query, key, value, implementation) -> bool:
  """Whether this SDPA-layout call (q ``[B, Hq, n, D]``, cache ``[B, Hkv,
  S, D]``) can take the step. Operand checks are the caller's
  (``sdpa.refusal``)."""
  if (not query.is_cuda or query.stride(-1) != 1
      or _library.needs_grad(query, key, value)):
    return False
  return (_attention_op.readable_in_place(
      key.transpose(1, 2), value.transpose(1, 2), implementation)
          and _row_routes.triton_importable())


def sequence_table(key, n: int, kv_start, kv_lens) -> torch.Tensor:
  """det_attention's int32 ``[4, B]`` table (q_start, q_len, k_start,
  k_len) for `n` new rows per sequence against this cache, keys read in
  place. `kv_start` may be None (every sequence starts at slot 0)."""
  b = key.shape[0]
  rows_per_batch = key.stride(0) // key.stride(2)
  q_start, q_len, k_base = _attention_rows.static_rows(
      key.device, (("arange", b, n), ("full", b, n),
                   ("arange", b, rows_per_batch)))
  k_start = k_base if kv_start is None else k_base + kv_start
  return torch.stack([q_start, q_len, k_start, kv_lens.to(torch.int32)])


@functools.lru_cache(maxsize=256)
def _settings(b, n, hq, hkv, d, s_cache, scale, softcap, window):
  """(heads per program, key chunks, config, statics) of a step's shapes
  and attention settings: every layer of a forward asks the same."""
  from triton_kernels import attention as kernels
  hpt, chunks = _attention.decode_plan("kv cache", (b, n, hq, d),
                                       (b, s_cache, hkv, d), hq // hkv)
  statics = kernels.Statics(hq // hkv, d,
                            float(1.0 / math.sqrt(d) if scale is None
                                  else scale),
                            None if softcap is None else float(softcap),
                            None if window is None else int(window))
  return hpt, chunks, kernels.config_for(d), statics


class Step:
  """The step's launches for calls of one signature (shapes, strides,
  dtypes, attention settings) against one sequence table: every layer of
  a decoder's forward. Made once a forward (``sdpa`` keeps it with the
  mask it read the table from), it leaves a layer's call one allocation,
  the launches and, where the mask may not fit, the poisoning of its rows
  (`unfit`: bool [B, 1, 1, 1], or None). `config` and `plan` (heads per
  program, key chunks) default to the device's tiles and ``decode_plan``
  (the interpreter's tests pass theirs)."""

  def __init__(self, query, key, value, seqs, unfit=None, scale=None,
               softcap=None, window=None, config=None, plan=None):
    from triton_kernels import attention as kernels
    b, hq, n, d = query.shape
    hpt, chunks, default_config, statics = _settings(
        b, n, hq, key.shape[1], d, key.shape[2], scale, softcap, window)
    if plan is not None:
      hpt, chunks = plan
    config = config or default_config
    tiles = _attention_rows.decode_tiles(query.device, b, n,
                                       config.tile_rows(True) // hpt)
    self._shape = (b, n, hq, d)
    self._unfit = unfit
    self._lse = torch.empty((b * n, hq), dtype=torch.float32,
                            device=query.device)
    # [B, S, Hkv, D] views: the kernels' in-place form (row b * stride(0)
    # / stride(1) + t), which `sequence_table` counts in.
    self._launch = kernels.PreparedForward(
        self._rows(query), key.transpose(1, 2), value.transpose(1, 2), seqs,
        tiles, statics, config, hpt, chunks)

  def _rows(self, query):
    b, n, hq, d = self._shape
    # n = 1: [B, Hq, D] is a view (token stride = the batch stride).
    return (query[:, :, 0] if n == 1
            else query.transpose(1, 2).reshape(b * n, hq, d))

  def __call__(self, query, key, value) -> torch.Tensor:
    """The step's output ``[B, n, Hq, D]`` (transformers' layout). The
    launches read key and value through the strides of their ``[B, S,
    Hkv, D]`` transposes, which start at the same element (and the lse,
    which nobody reads, goes to one buffer, reused in stream order)."""
    b, n, hq, d = self._shape
    out = torch.empty((b * n, hq, d), dtype=query.dtype, device=query.device)
    with on_device(query.device.index):  # Triton launches on the current one
      self._launch(self._rows(query), key, value, out, self._lse)
    out = out.view(b, n, hq, d)
    return out if self._unfit is None else out.masked_fill_(self._unfit,
                                                             float("nan"))


def run(query, key, value, seqs, scale=None, softcap=None, window=None,
        config=None, plan=None) -> torch.Tensor:
  """One call's step: ``Step(...)(query, key, value)``."""
  return Step(query, key, value, seqs, None, scale, softcap, window, config,
              plan)(query, key, value)
