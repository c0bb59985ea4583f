"""rlk_jax's ops as torch.autograd.Functions: the forward and the VJP both run
the JAX op (jit-compiled once per signature) on the tensors' own device."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import torch

import rlk_jax
from rlk_jax import _det_gemm, _pack, _validate
from rlk_torch_bridge import _cuda_pack, _packinfo, _sm90
from rlk_torch_bridge._dlpack import (check_same_device, check_tensor,
                                      jax_dtype, platform_of, to_jax,
                                      to_jax_all, to_torch, to_torch_all,
                                      torch_dtype)
from rlk_torch_bridge._packinfo import PackInfo


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
    out, ctx.vjp = _det_gemm_vjp(*to_jax_all(a, b, one_computation=True),
                                 out_dtype=out_dtype,
                                 implementation=implementation,
                                 transpose_b=transpose_b)
    return to_torch(out)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    da, db = _apply_vjp(ctx.vjp, to_jax(g))
    return (*to_torch_all(da, db), None, None, None)


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
    return to_torch(_det_gemm_forward(*to_jax_all(a, b, one_computation=True),
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
#
# One jitted JAX call per op: pack from a mask computes the PackInfo and
# packs in one executable and hands the info back as one buffer (see
# _packinfo); pack/unpack with an info read that buffer. The VJP of pack is
# unpack with fill 0 and the VJP of unpack is pack with fill 0: rlk_jax's own
# custom_vjp rule (the same row-gather kernel with the two index maps
# swapped), so the backward runs the opposite move.

_STATIC = ("capacity", "fill", "implementation")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _pack_from_mask(x, mask, *, capacity, fill, implementation):
  packed, info = rlk_jax.pack(x, mask, capacity=capacity, fill_value=fill,
                              implementation=implementation)
  return packed, _packinfo.info_to_bytes(info)


@functools.partial(jax.jit, static_argnames=("direction", "mask_shape",
                                             *_STATIC))
def _move(x, info_buffer, *, direction, mask_shape, capacity, fill,
          implementation):
  info = _packinfo.info_from_bytes(info_buffer, mask_shape, capacity)
  if direction == "pack":
    return rlk_jax.pack(x, info, fill_value=fill,
                        implementation=implementation)[0]
  return rlk_jax.unpack(x, info, fill_value=fill, implementation=implementation)


_OPPOSITE = {"pack": "unpack", "unpack": "pack"}


def _run_move(x, info: PackInfo, direction, fill, implementation):
  return to_torch(_move(to_jax(x), info.jax_buffer(), direction=direction,
                        mask_shape=info.mask_shape, capacity=info.capacity,
                        fill=fill, implementation=implementation))


class _MoveRows(torch.autograd.Function):
  """A move and, as its VJP, the opposite move with fill 0; `run(x, info,
  direction, fill)` is the route (the direct CUDA launch or the JAX call)."""

  @staticmethod
  def forward(ctx, x, info, direction, fill, run):
    ctx.info, ctx.direction, ctx.run = info, direction, run
    return run(x, info, direction, fill)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    return (ctx.run(g, ctx.info, _OPPOSITE[ctx.direction], 0),
            None, None, None, None)


def _run_pack_from_mask(x, mask, capacity, fill, implementation):
  packed, buffer = _pack_from_mask(*to_jax_all(x, mask, one_computation=True),
                                   capacity=capacity, fill=fill,
                                   implementation=implementation)
  packed_t, buffer_t = to_torch_all(packed, buffer)
  info = PackInfo.from_buffer(buffer_t, buffer, tuple(mask.shape), capacity)
  return packed_t, info


class _PackFromMask(torch.autograd.Function):
  """pack from a mask and, as its VJP, unpack with fill 0; `run_pack(x,
  mask, capacity, fill)` and `run_move` are the route's (direct or JAX)."""

  @staticmethod
  def forward(ctx, x, mask, capacity, fill, run_pack, run_move, info_out):
    packed, info = run_pack(x, mask, capacity, fill)
    ctx.info, ctx.run_move = info, run_move
    info_out.append(info)
    return packed

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    return (ctx.run_move(g, ctx.info, "unpack", 0),
            None, None, None, None, None, None)


def _as_int32_words(op, x, fill_value):
  """8-byte rows move as int32 pairs (a view): JAX without x64 would narrow
  them on import, and rows only move, so every bit is kept."""
  if x.requires_grad:
    raise TypeError(f"rlk_torch_bridge.{op}: {x.dtype} with requires_grad "
                    "needs JAX's x64 mode; use float32 or detach.")
  if fill_value != 0:
    raise ValueError(f"rlk_torch_bridge.{op}: fill_value must be 0 for "
                     f"{x.dtype} (its bytes move as int32 pairs).")
  return x.contiguous().unsqueeze(-1).view(torch.int32)


def _needs_grad(x):
  return (torch.is_grad_enabled() and x.requires_grad
          and x.dtype.is_floating_point)


def _checked_fill(op, x, fill_value):
  """rlk_jax's dtype and fill checks (the same messages)."""
  dtype = _validate.check_packable_dtype(op, "x" if op == "pack" else "packed",
                                         jax_dtype(x.dtype))
  return _validate.static_fill(op, "fill_value", fill_value, dtype)


def _move_rows(op, x, info, fill_value, impl):
  """Rows of `x` moved with `info`: the direct CUDA launch for cuda_ffi on a
  GPU, else one jitted JAX call through DLPack."""
  direct = impl == "cuda_ffi" and x.is_cuda
  run = (_cuda_pack.move if direct
         else functools.partial(_run_move, implementation=impl))
  dtype, words = x.dtype, x.element_size() == 8 and not direct
  if words:
    x = _as_int32_words(op, x, fill_value)
  if _needs_grad(x):
    out = _MoveRows.apply(x, info, op, fill_value, run)
  else:
    out = run(x, info, op, fill_value)
  return out.view(dtype).squeeze(-1) if words else out


def pack(x: torch.Tensor, mask_or_info, capacity: int | None = None,
         fill_value=0, implementation: str | None = None):
  """``rlk_jax.pack`` for torch: ``(packed [capacity, *tail], PackInfo)``.

  `mask_or_info` is a mask tensor (on x's device) or a :class:`PackInfo`
  from an earlier call, reused as is. Gradients flow to `x` (floating dtypes).
  On SM90 GPUs (implementation ``"cuda_ffi"``, the default there) the CUDA
  kernels run on torch's stream with no JAX call; elsewhere one jitted JAX
  call through DLPack. With ``capacity < mask.numel()`` the overflow check
  reads the active count back to the host (one sync), as rlk_jax.pack does
  with a concrete mask; the default capacity never syncs.
  """
  check_tensor("pack", "x", x)
  impl = rlk_jax.selected_implementation("pack", implementation,
                                         platform=platform_of(x))
  if isinstance(mask_or_info, PackInfo):
    info = mask_or_info
    _pack.check_reused_capacity("rlk_torch_bridge.pack", capacity, info.capacity)
    mask_shape = info.mask_shape
  else:
    mask = mask_or_info
    check_tensor("pack", "mask", mask)
    check_same_device("pack", x=x, mask=mask)
    _validate.check_mask_dtype("pack", jax_dtype(mask.dtype))
    mask_shape = tuple(mask.shape)
    capacity = _validate.static_capacity("pack", capacity, mask.numel())
  if tuple(x.shape[:len(mask_shape)]) != tuple(mask_shape):
    raise ValueError(f"rlk_torch_bridge.pack: mask shape {tuple(mask_shape)} "
                     f"must be a prefix of x's shape {tuple(x.shape)}.")
  fill = _checked_fill("pack", x, fill_value)
  if isinstance(mask_or_info, PackInfo):
    return _move_rows("pack", x, info, fill, impl), info
  if capacity < mask.numel():
    _pack.check_fits("rlk_torch_bridge.pack", mask_shape,
                     int(torch.count_nonzero(mask)), capacity)
  direct = impl == "cuda_ffi" and x.is_cuda
  if direct:
    run_pack, run_move = _cuda_pack.pack_from_mask, _cuda_pack.move
  else:
    run_pack = functools.partial(_run_pack_from_mask, implementation=impl)
    run_move = functools.partial(_run_move, implementation=impl)
  dtype, words = x.dtype, x.element_size() == 8 and not direct
  if words:
    x = _as_int32_words("pack", x, fill)
  if _needs_grad(x):
    info_out = []
    packed = _PackFromMask.apply(x, mask, capacity, fill, run_pack, run_move,
                                 info_out)
    info = info_out[0]
  else:
    packed, info = run_pack(x, mask, capacity, fill)
  return (packed.view(dtype).squeeze(-1) if words else packed), info


def unpack(packed: torch.Tensor, info: PackInfo, fill_value=0,
           implementation: str | None = None) -> torch.Tensor:
  """``rlk_jax.unpack`` for torch: packed rows back to ``[*mask_shape, *tail]``."""
  check_tensor("unpack", "packed", packed)
  if not isinstance(info, PackInfo):
    raise TypeError("rlk_torch_bridge.unpack: info must be the PackInfo "
                    f"returned by rlk_torch_bridge.pack, got {type(info).__name__}.")
  if packed.ndim < 1 or packed.shape[0] != info.capacity:
    raise ValueError(f"rlk_torch_bridge.unpack: packed has shape "
                     f"{tuple(packed.shape)}; its first axis must be the "
                     f"capacity {info.capacity}.")
  impl = rlk_jax.selected_implementation("pack", implementation,
                                         platform=platform_of(packed))
  return _move_rows("unpack", packed, info, _checked_fill("unpack", packed,
                                                          fill_value), impl)
