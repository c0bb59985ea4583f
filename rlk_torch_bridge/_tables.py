"""Small device tables derived from tensors (det_attention's sequence
tables and tile maps, tables of shapes alone), remembered while what they
were made from is unchanged.

Why: a model's layers hand every call the same mask, ``cu_seqlens`` or
shapes, and the backward gets the same tensors again; each table costs a
few small kernels and their host time, once per layer and direction
otherwise.

What makes a kept table safe to reuse:
- it is keyed by its sources' identities and in-place versions
  (``_version``), held through weak references (a source that dies takes
  its entry along), and by device and current stream (a table made on one
  stream is read in that stream's order only);
- what is derived from a table (``derived``) is kept only for tables this
  module made and kept itself: inside an operator the tables a compiled
  graph passes are its own buffers, which Inductor reuses for other values
  without a version bump;
- nothing is kept while tracing (torch.compile makes its own tables), under
  a fake-tensor mode, while capturing a CUDA graph on the device (the
  memory would be the graph's), or from inference tensors (which have no
  version and cannot be saved for a later backward).
"""

from __future__ import annotations

import weakref

import torch

from rlk_torch_bridge._torch_stream import current_stream_handle


def keeping(device: torch.device, inference_ok: bool = False) -> bool:
  """Whether a table made now for calls on `device` may be kept."""
  if torch.compiler.is_compiling() or (
      not inference_ok and torch.is_inference_mode_enabled()):
    return False
  if torch._C._get_dispatch_mode(
      torch._C._TorchDispatchModeKey.FAKE) is not None:
    return False
  if device.type != "cuda":
    return True
  if device.index is None or device.index == torch.cuda.current_device():
    return not torch.cuda.is_current_stream_capturing()
  with torch.cuda.device(device):
    return not torch.cuda.is_current_stream_capturing()


def _stream(device: torch.device):
  if device.type != "cuda":
    return None
  return current_stream_handle(torch.cuda.current_device()
                               if device.index is None else device.index)


# The tables made and kept here, by id: (weak reference, the version their
# derived values were made at, those values). Only these have values kept
# with them (`derived`).
_OWN: dict = {}


def _own(table: torch.Tensor) -> torch.Tensor:
  ident = id(table)
  _OWN[ident] = [weakref.ref(table, lambda _, ident=ident: _drop(ident)),
                 table._version, {}]
  return table


def _drop(ident) -> None:
  entry = _OWN.get(ident)
  if entry is not None and entry[0]() is None:
    del _OWN[ident]


def _entry(table: torch.Tensor):
  entry = _OWN.get(id(table))
  return entry if entry is not None and entry[0]() is table else None


_STATIC: dict = {}


def static(device: torch.device, key, make) -> torch.Tensor:
  """``make()`` (a table of shapes alone), made once per device and stream
  (and made as a normal tensor under inference mode: a later training
  call may save it for its backward)."""
  if not keeping(device, inference_ok=True):
    return make()
  full_key = (str(device), _stream(device), key)
  table = _STATIC.get(full_key)
  if table is None:
    with torch.inference_mode(False):
      table = make()
    if len(_STATIC) < 4096:
      _STATIC[full_key] = _own(table)
  return table


class Recent:
  """The last `size` tables made from tensor sources."""

  def __init__(self, size: int):
    self._size = size
    self._entries: list = []

  def get(self, like: torch.Tensor, sources, key, make):
    """``make()``, or the table it gave for these `sources` (tensors) and
    `key` (what else it depends on: shapes, say) on `like`'s device and
    stream while the sources are unchanged."""
    if (not all(isinstance(x, torch.Tensor) and not x.is_inference()
                for x in sources) or not keeping(like.device)):
      return make()
    key = (key, like.device, _stream(like.device),
           tuple((id(x), x._version) for x in sources))
    for refs, cached_key, table in self._entries:
      if cached_key == key and all(r() is x for r, x in zip(refs, sources)):
        return table
    table = make()
    self._entries.insert(0, (tuple(weakref.ref(x) for x in sources), key,
                             _kept(table)))
    del self._entries[self._size:]
    return table


def _kept(table):
  """Registers the tensors of a kept table as made here."""
  for t in table if isinstance(table, tuple) else (table,):
    if isinstance(t, torch.Tensor):
      _own(t)
  return table


def derived(table: torch.Tensor, key, make):
  """``make()``, kept with `table` under `key` (and the current stream)
  while `table` lives unchanged, if `table` is one this module keeps."""
  entry = _entry(table)
  if entry is None or not keeping(table.device):
    return make()
  if entry[1] != table._version:  # changed in place: made again
    entry[1], entry[2] = table._version, {}
  key = (key, _stream(table.device))
  value = entry[2].get(key)
  if value is None:
    value = entry[2][key] = make()
  return value


def is_kept(table: torch.Tensor) -> bool:
  """Whether `table` is one this module made and keeps."""
  return _entry(table) is not None
