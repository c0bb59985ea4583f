"""``rlk_jax.batch_invariant`` with ``shard_map`` and sharded ``jit`` on 8
(host) devices: the rewritten body is the per-device program, so a row's
bits are those of the unsharded transformed function, alone or in its
batch. Run by tests/test_sharding.py in a child process (the device count
is fixed when JAX starts)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import rlk_jax
from conftest import assert_bitwise_equal, random_array
from sharding_setup import (IMPLEMENTATIONS, mesh, operand_dtype, put,  # noqa: F401
                            single)


def block(x, w1, w2):
  """A decoder's feed-forward half: an RMSNorm (a last-axis mean), two
  products, SiLU."""
  h = x.astype(jnp.float32)
  h = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)
  h = jax.nn.silu(h.astype(x.dtype) @ w1)
  return h @ w2


def weights(rng, dtype):
  # K of 96 and 64: not all powers of two; rows 16-byte pitched in bf16
  return random_array(rng, (96, 64), dtype), random_array(rng, (64, 48), dtype)


def data_parallel(fn, mesh):
  return jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P(), P()),
                       out_specs=P("data"))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_shard_map_inside_is_rewritten_and_keeps_the_rows_bits(impl, mesh,
                                                                 rng):
  dtype = operand_dtype(impl)
  w1, w2 = weights(rng, dtype)
  rows = 8 * mesh.shape["data"]
  x = random_array(rng, (rows, 96), dtype)
  transformed = rlk_jax.batch_invariant(data_parallel(block, mesh),
                                        implementation=impl)
  got = jax.jit(transformed)(x, w1, w2)
  plain = jax.jit(rlk_jax.batch_invariant(block, implementation=impl))
  assert_bitwise_equal(got, plain(x, w1, w2), "sharded vs unsharded")
  for r in (0, rows // 2 + 3, rows - 1):
    assert_bitwise_equal(got[r:r + 1], plain(x[r:r + 1], w1, w2), f"row {r}")
  # Nothing left to XLA's products: the body was rewritten, not bound whole.
  assert transformed.report(x, w1, w2) == {}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradients_through_a_shard_map_inside(impl, mesh, rng):
  dtype = operand_dtype(impl)
  w1, w2 = weights(rng, dtype)
  x = random_array(rng, (8 * mesh.shape["data"], 96), dtype)

  def loss(f):
    return lambda x, w1, w2: jnp.sum(
        rlk_jax.batch_invariant(f, implementation=impl)(x, w1, w2)
        .astype(jnp.float32) ** 2)

  grad = jax.jit(jax.grad(loss(data_parallel(block, mesh)), argnums=(0, 1)))
  dx, dw1 = grad(x, w1, w2)
  want_dx, want_dw1 = jax.jit(jax.grad(loss(block), argnums=(0, 1)))(x, w1,
                                                                     w2)
  # dA: each row's own (row-local on every device); dW: summed over the
  # devices' rows, deterministic, and the unsharded sum to rounding.
  assert_bitwise_equal(dx, want_dx, "dx")
  assert_bitwise_equal(grad(x, w1, w2)[1], dw1, "dw1 run to run")
  err = (np.linalg.norm(np.asarray(dw1, np.float64) - np.asarray(want_dw1,
                                                                 np.float64))
         / np.linalg.norm(np.asarray(want_dw1, np.float64)))
  assert err < (1e-2 if dtype == jnp.bfloat16 else 1e-5), err


def test_batch_invariant_inside_a_shard_map(mesh, rng):
  w1, w2 = weights(rng, jnp.float32)
  x = random_array(rng, (8 * mesh.shape["data"], 96), jnp.float32)
  inside = jax.jit(data_parallel(rlk_jax.batch_invariant(block), mesh))
  assert_bitwise_equal(inside(x, w1, w2),
                       jax.jit(rlk_jax.batch_invariant(block))(x, w1, w2))


def test_sharded_jit_keeps_the_rows_bits(mesh, rng):
  w1, w2 = weights(rng, jnp.float32)
  x = random_array(rng, (8 * mesh.shape["data"], 96), jnp.float32)
  f = jax.jit(rlk_jax.batch_invariant(block))
  got = f(put(mesh, x, "data"), put(mesh, w1), put(mesh, w2))
  assert_bitwise_equal(got, f(single(x), single(w1), single(w2)))
