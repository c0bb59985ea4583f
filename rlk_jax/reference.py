"""Plain ``jax.numpy`` references: the oracle for tests and the CPU fallback.

Written to be obviously correct, not fast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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


def varying_axes(aval) -> frozenset:
  """The mesh axes a value of type `aval` varies over inside a checked
  ``shard_map`` (none elsewhere; JAX 0.10 names them
  ``manual_axis_type.varying``, earlier versions ``vma``)."""
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", None)
                   or getattr(aval, "vma", None) or ())


def varying_like(init, *operands):
  """A loop's initial carry typed to vary over the mesh axes its operands
  vary over: inside a checked ``shard_map`` a loop's carry must keep one
  type, and the sums below start from constants. The values are
  unchanged (outside ``shard_map`` this returns `init`)."""
  axes = frozenset().union(*(varying_axes(jax.typeof(x)) for x in operands))
  if not axes:
    return init
  def varying(z):
    missing = axes - varying_axes(jax.typeof(z))
    return jax.lax.pcast(z, tuple(sorted(missing)), to="varying")
  return jax.tree.map(varying, init)


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

  acc = jax.lax.fori_loop(0, k, step, varying_like(
      jnp.zeros((m, n), jnp.float32), a, b))
  return acc.astype(out_dtype)


def linear_logp(hidden, weight, targets, temperature=1.0, with_entropy=True):
  """(log-prob of target, logsumexp, entropy) per row, f32, by construction
  row-invariant: the logits come from the K-loop `det_matmul`, the
  logsumexp walks the vocabulary one column at a time (elementwise over rows)
  and exp and log run at a fixed width (`rowwise`). `temperature` is a
  scalar or each row's (``[N]``). Targets outside [0, V) get log-prob 0; the
  entropy is NaN without `with_entropy`. Holds [N, V] logits: a
  reference."""
  temps = jnp.asarray(temperature, jnp.float32)
  logits = det_matmul(hidden, weight, out_dtype=jnp.float32)
  logits = logits / (temps[:, None] if temps.ndim else temps)
  n, v = logits.shape

  def column(j, carry):
    m, s, weighted = carry
    col = jax.lax.dynamic_index_in_dim(logits, j, axis=1, keepdims=False)
    m_new = jnp.maximum(m, col)
    scale = rowwise(jnp.exp, m - m_new)
    e = rowwise(jnp.exp, col - m_new)
    if with_entropy:
      weighted = weighted * scale + e * col
    return m_new, s * scale + e, weighted

  zeros = jnp.zeros((n,), jnp.float32)
  m, s, weighted = jax.lax.fori_loop(
      0, v, column, (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros))
  lse = m + rowwise(jnp.log, s)
  valid = (targets >= 0) & (targets < v)
  picked = jnp.take_along_axis(logits, jnp.clip(targets, 0, v - 1)[:, None],
                               axis=1)[:, 0]
  entropy = lse - weighted / s if with_entropy else jnp.full_like(lse, jnp.nan)
  return jnp.where(valid, picked - lse, 0.0), lse, entropy


def _elementwise(fn, x: jax.Array) -> jax.Array:
  """`rowwise` for any shape: fn's bits per element independent of x's size."""
  return rowwise(fn, x.reshape(-1)).reshape(x.shape)


def attention(q, k, v, seqs, *, scale: float, block_n: int, fold_keys: int,
              softcap: float | None = None, window: int | None = None):
  """Causal attention of packed rows, block by block, as the kernels walk it.

  q ``[Tq, Hq, D]``, k and v ``[Tk, Hkv, D]`` (Hq a multiple of Hkv: query
  head h reads KV head ``h // (Hq / Hkv)``); `seqs` int32 ``[4, B]``:
  q_start, q_len, k_start, k_len per sequence. Query i of sequence b (row
  ``q_start + i``) sits at position ``k_len - q_len + i`` and sees the keys
  ``k_start + j`` for j up to that position (and, with a window W, above
  position - W). Returns (out ``[Tq, Hq, D]`` in q's dtype, lse ``[Tq, Hq]``
  f32); rows no sequence covers are 0 (lse -inf).

  The keys go in blocks of `block_n` counted from each sequence's first
  key, with the online softmax's update after each block; every `fold_keys`
  keys the chunk's softmax state folds into a running total and starts
  afresh (the kernels' chunks, which a decode step runs in parallel).
  Products and sums are explicit loops in a fixed order, so a row's bits
  depend only on its sequence's data up to its position, on any backend.
  """
  tq, hq, dim = q.shape
  tk, hkv, _ = k.shape
  q_start, q_len, k_start, k_len = (seqs[i] for i in range(4))
  rows = jnp.arange(tq)
  member = ((rows[:, None] >= q_start[None]) &
            (rows[:, None] < (q_start + q_len)[None]))       # [Tq, B]
  covered = jnp.any(member, axis=1)
  seq = jnp.argmax(member, axis=1)
  pos = k_len[seq] - q_len[seq] + rows - q_start[seq]         # [Tq]
  qf = q.astype(jnp.float32)
  heads = jnp.arange(hq) // (hq // hkv)
  log2e = jnp.float32(1.4426950408889634)

  def contract(a, b, n):  # sum over the last axis of a * b, in order
    def step(i, acc):
      return acc + a[..., i] * b[..., i]
    return jax.lax.fori_loop(0, n, step, varying_like(jnp.zeros(
        jnp.broadcast_shapes(a.shape[:-1], b.shape[:-1]), jnp.float32), a, b))

  def block(jb, carry):
    m, l, acc = carry                                        # [Tq, Hq, ...]
    j = jb * block_n + jnp.arange(block_n)                   # [BN]
    key_rows = jnp.clip(k_start[seq][:, None] + j[None], 0, tk - 1)
    kb = k[key_rows][:, :, heads].astype(jnp.float32)        # [Tq, BN, Hq, D]
    vb = v[key_rows][:, :, heads].astype(jnp.float32)
    s = contract(qf[:, :, None, :], jnp.swapaxes(kb, 1, 2), dim) * scale
    if softcap is not None:
      s = softcap * _elementwise(jnp.tanh, s / softcap)
    s = s * log2e                                            # [Tq, Hq, BN]
    ok = (j[None] <= pos[:, None]) & covered[:, None]
    if window is not None:
      ok &= j[None] > pos[:, None] - window
    s = jnp.where(ok[:, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = _elementwise(jnp.exp2, m - m_use)
    p = _elementwise(jnp.exp2, s - m_use[..., None])
    l = l * alpha + contract(p, jnp.ones_like(p), block_n)
    # p meets v in v's dtype, as in the kernels' MMA.
    p = p.astype(v.dtype).astype(jnp.float32)
    acc = acc * alpha[..., None] + contract(
        p[..., None, :], jnp.moveaxis(vb, 1, -1), block_n)
    return m_new, l, acc

  def empty():
    return varying_like((jnp.full((tq, hq), -jnp.inf, jnp.float32),
                         jnp.zeros((tq, hq), jnp.float32),
                         jnp.zeros((tq, hq, dim), jnp.float32)), q, k, v)

  # A chunk's blocks past the last key are no-ops: walk no more of them
  # than the keys fill (a static count, so reverse mode runs).
  per_chunk = min(fold_keys // block_n, -(-tk // block_n))

  def chunk(c, total):
    # Static trip counts: reverse mode differentiates these loops.
    first = c * (fold_keys // block_n)
    m, l, acc = jax.lax.fori_loop(
        0, per_chunk, lambda i, carry: block(first + i, carry), empty())
    m_run, l_run, acc_run = total
    m_new = jnp.maximum(m_run, m)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    a = _elementwise(jnp.exp2, m_run - m_use)
    b = _elementwise(jnp.exp2, m - m_use)
    return (m_new, l_run * a + l * b,
            acc_run * a[..., None] + acc * b[..., None])

  m, l, acc = jax.lax.fori_loop(0, -(-tk // fold_keys), chunk, empty())
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  out = acc / l_safe[..., None]
  lse = jnp.where(seen, (m + _elementwise(jnp.log2, l_safe))
                  * jnp.float32(0.6931471805599453), -jnp.inf)
  return out.astype(q.dtype), lse


ROW_THREADS = 256  # cuda_ffi/csrc/row_reduce_kernels.cu: threads per row


def row_sum(x: jax.Array) -> jax.Array:
  """The sum over the last axis of each row, in float32, in the order of
  the cuda_ffi row kernel (``row_reduce_kernels.cu``, what the torch
  bridge's ``rlk::det_row_sum`` runs on SM90): thread t of 256 adds columns
  t, t + 256, ... in order; each warp of 32 merges its sums by an xor
  butterfly; the warps' sums are added in order. Only elementwise
  additions, each over one row's own values: a row's bits cannot depend on
  the other rows or their number, on any backend. The zeros that pad a
  row to a whole number of 256 columns add exactly nothing (the sums start
  at +0.0). Returns float32 ``x.shape[:-1]``."""
  x = x.astype(jnp.float32)
  lead, k = x.shape[:-1], x.shape[-1]
  if k == 0:
    return jnp.zeros(lead, jnp.float32)
  chunks = -(-k // ROW_THREADS)
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, chunks * ROW_THREADS - k)])
  x = jnp.moveaxis(x.reshape(*lead, chunks, ROW_THREADS), -2, 0)
  # Unrolled by up to 64 chunks: XLA fuses each 64 adds into one pass,
  # where a plain loop ran one launch a chunk on a GPU; a vocabulary's 501
  # chunks take 8 passes. Unrolled whole, those took 2.6x the compile time
  # and made an 8x512 forward of Llama-3.2-1B's shapes 13% slower (H100,
  # 2026-11-28). The adds and their order are the same either way.
  per_thread, _ = jax.lax.scan(lambda acc, c: (acc + c, None),
                               varying_like(jnp.zeros((*lead, ROW_THREADS),
                                                      jnp.float32), x), x,
                               unroll=min(chunks, 64))
  # The per-thread sums are materialised: left to fuse with the tree below,
  # XLA ran one GPU thread per warp sum, each adding 32 threads' columns
  # alone (a norm's statistic took 3.5-13 us where XLA's own reduction takes
  # 1.3; fused, the forward compiled 5x slower, 2026-11-28). Apart, the sums
  # above run one thread per (row, lane).
  per_thread = jax.lax.optimization_barrier(per_thread)
  # The xor butterfly, as lane 0 reads it: after offset o, lane i < o holds
  # lane i's value + lane (i + o)'s, in that order; halving the lanes keeps
  # exactly those adds (the full butterfly, written out, recomputed every
  # lane's sum 32 times in XLA's fusion).
  lanes = per_thread.reshape(*lead, ROW_THREADS // 32, 32)
  for offset in (16, 8, 4, 2, 1):
    lanes = lanes[..., :offset] + lanes[..., offset:2 * offset]
  warps = lanes[..., 0]
  total = warps[..., 0]
  for w in range(1, ROW_THREADS // 32):
    total = total + warps[..., w]
  return total


def exp(x: jax.Array) -> jax.Array:
  """e**x in float32 from adds, multiplies, a rounding and exponent bits
  alone (Cody-Waite reduction x = n ln2 + r with ln2 split in two, a
  degree-7 Taylor polynomial of e**r in Horner form, then 2**n as two
  exactly representable factors so results down to subnormals keep their
  scale): every step is an IEEE operation on one element, so an element's
  bits cannot depend on how a compiler lays the loop around it out. Within
  1.2 ulp of e**x for normal results; +inf past 88.72, 0 below -104, NaN
  for NaN. Returns float32."""
  x = jnp.clip(x.astype(jnp.float32), -104.0, 89.0)
  n = jnp.round(x * np.float32(1.4426950408889634))
  r = ((x - n * np.float32(0.693145751953125))
       - n * np.float32(1.4286067653301870e-6))
  p = jnp.full_like(r, 1.0 / 5040)
  for c in (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
    p = p * r + np.float32(c)
  k = n.astype(jnp.int32)
  half = k // 2
  pow2 = lambda e: jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)
  return (p * pow2(half)) * pow2(k - half)


def _tangent_rule(tangent):
  """A function as a ``custom_jvp`` whose tangent is ``tangent(t, x, y)``
  (t and x in float32, y the function's value): its derivative by its own
  rule, in the same per-element arithmetic. `log` reads its argument's
  bits, which autodiff would take for constants (a zero gradient)."""
  def wrap(fn):
    fn = jax.custom_jvp(fn)

    @fn.defjvp
    def jvp(primals, tangents):
      y = fn(primals[0])
      return y, tangent(tangents[0].astype(jnp.float32),
                        primals[0].astype(jnp.float32), y)
    return fn
  return wrap


@_tangent_rule(lambda t, x, y: t / x)
def log(x: jax.Array) -> jax.Array:
  """The natural log in float32 from adds, multiplies, integer bit
  operations and comparisons alone (Cephes' logf: x = m 2**e with m in
  [sqrt(1/2), sqrt(2)), f = m - 1 exact, a degree-9 polynomial of f, e ln2
  added with ln2 split in two), so an element's bits cannot depend on how a
  compiler lays the loop around it out (as `exp`). Within 1 ulp of log(x)
  for positive finite x, subnormals included: they are read from their
  bits (their mantissa as an integer, times 2**-149), since XLA:CPU treats
  a subnormal operand of arithmetic as zero. -inf at +-0, NaN below 0 and
  for NaN, +inf at +inf. Returns float32."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  magnitude = bits & 0x7FFFFFFF
  mantissa = bits & 0x007FFFFF
  subnormal = (magnitude < 0x00800000) & (magnitude != 0)
  # A subnormal's mantissa as a float (exact below 2**24) is a normal
  # number 2**149 times larger.
  normal = jnp.where(subnormal, mantissa.astype(jnp.float32),
                     jax.lax.bitcast_convert_type(magnitude, jnp.float32))
  nbits = jax.lax.bitcast_convert_type(normal, jnp.int32)
  e = ((nbits >> 23) & 0xFF) - 126 - jnp.where(subnormal, 149, 0)
  # m in [0.5, 1): the exponent field of 0.5 under the mantissa bits.
  m = jax.lax.bitcast_convert_type((nbits & 0x007FFFFF) | 0x3F000000,
                                   jnp.float32)
  low = m < np.float32(0.70710678118654752)
  e = jnp.where(low, e - 1, e).astype(jnp.float32)
  f = jnp.where(low, m + m, m) - 1.0
  z = f * f
  p = jnp.full_like(f, 7.0376836292e-2)
  for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
            1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1,
            -2.4999993993e-1, 3.3333331174e-1):
    p = p * f + np.float32(c)
  y = p * f * z + e * np.float32(-2.12194440e-4) - 0.5 * z
  y = (f + y) + e * np.float32(0.693359375)
  y = jnp.where(magnitude == 0, -jnp.inf, y)
  y = jnp.where(magnitude == 0x7F800000, jnp.inf, y)
  return jnp.where(((bits < 0) & (magnitude != 0)) | (magnitude > 0x7F800000),
                   jnp.nan, y)


@_tangent_rule(lambda t, x, y: t / (1.0 + x))
def log1p(x: jax.Array) -> jax.Array:
  """log(1 + x) in float32 on `log` (Goldberg's form: u = 1 + x, then
  log(u) x / (u - 1), which cancels u's rounding; x itself where u rounds
  to 1): IEEE operations per element, as `log`."""
  x = x.astype(jnp.float32)
  # The barrier keeps XLA from folding (1 + x) - 1 back into x, which
  # would undo the form's cancellation.
  u = jax.lax.optimization_barrier(1.0 + x)
  y = jnp.where(u == 1.0, x, log(u) * (x / (u - 1.0)))
  return jnp.where(u == jnp.inf, u, y)


@_tangent_rule(lambda t, x, y: t * (y + 1.0))
def expm1(x: jax.Array) -> jax.Array:
  """e**x - 1 in float32 on `exp` and `log` (Kahan's form: u = e**x, then
  (u - 1) x / log(u); x where u rounds to 1, -1 where u - 1 does): IEEE
  operations per element, as `exp`."""
  x = x.astype(jnp.float32)
  u = exp(x)
  um1 = u - 1.0
  y = jnp.where(um1 == -1.0, -1.0, um1 * (x / log(u)))
  y = jnp.where(u == 1.0, x, y)
  return jnp.where(u == jnp.inf, u, y)


def rsqrt(x: jax.Array) -> jax.Array:
  """1 / sqrt(x) in float32 as two correctly rounded IEEE operations
  (XLA:CPU's rsqrt fused after a broadcast, as an RMSNorm's, takes a code
  path per element that the loop's shape picks): within 1.5 ulp."""
  return 1.0 / sqrt(x)


def sqrt(x: jax.Array) -> jax.Array:
  """sqrt(x) in float32, correctly rounded, that XLA cannot merge into a
  division: its algebraic simplifier turns ``a / sqrt(b)`` (an RMSNorm's
  ``x / rms``) into ``a * rsqrt(b)``, and XLA:CPU's rsqrt fused after a
  broadcast takes a code path per element that the loop's shape picks
  (Tunix's Qwen 3 q/k norms: a decode step's logits alone differed from
  its batch's)."""
  return jax.lax.optimization_barrier(jnp.sqrt(x.astype(jnp.float32)))


def logistic(x: jax.Array) -> jax.Array:
  """1 / (1 + e**-x) in float32 on `exp` (IEEE operations per element, as
  there): within 3 ulp; 0 and 1 at the ends."""
  return 1.0 / (1.0 + exp(-x.astype(jnp.float32)))


def tanh(x: jax.Array) -> jax.Array:
  """tanh in float32 from IEEE operations per element: Cephes' odd
  polynomial below |x| = 0.625, 1 - 2 / (e**2|x| + 1) on `exp` above (with
  x's sign); within 3 ulp."""
  x = x.astype(jnp.float32)
  a = jnp.abs(x)
  z = x * x
  p = np.float32(-5.70498872745e-3)
  for c in (2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
            -3.33332819422e-1):
    p = p * z + np.float32(c)
  small = x + x * z * p
  large = 1.0 - 2.0 / (exp(2.0 * a) + 1.0)
  return jnp.where(a < 0.625, small, jnp.where(x < 0, -large, large))
