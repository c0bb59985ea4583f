"""linear_logp: per-token log-probs of targets from hidden states and the LM
head, in f32, without holding the [N, V] logits, batch-invariant bitwise.

The forward is one fused pass (``pallas``, or ``triton``: the same kernel
as a @triton.jit function through jax-triton), chunks of f32 logits from the
SM90 det_gemm folded into the same online logsumexp by small CUDA kernels
behind XLA FFI (``cuda_ffi``: one ``[N, chunk_size]`` block at a time, every
launch a command-buffer-compatible FFI call; the torch bridge launches the
same kernels on torch's stream), or the column-by-column reference
(``xla``). The backward recomputes the logits a vocabulary chunk at a time
with det_gemm: ``dlogits = g·(onehot - p) - g_ent·p·(logit - E[logit])`` (a
CUDA kernel on ``cuda_ffi``), then ``dh += dlogits @ W_cᵀ`` and
``dW_c = hᵀ @ dlogits`` (fixed chunk order, fixed row order), so only one
``[N, chunk]`` block lives at a time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import cuda_ffi
from pallas_kernels import linear_logp as logp_kernel
from rlk_jax import _det_gemm, _dispatch, _sharding, _tree_reduction, reference
from triton_kernels import backend as triton_backend
from triton_kernels import linear_logp as triton_logp

IGNORE_INDEX = -100


# Every implementation takes (hidden [N, H], weight [H, V], targets int32
# [N], temps f32 [N], chunk_size, with_entropy) and returns (logp, lse,
# entropy), f32 [N] each; the entropy is NaN without with_entropy, and none
# of its work is done.


def _reference(hidden, weight, targets, temps, chunk_size, with_entropy):
  del chunk_size  # the oracle holds all the logits
  return reference.linear_logp(hidden, weight, targets, temps, with_entropy)


def _pallas(hidden, weight, targets, temps, chunk_size, with_entropy, *,
            interpret):
  del chunk_size  # fused: no logits block at all
  return logp_kernel.linear_logp(hidden, weight, targets, temps,
                                 with_entropy=with_entropy,
                                 interpret=interpret)


def _no_rows():
  """(logp, lse, entropy) of zero rows: no launch for an empty grid."""
  return tuple(jnp.zeros((0,), jnp.float32) for _ in range(3))


def _triton(hidden, weight, targets, temps, chunk_size, with_entropy):
  del chunk_size  # fused, like "pallas"
  n = hidden.shape[0]
  if not n:
    return _no_rows()
  return triton_logp.linear_logp(hidden, weight, targets, temps,
                                 with_entropy=with_entropy,
                                 config=logp_kernel.DEFAULT_CONFIG)


def _chunked_sm90(hidden, weight, targets, temps, chunk_size, with_entropy):
  # The logits of one vocabulary chunk at a time come from the SM90 det_gemm
  # (row-invariant); the CUDA stats kernel folds them into each row's
  # running logsumexp in vocabulary order, one warp per row in a fixed lane
  # order: a row's result never depends on the other rows. (Not jax-triton's
  # stats kernel: its legacy custom call splits XLA's command buffers.) The
  # finish is a CUDA kernel too, so the torch bridge's route, which launches
  # the same kernels in the same order, has these bits.
  # Rows go in blocks of at most LOGITS_BLOCK_BYTES of f32 logits (the
  # bits do not depend on it: every step is per row).
  n, v = hidden.shape[0], weight.shape[1]
  if not n:
    return _no_rows()
  stats = logp_kernel.initial_stats(n)
  for c0 in range(0, v, chunk_size):  # a fixed order: the same every call
    w_c = weight[:, c0:c0 + chunk_size]
    blocks = []
    for r0, r1 in row_blocks(n, w_c.shape[1], LOGITS_BLOCK_BYTES):
      logits = _det_gemm.det_gemm(hidden[r0:r1], w_c, out_dtype=jnp.float32,
                                  implementation="cuda_ffi")
      blocks.append(cuda_ffi.logits_stats(
          logits, targets[r0:r1] - c0, temps[r0:r1],
          [s[r0:r1] for s in stats], with_entropy=with_entropy))
    stats = tuple(map(jnp.concatenate, zip(*blocks)))
  return cuda_ffi.logits_finish(stats, targets, v, with_entropy=with_entropy)


# The SM90 routes (here and the torch bridge's) hold f32 logits one (row
# block, vocabulary chunk) at a time, at most about this many bytes, so the
# forward's temporaries stay under 0.25 GiB whatever N is. The bits do not
# depend on the blocking: det_gemm's rows never depend on the other rows
# (M), and the stats and gradient kernels are per row. (The chunk width does
# set the bits: it is the fold order, and it never depends on N.) Measured
# on the H100 (2026-11-27, torch route, N=16384, H=4096, V=151936, three
# rounds interleaved): forward 37.3-38.2 ms at 128 MB blocks, 37.7-38.0 at
# 256 MB, 36.4-37.8 unblocked; 32 MB blocks cost more (44.3 ms: the
# hoped-for L2 reuse does not pay for the narrower products). Row-blocked
# dh products cost the backward 4% there (145.6 vs 140.1 ms), so the
# backward blocks only beyond 1 GiB, where it bounds memory at large N.
LOGITS_BLOCK_BYTES = 128 << 20
BACKWARD_LOGITS_BLOCK_BYTES = 1 << 30


def row_blocks(n: int, chunk: int, block_bytes: int):
  """``(r0, r1)`` row blocks whose f32 logits of `chunk` columns take at
  most about `block_bytes` (multiples of 128 rows)."""
  rows = max(128, block_bytes // (4 * chunk) // 128 * 128)
  return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


def _sm90_operands(n, h, v, dtype, chunk_size):
  if chunk_size % 8:
    return f"chunk_size={chunk_size} must be a multiple of 8 (TMA rows)"
  return cuda_ffi.operand_reason(n, v, h, False, False, dtype, jnp.float32)


TABLE = _dispatch.register_reference_and_pallas(
    "linear_logp",
    reference=_reference,
    reference_doc="K-loop logits, column-by-column logsumexp: the oracle, "
                  "CPU default",
    pallas=_pallas,
    pallas_doc="fused row-block kernel: det_matmul K loop + online logsumexp",
    gpu_first=[_dispatch.Implementation(
        "cuda_ffi", _chunked_sm90, cuda_ffi.unavailable_reason,
        "SM90 det_gemm logits per vocabulary chunk + a CUDA online "
        "logsumexp kernel, all behind XLA FFI (Hopper; bf16, H and V "
        "multiples of 8)",
        operand_check=_sm90_operands),
        _dispatch.Implementation(
        "triton", _triton, triton_backend.unavailable_reason,
        "the fused row-block kernel as a @triton.jit function through "
        "jax-triton (CUDA GPUs); its backward runs det_gemm's \"triton\"")],
)


@functools.lru_cache(maxsize=None)
def _partitioned(impl, chunk_size, with_entropy):
  fn = TABLE.implementations[impl].fn
  return _sharding.partitioned_rows(
      lambda h, w, t, temps: tuple(fn(h, w, t, temps, chunk_size,
                                      with_entropy)), 3, n_row_inputs=2)


def _forward(impl, chunk_size, with_entropy, hidden, weight, targets, temps):
  """(logp, lse, entropy); on several devices the token rows stay sharded."""
  if _sharding.multi_device():
    return _partitioned(impl, chunk_size, with_entropy)(hidden, weight,
                                                        targets, temps)
  return TABLE.implementations[impl].fn(hidden, weight, targets, temps,
                                        chunk_size, with_entropy)


# The temperatures are an operand, not differentiated: their cotangent is
# None (zero), and the public function passes them through stop_gradient, so
# a caller's derivative with respect to them is an explicit zero, as in
# verl and Liger, where the temperature is the sampler's constant.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _logp(impl, chunk_size, with_entropy, hidden, weight, targets, temps):
  logp, _, entropy = _forward(impl, chunk_size, with_entropy, hidden,
                              weight.astype(hidden.dtype), targets, temps)
  return logp, entropy


# The weight may be f32 master weights beside bf16 or f16 hidden states: the
# products read it cast to hidden's dtype (so the bits are those of a call
# with the cast weight), and its cotangent is the f32 gradient before any
# rounding, so micro-batches sum it in f32 without a rounding each.
def _logp_fwd(impl, chunk_size, with_entropy, hidden, weight, targets, temps):
  logp, lse, entropy = _forward(impl, chunk_size, with_entropy, hidden,
                                weight.astype(hidden.dtype), targets, temps)
  return (logp, entropy), (hidden, weight, targets, temps, lse, entropy)


def _logp_bwd(impl, chunk_size, with_entropy, residuals, cotangents):
  hidden, weight, *rest = residuals
  dh, dw = linear_logp_grads(impl, chunk_size, with_entropy, hidden,
                             weight.astype(hidden.dtype), *rest, *cotangents,
                             dw_dtype=weight.dtype)
  return dh, dw, None, None


def linear_logp_grads(impl, chunk_size, with_entropy, hidden, weight, targets,
                      temps, lse, entropy, g_logp, g_ent,
                      dw_dtype=None, dh_dtype=None, target_ok=None):
  """``(d hidden, d weight [H, V])`` of linear_logp's VJP; d weight in
  `dw_dtype` (default the weight's: f32 for a caller that accumulates
  micro-batches in f32 without a rounding per micro-batch), d hidden in
  `dh_dtype` (default hidden's; f32: the unrounded sum). `target_ok`: the
  rows whose target is in the vocabulary (default: in this weight's
  columns; a vocabulary chunk's caller passes the whole vocabulary's)."""
  v = weight.shape[1]
  dw_dtype = weight.dtype if dw_dtype is None else dw_dtype
  if target_ok is None:
    target_ok = (targets >= 0) & (targets < v)
  g_picked = jnp.where(target_ok, g_logp, 0.0)
  dlogits_of = _dlogits_sm90 if impl == "cuda_ffi" else _dlogits

  def chunk_grads(c0, w_c):
    parts = []
    for r0, r1 in row_blocks(hidden.shape[0], w_c.shape[1],
                             BACKWARD_LOGITS_BLOCK_BYTES):
      rows = slice(r0, r1)
      logits = _det_gemm.det_gemm(hidden[rows], w_c, out_dtype=jnp.float32,
                                  implementation=impl)
      parts.append(dlogits_of(
          logits, targets[rows] - c0, temps[rows], lse[rows], entropy[rows],
          g_picked[rows], g_ent[rows], with_entropy).astype(hidden.dtype))
    dlogits = jnp.concatenate(parts)  # (one block: no copy)
    dh_c = _det_gemm.det_gemm(dlogits, w_c, transpose_b=True,
                              out_dtype=jnp.float32, implementation=impl)
    return dh_c, _det_gemm._matmul(impl, True, False, dw_dtype, hidden,
                                   dlogits)

  # A scan, not an unrolled loop: XLA could otherwise schedule several
  # chunks' [N, chunk] blocks at once. Chunks run in vocabulary order and dh
  # sums them in that order: the same every call.
  def step(carry, i):
    dh, dw = carry
    c0 = i * chunk_size
    dh_c, dw_c = chunk_grads(c0, jax.lax.dynamic_slice_in_dim(
        weight, c0, chunk_size, axis=1))
    return (dh + dh_c, jax.lax.dynamic_update_slice_in_dim(dw, dw_c, c0,
                                                           axis=1)), None

  full = v // chunk_size
  dh = jnp.zeros(hidden.shape, jnp.float32)
  dw = jnp.zeros(weight.shape, dw_dtype)
  if full:  # (a scan traces its body even for zero steps)
    (dh, dw), _ = jax.lax.scan(step, (dh, dw), jnp.arange(full, dtype=jnp.int32))
  if v % chunk_size:
    c0 = full * chunk_size
    dh_c, dw_c = chunk_grads(c0, weight[:, c0:])
    dh, dw = dh + dh_c, dw.at[:, c0:].set(dw_c)
  return dh.astype(dh_dtype or hidden.dtype), dw


def _dlogits(logits, targets, temps, lse, entropy, g_picked, g_ent,
             with_entropy):
  """d loss / d logits of one chunk (f32) from its raw f32 logits;
  `targets` index the chunk. The arithmetic of the CUDA kernel behind
  ``cuda_ffi.logits_grad``, in XLA ops."""
  t = temps[:, None]
  x = logits / t
  p = jnp.exp(x - lse[:, None])
  onehot = targets[:, None] == jnp.arange(x.shape[1], dtype=jnp.int32)
  d = g_picked[:, None] * (onehot - p)
  if with_entropy:
    d = d - g_ent[:, None] * p * (x - (lse - entropy)[:, None])
  return d / t


def _dlogits_sm90(logits, targets, temps, lse, entropy, g_picked, g_ent,
                  with_entropy):
  # A CUDA kernel rather than XLA's fusion: the torch bridge launches the
  # same kernel, so its gradients have these bits (XLA's exp is not torch's).
  # On several devices it runs on each device's rows (an FFI call is opaque
  # to XLA's partitioner, which would gather every row onto every device).
  args = (logits, targets, temps, lse, entropy, g_picked, g_ent)
  if _sharding.multi_device():
    return _partitioned_dlogits(with_entropy)(*args)[0]
  return cuda_ffi.logits_grad(*args, with_entropy=with_entropy)


@functools.lru_cache(maxsize=None)
def _partitioned_dlogits(with_entropy):
  return _sharding.rowwise(
      lambda *args: (cuda_ffi.logits_grad(*args, with_entropy=with_entropy),),
      ranks=(2, 1, 1, 1, 1, 1, 1), out_ranks=(2,))


_logp.defvjp(_logp_fwd, _logp_bwd)


# The vocabulary-parallel mode (``vocab_chunks``): V in C chunks, each
# chunk's row statistics from the implementation's own kernels on its
# weight slice, combined in the fixed tree of _tree_reduction (so the bits
# do not depend on how many devices split V); the backward is linear_logp's
# own per chunk with the combined lse and entropy, d hidden the tree of the
# chunks' f32 products.

def _chunk_offset(first, c, width):
  return first * width + c * width


def _vocab_stats(impl, chunk_size, with_entropy, chunks, hidden, weight,
                 targets, temps, v_axis=None, ranks=1):
  """(lse, mean, target's chunk log-prob, its chunk's lse), f32 [N], of
  this device's `chunks // ranks` vocabulary chunks, combined across
  `v_axis` in the fixed tree."""
  local = chunks // ranks
  first = 0 if ranks == 1 else jax.lax.axis_index(v_axis) * local
  stats = subtree_stats(impl, chunk_size, with_entropy, local, first, hidden,
                        weight, targets, temps)
  return _tree_reduction.finish_stats_across(stats, v_axis, ranks)


def subtree_stats(impl, chunk_size, with_entropy, local, first, hidden,
                  weight, targets, temps):
  """The row statistics' subtree of `local` neighbouring vocabulary chunks,
  the first of them chunk `first` of the whole vocabulary (`weight` holds
  exactly those chunks; `targets` are ids in the whole vocabulary)."""
  fn = TABLE.implementations[impl].fn
  width = weight.shape[1] // local
  parts = []
  for c in range(local):
    t_c = targets - _chunk_offset(first, c, width)
    # Each chunk's statistics are computed apart (barriers on what goes in
    # and comes out): the same computation in a sharded and an unsharded
    # program, never fused with its neighbours differently (the XLA
    # reference's elementwise code rounded otherwise).
    w_c, t_c, h_c, temps_c = jax.lax.optimization_barrier(
        (weight[:, c * width:(c + 1) * width], t_c, hidden, temps))
    logp, lse, entropy = jax.lax.optimization_barrier(fn(
        h_c, w_c, t_c, temps_c, min(chunk_size, width), with_entropy))
    mean = lse - entropy if with_entropy else jnp.zeros_like(lse)
    owner = (t_c >= 0) & (t_c < width)
    parts.append((lse, mean, jnp.where(owner, logp, 0.0),
                  jnp.where(owner, lse, 0.0)))
  return _tree_reduction.tree_reduce(parts, _tree_reduction.combine_row_stats)


def _vocab_grads(impl, chunk_size, with_entropy, chunks, dw_dtype, hidden,
                 weight, targets, temps, lse, entropy, g_logp, g_ent,
                 v_axis=None, ranks=1):
  local = chunks // ranks
  first = 0 if ranks == 1 else jax.lax.axis_index(v_axis) * local
  dh, dw = subtree_grads(impl, chunk_size, with_entropy, chunks, local, first,
                         dw_dtype, hidden, weight, targets, temps, lse,
                         entropy, g_logp, g_ent)
  dh = _tree_reduction.finish_across(dh, v_axis, ranks)
  return dh.astype(hidden.dtype), dw


def subtree_grads(impl, chunk_size, with_entropy, chunks, local, first,
                  dw_dtype, hidden, weight, targets, temps, lse, entropy,
                  g_logp, g_ent):
  """(the f32 root of d hidden's subtree, d weight) of `local` neighbouring
  vocabulary chunks of `chunks`, the first of them chunk `first` (`weight`
  holds exactly those), with the whole vocabulary's lse and entropy."""
  width = weight.shape[1] // local
  # Every chunk carries -g p of a row with a target anywhere in V.
  target_ok = (targets >= 0) & (targets < width * chunks)
  dh_parts, dw_parts = [], []
  for c in range(local):
    dh_c, dw_c = linear_logp_grads(
        impl, min(chunk_size, width), with_entropy, hidden,
        weight[:, c * width:(c + 1) * width],
        targets - _chunk_offset(first, c, width), temps, lse, entropy, g_logp,
        g_ent, dw_dtype=dw_dtype, dh_dtype=jnp.float32, target_ok=target_ok)
    dh_parts.append(dh_c)
    dw_parts.append(dw_c)
  return (_tree_reduction.tree_sum(dh_parts),
          jnp.concatenate(dw_parts, axis=1))


@functools.lru_cache(maxsize=None)
def _partitioned_vocab(kind, *static):
  if kind == "stats":
    local = functools.partial(_vocab_stats, *static)
    return _sharding.partitioned_vocab_tree(local, 4, 2, static[3])
  local = functools.partial(_vocab_grads, *static)
  return _sharding.partitioned_vocab_tree(local, 2, 6, static[3],
                                          weight_output=True, rows_local=False)


def _stats_of(impl, chunk_size, with_entropy, chunks, hidden, weight, targets,
              temps):
  args = (hidden, weight, targets, temps)
  if _sharding.multi_device():
    return _partitioned_vocab("stats", impl, chunk_size, with_entropy,
                              chunks)(*args)
  return _vocab_stats(impl, chunk_size, with_entropy, chunks, *args)


def _vocab_outputs(stats, with_entropy, targets, v):
  # A target no chunk holds (ignored: -1) gets log-prob 0, as in the
  # default mode; the public function marks ids outside [0, V) NaN.
  # log p = (x_t - lse_c) + (lse_c - lse): the target's chunk log-prob as
  # its kernel gave it, moved to the whole vocabulary's normaliser.
  lse, mean, target_logp, target_lse = stats
  entropy = lse - mean if with_entropy else jnp.full_like(lse, jnp.nan)
  held = (targets >= 0) & (targets < v)
  return jnp.where(held, target_logp + (target_lse - lse), 0.0), lse, entropy


def _vocab_logp_fwd(impl, chunk_size, with_entropy, chunks, hidden, weight,
                    targets, temps):
  logp, lse, entropy = _vocab_outputs(_stats_of(
      impl, chunk_size, with_entropy, chunks, hidden,
      weight.astype(hidden.dtype), targets, temps), with_entropy, targets,
      weight.shape[1])
  return (logp, entropy), (hidden, weight, targets, temps, lse, entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _vocab_logp(impl, chunk_size, with_entropy, chunks, hidden, weight,
                targets, temps):
  return _vocab_logp_fwd(impl, chunk_size, with_entropy, chunks, hidden,
                         weight, targets, temps)[0]


def _vocab_logp_bwd(impl, chunk_size, with_entropy, chunks, residuals,
                    cotangents):
  hidden, weight, targets, temps, lse, entropy = residuals
  g_logp, g_ent = cotangents
  static = (impl, chunk_size, with_entropy, chunks, weight.dtype)
  args = (hidden, weight.astype(hidden.dtype), targets, temps, lse, entropy,
          g_logp, g_ent)
  if _sharding.multi_device():
    dh, dw = _partitioned_vocab("grads", *static)(*args)
  else:
    dh, dw = _vocab_grads(*static, *args)
  return dh, dw, None, None


_vocab_logp.defvjp(_vocab_logp_fwd, _vocab_logp_bwd)


def linear_logp(hidden, weight, targets, *, temperature=1.0,
                chunk_size: int = 8192, return_entropy: bool = False,
                ignore_index: int = IGNORE_INDEX,
                implementation: str | None = None,
                vocab_chunks: int | None = None):
  """Log-probs (f32) of `targets` under ``softmax(hidden @ weight / T)``.

  Args:
    hidden: ``[..., H]`` (bf16, f16 or f32).
    weight: ``[H, V]``, the dtype of hidden, or f32 master weights beside
      bf16/f16 hidden: the products then read it cast to hidden's dtype (the
      bits of a call with the cast weight) and its gradient comes back in
      f32 before any rounding, so micro-batches sum it in f32 without a
      bf16 rounding each. (A torch ``lm_head.weight`` is ``[V, H]``: pass
      its transpose.)
    targets: integer ``[...]``; `ignore_index` gives log-prob 0 and no
      gradient. Any other id outside [0, V) (a tokenizer/model vocabulary
      mismatch) gives NaN, so a loss over it is NaN; where the targets are
      host data (numpy, a list, a CPU array outside jit) it raises a
      ValueError naming the id instead. Neither costs a host sync.
    temperature: logits are divided by it: a number (> 0) for the call, or
      an array of temperatures broadcastable to targets' shape (a sampler's
      per-sample temperatures, ``[B, 1]`` for ``[B, S]`` targets, or one per
      token), each > 0 (checked where they are host data). Not
      differentiated: no gradient flows to it (it passes through
      ``stop_gradient``), as in verl's and Liger's ops.
    chunk_size: vocabulary chunk of the backward, and of the ``cuda_ffi``
      forward (peak extra memory about ``N x chunk_size`` f32).
    return_entropy: also return the entropy of each row's distribution.
      Without it no entropy is computed, forward or backward.
    implementation: None (the first of ``cuda_ffi``, ``pallas``, ``xla``
      available here that takes these operands; ``cuda_ffi`` needs an SM90
      GPU, bf16, H, V and chunk_size multiples of 8) or one of those names.
    vocab_chunks: None, or C (a power of two dividing V): the
      vocabulary-parallel mode. V is cut into C chunks whose row statistics
      (logsumexp, mean logit, the target's logit) combine in one fixed
      binary tree, and d hidden sums the chunks' products in the same tree,
      so a weight whose V is sharded over a mesh axis of t devices (t
      dividing C) stays sharded (each device runs its own chunks) and the
      kernels' bits (pallas, triton; not the CPU ``xla`` reference's, which
      an ulp moves in some programs) are the same at every t. Other bits
      than the default mode's.

  Each row's result is bitwise the same whatever other rows are in the batch
  (per implementation and device).
  """
  host_targets = _host_values(targets)
  host_temps = _host_values(temperature)
  hidden, weight, targets = map(jnp.asarray, (hidden, weight, targets))
  _check(hidden, weight, targets, chunk_size)
  check_temperature(temperature, host_temps, targets.shape,
                    "rlk_jax.linear_logp")
  if host_targets is not None:
    check_target_ids(host_targets, weight.shape[1], ignore_index,
                     "rlk_jax.linear_logp")
  lead = hidden.shape[:-1]
  n = math.prod(lead)
  v = weight.shape[1]
  if vocab_chunks is not None:
    _tree_reduction.check_power_of_two(vocab_chunks, "rlk_jax.linear_logp",
                                       "vocab_chunks")
    if v % vocab_chunks:
      raise ValueError(f"rlk_jax.linear_logp: vocab_chunks={vocab_chunks} "
                       f"must divide V={v} (weight {weight.shape}).")
  width = v if vocab_chunks is None else v // vocab_chunks
  chunk_size = int(chunk_size) if vocab_chunks is None else min(
      int(chunk_size), width)
  impl = TABLE.select(implementation, operands=(
      n, weight.shape[0], width, hidden.dtype, chunk_size)).name
  t = jnp.where(targets == ignore_index, -1, targets).astype(jnp.int32)
  temps = jax.lax.stop_gradient(jnp.broadcast_to(
      jnp.asarray(temperature, jnp.float32), lead)).reshape(n)
  args = (hidden.reshape(n, hidden.shape[-1]), weight, t.reshape(n), temps)
  if vocab_chunks is None:
    logp, entropy = _logp(impl, chunk_size, bool(return_entropy), *args)
  else:
    logp, entropy = _vocab_logp(impl, chunk_size, bool(return_entropy),
                                int(vocab_chunks), *args)
  logp, entropy = logp.reshape(lead), entropy.reshape(lead)
  logp = jnp.where(out_of_range(targets, weight.shape[1], ignore_index),
                   jnp.nan, logp)
  return (logp, entropy) if return_entropy else logp


def out_of_range(targets, v, ignore_index):
  """Targets that are neither an id of the vocabulary nor ignore_index:
  their log-prob is NaN, never a silent 0 (works on jax and torch arrays)."""
  return (targets != ignore_index) & ((targets < 0) | (targets >= v))


def check_target_ids(targets, v, ignore_index, op):
  """Raises naming the first target outside [0, V) that is not
  ignore_index; `targets` is host data (numpy or a CPU torch tensor)."""
  bad = out_of_range(targets, v, ignore_index)
  if bad.any():
    flat = bad.reshape(-1).nonzero()[0]
    first = int(flat[0])
    raise ValueError(
        f"{op}: target id {int(targets.reshape(-1)[first])} (flat position "
        f"{first}; {int(bad.sum())} such ids) is outside the vocabulary "
        f"[0, V={v}) and is not ignore_index={ignore_index}: does the "
        f"tokenizer match the model?")


def check_temperature(temperature, host_values, targets_shape, op):
  """A temperature is a positive number, or a float array broadcastable to
  the targets' shape whose values (where they are host data, so no device
  sync) are all positive. `host_values` is `temperature` as numpy or None;
  the shape check works on jax and torch arrays alike."""
  import numpy as np
  if hasattr(temperature, "dtype"):
    floating = getattr(temperature.dtype, "is_floating_point", None)  # torch
    if floating is None:
      floating = jnp.issubdtype(temperature.dtype, jnp.floating)
    if not floating:
      raise TypeError(f"{op}: temperature must be floating point, got "
                      f"{temperature.dtype}.")
  shape, targets_shape = tuple(getattr(temperature, "shape", ())), tuple(
      targets_shape)
  if shape:
    try:
      fits = np.broadcast_shapes(shape, targets_shape) == targets_shape
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(f"{op}: temperature of shape {shape} does not "
                       f"broadcast to the targets' shape "
                       f"{tuple(targets_shape)}.")
  if host_values is not None and not (np.asarray(host_values) > 0).all():
    raise ValueError(f"{op}: temperature must be > 0, got "
                     f"{np.asarray(host_values).min()} (smallest).")


def _host_values(targets):
  """`targets` as numpy when reading them costs no device sync: host data,
  or a committed array on CPU devices; None otherwise (a tracer, a GPU
  array)."""
  import numpy as np
  if isinstance(targets, jax.core.Tracer):
    return None
  if isinstance(targets, jax.Array):
    if any(d.platform != "cpu" for d in targets.devices()):
      return None
  try:
    return np.asarray(targets)
  except Exception:  # noqa: BLE001 - anything numpy cannot read is not host data
    return None


def _check(hidden, weight, targets, chunk_size):
  op = "rlk_jax.linear_logp"
  if weight.ndim != 2:
    raise ValueError(f"{op}: weight must be [H, V], got shape {weight.shape}.")
  if hidden.ndim < 1 or hidden.shape[-1] != weight.shape[0]:
    raise ValueError(f"{op}: hidden {hidden.shape} must end in H={weight.shape[0]}"
                     f" of weight {weight.shape} ([H, V]).")
  if targets.shape != hidden.shape[:-1]:
    raise ValueError(f"{op}: targets shape {targets.shape} must be hidden's "
                     f"leading shape {hidden.shape[:-1]}.")
  if weight.shape[1] == 0:
    raise ValueError(f"{op}: the vocabulary is empty (weight {weight.shape}).")
  master = weight.dtype == jnp.float32 and hidden.dtype in (jnp.bfloat16,
                                                            jnp.float16)
  if hidden.dtype not in _det_gemm.GEMM_DTYPES or not (
      hidden.dtype == weight.dtype or master):
    raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) "
                    "must share one of bfloat16, float16, float32, or the "
                    "weight be float32 master weights beside bfloat16 or "
                    "float16 hidden.")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"{op}: targets must be integers, got {targets.dtype}.")
  if int(chunk_size) < 1:
    raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}.")
