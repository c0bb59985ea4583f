"""rlk's FFI calls inside XLA's command buffers (CUDA graphs) on a GPU
(`pytest -m gpu`; the dump parser's test runs anywhere): in a jitted program
of det_gemm products, pack, unpack and linear_logp, every custom call (all
of them rlk's) runs inside a command buffer, and the program returns the
bits of op-by-op calls.

XLA (jaxlib 0.11) forms command buffers from the compiled program's thunk
sequence (``CommandBufferConversionPass``), not in HLO: the optimized HLO
no longer shows them. The pass's result is dumped as
``*.thunk_sequence_after_thunk_passes.txt``: each ``kCommandBuffer`` thunk
lists the thunks it captured, indented beneath it; a custom call left out
(a handler without the command-buffer trait, a legacy custom call such as
jax-triton's, a run shorter than ``xla_gpu_graph_min_graph_size``) stays a
top-level ``kCustomCall`` line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import ON_GPU, assert_bitwise_equal, random_array


def on_sm90(test):
  for mark in (
      pytest.mark.gpu,
      pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU"),
      pytest.mark.skipif(ON_GPU and rlk_jax.implementations("det_gemm")[
          "cuda_ffi"] is not None, reason="requires the SM90 cuda_ffi library")):
    test = mark(test)
  return test


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


def test_the_dump_parser_counts_captured_and_left_out_calls():
  sequence = """000: kCommandBuffer
  001: kKernel
  002: kCustomCall
  003: kCustomCall
004: kCustomCall
005: kCommandBuffer
  006: kCustomCall
007: kKernel"""
  assert custom_call_thunks(sequence) == (3, 1)
  assert custom_call_thunks("000: kKernel\n001: kCustomCall") == (0, 1)


def _program_inputs(rng):
  x = random_array(rng, (4, 96, 256), jnp.bfloat16)
  mask = jnp.asarray(rng.random((4, 96)) < 0.6)
  weights = [random_array(rng, (256, 256), jnp.bfloat16) / 16
             for _ in range(6)]
  head = random_array(rng, (256, 4096), jnp.bfloat16) / 16
  targets = jnp.asarray(rng.integers(0, 4096, (4, 96)), jnp.int32)
  return x, mask, weights, head, targets


def _program(x, mask, weights, head, targets):
  packed, info = rlk_jax.pack(x, mask, capacity=384)
  labels = rlk_jax.pack(targets, info, fill_value=-100)[0]
  h = packed
  for w in weights:
    h = rlk_jax.det_gemm(h, w)
  logp = rlk_jax.linear_logp(h, head, labels)
  return rlk_jax.unpack(h, info), logp


@on_sm90
def test_every_rlk_call_runs_in_a_command_buffer_with_op_by_op_bits(rng,
                                                                    tmp_path):
  args = _program_inputs(rng)
  lowered = jax.jit(_program).lower(*args)
  hlo_calls = re.findall(r'custom_call_target="([^"]+)"',
                         lowered.compile().as_text())
  assert hlo_calls and all(t.startswith("rlk_") for t in hlo_calls), hlo_calls
  assert {"rlk_det_gemm_sm90", "rlk_logits_stats"} <= set(hlo_calls)
  compiled = lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
  dumps = sorted(tmp_path.glob("*thunk_sequence_after_thunk_passes.txt"))
  assert dumps, ("no thunk pass changed the program (nothing captured): "
                 f"{sorted(p.name for p in tmp_path.iterdir())[:40]}")
  sequence = max(dumps, key=lambda p: p.stat().st_size).read_text()
  captured, outside = custom_call_thunks(sequence)
  assert outside == 0 and captured >= len(hlo_calls), (
      captured, outside, len(hlo_calls), sequence[:4000])
  jitted = compiled(*args)
  op_by_op = _program(*args)  # eager: each op its own executable
  for got, want in zip(jitted, op_by_op):
    assert_bitwise_equal(np.asarray(got), np.asarray(want))
