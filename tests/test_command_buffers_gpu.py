"""rlk's FFI calls inside XLA's command buffers (CUDA graphs) on a GPU
(`pytest -m gpu`; the dump parser's test runs anywhere): in a jitted program
of det_gemm products, pack, unpack and linear_logp and its gradient, every
custom call (all of them rlk's) runs inside a command buffer, and the
program returns the bits of op-by-op calls. How the dump is read:
``benchmarks.xla_dump``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from benchmarks.xla_dump import custom_call_thunks, thunk_sequence
from conftest import ON_GPU, assert_bitwise_equal, random_array


def on_sm90(test):
  for mark in (
      pytest.mark.gpu,
      pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU"),
      pytest.mark.skipif(ON_GPU and rlk_jax.implementations("det_gemm")[
          "cuda_ffi"] is not None, reason="requires the SM90 cuda_ffi library")):
    test = mark(test)
  return test


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
  """A packed forward, the gradient of its log-probs and a PackInfo: every
  rlk FFI call (pack's three, det_gemm's both ways, linear_logp's forward
  and backward)."""
  def loss(weights, head):
    packed, info = rlk_jax.pack(x, mask, capacity=384)
    labels = rlk_jax.pack(targets, info, fill_value=-100)[0]
    h = packed
    for w in weights:
      h = rlk_jax.det_gemm(h, w)
    logp = rlk_jax.linear_logp(h, head, labels)
    return logp.sum(), (rlk_jax.unpack(h, info), logp)

  grads, outputs = jax.grad(loss, argnums=(0, 1), has_aux=True)(weights, head)
  # The metadata kernels on their own (pack from a mask above takes the
  # one-kernel route at this size).
  info = rlk_jax.pack_info(mask, capacity=384, implementation="cuda_ffi")
  return jax.tree.leaves((outputs, grads, info.cu_seqlens, info.gather_map))


@on_sm90
def test_every_rlk_call_runs_in_a_command_buffer_with_op_by_op_bits(rng,
                                                                    tmp_path):
  args = _program_inputs(rng)
  lowered = jax.jit(_program).lower(*args)
  compiled = lowered.compile()
  hlo_calls = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
  assert hlo_calls and all(t.startswith("rlk_") for t in hlo_calls), hlo_calls
  assert {"rlk_det_gemm_sm90", "rlk_pack_rows", "rlk_pack_info",
          "rlk_gather_rows", "rlk_logits_stats", "rlk_logits_finish",
          "rlk_logits_grad"} <= set(hlo_calls), set(hlo_calls)
  sequence = thunk_sequence(lowered, tmp_path)
  assert sequence, ("no thunk pass changed the program (nothing captured): "
                    f"{sorted(p.name for p in tmp_path.iterdir())[:40]}")
  captured, outside = custom_call_thunks(sequence)
  assert outside == 0 and captured >= len(hlo_calls), (
      captured, outside, len(hlo_calls), sequence[:4000])
  jitted = compiled(*args)
  op_by_op = _program(*args)  # eager: each op its own executable
  for got, want in zip(jitted, op_by_op):
    assert_bitwise_equal(np.asarray(got), np.asarray(want))
