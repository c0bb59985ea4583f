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
