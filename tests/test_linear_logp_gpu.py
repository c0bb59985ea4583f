"""linear_logp on a CUDA GPU at real sizes (run with `pytest -m gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import (ON_GPU, assert_bitwise_equal, dense_logp_grads,
                      random_array, relative_error)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU")]


GPU_IMPLS = [name for name, why in rlk_jax.implementations("linear_logp").items()
             if name != "xla" and (why is None or name == "pallas")]


@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_rows_invariant_and_accurate_at_size(impl, vocab, rng):
  hidden = random_array(rng, (2048, 4096), jnp.bfloat16) / 3
  weight = (random_array(rng, (4096, vocab), jnp.float32) * 0.01).astype(jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, vocab, 2048), jnp.int32)
  f = jax.jit(functools.partial(rlk_jax.linear_logp, implementation=impl))
  full = f(hidden, weight, targets)
  for m in (1, 3, 64, 1000):
    start = int(rng.integers(0, 2048 - m + 1))
    rows = slice(start, start + m)
    assert_bitwise_equal(f(hidden[rows], weight, targets[rows]), full[rows],
                         f"M={m} at row {start}")
  logits = jnp.dot(hidden[:64].astype(jnp.float32), weight.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  ref = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:64, None], 1)[:, 0]
  np.testing.assert_allclose(np.asarray(full[:64]), np.asarray(ref), rtol=1e-5, atol=1e-4)
  assert (np.asarray(full) <= 0).all()


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gradients_deterministic_at_size(impl, rng):
  hidden = random_array(rng, (1024, 4096), jnp.bfloat16) / 3
  weight = (random_array(rng, (4096, 32000), jnp.float32) * 0.01).astype(jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, 32000, 1024), jnp.int32)
  grad = jax.jit(jax.grad(lambda h, w: jnp.sum(rlk_jax.linear_logp(
      h, w, targets, implementation=impl)), argnums=(0, 1)))
  a, b = grad(hidden, weight), grad(hidden, weight)
  assert_bitwise_equal(a[0], b[0])
  assert_bitwise_equal(a[1], b[1])


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gradients_accurate_with_entropy_temperature_and_chunks(impl, rng):
  # The backward of both outputs against float64, across several vocabulary
  # chunks (two full ones and a remainder) with ignored targets.
  n, h, v, chunk, temperature = 300, 512, 2 * 2048 + 808, 2048, 0.7
  hidden = random_array(rng, (n, h), jnp.bfloat16) / 3
  weight = (random_array(rng, (h, v), jnp.float32) * 0.05).astype(jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, v, n), jnp.int32).at[::7].set(-100)
  g_logp = random_array(rng, (n,), jnp.float32)
  g_entropy = random_array(rng, (n,), jnp.float32)

  def loss(h, w):
    logp, entropy = rlk_jax.linear_logp(
        h, w, targets, temperature=temperature, chunk_size=chunk,
        return_entropy=True, implementation=impl)
    return jnp.sum(g_logp * logp + g_entropy * entropy)

  dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, weight)
  h64, w64 = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)
  t = np.asarray(targets)
  *_, d = dense_logp_grads(h64 @ w64, t, np.where(t >= 0, g_logp, 0.0),
                           g_entropy, temperature)
  assert relative_error(dh, d @ w64.T) < 1e-2
  assert relative_error(dw, h64.T @ d) < 1e-2


def test_sm90_default_on_hopper():
  # On Hopper the chunked SM90 path must be available, not silently skipped.
  if getattr(jax.devices()[0], "compute_capability", "") != "9.0":
    pytest.skip("not an SM90 GPU")
  assert rlk_jax.selected_implementation("linear_logp") == "cuda_ffi"


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_f32_master_weight_on_the_gpu_routes(impl, rng):
  # f32 master weights: the bf16-weight call's bits, and the weight's f32
  # gradient that rounds to the bf16 call's (the products' f32 output).
  hidden = random_array(rng, (300, 1024), jnp.bfloat16) / 3
  master = random_array(rng, (1024, 4096 + 1032), jnp.float32) * 0.02
  targets = jnp.asarray(rng.integers(0, 4096 + 1032, 300), jnp.int32)
  temps = jnp.asarray(rng.uniform(0.5, 1.5, 300), jnp.float32)
  g = random_array(rng, (300,), jnp.float32)
  loss = lambda h, w: jnp.sum(rlk_jax.linear_logp(
      h, w, targets, temperature=temps, chunk_size=2048,
      implementation=impl) * g)
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  value, (dh, dw) = grad(hidden, master)
  want, (dh_b, dw_b) = grad(hidden, master.astype(jnp.bfloat16))
  assert dw.dtype == jnp.float32
  assert_bitwise_equal(value, want)
  assert_bitwise_equal(dh, dh_b)
  assert_bitwise_equal(dw.astype(jnp.bfloat16), dw_b)
