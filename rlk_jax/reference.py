"""Plain ``jax.numpy`` references: the oracle for tests and the CPU fallback.

Written to be obviously correct, not fast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_rows(src: jax.Array, idx: jax.Array, fill) -> jax.Array:
  """``out[i] = src[idx[i]]`` where ``idx[i] >= 0``, else ``fill``."""
  n_out, = idx.shape
  n_src, width = src.shape
  if n_src == 0:
    return jnp.full((n_out, width), fill, src.dtype)
  rows = jnp.take(src, jnp.clip(idx, 0, n_src - 1), axis=0)
  return jnp.where((idx >= 0)[:, None], rows, jnp.asarray(fill, src.dtype))


# XLA's CPU backend computes a transcendental function with vector code over
# most of an array and other code over its remainder, so an element's bits can
# depend on the array's length: on random [N] rows, jnp.log of a 1-3 row
# window differed from the same rows inside the batch about once in a hundred
# tries. Padded to this many lanes and materialized before the slice, every
# element takes the same code whatever N is.
_LANES = 128


def rowwise(fn, x: jax.Array) -> jax.Array:
  """``fn(x)`` for an elementwise `fn` over a 1-D `x`, with each element's
  bits independent of x's length on every backend (see _LANES)."""
  n, = x.shape
  padded = jnp.pad(x, (0, -n % _LANES), constant_values=1)
  # The barrier keeps XLA from fusing the slice back into fn's loop, whose
  # bounds would then be N again, remainder and all.
  return jax.lax.optimization_barrier(fn(padded))[:n]


def det_matmul(a: jax.Array, b: jax.Array, transpose_a: bool = False,
               transpose_b: bool = False, out_dtype=None) -> jax.Array:
  """``op(a) @ op(b)`` as an explicit loop over K of f32 multiply-adds.

  The reduction order (k = 0, 1, ..., K-1, one rounding per add) is fixed by
  construction and every element is computed on its own, so a row's bits
  cannot depend on M or on the other rows, on any backend.
  """
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  a = (a.T if transpose_a else a).astype(jnp.float32)
  b = (b.T if transpose_b else b).astype(jnp.float32)
  m, k = a.shape
  n = b.shape[1]
  if k == 0:  # the body is traced even for zero trips; an empty sum is +0.0
    return jnp.zeros((m, n), out_dtype)

  def step(i, acc):
    column = jax.lax.dynamic_slice_in_dim(a, i, 1, axis=1)  # [M, 1]
    row = jax.lax.dynamic_slice_in_dim(b, i, 1, axis=0)     # [1, N]
    return acc + column * row

  acc = jax.lax.fori_loop(0, k, step, jnp.zeros((m, n), jnp.float32))
  return acc.astype(out_dtype)


def linear_logp(hidden, weight, targets, temperature=1.0):
  """(log-prob of target, logsumexp, entropy) per row, f32, by construction
  row-invariant: the logits come from the K-loop `det_matmul`, the
  logsumexp walks the vocabulary one column at a time (elementwise over rows)
  and exp and log run at a fixed width (`rowwise`). Targets outside [0, V)
  get log-prob 0. Holds [N, V] logits: a reference."""
  logits = det_matmul(hidden, weight, out_dtype=jnp.float32) / jnp.float32(temperature)
  n, v = logits.shape

  def column(j, carry):
    m, s, weighted = carry
    col = jax.lax.dynamic_index_in_dim(logits, j, axis=1, keepdims=False)
    m_new = jnp.maximum(m, col)
    scale = rowwise(jnp.exp, m - m_new)
    e = rowwise(jnp.exp, col - m_new)
    return m_new, s * scale + e, weighted * scale + e * col

  zeros = jnp.zeros((n,), jnp.float32)
  m, s, weighted = jax.lax.fori_loop(
      0, v, column, (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros))
  lse = m + rowwise(jnp.log, s)
  valid = (targets >= 0) & (targets < v)
  picked = jnp.take_along_axis(logits, jnp.clip(targets, 0, v - 1)[:, None],
                               axis=1)[:, 0]
  return jnp.where(valid, picked - lse, 0.0), lse, lse - weighted / s
