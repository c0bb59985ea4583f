"""Small device tables derived from tensors (det_attention's sequence
tables and tile maps, a mixture of experts' groups), remembered while what
they were made from is unchanged.

Why: a model's layers hand every call the same mask, ``cu_seqlens`` or
expert offsets, and the backward gets the same tensors again; each table
costs a few small kernels and their host time, once per layer and
direction otherwise.

What makes a kept table safe to reuse: it is keyed by its sources'
identities and in-place versions (``_version``), held through weak
references (a source that dies takes its entry along), and by the current
stream (a table made on one stream is read in that stream's order only).
Nothing is kept while tracing (torch.compile makes its own tables) or
capturing a CUDA graph (the memory would be the graph's)."""

from __future__ import annotations

import weakref

import torch

from rlk_torch_bridge._torch_stream import current_stream_handle


def keeping(t: torch.Tensor) -> bool:
  """Whether tables made now for calls on `t`'s device may be kept."""
  return not torch.compiler.is_compiling() and not (
      t.is_cuda and torch.cuda.is_current_stream_capturing())


def _stream(t: torch.Tensor):
  return current_stream_handle(t.device.index) if t.is_cuda else None


class Recent:
  """The last `size` tables made from tensor sources."""

  def __init__(self, size: int):
    self._size = size
    self._entries: list = []

  def get(self, like: torch.Tensor, sources, key, make):
    """``make()``, or the table it gave for these `sources` (tensors) and
    `key` (what else it depends on: shapes, say) on `like`'s device and
    stream while the sources are unchanged."""
    if not all(isinstance(x, torch.Tensor) for x in sources) or not keeping(
        like):
      return make()
    key = (key, like.device, _stream(like),
           tuple((id(x), x._version) for x in sources))
    for refs, cached_key, table in self._entries:
      if cached_key == key and all(r() is x for r, x in zip(refs, sources)):
        return table
    table = make()
    self._entries.insert(0, (tuple(weakref.ref(x) for x in sources), key,
                             table))
    del self._entries[self._size:]
    return table


# What is derived from a table (its tile maps), kept with it while it lives
# unchanged.
_DERIVED: dict = {}


def derived(table: torch.Tensor, key, make):
  """``make()``, kept with `table` under `key` (and the current stream)
  while `table` lives unchanged."""
  if not keeping(table):
    return make()
  entry = _DERIVED.get(id(table))
  if not (entry is not None and entry[0]() is table
          and entry[1] == table._version):
    if len(_DERIVED) >= 4096:
      _DERIVED.clear()
    ident = id(table)
    entry = _DERIVED[ident] = (
        weakref.ref(table, lambda _, ident=ident: _forget(ident)),
        table._version, {})
  kept = entry[2]
  key = (key, _stream(table))
  value = kept.get(key)
  if value is None:
    value = kept[key] = make()
  return value


def _forget(ident) -> None:
  entry = _DERIVED.get(ident)
  if entry is not None and entry[0]() is None:
    del _DERIVED[ident]
