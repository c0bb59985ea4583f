"""det_gemm and linear_logp inside sharded jit programs on 8 (host)
devices: bitwise the unsharded result, and no operand all-gathered where
rows or columns are split. Run by tests/test_sharding.py in a child process
(the device count is fixed when JAX starts)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import rlk_jax
from conftest import assert_bitwise_equal, random_array

assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"
MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
ONE = jax.devices()[0]


def put(x, *spec):
  return jax.device_put(x, NamedSharding(MESH, P(*spec)))


def single(x):
  return jax.device_put(x, ONE)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("a_spec,b_spec,transpose_b,out_spec", [
    (("data",), (), False, ("data", None)),                # data parallel
    ((), (None, "model"), False, (None, "model")),         # column TP
    (("data",), (None, "model"), False, ("data", "model")),
    (("data",), ("model",), True, ("data", "model")),      # nn.Linear layout
])
def test_sharded_forward_is_local_and_bitwise(impl, a_spec, b_spec, transpose_b,
                                              out_spec, rng):
  m, k, n = 64, 96, 48  # k not a power of two; k % 8 == 0 for every layout
  a = random_array(rng, (m, k), jnp.float32)
  b = random_array(rng, (n, k) if transpose_b else (k, n), jnp.float32)
  f = jax.jit(functools.partial(rlk_jax.det_gemm, implementation=impl,
                                transpose_b=transpose_b))
  sharded_a, sharded_b = put(a, *a_spec), put(b, *b_spec)
  got = f(sharded_a, sharded_b)
  assert got.sharding.is_equivalent_to(NamedSharding(MESH, P(*out_spec)), 2)
  assert_bitwise_equal(got, f(single(a), single(b)))
  hlo = f.lower(sharded_a, sharded_b).compile().as_text()
  assert "all-gather" not in hlo and "all-reduce" not in hlo, hlo[:2000]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sharded_gradients_bitwise(impl, rng):
  a = random_array(rng, (64, 40), jnp.float32)
  b = random_array(rng, (40, 24), jnp.float32)
  w = random_array(rng, (64, 24), jnp.float32)

  @jax.jit
  def grads(a, b, w):
    loss = lambda a, b: jnp.sum(rlk_jax.det_gemm(a, b, implementation=impl) * w)
    return jax.grad(loss, argnums=(0, 1))(a, b)

  da, db = grads(put(a, "data"), put(b, None, "model"), put(w, "data", "model"))
  want_da, want_db = grads(single(a), single(b), single(w))
  assert_bitwise_equal(da, want_da)
  # dB sums over the (row-sharded) rows: its operands are gathered so the sum
  # runs in the unsharded order: the same bits, not a cross-device all-reduce.
  assert_bitwise_equal(db, want_db)


def test_sharded_k_is_gathered_not_split(rng):
  a = random_array(rng, (32, 64), jnp.float32)
  b = random_array(rng, (64, 16), jnp.float32)
  f = jax.jit(functools.partial(rlk_jax.det_gemm, implementation="xla"))
  got = f(put(a, None, "data"), put(b, "data", None))
  assert_bitwise_equal(got, f(single(a), single(b)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_linear_logp_token_sharded_forward_and_gradients(impl, rng):
  n, h, v = 32, 24, 70
  hidden = random_array(rng, (n, h), jnp.float32) / 4
  weight = random_array(rng, (h, v), jnp.float32) / 8
  targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)

  @jax.jit
  def run(hidden, weight, targets):
    f = lambda h, w: rlk_jax.linear_logp(h, w, targets, chunk_size=32,
                                         implementation=impl)
    logp, vjp = jax.vjp(f, hidden, weight)
    return logp, vjp(jnp.ones_like(logp))

  sharded = (put(hidden, "data"), put(weight), put(targets, "data"))
  logp, (dh, dw) = run(*sharded)
  want_logp, (want_dh, want_dw) = run(single(hidden), single(weight),
                                      single(targets))
  assert_bitwise_equal(logp, want_logp)
  assert_bitwise_equal(dh, want_dh)
  assert_bitwise_equal(dw, want_dw)
  assert logp.sharding.is_equivalent_to(NamedSharding(MESH, P("data")), 1)
  fwd = jax.jit(lambda h, w, t: rlk_jax.linear_logp(h, w, t, implementation=impl))
  hlo = fwd.lower(*sharded).compile().as_text()
  assert "all-gather" not in hlo, "the forward gathered its tokens"
