"""rlk_jax's ops as torch.autograd.Functions: the forward and the VJP both run
the JAX op (jit-compiled once per signature) on the tensors' own device."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import torch

import rlk_jax
from rlk_jax import _det_gemm, _pack
from rlk_torch_bridge import _sm90
from rlk_torch_bridge._dlpack import (check_same_device, check_tensor,
                                      jax_dtype, platform_of, to_jax, to_torch,
                                      torch_dtype)


@jax.jit
def _apply_vjp(vjp, g):
  return vjp(g)


# ----------------------------------------------------------------------------
# det_gemm


@functools.partial(jax.jit, static_argnames=("out_dtype", "implementation",
                                             "transpose_b"))
def _det_gemm_vjp(a, b, *, out_dtype, implementation, transpose_b):
  return jax.vjp(functools.partial(
      rlk_jax.det_gemm, out_dtype=out_dtype, implementation=implementation,
      transpose_b=transpose_b), a, b)


_det_gemm_forward = jax.jit(rlk_jax.det_gemm, static_argnames=(
    "out_dtype", "implementation", "transpose_b"))


class _DetGemm(torch.autograd.Function):

  @staticmethod
  def forward(ctx, a, b, out_dtype, implementation, transpose_b):
    out, ctx.vjp = _det_gemm_vjp(to_jax(a), to_jax(b), out_dtype=out_dtype,
                                 implementation=implementation,
                                 transpose_b=transpose_b)
    return to_torch(out)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    da, db = _apply_vjp(ctx.vjp, to_jax(g))
    return to_torch(da), to_torch(db), None, None, None


def det_gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype=None,
             implementation: str | None = None,
             transpose_b: bool = False) -> torch.Tensor:
  """``rlk_jax.det_gemm`` for torch tensors: the same kernel, the same bits.

  ``b`` is ``[K, N]``, or ``[N, K]`` (``nn.Linear.weight``) with
  ``transpose_b=True``. `implementation` None picks, like rlk_jax, the best
  one for the tensors' device; pin it to match a JAX rollout exactly.
  """
  check_tensor("det_gemm", "a", a)
  check_tensor("det_gemm", "b", b)
  check_same_device("det_gemm", a=a, b=b)
  # rlk_jax checks the call and picks the kernel: the same errors, the same
  # choice as a JAX caller with these shapes and dtypes.
  call = _det_gemm.plan(_spec(a), _spec(b), out_dtype=jax_dtype(out_dtype),
                        implementation=implementation, transpose_b=transpose_b,
                        platform=platform_of(a))
  if call.implementation == "cuda_ffi":
    return _sm90.det_gemm(a, b, torch_dtype(call.out_dtype), transpose_b,
                          call.m, call.n, call.k)
  impl = call.implementation
  if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
    # Inference: no VJP residuals to build or keep.
    return to_torch(_det_gemm_forward(to_jax(a), to_jax(b),
                                      out_dtype=jax_dtype(out_dtype),
                                      implementation=impl,
                                      transpose_b=transpose_b))
  return _DetGemm.apply(a, b, jax_dtype(out_dtype), impl, transpose_b)


class _Spec(NamedTuple):
  """Shape and JAX dtype of a tensor: all rlk_jax's checks need."""
  shape: tuple
  dtype: object


def _spec(t: torch.Tensor) -> _Spec:
  return _Spec(tuple(t.shape), jax_dtype(t.dtype))


# ----------------------------------------------------------------------------
# pack / unpack

_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(rlk_jax.PackInfo)
                     if f.name not in ("mask_shape", "capacity"))


@dataclasses.dataclass
class PackInfo:
  """The torch side of ``rlk_jax.PackInfo``: the same fields, as tensors
  (cu_seqlens, seq_lens, total, max_seqlen, num_dropped, segment_ids,
  positions, valid, gather_map, scatter_map), plus ``mask_shape`` and
  ``capacity``. Reusable: ``pack(y, info)`` packs another tensor with it.

  The tensors are zero-copy views of the JAX arrays the pack computed; the
  JAX PackInfo itself is kept and handed back to later calls (no DLPack
  imports per reuse) as long as the fields are the same tensor objects.
  Treat the fields as read-only: they alias JAX's buffers."""
  cu_seqlens: torch.Tensor
  seq_lens: torch.Tensor
  total: torch.Tensor
  max_seqlen: torch.Tensor
  num_dropped: torch.Tensor
  segment_ids: torch.Tensor
  positions: torch.Tensor
  valid: torch.Tensor
  gather_map: torch.Tensor
  scatter_map: torch.Tensor
  mask_shape: tuple
  capacity: int
  # (the field tensors' ids, the JAX PackInfo they view)
  _jax: tuple | None = dataclasses.field(default=None, repr=False,
                                         compare=False)

  @classmethod
  def from_jax(cls, info) -> "PackInfo":
    torch_info = cls(**{f: to_torch(getattr(info, f)) for f in _INFO_FIELDS},
                     mask_shape=info.mask_shape, capacity=info.capacity)
    torch_info._jax = (torch_info._field_ids(), info)
    return torch_info

  def _field_ids(self) -> tuple:
    return tuple(id(getattr(self, f)) for f in _INFO_FIELDS)

  def to_jax(self):
    if self._jax is not None and self._jax[0] == self._field_ids():
      return self._jax[1]
    return rlk_jax.PackInfo(**{f: to_jax(getattr(self, f)) for f in _INFO_FIELDS},
                            mask_shape=tuple(self.mask_shape),
                            capacity=self.capacity)


def _move(direction, x, info, fill, implementation):
  if direction == "pack":
    return rlk_jax.pack(x, info, fill_value=fill, implementation=implementation)[0]
  return rlk_jax.unpack(x, info, fill_value=fill, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("direction", "fill", "implementation"))
def _move_vjp(x, info, *, direction, fill, implementation):
  return jax.vjp(lambda x: _move(direction, x, info, fill, implementation), x)


@functools.partial(jax.jit, static_argnames=("direction", "fill", "implementation"))
def _move_no_grad(x, info, *, direction, fill, implementation):
  return _move(direction, x, info, fill, implementation)


class _MoveRows(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x, info, direction, fill, implementation, needs_grad):
    # Grad mode is off inside forward: the caller decides `needs_grad`.
    kwargs = dict(direction=direction, fill=fill, implementation=implementation)
    if needs_grad:
      out, ctx.vjp = _move_vjp(to_jax(x), info, **kwargs)
    else:
      out = _move_no_grad(to_jax(x), info, **kwargs)
    return to_torch(out)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    dx, = _apply_vjp(ctx.vjp, to_jax(g))
    return to_torch(dx), None, None, None, None, None


def _move_rows(op, direction, x, info: PackInfo, fill_value, implementation):
  impl = rlk_jax.selected_implementation("pack", implementation,
                                         platform=platform_of(x))
  if x.element_size() == 8:
    # JAX without x64 narrows 8-byte dtypes on import; rows only move, so
    # move their bytes as int32 pairs (a view) and keep every bit.
    if x.requires_grad:
      raise TypeError(f"rlk_torch_bridge.{op}: {x.dtype} with requires_grad "
                      "needs JAX's x64 mode; use float32 or detach.")
    words = x.contiguous().unsqueeze(-1).view(torch.int32)
    if fill_value != 0:
      raise ValueError(f"rlk_torch_bridge.{op}: fill_value must be 0 for "
                       f"{x.dtype} (its bytes move as int32 pairs).")
    out = _MoveRows.apply(words, info.to_jax(), direction, 0, impl, False)
    return out.view(x.dtype).squeeze(-1)
  needs_grad = (torch.is_grad_enabled() and x.requires_grad
                and x.dtype.is_floating_point)
  return _MoveRows.apply(x, info.to_jax(), direction, fill_value, impl,
                         needs_grad)


def pack(x: torch.Tensor, mask_or_info, capacity: int | None = None,
         fill_value=0, implementation: str | None = None):
  """``rlk_jax.pack`` for torch: ``(packed [capacity, *tail], PackInfo)``.

  `mask_or_info` is a mask tensor (on x's device) or a :class:`PackInfo`
  from an earlier call, reused as is. Gradients flow to `x` (floating dtypes).
  """
  check_tensor("pack", "x", x)
  if isinstance(mask_or_info, PackInfo):
    info = mask_or_info
    _pack.check_reused_capacity("rlk_torch_bridge.pack", capacity, info.capacity)
  else:
    check_tensor("pack", "mask", mask_or_info)
    check_same_device("pack", x=x, mask=mask_or_info)
    info = PackInfo.from_jax(rlk_jax.pack_info(to_jax(mask_or_info),
                                               capacity=capacity))
  if tuple(x.shape[:len(info.mask_shape)]) != tuple(info.mask_shape):
    raise ValueError(f"rlk_torch_bridge.pack: mask shape {tuple(info.mask_shape)} "
                     f"must be a prefix of x's shape {tuple(x.shape)}.")
  return _move_rows("pack", "pack", x, info, fill_value, implementation), info


def unpack(packed: torch.Tensor, info: PackInfo, fill_value=0,
           implementation: str | None = None) -> torch.Tensor:
  """``rlk_jax.unpack`` for torch: packed rows back to ``[*mask_shape, *tail]``."""
  check_tensor("unpack", "packed", packed)
  if not isinstance(info, PackInfo):
    raise TypeError("rlk_torch_bridge.unpack: info must be the PackInfo "
                    f"returned by rlk_torch_bridge.pack, got {type(info).__name__}.")
  return _move_rows("unpack", "unpack", packed, info, fill_value, implementation)
