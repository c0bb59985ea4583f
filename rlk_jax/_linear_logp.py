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
from rlk_jax import _det_gemm, _dispatch, _sharding, reference
from triton_kernels import backend as triton_backend
from triton_kernels import linear_logp as triton_logp

IGNORE_INDEX = -100


def _reference(hidden, weight, targets, temperature, chunk_size):
  del chunk_size  # the oracle holds all the logits
  return reference.linear_logp(hidden, weight, targets, temperature)


def _pallas(hidden, weight, targets, temperature, chunk_size, *, interpret):
  del chunk_size  # fused: no logits block at all
  return logp_kernel.linear_logp(hidden, weight, targets,
                                 temperature=temperature, interpret=interpret)


def _no_rows():
  """(logp, lse, entropy) of zero rows: no launch for an empty grid."""
  return tuple(jnp.zeros((0,), jnp.float32) for _ in range(3))


def _triton(hidden, weight, targets, temperature, chunk_size):
  del chunk_size  # fused, like "pallas"
  n = hidden.shape[0]
  if not n:
    return _no_rows()
  return triton_logp.linear_logp(hidden, weight, targets,
                                 temperature=temperature,
                                 config=logp_kernel.DEFAULT_CONFIG)


def _chunked_sm90(hidden, weight, targets, temperature, chunk_size):
  # The logits of one vocabulary chunk at a time come from the SM90 det_gemm
  # (row-invariant); the CUDA stats kernel folds them into each row's
  # running logsumexp in vocabulary order, one warp per row in a fixed lane
  # order: a row's result never depends on the other rows. (Not jax-triton's
  # stats kernel: its legacy custom call splits XLA's command buffers.) The
  # finish is a CUDA kernel too, so the torch bridge's route, which launches
  # the same kernels in the same order, has these bits.
  n, v = hidden.shape[0], weight.shape[1]
  if not n:
    return _no_rows()
  stats = logp_kernel.initial_stats(n)
  for c0 in range(0, v, chunk_size):  # a fixed order: the same every call
    logits = _det_gemm.det_gemm(hidden, weight[:, c0:c0 + chunk_size],
                                out_dtype=jnp.float32,
                                implementation="cuda_ffi")
    stats = cuda_ffi.logits_stats(logits, targets - c0, stats,
                                  temperature=temperature)
  return cuda_ffi.logits_finish(stats, targets, v)


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
def _partitioned(impl, temperature, chunk_size):
  fn = TABLE.implementations[impl].fn
  return _sharding.partitioned_rows(
      lambda h, w, t: tuple(fn(h, w, t, temperature, chunk_size)), 3)


def _forward(impl, temperature, chunk_size, hidden, weight, targets):
  """(logp, lse, entropy); on several devices the token rows stay sharded."""
  if _sharding.multi_device():
    return _partitioned(impl, temperature, chunk_size)(hidden, weight, targets)
  return TABLE.implementations[impl].fn(hidden, weight, targets, temperature,
                                        chunk_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _logp(impl, temperature, chunk_size, hidden, weight, targets):
  logp, _, entropy = _forward(impl, temperature, chunk_size, hidden, weight,
                              targets)
  return logp, entropy


def _logp_fwd(impl, temperature, chunk_size, hidden, weight, targets):
  logp, lse, entropy = _forward(impl, temperature, chunk_size, hidden, weight,
                                targets)
  return (logp, entropy), (hidden, weight, targets, lse, entropy)


def _logp_bwd(impl, temperature, chunk_size, residuals, cotangents):
  hidden, weight, targets, lse, entropy = residuals
  g_logp, g_ent = cotangents
  v = weight.shape[1]
  g_picked = jnp.where((targets >= 0) & (targets < v), g_logp, 0.0)
  dlogits_of = _dlogits_sm90 if impl == "cuda_ffi" else _dlogits

  def chunk_grads(c0, w_c):
    logits = _det_gemm.det_gemm(hidden, w_c, out_dtype=jnp.float32,
                                implementation=impl)
    dlogits = dlogits_of(logits, targets - c0, lse, entropy, g_picked, g_ent,
                         temperature).astype(hidden.dtype)
    dh_c = _det_gemm.det_gemm(dlogits, w_c, transpose_b=True,
                              out_dtype=jnp.float32, implementation=impl)
    return dh_c, _det_gemm._matmul(impl, True, False, weight.dtype, hidden,
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
  dh, dw = jnp.zeros(hidden.shape, jnp.float32), jnp.zeros_like(weight)
  if full:  # (a scan traces its body even for zero steps)
    (dh, dw), _ = jax.lax.scan(step, (dh, dw), jnp.arange(full, dtype=jnp.int32))
  if v % chunk_size:
    c0 = full * chunk_size
    dh_c, dw_c = chunk_grads(c0, weight[:, c0:])
    dh, dw = dh + dh_c, dw.at[:, c0:].set(dw_c)
  return dh.astype(hidden.dtype), dw, None


def _dlogits(logits, targets, lse, entropy, g_picked, g_ent, temperature):
  """d loss / d logits of one chunk (f32) from its raw f32 logits;
  `targets` index the chunk. The arithmetic of the CUDA kernel behind
  ``cuda_ffi.logits_grad``, in XLA ops."""
  x = logits / jnp.float32(temperature)
  p = jnp.exp(x - lse[:, None])
  onehot = targets[:, None] == jnp.arange(x.shape[1], dtype=jnp.int32)
  d = g_picked[:, None] * (onehot - p)
  d = d - g_ent[:, None] * p * (x - (lse - entropy)[:, None])
  return d / jnp.float32(temperature)


def _dlogits_sm90(logits, targets, lse, entropy, g_picked, g_ent, temperature):
  # A CUDA kernel rather than XLA's fusion: the torch bridge launches the
  # same kernel, so its gradients have these bits (XLA's exp is not torch's).
  # On several devices it runs on each device's rows (an FFI call is opaque
  # to XLA's partitioner, which would gather every row onto every device).
  args = (logits, targets, lse, entropy, g_picked, g_ent)
  if _sharding.multi_device():
    return _partitioned_dlogits(float(temperature))(*args)[0]
  return cuda_ffi.logits_grad(*args, temperature=temperature)


@functools.lru_cache(maxsize=None)
def _partitioned_dlogits(temperature):
  return _sharding.rowwise(
      lambda *args: (cuda_ffi.logits_grad(*args, temperature=temperature),),
      ranks=(2, 1, 1, 1, 1, 1), out_ranks=(2,))


_logp.defvjp(_logp_fwd, _logp_bwd)


def linear_logp(hidden, weight, targets, *, temperature: float = 1.0,
                chunk_size: int = 8192, return_entropy: bool = False,
                ignore_index: int = IGNORE_INDEX,
                implementation: str | None = None):
  """Log-probs (f32) of `targets` under ``softmax(hidden @ weight / T)``.

  Args:
    hidden: ``[..., H]`` (bf16, f16 or f32).
    weight: ``[H, V]``, the dtype of hidden. (A torch ``lm_head.weight`` is
      ``[V, H]``: pass its transpose.)
    targets: integer ``[...]``; `ignore_index` gives log-prob 0 and no
      gradient. Any other id outside [0, V) (a tokenizer/model vocabulary
      mismatch) gives NaN, so a loss over it is NaN; where the targets are
      host data (numpy, a list, a CPU array outside jit) it raises a
      ValueError naming the id instead. Neither costs a host sync.
    temperature: static; logits are divided by it.
    chunk_size: vocabulary chunk of the backward, and of the ``cuda_ffi``
      forward (peak extra memory about ``N x chunk_size`` f32).
    return_entropy: also return the entropy of each row's distribution.
    implementation: None (the first of ``cuda_ffi``, ``pallas``, ``xla``
      available here that takes these operands; ``cuda_ffi`` needs an SM90
      GPU, bf16, H, V and chunk_size multiples of 8) or one of those names.

  Each row's result is bitwise the same whatever other rows are in the batch
  (per implementation and device).
  """
  host_targets = _host_values(targets)
  hidden, weight, targets = map(jnp.asarray, (hidden, weight, targets))
  _check(hidden, weight, targets, temperature, chunk_size)
  if host_targets is not None:
    check_target_ids(host_targets, weight.shape[1], ignore_index,
                     "rlk_jax.linear_logp")
  lead = hidden.shape[:-1]
  n = math.prod(lead)
  impl = TABLE.select(implementation, operands=(
      n, weight.shape[0], weight.shape[1], hidden.dtype, int(chunk_size))).name
  t = jnp.where(targets == ignore_index, -1, targets).astype(jnp.int32)
  logp, entropy = _logp(impl, float(temperature), int(chunk_size),
                        hidden.reshape(n, hidden.shape[-1]), weight,
                        t.reshape(n))
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


def _check(hidden, weight, targets, temperature, chunk_size):
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
  if hidden.dtype not in _det_gemm.GEMM_DTYPES or hidden.dtype != weight.dtype:
    raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) "
                    "must share one of bfloat16, float16, float32.")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"{op}: targets must be integers, got {targets.dtype}.")
  if not temperature > 0:
    raise ValueError(f"{op}: temperature must be > 0, got {temperature}.")
  if int(chunk_size) < 1:
    raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}.")
