"""pack_sharded / unpack_sharded on several devices (8 host devices, or the
GPUs of a multi-GPU machine) against per-shard packs computed one shard at
a time. Run by tests/test_sharding.py in a child process."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import rlk_jax
from conftest import IMPLEMENTATIONS, assert_bitwise_equal, random_array, random_mask
from sharding_setup import DEVICES, mesh  # noqa: F401


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_per_shard_layout_and_round_trip(impl, mesh, rng):
  shards = mesh.shape["data"]
  b, s, h, cap = 2 * shards, 13, 5, 30  # 2 sequences of 13 per shard, ragged h
  x = random_array(rng, (b, s, h), jnp.float32)
  mask = random_mask(rng, (b, s), 0.6)
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ms = jax.device_put(mask, NamedSharding(mesh, P("data")))
  f = jax.jit(lambda x, m: rlk_jax.pack_sharded(
      x, m, mesh=mesh, axis="data", capacity=cap, fill_value=-1,
      implementation=impl))
  packed, info = f(xs, ms)
  assert packed.shape == (shards * cap, h) and info.capacity == cap
  assert packed.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
  for shard in range(shards):
    rows = slice(2 * shard, 2 * shard + 2)
    want, want_info = rlk_jax.pack(x[rows], mask[rows], capacity=cap,
                                   fill_value=-1, implementation=impl)
    block = slice(shard * cap, (shard + 1) * cap)
    assert_bitwise_equal(packed[block], want, f"shard {shard}")
    for field in ("segment_ids", "positions", "valid", "gather_map"):
      assert_bitwise_equal(getattr(info, field)[block], getattr(want_info, field))
    assert_bitwise_equal(info.scatter_map[rows], want_info.scatter_map)
    assert_bitwise_equal(info.cu_seqlens[3 * shard:3 * shard + 3],
                         want_info.cu_seqlens)
    assert int(info.total[shard]) == int(want_info.total)
  dense = jax.jit(lambda p, i: rlk_jax.unpack_sharded(
      p, i, mesh=mesh, axis="data", implementation=impl))(packed, info)
  assert_bitwise_equal(dense, jnp.where(mask[..., None], x, 0.0))
  hlo = f.lower(xs, ms).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_errors():
  mesh = Mesh(np.array(jax.devices()), ("data",))
  b = DEVICES + 1
  x = jnp.ones((b, 4, 2))
  with pytest.raises(ValueError, match=rf"batch axis \({b}\) must split evenly"):
    rlk_jax.pack_sharded(x, jnp.ones((b, 4)), mesh=mesh, axis="data", capacity=8)
  with pytest.raises(ValueError, match="mesh has no axis 'rows'"):
    rlk_jax.pack_sharded(x, jnp.ones((b, 4)), mesh=mesh, axis="rows", capacity=8)


def test_data_parallel_example_step(rng):
  from examples import data_parallel_step as dp
  mesh = Mesh(np.array(jax.devices()), ("data",))
  data = NamedSharding(mesh, P("data"))
  b, s, h, v, cap = 2 * DEVICES, 12, 16, 37, 24  # 2 sequences per device
  x = jax.device_put(random_array(rng, (b, s, h), jnp.float32), data)
  mask = jax.device_put(random_mask(rng, (b, s), 0.7), data)
  targets = jax.device_put(jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32), data)
  params = dp.init_params(jax.random.key(1), hidden=h, ffn=24, vocab=v)
  logp, valid = jax.jit(lambda p, x, m, t: dp.token_logprobs(
      p, x, m, t, mesh=mesh, capacity=cap))(params, x, mask, targets)
  # Each token's log-prob is the one device-local computation gives: the
  # last shard's rows recomputed alone, on one device, from its own sequences.
  last = DEVICES - 1
  rows = slice(2 * last, 2 * last + 2)
  one = Mesh(np.array(jax.devices()[:1]), ("data",))
  alone, _ = jax.jit(lambda p, x, m, t: dp.token_logprobs(
      p, x, m, t, mesh=one, capacity=cap))(
          params, *(jax.device_put(a[rows], jax.devices()[0])
                    for a in (x, mask, targets)))
  assert_bitwise_equal(logp[last * cap:(last + 1) * cap], alone)
  assert bool((logp <= 0).all()) and int(valid.sum()) == int(mask.sum())
  new, loss = dp.make_step(mesh, cap)(params, x, mask, targets)
  assert np.isfinite(float(loss))
  assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(new))
