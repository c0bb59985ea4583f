"""The torch bridge on a CUDA GPU (run with `pytest -m gpu`): bits, devices,
stream order and input lifetime."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import rlk_jax
import rlk_torch_bridge as rtb
from conftest import ON_GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()),
                                 reason="requires a CUDA GPU")]


def test_cuda_same_bits_as_jax():
  a = torch.randn(100, 4096, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
  c = rtb.det_gemm(a, b)
  expected = rlk_jax.det_gemm(jnp.asarray(a.float().cpu().numpy()).astype(jnp.bfloat16),
                              jnp.asarray(b.float().cpu().numpy()).astype(jnp.bfloat16))
  got = c.view(torch.int16).cpu().numpy()
  assert np.array_equal(got, np.asarray(expected).view(np.int16))


def test_device_mismatch_is_a_clear_error():
  with pytest.raises(ValueError, match="inputs on different devices: a on cuda:0, b on cpu"):
    rtb.det_gemm(torch.ones(4, 8, device="cuda"), torch.ones(8, 3))


def test_stream_order_and_allocator_reuse():
  """Inputs produced asynchronously by torch, freed right after the call,
  their memory reused and overwritten by torch: results stay exact."""
  w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
  expected = None
  for i in range(20):
    torch.manual_seed(i)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * 3  # async
    out = rtb.det_gemm(x, w)
    ref_x = x.clone()
    del x  # the caching allocator may now hand this memory out again
    garbage = torch.full((4096, 2048), float("nan"), device="cuda",
                         dtype=torch.bfloat16)
    again = rtb.det_gemm(ref_x, w)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), i
    del garbage
    if expected is None:
      expected = out.float().sum().item()
  assert np.isfinite(expected)


def test_det_linear_rows_invariant_on_cuda():
  layer = rtb.DetLinear(4096, 1024, device="cuda", dtype=torch.bfloat16)
  x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
  full = layer(x)
  for m in (1, 3, 16, 100):
    assert torch.equal(layer(x[:m]).view(torch.int16), full[:m].view(torch.int16))
