"""Fused ``hidden @ weight -> log_softmax -> pick target`` per row block.

One program owns ``block_m`` rows and walks the vocabulary in ``block_n``
chunks; each chunk's logits come from det_matmul's K loop (fixed ``block_k``
steps, in order) and feed an online logsumexp in f32, so the ``[N, V]``
logits never exist in memory. Every reduction (over K, over a chunk's
columns, over chunks) happens inside one program on blocks of one fixed
shape, in one fixed order: a row's log-prob cannot depend on the other rows,
whatever N is. The product tiles come from det_matmul's own `tile_product`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.det_matmul import tile_product
from pallas_kernels.triton_backend import IMPORT_ERROR, pltriton


@dataclasses.dataclass(frozen=True)
class LogpConfig:
  block_m: int = 64
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_CONFIG = LogpConfig()


def _kernel(h_ref, w_ref, t_ref, logp_ref, lse_ref, ent_ref, *, n, hdim, v,
            temperature, cfg):
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  r0 = pl.program_id(0) * bm
  rows = pl.ds(r0, bm)
  row_in = r0 + jnp.arange(bm, dtype=jnp.int32) < n
  target = pltriton.load(t_ref.at[rows], mask=row_in, other=jnp.int32(-1))

  def vocab_step(j, carry):
    m, s, picked, weighted = carry
    c0 = j * bn
    col_ids = c0 + jnp.arange(bn, dtype=jnp.int32)
    col_in = col_ids < v

    logits = tile_product(h_ref, w_ref, r0, c0, m=n, n=v, k=hdim, block_m=bm,
                          block_n=bn, block_k=bk)
    logits = logits / jnp.float32(temperature)
    logits = jnp.where(col_in[None, :], logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(logits - m_new[:, None])
    finite = jnp.where(col_in[None, :], logits, 0.0)
    s = s * scale + jnp.sum(e, axis=1)
    weighted = weighted * scale + jnp.sum(e * finite, axis=1)
    picked = picked + jnp.sum(
        jnp.where(col_ids[None, :] == target[:, None], finite, 0.0), axis=1)
    return m_new, s, picked, weighted

  init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
          jnp.zeros((bm,), jnp.float32), jnp.zeros((bm,), jnp.float32))
  m, s, picked, weighted = jax.lax.fori_loop(
      jnp.int32(0), jnp.int32(pl.cdiv(v, bn)), vocab_step, init)
  lse = m + jnp.log(s)
  valid = (target >= 0) & (target < v)
  pltriton.store(logp_ref.at[rows], jnp.where(valid, picked - lse, 0.0),
                 mask=row_in)
  pltriton.store(lse_ref.at[rows], lse, mask=row_in)
  pltriton.store(ent_ref.at[rows], lse - weighted / s, mask=row_in)


def linear_logp(hidden, weight, targets, *, temperature: float = 1.0,
                interpret: bool = False, config: LogpConfig = DEFAULT_CONFIG):
  """hidden [N, H], weight [H, V], targets int32 [N] -> (logp, lse, entropy),
  each f32 [N]. A target outside [0, V) gives log-prob 0 (ignored)."""
  if pltriton is None:
    raise RuntimeError(IMPORT_ERROR)
  n, hdim = hidden.shape
  v = weight.shape[1]
  out = jax.ShapeDtypeStruct((n,), jnp.float32)
  kernel = functools.partial(_kernel, n=n, hdim=hdim, v=v,
                             temperature=float(temperature), cfg=config)
  return pl.pallas_call(
      kernel, out_shape=(out, out, out), grid=(pl.cdiv(n, config.block_m),),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      name="rlk_linear_logp",
  )(hidden, weight, targets)
