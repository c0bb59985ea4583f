"""One fixed reduction order for sums split over tensor-parallel ranks.

A row-parallel layer splits its reduction (K) over the ranks: each rank sums
its slice and the partials are added across ranks, so the order of the sum,
and the bits, depend on the number of ranks. rlk's tensor-parallel-invariant
mode cuts the reduction into C equal chunks whatever the number of ranks:

* each chunk is an ordinary det_gemm product with an f32 result (its own K
  walk from a fresh accumulator: row-invariant as ever);
* the C partials are added pairwise, neighbours first, in f32:
  ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` for C = 8;
* the root is rounded to the output dtype once.

A rank holding 1/t of the reduction (t a power of two dividing C) owns C/t
neighbouring chunks, a whole subtree: it sums that subtree, and the t roots,
gathered in rank order, finish the same tree. So the bits are the same at
t = 1, 2, 4, ..., C (and differ from the default det_gemm's: another order).

This module holds the order itself (`tree_sum`, framework-agnostic: the
torch bridge sums its partials with it) and its checks; det_gemm's
``reduction_chunks`` mode and linear_logp use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_reduce(parts, combine):
  """The fixed binary tree over `parts` (a power-of-two count): neighbours
  first, the earlier chunk always the left operand of `combine`."""
  parts = list(parts)
  if not parts or len(parts) & (len(parts) - 1):
    raise ValueError(f"rlk: a reduction tree needs a power-of-two number of "
                     f"partials, got {len(parts)}.")
  while len(parts) > 1:
    parts = [combine(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
  return parts[0]


def tree_sum(parts):
  """`tree_reduce` with ``+``: anything that adds (JAX or torch arrays)."""
  return tree_reduce(parts, lambda a, b: a + b)


def combine_row_stats(a, b):
  """Two vocabulary chunks' row statistics as one: each ``(lse, mean,
  target_logp, target_lse)`` f32 ``[N]``: the chunk's logsumexp of the
  scaled logits, their mean under the chunk's softmax, and the target's
  log-prob within its chunk and that chunk's logsumexp (both exactly 0 in
  chunks not holding the target, so the sums pick them exactly)."""
  (la, ma, pa_, qa), (lb, mb, pb_, qb) = a, b
  top = jnp.maximum(la, lb)
  lse = top + jnp.log1p(jnp.exp(-jnp.abs(la - lb)))
  # The products are materialised before the add: a compiler may otherwise
  # contract one of them into a fused multiply-add in one program and not
  # in another (a sharded and an unsharded one), and the bits would follow
  # the partitioning.
  pa, pb = jax.lax.optimization_barrier((jnp.exp(la - lse) * ma,
                                         jnp.exp(lb - lse) * mb))
  return lse, pa + pb, pa_ + pb_, qa + qb


def check_power_of_two(chunks, what: str, name: str = "reduction_chunks"):
  if (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1
      or chunks & (chunks - 1)):
    raise ValueError(f"{what}: {name} must be a power of two (1, 2, 4, 8, "
                     f"...), got {chunks!r}.")


def check_chunks(chunks, k: int, n: int, what: str = "rlk_jax.det_gemm"):
  """Raises unless `chunks` is a power of two dividing both K (cut in the
  forward) and N (cut in the input gradient)."""
  check_power_of_two(chunks, what)
  for name, size, role in (("K", k, "the forward's reduction"),
                           ("N", n, "the input gradient's reduction")):
    if size % chunks:
      raise ValueError(
          f"{what}: reduction_chunks={chunks} must divide {name}={size} "
          f"({role}); a product of K={k}, N={n} cannot be cut into "
          f"{chunks} equal chunks.")


def check_ranks(chunks: int, ranks: int, what: str,
                name: str = "reduction_chunks"):
  """A rank must hold whole neighbouring chunks: `ranks` divides `chunks`."""
  if ranks < 1 or chunks % ranks:
    raise ValueError(f"{what}: {ranks} ranks cannot each hold a whole "
                     f"subtree of {name}={chunks} chunks: the "
                     f"number of ranks must divide it (so at most {chunks}).")


def finish_across(partial, axis_name, ranks: int, invariant: bool = False):
  """The tree's top levels across the `ranks` devices of `axis_name`, each
  holding the root of its neighbouring subtree: gathered in rank order (not
  an all-reduce, whose order is the collective's own) and summed in the same
  tree on every device. `invariant` (inside ``shard_map``): the result is
  typed as the same on every device of the axis, which it is, so a checked
  ``shard_map`` may return it whole (``out_specs`` without the axis)."""
  if ranks == 1 and not invariant:  # (invariant: one device's is typed so)
    return partial
  gather = _all_gather_invariant() if invariant else jax.lax.all_gather
  roots = gather(partial, axis_name)
  return tree_sum(roots[r] for r in range(ranks))


def _all_gather_invariant():
  # JAX types an all_gather's result as varying over the axis;
  # all_gather_invariant (not yet exported by jax.lax in 0.10-0.11) types it
  # as what it is. Where neither exists, all_gather (then a checked
  # shard_map must return the result with the axis in its out_specs).
  found = getattr(jax.lax, "all_gather_invariant", None)
  if found is None:
    try:
      from jax._src.lax import parallel
      found = getattr(parallel, "all_gather_invariant", None)
    except ImportError:
      found = None
  return found or jax.lax.all_gather


def finish_stats_across(stats, axis_name, ranks: int):
  """`finish_across` for `combine_row_stats`' triples."""
  if ranks == 1:
    return stats
  gathered = [jax.lax.all_gather(x, axis_name) for x in stats]
  return tree_reduce([tuple(g[r] for g in gathered) for r in range(ranks)],
                     combine_row_stats)
