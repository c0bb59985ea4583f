"""det_gemm on Mosaic GPU (``mosaic_gpu``) on a Hopper GPU (`pytest -m gpu`):
the SM90 kernels' bits (``cuda_ffi``) for every layout, output dtype and
config at ragged shapes, rows invariant, the VJP's products, and Pallas's
bits where the SM90 kernels decline (K not a multiple of 8)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import (ON_GPU, assert_bitwise_equal, assert_row_windows_match,
                      assert_same_gradients, random_array, relative_error)
from pallas_kernels import det_matmul_mgpu
from rlk_jax import _det_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU"),
    pytest.mark.skipif(ON_GPU and (
        rlk_jax.implementations("det_gemm")["mosaic_gpu"] is not None
        or rlk_jax.implementations("det_gemm")["cuda_ffi"] is not None),
        reason="requires a Hopper GPU and the SM90 cuda_ffi library")]

LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


def mosaic(config, ta, tb, out, num_sms=None):
  return jax.jit(functools.partial(
      det_matmul_mgpu.matmul, transpose_a=ta, transpose_b=tb, out_dtype=out,
      config=det_matmul_mgpu.CONFIGS[config], num_sms=num_sms))


@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_every_layout_output_and_config_gives_the_sm90_bits(ta, tb, out, rng):
  m, k, n = 264, 1032, 776  # ragged against every tile
  a = random_array(rng, (k, m) if ta else (m, k), jnp.bfloat16)
  b = random_array(rng, (n, k) if tb else (k, n), jnp.bfloat16)
  want = _det_gemm._matmul("cuda_ffi", ta, tb, jnp.dtype(out), a, b)
  for config in det_matmul_mgpu.CONFIGS:
    got = mosaic(config, ta, tb, out)(a, b)
    assert_bitwise_equal(got, want, f"ta={ta} tb={tb} {config}")
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
  assert relative_error(got, ref) < (1e-5 if out == jnp.float32 else 1e-2)


CHAINED = [name for name, cfg in det_matmul_mgpu.CONFIGS.items()
           if cfg.chain or cfg.cluster]


@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_chained_and_clustered_configs_give_the_sm90_bits(ta, tb, out, rng):
  # K=1000: 16 K steps, so the pipeline chains across tiles; 5 SMs (2
  # clusters) over 8x4 (4x8) CTA tiles, so each runs a first, middle and
  # last tile; 1000 rows and columns make whole clusters of ragged tiles
  # (the every-config test above runs one tile per SM, and drops the
  # clusters where M=264 leaves a partner CTA without rows).
  m, k, n = 1000, 1000, 1000
  a = random_array(rng, (k, m) if ta else (m, k), jnp.bfloat16)
  b = random_array(rng, (n, k) if tb else (k, n), jnp.bfloat16)
  want = _det_gemm._matmul("cuda_ffi", ta, tb, jnp.dtype(out), a, b)
  for config in CHAINED:
    got = mosaic(config, ta, tb, out, num_sms=5)(a, b)
    assert_bitwise_equal(got, want, f"ta={ta} tb={tb} {config}")


@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (3584, 18944),
                                 (768, 2048), (4096, 1024)])
def test_model_shapes_rows_invariant_and_sm90_bits(k, n, rng):
  a = random_array(rng, (2048, k), jnp.bfloat16)
  w = random_array(rng, (n, k), jnp.bfloat16)  # nn.Linear layout
  gemm = jax.jit(functools.partial(rlk_jax.det_gemm, transpose_b=True,
                                   implementation="mosaic_gpu"))
  full = gemm(a, w)
  assert_bitwise_equal(full, rlk_jax.det_gemm(a, w, transpose_b=True,
                                              implementation="cuda_ffi"))
  assert_row_windows_match(gemm, a, w, full, (1, 7, 100, 1001), rng,
                           f"K={k} N={n}")


def test_backward_products_give_the_sm90_bits(rng):
  assert_same_gradients(rng, 1000, 4096, 1536, "mosaic_gpu", "cuda_ffi")


def test_unaligned_k_gives_pallas_bits(rng):
  # K=777: the SM90 kernels decline (TMA rows); padded K here, masked K in
  # Pallas's kernel: zero products either way.
  a = random_array(rng, (300, 777), jnp.bfloat16)
  b = random_array(rng, (777, 520), jnp.bfloat16)
  got = rlk_jax.det_gemm(a, b, implementation="mosaic_gpu")
  assert_bitwise_equal(got, rlk_jax.det_gemm(a, b, implementation="pallas"))
