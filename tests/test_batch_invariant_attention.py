"""rlk_jax.batch_invariant runs softmax attention it recognises in a traced
program on det_attention (rlk_jax._attention_pattern): the bits are
det_attention's own on the mask's sequences, a row alone = in its batch =
decoded against a cache = in a pack, and what it does not recognise stays
on the other rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax

D, HKV, GROUP = 64, 2, 2
BF16 = jnp.bfloat16


def _einsum_attention(q, k, v, mask, scale=0.125):
  """Tunix's Llama 3 attention as it is written: GQA by reshape, scores in
  the input dtype, ``where`` with a finite fill, an f32 softmax."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  q = q.reshape(b, t, hkv, hq // hkv, d)
  s = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * scale
  s = s.reshape(b, hq, t, k.shape[1])
  s = jnp.where(mask[:, None], s, -2.3819763e38)
  p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(k.dtype)
  p = p.reshape(b, hkv, hq // hkv, t, k.shape[1])
  return jnp.einsum("BHGTS,BSHD->BTHGD", p, v).reshape(b, t, hq, d)


@jax.custom_jvp
def _softmax_with_own_rule(x):
  e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, -1, keepdims=True)))
  return e / jnp.sum(e, -1, keepdims=True)


@_softmax_with_own_rule.defjvp
def _softmax_jvp(primals, tangents):
  y = _softmax_with_own_rule(primals[0])
  return y, y * (tangents[0] - jnp.sum(y * tangents[0], -1, keepdims=True))


def _custom_jvp_softmax_attention(q, k, v, mask, scale=0.125):
  """Multi-head (no GQA), the softmax a custom_jvp function of its own."""
  k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
  s = jnp.einsum("BTHD,BSHD->BHTS", q, k).astype(jnp.float32) * scale
  p = _softmax_with_own_rule(jnp.where(mask[:, None], s, -jnp.inf))
  return jnp.einsum("BHTS,BSHD->BTHD", p.astype(v.dtype), v)


def _nn_attention(q, k, v, mask, scale=0.125):
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                      scale=scale, implementation="xla")


def _operands(rng, b, t, s=None):
  s = t if s is None else s
  q = rng.standard_normal((b, t, HKV * GROUP, D))
  k = rng.standard_normal((b, s, HKV, D))
  v = rng.standard_normal((b, s, HKV, D))
  return tuple(jnp.asarray(x, BF16) for x in (q, k, v))


def _causal(valid):
  """Causal mask of token slots `valid` [B, L] (padding left and right)."""
  length = valid.shape[1]
  return jnp.tril(jnp.ones((length, length), bool))[None] & valid[:, None, :]


def _bits(x):
  return np.asarray(x).view(np.uint16)


def _valid(length, starts, ends):
  cols = jnp.arange(length)[None]
  return (cols >= jnp.asarray(starts)[:, None]) & (cols < jnp.asarray(ends)[:,
                                                                          None])


@pytest.mark.parametrize("attention", [_einsum_attention, _nn_attention,
                                       _custom_jvp_softmax_attention])
def test_recognised_attention_is_det_attention_on_the_masks_sequences(
    attention, rng):
  q, k, v = _operands(rng, 3, 40)
  valid = _valid(40, [0, 7, 3], [40, 33, 21])
  mask = _causal(valid)
  transformed = rlk_jax.batch_invariant(attention)
  assert transformed.attentions(q, k, v, mask) == 1
  got = jax.jit(transformed)(q, k, v, mask)
  want = rlk_jax.det_attention(q, k, v, attn_mask=mask, scale=0.125)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  # The tokens' rows against the plain computation in f32.
  plain = np.asarray(attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                               mask))
  tok = np.asarray(valid)
  got = np.asarray(got, np.float32)
  assert (np.linalg.norm((got - plain)[tok]) / np.linalg.norm(plain[tok])
          < 1e-2)
  assert not got[~tok].any()  # padding rows: 0


def test_rows_alone_decoded_and_chunked_equal_the_prefill(rng):
  # Left-padded prompts, a prefill of all slots, then rows one at a time
  # and in a chunk of 5 against a cache of more slots than the rows.
  b, length, slots = 3, 24, 31
  q, k, v = _operands(rng, b, length)
  valid = _valid(length, [0, 6, 2], [length] * 3)
  run = jax.jit(rlk_jax.batch_invariant(_einsum_attention))
  prefill = _bits(run(q, k, v, _causal(valid)))
  pad = ((0, 0), (0, slots - length), (0, 0), (0, 0))
  k_cache, v_cache = jnp.pad(k, pad), jnp.pad(v, pad)
  cache_mask = jnp.pad(_causal(valid), ((0, 0), (0, 0), (0, slots - length)))
  for i in (2, 9, 23):
    alone = _bits(run(q[1:2], k[1:2], v[1:2], _causal(valid[1:2])))
    np.testing.assert_array_equal(alone[0], prefill[1])
    step = _bits(run(q[:, i:i + 1], k_cache, v_cache, cache_mask[:, i:i + 1]))
    np.testing.assert_array_equal(step[:, 0][np.asarray(valid[:, i])],
                                  prefill[:, i][np.asarray(valid[:, i])])
  chunk = _bits(run(q[:, 10:15], k_cache, v_cache, cache_mask[:, 10:15]))
  np.testing.assert_array_equal(chunk, prefill[:, 10:15])


def test_a_pack_with_segments_equals_its_sequences_alone(rng):
  lengths = (9, 17, 6)
  total = sum(lengths)
  q, k, v = _operands(rng, 1, total + 4)  # 4 spare slots at the end
  seg = np.repeat(np.arange(len(lengths)), lengths)
  seg = np.concatenate([seg, np.full(4, -1)])
  mask = ((seg[:, None] == seg[None]) & (seg[None] >= 0)
          & np.tril(np.ones((total + 4,) * 2, bool)))[None]
  packed = jax.jit(rlk_jax.batch_invariant(_einsum_attention,
                                           attention_segments=3))
  got = _bits(packed(q, k, v, jnp.asarray(mask)))
  one = jax.jit(rlk_jax.batch_invariant(_einsum_attention))
  start = 0
  for n in lengths:
    sl = slice(start, start + n)
    alone = _bits(one(q[:, sl], k[:, sl], v[:, sl],
                      _causal(jnp.ones((1, n), bool))))
    np.testing.assert_array_equal(got[:, sl], alone)
    start += n
  assert not np.asarray(got[:, total:]).any()
  # Too few segments: that batch row comes back NaN, never silently wrong.
  short = jax.jit(rlk_jax.batch_invariant(_einsum_attention))(
      q, k, v, jnp.asarray(mask))
  assert np.isnan(np.asarray(short, np.float32)[0, :total]).all()


def test_a_mask_it_cannot_read_gives_nan_rows_for_its_batch_row_only(rng):
  q, k, v = _operands(rng, 2, 16)
  mask = np.array(_causal(jnp.ones((2, 16), bool)))
  mask[1] &= ~np.tril(np.ones((16, 16), bool), -4)  # a sliding window
  got = np.asarray(jax.jit(rlk_jax.batch_invariant(_einsum_attention))(
      q, k, v, jnp.asarray(mask)), np.float32)
  assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
  # The products route takes any mask.
  products = np.asarray(jax.jit(rlk_jax.batch_invariant(
      _einsum_attention, attention="products"))(q, k, v, jnp.asarray(mask)),
                        np.float32)
  assert np.isfinite(products).all()


def _softmax_returned(q, k, v, mask):
  s = jnp.einsum("BTHD,BSHD->BHTS", q, k) * 0.125
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e38).astype(jnp.float32))
  return jnp.einsum("BHTS,BSHD->BTHD", p.astype(v.dtype), v), p


def _biased(q, k, v, mask):
  s = jnp.einsum("BTHD,BSHD->BHTS", q, k) * 0.125 + 1.0
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e38).astype(jnp.float32))
  return jnp.einsum("BHTS,BSHD->BTHD", p.astype(v.dtype), v)


def _no_mask(q, k, v, mask):
  del mask
  s = jnp.einsum("BTHD,BSHD->BHTS", q, k) * 0.125
  p = jax.nn.softmax(s.astype(jnp.float32))
  return jnp.einsum("BHTS,BSHD->BTHD", p.astype(v.dtype), v)


@pytest.mark.parametrize("fn, dtype", [
    (_einsum_attention, jnp.float32),  # det_attention takes bf16/f16
    (_softmax_returned, BF16),         # the probabilities escape
    (_biased, BF16),                   # a bias det_attention has not
    (_no_mask, BF16),                  # not causal
])
def test_what_it_does_not_recognise_stays_on_the_other_rules(fn, dtype, rng):
  q, k, v = (x.astype(dtype) for x in _operands(rng, 2, 8))
  k = k if fn is _einsum_attention else jnp.repeat(k, GROUP, axis=2)
  v = v if fn is _einsum_attention else jnp.repeat(v, GROUP, axis=2)
  mask = _causal(jnp.ones((2, 8), bool))
  transformed = rlk_jax.batch_invariant(fn)
  assert transformed.attentions(q, k, v, mask) == 0
  got = jax.tree.leaves(jax.jit(transformed)(q, k, v, mask))[0]
  want = jax.tree.leaves(fn(q, k, v, mask))[0]
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(want, np.float32), rtol=2e-2,
                             atol=2e-2)


def test_gradients_inside_are_each_sequences_own_and_accurate(rng):
  # jax.grad of the transformed function: det_attention's backward, its
  # VJP traced and rewritten. A sequence's dq, dk, dv alone = in the batch,
  # run to run the same, and near the plain attention's f32 gradient.
  q, k, v = _operands(rng, 3, 32)
  valid = _valid(32, [0, 5, 2], [32, 30, 17])
  # Padding rows (whose output det_attention gives as 0) carry no loss.
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  w = w * valid[..., None, None]

  def loss(attention, q, k, v, mask, w):
    return jnp.sum(attention(q, k, v, mask).astype(jnp.float32) * w)

  grad = jax.jit(jax.grad(functools.partial(
      loss, rlk_jax.batch_invariant(_einsum_attention)), argnums=(0, 1, 2)))
  batch = grad(q, k, v, _causal(valid), w)
  again = grad(q, k, v, _causal(valid), w)
  alone = grad(q[1:2], k[1:2], v[1:2], _causal(valid[1:2]), w[1:2])
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.grad(functools.partial(loss, _einsum_attention),
                  argnums=(0, 1, 2))(f32(q), f32(k), f32(v), _causal(valid), w)
  tok = np.asarray(valid)
  for g, g2, g1, h in zip(batch, again, alone, want):
    np.testing.assert_array_equal(_bits(g), _bits(g2))
    np.testing.assert_array_equal(_bits(g1)[0], _bits(g)[1])
    g, h = np.asarray(g, np.float32)[tok], np.asarray(h)[tok]
    assert np.linalg.norm(g - h) / np.linalg.norm(h) < 2e-2


def test_composes_with_vmap_and_scan(rng):
  q, k, v = _operands(rng, 2, 16)
  mask = _causal(jnp.ones((2, 16), bool))
  transformed = rlk_jax.batch_invariant(_einsum_attention)
  want = _bits(jax.jit(transformed)(q, k, v, mask))
  mapped = jax.jit(jax.vmap(transformed, in_axes=(0, 0, 0, 0)))(
      q[:, None], k[:, None], v[:, None], mask[:, None])
  np.testing.assert_array_equal(_bits(mapped)[:, 0], want)

  def layers(q, k, v, mask):
    def body(x, _):
      return _einsum_attention(x, k, v, mask), None
    return jax.lax.scan(body, q, None, length=2)[0]

  scanned = rlk_jax.batch_invariant(layers)
  assert scanned.attentions(q, k, v, mask) == 1  # the body's, traced once
  twice = _bits(jax.jit(scanned)(q, k, v, mask))
  once = jax.jit(transformed)(q, k, v, mask)
  np.testing.assert_array_equal(twice, _bits(jax.jit(transformed)(
      once, k, v, mask)))


def test_bad_attention_options_are_named():
  with pytest.raises(ValueError, match="attention must be"):
    rlk_jax.batch_invariant(_einsum_attention, attention="flash")
