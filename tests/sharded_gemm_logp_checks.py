"""det_gemm and linear_logp inside sharded jit programs on 8 (host)
devices: bitwise the unsharded result, and no operand all-gathered where
rows or columns are split. Run by tests/test_sharding.py in a child process
(the device count is fixed when JAX starts): on 8 host devices, or on the
GPUs of a multi-GPU machine."""

import csv
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import rlk_jax
from conftest import assert_bitwise_equal, random_array
from sharding_setup import (IMPLEMENTATIONS, mesh, operand_dtype, put,  # noqa: F401
                            single)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("a_spec,b_spec,transpose_b,out_spec", [
    (("data",), (), False, ("data", None)),                # data parallel
    ((), (None, "model"), False, (None, "model")),         # column TP
    (("data",), (None, "model"), False, ("data", "model")),
    (("data",), ("model",), True, ("data", "model")),      # nn.Linear layout
])
def test_sharded_forward_is_local_and_bitwise(impl, a_spec, b_spec, transpose_b,
                                              out_spec, mesh, rng):
  # k not a power of two; every local block keeps 16-byte row pitches in
  # bf16 (the SM90 path's TMA rule) for every layout
  m, k, n = 64, 96, 48
  dtype = operand_dtype(impl)
  a = random_array(rng, (m, k), dtype)
  b = random_array(rng, (n, k) if transpose_b else (k, n), dtype)
  f = jax.jit(functools.partial(rlk_jax.det_gemm, implementation=impl,
                                transpose_b=transpose_b))
  sharded_a, sharded_b = put(mesh, a, *a_spec), put(mesh, b, *b_spec)
  got = f(sharded_a, sharded_b)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(*out_spec)), 2)
  assert_bitwise_equal(got, f(single(a), single(b)))
  hlo = f.lower(sharded_a, sharded_b).compile().as_text()
  assert "all-gather" not in hlo and "all-reduce" not in hlo, hlo[:2000]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sharded_gradients_bitwise(impl, mesh, rng):
  dtype = operand_dtype(impl)
  a = random_array(rng, (64, 40), dtype)
  b = random_array(rng, (40, 32), dtype)
  w = random_array(rng, (64, 32), dtype)

  @jax.jit
  def grads(a, b, w):
    loss = lambda a, b: jnp.sum(rlk_jax.det_gemm(a, b, implementation=impl) * w)
    return jax.grad(loss, argnums=(0, 1))(a, b)

  da, db = grads(put(mesh, a, "data"), put(mesh, b, None, "model"),
                 put(mesh, w, "data", "model"))
  want_da, want_db = grads(single(a), single(b), single(w))
  assert_bitwise_equal(da, want_da)
  # dB sums over the (row-sharded) rows: its operands are gathered so the sum
  # runs in the unsharded order: the same bits, not a cross-device all-reduce.
  assert_bitwise_equal(db, want_db)


def test_sharded_k_is_gathered_not_split(mesh, rng):
  a = random_array(rng, (32, 64), jnp.float32)
  b = random_array(rng, (64, 16), jnp.float32)
  f = jax.jit(functools.partial(rlk_jax.det_gemm, implementation="xla"))
  got = f(put(mesh, a, None, "data"), put(mesh, b, "data", None))
  assert_bitwise_equal(got, f(single(a), single(b)))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_linear_logp_token_sharded_forward_and_gradients(impl, mesh, rng):
  # v is not a multiple of the chunk; its f32 logit rows keep 16-byte pitches
  n, h, v = 32, 24, 72
  dtype = operand_dtype(impl)
  hidden = (random_array(rng, (n, h), jnp.float32) / 4).astype(dtype)
  weight = (random_array(rng, (h, v), jnp.float32) / 8).astype(dtype)
  targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)

  @jax.jit
  def run(hidden, weight, targets):
    f = lambda h, w: rlk_jax.linear_logp(h, w, targets, chunk_size=32,
                                         implementation=impl)
    logp, vjp = jax.vjp(f, hidden, weight)
    return logp, vjp(jnp.ones_like(logp))

  sharded = (put(mesh, hidden, "data"), put(mesh, weight),
             put(mesh, targets, "data"))
  logp, (dh, dw) = run(*sharded)
  want_logp, (want_dh, want_dw) = run(single(hidden), single(weight),
                                      single(targets))
  assert_bitwise_equal(logp, want_logp)
  assert_bitwise_equal(dh, want_dh)
  assert_bitwise_equal(dw, want_dw)
  assert logp.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 1)
  fwd = jax.jit(lambda h, w, t: rlk_jax.linear_logp(h, w, t, implementation=impl))
  hlo = fwd.lower(*sharded).compile().as_text()
  assert "all-gather" not in hlo, "the forward gathered its tokens"


def test_rowwise_kernels_stay_on_their_rows(mesh, rng):
  # _sharding.rowwise (what linear_logp's d-logits FFI call runs under):
  # each device computes its own rows, bitwise the unsharded result.
  from rlk_jax import _sharding
  n, c = 64, 40
  logits = random_array(rng, (n, c), jnp.float32)
  scale = random_array(rng, (n,), jnp.float32)
  rows = lambda local: jax.jit(
      lambda x, s: _sharding.rowwise(local, (2, 1), (2,))(x, s)[0])
  f = rows(lambda x, s: (x * s[:, None],))  # one rounding: the same anywhere
  sharded = (put(mesh, logits, "data"), put(mesh, scale, "data"))
  got = f(*sharded)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
  assert_bitwise_equal(got, f(single(logits), single(scale)))
  # A local opaque to XLA's partitioner, as an FFI call is (compiled only:
  # without the rule every row is gathered onto every device).
  opaque = rows(lambda x, s: (jax.pure_callback(
      lambda a, b: a * b[:, None], jax.ShapeDtypeStruct(x.shape, x.dtype),
      x, s),))
  hlo = opaque.lower(*sharded).compile().as_text()
  assert "all-gather" not in hlo, hlo[:2000]


def test_scaling_benchmark_measures_every_case(tmp_path):
  # The main job's scaling section, on this process's devices (the child
  # inherits the device set-up through the environment).
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks", "--only", "scaling", "--smoke",
       "--repeats", "2", "--out", str(tmp_path)],
      capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(tmp_path, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  devices = f"{jax.device_count()}_devices"
  assert {r["implementation"] for r in rows} == {"1_device", devices}
  assert all(float(r["median_ms"]) > 0 for r in rows), rows
  efficiencies = [float(r["note"].split()[-1]) for r in rows
                  if r["implementation"] == devices]
  assert len(efficiencies) == len(rows) // 2 and all(e > 0 for e in efficiencies)
  assert "## scaling" in open(os.path.join(tmp_path, "report.md")).read()
