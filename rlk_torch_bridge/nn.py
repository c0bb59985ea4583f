"""DetLinear: a drop-in nn.Linear whose matmul is rlk's det_gemm."""

from __future__ import annotations

import math

import torch
from torch import nn

from rlk_torch_bridge.functions import det_gemm


class DetLinear(nn.Module):
  """``nn.Linear`` (weight ``[out, in]``, optional bias) through det_gemm.

  Each output row's bits depend only on its input row, whatever the batch;
  the weight is read in its ``[out, in]`` layout, not transposed in memory.
  """

  def __init__(self, in_features: int, out_features: int, bias: bool = True,
               device=None, dtype=None, implementation: str | None = None):
    super().__init__()
    self.in_features, self.out_features = in_features, out_features
    self.implementation = implementation
    kwargs = dict(device=device, dtype=dtype)
    self.weight = nn.Parameter(torch.empty(out_features, in_features, **kwargs))
    self.bias = nn.Parameter(torch.empty(out_features, **kwargs)) if bias else None
    self.reset_parameters()

  def reset_parameters(self) -> None:
    # nn.Linear's initialisation, so a swapped model trains the same way.
    nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
    if self.bias is not None:
      bound = 1 / math.sqrt(self.in_features) if self.in_features else 0
      nn.init.uniform_(self.bias, -bound, bound)

  @classmethod
  def from_linear(cls, linear: nn.Linear, implementation: str | None = None
                  ) -> "DetLinear":
    """A DetLinear sharing `linear`'s Parameter objects (no copy)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.in_features, module.out_features = linear.in_features, linear.out_features
    module.implementation = implementation
    module.weight = linear.weight
    module.bias = linear.bias
    return module

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = det_gemm(x, self.weight, transpose_b=True,
                 implementation=self.implementation)
    return y if self.bias is None else y + self.bias

  def extra_repr(self) -> str:
    return (f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, implementation={self.implementation}")


def replace_linear(module: nn.Module, implementation: str | None = None) -> nn.Module:
  """Swaps every ``nn.Linear`` inside `module` (or `module` itself) for a
  DetLinear that keeps its parameters; returns the (modified) module."""
  if isinstance(module, nn.Linear):
    return DetLinear.from_linear(module, implementation)
  for name, child in module.named_children():
    setattr(module, name, replace_linear(child, implementation))
  return module
