"""pack / unpack on a CUDA GPU at real sizes (run with `pytest -m gpu`).

The rest of the suite also runs on the GPU machine, where its "pallas" cases
go through the Triton lowering instead of the interpreter.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import (ON_GPU, assert_bitwise_equal, pack_implementations,
                      random_array, random_mask)
from test_pack import numpy_pack, numpy_unpack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU")]


def test_gpu_default_is_cuda_ffi_where_it_runs():
  available = pack_implementations()
  assert rlk_jax.selected_implementation("pack") == next(
      name for name in ("cuda_ffi", "triton", "pallas") if name in available)


@pytest.mark.parametrize("density", [0.05, 0.3, 1.0])
def test_benchmark_shape_matches_numpy(density, rng):
  mask = random_mask(rng, (32, 1024), density)
  x = random_array(rng, (32, 1024, 4096), jnp.bfloat16)
  capacity = -(-int(mask.sum()) // 128) * 128
  packed, info = jax.jit(lambda x, m: rlk_jax.pack(x, m, capacity=capacity))(
      x, jnp.asarray(mask))
  assert_bitwise_equal(packed, numpy_pack(x, mask, capacity, 0))
  dense = jax.jit(rlk_jax.unpack)(packed, info)
  assert_bitwise_equal(dense, numpy_unpack(packed, mask, capacity, 0))


@pytest.mark.parametrize("width", [1, 3, 8, 1000, 4095, 4097, 8192])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int32])
def test_ragged_widths(width, dtype, rng):
  mask = random_mask(rng, (7, 301), 0.4)
  x = random_array(rng, (7, 301, width), dtype)
  packed, info = rlk_jax.pack(x, mask, fill_value=-1)
  assert_bitwise_equal(packed, numpy_pack(x, mask, mask.size, -1))
  assert_bitwise_equal(rlk_jax.unpack(packed, info, fill_value=2),
                       numpy_unpack(packed, mask, mask.size, 2))


def test_jit_pack_makes_no_host_transfer(rng):
  mask = jnp.asarray(random_mask(rng, (16, 512), 0.3))
  x = random_array(rng, (16, 512, 256), jnp.bfloat16)
  capacity = 16 * 512 // 2

  @jax.jit
  def step(x, mask):
    packed, info = rlk_jax.pack(x, mask, capacity=capacity)
    return rlk_jax.unpack(packed * 2, info), info

  step(x, mask)  # compile outside the guard
  with jax.transfer_guard("disallow"):
    dense, info = step(x, mask)
    jax.block_until_ready(dense)
  assert_bitwise_equal(dense, np.where(np.asarray(mask)[..., None],
                                       np.asarray(x * 2), np.zeros((), x.dtype)))


def test_gradients_at_size(rng):
  mask = random_mask(rng, (8, 2048), 0.3)
  capacity = int(mask.sum())
  x = random_array(rng, (8, 2048, 512), jnp.float32)
  w = random_array(rng, (capacity, 512), jnp.float32)
  g = jax.jit(jax.grad(lambda x: jnp.sum(
      rlk_jax.pack(x, mask, capacity=capacity)[0] * w)))(x)
  assert_bitwise_equal(g, numpy_unpack(w, mask, capacity, 0))


@pytest.mark.parametrize("impl", pack_implementations())
def test_every_implementation_equals_xla_bitwise(impl, rng):
  mask = random_mask(rng, (32, 1024), 0.7)
  x = random_array(rng, (32, 1024, 1024), jnp.bfloat16)
  a, _ = rlk_jax.pack(x, mask, implementation=impl)
  b, _ = rlk_jax.pack(x, mask, implementation="xla")
  assert_bitwise_equal(a, b)


needs_cuda_ffi = pytest.mark.skipif("cuda_ffi" not in pack_implementations(),
                                    reason="needs the SM90 cuda_ffi library")


def _mask_cases(rng):
  """Masks the CUDA metadata kernels must get right: one and many 4096-
  position tiles, sequence ends inside and across tiles, empty masks, rank
  1 and 3, non-bool dtypes (int8 {0, 2}; float with -0.0 inactive, NaN
  active)."""
  floats = random_mask(rng, (6, 700), 0.5).astype(np.float32) * 1.5
  floats[0, :5] = [-0.0, np.nan, 0.0, -2.0, np.inf]
  return [
      (random_mask(rng, (5, 37), 0.5), None),
      (random_mask(rng, (5, 37), 0.5), 200),  # more pad rows than positions
      (random_mask(rng, (3, 10000), 0.3), None),
      (random_mask(rng, (64, 4096), 0.05), None),
      (random_mask(rng, (2, 4097), 1.0), None),
      (random_mask(rng, (9, 513), 0.0), 17),
      (random_mask(rng, (40000,), 0.5), None),  # rank 1: one row per sequence
      (random_mask(rng, (4, 33, 7), 0.4), None),
      ((random_mask(rng, (8, 300), 0.5) * 2).astype(np.int8), 2399),
      (floats, None),
      (np.zeros((0, 5), bool), 3),
      (np.zeros((4, 0), bool), 2),
      (random_mask(rng, (8, 100), 0.0), 0),
  ]


@needs_cuda_ffi
def test_cuda_metadata_equals_xla_field_by_field(rng):
  for mask, capacity in _mask_cases(rng):
    got = rlk_jax.pack_info(jnp.asarray(mask), capacity=capacity,
                            implementation="cuda_ffi")
    want = rlk_jax.pack_info(jnp.asarray(mask), capacity=capacity)
    for field in ("cu_seqlens", "seq_lens", "total", "max_seqlen",
                  "num_dropped", "segment_ids", "positions", "valid",
                  "gather_map", "scatter_map"):
      assert_bitwise_equal(getattr(got, field), getattr(want, field),
                           f"{field} of a {mask.shape} {mask.dtype} mask, "
                           f"capacity {capacity}")


@needs_cuda_ffi
def test_cuda_metadata_under_jit_reports_dropped_rows(rng):
  mask = jnp.asarray(random_mask(rng, (16, 5000), 0.5))
  capacity = 1000  # far fewer than the active rows: the rest are dropped
  got, want = (jax.jit(lambda m: rlk_jax.pack_info(m, capacity=capacity,
                                                   implementation=i))(mask)
               for i in ("cuda_ffi", "xla"))
  assert int(got.num_dropped) == int(mask.sum()) - capacity
  for field in ("gather_map", "scatter_map", "positions", "segment_ids",
                "cu_seqlens", "max_seqlen", "valid"):
    assert_bitwise_equal(getattr(got, field), getattr(want, field), field)


@needs_cuda_ffi
@pytest.mark.parametrize("tail,dtype", [((), jnp.int32), ((3,), jnp.bfloat16),
                                        ((5,), jnp.float16), ((4096,), jnp.bfloat16),
                                        ((2, 3, 4), jnp.float32),
                                        ((7,), jnp.int8)])
def test_cuda_row_gather_every_row_width(tail, dtype, rng):
  mask = random_mask(rng, (6, 333), 0.4)
  x = random_array(rng, (6, 333, *tail), dtype)
  fill = -7
  packed, info = rlk_jax.pack(x, mask, capacity=int(mask.sum()) + 9,
                              fill_value=fill, implementation="cuda_ffi")
  assert_bitwise_equal(packed, numpy_pack(x, mask, int(mask.sum()) + 9, fill))
  dense = rlk_jax.unpack(packed, info, fill_value=3, implementation="cuda_ffi")
  assert_bitwise_equal(dense, numpy_unpack(packed, mask, int(mask.sum()) + 9, 3))


INFO_FIELDS = ("cu_seqlens", "seq_lens", "total", "max_seqlen", "num_dropped",
               "segment_ids", "positions", "valid", "gather_map", "scatter_map")


@needs_cuda_ffi
@pytest.mark.parametrize("tail,dtype", [((8,), jnp.bfloat16), ((3,), jnp.bfloat16),
                                        ((4,), jnp.float32), ((16,), jnp.int8)])
def test_cuda_pack_from_mask_equals_xla_rows_and_fields(tail, dtype, rng):
  # 16-byte rows of masks up to 65536 positions and 4096 sequences take the
  # one-kernel path; the rest (6-byte rows, longer masks, more sequences)
  # the metadata kernels and the gather: both must equal XLA's.
  cases = _mask_cases(rng) + [
      (random_mask(rng, (16, 4096), 0.3), 5000),   # 65536: the largest fused
      (random_mask(rng, (1, 65537), 0.3), None),   # one past it
      (random_mask(rng, (5000, 3), 0.6), None),    # too many sequences
      (random_mask(rng, (4096, 2), 0.6), 3000),    # just enough
      (random_mask(rng, (32, 1024), 0.3), 9856),
      (random_mask(rng, (7, 301), 0.4), 100),      # rows dropped
  ]
  for mask, capacity in cases:
    x = random_array(rng, (*mask.shape, *tail), dtype)
    where = f"a {mask.shape} {mask.dtype} mask, capacity {capacity}, {tail} {dtype}"
    pack = jax.jit(lambda x, m, i: rlk_jax.pack(
        x, m, capacity=capacity, fill_value=-3, implementation=i),
        static_argnums=2)
    got, got_info = pack(x, jnp.asarray(mask), "cuda_ffi")
    want, want_info = pack(x, jnp.asarray(mask), "xla")
    assert_bitwise_equal(got, want, f"packed rows of {where}")
    for field in INFO_FIELDS:
      assert_bitwise_equal(getattr(got_info, field), getattr(want_info, field),
                           f"{field} of {where}")


@needs_cuda_ffi
def test_cuda_pack_from_mask_gradient(rng):
  mask = random_mask(rng, (32, 1024), 0.3)
  capacity = int(mask.sum()) + 50
  x = random_array(rng, (32, 1024, 64), jnp.float32)
  w = random_array(rng, (capacity, 64), jnp.float32)
  g = jax.jit(jax.grad(lambda x: jnp.sum(rlk_jax.pack(
      x, mask, capacity=capacity, implementation="cuda_ffi")[0] * w)))(x)
  assert_bitwise_equal(g, numpy_unpack(w, mask, capacity, 0))
