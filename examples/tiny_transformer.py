"""A tiny decoder-only transformer whose RL log-probs are the same bits
whether a sequence is replayed packed with others or alone.

    python -m examples.tiny_transformer

The claim: ``packed_replay`` (sequences packed into one token stream by
``rlk_jax.pack``, one forward, ``rlk_jax.linear_logp``) returns bitwise the
log-probs of ``dense_replay`` (each sequence run on its own, unpadded). That
is what lets a trainer pack freely without drifting from the numbers the
rollout engine saw. It holds because every op a row goes through is
*row-invariant*: its result depends only on that row's own inputs, never on
how many other rows share the stream or where they sit.

* Projections (qkv, o, up, down) go through ``rlk_jax.det_gemm``, the LM
  head through ``rlk_jax.linear_logp``: both promise row invariance.
* Elementwise ops (embedding gather, RoPE, SiLU, residual adds) are
  row-invariant by nature.
* Reductions are the trap. A ``jnp.sum`` / ``jnp.dot`` / ``softmax`` leaves
  the summation tree to the compiler, which may pick a different one for a
  different shape; and in attention the reduction *length* itself changes
  when a query row sits in a longer (packed) stream with more masked keys.
  So every reduction here (RMSNorm's mean square, q·k, the softmax sum, p·v)
  is written as an explicit loop in a fixed order, and masked keys are
  skipped by *selecting* the unchanged carry, so they cannot touch the bits.

Everything is written for clarity at tiny sizes (attention is O(T²) loop
steps of elementwise work), not speed: it is a proof, not a kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import rlk_jax

IGNORE_INDEX = -100
_RMS_EPS = 1e-6
_ROPE_BASE = 10000.0


# ----------------------------------------------------------------------------
# Parameters


def init_params(key, *, vocab: int, d_model: int, n_heads: int, n_layers: int,
                d_ff: int, dtype=jnp.float32) -> dict:
  """Random parameters as a pytree of arrays (no static config inside).

  The head count is carried by the shapes (``wqkv`` is ``[D, 3, H, Dh]``,
  ``wo`` ``[H, Dh, D]``), so :func:`forward` needs no extra arguments and
  the pytree goes through ``jit``/``tree_map`` as is. ``lm_head`` is
  ``[D, V]``, the layout ``linear_logp`` takes.
  """
  if d_model % n_heads:
    raise ValueError(f"d_model={d_model} is not a multiple of "
                     f"n_heads={n_heads}.")
  d_head = d_model // n_heads
  if d_head % 2:
    raise ValueError(f"RoPE rotates pairs of features: the head size "
                     f"{d_head} must be even.")
  keys = iter(jax.random.split(key, 2 + 4 * n_layers))

  def dense(shape, fan_in):
    # 1/sqrt(fan_in) keeps activations O(1) through the stack, so the
    # softmaxes stay soft and the test exercises every term.
    w = jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)
    return w.astype(dtype)

  layers = []
  for _ in range(n_layers):
    layers.append({
        "attn_norm": jnp.ones((d_model,), dtype),
        "wqkv": dense((d_model, 3, n_heads, d_head), d_model),
        "wo": dense((n_heads, d_head, d_model), d_model),
        "mlp_norm": jnp.ones((d_model,), dtype),
        "w_up": dense((d_model, d_ff), d_model),
        "w_down": dense((d_ff, d_model), d_ff),
    })
  return {
      "embed": dense((vocab, d_model), 1),
      "layers": layers,
      "final_norm": jnp.ones((d_model,), dtype),
      "lm_head": dense((d_model, vocab), d_model),
  }


# ----------------------------------------------------------------------------
# Row-invariant building blocks


def fixed_order_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis, strictly left to right.

  ``jnp.sum`` would let XLA choose the summation tree, and it may choose a
  different one for a different number of rows; a loop of elementwise adds
  over the reduced axis has one order by construction.
  """
  n = x.shape[-1]

  def add(i, acc):
    return acc + jax.lax.dynamic_index_in_dim(x, i, axis=-1, keepdims=False)

  return jax.lax.fori_loop(0, n, add, jnp.zeros(x.shape[:-1], x.dtype))


def rms_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
  """RMSNorm in f32 with a fixed-order mean square."""
  mean_square = fixed_order_sum(x * x) / jnp.float32(x.shape[-1])
  return x * jax.lax.rsqrt(mean_square + _RMS_EPS)[..., None] * gain.astype(
      jnp.float32)


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary embedding of ``x [T, H, Dh]`` at the per-sequence ``positions``.

  Indexed by the *restarting* positions, so a token at position 5 of its
  sequence gets the same rotation whether it sits at row 5 of its own
  stream or row 500 of a packed one. (RoPE being relative does not make a
  global position harmless: the rotated values, hence the bits, differ.)
  """
  half = x.shape[-1] // 2
  # A NumPy constant: the frequencies are the same literal in every
  # compilation, not a computation XLA might fold differently per shape.
  inv_freq = (_ROPE_BASE ** (-np.arange(half, dtype=np.float64) / half)
              ).astype(np.float32)
  angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, Dh/2]
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def segment_causal_attention(q, k, v, segment_ids, positions) -> jax.Array:
  """Causal self-attention within segments, row-invariant bit for bit.

  Args:
    q, k, v: ``[T, H, Dh]`` float32 (``q`` not yet scaled).
    segment_ids: int ``[T]``, -1 on pad rows (they attend to nothing and
      output 0).
    positions: int ``[T]``, restarting at 0 for each segment.

  Query row ``i`` may read key row ``j`` iff ``segment_ids[j] ==
  segment_ids[i] >= 0`` and ``positions[j] <= positions[i]``.

  The keys are visited one at a time, in stream order, with an online
  softmax per query (running max ``m``, running sum ``l``, running ``p·v``
  ``acc``, all f32, all elementwise over queries). A key a query may not
  read leaves that query's carry untouched: the new carry is *selected*
  with ``jnp.where``, not computed as "plus zero", so the identity is exact
  by construction and not an argument about ``-0.0`` or ``exp(-inf)``. A
  query therefore performs exactly the same float operations, on the same
  values, in the same order, as long as it sees the same allowed keys in the
  same relative order, which packing preserves (a sequence's rows stay
  contiguous and in order). How many masked keys surround them, and where,
  cannot change a bit. The q·k dot product is a fixed-order loop over the
  head dimension for the same reason.
  """
  t, _, d_head = q.shape
  q = q * jnp.float32(1.0 / math.sqrt(d_head))
  query_seg = segment_ids[:, None]
  query_pos = positions[:, None]

  def visit(j, carry):
    m, l, acc = carry  # [T, H], [T, H], [T, H, Dh]
    k_j = jax.lax.dynamic_index_in_dim(k, j, axis=0, keepdims=False)  # [H, Dh]
    v_j = jax.lax.dynamic_index_in_dim(v, j, axis=0, keepdims=False)
    seg_j, pos_j = segment_ids[j], positions[j]
    allowed = (query_seg == seg_j) & (seg_j >= 0) & (pos_j <= query_pos)
    s = fixed_order_sum(q * k_j)  # [T, H]
    # Computed for every query, kept only where allowed. m_new >= m and
    # m_new >= s, s finite, so the discarded values are finite too (no NaN
    # for jax.grad to meet), even while m is still -inf.
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp(m - m_new)  # 0 at a query's first allowed key
    p = jnp.exp(s - m_new)
    l_new = l * alpha + p
    acc_new = acc * alpha[..., None] + p[..., None] * v_j
    return (jnp.where(allowed, m_new, m), jnp.where(allowed, l_new, l),
            jnp.where(allowed[..., None], acc_new, acc))

  shape = q.shape[:2]
  init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(q.shape, jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, t, visit, init)
  seen = (l > 0)[..., None]
  # Pad rows saw no key (l == 0): output 0, not 0/0.
  return jnp.where(seen, acc / jnp.where(seen, l[..., None], 1.0), 0.0)


# ----------------------------------------------------------------------------
# The model


def forward(params: dict, ids, segment_ids, positions, *,
            implementation: str | None = None) -> jax.Array:
  """Final hidden states ``[T, d_model]`` (the params' dtype) of one stream.

  ``ids``, ``segment_ids``, ``positions`` are ``[T]``: a packed stream
  (``rlk_jax.pack`` + its ``PackInfo``) or a single sequence (segment 0,
  positions ``0..T-1``). The residual stream, norms and attention run in
  f32; the projections take the params' dtype and accumulate in f32.
  `implementation` is passed to every det_gemm: pin one name on both sides of
  a comparison, since bits are promised per implementation.
  """
  dtype = params["embed"].dtype
  gemm = functools.partial(rlk_jax.det_gemm, out_dtype=jnp.float32,
                           implementation=implementation)
  t = ids.shape[0]
  x = jnp.take(params["embed"], ids, axis=0).astype(jnp.float32)  # [T, D]
  for layer in params["layers"]:
    d_model, _, n_heads, d_head = layer["wqkv"].shape
    h = rms_norm(x, layer["attn_norm"]).astype(dtype)
    qkv = gemm(h, layer["wqkv"].reshape(d_model, -1))
    qkv = qkv.reshape(t, 3, n_heads, d_head)
    q = rope(qkv[:, 0], positions)
    k = rope(qkv[:, 1], positions)
    attn = segment_causal_attention(q, k, qkv[:, 2], segment_ids, positions)
    x = x + gemm(attn.reshape(t, n_heads * d_head).astype(dtype),
                 layer["wo"].reshape(n_heads * d_head, d_model))
    h = rms_norm(x, layer["mlp_norm"]).astype(dtype)
    up = jax.nn.silu(gemm(h, layer["w_up"]))
    x = x + gemm(up.astype(dtype), layer["w_down"])
  # linear_logp takes hidden and weight in one dtype.
  return rms_norm(x, params["final_norm"]).astype(dtype)


def sequence_logprobs(params: dict, ids, segment_ids, positions, targets, *,
                      implementation: str | None = None) -> jax.Array:
  """f32 ``[T]``: log-prob of ``targets[t]`` given the stream up to row t
  (its own segment only); 0 where ``targets == IGNORE_INDEX``."""
  hidden = forward(params, ids, segment_ids, positions,
                   implementation=implementation)
  return rlk_jax.linear_logp(hidden, params["lm_head"], targets,
                             ignore_index=IGNORE_INDEX,
                             implementation=implementation)


def gather_response_logprobs(logp: jax.Array, index: jax.Array) -> jax.Array:
  """``logp[index]`` with 0.0 where ``index == -1``.

  0.0 (not NaN) so that a masked sum or mean over the result needs no
  ``nan_to_num``; -1 marks response tokens past a sequence's length and the
  first response token of an empty prompt, which nothing predicts. Both
  replays use this same convention.
  """
  picked = jnp.take(logp, jnp.maximum(index, 0), axis=0)
  return jnp.where(index >= 0, picked, jnp.float32(0.0))


@functools.partial(jax.jit, static_argnames=("max_response_len", "capacity",
                                             "implementation"))
def packed_replay(params: dict, ids, mask, prompt_lens, response_lens, *,
                  max_response_len: int, capacity: int | None = None,
                  implementation: str | None = None) -> jax.Array:
  """Response log-probs ``[B, max_response_len]`` f32 from ONE packed forward.

  Args:
    ids, mask: ``[B, W]`` left-padded rollouts, each active run being the
      prompt followed by the response (``mask.sum(1) == prompt_lens +
      response_lens``), as ``rlk_jax.response_predict_index`` assumes.
    prompt_lens, response_lens: int ``[B]``.
    max_response_len: static; responses longer than it are cut.
    capacity: static packed length (default ``B * W``). It must hold every
      active token (``info.num_dropped == 0``): a sequence cut by the
      capacity gets entries of 0.0 that are not log-probs.

  Entry ``[i, j]`` is the log-prob of response token j of sequence i, 0.0
  where there is none (see :func:`gather_response_logprobs`).
  """
  packed_ids, info = rlk_jax.pack(ids, mask, capacity=capacity,
                                  implementation=implementation)
  # Labels come from the same segment only: the last token of sequence i
  # never gets sequence i+1's first token as its label.
  targets = rlk_jax.next_token_targets(packed_ids, info,
                                       ignore_index=IGNORE_INDEX)
  logp = sequence_logprobs(params, packed_ids, info.segment_ids,
                           info.positions, targets,
                           implementation=implementation)
  index = rlk_jax.response_predict_index(info, prompt_lens, response_lens,
                                         max_response_len=max_response_len)
  return gather_response_logprobs(logp, index)


_sequence_logprobs_jit = jax.jit(sequence_logprobs,
                                 static_argnames=("implementation",))


def dense_replay(params: dict, ids, mask, prompt_lens, response_lens, *,
                 max_response_len: int,
                 implementation: str | None = None) -> jax.Array:
  """What :func:`packed_replay` computes, one sequence at a time.

  Each sequence runs alone as its own unpadded stream (length ``n_i``,
  segment 0, positions ``0..n_i-1``), so no other sequence, pad token or
  packing offset can touch it: the reference the packed replay must match
  bit for bit. Host-side loop over concrete inputs (one compilation per
  distinct length); a test oracle, not a training path.
  """
  ids, mask = np.asarray(ids), np.asarray(mask) != 0
  prompt_lens, response_lens = np.asarray(prompt_lens), np.asarray(response_lens)
  out = np.zeros((ids.shape[0], max_response_len), np.float32)
  for i in range(ids.shape[0]):
    seq = ids[i][mask[i]]
    n, p, r = len(seq), int(prompt_lens[i]), int(response_lens[i])
    if n != p + r:
      raise ValueError(f"sequence {i}: {n} active tokens but prompt_len + "
                       f"response_len = {p} + {r}.")
    if n == 0:
      continue
    targets = np.concatenate([seq[1:], [IGNORE_INDEX]]).astype(np.int32)
    logp = np.asarray(_sequence_logprobs_jit(
        params, jnp.asarray(seq), jnp.zeros((n,), jnp.int32),
        jnp.arange(n, dtype=jnp.int32), jnp.asarray(targets),
        implementation=implementation))
    for j in range(min(r, max_response_len)):
      row = p - 1 + j  # the row whose output predicts response token j
      if row >= 0:
        out[i, j] = logp[row]
  return jnp.asarray(out)


# ----------------------------------------------------------------------------
# Demo


def left_padded_batch(rng: np.random.Generator, prompt_lens, response_lens,
                      width: int, vocab: int):
  """Random left-padded (prompt + response) rows, as rollout engines return
  them; pad id 0, real ids in ``[1, vocab)``."""
  ids = np.zeros((len(prompt_lens), width), np.int32)
  mask = np.zeros((len(prompt_lens), width), bool)
  for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
    n = p + r
    ids[i, width - n:] = rng.integers(1, vocab, n)
    mask[i, width - n:] = True
  return ids, mask


def main() -> int:
  rng = np.random.default_rng(0)
  vocab = 97
  params = init_params(jax.random.key(0), vocab=vocab, d_model=32, n_heads=2,
                       n_layers=2, d_ff=64)
  prompt_lens = [5, 0, 3, 7, 1, 4]
  response_lens = [4, 6, 0, 3, 5, 8]
  max_response_len = max(response_lens)
  width = max(p + r for p, r in zip(prompt_lens, response_lens)) + 2
  ids, mask = left_padded_batch(rng, prompt_lens, response_lens, width, vocab)
  capacity = int(mask.sum()) + 5  # a few pad rows at the end of the stream
  packed = packed_replay(params, ids, mask, np.asarray(prompt_lens),
                         np.asarray(response_lens),
                         max_response_len=max_response_len, capacity=capacity)
  dense = dense_replay(params, ids, mask, prompt_lens, response_lens,
                       max_response_len=max_response_len)
  packed, dense = np.asarray(packed), np.asarray(dense)
  same = np.array_equal(packed.view(np.uint32), dense.view(np.uint32))
  print(f"{len(prompt_lens)} sequences, {int(mask.sum())} tokens packed into "
        f"{capacity} rows")
  print("response log-probs (packed replay):")
  print(np.array2string(packed, precision=3, suppress_small=True))
  print(f"packed replay == dense replay bitwise: {same} "
        f"(max |diff| = {float(np.max(np.abs(packed - dense))):.3g})")
  return 0 if same else 1


if __name__ == "__main__":
  raise SystemExit(main())
