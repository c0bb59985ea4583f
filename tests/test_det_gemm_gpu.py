"""det_gemm on a CUDA GPU at real sizes (run with `pytest -m gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from pallas_kernels import det_matmul
from conftest import (ON_GPU, assert_bitwise_equal, assert_row_windows_match,
                      random_array)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU")]

# (K, N) of the projections of a Llama-3-8B-like layer.
PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
               "down": (14336, 4096), "lm_head": (4096, 128256)}


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_projection_rows_are_batch_invariant(name, rng):
  k, n = PROJECTIONS[name]
  a = random_array(rng, (4096, k), jnp.bfloat16)
  b = random_array(rng, (k, n), jnp.bfloat16)
  gemm = jax.jit(lambda a, b: rlk_jax.det_gemm(a, b, implementation="pallas"))
  full = gemm(a, b)
  assert_row_windows_match(gemm, a, b, full, (1, 3, 16, 100), rng, name)
  assert_bitwise_equal(gemm(a, b), full, "repeat run")
  # Accuracy of a sample of rows against f32 math on the rounded operands.
  ref = jnp.dot(a[:64].astype(jnp.float32), b.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  err = float(jnp.linalg.norm(full[:64].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
  assert err < 1e-2, err


# (M, K, N, transpose_a, transpose_b): tiny and ragged M, ragged and
# power-of-two K, ragged N, and the backward's two stored-transposed layouts.
CONFIG_CASES = [(1, 4096, 4096, False, False), (3, 1000, 257, False, False),
                (17, 1024, 1000, False, True), (64, 14336, 512, False, False),
                (100, 4096, 6144, False, True), (1000, 1000, 1000, True, False),
                (300, 512, 2000, True, False), (4096, 4096, 4096, False, False)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", CONFIG_CASES, ids=str)
def test_every_pallas_config_gives_the_same_bits(case, dtype, rng):
  # choose_config may pick any of CONFIGS by problem size: allowed only
  # because they all round alike, which this proves on the device.
  m, k, n, ta, tb = case
  a = random_array(rng, (k, m) if ta else (m, k), dtype)
  b = random_array(rng, (n, k) if tb else (k, n), dtype)
  outs = [jax.jit(functools.partial(
      det_matmul.matmul, transpose_a=ta, transpose_b=tb, config=cfg))(a, b)
          for cfg in det_matmul.CONFIGS]
  for cfg, out in zip(det_matmul.CONFIGS[1:], outs[1:]):
    assert_bitwise_equal(out, outs[0], f"{cfg} vs {det_matmul.DEFAULT_CONFIG}")
  chosen = det_matmul.choose_config(m, n, dtype)
  assert chosen in det_matmul.CONFIGS
  assert_bitwise_equal(jax.jit(functools.partial(
      det_matmul.matmul, transpose_a=ta, transpose_b=tb))(a, b), outs[0],
      f"chosen {chosen}")


def test_no_tf32_for_float32(rng):
  a = random_array(rng, (512, 4096), jnp.float32)
  b = random_array(rng, (4096, 512), jnp.float32)
  c = rlk_jax.det_gemm(a, b)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  err = np.linalg.norm(np.asarray(c, np.float64) - ref) / np.linalg.norm(ref)
  assert err < 1e-5, err  # TF32 lands near 3e-4


@pytest.mark.parametrize("impl", ["pallas", "cuda_ffi"])
def test_weight_gradient_padding_inert_at_size(impl, rng):
  if rlk_jax.implementations("det_gemm")[impl] is not None:
    pytest.skip(rlk_jax.implementations("det_gemm")[impl])  # cuda_ffi off Hopper
  a = random_array(rng, (3000, 4096), jnp.bfloat16)
  b = random_array(rng, (4096, 1024), jnp.bfloat16)
  g = random_array(rng, (3000, 1024), jnp.bfloat16)

  @jax.jit
  def grads(a, g):
    return jax.vjp(functools.partial(rlk_jax.det_gemm, implementation=impl),
                   a, b)[1](g)

  da, db = grads(a, g)
  da_pad, db_pad = grads(jnp.concatenate([a, jnp.zeros((1096, 4096), a.dtype)]),
                         jnp.concatenate([g, jnp.zeros((1096, 1024), g.dtype)]))
  assert_bitwise_equal(db_pad, db, "dB with appended zero rows")
  assert_bitwise_equal(da_pad[:3000], da, "dA rows")
  assert_bitwise_equal(grads(a, g)[1], db, "repeat run")
  da_17, _ = grads(a[100:117], g[100:117])
  assert_bitwise_equal(da_17, da[100:117], "dA rows of M=17")
  ref_db = np.asarray(a, np.float64).T @ np.asarray(g, np.float64)
  err = np.linalg.norm(np.asarray(db, np.float64) - ref_db) / np.linalg.norm(ref_db)
  assert err < 1e-2, err


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_triton_route_under_vmap_is_each_elements_product(dtype, rng):
  # jax-triton's call has no batching rule: det_gemm's "triton" route maps
  # one product per batch element (f32 products take this route on a GPU).
  if rlk_jax.implementations("det_gemm")["triton"] is not None:
    pytest.skip("no jax-triton here")
  a = random_array(rng, (3, 40, 128), dtype)
  b = random_array(rng, (3, 128, 72), dtype)
  f = functools.partial(rlk_jax.det_gemm, implementation="triton")
  both, left = jax.vmap(f)(a, b), jax.vmap(f, in_axes=(0, None))(a, b[1])
  for i in range(3):
    assert_bitwise_equal(both[i], f(a[i], b[i]))
    assert_bitwise_equal(left[i], f(a[i], b[1]))
