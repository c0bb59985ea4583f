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

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.det_matmul import MatmulConfig, tile_product
from pallas_kernels.triton_backend import IMPORT_ERROR, pltriton

# det_matmul's tile parameters; smaller row blocks, because each program also
# carries four running row statistics across the whole vocabulary.
DEFAULT_CONFIG = MatmulConfig(block_m=64, block_n=128, block_k=64,
                              num_warps=4, num_stages=2)


def _online_update(carry, logits, col_ids, col_in, target, temp,
                   with_entropy):
  """One ``[bm, bn]`` logits tile into the running (max, sum of exp,
  target logit, sum of exp * logit) of each row, in f32, at each row's
  temperature `temp`. Both kernels below walk the vocabulary through this
  one update, tile after tile, in order. Without entropy the sum of
  exp * logit is not taken (no work for what nobody reads)."""
  m, s, picked, weighted = carry
  logits = logits / temp[:, None]
  logits = jnp.where(col_in[None, :], logits, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(logits, axis=1))
  scale = jnp.exp(m - m_new)
  e = jnp.exp(logits - m_new[:, None])
  finite = jnp.where(col_in[None, :], logits, 0.0)
  s = s * scale + jnp.sum(e, axis=1)
  if with_entropy:
    weighted = weighted * scale + jnp.sum(e * finite, axis=1)
  picked = picked + jnp.sum(
      jnp.where(col_ids[None, :] == target[:, None], finite, 0.0), axis=1)
  return m_new, s, picked, weighted


def _initial_stats(bm):
  return (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
          jnp.zeros((bm,), jnp.float32), jnp.zeros((bm,), jnp.float32))


def finish(stats, targets, v, log=jnp.log, with_entropy=True):
  """(logp, lse, entropy) from the final running stats; a target outside
  [0, V) gives log-prob 0; the entropy is NaN where it was not folded.
  Outside a kernel, callers pass a `log` whose bits do not depend on the
  number of rows (rlk_jax.reference.rowwise)."""
  m, s, picked, weighted = stats
  lse = m + log(s)
  valid = (targets >= 0) & (targets < v)
  entropy = lse - weighted / s if with_entropy else jnp.full_like(lse, jnp.nan)
  return jnp.where(valid, picked - lse, 0.0), lse, entropy


def _row_operands(t_ref, temp_ref, rows, row_in):
  """A row block's targets and temperatures (overhanging rows: no target,
  temperature 1, never stored)."""
  return (pltriton.load(t_ref.at[rows], mask=row_in, other=jnp.int32(-1)),
          pltriton.load(temp_ref.at[rows], mask=row_in, other=1.0))


def _kernel(h_ref, w_ref, t_ref, temp_ref, logp_ref, lse_ref, ent_ref, *, n,
            hdim, v, with_entropy, cfg):
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  r0 = pl.program_id(0) * bm
  rows = pl.ds(r0, bm)
  row_in = r0 + jnp.arange(bm, dtype=jnp.int32) < n
  target, temp = _row_operands(t_ref, temp_ref, rows, row_in)

  def vocab_step(j, carry):
    c0 = j * bn
    col_ids = c0 + jnp.arange(bn, dtype=jnp.int32)
    logits = tile_product(h_ref, w_ref, r0, c0, m=n, n=v, k=hdim, block_m=bm,
                          block_n=bn, block_k=bk)
    return _online_update(carry, logits, col_ids, col_ids < v, target, temp,
                          with_entropy)

  stats = jax.lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(v, bn)),
                            vocab_step, _initial_stats(bm))
  for ref, value in zip((logp_ref, lse_ref, ent_ref),
                        finish(stats, target, v, with_entropy=with_entropy)):
    pltriton.store(ref.at[rows], value, mask=row_in)


def _stats_kernel(x_ref, t_ref, temp_ref, m_ref, s_ref, p_ref, w_ref, m_out,
                  s_out, p_out, w_out, *, n, c, with_entropy, cfg):
  # The outputs alias the stats inputs: each row block reads its stats, folds
  # the chunk in, and writes them back in place.
  bm, bn = cfg.block_m, cfg.block_n
  r0 = pl.program_id(0) * bm
  rows = pl.ds(r0, bm)
  row_in = r0 + jnp.arange(bm, dtype=jnp.int32) < n
  target, temp = _row_operands(t_ref, temp_ref, rows, row_in)
  carry = tuple(pltriton.load(ref.at[rows], mask=row_in, other=0.0)
                for ref in (m_ref, s_ref, p_ref, w_ref))

  def column_step(j, carry):
    c0 = j * bn
    col_ids = c0 + jnp.arange(bn, dtype=jnp.int32)
    col_in = col_ids < c
    tile = pltriton.load(x_ref.at[rows, pl.ds(c0, bn)],
                         mask=row_in[:, None] & col_in[None, :], other=0.0)
    return _online_update(carry, tile, col_ids, col_in, target, temp,
                          with_entropy)

  carry = jax.lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(c, bn)),
                            column_step, carry)
  for ref, value in zip((m_out, s_out, p_out, w_out), carry):
    pltriton.store(ref.at[rows], value, mask=row_in)


def initial_stats(n):
  """Running stats of N rows before any logits: ``update_stats`` input."""
  return _initial_stats(n)


def update_stats(logits, targets, temps, stats, *, with_entropy: bool = True,
                 interpret: bool = False, config: MatmulConfig = DEFAULT_CONFIG):
  """Folds a chunk of precomputed f32 logits ``[N, C]`` into the running
  stats (a 4-tuple of f32 ``[N]``, from :func:`initial_stats` or an earlier
  call); `targets` int32 ``[N]`` are column indices into this chunk (outside
  [0, C): no hit), `temps` f32 ``[N]`` the rows' temperatures. Chunks folded in vocabulary order, with C a multiple of
  ``config.block_n``, walk the same tiles in the same order as the fused
  kernel. :func:`finish` turns the final stats into (logp, lse, entropy)."""
  if pltriton is None:
    raise RuntimeError(IMPORT_ERROR)
  n, c = logits.shape
  kernel = functools.partial(_stats_kernel, n=n, c=c,
                             with_entropy=bool(with_entropy), cfg=config)
  out = jax.ShapeDtypeStruct((n,), jnp.float32)
  return pl.pallas_call(
      kernel, out_shape=(out,) * 4, grid=(pl.cdiv(n, config.block_m),),
      input_output_aliases={3: 0, 4: 1, 5: 2, 6: 3}, interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      name="rlk_logits_stats",
  )(logits, targets, temps, *stats)


def linear_logp(hidden, weight, targets, temps, *, with_entropy: bool = True,
                interpret: bool = False, config: MatmulConfig = DEFAULT_CONFIG):
  """hidden [N, H], weight [H, V], targets int32 [N], temps f32 [N] (each
  row's temperature) -> (logp, lse, entropy), each f32 [N]. A target outside
  [0, V) gives log-prob 0 (ignored); the entropy is NaN without
  `with_entropy`."""
  if pltriton is None:
    raise RuntimeError(IMPORT_ERROR)
  n, hdim = hidden.shape
  v = weight.shape[1]
  out = jax.ShapeDtypeStruct((n,), jnp.float32)
  kernel = functools.partial(_kernel, n=n, hdim=hdim, v=v,
                             with_entropy=bool(with_entropy), cfg=config)
  return pl.pallas_call(
      kernel, out_shape=(out, out, out), grid=(pl.cdiv(n, config.block_m),),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      name="rlk_linear_logp",
  )(hidden, weight, targets, temps)
