"""``batch_invariant_mode``'s replacements as aten kernels: the route eager
decoding takes (transformers' ``generate`` under the mode).

Why a second route: the mode is a torch-function mode, which torch.compile
traces, so compiled models get rlk's operators in their graphs. In eager
code, though, every torch call passes through the mode's Python handler,
the ~700 calls per decoded token of an 8-layer Llama that the mode leaves
alone included: a pass-through mode alone made ``generate`` 9.67 ms a token
against 7.58 (H200, 2026-11-26). Kernels registered with the dispatcher
for the few ops the mode replaces cost the rest nothing.

While active, a ``torch.library.Library`` on ``aten`` holds, for CPU and
CUDA tensors:

- at the Autograd keys, the entry points (``linear``, ``matmul``, ``mm``,
  ``addmm``, ``bmm``, ``baddbmm``, ``mean.dim``,
  ``scaled_dot_product_attention``, ``_grouped_mm``): the replacements bring their own
  autograd (det_gemm's, det_row_mean's, det_attention's);
- at the backend keys, the products and the mean, which
  ``inference_mode`` (no Autograd keys) and aten's own backward formulas
  reach below autograd.

The handlers are the torch-function mode's (``batch_invariant._Products``):
the same det ops, so the same bits. A call they leave goes to the kernel
registered before (``torch.library.get_kernel``).

On an SM90 GPU with the C++ extension (``_cpp_extension``), C++ kernels for
``linear`` and ``mean.dim`` go on top of these (``csrc/aten_route.cpp``):
calls that need no gradient run det_gemm's product with the config this
route planned for the shape, and the row kernel, with no Python; the rest
reach the Python kernels below them.
"""

from __future__ import annotations

import warnings

import torch

from rlk_torch_bridge import _cpp_extension, _row_routes

_ENTRY = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "mean.dim",
          "scaled_dot_product_attention", "_grouped_mm")
_BELOW_AUTOGRAD = ("mm", "addmm", "bmm", "baddbmm", "mean.dim", "_grouped_mm")
_KEYS = {"Autograd": _ENTRY, "": _BELOW_AUTOGRAD}


def _cpp_route(products) -> bool:
  """Whether the C++ kernels go on top: the mode's default implementation
  (the one whose plans they replay) on a GPU where the row kernel is the
  cuda_ffi library's (the one they launch; ``_row_routes``)."""
  if (products.implementation is not None or not _cpp_extension.enabled()
      or not torch.cuda.is_available()):
    return False
  return _row_routes.library_kernel() and _cpp_extension.load()


def _handler_name(op: str) -> str:
  return {"scaled_dot_product_attention": "sdpa", "mean.dim": "mean",
          "_grouped_mm": "grouped_mm"}.get(op, op)


class AtenRoute:
  """Context manager: the handlers of `products` as aten kernels (module
  docstring). Not re-entrant; one per thread of eager decoding."""

  def __init__(self, products, not_ours, report):
    self._products = products
    self._not_ours = not_ours
    self._report = report
    self._library = None
    self._cpp = False

  def _kernel(self, op, original):
    handler = getattr(self._products, _handler_name(op))
    not_ours, report = self._not_ours, self._report

    def kernel(keyset, *args, **kwargs):
      result = handler(*args, **kwargs)
      if result is NotImplemented:
        report(f"aten::{op}", args)
      elif result is not not_ours:
        return result
      return original.call_boxed(keyset, *args, **kwargs)
    return kernel

  def __enter__(self):
    library = torch.library.Library("aten", "IMPL")
    try:
      with warnings.catch_warnings():
        # Overriding aten's kernels is the point (undone on exit).
        warnings.filterwarnings(
            "ignore", "(?s).*Overriding a previously registered kernel")
        for prefix, ops in _KEYS.items():
          for device in ("CPU", "CUDA"):
            key = prefix + device
            for op in ops:
              original = torch.library.get_kernel(f"aten::{op}", key)
              library.impl(op, self._kernel(op, original), key,
                           with_keyset=True)
        cpp = _cpp_route(self._products)
        if cpp:
          torch.ops.rlk.cpp_route_enter()
        self._cpp = cpp
    except BaseException:
      library._destroy()
      raise
    self._library = library
    return self

  def __exit__(self, *exc):
    # The C++ kernels fall back to the Python ones: off first.
    if self._cpp:
      torch.ops.rlk.cpp_route_exit()
      self._cpp = False
    self._library._destroy()
    self._library = None
