"""A switch that makes an unmodified PyTorch model's matrix products
batch-invariant: inside :func:`batch_invariant_mode`, ``torch.matmul``,
``@``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``F.linear`` (so every
``nn.Linear``) on bfloat16, float16 or float32 tensors run on rlk's
det_gemm (the ``rlk::det_mm`` operator), in eager mode and under
torch.compile alike.

Why a torch-function mode and not aten overrides (what Thinking Machines'
``batch_invariant_ops`` and vLLM register): Inductor lowers ``aten.mm`` to
its own matmul templates, so aten overrides never run in a compiled model.
A torch-function mode sits above that: Dynamo traces it, and the model's
products reach the graph as ``rlk::det_mm`` calls, which Inductor leaves
alone.

Bits: every output row of a product depends only on its input row and the
weight, whatever the batch (det_gemm's contract); gradients follow (dA
row-invariant, dB deterministic). Other dtypes, and products torch itself
rejects, fall through to torch unchanged. Batched products (``bmm``,
``baddbmm``, ``matmul`` with a batched right operand) run one det_gemm per
batch element. With a bias (``addmm``, ``linear``), the product is kept in
float32 and the bias added before the one rounding to the output dtype, as
a GEMM epilogue does.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from rlk_torch_bridge.functions import det_gemm

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _takes(*tensors) -> bool:
  return (all(isinstance(t, torch.Tensor) for t in tensors)
          and tensors[0].dtype in SUPPORTED_DTYPES
          and all(t.dtype == tensors[0].dtype for t in tensors)
          and len({t.device for t in tensors}) == 1)


class _Products:
  """The replacements, each returning NotImplemented for calls it does not
  take (they go to torch as they are)."""

  def __init__(self, implementation):
    self.implementation = implementation

  def gemm(self, a, b, out_dtype=None, transpose_b=False):
    return det_gemm(a, b, out_dtype=out_dtype, transpose_b=transpose_b,
                    implementation=self.implementation)

  def batched(self, a, b):
    """``a [..., M, K] @ b [..., K, N]`` with broadcast batch dimensions:
    one product per batch element."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.stack([self.gemm(a[i], b[i]) for i in range(a.shape[0])])
    return out.reshape(*batch, *out.shape[-2:])

  def matmul(self, a, b):
    if not _takes(a, b) or a.ndim == 0 or b.ndim == 0:
      return NotImplemented
    if a.ndim == 1:
      return self.matmul(a.unsqueeze(0), b).squeeze(-2)
    if b.ndim == 1:
      return self.matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if b.ndim == 2:
      return self.gemm(a, b)
    return self.batched(a, b)

  def mm(self, a, b):
    if not _takes(a, b) or a.ndim != 2 or b.ndim != 2:
      return NotImplemented
    return self.gemm(a, b)

  def bmm(self, a, b):
    if not _takes(a, b) or a.ndim != 3 or b.ndim != 3:
      return NotImplemented
    return self.batched(a, b)

  def _plus(self, bias, product_f32, beta, alpha, dtype):
    # (beta, alpha) = (1, 1) is what nn.Linear and most callers use; other
    # values scale in float32 before the one rounding.
    out = product_f32 if alpha == 1 else product_f32 * alpha
    if beta != 0:
      out = out + (bias.float() if beta == 1 else bias.float() * beta)
    return out.to(dtype)

  def addmm(self, bias, a, b, *, beta=1, alpha=1):
    if not _takes(bias, a, b) or a.ndim != 2 or b.ndim != 2:
      return NotImplemented
    return self._plus(bias, self.gemm(a, b, out_dtype=torch.float32), beta,
                      alpha, a.dtype)

  def baddbmm(self, bias, a, b, *, beta=1, alpha=1):
    if not _takes(bias, a, b) or a.ndim != 3 or b.ndim != 3:
      return NotImplemented
    product = self.batched(a, b).float()
    return self._plus(bias, product, beta, alpha, a.dtype)

  def linear(self, x, weight, bias=None):
    if not _takes(x, weight) or weight.ndim != 2 or x.ndim == 0:
      return NotImplemented
    if bias is None:
      return self.gemm(x, weight, transpose_b=True)
    if not _takes(x, weight, bias):
      return NotImplemented
    product = self.gemm(x, weight, out_dtype=torch.float32, transpose_b=True)
    return self._plus(bias, product, 1, 1, x.dtype)


def _handlers(products: _Products) -> dict:
  matmul = products.matmul
  return {
      torch.matmul: matmul, torch.Tensor.matmul: matmul,
      torch.Tensor.__matmul__: matmul,
      torch.Tensor.__rmatmul__: lambda b, a: matmul(a, b),
      torch.mm: products.mm, torch.Tensor.mm: products.mm,
      torch.bmm: products.bmm, torch.Tensor.bmm: products.bmm,
      torch.addmm: products.addmm, torch.Tensor.addmm: products.addmm,
      torch.baddbmm: products.baddbmm, torch.Tensor.baddbmm: products.baddbmm,
      torch.nn.functional.linear: products.linear,
  }


class BatchInvariantMode(TorchFunctionMode):
  """The torch-function mode behind :func:`batch_invariant_mode`."""

  def __init__(self, implementation: str | None = None):
    super().__init__()
    self.implementation = implementation
    self._handlers = _handlers(_Products(implementation))

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    handler = self._handlers.get(func)
    if handler is not None:
      out = kwargs.pop("out", None)
      result = handler(*args, **kwargs)
      if result is not NotImplemented:
        return result if out is None else out.copy_(result)
      if out is not None:
        kwargs["out"] = out
    return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant_mode(implementation: str | None = None):
  """Inside this context every matrix product of a supported dtype runs on
  rlk's det_gemm (see the module docstring). Re-entrant (an inner context
  adds nothing and leaves the outer one on) and exception-safe.
  `implementation` pins det_gemm's implementation (None: the best for each
  call's device and operands, as ``det_gemm`` picks)."""
  with BatchInvariantMode(implementation):
    yield


_global = threading.local()


def enable(implementation: str | None = None) -> None:
  """Turns the mode on in this thread until :func:`disable` (outside any
  ``batch_invariant_mode`` context: the modes form a stack)."""
  if getattr(_global, "mode", None) is None:
    mode = BatchInvariantMode(implementation)
    mode.__enter__()
    _global.mode = mode


def disable() -> None:
  """Turns off what :func:`enable` turned on (a no-op otherwise)."""
  mode = getattr(_global, "mode", None)
  if mode is not None:
    _global.mode = None
    mode.__exit__(None, None, None)


def is_enabled() -> bool:
  """Whether :func:`enable` has the mode on in this thread."""
  return getattr(_global, "mode", None) is not None
