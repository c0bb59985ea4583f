"""The ``rlk::`` PyTorch operator library: one place that defines an op
(schema, device kernels, fake kernel, autograd) so torch.compile, export,
opcheck and CUDA graphs see real operators, not Python calls.

Route: ``torch.library`` define + impl (about 2 us per call over a plain
Python call) with the autograd kernel registered by hand at the ``Autograd``
key as a thin ``torch.autograd.Function`` (``torch.library.register_autograd``
costs about 25 us more per call). The public functions call the op with
:func:`call`, which in eager mode enters the autograd function or the kernel
below autograd directly: exactly what the ``Autograd`` kernel would do,
without one more trip through the dispatcher.
"""

from __future__ import annotations

from typing import Callable

import torch

LIBRARY = torch.library.Library("rlk", "DEF")  # noqa: the ops live as long as it does


def define(name: str, schema: str, kernel: Callable, fake: Callable,
           autograd_function: type[torch.autograd.Function] | None = None,
           differentiable: Callable | None = None):
  """Defines ``rlk::name`` with `kernel` for CPU and CUDA tensors, `fake`
  for meta/fake tensors, and, if given, `autograd_function` as its gradient
  (entered when `differentiable(*args)` says some input needs one).
  Returns the op's default overload."""
  LIBRARY.define(f"{name}{schema}")
  for key in ("CPU", "CUDA"):
    LIBRARY.impl(name, kernel, key)
  torch.library.register_fake(f"rlk::{name}", fake, lib=LIBRARY)
  op = getattr(torch.ops.rlk, name).default
  op._rlk_kernel = kernel
  if autograd_function is not None:
    def autograd_kernel(*args):
      if differentiable(*args):
        return autograd_function.apply(*args)
      return below_autograd(op, *args)
    LIBRARY.impl(name, autograd_kernel, "Autograd")
    op._rlk_autograd_kernel = autograd_kernel
  return op


def call(op, *args):
  """``op(*args)``. In eager mode it does what the dispatcher would (the
  op's Autograd kernel, then its device kernel: the same functions, the same
  kernels) without the trips through it; traced (torch.compile, export) it
  is a plain op call."""
  if torch.compiler.is_compiling():
    return op(*args)
  return op._rlk_autograd_kernel(*args)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def below_autograd(op, *args):
  """The op's device (or fake) kernel, past the dispatcher's autograd step:
  for calls that record no gradient (inside an autograd function, or with
  no input needing one). When nothing could observe the dispatcher (no
  torch-dispatch or torch-function mode, plain tensors, not tracing) the
  kernel is called straight from Python: about 20 us less per call on the
  H100's host, which is most of what a small product costs."""
  if (not torch._C._len_torch_dispatch_stack()
      and not torch._C._is_torch_function_mode_enabled()
      and not torch.compiler.is_compiling()
      and all(type(t) in _PLAIN for t in args if isinstance(t, torch.Tensor))):
    return op._rlk_kernel(*args)
  with torch._C._AutoDispatchBelowAutograd():
    return op(*args)


def sizes(t: torch.Tensor) -> tuple:
  """t's shape as ints. A symbolic size (torch.compile's dynamic shapes)
  reads as the size being traced, without a guard: an implementation is
  chosen for the traced sizes, as an eager call of them would choose."""
  return tuple(d if isinstance(d, int) else _hint(d) for d in t.shape)


def _hint(size: torch.SymInt) -> int:
  hint = getattr(size.node, "hint", None)  # the traced value (torch 2.4-2.13)
  return hint if isinstance(hint, int) else 1


def needs_grad(*tensors: torch.Tensor) -> bool:
  return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def first_args_need_grad(count: int) -> Callable:
  """`define`'s `differentiable` for ops whose gradients flow to their
  first `count` arguments (tensors) alone."""
  return lambda *args: needs_grad(*args[:count])
