"""Property tests (hypothesis): pack/unpack equal NumPy on drawn inputs."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import rlk_jax
from conftest import assert_bitwise_equal, pack_implementations
from test_pack import assert_info_matches, numpy_pack, numpy_unpack

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32]
TAILS = [(), (1,), (5,), (2, 3, 4), (17,)]


@st.composite
def packing_case(draw):
  b = draw(st.integers(1, 300))
  s = draw(st.integers(1, max(1, 3000 // b)))  # keeps the interpreter quick
  tail = draw(st.sampled_from(TAILS))
  dtype = draw(st.sampled_from(DTYPES))
  density = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]) | st.floats(0, 1))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  active = rng.random((b, s)) < density
  mask_kind = draw(st.sampled_from(["bool", "int8", "float"]))
  mask = {"bool": active, "int8": np.where(active, 2, 0).astype(np.int8),
          "float": np.where(active, 0.5, 0.0).astype(np.float32)}[mask_kind]
  n_active = int(active.sum())
  capacity = draw(st.sampled_from(
      [n_active, n_active + draw(st.integers(1, 200)), b * s]))
  if jnp.issubdtype(dtype, jnp.integer):
    x = rng.integers(-2**31, 2**31 - 1, size=(b, s, *tail), dtype=np.int32)
  else:
    x = (rng.standard_normal((b, s, *tail)) * 3).astype(np.float32)
  fill = draw(st.sampled_from([0, -1, 9]))
  return jnp.asarray(x).astype(dtype), mask, capacity, fill


def check_case(case, impl):
  x, mask, capacity, fill = case
  packed, info = rlk_jax.pack(x, mask, capacity=capacity, fill_value=fill,
                              implementation=impl)
  assert_bitwise_equal(packed, numpy_pack(x, mask, capacity, fill))
  assert_info_matches(info, mask, capacity)
  dense = rlk_jax.unpack(packed, info, fill_value=fill, implementation=impl)
  assert_bitwise_equal(dense, numpy_unpack(packed, mask, capacity, fill))


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Each example compiles afresh (~3 s on CI's cores); test_pack.py's grids
# cover the dtypes, tails and edges case by case.
@settings(max_examples=20, **_SETTINGS)
@given(packing_case())
def test_xla_matches_numpy(case):
  check_case(case, "xla")


@settings(max_examples=10, **_SETTINGS)
@given(packing_case())
def test_pallas_matches_numpy(case):
  check_case(case, "pallas")


@pytest.mark.gpu
@pytest.mark.skipif("cuda_ffi" not in pack_implementations(),
                    reason="needs the SM90 cuda_ffi library on a GPU")
@settings(max_examples=60, **_SETTINGS)
@given(packing_case())
def test_cuda_ffi_matches_numpy(case):
  check_case(case, "cuda_ffi")
