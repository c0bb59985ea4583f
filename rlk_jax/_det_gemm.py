"""det_gemm: a batch-invariant, deterministic GEMM with a deterministic VJP.

``c = det_gemm(a, b)``: ``a [..., K] @ b [K, N] -> [..., N]``, f32 accumulation.
Every output row depends only on its input row and ``b``, bit for bit, per
implementation and device: the same whatever M, whatever rows surround it,
whatever leading shape, on every run. (Bits are not promised across GPU
architectures, nor across implementations beyond what the device tests
prove.)

Every product, forward and backward, is one primitive,
``op(A) @ op(B)`` with either operand optionally stored transposed, so the
gradients read the forward operands in place:

* ``da = g @ b^T``: again row-invariant (row i of da needs row i of g only);
* ``db = a^T @ g``: a reduction over rows in a fixed blocked order, so it is
  deterministic and unchanged by appended zero rows (padding).

The backward runs in the operand dtype: the cotangent is cast to ``a.dtype``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import cuda_ffi
from pallas_kernels import det_matmul, det_matmul_mgpu
from triton_kernels import backend as triton_backend
from triton_kernels import det_matmul as triton_det_matmul
from rlk_jax import _dispatch, _gemm_tuning, _sharding, _tree_reduction, reference

GEMM_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


def _tiles(a, b, transpose_a, transpose_b):
  """(m, n, k) and the tile config of the K-ordered tiled kernels (Pallas
  and Triton share the vocabulary and the measured table)."""
  m, n, k = product_operands(a.shape, b.shape, transpose_a, transpose_b,
                             a.dtype, a.dtype)[:3]
  return (m, n, k), _gemm_tuning.choose_pallas_config(
      m, n, k, transpose_a=transpose_a, transpose_b=transpose_b, dtype=a.dtype)


def _pallas_matmul(a, b, transpose_a, transpose_b, out_dtype, *, interpret):
  # Interpreted: det_matmul's default tiles.
  config = None if interpret else _tiles(a, b, transpose_a, transpose_b)[1]
  return det_matmul.matmul(a, b, transpose_a=transpose_a,
                           transpose_b=transpose_b, out_dtype=out_dtype,
                           interpret=interpret, config=config)


def _triton_matmul(a, b, transpose_a, transpose_b, out_dtype):
  def product(a, b):
    (m, n, k), config = _tiles(a, b, transpose_a, transpose_b)
    if not (m and n and k):  # no launch for an empty grid; an empty sum is +0.0
      return jnp.zeros((m, n), out_dtype)
    return triton_det_matmul.matmul(a, b, transpose_a=transpose_a,
                                    transpose_b=transpose_b,
                                    out_dtype=out_dtype, config=config)
  return _one_product_per_batch_element(product)(a, b)


def _one_product_per_batch_element(product):
  """`product` under vmap as one call per batch element (lax.map):
  jax-triton's call has no batching rule, and each element's own product
  has the bits of an unbatched call."""
  @jax.custom_batching.custom_vmap
  def call(a, b):
    return product(a, b)

  @call.def_vmap
  def _batched(axis_size, in_batched, a, b):
    a_batched, b_batched = in_batched
    if a_batched and b_batched:
      out = jax.lax.map(lambda ab: call(*ab), (a, b))
    elif a_batched:
      out = jax.lax.map(lambda x: call(x, b), a)
    else:
      out = jax.lax.map(lambda y: call(a, y), b)
    return out, True

  return call


def _mosaic_gpu_matmul(a, b, transpose_a, transpose_b, out_dtype):
  m, n, k = product_operands(a.shape, b.shape, transpose_a, transpose_b,
                             a.dtype, out_dtype)[:3]
  config = _gemm_tuning.choose_mosaic_config(
      m, n, k, transpose_a=transpose_a, transpose_b=transpose_b)
  return det_matmul_mgpu.matmul(a, b, transpose_a=transpose_a,
                                transpose_b=transpose_b, out_dtype=out_dtype,
                                config=config)


def _mosaic_gpu_unavailable(platform):
  # wgmma: Hopper only, the SM90 kernels' own device check.
  return (det_matmul_mgpu.unavailable_reason(platform)
          or cuda_ffi.sm90_reason())


def _cuda_ffi_matmul(a, b, transpose_a, transpose_b, out_dtype):
  # The kernel config is a speed choice (every config gives the same bits),
  # made when the call is traced. Measured on first use only outside a
  # trace: a jit trace runs while earlier steps may still hold the card, and
  # a trace should cost no GPU time; a traced product takes the table's or
  # the rule's config and is tuned at the next untraced call
  # (_gemm_tuning.tune_pending).
  m, n, k = product_operands(a.shape, b.shape, transpose_a, transpose_b,
                             a.dtype, out_dtype)[:3]
  traced = any(isinstance(x, jax.core.Tracer) for x in (a, b))
  config = _gemm_tuning.choose_config(
      m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
      out_f32=jnp.dtype(out_dtype) == jnp.float32, may_tune=not traced)
  if config is None:
    # Its kernel is still building (cuda_ffi.build): the next implementation
    # the table would choose, which gives the same bits, meanwhile (named
    # "cuda_ffi" too: the name picks the bits' contract, not the kernel).
    impl = while_building(product_operands(
        a.shape, b.shape, transpose_a, transpose_b, a.dtype, out_dtype))
    return impl.fn(a, b, transpose_a, transpose_b, out_dtype)
  return cuda_ffi.matmul(a, b, transpose_a=transpose_a,
                         transpose_b=transpose_b, out_dtype=out_dtype,
                         config=config)


def while_building(operands) -> _dispatch.Implementation:
  """What runs a product whose SM90 kernel is still building: the next
  implementation the table would choose on a GPU (the same bits)."""
  return TABLE.select(None, "gpu", operands, passing_over=("cuda_ffi",))


def _cuda_ffi_unavailable(platform):
  # Never waits for a running build: every det_gemm implementation gives
  # the same bits, so a product runs on another until its kernel is built
  # (_cuda_ffi_matmul).
  return cuda_ffi.unavailable_reason(platform, wait=False)


# The operands of one product as every implementation's check sees them:
# (m, n, k, transpose_a, transpose_b, dtype, out_dtype).
def product_operands(a_shape, b_shape, transpose_a, transpose_b, dtype,
                     out_dtype):
  m, k = a_shape[::-1] if transpose_a else a_shape
  n = b_shape[0] if transpose_b else b_shape[1]
  return (m, n, k, transpose_a, transpose_b, dtype, out_dtype)


TABLE = _dispatch.register_reference_and_pallas(
    "det_gemm",
    reference=reference.det_matmul,
    reference_doc="explicit K loop of f32 multiply-adds: the oracle, the CPU "
                  "default",
    pallas=_pallas_matmul,
    pallas_doc="tiled Pallas kernel, BK=64 in K order, tiles chosen by size "
               "among bit-identical configs (Triton lowering on GPUs, the "
               "Pallas interpreter on CPUs)",
    gpu_first=[_dispatch.Implementation(
        "cuda_ffi", _cuda_ffi_matmul, _cuda_ffi_unavailable,
        "CUTLASS SM90 TMA warp-specialized kernels behind an XLA FFI call "
        "(Hopper; bf16 operands, K and N multiples of 8)",
        operand_check=cuda_ffi.operand_reason),
        _dispatch.Implementation(
        "triton", _triton_matmul, triton_backend.unavailable_reason,
        "the same tiled K-ordered kernel as a @triton.jit function, launched "
        "through jax-triton (and natively from torch); CUDA GPUs"),
        _dispatch.Implementation(
        "mosaic_gpu", _mosaic_gpu_matmul, _mosaic_gpu_unavailable,
        "Pallas on Mosaic GPU: TMA, wgmma, two compute warpgroups and a "
        "persistent grid, K in 64-wide steps in order (Hopper; bf16/f16)",
        operand_check=det_matmul_mgpu.operand_reason)],
)


@functools.lru_cache(maxsize=None)
def _partitioned(impl, transpose_a, transpose_b, out_dtype):
  fn = TABLE.implementations[impl].fn
  # custom_partitioning has no batching rule: under vmap, one partitioned
  # product per element (each its unbatched bits).
  return _one_product_per_batch_element(_sharding.partitioned_product(
      lambda a, b: fn(a, b, transpose_a, transpose_b, out_dtype),
      transpose_a, transpose_b))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _matmul(impl, transpose_a, transpose_b, out_dtype, a, b):
  if _sharding.multi_device():  # keeps sharded rows/columns local
    return _partitioned(impl, transpose_a, transpose_b, out_dtype)(a, b)
  return TABLE.implementations[impl].fn(a, b, transpose_a, transpose_b, out_dtype)


def _matmul_fwd(impl, transpose_a, transpose_b, out_dtype, a, b):
  return _matmul(impl, transpose_a, transpose_b, out_dtype, a, b), (a, b)


def _vjp_products(da_product, db_product, transpose_a, transpose_b, a, b, g):
  # C = op_ta(A) op_tb(B), so d op_ta(A) = G op_tb(B)^T and
  # d op_tb(B) = op_ta(A)^T G; transposing back where an operand is stored
  # transposed gives four products of the same primitive. `da_product` and
  # `db_product(transpose_a, transpose_b, out_dtype, a, b)` run them.
  g = g.astype(a.dtype)
  if transpose_a:
    da = da_product(transpose_b, True, a.dtype, b, g)
  else:
    da = da_product(False, not transpose_b, a.dtype, g, b)
  if transpose_b:
    db = db_product(True, transpose_a, b.dtype, g, a)
  else:
    db = db_product(not transpose_a, False, b.dtype, a, g)
  return da, db


def _matmul_bwd(impl, transpose_a, transpose_b, out_dtype, residuals, g):
  product = functools.partial(_matmul, impl)
  return _vjp_products(product, product, transpose_a, transpose_b,
                       *residuals, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# The tensor-parallel-invariant mode (``reduction_chunks``): the reduction
# cut into chunks summed in one fixed tree (_tree_reduction gives the order).

def _chunk(x, dim, index, size):
  return jax.lax.slice_in_dim(x, index * size, (index + 1) * size, axis=dim)


def fused_chunks(impl: str, chunks: int) -> bool:
  """Whether Triton's fused launch computes the mode's chunks (where Triton
  launches): every chunk of every tile in one launch (the chunks are the
  grid's second axis: the parallelism a product of few rows lacks), the tree
  in a second. The SM90 implementation's chunks take it too: one CUTLASS
  product per chunk was the slower, or within 1%, at every M measured
  (H200, 2026-11-29, benchmarks/results/nvidia-h200-2026-11-29/
  tensor_parallel_fused-e5c2dc8/: M=8..4096, Llama-3-8B's down and o
  projections, torch and JAX), and every
  implementation's chunks have one set of bits, so the choice changes
  none."""
  return chunks <= triton_det_matmul.MAX_CHUNKS and impl in ("triton",
                                                             "cuda_ffi")


def _fused_subtree(transpose_a, transpose_b, chunks, a, b):
  def product(a, b):
    m, n, k = product_operands(a.shape, b.shape, transpose_a, transpose_b,
                               a.dtype, jnp.float32)[:3]
    if not (m and n and k):  # no launch for an empty grid; an empty sum is +0.0
      return jnp.zeros((m, n), jnp.float32)
    config = _gemm_tuning.choose_chunked_config(
        m, n, k // chunks, transpose_a=transpose_a, transpose_b=transpose_b,
        dtype=a.dtype)
    return triton_det_matmul.chunked_matmul(
        a, b, transpose_a=transpose_a, transpose_b=transpose_b, chunks=chunks,
        config=config)
  return _one_product_per_batch_element(product)(a, b)


def _subtree(impl, transpose_a, transpose_b, chunks, a, b):
  """The f32 root of the subtree of `chunks` chunks these operands hold (all
  of K, or one rank's neighbouring slice of it): each chunk one product."""
  if (fused_chunks(impl, chunks) and _dispatch.current_platform() == "gpu"
      and triton_backend.unavailable_reason("gpu") is None):
    return _fused_subtree(transpose_a, transpose_b, chunks, a, b)
  fn = TABLE.implementations[impl].fn
  k = a.shape[0] if transpose_a else a.shape[1]
  size = k // chunks
  a_dim, b_dim = (0 if transpose_a else 1), (1 if transpose_b else 0)
  return _tree_reduction.tree_sum(
      fn(_chunk(a, a_dim, c, size), _chunk(b, b_dim, c, size), transpose_a,
         transpose_b, jnp.float32) for c in range(chunks))


@functools.lru_cache(maxsize=None)
def _partitioned_tree(impl, transpose_a, transpose_b, out_dtype, chunks):
  def local(a, b, k_axis=None, ranks=1):
    partial = _subtree(impl, transpose_a, transpose_b, chunks // ranks, a, b)
    return _tree_reduction.finish_across(partial, k_axis, ranks).astype(
        out_dtype)
  return _one_product_per_batch_element(_sharding.partitioned_tree_product(
      local, transpose_a, transpose_b, chunks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _tree_matmul(impl, transpose_a, transpose_b, out_dtype, chunks, k_axis,
                 n_axis, a, b):
  if k_axis is not None:
    # Inside shard_map, this device's operands hold its slice of K over
    # `k_axis`: its neighbouring subtree, then the tree's top across the
    # axis in rank order.
    ranks = jax.lax.axis_size(k_axis)
    partial = _subtree(impl, transpose_a, transpose_b, chunks // ranks, a, b)
    return _tree_reduction.finish_across(partial, k_axis, ranks,
                                         invariant=True).astype(out_dtype)
  if _sharding.multi_device():  # a K sharded over a divisor of C stays so
    return _partitioned_tree(impl, transpose_a, transpose_b, out_dtype,
                             chunks)(a, b)
  return _subtree(impl, transpose_a, transpose_b, chunks, a,
                  b).astype(out_dtype)


def _tree_matmul_fwd(impl, transpose_a, transpose_b, out_dtype, chunks, k_axis,
                     n_axis, a, b):
  return _tree_matmul(impl, transpose_a, transpose_b, out_dtype, chunks,
                      k_axis, n_axis, a, b), (a, b)


def _tree_matmul_bwd(impl, transpose_a, transpose_b, out_dtype, chunks, k_axis,
                     n_axis, residuals, g):
  # _matmul_bwd's products, with da's (a reduction over N, which a
  # column-parallel layer splits: over `n_axis` inside shard_map) cut into
  # chunks too; db reduces over rows, the data-parallel dimension: the
  # default product.
  def da_product(ta, tb, dtype, x, y):
    return _tree_matmul(impl, ta, tb, dtype, chunks, n_axis, k_axis, x, y)
  return _vjp_products(da_product, functools.partial(_matmul, impl),
                       transpose_a, transpose_b, *residuals, g)


_tree_matmul.defvjp(_tree_matmul_fwd, _tree_matmul_bwd)


def det_gemm(a, b, *, out_dtype=None, implementation: str | None = None,
             transpose_b: bool = False,
             reduction_chunks: int | None = None,
             k_axis_name=None, n_axis_name=None) -> jax.Array:
  """Batch-invariant ``a [..., K] @ b [K, N]`` with f32 accumulation.

  Args:
    a: ``[..., K]``, bfloat16, float16 or float32 (f32 without TF32).
    b: ``[K, N]``, the same dtype as ``a``; ``[N, K]`` with
      ``transpose_b=True`` (the ``nn.Linear`` weight layout), read in place.
    out_dtype: dtype of the result (bfloat16, float16 or float32); default
      ``a.dtype``.
    implementation: None (the first of ``cuda_ffi``, ``pallas``, ``xla``
      that is available here and takes these operands: ``cuda_ffi`` needs an
      SM90 GPU, bf16 operands, K and N multiples of 8), or one of those names
      (which raises if it cannot run this call). Pin one name in both rollout
      and training to get the same bits in both.
    reduction_chunks: None (the default order), or C, a power of two
      dividing K and N: the tensor-parallel-invariant mode. K is cut into C
      chunks, each an f32 product, summed in one fixed binary tree (and the
      input gradient's reduction over N likewise), so the bits do not depend
      on how many devices a mesh splits K (or N) over: under ``jit`` a
      reduction dimension sharded over a divisor of C stays sharded (no
      gather of the weight) and the devices finish the tree in rank order.
      Rows stay invariant; the bits differ from the default order's.
    k_axis_name, n_axis_name: inside ``shard_map``, with
      ``reduction_chunks``: the mesh axis over which each device's `b`
      holds a slice of K (a row-parallel layer: `a` holds the same slice of
      its features) or of N (a column-parallel layer). The device sums its
      neighbouring subtree and an ``all_gather`` of the f32 roots finishes
      the tree in rank order: the result (and, for N, the input gradient)
      is whole on every device, with the bits of one device holding the
      whole weight. The axis's size must divide C.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)
  ranks_k, ranks_n = _axis_ranks(k_axis_name, n_axis_name, reduction_chunks)
  whole_a, whole_b = a, b
  if (ranks_k, ranks_n) != (1, 1):
    # Checked and planned as the whole product, which each device's is a
    # slice of (the chunks' sizes, and so the implementation, are the same).
    _check(a, b, transpose_b)
    n_b, k_b = b.shape if transpose_b else b.shape[::-1]
    shape_b = (n_b * ranks_n, k_b * ranks_k)
    whole_a = jax.ShapeDtypeStruct((*a.shape[:-1], a.shape[-1] * ranks_k),
                                   a.dtype)
    whole_b = jax.ShapeDtypeStruct(
        shape_b if transpose_b else shape_b[::-1], b.dtype)
  call = plan(whole_a, whole_b, out_dtype=out_dtype,
              implementation=implementation, transpose_b=transpose_b,
              reduction_chunks=reduction_chunks)
  n_local, k_local = call.n // ranks_n, call.k // ranks_k
  a2 = a.reshape(call.m, k_local)
  if reduction_chunks is None:
    c = _matmul(call.implementation, False, transpose_b, call.out_dtype, a2, b)
  else:
    c = _tree_matmul(call.implementation, False, transpose_b, call.out_dtype,
                     reduction_chunks, k_axis_name, n_axis_name, a2, b)
  return c.reshape(*a.shape[:-1], n_local)


def _axis_ranks(k_axis_name, n_axis_name, chunks) -> tuple[int, int]:
  """How many devices split K and N (1 where no axis is named)."""
  if (k_axis_name, n_axis_name) == (None, None):
    return 1, 1
  if chunks is None:
    raise ValueError("rlk_jax.det_gemm: k_axis_name and n_axis_name name the "
                     "axes of the tensor-parallel mode: pass reduction_chunks "
                     "too.")
  if k_axis_name is not None and k_axis_name == n_axis_name:
    raise ValueError(f"rlk_jax.det_gemm: K and N cannot both be split over "
                     f"axis {k_axis_name!r}.")
  ranks = []
  for what, name in (("k_axis_name", k_axis_name), ("n_axis_name", n_axis_name)):
    if name is None:
      ranks.append(1)
      continue
    try:
      size = jax.lax.axis_size(name)
    except NameError as e:
      raise ValueError(f"rlk_jax.det_gemm: {what}={name!r} names no axis "
                       "here: it is for calls inside shard_map (under jit "
                       "with a mesh the sharding alone says the split).") from e
    _tree_reduction.check_ranks(chunks, size, f"rlk_jax.det_gemm ({what})")
    ranks.append(size)
  return tuple(ranks)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """What a det_gemm call runs: the checked problem and the implementation."""
  implementation: str
  out_dtype: jnp.dtype
  m: int
  n: int
  k: int


def det_gemm_tune_pending() -> int:
  """Tunes the SM90 kernel config of the products first met inside a
  ``jax.jit`` trace (which never measures: they ran the shipped table's
  nearest M bucket or the analytic rule), and returns how many. A trace
  made after it takes the tuned configs; bits do not change (every config
  gives the same bits). An untraced det_gemm call does this itself.

      step = jax.jit(train_step)
      state = step(state, batch)          # traced: no tuning in the trace
      if rlk_jax.det_gemm_tune_pending(): # outside any trace
        jax.clear_caches()                # jit keeps its traces: trace again
  """
  return _gemm_tuning.tune_pending()


def plan(a, b, *, out_dtype=None, implementation: str | None = None,
         transpose_b: bool = False, platform: str | None = None,
         reduction_chunks: int | None = None) -> GemmPlan:
  """Checks a det_gemm call and chooses its implementation.

  `a` and `b` need only ``shape`` and a ``dtype`` JAX knows (arrays, or
  ``jax.ShapeDtypeStruct``): the torch bridge plans its calls here too, so
  both front ends raise the same errors and pick the same kernel. Cached per
  signature: the bridge calls this on every op call.
  """
  # cuda_ffi.generation(): a library or kernels arriving from a running
  # build make the choice again.
  return _plan(tuple(a.shape), jnp.dtype(a.dtype), tuple(b.shape),
               jnp.dtype(b.dtype), None if out_dtype is None
               else jnp.dtype(out_dtype), implementation, bool(transpose_b),
               platform or _dispatch.current_platform(), cuda_ffi.generation(),
               reduction_chunks)


@functools.lru_cache(maxsize=4096)
def _plan(a_shape, a_dtype, b_shape, b_dtype, out_dtype, implementation,
          transpose_b, platform, generation, chunks=None) -> GemmPlan:
  a = jax.ShapeDtypeStruct(a_shape, a_dtype)
  b = jax.ShapeDtypeStruct(b_shape, b_dtype)
  _check(a, b, transpose_b)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if out_dtype not in GEMM_DTYPES:
    raise TypeError(f"rlk_jax.det_gemm: out_dtype {out_dtype} is not supported;"
                    f" use one of {', '.join(map(str, GEMM_DTYPES))}.")
  n, k = b.shape if transpose_b else b.shape[::-1]
  m = math.prod(a.shape[:-1])
  if chunks is None:
    impl = TABLE.select(implementation, platform, operands=product_operands(
        (m, k), b.shape, False, transpose_b, a.dtype, out_dtype)).name
    return GemmPlan(impl, out_dtype, m, n, k)
  _tree_reduction.check_chunks(chunks, k, n)
  # An implementation that takes both the forward's chunks (K/C) and the
  # input gradient's (N/C).
  kc, nc = k // chunks, n // chunks
  forward = product_operands((m, kc), (n, kc) if transpose_b else (kc, n),
                             False, transpose_b, a.dtype, out_dtype)
  backward = product_operands((m, nc), (nc, k) if transpose_b else (k, nc),
                              False, not transpose_b, a.dtype, a.dtype)
  passing = ()
  while True:
    chosen = TABLE.select(implementation, platform, forward, passing)
    reason = chosen.operand_reason(backward)
    if reason is None:
      return GemmPlan(chosen.name, out_dtype, m, n, k)
    if implementation is not None:
      raise ValueError(f"rlk_jax.det_gemm: implementation {implementation!r} "
                       f"cannot take the input gradient's chunks: {reason}")
    passing += (chosen.name,)


def _check(a, b, transpose_b=False):
  if b.ndim != 2:
    raise ValueError(f"rlk_jax.det_gemm: b must be rank 2 [K, N], got shape "
                     f"{b.shape} (a has shape {a.shape}).")
  if a.ndim < 1:
    raise ValueError(f"rlk_jax.det_gemm: a must have rank >= 1 [..., K], got "
                     f"a scalar (b has shape {b.shape}).")
  b_k = b.shape[1] if transpose_b else b.shape[0]
  if a.shape[-1] != b_k:
    layout = "[N, K] (transpose_b)" if transpose_b else "[K, N]"
    raise ValueError(f"rlk_jax.det_gemm: inner dimensions differ: a has shape "
                     f"{a.shape} (K={a.shape[-1]}) and b has shape {b.shape} "
                     f"(K={b_k}, b read as {layout}).")
  for name, x in (("a", a), ("b", b)):
    if x.dtype not in GEMM_DTYPES:
      raise TypeError(f"rlk_jax.det_gemm: {name} has unsupported dtype "
                      f"{x.dtype}; supported: "
                      f"{', '.join(map(str, GEMM_DTYPES))}.")
  if a.dtype != b.dtype:
    raise TypeError(f"rlk_jax.det_gemm: a and b must have the same dtype, got "
                    f"{a.dtype} (shape {a.shape}) and {b.dtype} "
                    f"(shape {b.shape}).")
