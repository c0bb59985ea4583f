"""Packed replay helpers: what a trainer derives from a PackInfo to replay
(prompt, response) sequences packed into one stream. All jit-friendly, no
host sync, computed from the metadata the pack already made."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlk_jax._pack import PackInfo

IGNORE_INDEX = -100


def next_token_targets(packed_ids, info: PackInfo, *,
                       ignore_index: int = IGNORE_INDEX) -> jax.Array:
  """Label of each packed row: the next token *of the same sequence*.

  ``packed_ids`` is ``pack(ids, info)[0]`` ([capacity]). A sequence's last
  token, and pad rows, get `ignore_index`: the last token of sequence i never
  gets sequence i+1's first token as its label (a bug class seen in RL
  trainers that shift the packed stream as a whole).
  """
  packed_ids = jnp.asarray(packed_ids)
  if packed_ids.shape != (info.capacity,):
    raise ValueError(f"rlk_jax.next_token_targets: packed_ids has shape "
                     f"{packed_ids.shape}; expected ({info.capacity},).")
  seg = info.segment_ids
  following = jnp.concatenate([seg[1:], jnp.full((1,), -1, seg.dtype)])
  same = info.valid & (following == seg)
  shifted = jnp.concatenate([packed_ids[1:], packed_ids[:1]])
  return jnp.where(same, shifted, jnp.asarray(ignore_index, packed_ids.dtype))


def response_predict_index(info: PackInfo, prompt_lens, response_lens, *,
                           max_response_len: int) -> jax.Array:
  """``[n_seq, max_response_len]`` packed row whose output predicts response
  token j of sequence i: ``cu_seqlens[i] + prompt_lens[i] - 1 + j``; -1 where
  there is no such token (j past the response), where nothing precedes it (an
  empty prompt's first response token), or where the predicting row or the
  predicted token's row was dropped (capacity too small: that row's target
  is ignored, and its log-prob would read as a certain 0).

  Each packed sequence must be its prompt followed by its response
  (``seq_lens == prompt_lens + response_lens``): checked when the lengths
  are concrete.
  """
  prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
  response_lens = jnp.asarray(response_lens, jnp.int32)
  _check_lengths(info, prompt_lens, response_lens)
  j = jnp.arange(max_response_len, dtype=jnp.int32)[None, :]
  rows = info.cu_seqlens[:-1, None] + prompt_lens[:, None] - 1 + j
  kept = jnp.minimum(info.total, info.capacity)
  ok = ((j < response_lens[:, None]) & (prompt_lens[:, None] + j >= 1)
        & (rows + 1 < kept))
  return jnp.where(ok, rows, -1)


def _check_lengths(info: PackInfo, prompt_lens, response_lens) -> None:
  op = "rlk_jax.response_predict_index"
  if (prompt_lens.shape != info.seq_lens.shape
      or response_lens.shape != info.seq_lens.shape):
    raise ValueError(f"{op}: prompt_lens {prompt_lens.shape} and "
                     f"response_lens {response_lens.shape} need one entry per "
                     f"sequence {info.seq_lens.shape}.")
  if any(isinstance(x, jax.core.Tracer)
         for x in (info.seq_lens, prompt_lens, response_lens)):
    return  # inside jit: no comparison without a host sync
  bad = np.flatnonzero(np.asarray(info.seq_lens)
                       != np.asarray(prompt_lens + response_lens))
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{op}: sequence {i} has {int(info.seq_lens[i])} packed "
                     f"tokens but prompt_lens + response_lens = "
                     f"{int(prompt_lens[i])} + {int(response_lens[i])}.")


def block_causal_mask(info: PackInfo) -> jax.Array:
  """``[capacity, capacity]`` bool: row q may attend to row k iff both belong
  to the same sequence and k is not after q. Materialised (capacity²): for
  small batches and tests; kernels take ``segment_ids``/``positions``."""
  seg, pos = info.segment_ids, info.positions
  same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
  return same & (pos[None, :] <= pos[:, None])
