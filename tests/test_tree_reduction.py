"""det_gemm's tensor-parallel-invariant mode on one device: the fixed tree's
order, its checks, accuracy, row invariance and gradients. (Its bits across
1, 2, 4 and 8 devices: sharded_tree_checks.py; torch's ranks:
test_tensor_parallel_torch.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import (assert_bitwise_equal, assert_row_windows_match,
                      random_array, relative_error)
from rlk_jax import _tree_reduction


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


class Term:
  """Records the order of `+` as a parenthesised expression."""

  def __init__(self, text):
    self.text = text

  def __add__(self, other):
    return Term(f"({self.text}+{other.text})")


def test_tree_sums_neighbours_first_earlier_chunk_left():
  root = _tree_reduction.tree_sum(Term(f"p{i}") for i in range(8))
  assert root.text == "(((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)))"
  # A rank holding 2 of 8 chunks sums a subtree of the same tree: the 4
  # ranks' roots finish it identically.
  ranks = [_tree_reduction.tree_sum([Term(f"p{2 * r}"), Term(f"p{2 * r + 1}")])
           for r in range(4)]
  assert _tree_reduction.tree_sum(ranks).text == root.text
  with pytest.raises(ValueError, match="power-of-two number of partials, got 3"):
    _tree_reduction.tree_sum([Term("a")] * 3)


@pytest.mark.parametrize("chunks,k,n,match", [
    (3, 96, 48, "power of two"),
    (0, 96, 48, "power of two"),
    (True, 96, 48, "power of two"),
    (8, 100, 48, "must divide K=100"),
    (8, 96, 44, "must divide N=44"),
])
def test_bad_chunks_raise_naming_the_sizes(chunks, k, n, match):
  a = jnp.ones((4, k), jnp.float32)
  b = jnp.ones((k, n), jnp.float32)
  with pytest.raises(ValueError, match=match):
    rlk_jax.det_gemm(a, b, reduction_chunks=chunks)


def test_ranks_must_hold_whole_subtrees():
  _tree_reduction.check_ranks(8, 4, "x")
  with pytest.raises(ValueError, match="3 ranks cannot each hold"):
    _tree_reduction.check_ranks(8, 3, "x")


@pytest.mark.parametrize("dtype,out_dtype,tol", [
    (jnp.float32, jnp.float32, 1e-6), (jnp.bfloat16, jnp.float32, 1e-6),
    (jnp.bfloat16, jnp.bfloat16, 1e-2)])
def test_accuracy_against_float64(impl, dtype, out_dtype, tol, rng):
  a = random_array(rng, (37, 512), dtype)   # ragged M, power-of-two K
  b = random_array(rng, (512, 72), dtype)
  c = rlk_jax.det_gemm(a, b, out_dtype=out_dtype, implementation=impl,
                       reduction_chunks=8)
  assert c.dtype == out_dtype
  assert relative_error(c, f64(a) @ f64(b)) < tol


def test_the_mode_is_the_tree_of_f32_chunk_products(impl, rng):
  a = random_array(rng, (29, 256), jnp.bfloat16)
  w = random_array(rng, (40, 256), jnp.bfloat16)   # [N, K], nn.Linear's
  chunk = lambda c: rlk_jax.det_gemm(
      a[:, 64 * c:64 * (c + 1)], w[:, 64 * c:64 * (c + 1)], transpose_b=True,
      out_dtype=jnp.float32, implementation=impl)
  parts = [np.asarray(chunk(c)) for c in range(4)]
  want = ((parts[0] + parts[1]) + (parts[2] + parts[3])).astype(jnp.bfloat16)
  got = rlk_jax.det_gemm(a, w, transpose_b=True, implementation=impl,
                         reduction_chunks=4)
  assert_bitwise_equal(got, want)
  # One chunk is the default order.
  assert_bitwise_equal(
      rlk_jax.det_gemm(a, w, transpose_b=True, implementation=impl,
                       reduction_chunks=1),
      rlk_jax.det_gemm(a, w, transpose_b=True, implementation=impl))


def test_rows_stay_invariant(impl, rng):
  a = random_array(rng, (53, 128), jnp.bfloat16)
  b = random_array(rng, (128, 24), jnp.bfloat16)
  gemm = jax.jit(functools.partial(rlk_jax.det_gemm, implementation=impl,
                                   reduction_chunks=8))
  assert_row_windows_match(gemm, a, b, gemm(a, b), (1, 7, 33), rng)


def test_gradients_cut_the_input_gradient_over_n(impl, rng):
  m, k, n, chunks = 19, 128, 64, 4
  a = random_array(rng, (m, k), jnp.bfloat16)
  w = random_array(rng, (n, k), jnp.bfloat16)
  g = random_array(rng, (m, n), jnp.bfloat16)
  mode = functools.partial(rlk_jax.det_gemm, transpose_b=True,
                           implementation=impl, reduction_chunks=chunks)
  da, dw = jax.jit(lambda a, w, g: jax.vjp(mode, a, w)[1](g))(a, w, g)
  # da = g @ w reduces over N: the same tree, over N's chunks.
  assert_bitwise_equal(da, rlk_jax.det_gemm(g, w, implementation=impl,
                                            reduction_chunks=chunks))
  # dw = g^T a reduces over rows: the default product.
  default = functools.partial(rlk_jax.det_gemm, transpose_b=True,
                              implementation=impl)
  assert_bitwise_equal(dw, jax.vjp(default, a, w)[1](g)[1])
  assert relative_error(da, f64(g) @ f64(w)) < 1e-2
  assert relative_error(dw, f64(g).T @ f64(a)) < 1e-2


def test_leading_dims_and_vmap(rng):
  a = random_array(rng, (3, 5, 64), jnp.float32)
  b = random_array(rng, (64, 16), jnp.float32)
  mode = functools.partial(rlk_jax.det_gemm, implementation="xla",
                           reduction_chunks=2)
  whole = mode(a, b)
  assert whole.shape == (3, 5, 16)
  assert_bitwise_equal(jax.vmap(mode, in_axes=(0, None))(a, b), whole)
  assert_bitwise_equal(whole[1], mode(a[1], b))


@pytest.mark.gpu
@pytest.mark.parametrize("m,chunks", [(1, 8), (8, 2), (8, 8), (300, 8),
                                      (1024, 4)])
def test_every_gpu_route_and_torch_give_one_set_of_bits(m, chunks, rng):
  # JAX's Triton and cuda_ffi (where built) and torch's Triton run every
  # chunk in one launch and the tree in a second (the bf16 output: the f32
  # root rounded once, in the kernel); Pallas runs a product per chunk. One
  # set of bits, forward and gradients.
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  import torch
  import rlk_torch_bridge
  from rlk_jax import _det_gemm
  k, n = 1024, 512
  x = random_array(rng, (m, k), jnp.bfloat16)
  w = random_array(rng, (n, k), jnp.bfloat16)
  g = random_array(rng, (m, n), jnp.bfloat16)
  impls = [name for name in ("triton", "pallas", "cuda_ffi")
           if _det_gemm.TABLE.unavailable_reason(name, "gpu") is None]
  assert "triton" in impls, impls
  runs = {}
  for impl in impls:
    mode = functools.partial(rlk_jax.det_gemm, transpose_b=True,
                             implementation=impl, reduction_chunks=chunks)
    y, vjp = jax.vjp(mode, x, w)
    runs[impl] = (y, *vjp(g))
  for impl in impls[1:]:
    for name, a, b in zip(("y", "dx", "dw"), runs[impl], runs["triton"]):
      assert_bitwise_equal(a, b, f"{impl} vs triton: {name}")
  # Under vmap each element is its own call (the fused launch has no
  # batching rule of its own): the same bits.
  batched = jax.vmap(functools.partial(
      rlk_jax.det_gemm, transpose_b=True, implementation="triton",
      reduction_chunks=chunks), in_axes=(0, None))(jnp.stack([x, -x]), w)
  assert_bitwise_equal(batched[0], runs["triton"][0], "vmap")
  # (Negation is exact through products, sums and rounding.)
  assert_bitwise_equal(batched[1], -runs["triton"][0], "vmap, -x")
  to_torch = lambda t: torch.from_dlpack(np.asarray(t.astype(jnp.float32))
                                         ).cuda().bfloat16()
  tx, tw = to_torch(x).requires_grad_(True), to_torch(w).requires_grad_(True)
  ty = rlk_torch_bridge.det_gemm(tx, tw, transpose_b=True,
                                 implementation="triton",
                                 reduction_chunks=chunks)
  ty.backward(to_torch(g))
  for name, a, b in zip(("y", "dx", "dw"), (ty, tx.grad, tw.grad),
                        runs["triton"]):
    assert_bitwise_equal(a.detach().float().cpu().numpy(),
                         np.asarray(b.astype(jnp.float32)), f"torch: {name}")
  assert relative_error(runs["triton"][0], f64(x) @ f64(w).T) < 1e-2


# linear_logp's vocabulary-parallel mode (vocab_chunks) on one device.

def dense_logp(hidden, weight, targets, temps):
  x = f64(hidden) @ f64(weight) / np.asarray(temps, np.float64)[:, None]
  lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
  p = np.exp(x - lse[:, None])
  picked = x[np.arange(len(x)), np.clip(targets, 0, x.shape[1] - 1)]
  return picked - lse, lse - (p * x).sum(1), x, p


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_vocab_mode_accurate_against_float64(impl, rng):
  n, h, v = 13, 64, 128
  hidden = random_array(rng, (n, h), jnp.float32)
  weight = random_array(rng, (h, v), jnp.float32) / 8
  targets = np.asarray(rng.integers(0, v, n))
  temps = rng.uniform(0.5, 1.5, n).astype(np.float32)
  g = random_array(rng, (n,), jnp.float32)
  g_ent = random_array(rng, (n,), jnp.float32)
  fn = lambda h_, w_: rlk_jax.linear_logp(
      h_, w_, jnp.asarray(targets), temperature=jnp.asarray(temps),
      return_entropy=True, implementation=impl, vocab_chunks=4)
  (logp, entropy), vjp = jax.vjp(fn, hidden, weight)
  dh, dw = vjp((g, g_ent))
  want_logp, want_entropy, x, p = dense_logp(hidden, weight, targets, temps)
  assert relative_error(logp, want_logp) < 1e-5
  # lse - E[x] cancels where the entropy is small: an f32 ulp of lse.
  assert relative_error(entropy, want_entropy) < 1e-4
  onehot = np.eye(v)[targets]
  mean = (p * x).sum(1, keepdims=True)
  dlogits = (f64(g)[:, None] * (onehot - p)
             - f64(g_ent)[:, None] * p * (x - mean)) / temps[:, None]
  # The entropy term's x - E[x] cancels in f32; with E[x] combined over the
  # chunks (lse - entropy, each an f32 rounding) d hidden is about 10x less
  # accurate than the default mode's (31 seeds, 2026-11-28: median 2.1e-5,
  # worst 1.08e-4; the default mode 2.2e-6 and 8.6e-6; d weight alike). A
  # known gap (#50), bounded here rather than at the default mode's 5e-5.
  assert relative_error(dh, dlogits @ f64(weight).T) < 3e-4
  assert relative_error(dw, f64(hidden).T @ dlogits) < 3e-4


def test_vocab_mode_rows_invariant_ignored_and_bad_targets(rng):
  n, h, v = 20, 32, 64
  hidden = random_array(rng, (n, h), jnp.float32)
  weight = random_array(rng, (h, v), jnp.float32) / 8
  targets = jnp.asarray(rng.integers(0, v, n)).at[2].set(-100)
  mode = jax.jit(functools.partial(rlk_jax.linear_logp, implementation="xla",
                                   vocab_chunks=8))
  full = mode(hidden, weight, targets)
  assert float(full[2]) == 0.0  # ignore_index: log-prob 0
  for start, m in ((0, 1), (5, 7), (3, 17)):
    assert_bitwise_equal(mode(hidden[start:start + m], weight,
                              targets[start:start + m]),
                         full[start:start + m], f"rows {start}:{start + m}")
  bad = mode(hidden, weight, targets.at[4].set(v))
  assert np.isnan(float(bad[4])) and not np.isnan(np.asarray(bad)[5:]).any()
  with pytest.raises(ValueError, match="vocab_chunks must be a power of two"):
    rlk_jax.linear_logp(hidden, weight, targets, vocab_chunks=3)
  with pytest.raises(ValueError, match="must divide V=64"):
    rlk_jax.linear_logp(hidden, weight, targets, vocab_chunks=128)
