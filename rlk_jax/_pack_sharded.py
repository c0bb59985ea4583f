"""pack / unpack of a batch sharded over a mesh axis: each shard packs its
own sequences into its own capacity block, on its own device, with no
communication.

Layout (n shards along `axis`, per-shard capacity C, per-shard mask shape
``(B/n, ...)``): ``packed`` is ``[n * C, *tail]``, shard s's rows in block
``[s*C, (s+1)*C)``, sharded along `axis`. The returned PackInfo holds every
shard's own metadata concatenated along the first axis (so
``segment_ids``, ``gather_map``, ``scatter_map`` and ``cu_seqlens`` index
within the shard; ``cu_seqlens`` is ``[n * (B/n + 1)]``), its scalars
``total``, ``max_seqlen``, ``num_dropped`` become ``[n]`` (one per shard),
and its static ``mask_shape`` and ``capacity`` are the per-shard ones. Pass
it to :func:`unpack_sharded` with the same mesh and axis.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from rlk_jax._pack import PackInfo, pack, unpack

_SCALARS = ("total", "max_seqlen", "num_dropped")


def _check(op, mesh, axis, batch):
  if axis not in mesh.shape:
    raise ValueError(f"rlk_jax.{op}: mesh has no axis {axis!r} "
                     f"(axes: {tuple(mesh.shape)}).")
  n = mesh.shape[axis]
  if batch % n:
    raise ValueError(f"rlk_jax.{op}: the batch axis ({batch}) must split "
                     f"evenly over mesh axis {axis!r} of size {n}.")


def pack_sharded(x, mask, *, mesh, axis: str, capacity: int, fill_value=0,
                 implementation: str | None = None):
  """Per-shard :func:`rlk_jax.pack` of `x` and `mask` sharded on their first
  axis over `axis` of `mesh`; `capacity` is per shard. See the module doc for
  the layout."""
  _check("pack_sharded", mesh, axis, mask.shape[0])

  def local(x, mask):
    packed, info = pack(x, mask, capacity=capacity, fill_value=fill_value,
                        implementation=implementation)
    # Scalars get a shard axis so that shards can be laid side by side.
    return packed, dataclasses.replace(
        info, **{f: getattr(info, f)[None] for f in _SCALARS})

  return _per_shard(local, mesh, axis)(x, mask)


def unpack_sharded(packed, info: PackInfo, *, mesh, axis: str, fill_value=0,
                   implementation: str | None = None):
  """Inverse of :func:`pack_sharded`: ``[B, ..., *tail]`` sharded on `axis`."""
  n = mesh.shape[axis] if axis in mesh.shape else 0
  _check("unpack_sharded", mesh, axis, packed.shape[0])
  if packed.shape[0] != n * info.capacity:
    raise ValueError(f"rlk_jax.unpack_sharded: packed has {packed.shape[0]} "
                     f"rows; expected {n} shards x capacity {info.capacity}.")

  def local(packed, info):
    info = dataclasses.replace(info, **{f: getattr(info, f)[0] for f in _SCALARS})
    return unpack(packed, info, fill_value=fill_value,
                  implementation=implementation)

  return _per_shard(local, mesh, axis)(packed, info)


def _per_shard(fn, mesh, axis):
  spec = PartitionSpec(axis)
  # check_vma=False: Pallas calls declare no varying mesh axes; every input
  # and output here is split along `axis` alone, by construction.
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                       check_vma=False)
