"""linear_logp's kernels as ``@triton.jit`` functions: the arithmetic of
``pallas_kernels/linear_logp.py`` (whose docstring gives the invariance
argument), so that the op can leave Pallas's deprecated Triton lowering.

* ``_fused_kernel``: one program per ``BLOCK_M`` rows walks the vocabulary in
  ``BLOCK_N`` chunks; each chunk's logits come from det_matmul's
  ``tile_product`` (its K loop) and feed one
  online logsumexp update in f32. No logits in memory.
* ``_stats_kernel``: the same update over a chunk of precomputed f32 logits,
  folding it into running stats in place (the SM90 route's second half).

exp and log are libdevice's ``__nv_expf``/``__nv_logf``, the calls Pallas's
Triton lowering emits for ``jnp.exp``/``jnp.log`` (``tl.exp`` would lower to
``ex2.approx``: other bits). Triton's interpreter has no libdevice, so an
``INTERPRETED`` switch (set only there) uses ``tl.exp``/``tl.log`` and
computes the tile product as a broadcast sum (``tile_product`` says why);
the CPU tests check arithmetic, the device tests bits.

Launchers: ``linear_logp`` / ``update_stats`` (JAX arrays, jax-triton; the
sizes are compile-time constants, ``det_matmul.matmul`` says why) and
``linear_logp_torch`` / ``update_stats_torch`` (torch tensors, Triton's own
launcher, or its interpreter on CPU).
"""

from __future__ import annotations

from triton_kernels import jax_launch
from triton_kernels.backend import cdiv, interpreted, tl, triton
from triton_kernels.det_matmul import tile_product

__all__ = ["linear_logp", "update_stats", "linear_logp_torch",
           "update_stats_torch"]


if triton is not None:
  from triton.language.extra.cuda import libdevice

  @triton.jit
  def _exp(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
      return tl.exp(x)
    else:
      return libdevice.exp(x)

  @triton.jit
  def _log(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
      return tl.log(x)
    else:
      return libdevice.log(x)

  @triton.jit
  def _online_update(m, s, picked, weighted, logits, col_ids, col_in, target,
                     temp, WITH_ENTROPY: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    # One [BLOCK_M, BLOCK_N] logits tile into each row's running (max, sum of
    # exp, target logit, sum of exp * logit), at each row's temperature, in
    # the Pallas kernel's order; the last sum only when entropy is asked.
    logits = logits / temp[:, None]
    logits = tl.where(col_in[None, :], logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    scale = _exp(m - m_new, INTERPRETED)
    e = _exp(logits - m_new[:, None], INTERPRETED)
    finite = tl.where(col_in[None, :], logits, 0.0)
    s = s * scale + tl.sum(e, axis=1)
    if WITH_ENTROPY:
      weighted = weighted * scale + tl.sum(e * finite, axis=1)
    picked = picked + tl.sum(
        tl.where(col_ids[None, :] == target[:, None], finite, 0.0), axis=1)
    return m_new, s, picked, weighted

  @triton.jit
  def _fused_kernel(h_ptr, w_ptr, t_ptr, temp_ptr, logp_ptr, lse_ptr, ent_ptr,
                    N, H, V, WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < N
    rm = rows.to(tl.int64)  # 64-bit: N x H passes 2**31 elements
    target = tl.load(t_ptr + rm, mask=row_in, other=-1)
    temp = tl.load(temp_ptr + rm, mask=row_in, other=1.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    picked = tl.zeros((BLOCK_M,), tl.float32)
    weighted = tl.zeros((BLOCK_M,), tl.float32)
    for c0 in range(0, V, BLOCK_N):
      col_ids = c0 + tl.arange(0, BLOCK_N)
      col_in = col_ids < V
      # Overhanging rows and columns load wrapped, real ones: the update
      # masks those columns to -inf and those rows are never stored.
      logits = tile_product(h_ptr, w_ptr, rm % N, col_ids.to(tl.int64) % V,
                            H, H, 1, V, 1, BLOCK_M, BLOCK_N, BLOCK_K,
                            INTERPRETED)
      m, s, picked, weighted = _online_update(
          m, s, picked, weighted, logits, col_ids, col_in, target, temp,
          WITH_ENTROPY, INTERPRETED)
    lse = m + _log(s, INTERPRETED)
    valid = (target >= 0) & (target < V)
    tl.store(logp_ptr + rm, tl.where(valid, picked - lse, 0.0), mask=row_in)
    tl.store(lse_ptr + rm, lse, mask=row_in)
    if WITH_ENTROPY:
      tl.store(ent_ptr + rm, lse - weighted / s, mask=row_in)
    else:
      tl.store(ent_ptr + rm, tl.full((BLOCK_M,), float("nan"), tl.float32),
               mask=row_in)

  @triton.jit
  def _stats_kernel(x_ptr, t_ptr, temp_ptr, m_ptr, s_ptr, p_ptr, w_ptr,
                    m_out, s_out, p_out, w_out, N: tl.constexpr,
                    C: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                    BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr = False):
    # From JAX the outputs alias the inputs (the same buffers): each row
    # block reads its stats, folds the chunk in and writes them back.
    # N and C are compile-time constants on both routes: jax-triton makes
    # them so, and the tile's load layout (so the order of each row's sum)
    # follows what the compiler knows of C; as runtime sizes from torch, 46
    # of 1000 rows' sums differed by an ulp (H100, 2026-11-23).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < N
    rm = rows.to(tl.int64)
    target = tl.load(t_ptr + rm, mask=row_in, other=-1)
    temp = tl.load(temp_ptr + rm, mask=row_in, other=1.0)
    m = tl.load(m_ptr + rm, mask=row_in, other=0.0)
    s = tl.load(s_ptr + rm, mask=row_in, other=0.0)
    picked = tl.load(p_ptr + rm, mask=row_in, other=0.0)
    weighted = tl.load(w_ptr + rm, mask=row_in, other=0.0)
    for c0 in range(0, C, BLOCK_N):
      col_ids = c0 + tl.arange(0, BLOCK_N)
      col_in = col_ids < C
      tile = tl.load(x_ptr + rm[:, None] * C + col_ids.to(tl.int64)[None, :],
                     mask=row_in[:, None] & col_in[None, :], other=0.0)
      m, s, picked, weighted = _online_update(
          m, s, picked, weighted, tile, col_ids, col_in, target, temp,
          WITH_ENTROPY, INTERPRETED)
    tl.store(m_out + rm, m, mask=row_in)
    tl.store(s_out + rm, s, mask=row_in)
    tl.store(p_out + rm, picked, mask=row_in)
    tl.store(w_out + rm, weighted, mask=row_in)


def _grid(n, config):
  return (cdiv(n, config.block_m),)


def linear_logp(hidden, weight, targets, temps, *, with_entropy: bool = True,
                config):
  """hidden [N, H], weight [H, V], targets int32 [N], temps f32 [N] (each
  row's temperature; JAX arrays, N > 0) -> (logp, lse, entropy), f32 [N]; a
  target outside [0, V) gives log-prob 0, the entropy is NaN without
  `with_entropy`.
  `config`: block_m/block_n/block_k/num_warps/num_stages (the Pallas
  kernel's MatmulConfig)."""
  import jax
  import jax.numpy as jnp
  n, h = hidden.shape
  v = weight.shape[1]
  out = jax.ShapeDtypeStruct((n,), jnp.float32)
  return jax_launch.triton_call(
      hidden, weight, targets, temps, kernel=_fused_kernel,
      out_shape=(out,) * 3,
      grid=_grid(n, config), num_warps=config.num_warps,
      num_stages=config.num_stages, name="rlk_linear_logp_triton",
      N=n, H=h, V=v, WITH_ENTROPY=bool(with_entropy), BLOCK_M=config.block_m,
      BLOCK_N=config.block_n, BLOCK_K=config.block_k)


def update_stats(logits, targets, temps, stats, *, with_entropy: bool = True,
                 config):
  """Folds f32 logits [N, C] into the running stats (four f32 [N], updated
  in place: the outputs alias them); `targets` int32 [N] index this chunk,
  `temps` f32 [N] are the rows' temperatures."""
  import jax
  import jax.numpy as jnp
  n, c = logits.shape
  out = jax.ShapeDtypeStruct((n,), jnp.float32)
  return jax_launch.triton_call(
      logits, targets, temps, *stats, kernel=_stats_kernel,
      out_shape=(out,) * 4, input_output_aliases={3: 0, 4: 1, 5: 2, 6: 3},
      grid=_grid(n, config),
      num_warps=config.num_warps, num_stages=config.num_stages,
      name="rlk_logits_stats_triton", N=n, C=c,
      WITH_ENTROPY=bool(with_entropy), BLOCK_M=config.block_m,
      BLOCK_N=config.block_n)


def linear_logp_torch(hidden, weight, targets, temps, logp, lse, entropy, *,
                      with_entropy: bool = True, config):
  """The fused kernel on torch tensors (contiguous; targets int32, temps
  f32), into `logp`, `lse` and `entropy` (f32 [N])."""
  n, h = hidden.shape
  v = weight.shape[1]
  _fused_kernel[_grid(n, config)](
      hidden, weight, targets, temps, logp, lse, entropy, n, h, v,
      WITH_ENTROPY=bool(with_entropy), BLOCK_M=config.block_m,
      BLOCK_N=config.block_n, BLOCK_K=config.block_k,
      INTERPRETED=interpreted(), num_warps=config.num_warps,
      num_stages=config.num_stages)
  return logp, lse, entropy


def update_stats_torch(logits, targets, temps, stats, *,
                       with_entropy: bool = True, config):
  """The stats kernel on torch tensors, updating the four `stats` in place
  (compiled per N and C, as jax-triton compiles it: the same bits)."""
  n, c = logits.shape
  _stats_kernel[_grid(n, config)](
      logits, targets, temps, *stats, *stats, n, c,
      WITH_ENTROPY=bool(with_entropy),
      BLOCK_M=config.block_m, BLOCK_N=config.block_n,
      INTERPRETED=interpreted(), num_warps=config.num_warps,
      num_stages=config.num_stages)
  return stats
