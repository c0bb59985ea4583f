"""What XLA did with a jitted program's custom calls: which ran inside its
command buffers (CUDA graphs), read from XLA's thunk dump.

XLA (jaxlib 0.11) forms command buffers from the compiled program's thunk
sequence (``CommandBufferConversionPass``), not in HLO: the optimized HLO
no longer shows them. The pass's result is dumped as
``*.thunk_sequence_after_thunk_passes.txt``: each ``kCommandBuffer`` thunk
lists the thunks it captured, indented beneath it; a custom call left out
(a handler without the command-buffer trait, a legacy custom call such as
jax-triton's, a run shorter than ``xla_gpu_graph_min_graph_size``) stays a
top-level ``kCustomCall`` line.
"""

from __future__ import annotations

import pathlib
import re

_THUNK = re.compile(r"^(\s*)\d+\s*:\s*(k\w+)")


def custom_call_thunks(sequence: str) -> tuple[int, int]:
  """(captured, left out): kCustomCall thunks indented under a
  kCommandBuffer thunk, and those at the top level of the sequence."""
  captured = outside = 0
  in_buffer = False
  for line in sequence.splitlines():
    thunk = _THUNK.match(line)
    if not thunk:
      continue
    indent, kind = thunk.groups()
    if not indent:
      in_buffer = kind == "kCommandBuffer"
      outside += kind == "kCustomCall"
    elif kind == "kCustomCall":
      captured += in_buffer
      outside += not in_buffer
  return captured, outside


def thunk_sequence(lowered, dump_dir) -> str | None:
  """Compiles `lowered` (``jax.jit(f).lower(...)``) with XLA's dump in
  `dump_dir` and returns the largest thunk sequence after XLA's thunk
  passes, or None when no pass changed the program (nothing captured)."""
  lowered.compile(compiler_options={"xla_dump_to": str(dump_dir)})
  dumps = sorted(pathlib.Path(dump_dir).glob(
      "*thunk_sequence_after_thunk_passes.txt"))
  if not dumps:
    return None
  return max(dumps, key=lambda p: p.stat().st_size).read_text()
