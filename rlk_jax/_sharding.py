"""How rlk's products split over a device mesh under ``jit``.

A Pallas call or an FFI custom call is opaque to XLA's partitioner, which
would otherwise gather every operand onto every device. Each det_gemm
product gets a rule instead (``custom_partitioning`` with a Shardy sharding
rule): the rows of A (data parallel) and the columns of B (column tensor
parallel) stay sharded and each device runs the kernel on its own block; the
reduction dimension K is never split, because a split K means partial sums
added in a different order: other bits. A K that arrives sharded is gathered
first (the partitioner does that from ``need_replication_factors``), so the
result is bitwise the unsharded one: every output element depends only on
its row of A and column of B, whichever device computes it.

The tensor-parallel modes (det_gemm's ``reduction_chunks``, linear_logp's
``vocab_chunks``) are the exception: their reduction is a fixed tree of
chunks, so a reduction dimension (K, or V) sharded over a number of devices
dividing the chunk count stays sharded, each device sums its own subtree and
the roots finish the tree in rank order (`partitioned_tree_product`,
`partitioned_vocab_tree`).
"""

from __future__ import annotations

import threading

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


_LOCAL = threading.local()


def multi_device() -> bool:
  """Whether the rules apply: with one device nothing is partitioned, and
  the plain call keeps single-device programs exactly as they were; inside
  a rule's own per-device body (`per_device`) the operands are one
  device's, and the ops it calls run plainly."""
  return jax.device_count() > 1 and not getattr(_LOCAL, "depth", 0)


def per_device(fn):
  """`fn` as a partition rule's per-device body: rlk ops it calls run on
  the device's own blocks, not through their own rules."""
  def body(*args):
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
      return fn(*args)
    finally:
      _LOCAL.depth -= 1
  return body


def axis_size(mesh, axis) -> int:
  """Devices along a mesh axis (or a tuple of axes); 1 for None."""
  size = 1
  for name in (() if axis is None else axis if isinstance(axis, tuple)
               else (axis,)):
    size *= mesh.shape[name]
  return size


def _dims(transpose_a: bool, transpose_b: bool):
  """(A's factor names, B's factor names) in storage order."""
  a = ("k", "m") if transpose_a else ("m", "k")
  b = ("n", "k") if transpose_b else ("k", "n")
  return a, b


def _axis(spec, dim):
  return spec[dim] if dim < len(spec) else None


def _rows_and_columns(arg_shapes, a_dims, b_dims):
  """(A's and B's specs, the mesh axes of M and N): rows and columns stay
  where they are; one mesh axis cannot split both, so the rows' keep it."""
  a_spec = arg_shapes[0].sharding.spec
  b_spec = arg_shapes[1].sharding.spec
  m_axis = _axis(a_spec, a_dims.index("m"))
  n_axis = _axis(b_spec, b_dims.index("n"))
  if n_axis is not None and n_axis == m_axis:
    n_axis = None
  return a_spec, b_spec, m_axis, n_axis


def partitioned_product(local, transpose_a: bool, transpose_b: bool):
  """`local(a, b)` (one device's product, ``[M, N]``) as a partitioned op.
  (Callers cache the result: each call makes a new primitive.)"""
  a_dims, b_dims = _dims(transpose_a, transpose_b)

  @custom_partitioning
  def product(a, b):
    return local(a, b)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    _, _, m_axis, n_axis = _rows_and_columns(arg_shapes, a_dims, b_dims)
    names = {"m": m_axis, "n": n_axis, "k": None}
    a_sharding = NamedSharding(mesh, PartitionSpec(*(names[d] for d in a_dims)))
    b_sharding = NamedSharding(mesh, PartitionSpec(*(names[d] for d in b_dims)))
    out = NamedSharding(mesh, PartitionSpec(m_axis, n_axis))
    return mesh, local, out, (a_sharding, b_sharding)

  product.def_partition(
      partition,
      sharding_rule=f"{' '.join(a_dims)}, {' '.join(b_dims)} -> m n",
      need_replication_factors=("k",))
  return product


def rowwise(local, ranks: tuple[int, ...], out_ranks: tuple[int, ...]):
  """`local(*arrays)` returning a tuple of arrays, where every argument and
  result is indexed by rows on its leading axis (rank 1: ``[N]``; rank 2:
  ``[N, C]``, one C for all), partitioned over rows only: each device runs
  the kernel on its own rows. A row's result depends on that row alone
  (linear_logp's d logits kernel), so the rows are bitwise the unsharded
  ones; C is never split (a chunk's columns are indexed by its targets)."""

  @custom_partitioning
  def rows(*args):
    return local(*args)

  def sharding(mesh, n_axis, rank):
    return NamedSharding(mesh, PartitionSpec(n_axis, *[None] * (rank - 1)))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    spec = arg_shapes[0].sharding.spec
    n_axis = spec[0] if len(spec) else None
    return (mesh, local,
            tuple(sharding(mesh, n_axis, r) for r in out_ranks),
            tuple(sharding(mesh, n_axis, r) for r in ranks))

  factors = lambda rs: ", ".join("n" if r == 1 else "n c" for r in rs)
  rows.def_partition(partition,
                     sharding_rule=f"{factors(ranks)} -> {factors(out_ranks)}",
                     need_replication_factors=("c",))
  return rows


def partitioned_rows(local, n_outputs: int, n_row_inputs: int = 1):
  """`local(hidden [N, H], weight [H, V], *row_inputs)` (`n_row_inputs`
  arrays ``[N]``: linear_logp's targets and temperatures) returning
  `n_outputs` per-row arrays ``[N]`` (linear_logp's forward), partitioned
  over rows only: each device runs the kernel on its tokens with the whole
  weight. H and V are never split (a split V would combine per-device
  logsumexps: other bits), so the rows are bitwise the unsharded ones."""

  @custom_partitioning
  def rows(hidden, weight, *row_inputs):
    return local(hidden, weight, *row_inputs)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    spec = arg_shapes[0].sharding.spec
    n_axis = spec[0] if len(spec) else None
    row = NamedSharding(mesh, PartitionSpec(n_axis))
    args = (NamedSharding(mesh, PartitionSpec(n_axis, None)),
            NamedSharding(mesh, PartitionSpec(None, None)),
            *(row,) * n_row_inputs)
    return mesh, local, (row,) * n_outputs, args

  rows.def_partition(
      partition,
      sharding_rule="n h, h v" + ", n" * n_row_inputs + " -> "
                    + ", ".join(["n"] * n_outputs),
      need_replication_factors=("h", "v"))
  return rows


def partitioned_tree_product(local, transpose_a: bool, transpose_b: bool,
                             chunks: int):
  """`local(a, b, k_axis, ranks)` (det_gemm's chunked mode: the reduction
  in `chunks` chunks summed in a fixed tree) as a partitioned op. Rows and
  columns stay local as in `partitioned_product`; a reduction dimension K
  sharded over a mesh axis of t devices, t dividing `chunks`, stays
  sharded: each device sums its neighbouring chunks' subtree and `local`
  finishes the tree across the axis in rank order, so the weight is never
  gathered and the bits are the one-device bits. Another K sharding is
  gathered first (the same bits, the weight's memory on every device)."""
  a_dims, b_dims = _dims(transpose_a, transpose_b)

  @custom_partitioning
  def product(a, b):
    return local(a, b)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    a_spec, b_spec, m_axis, n_axis = _rows_and_columns(arg_shapes, a_dims,
                                                       b_dims)
    # The weight's (B's) K split decides: A's K is resharded to it (a
    # replicated activation is sliced locally, no communication); only
    # where B's K is whole does A's split stand (B is sliced locally).
    k_axis = (_axis(b_spec, b_dims.index("k"))
              or _axis(a_spec, a_dims.index("k")))
    if k_axis in (m_axis, n_axis):
      k_axis = None
    ranks = axis_size(mesh, k_axis)
    if chunks % ranks:
      k_axis, ranks = None, 1  # not a whole subtree per device: gathered
    names = {"m": m_axis, "n": n_axis, "k": k_axis}
    a_sharding = NamedSharding(mesh, PartitionSpec(*(names[d] for d in a_dims)))
    b_sharding = NamedSharding(mesh, PartitionSpec(*(names[d] for d in b_dims)))
    out = NamedSharding(mesh, PartitionSpec(m_axis, n_axis))
    lower = per_device(lambda a, b: local(a, b, k_axis, ranks))
    return mesh, lower, out, (a_sharding, b_sharding)

  product.def_partition(
      partition,
      sharding_rule=f"{' '.join(a_dims)}, {' '.join(b_dims)} -> m n")
  return product


def partitioned_vocab_tree(local, n_outputs: int, n_row_inputs: int,
                           chunks: int, weight_output: bool = False,
                           rows_local: bool = True):
  """`local(hidden [N, H], weight [H, V], *row_inputs, v_axis=, ranks=)`
  (linear_logp's vocabulary-chunked mode: V in `chunks` chunks whose row
  statistics or gradients combine in a fixed tree) as a partitioned op: a V
  sharded over a mesh axis of t devices, t dividing `chunks`, stays sharded,
  each device runs its own chunks on its own weight slice and `local`
  finishes the tree across the axis in rank order; another V sharding is
  gathered. Returns `n_outputs` row arrays ``[N]`` (or ``[N, H]``: the
  input gradient, when `weight_output`, followed by the weight gradient
  ``[H, V]`` sharded like the weight). Rows stay sharded when `rows_local`
  (the forward: a row's statistics need only that row); the backward's
  weight gradient sums over rows, so it gathers them (the unsharded order)."""

  @custom_partitioning
  def op(hidden, weight, *row_inputs):
    return local(hidden, weight, *row_inputs)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    h_spec = arg_shapes[0].sharding.spec
    w_spec = arg_shapes[1].sharding.spec
    n_axis = (h_spec[0] if len(h_spec) else None) if rows_local else None
    v_axis = w_spec[1] if len(w_spec) > 1 else None
    if v_axis is not None and v_axis == n_axis:
      v_axis = None
    ranks = axis_size(mesh, v_axis)
    if chunks % ranks:
      v_axis, ranks = None, 1
    row = NamedSharding(mesh, PartitionSpec(n_axis))
    hidden = NamedSharding(mesh, PartitionSpec(n_axis, None))
    weight = NamedSharding(mesh, PartitionSpec(None, v_axis))
    outs = ((hidden, weight) if weight_output
            else (row,) * n_outputs)
    lower = per_device(
        lambda h, w, *rows: local(h, w, *rows, v_axis=v_axis, ranks=ranks))
    return mesh, lower, outs, (hidden, weight, *(row,) * n_row_inputs)

  rows = ", n" * n_row_inputs
  results = "n h, h v" if weight_output else ", ".join(["n"] * n_outputs)
  op.def_partition(partition,
                   sharding_rule=f"n h, h v{rows} -> {results}",
                   need_replication_factors=("h",) if rows_local
                   else ("n", "h"))
  return op

