"""What the batch-invariant mode left to torch: said once per (function,
reason) as a warning, and listed by ``fallthroughs()``. Apart from the mode
so the hooks it installs (transformers' attention and generate) report
without importing it."""

from __future__ import annotations

import threading
import warnings

import torch


class BatchInvariantFallthrough(UserWarning):
  """A call the batch-invariant mode left to torch: its bits may depend on
  the batch."""


_reported: set = set()
_reported_lock = threading.Lock()


def fallthroughs() -> frozenset:
  """(function, reason) of every call the mode has left to torch in this
  process."""
  with _reported_lock:
    return frozenset(_reported)


def report_fallthrough(name: str, reason: str) -> None:
  """Says once per (name, reason) that the mode left a call to torch."""
  if torch.compiler.is_compiling():  # said by the eager call, not traced
    return
  with _reported_lock:
    if (name, reason) in _reported:
      return
    _reported.add((name, reason))
  warnings.warn(f"rlk_torch_bridge.batch_invariant_mode left {name} "
                f"({reason}) to torch: its rows may depend on the batch.",
                BatchInvariantFallthrough, stacklevel=4)
