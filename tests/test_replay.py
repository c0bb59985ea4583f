"""Packed replay helpers against loops written out in the test."""

import jax
import numpy as np
import pytest

import rlk_jax
from conftest import assert_bitwise_equal


def left_padded_batch(rng, prompt_lens, response_lens, width):
  """Left-padded (prompt + response) rows, as rollout engines return them."""
  ids = np.zeros((len(prompt_lens), width), np.int32)
  mask = np.zeros((len(prompt_lens), width), bool)
  for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
    n = p + r
    ids[i, width - n:] = rng.integers(1, 1000, n)
    mask[i, width - n:] = True
  return ids, mask


def test_next_token_targets_never_cross_sequences(rng):
  prompt_lens, response_lens = [3, 0, 5, 2], [4, 2, 0, 6]
  ids, mask = left_padded_batch(rng, prompt_lens, response_lens, 10)
  packed, info = rlk_jax.pack(ids, mask, capacity=30)
  targets = jax.jit(rlk_jax.next_token_targets)(packed, info)
  expected = []
  for i in range(len(ids)):
    seq = ids[i][mask[i]].tolist()
    expected += seq[1:] + [-100] * (len(seq) > 0)
  expected += [-100] * (30 - len(expected))
  assert_bitwise_equal(targets, np.asarray(expected, np.int32))
  # The explicit boundary: each sequence's last row is ignored.
  ends = np.asarray(info.cu_seqlens[1:]) - 1
  assert (np.asarray(targets)[ends[np.asarray(info.seq_lens) > 0]] == -100).all()


def test_response_predict_index(rng):
  prompt_lens, response_lens = [3, 0, 5, 2, 1], [4, 2, 0, 6, 1]
  ids, mask = left_padded_batch(rng, prompt_lens, response_lens, 9)
  packed, info = rlk_jax.pack(ids, mask)
  index = rlk_jax.response_predict_index(info, prompt_lens, response_lens,
                                         max_response_len=7)
  expected = np.full((5, 7), -1, np.int32)
  offset = 0
  for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
    for j in range(r):
      if p + j >= 1:
        expected[i, j] = offset + p - 1 + j
    offset += p + r
  assert_bitwise_equal(index, expected)
  # The row predicting response token j holds the token before it.
  targets = np.asarray(rlk_jax.next_token_targets(packed, info))
  for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
    response = ids[i][mask[i]][p:]
    for j in range(r):
      if expected[i, j] >= 0:
        assert targets[expected[i, j]] == response[j]


def test_block_causal_mask(rng):
  ids, mask = left_padded_batch(rng, [2, 3], [1, 2], 6)
  _, info = rlk_jax.pack(ids, mask, capacity=12)
  allowed = np.asarray(rlk_jax.block_causal_mask(info))
  seg, pos = np.asarray(info.segment_ids), np.asarray(info.positions)
  for q in range(12):
    for k in range(12):
      want = seg[q] >= 0 and seg[q] == seg[k] and pos[k] <= pos[q]
      assert allowed[q, k] == want, (q, k)


def test_next_token_targets_bad_shape(rng):
  ids, mask = left_padded_batch(rng, [2], [1], 4)
  packed, info = rlk_jax.pack(ids, mask, capacity=5)
  with pytest.raises(ValueError, match=r"shape \(4,\); expected \(5,\)"):
    rlk_jax.next_token_targets(packed[:4], info)


def test_response_predict_index_never_points_at_a_dropped_target():
  # Capacity 4 keeps [11 12 13 | 21]: sequence 1's prompt row (21) survives
  # but the response token it predicts (22) was dropped, so its index is -1
  # (under jit, where pack cannot raise on the overflow).
  ids = np.array([[11, 12, 13, 0], [21, 22, 23, 24]], np.int32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)

  @jax.jit
  def index(ids, mask):
    _, info = rlk_jax.pack(ids, mask, capacity=4)
    return rlk_jax.response_predict_index(info, [1, 1], [2, 3],
                                          max_response_len=3)

  got = np.asarray(index(ids, mask))
  assert got.tolist() == [[0, 1, -1], [-1, -1, -1]]


def test_response_predict_index_checks_lengths():
  ids = np.arange(8, dtype=np.int32).reshape(2, 4)
  _, info = rlk_jax.pack(ids, np.ones_like(ids, bool))
  with pytest.raises(ValueError, match="sequence 1 has 4 packed tokens but "
                                       "prompt_lens \\+ response_lens = 2 \\+ 1"):
    rlk_jax.response_predict_index(info, [1, 2], [3, 1], max_response_len=3)
