"""examples/tiny_transformer: packed replay equals per-sample dense replay,
bit for bit; the attention is accurate; the segment mask is what makes it so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import assert_bitwise_equal, bits

from examples import tiny_transformer as tt

VOCAB = 97  # not a power of two
DIMS = dict(vocab=VOCAB, d_model=32, n_heads=2, n_layers=2, d_ff=48)


def random_params(rng, dtype=jnp.float32, **dims):
  params = tt.init_params(jax.random.key(int(rng.integers(2**31))),
                          **{**DIMS, **dims}, dtype=dtype)
  # init_params sets the norm gains to exactly 1; jitter them so the gain
  # multiply is exercised (and could break bits) too.
  def jitter(path, x):
    if "norm" in jax.tree_util.keystr(path):
      return (1 + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(jitter, params)


def ragged_lengths(rng):
  """>= 6 sequences, shuffled: an empty prompt, empty responses, one-token
  sequences, plus two random lengths."""
  prompt = [5, 0, 3, 7, 1, 0, 2] + list(rng.integers(1, 9, 2))
  response = [4, 6, 0, 3, 5, 1, 0] + list(rng.integers(1, 9, 2))
  order = rng.permutation(len(prompt))
  return np.asarray(prompt)[order], np.asarray(response)[order]


def batch(rng):
  prompt_lens, response_lens = ragged_lengths(rng)
  width = int((prompt_lens + response_lens).max()) + 3  # some left padding
  ids, mask = tt.left_padded_batch(rng, prompt_lens, response_lens, width,
                                   VOCAB)
  return ids, mask, prompt_lens, response_lens


def defined(mask, prompt_lens, response_lens, max_response_len):
  """Where a response log-prob exists (as response_predict_index defines
  it): inside the response, and with at least one token before it."""
  info = rlk_jax.pack_info(mask)
  index = rlk_jax.response_predict_index(info, prompt_lens, response_lens,
                                         max_response_len=max_response_len)
  return np.asarray(index) >= 0


@pytest.mark.parametrize("dtype,n_layers", [(jnp.float32, 2),
                                             (jnp.bfloat16, 1)])
def test_packed_replay_equals_dense_replay_bitwise(dtype, n_layers, rng):
  params = random_params(rng, dtype, n_layers=n_layers)
  ids, mask, prompt_lens, response_lens = batch(rng)
  r = int(response_lens.max())
  dense = tt.dense_replay(params, ids, mask, prompt_lens, response_lens,
                          max_response_len=r)
  total = int(mask.sum())
  # total + 7: pad rows after the last sequence; total: none, the last
  # sequence ends the stream.
  for capacity in (total + 7, total):
    packed = tt.packed_replay(params, ids, mask, prompt_lens, response_lens,
                              max_response_len=r, capacity=capacity)
    assert packed.shape == (len(ids), r) and packed.dtype == jnp.float32
    assert_bitwise_equal(packed, dense,
                         f"{jnp.dtype(dtype).name}, capacity {capacity}:")

  ok = defined(mask, prompt_lens, response_lens, r)
  packed = np.asarray(packed)
  # 19 fixed response tokens plus two random ones (>= 1 each), less the
  # first of each of the two empty-prompt sequences: at least 19.
  assert ok.sum() >= 19
  assert np.isfinite(packed).all()
  assert (packed[ok] < 0).all()  # real, nonzero log-probs: not 0 == 0
  assert (bits(packed[~ok]) == 0).all()  # +0.0 where nothing is predicted
  # The empty-prompt sequence: its first response token has no predictor.
  empty_prompt = np.flatnonzero((prompt_lens == 0) & (response_lens > 1))
  assert len(empty_prompt) and not ok[empty_prompt, 0].any()
  assert ok[empty_prompt, 1].all()


def test_attention_matches_dense_masked_softmax(rng):
  """The loop attention against a plain jnp masked softmax, in float32."""
  ids, mask, _, _ = batch(rng)
  capacity = int(mask.sum()) + 5
  _, info = rlk_jax.pack(ids, mask, capacity=capacity)
  t, h, d = capacity, 2, 16
  q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)).astype(np.float32))
             for _ in range(3))
  out = jax.jit(tt.segment_causal_attention)(q, k, v, info.segment_ids,
                                             info.positions)

  allowed = rlk_jax.block_causal_mask(info)  # [T, T]
  scores = jnp.einsum("qhd,khd->hqk", q, k,
                      precision=jax.lax.Precision.HIGHEST) / np.sqrt(d)
  scores = jnp.where(allowed[None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1, where=allowed[None])
  probs = jnp.where(allowed[None], probs, 0.0)
  expected = jnp.einsum("hqk,khd->qhd", probs, v,
                        precision=jax.lax.Precision.HIGHEST)
  valid = np.asarray(info.valid)
  out, expected = np.asarray(out), np.asarray(expected)
  err = np.linalg.norm(out[valid] - expected[valid])
  assert err / np.linalg.norm(expected[valid]) < 1e-5
  assert (bits(out[~valid]) == 0).all()  # pad rows attend to nothing


def test_attention_without_segment_mask_crosses_sequences(rng):
  """The negative control: run the same packed stream as ONE sequence
  (segment 0 everywhere, global positions), as a trainer that packs without
  varlen attention does. The first sequence, which has nothing before it,
  keeps its bits; every later one reads its predecessors and changes."""
  params = random_params(rng)
  ids, mask, prompt_lens, response_lens = batch(rng)
  r = int(response_lens.max())
  packed_ids, info = rlk_jax.pack(ids, mask)
  targets = rlk_jax.next_token_targets(packed_ids, info)
  index = rlk_jax.response_predict_index(info, prompt_lens, response_lens,
                                         max_response_len=r)
  naive_seg = jnp.where(info.valid, 0, -1).astype(jnp.int32)
  naive_pos = jnp.arange(info.capacity, dtype=jnp.int32)
  logp = jax.jit(tt.sequence_logprobs)(params, packed_ids, naive_seg,
                                       naive_pos, targets)
  naive = np.asarray(tt.gather_response_logprobs(logp, index))
  # The segment-masked replay, proven equal to dense_replay above.
  dense = np.asarray(tt.packed_replay(params, ids, mask, prompt_lens,
                                      response_lens, max_response_len=r))
  ok = np.asarray(index) >= 0
  first = int(np.flatnonzero(prompt_lens + response_lens)[0])
  assert_bitwise_equal(naive[first], dense[first], "first sequence:")
  later = [i for i in range(first + 1, len(ids)) if ok[i].any()]
  assert len(later) >= 4
  for i in later:
    differs = bits(naive[i][ok[i]]) != bits(dense[i][ok[i]])
    assert differs.all(), f"sequence {i}: {int((~differs).sum())} unchanged"


def test_pallas_packed_replay_equals_dense_replay(rng):
  """The same proof with every rlk op pinned to the Pallas kernels (the
  interpreter on CPUs, so tiny): bits are promised per implementation."""
  params = random_params(rng, n_layers=1)
  prompt_lens, response_lens = np.asarray([3, 0, 2]), np.asarray([2, 3, 0])
  ids, mask = tt.left_padded_batch(rng, prompt_lens, response_lens, 6, VOCAB)
  packed = tt.packed_replay(params, ids, mask, prompt_lens, response_lens,
                            max_response_len=3, capacity=12,
                            implementation="pallas")
  dense = tt.dense_replay(params, ids, mask, prompt_lens, response_lens,
                          max_response_len=3, implementation="pallas")
  assert_bitwise_equal(packed, dense)
  packed = np.asarray(packed)
  assert (packed[0, :2] < 0).all() and (packed[1, 1:] < 0).all()
