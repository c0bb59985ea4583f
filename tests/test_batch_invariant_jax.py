"""rlk_jax.batch_invariant: an unmodified JAX function's products and
last-axis sums rewritten onto rlk's row-invariant ops (CPU: det_gemm's
K-loop reference and the row kernel's order in jnp)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from rlk_jax import reference

D, HEADS, FF, VOCAB = 32, 4, 48, 61


def _params(key):
  ks = jax.random.split(key, 7)
  normal = lambda k, shape, scale: jax.random.normal(k, shape) * scale
  return {
      "embed": normal(ks[0], (VOCAB, D), 1.0),
      "qkv": normal(ks[1], (D, 3 * D), D ** -0.5),
      "o": normal(ks[2], (D, D), D ** -0.5),
      "up": normal(ks[3], (D, FF), D ** -0.5),
      "down": normal(ks[4], (FF, D), FF ** -0.5),
      "norm": 1.0 + normal(ks[5], (D,), 0.1),
      "head": normal(ks[6], (D, VOCAB), D ** -0.5),
  }


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _decoder(params, tokens):
  """A one-layer causal decoder written the plain way (einsum attention,
  softmax, RMSNorm, a jitted MLP): logits [B, S, V]."""
  x = params["embed"][tokens]
  b, s, _ = x.shape
  h = _rms_norm(x, params["norm"])
  q, k, v = jnp.split(h @ params["qkv"], 3, axis=-1)
  split = lambda t: t.reshape(b, s, HEADS, D // HEADS)
  q, k, v = split(q), split(k), split(v)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
  causal = jnp.tril(jnp.ones((s, s), bool))
  p = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  att = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, D)
  x = x + att @ params["o"]
  mlp = jax.jit(lambda t: jax.nn.silu(t @ params["up"]) @ params["down"])
  x = x + mlp(_rms_norm(x, params["norm"]))
  return _rms_norm(x, params["norm"]) @ params["head"]


def _decoder_float64(params, tokens):
  """_decoder in NumPy float64: the accuracy reference."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  norm = lambda x: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * p[
      "norm"]
  x = p["embed"][tokens]
  b, s, _ = x.shape
  q, k, v = np.split(norm(x) @ p["qkv"], 3, axis=-1)
  split = lambda t: t.reshape(b, s, HEADS, D // HEADS)
  scores = np.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(
      D // HEADS)
  scores = np.where(np.tril(np.ones((s, s), bool)), scores, -1e9)
  e = np.exp(scores - scores.max(-1, keepdims=True))
  att = np.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), split(v))
  x = x + att.reshape(b, s, D) @ p["o"]
  u = norm(x) @ p["up"]
  x = x + (u / (1 + np.exp(-u))) @ p["down"]
  return norm(x) @ p["head"]


def _full_f32():
  """XLA's own products at full f32 for the accuracy references: on a GPU
  its default f32 dot rounds the operands to TF32 (errors of 1e-3), where
  det_gemm keeps f32."""
  return jax.default_matmul_precision("highest")


def _ops(fn, *args):
  """The primitive names of fn's jaxpr, nested jaxprs included."""
  names = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      names.append((eqn.primitive.name, eqn))
      for value in eqn.params.values():
        for v in (value if isinstance(value, (tuple, list)) else (value,)):
          if hasattr(v, "eqns"):
            walk(v)
          elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            walk(v.jaxpr)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


def _last_axis_sums(fn, *args):
  return [e for name, e in _ops(fn, *args) if name == "reduce_sum"
          and tuple(e.params["axes"]) == (e.invars[0].aval.ndim - 1,)]


@pytest.fixture
def params():
  return _params(jax.random.PRNGKey(0))


def _tokens(seed, b, s):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, s), 0, VOCAB)


def test_rows_alone_equal_their_batch_and_float64(params):
  tokens = _tokens(1, 7, 11)  # ragged: 7 rows of 11 tokens
  model = jax.jit(rlk_jax.batch_invariant(_decoder))
  batch = np.asarray(model(params, tokens))
  for lo, hi in ((0, 1), (3, 4), (6, 7), (2, 5)):
    alone = np.asarray(model(params, tokens[lo:hi]))
    np.testing.assert_array_equal(alone.view(np.uint32),
                                  batch[lo:hi].view(np.uint32))
  want = _decoder_float64(params, np.asarray(tokens))
  err = np.linalg.norm(batch - want) / np.linalg.norm(want)
  assert err < 1e-5, err


def test_every_product_and_last_axis_sum_is_rewritten(params):
  tokens = _tokens(2, 3, 5)
  plain = [n for n, _ in _ops(_decoder, params, tokens)]
  assert plain.count("dot_general") == 7  # qkv, scores, p v, o, up, down, head
  assert len(_last_axis_sums(_decoder, params, tokens)) == 4  # 3 norms, softmax
  model = rlk_jax.batch_invariant(_decoder)
  # On CPU det_gemm is its K loop of multiply-adds: no dot is left at all.
  assert "dot_general" not in [n for n, _ in _ops(model, params, tokens)]
  assert not _last_axis_sums(model, params, tokens)
  assert model.report(params, tokens) == {}


def test_mixed_precision_and_batch_dims_follow_dot_general(params):
  # bf16 operands with an f32 result, two batch dims and contracting
  # dims on either side: the same values as XLA's dot, up to rounding.
  key = jax.random.split(jax.random.PRNGKey(3), 2)
  a = jax.random.normal(key[0], (2, 5, 3, 16)).astype(jnp.bfloat16)
  b = jax.random.normal(key[1], (3, 16, 2, 7)).astype(jnp.bfloat16)

  def f(a, b):
    return jax.lax.dot_general(a, b, (((3,), (1,)), ((0, 2), (2, 0))),
                               preferred_element_type=jnp.float32)
  got = rlk_jax.batch_invariant(f)(a, b)
  want = f(a.astype(jnp.float32), b.astype(jnp.float32))
  assert got.dtype == jnp.float32 and got.shape == want.shape == (2, 3, 5, 7)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5)


def test_composes_with_scan_while_cond_checkpoint_and_vmap(params):
  w = params["o"]

  def f(x):
    def body(c, _):
      return jnp.tanh(c @ w), jnp.mean(c, -1)
    c, means = jax.lax.scan(body, x, None, length=3)
    c = jax.checkpoint(lambda t: _rms_norm(t @ w, 1.0))(c)
    c, _ = jax.lax.while_loop(lambda v: v[1] < 2,
                              lambda v: (jnp.tanh(v[0] @ w), v[1] + 1), (c, 0))
    c = jax.lax.cond(c[0, 0] > 0, lambda t: t @ w, lambda t: -t, c)
    return c, means

  x = jax.random.normal(jax.random.PRNGKey(4), (5, D))
  g = jax.jit(rlk_jax.batch_invariant(f))
  got, means = g(x)
  with _full_f32():  # the plain function at f32 accuracy, not TF32
    want, want_means = f(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(means), np.asarray(want_means),
                             rtol=1e-5, atol=1e-6)
  assert not [n for n, _ in _ops(rlk_jax.batch_invariant(f), x)
              if n == "dot_general"]
  # vmap over the transformed function: each mapped row = it alone.
  rows = jax.jit(jax.vmap(rlk_jax.batch_invariant(lambda r: f(r[None])[0])))(x)
  for i in (0, 3):
    alone = g(x[i:i + 1])[0]
    np.testing.assert_array_equal(np.asarray(rows[i]), np.asarray(alone))


def test_gradients_outside_and_inside(params):
  tokens = _tokens(5, 6, 9)

  def loss(p, t):
    logits = _decoder(p, t)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0])

  # Outside grad: the backward's products and sums are rewritten too. A
  # sequence's input-side gradient (its embedding rows) alone = in the
  # batch; the weight gradient is the same run to run.
  grad = jax.jit(rlk_jax.batch_invariant(jax.grad(loss)))
  assert not [n for n, _ in _ops(rlk_jax.batch_invariant(jax.grad(loss)),
                                 params, tokens) if n == "dot_general"]
  g_batch = grad(params, tokens)
  g_again = grad(params, tokens)
  for name in params:
    np.testing.assert_array_equal(np.asarray(g_batch[name]),
                                  np.asarray(g_again[name]))
  with _full_f32():
    want = jax.grad(loss)(params, tokens)
  for name in params:
    err = (np.linalg.norm(np.asarray(g_batch[name] - want[name]))
           / np.linalg.norm(np.asarray(want[name])))
    assert err < 1e-4, (name, err)
  # Inside grad: det_gemm's own backward runs the products.
  inside = jax.jit(jax.grad(rlk_jax.batch_invariant(loss)))(params, tokens)
  for name in params:
    err = (np.linalg.norm(np.asarray(inside[name] - want[name]))
           / np.linalg.norm(np.asarray(want[name])))
    assert err < 1e-4, (name, err)


def test_row_gradient_alone_equals_its_batch(params):
  # The per-sequence input gradient (through the embeddings' output: the
  # hidden rows) of a sequence alone and in the batch.
  tokens = _tokens(6, 5, 7)

  def per_row_loss(x):
    h = _rms_norm(x, params["norm"])
    return jnp.sum(jnp.tanh(h @ params["up"]) @ params["down"])

  grad = jax.jit(rlk_jax.batch_invariant(jax.grad(per_row_loss)))
  x = params["embed"][tokens]
  batch = np.asarray(grad(x))
  for i in (0, 2, 4):
    np.testing.assert_array_equal(np.asarray(grad(x[i:i + 1]))[0], batch[i])


def test_report_names_what_it_left():
  @jax.custom_vjp
  def custom(a, b):
    return a @ b
  custom.defvjp(lambda a, b: (a @ b, (a, b)),
                lambda res, g: (g @ res[1].T, res[0].T @ g))

  def f(x, w, n):
    # (A sum over a size-1 axis has one addend: exact, and not reported.)
    return (custom(x, w), n @ n, jnp.sum(x, axis=0), jnp.sum(x @ w, -1),
            jnp.sum(x[:, None, :], axis=1))
  x = jnp.ones((3, 4))
  w = jnp.ones((4, 2))
  n = jnp.ones((2, 2), jnp.int32)
  left = rlk_jax.batch_invariant(f).report(x, w, n)
  assert left == {
      "custom_vjp_call: its body has products or sums, left as they are "
      "(its forward and backward are the function's own)": 1,
      "dot_general of int32 x int32 -> int32": 1,
      "reduce_sum over axes (0,) of a rank-2 array": 1,
  }, left
  out = rlk_jax.batch_invariant(f)(x, w, n)
  for got, want in zip(out, f(x, w, n)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mode", ["promise_in_bounds", "drop", "clip"])
def test_embedding_gradient_scatter_add_is_ordered(mode):
  # An embedding's backward is a scatter-add, which XLA's GPU backend runs
  # with atomics (other bits run to run): rewritten into a sorted,
  # segmented sum. Repeated ids, ids out of range (dropped, or clipped),
  # float64 accuracy, and no scatter-add left in the jaxpr.
  rng = np.random.default_rng(5)
  table = jnp.asarray(rng.normal(size=(37, 6)), jnp.float32)
  ids = rng.integers(0, 37, (4, 23))
  ids[0, :5] = 3  # one row many times
  if mode != "promise_in_bounds":
    ids[1, 2], ids[2, 7] = 37, 45  # (a negative id wraps, as in NumPy)
  ids = jnp.asarray(ids)
  g_out = jnp.asarray(rng.normal(size=(4, 23, 6)), jnp.float32)

  def loss(table):
    return jnp.sum(table.at[ids].get(mode=mode) * g_out)

  grad = rlk_jax.batch_invariant(jax.grad(loss))
  assert "scatter-add" not in [n for n, _ in _ops(grad, table)]
  got = np.asarray(jax.jit(grad)(table))
  want = np.zeros((37, 6))
  for i, row in np.ndenumerate(np.asarray(ids)):
    r = min(max(row, 0), 36) if mode == "clip" else row
    if 0 <= r < 37:
      want[r] += np.asarray(g_out, np.float64)[i]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got, np.asarray(jax.jit(grad)(table)))


@pytest.mark.parametrize("k", [1, 255, 256, 1000, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_sum_rows_alone_equal_batch_and_float64(k, dtype):
  x = (jax.random.normal(jax.random.PRNGKey(k), (9, k)) * 3).astype(dtype)
  s = np.asarray(jax.jit(reference.row_sum)(x))
  for i in (0, 4, 8):
    alone = np.asarray(jax.jit(reference.row_sum)(x[i:i + 1]))
    np.testing.assert_array_equal(alone.view(np.uint32),
                                  s[i:i + 1].view(np.uint32))
  want = np.asarray(x, np.float64).sum(-1)
  np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name,want,ulps", [
    ("exp", np.exp, 1.2), ("logistic", lambda v: 1 / (1 + np.exp(-v)), 2.5),
    ("tanh", np.tanh, 1.5)])
def test_per_element_references_against_float64(name, want, ulps):
  # Within a few ulp where the result is normal; the edges as the
  # functions' own.
  fn = getattr(reference, name)
  x = np.concatenate([np.linspace(-87.0, 88.7, 100_003),
                      np.random.default_rng(0).standard_normal(50_000) * 6,
                      np.logspace(-30, 0, 500), -np.logspace(-30, 0, 500)])
  x = x.astype(np.float32)
  got = np.asarray(jax.jit(fn)(x), np.float64)
  with np.errstate(over="ignore"):
    w = want(x.astype(np.float64))
  normal = (np.abs(w) > 1e-37) & (np.abs(w) < 3e38)
  err = np.abs(got - w)[normal] / np.spacing(
      np.abs(w[normal]).astype(np.float32))
  assert err.max() <= ulps
  edges = np.array([np.inf, -np.inf, 0.0], np.float32)
  with np.errstate(over="ignore"):
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(edges)),
                                  want(edges.astype(np.float64)))
  assert np.isnan(np.asarray(jax.jit(fn)(np.float32([np.nan])))).all()


def test_log_reference_against_float64():
  # Every positive float32 range by its bits, subnormals included (XLA:CPU
  # reads those as zero in arithmetic; the reference reads their bits):
  # within 1 ulp. The edges as numpy's log.
  rng = np.random.default_rng(1)
  x = rng.integers(1, 0x7F800000, 1_000_000, dtype=np.int64).astype(
      np.uint32).view(np.float32)
  x = np.concatenate([x, rng.uniform(0.5, 2.0, 200_000).astype(np.float32),
                      np.float32([1.0, 2.0, 0.5, 1.4e-45, 3.4e38])])
  got = np.asarray(jax.jit(reference.log)(x), np.float64)
  want = np.log(x.astype(np.float64))
  nonzero = want != 0
  err = np.abs(got - want)[nonzero] / np.spacing(
      np.abs(want[nonzero]).astype(np.float32))
  assert err.max() <= 1.0
  assert got[x == 1.0].tolist() == [0.0]
  edges = np.float32([0.0, -0.0, np.inf])
  np.testing.assert_array_equal(np.asarray(jax.jit(reference.log)(edges)),
                                [-np.inf, -np.inf, np.inf])
  bad = np.float32([-1.0, -np.inf, np.nan, -1.4e-45])
  assert np.isnan(np.asarray(jax.jit(reference.log)(bad))).all()


@pytest.mark.parametrize("name,want,low,ulps", [
    ("log1p", np.log1p, -1.0, 2.5), ("expm1", np.expm1, -87.0, 2.5),
    ("rsqrt", lambda v: 1 / np.sqrt(v), 0.0, 1.5)])
def test_more_per_element_references_against_float64(name, want, low, ulps):
  # Over each function's domain: small arguments (where log1p and expm1
  # need their forms), the bulk, large ones; the edges as numpy's.
  rng = np.random.default_rng(2)
  x = np.concatenate([rng.standard_normal(100_000) * 1e-7,
                      rng.standard_normal(100_000) * 1e-3,
                      np.linspace(-87.0, 88.0, 100_001),
                      np.logspace(-30, 30, 10_000)]).astype(np.float32)
  x = x[x > low]
  fn = getattr(reference, name)
  got = np.asarray(jax.jit(fn)(x), np.float64)
  with np.errstate(over="ignore", divide="ignore"):
    w = want(x.astype(np.float64))
  normal = (np.abs(w) > 1e-37) & (np.abs(w) < 3e38)
  err = np.abs(got - w)[normal] / np.spacing(
      np.abs(w[normal]).astype(np.float32))
  assert err.max() <= ulps
  edges = np.float32([np.inf, 0.0, -0.0])
  with np.errstate(over="ignore", divide="ignore"):
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(edges)),
                                  want(edges.astype(np.float64)))


def test_rewritten_transcendentals_differentiate_by_their_own_rules():
  # `log` reads its argument's bits (autodiff alone would see constants):
  # the gradient of the rewritten function is the plain function's.
  def f(x):
    return jnp.sum(jnp.log(x) + jnp.log1p(x) + jnp.expm1(-x)
                   + jax.lax.rsqrt(x) + jnp.exp(-x) + jnp.tanh(x))
  x = jnp.asarray(np.random.default_rng(3).uniform(0.1, 4.0, (5, 33)),
                  jnp.float32)
  got = np.asarray(jax.jit(jax.grad(rlk_jax.batch_invariant(f)))(x))
  want = np.asarray(jax.grad(f)(np.asarray(x, np.float64)))
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6


@pytest.mark.parametrize("fn", [
    lambda s: jax.lax.rsqrt(jnp.abs(s) + jnp.max(jnp.abs(s), -1,
                                                  keepdims=True)),
    lambda s: jnp.log1p(jnp.abs(s) * jnp.max(jnp.abs(s), -1, keepdims=True)),
    lambda s: jnp.expm1(s - jnp.max(s, -1, keepdims=True)),
    lambda s: jnp.tanh(s - jnp.max(s, -1, keepdims=True)),
    lambda s: jax.nn.sigmoid(s * jnp.max(s, -1, keepdims=True)),
    lambda s: jnp.log(jnp.abs(s) + jnp.max(jnp.abs(s), -1, keepdims=True)),
    lambda s: jax.nn.log_softmax(s, -1)],
    ids=["rsqrt", "log1p", "expm1", "tanh", "logistic", "log",
         "log_softmax"])
def test_fused_transcendentals_rows_alone_equal_their_batch(fn):
  # Fused after a broadcast, XLA:CPU's rsqrt, log1p, expm1, tanh, logistic
  # and log gave a row other bits alone than in its batch (hundreds to
  # thousands of values on these shapes, 2026-11-27: log 235-252,
  # log_softmax's s - log(sum) about 800, rsqrt 3358 over four shapes);
  # rewritten, never.
  for shape in [(8, 2, 2, 12, 12), (8, 12, 64)]:
    x = jax.random.normal(jax.random.PRNGKey(shape[1]), shape) * 3
    run = jax.jit(rlk_jax.batch_invariant(fn))
    batch = np.asarray(run(x))
    for i in (0, 5):
      alone = np.asarray(run(x[i:i + 1]))
      np.testing.assert_array_equal(alone[0].view(np.uint32),
                                    batch[i].view(np.uint32))
    want = np.asarray(fn(np.asarray(x, np.float64)))
    assert np.linalg.norm(batch - want) / np.linalg.norm(want) < 1e-6


@pytest.mark.parametrize("shape", [(4, 1, 64), (1, 1, 64), (3, 5, 16)])
def test_divisions_are_true_divisions_at_every_shape(shape, rng):
  # XLA's simplifier turns `x / broadcast(y)` into `x * broadcast(1 / y)`
  # and `x / sqrt(y)` into `x * rsqrt(y)` where its pattern matches, which
  # follows the shapes around it (Tunix's Qwen 3 rope: a decode step's
  # logits alone differed from its batch's). Plain jit on CPU gave other
  # bits than the quotient on every shape here (2-150 values, 2026-11-27);
  # rewritten, each element is numpy's correctly rounded f32 quotient.
  x = rng.normal(size=shape).astype(np.float32)
  y = rng.uniform(0.5, 3.0, size=shape[:-1] + (1,)).astype(np.float32)
  for fn, want in ((lambda x, y: x / y, x / y),
                   (lambda x, y: x / jnp.sqrt(y), x / np.sqrt(y))):
    got = np.asarray(jax.jit(rlk_jax.batch_invariant(fn))(x, y))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  got = jax.grad(lambda y: jnp.sum(rlk_jax.batch_invariant(
      lambda x, y: x / jnp.sqrt(y))(x, y)))(y)
  terms = -0.5 * x / (y.astype(np.float64) ** 1.5)
  want = np.sum(terms, -1, keepdims=True)
  # An f32 sum of n terms errs by up to about n ulps of the sum of their
  # magnitudes, which a sum that cancels (random signs) can dwarf: the
  # bound is relative to that, not to the sum (a 64-term row failed 1e-6
  # of its sum by 2.3x, 2026-11-28).
  bound = shape[-1] * 2.0**-23 * np.sum(np.abs(terms), -1, keepdims=True)
  assert np.all(np.abs(got - want) <= bound), (got, want, bound)


@pytest.mark.parametrize("shape", [(8, 2, 2, 12, 12), (8, 4, 12, 16)])
def test_softmax_rows_alone_equal_their_batch(shape):
  # A softmax's exp(s - max) fused by XLA:CPU: plain jit gave a row other
  # bits alone (hundreds of values on these shapes, 2026-11-27); rewritten,
  # never. Fresh inputs per shape; and close to the plain softmax.
  x = jax.random.normal(jax.random.PRNGKey(shape[-1]), shape) * 3
  for dtype in (jnp.float32, jnp.bfloat16):
    run = jax.jit(rlk_jax.batch_invariant(
        lambda s: jax.nn.softmax(s.astype(dtype), axis=-1)))
    batch = np.asarray(run(x), np.float32)
    for i in (0, 3, 7):
      alone = np.asarray(run(x[i:i + 1]), np.float32)
      np.testing.assert_array_equal(alone[0].view(np.uint32),
                                    batch[i].view(np.uint32))
    # Against float64 by relative norm.
    s64 = np.asarray(x.astype(dtype), np.float64)
    e = np.exp(s64 - s64.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    err = np.linalg.norm(batch - want) / np.linalg.norm(want)
    assert err < (1e-6 if dtype == jnp.float32 else 1e-2)


def test_batched_products_folded_into_one_call_keep_each_elements_bits(
    monkeypatch):
  # A small batched product (attention's at decode) runs as one det_gemm
  # call over every batch pair, keeping the diagonal blocks: the same bits
  # as one call per batch element, and as a batch element alone.
  from rlk_jax import _batch_invariant
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  q = jax.random.normal(keys[0], (3, 5, 2, 2, 16)).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (3, 7, 2, 16)).astype(jnp.bfloat16)

  def scores(q, k):
    return jnp.einsum("BTHGD,BSHD->BHGTS", q, k,
                      preferred_element_type=jnp.float32)
  run = lambda q, k: np.asarray(jax.jit(rlk_jax.batch_invariant(scores))(q, k))
  folded = run(q, k)
  alone = run(q[1:2], k[1:2])
  monkeypatch.setattr(_batch_invariant, "_FOLDED_OUTPUTS", 0)
  one_by_one = run(q, k)
  np.testing.assert_array_equal(folded.view(np.uint32),
                                one_by_one.view(np.uint32))
  np.testing.assert_array_equal(alone[0].view(np.uint32),
                                folded[1].view(np.uint32))
  want = np.einsum("BTHGD,BSHD->BHGTS", np.asarray(q, np.float64),
                   np.asarray(k, np.float64))
  assert np.linalg.norm(folded - want) / np.linalg.norm(want) < 1e-6

