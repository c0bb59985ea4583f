"""rlk_jax.det_gemm: bitwise batch invariance, accuracy, gradients, errors.

Runs every implementation; on the CPU the Pallas kernel is interpreted, on a
GPU it goes through the Triton lowering.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import assert_bitwise_equal, random_array, relative_error

# Power-of-two and ragged K; N not a multiple of the 128-wide tile.
KS = (64, 512, 1000, 1024)
N = 200
M_FULL = 256


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("k", KS)
def test_rows_do_not_depend_on_the_batch(impl, k, rng):
  a = random_array(rng, (M_FULL, k), jnp.bfloat16)
  b = random_array(rng, (k, N), jnp.bfloat16)
  full = rlk_jax.det_gemm(a, b, implementation=impl)
  for m in (1, 2, 3, 7, 64, 129):
    start = int(rng.integers(0, M_FULL - m + 1))
    part = rlk_jax.det_gemm(a[start:start + m], b, implementation=impl)
    assert_bitwise_equal(part, full[start:start + m], f"M={m} at row {start}")


def test_chunked_equals_whole_and_padding_is_inert(impl, rng):
  k = 1000
  a = random_array(rng, (M_FULL, k), jnp.bfloat16)
  b = random_array(rng, (k, N), jnp.bfloat16)
  whole = rlk_jax.det_gemm(a, b, implementation=impl)
  # Chunked prefill: ragged chunks, computed one after another.
  bounds = np.cumsum([0, 50, 1, 77, 128])
  chunks = [rlk_jax.det_gemm(a[s:e], b, implementation=impl)
            for s, e in zip(bounds[:-1], bounds[1:])]
  assert_bitwise_equal(jnp.concatenate(chunks), whole)
  # The same rows with zero rows and random rows around them.
  zeros = jnp.zeros((37, k), a.dtype)
  noise = random_array(rng, (91, k), jnp.bfloat16)
  padded = jnp.concatenate([noise, a[:100], zeros, a[100:], noise[:5]])
  out = rlk_jax.det_gemm(padded, b, implementation=impl)
  assert_bitwise_equal(out[91:191], whole[:100])
  assert_bitwise_equal(out[228:228 + 156], whole[100:])


def test_leading_shapes_and_repeat_runs(impl, rng):
  a = random_array(rng, (4, 64, 512), jnp.bfloat16)
  b = random_array(rng, (512, N), jnp.bfloat16)
  flat = rlk_jax.det_gemm(a.reshape(256, 512), b, implementation=impl)
  out = rlk_jax.det_gemm(a, b, implementation=impl)
  assert out.shape == (4, 64, N)
  assert_bitwise_equal(out.reshape(256, N), flat)
  out4 = rlk_jax.det_gemm(a.reshape(2, 2, 64, 512), b, implementation=impl)
  assert_bitwise_equal(out4.reshape(256, N), flat)
  again = jax.jit(lambda a, b: rlk_jax.det_gemm(a, b, implementation=impl))(a, b)
  assert_bitwise_equal(again, out)
  assert_bitwise_equal(rlk_jax.det_gemm(a, b, implementation=impl), out)


@pytest.mark.parametrize("dtype,out_dtype,tol", [
    (jnp.bfloat16, jnp.bfloat16, 1e-2),
    (jnp.float16, jnp.float16, 2e-3),
    (jnp.bfloat16, jnp.float32, 1e-5),
    (jnp.float32, jnp.float32, 1e-5),  # TF32 would land near 3e-4
])
def test_accuracy_against_float64(impl, dtype, out_dtype, tol, rng):
  a = random_array(rng, (130, 1000), dtype)
  b = random_array(rng, (1000, 257), dtype)
  c = rlk_jax.det_gemm(a, b, out_dtype=out_dtype, implementation=impl)
  assert c.dtype == jnp.dtype(out_dtype) and c.shape == (130, 257)
  # Reference on the (already rounded) operands, in float64: what remains is
  # f32 accumulation and the final rounding to out_dtype.
  err = relative_error(c, f64(a) @ f64(b))
  assert err < tol, err
  if jnp.dtype(out_dtype) == jnp.bfloat16:
    assert err > 1e-4  # really rounded to bf16, not silently f32


def test_gradients_against_float64(impl, rng):
  a = random_array(rng, (70, 300), jnp.float32)
  b = random_array(rng, (300, 150), jnp.float32)
  g = random_array(rng, (70, 150), jnp.float32)
  _, vjp = jax.vjp(lambda a, b: rlk_jax.det_gemm(a, b, implementation=impl), a, b)
  da, db = vjp(g)
  assert relative_error(da, f64(g) @ f64(b).T) < 1e-6
  assert relative_error(db, f64(a).T @ f64(g)) < 1e-6


def test_check_grads_second_order(impl, rng):
  from jax.test_util import check_grads
  # Scaled so a @ b is O(1): tanh is curved there, not saturated, and float32
  # finite differences of second order resolve it.
  a = random_array(rng, (9, 70), jnp.float32) * 0.1
  b = random_array(rng, (70, 11), jnp.float32) * 0.1
  f = lambda a, b: jnp.tanh(rlk_jax.det_gemm(a, b, implementation=impl))
  check_grads(f, (a, b), order=2, modes=("rev",), atol=2e-2, rtol=2e-2)


def test_weight_gradient_is_deterministic_and_padding_inert(impl, rng):
  a = random_array(rng, (203, 96), jnp.bfloat16)
  b = random_array(rng, (96, 130), jnp.bfloat16)
  g = random_array(rng, (203, 130), jnp.bfloat16)

  def grads(a, g):
    _, vjp = jax.vjp(lambda a, b: rlk_jax.det_gemm(a, b, implementation=impl), a, b)
    return vjp(g)

  da, db = grads(a, g)
  da2, db2 = grads(a, g)
  assert_bitwise_equal(db2, db)
  assert_bitwise_equal(da2, da)
  # Zero rows appended to a and g (padding tokens) leave db's bits alone,
  # also when they spill into new row blocks.
  for extra in (1, 61, 200):
    a_pad = jnp.concatenate([a, jnp.zeros((extra, 96), a.dtype)])
    g_pad = jnp.concatenate([g, jnp.zeros((extra, 130), g.dtype)])
    da_pad, db_pad = grads(a_pad, g_pad)
    assert_bitwise_equal(db_pad, db, f"{extra} zero rows")
    assert_bitwise_equal(da_pad[:203], da, f"{extra} zero rows")
  # da is row-invariant like the forward.
  da_part, _ = grads(a[50:53], g[50:53])
  assert_bitwise_equal(da_part, da[50:53])


def test_vmap_and_remat(impl, rng):
  a = random_array(rng, (3, 40, 128), jnp.bfloat16)
  b = random_array(rng, (128, 72), jnp.bfloat16)
  f = lambda a: rlk_jax.det_gemm(a, b, implementation=impl)
  batched = jax.vmap(f)(a)
  for i in range(3):
    assert_bitwise_equal(batched[i], f(a[i]))
  loss = lambda a, b: jnp.sum(rlk_jax.det_gemm(a, b, implementation=impl)
                              .astype(jnp.float32) ** 2)
  plain = jax.grad(loss, argnums=(0, 1))(a, b)
  remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(a, b)
  for x, y in zip(plain, remat):
    assert_bitwise_equal(x, y)


@pytest.mark.parametrize("batched", ["both", "left", "right"])
def test_one_product_per_batch_element_under_vmap(batched, rng):
  # The batching rule of the "triton" route (jax-triton's call has none):
  # one unbatched product per batch element, however vmap batches.
  from rlk_jax import _det_gemm
  calls = []
  def product(a, b):
    calls.append((a.shape, b.shape))
    return jnp.dot(a, b, preferred_element_type=jnp.float32)
  call = _det_gemm._one_product_per_batch_element(product)
  a = random_array(rng, (3, 5, 16), jnp.float32)
  b = random_array(rng, (3, 16, 7), jnp.float32)
  axes = {"both": (0, 0), "left": (0, None), "right": (None, 0)}[batched]
  args = (a if axes[0] == 0 else a[1], b if axes[1] == 0 else b[2])
  got = jax.vmap(call, in_axes=axes)(*args)
  for i in range(3):
    want = product(args[0][i] if axes[0] == 0 else args[0],
                   args[1][i] if axes[1] == 0 else args[1])
    assert_bitwise_equal(got[i], want)
  assert all(len(sa) == 2 and len(sb) == 2 for sa, sb in calls), calls


def test_transposed_weight_layout(impl, rng):
  a = random_array(rng, (70, 1000), jnp.bfloat16)
  w = random_array(rng, (130, 1000), jnp.bfloat16)  # nn.Linear's [out, in]
  c = rlk_jax.det_gemm(a, w, transpose_b=True, implementation=impl)
  assert c.shape == (70, 130)
  assert relative_error(c, f64(a) @ f64(w).T) < 1e-2
  # The same bits as the [K, N] layout (same tiles, same K order), and row
  # invariance holds in this layout too.
  assert_bitwise_equal(rlk_jax.det_gemm(a, w.T, implementation=impl), c)
  assert_bitwise_equal(rlk_jax.det_gemm(a[5:8], w, transpose_b=True,
                                        implementation=impl), c[5:8])
  _, vjp = jax.vjp(lambda a, w: rlk_jax.det_gemm(
      a, w, transpose_b=True, out_dtype=jnp.float32, implementation=impl), a, w)
  g = random_array(rng, (70, 130), jnp.float32)
  da, dw = vjp(g)
  assert dw.shape == w.shape and da.shape == a.shape
  g_rounded = f64(g.astype(jnp.bfloat16))
  assert relative_error(dw, g_rounded.T @ f64(a)) < 1e-2
  assert relative_error(da, g_rounded @ f64(w)) < 1e-2
  with pytest.raises(ValueError, match=r"K=1000.*\(K=130, b read as \[N, K\]"):
    rlk_jax.det_gemm(a, w.T, transpose_b=True, implementation=impl)


@pytest.mark.parametrize("m,k,n", [(0, 64, 30), (5, 0, 30), (5, 64, 0), (1, 1, 1)])
def test_degenerate_shapes(impl, m, k, n, rng):
  a = random_array(rng, (m, k), jnp.float32)
  b = random_array(rng, (k, n), jnp.float32)
  c = rlk_jax.det_gemm(a, b, implementation=impl)
  assert c.shape == (m, n)
  np.testing.assert_allclose(np.asarray(c), f64(a) @ f64(b), rtol=1e-6, atol=0)


def test_bad_inputs():
  a = jnp.ones((4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"b must be rank 2.*\(8, 2, 3\)"):
    rlk_jax.det_gemm(a, jnp.ones((8, 2, 3), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"a has shape \(4, 8\) \(K=8\) and b has shape \(9, 3\) \(K=9, b read as \[K, N\]\)"):
    rlk_jax.det_gemm(a, jnp.ones((9, 3), jnp.bfloat16))
  with pytest.raises(ValueError, match="rank >= 1"):
    rlk_jax.det_gemm(jnp.ones((), jnp.bfloat16), jnp.ones((1, 3), jnp.bfloat16))
  with pytest.raises(TypeError, match="a has unsupported dtype int32"):
    rlk_jax.det_gemm(a.astype(jnp.int32), jnp.ones((8, 3), jnp.int32))
  with pytest.raises(TypeError, match=r"same dtype, got bfloat16 \(shape \(4, 8\)\) and float32"):
    rlk_jax.det_gemm(a, jnp.ones((8, 3), jnp.float32))
  with pytest.raises(TypeError, match="out_dtype int8"):
    rlk_jax.det_gemm(a, jnp.ones((8, 3), jnp.bfloat16), out_dtype=jnp.int8)
  with pytest.raises(ValueError, match="unknown implementation 'cublas'"):
    rlk_jax.det_gemm(a, jnp.ones((8, 3), jnp.bfloat16), implementation="cublas")


def test_dispatch():
  assert rlk_jax.selected_implementation("det_gemm", platform="cpu") == "xla"
  # On GPUs the SM90 kernels come first where they run (Hopper with the
  # library), then the jax-triton kernel, then Pallas's deprecated lowering.
  on_gpu = rlk_jax.implementations("det_gemm", platform="gpu")
  assert rlk_jax.selected_implementation("det_gemm", platform="gpu") == next(
      name for name in ("cuda_ffi", "triton", "pallas") if on_gpu[name] is None)
  assert rlk_jax.implementations("det_gemm", platform="tpu")["pallas"]


def test_pallas_config_choice_stays_among_bit_identical_configs():
  from pallas_kernels import det_matmul
  # The K order (BK) fixes the bits: every config the kernel may pick
  # shares it (their identity on a GPU is proven in test_det_gemm_gpu.py).
  assert {c.block_k for c in det_matmul.CONFIGS} == {64}
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    for m in (1, 3, 64, 65, 128, 1000, 4096, 100000):
      for n in (1, 257, 4096, 8448, 8449, 14336, 128256):
        cfg = det_matmul.choose_config(m, n, dtype)
        assert cfg in det_matmul.CONFIGS, (m, n, dtype, cfg)
        if dtype == jnp.float32:  # no identity promise across f32 tiles
          assert cfg == det_matmul.DEFAULT_CONFIG
  assert det_matmul.choose_config(16, 4096, jnp.bfloat16).block_m == 64
  assert det_matmul.choose_config(4096, 4096, jnp.bfloat16).block_n == 256
