"""pack / unpack on a CUDA GPU at real sizes (run with `pytest -m gpu`).

The rest of the suite also runs on the GPU machine, where its "pallas" cases
go through the Triton lowering instead of the interpreter.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import ON_GPU, assert_bitwise_equal, random_array, random_mask
from test_pack import numpy_pack, numpy_unpack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU")]


def test_gpu_default_is_pallas():
  assert rlk_jax.selected_implementation("pack") == "pallas"


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


def test_pallas_equals_xla_bitwise(rng):
  mask = random_mask(rng, (32, 1024), 0.7)
  x = random_array(rng, (32, 1024, 1024), jnp.bfloat16)
  a, _ = rlk_jax.pack(x, mask, implementation="pallas")
  b, _ = rlk_jax.pack(x, mask, implementation="xla")
  assert_bitwise_equal(a, b)
