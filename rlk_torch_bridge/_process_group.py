"""A process group's size, this process's rank in it, and an all-gather in
rank order: what the tensor-parallel layers and modes share. ``None`` is one
process (size 1, rank 0, nothing to gather)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def size(group) -> int:
  return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
  return 0 if group is None else dist.get_rank(group)


def gathered(x: torch.Tensor, group) -> list[torch.Tensor]:
  """`x` from every rank of `group`, in rank order (an ``all_gather``: no
  arithmetic, so a sum over the list is in the caller's order, not the
  collective's)."""
  if size(group) == 1:
    return [x]
  parts = [torch.empty_like(x) for _ in range(size(group))]
  dist.all_gather(parts, x.contiguous(), group=group)
  return parts
