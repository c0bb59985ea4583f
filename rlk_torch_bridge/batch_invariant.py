"""A switch that makes an unmodified PyTorch model's matrix products
batch-invariant: inside :func:`batch_invariant_mode`, ``torch.matmul``,
``@``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``F.linear`` (so every
``nn.Linear``) on bfloat16, float16 or float32 tensors run on rlk's
det_gemm (the ``rlk::det_mm`` operator), in eager mode and under
torch.compile alike; a mixture of experts' ``torch._grouped_mm`` (transformers' default
experts) runs one det_gemm per expert (``rlk::det_grouped_mm``);
``mean`` over the last dimension (an RMSNorm's) runs
on ``rlk::det_row_mean`` (a row kernel), and the gradient of a per-row
scale (an RMSNorm's ``x * rsqrt(var)``) on ``rlk::det_row_sum``; a causal
decoder's ``F.scaled_dot_product_attention``, and transformers' attention
functions, run on det_attention (``rlk_torch_bridge.sdpa``,
``rlk_torch_bridge.transformers_attention``). A product with K = 1 (a
rotary embedding's) has no sum: it runs elementwise, exactly.

While the mode is on, Inductor rounds fused bf16/f16 elementwise chains
where eager does (``emulate_precision_casts``), so a compiled trainer gets
an eager rollout's bits.

transformers' ``generate`` under the mode decodes on the same replacements
registered as aten kernels (``rlk_torch_bridge.transformers_generate``): in
eager code a torch-function mode costs every torch call some Python, and a
decoded token is hundreds of small calls.

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

Why ``mean`` and not ``softmax``: torch's CUDA reduction kernel picks how
many threads share one output's sum from the number of outputs, so a row's
mean can change with the batch; ``rlk::det_row_mean`` fixes one order per
row length (on CPU it is ``x @ ones / K``, a det_gemm product). torch's
softmax and log_softmax kernels size their blocks from the row length
alone (batch-invariant already: a device test checks it), so they stay
torch's.

What the mode leaves to torch (other dtypes, devices or argument forms) it
says once per function and reason, as a :class:`BatchInvariantFallthrough`
warning; :func:`fallthroughs` lists them.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from rlk_torch_bridge import sdpa, transformers_attention, transformers_generate
# (BatchInvariantFallthrough and fallthroughs are this module's API.)
from rlk_torch_bridge._fallthroughs import (  # noqa: F401
    BatchInvariantFallthrough, fallthroughs, report_fallthrough)
from rlk_torch_bridge._aten_route import AtenRoute
from rlk_torch_bridge._grouped_mm_op import det_grouped_mm
from rlk_torch_bridge._row_mean_op import RowScaled, det_row_mean
from rlk_torch_bridge.functions import det_gemm

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# A handler's answer for calls outside the mode's business (a mean over
# other dimensions, say): torch runs them, and nothing is said.
_NOT_OURS = object()


def _report(func, args) -> None:
  tensors = [a for a in args if isinstance(a, torch.Tensor)]
  # Integer products are exact, so batch-invariant as they are.
  if not any(t.is_floating_point() for t in tensors):
    return
  reason = (", ".join(sorted({f"{t.dtype} on {t.device.type}" for t in tensors}))
            or "no tensor operands")
  name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
  report_fallthrough(name, reason)


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
    if a.shape[-1] == 1:
      # K = 1 (a rotary embedding's positions x frequencies): one product
      # per element and no sum, so elementwise is exact and as invariant.
      b_row = b.reshape(1, -1) if transpose_b else b
      out = a.float() * b_row.float() if out_dtype == torch.float32 else a * b_row
      return out.to(a.dtype if out_dtype is None else out_dtype)
    return det_gemm(a, b, out_dtype=out_dtype, transpose_b=transpose_b,
                    implementation=self.implementation)

  def batched(self, a, b):
    """``a [..., M, K] @ b [..., K, N]`` with broadcast batch dimensions:
    one product per batch element."""
    if a.shape[-1] == 1:  # no sum: elementwise, as gemm says
      return a * b
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

  def mean(self, x, dim=None, keepdim=False, *, dtype=None):
    """``mean`` over the last dimension, on ``rlk::det_row_mean`` (a row
    kernel with one summation order per row length). Other reductions go
    to torch."""
    if (not isinstance(x, torch.Tensor) or x.ndim == 0 or dtype is not None
        or _last_dim(dim, x.ndim) is None or x.shape[-1] == 0):
      return _NOT_OURS
    if not _takes(x):
      return NotImplemented
    out = det_row_mean(x)
    return out.unsqueeze(-1) if keepdim else out

  def mul(self, a, b):
    """A product scaling each row of ``x [..., K]`` by ``s [..., 1]`` that
    needs the scale's gradient (an RMSNorm's ``x * rsqrt(var)``):
    ``RowScaled``, whose backward sums each row on the row kernel. Every
    other product is torch's (elementwise, invariant as it is)."""
    if (not torch.is_grad_enabled() or not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)):
      return _NOT_OURS
    for x, s in ((a, b), (b, a)):
      if (s.requires_grad and s.ndim == x.ndim >= 1 and s.shape[-1] == 1
          and x.shape[-1] > 1 and s.shape[:-1] == x.shape[:-1]
          and s.dtype == x.dtype and x.dtype in SUPPORTED_DTYPES
          and s.device == x.device):
        return RowScaled.apply(x, s)
    return _NOT_OURS

  def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0,
           is_causal=False, scale=None, enable_gqa=False):
    """A causal decoder's ``scaled_dot_product_attention`` on det_attention
    (``rlk_torch_bridge.sdpa``). Eager calls with a mask check it on the
    host and leave a mask det_attention cannot express to torch; traced
    ones check on the device (NaN rows where it does not fit)."""
    if not _takes(query, key, value):
      return NotImplemented
    reason = sdpa.refusal(query, key, value, attn_mask, dropout_p, is_causal,
                          enable_gqa)
    if reason is not None:
      report_fallthrough("scaled_dot_product_attention", reason)
      return _NOT_OURS
    check = "device" if torch.compiler.is_compiling() else "host"
    out = sdpa.attention(query, key, value, attn_mask, scale, check=check)
    if out is None:
      report_fallthrough("scaled_dot_product_attention",
                         "a mask that is not causal with padding")
      return _NOT_OURS
    return out.transpose(1, 2)

  def grouped_mm(self, a, b, offs=None, bias=None, out_dtype=None):
    """A mixture of experts' ``torch._grouped_mm(a [S, K], b [E, K, N],
    offs)`` (transformers' default experts) on ``rlk::det_grouped_mm``:
    each expert's rows one det_gemm product."""
    if (offs is None or bias is not None or not _takes(a, b) or a.ndim != 2
        or b.ndim != 3 or a.shape[1] != b.shape[1]
        or offs.shape != (b.shape[0],)):
      return NotImplemented
    return det_grouped_mm(a, b, offs, a.dtype if out_dtype is None
                          else out_dtype, self.implementation)

  def linear(self, x, weight, bias=None):
    if not _takes(x, weight) or weight.ndim != 2 or x.ndim == 0:
      return NotImplemented
    if bias is None:
      return self.gemm(x, weight, transpose_b=True)
    if not _takes(x, weight, bias):
      return NotImplemented
    product = self.gemm(x, weight, out_dtype=torch.float32, transpose_b=True)
    return self._plus(bias, product, 1, 1, x.dtype)


def _last_dim(dim, ndim):
  """`dim` if it names the last dimension alone (an int, or a one-element
  list or tuple), else None."""
  if isinstance(dim, (list, tuple)):
    if len(dim) != 1:
      return None
    dim = dim[0]
  if isinstance(dim, int) and dim in (-1, ndim - 1):
    return dim
  return None


def _handlers(products: _Products) -> dict:
  matmul = products.matmul
  return {
      torch.mean: products.mean, torch.Tensor.mean: products.mean,
      torch.mul: products.mul, torch.Tensor.mul: products.mul,
      torch.Tensor.__mul__: products.mul, torch.Tensor.__rmul__: products.mul,
      torch.matmul: matmul, torch.Tensor.matmul: matmul,
      torch.Tensor.__matmul__: matmul,
      torch.Tensor.__rmatmul__: lambda b, a: matmul(a, b),
      torch.mm: products.mm, torch.Tensor.mm: products.mm,
      torch.bmm: products.bmm, torch.Tensor.bmm: products.bmm,
      torch.addmm: products.addmm, torch.Tensor.addmm: products.addmm,
      torch.baddbmm: products.baddbmm, torch.Tensor.baddbmm: products.baddbmm,
      torch.nn.functional.linear: products.linear,
      torch.nn.functional.scaled_dot_product_attention: products.sdpa,
      **{f: products.grouped_mm for f in _GROUPED_BUILTINS},
  }


# torch's names for the operands the handlers take by position: a caller
# may name them (Bloom's ``alibi.baddbmm(batch1=..., batch2=...)``).
_OPERAND_NAMES = {
    "baddbmm": ("input", "batch1", "batch2"),
    "addmm": ("input", "mat1", "mat2"),
    "mm": ("input", "mat2"), "bmm": ("input", "mat2"),
    "matmul": ("input", "other"), "__matmul__": ("input", "other"),
    "mul": ("input", "other"), "__mul__": ("input", "other"),
    "linear": ("input", "weight", "bias"),
    "mean": ("input", "dim", "keepdim"),
    "_grouped_mm": ("mat_a", "mat_b", "offs"),
    "grouped_mm": ("mat_a", "mat_b"),
}


def _positional(func, args, kwargs):
  """`args` and `kwargs` with the operands named in `kwargs` moved into
  `args`, in torch's order, as far as they run without a gap (``self`` of
  a method call is already ``args[0]``)."""
  names = _OPERAND_NAMES.get(getattr(func, "__name__", None))
  if not names or not any(n in kwargs for n in names):
    return args, kwargs
  args, kwargs = list(args), dict(kwargs)
  for name in names[len(args):]:
    if name not in kwargs:
      break
    args.append(kwargs.pop(name))
  return tuple(args), kwargs


# The products of the innermost open mode, for the grouped-product entry
# points below (process-wide, as transformers_attention's patch is).
_open_modes: list = []
# (module, name, torch's function) of each grouped-product entry point.
_GROUPED = tuple((m, n, getattr(m, n)) for m, n in (
    (torch, "_grouped_mm"), (torch.nn.functional, "grouped_mm"))
                 if hasattr(m, n))
_GROUPED_BUILTINS = tuple(f for _, _, f in _GROUPED)


def _grouped_entry(original):
  """``torch._grouped_mm`` / ``F.grouped_mm`` while a mode is open.
  torch.compile hands a torch-function mode only the functions torch lists
  as overridable, which these are not: a compiled MoE model kept torch's
  grouped kernel. As Python functions they are traced, and the product
  reaches the graph as ``rlk::det_grouped_mm``."""

  def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if _open_modes:
      out = _open_modes[-1].grouped_mm(mat_a, mat_b, offs, bias, out_dtype)
      if out is not NotImplemented:
        return out
    return original(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

  return grouped_mm


def _open(products) -> None:
  if not _open_modes:
    for module, name, original in _GROUPED:
      setattr(module, name, _grouped_entry(original))
  _open_modes.append(products)


def _close(products) -> None:
  if products in _open_modes:
    _open_modes.remove(products)
  if not _open_modes:
    for module, name, original in _GROUPED:
      setattr(module, name, original)


class BatchInvariantMode(TorchFunctionMode):
  """The torch-function mode behind :func:`batch_invariant_mode`."""

  def __init__(self, implementation: str | None = None):
    super().__init__()
    self.implementation = implementation
    self._products = _Products(implementation)
    self._handlers = _handlers(self._products)

  def aten_route(self) -> AtenRoute:
    """This mode's replacements as aten kernels, for eager code that should
    not pay a torch-function mode's per-call cost (``_aten_route``)."""
    return AtenRoute(self._products, _NOT_OURS, _report)

  def __enter__(self):
    # Inductor computes a chain of fused bf16/f16 elementwise ops in float32
    # and rounds once; eager rounds after each op. With this flag it rounds
    # where eager does, so a compiled trainer gets an eager rollout's bits.
    from torch._inductor import config as inductor
    self._saved_casts = inductor.emulate_precision_casts
    inductor.emulate_precision_casts = True
    transformers_attention.enter()
    transformers_generate.install(BatchInvariantMode)
    _open(self._products)
    try:
      return super().__enter__()
    except BaseException:
      self._restore()
      raise

  def __exit__(self, *exc):
    try:
      return super().__exit__(*exc)
    finally:
      self._restore()

  def _restore(self):
    from torch._inductor import config as inductor
    inductor.emulate_precision_casts = self._saved_casts
    transformers_attention.exit()
    _close(self._products)

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    handler = self._handlers.get(func)
    if handler is not None:
      out = kwargs.pop("out", None)
      args, kwargs = _positional(func, args, kwargs)
      result = handler(*args, **kwargs)
      if result is not NotImplemented and result is not _NOT_OURS:
        return result if out is None else out.copy_(result)
      if result is NotImplemented:
        _report(func, args)
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
