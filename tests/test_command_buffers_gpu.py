"""rlk's FFI calls inside XLA's command buffers (CUDA graphs) on a GPU
(`pytest -m gpu`; the HLO parser's test runs anywhere): in a jitted program of det_gemm products, pack, unpack
and linear_logp, every rlk custom call sits in a command-buffer region of
the compiled program, and the program returns the bits of op-by-op calls.

XLA's command-buffer scheduling is an HLO pass: it outlines runs of
capturable instructions into computations named ``command_buffer*`` that
run as one CUDA graph. A custom call lands in one only if XLA knows it is
capturable (the FFI handler's traits), so the optimized HLO says where each
call runs."""

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


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def custom_calls_by_computation(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: [custom-call targets]} of an HLO module's text."""
  calls, current = {}, None
  for line in hlo_text.splitlines():
    opened = _COMPUTATION.match(line)
    if opened and "=" not in line.split("{")[0]:
      current = opened.group(1)
      continue
    target = _TARGET.search(line)
    if target and current is not None:
      calls.setdefault(current, []).append(target.group(1))
  return calls


def test_the_parser_reads_computations_and_targets():
  hlo = """HloModule m
%command_buffer.3 (p0: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  ROOT %c = bf16[8,8]{1,0} custom-call(%p0), custom_call_target="rlk_det_gemm_sm90", backend_config={}
}
ENTRY %main.1 (a: bf16[8,8]{1,0}) -> bf16[8,8]{1,0} {
  %a = bf16[8,8] parameter(0)
  %x = bf16[8,8] custom-call(%a), custom_call_target="triton_kernel_call"
  ROOT %y = bf16[8,8] call(%x), to_apply=%command_buffer.3
}"""
  assert custom_calls_by_computation(hlo) == {
      "command_buffer.3": ["rlk_det_gemm_sm90"],
      "main.1": ["triton_kernel_call"]}


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
def test_every_rlk_call_runs_in_a_command_buffer_with_op_by_op_bits(rng):
  args = _program_inputs(rng)
  compiled = jax.jit(_program).lower(*args).compile()
  calls = custom_calls_by_computation(compiled.as_text())
  ours = {(name, target) for name, targets in calls.items()
          for target in targets
          if target.startswith("rlk_") or target == "triton_kernel_call"}
  assert {t for _, t in ours} >= {"rlk_det_gemm_sm90", "triton_kernel_call"}, ours
  outside = sorted((t, n) for n, t in ours if "command_buffer" not in n)
  assert not outside, f"rlk calls outside command buffers: {outside}"
  jitted = compiled(*args)
  op_by_op = _program(*args)  # eager: each op its own executable
  for got, want in zip(jitted, op_by_op):
    assert_bitwise_equal(np.asarray(got), np.asarray(want))
