"""Tensor-parallel linear layers whose bits do not depend on the number of
ranks: Megatron's row- and column-parallel layers with det_gemm's
tensor-parallel-invariant mode (``reduction_chunks``).

    group = torch.distributed.new_group(...)      # t ranks, t divides C
    up = ColumnParallelDetLinear.from_linear(mlp.up_proj, group)
    down = RowParallelDetLinear.from_linear(mlp.down_proj, group)
    y = down(act(up(x)))      # the bits of one GPU's DetLinear chain in the mode

    parallelize(model, group, LLAMA_PLAN)         # a whole transformers decoder

A row-parallel layer holds K/t of the input features: its forward sums the
reduction in C fixed chunks, each rank the subtree of its own, and the ranks'
roots finish the tree in rank order (an all-gather of f32 partials, not
torch's all-reduce). A column-parallel layer holds N/t of the outputs: its
forward is local, and the input gradient's reduction over N is split the same
way. At every t dividing C (1, 2, 4, 8 for C = 8) forward, input and weight
gradients carry the bits of one process running
``rlk_torch_bridge.det_gemm(x, weight, transpose_b=True,
reduction_chunks=C)`` with the whole weight, and rlk_jax's bits.
"""

from __future__ import annotations

import torch
from torch import nn

from rlk_torch_bridge import _process_group, _tree_gemm

__all__ = ["ColumnParallelDetLinear", "RowParallelDetLinear", "parallelize"]


def _shard(size: int, parts: int, what: str) -> int:
  if size % parts:
    raise ValueError(f"rlk_torch_bridge.{what}: {size} features cannot be "
                     f"split evenly over {parts} ranks.")
  return size // parts


class _ParallelDetLinear(nn.Module):
  split_dim: int   # the weight's dimension ([out, in]) split over the group

  def __init__(self, in_features: int, out_features: int, group=None,
               reduction_chunks: int = 8, bias: bool = True, device=None,
               dtype=None, implementation: str | None = None,
               _initialise: bool = True):
    super().__init__()
    self.in_features, self.out_features = in_features, out_features
    self.group, self.reduction_chunks = group, reduction_chunks
    self.implementation = implementation
    self.rank = _process_group.rank(group)
    self.ranks = _process_group.size(group)
    name = type(self).__name__
    shape = [out_features, in_features]
    shape[self.split_dim] = _shard(shape[self.split_dim], self.ranks, name)
    kwargs = dict(device=device, dtype=dtype)
    self.weight = nn.Parameter(torch.empty(*shape, **kwargs))
    bias_size = shape[0]
    self.bias = nn.Parameter(torch.empty(bias_size, **kwargs)) if bias else None
    if _initialise:
      # nn.Linear's initialisation, drawn per shard (fan-in of the whole
      # layer): a fresh layer's values depend on the number of ranks; load
      # or shard a whole layer (`from_linear`) for weights that do not.
      bound = 1 / in_features ** 0.5 if in_features else 0
      nn.init.uniform_(self.weight, -bound, bound)
      if self.bias is not None:
        nn.init.uniform_(self.bias, -bound, bound)

  @classmethod
  def from_linear(cls, linear: nn.Linear, group=None, reduction_chunks: int = 8,
                  implementation: str | None = None, **kwargs):
    """This rank's shard of a whole `linear` (every rank holding the same
    one, as after loading a checkpoint): a copy of its slice, keeping
    ``requires_grad``; draws no random numbers. `kwargs`: the layer's own
    (``gather_output`` for a column-parallel one)."""
    module = cls(linear.in_features, linear.out_features, group,
                 reduction_chunks, linear.bias is not None,
                 linear.weight.device, linear.weight.dtype, implementation,
                 _initialise=False, **kwargs)
    with torch.no_grad():
      module.weight.copy_(module._local(linear.weight, module.split_dim))
      if linear.bias is not None:
        module.bias.copy_(module._local_bias(linear.bias))
    module.weight.requires_grad_(linear.weight.requires_grad)
    if linear.bias is not None:
      module.bias.requires_grad_(linear.bias.requires_grad)
    return module

  def _local(self, whole, dim):
    size = whole.shape[dim] // self.ranks
    return whole.narrow(dim, self.rank * size, size)

  def extra_repr(self) -> str:
    return (f"in_features={self.in_features}, out_features={self.out_features},"
            f" ranks={self.ranks}, reduction_chunks={self.reduction_chunks}, "
            f"bias={self.bias is not None}")


class RowParallelDetLinear(_ParallelDetLinear):
  """``nn.Linear`` with the input features split over `group`: takes this
  rank's slice of the input (``[..., in/t]``, a column-parallel layer's
  output) and returns the whole output on every rank. Weight
  ``[out, in/t]``; the bias whole on every rank, added after the tree."""
  split_dim = 1

  def _local_bias(self, bias):
    return bias

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    local = self.weight.shape[1]
    if x.shape[-1] != local:
      raise ValueError(
          f"rlk_torch_bridge.RowParallelDetLinear: the input's last "
          f"dimension is {x.shape[-1]}, this rank's slice of the "
          f"{self.in_features} input features is {local} (rank "
          f"{self.rank} of {self.ranks}): pass the rank's slice, e.g. a "
          f"ColumnParallelDetLinear's output.")
    y = _tree_gemm.tree_gemm(
        x, self.weight, transpose_b=True, out_dtype=x.dtype,
        implementation=self.implementation, chunks=self.reduction_chunks,
        k_group=self.group, whole_k=self.in_features)
    return y if self.bias is None else y + self.bias


class ColumnParallelDetLinear(_ParallelDetLinear):
  """``nn.Linear`` with the output features split over `group`: takes the
  whole input and returns this rank's slice of the output (``[...,
  out/t]``), or, with ``gather_output``, the whole output. Weight and bias
  ``[out/t, in]``, ``[out/t]``."""
  split_dim = 0

  def __init__(self, *args, gather_output: bool = False, **kwargs):
    super().__init__(*args, **kwargs)
    self.gather_output = gather_output

  def _local_bias(self, bias):
    return self._local(bias, 0)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = _tree_gemm.tree_gemm(
        x, self.weight, transpose_b=True, out_dtype=x.dtype,
        implementation=self.implementation, chunks=self.reduction_chunks,
        n_group=self.group, whole_n=self.out_features)
    if self.bias is not None:
      y = y + self.bias
    if not self.gather_output or self.ranks == 1:
      return y
    return _gather_last_dim(y, self.group)


class _GatherLastDim(torch.autograd.Function):
  """Concatenates the ranks' slices along the last dimension (no
  arithmetic); the gradient is this rank's slice."""

  @staticmethod
  def forward(ctx, y, group):
    ctx.group = group
    return torch.cat(_process_group.gathered(y, group), dim=-1)

  @staticmethod
  def backward(ctx, g):
    width = g.shape[-1] // _process_group.size(ctx.group)
    return g.narrow(-1, _process_group.rank(ctx.group) * width, width), None


def _gather_last_dim(y, group):
  return _GatherLastDim.apply(y, group)


# Megatron's split of a Llama-style decoder (transformers' module names):
# attention heads and the MLP's hidden units are split over the ranks.
# Attention then runs on each rank's own heads (transformers reshapes q, k,
# v with -1 heads), whose outputs the row-parallel o_proj sums in the tree.
LLAMA_PLAN = {"q_proj": "column", "k_proj": "column", "v_proj": "column",
              "o_proj": "row", "gate_proj": "column", "up_proj": "column",
              "down_proj": "row"}
_STYLES = {"column": ColumnParallelDetLinear, "row": RowParallelDetLinear}


def parallelize(module: nn.Module, group, plan: dict, *,
                reduction_chunks: int = 8,
                implementation: str | None = None) -> nn.Module:
  """Replaces, in place, each ``nn.Linear`` of `module` whose name ends in
  a key of `plan` with this rank's shard of it: ``"column"``
  (`ColumnParallelDetLinear`) or ``"row"`` (`RowParallelDetLinear`). Every
  rank must hold the same whole module (one seed, or one checkpoint). A plan
  entry that matches no ``nn.Linear`` raises: nothing is left unsplit
  silently. Returns `module`."""
  bad = {k: v for k, v in plan.items() if v not in _STYLES}
  if bad:
    raise ValueError(f"rlk_torch_bridge.parallelize: unknown styles {bad}; "
                     f"use 'column' or 'row'.")
  matched = dict.fromkeys(plan, 0)
  for name, child in list(module.named_modules()):
    suffix = name.rsplit(".", 1)[-1]
    if suffix not in plan or not isinstance(child, nn.Linear):
      continue
    shard = _STYLES[plan[suffix]].from_linear(
        child, group, reduction_chunks=reduction_chunks,
        implementation=implementation)
    parent = module.get_submodule(name.rpartition(".")[0])
    setattr(parent, suffix, shard)
    matched[suffix] += 1
  missing = [k for k, n in matched.items() if not n]
  if missing:
    raise ValueError(f"rlk_torch_bridge.parallelize: no nn.Linear named "
                     f"{missing} in {type(module).__name__}.")
  return module

