"""``rlk::pack`` and ``rlk::move_rows``: rlk_jax's pack, and the row moves
made with a PackInfo, as PyTorch operators.

``pack(x, mask, capacity, fill, checked, implementation) -> (packed, info)``
computes the PackInfo (as one uint8 buffer, see ``_packinfo``) and packs;
``move_rows(x, info, mask_shape, capacity, to_packed, fill, implementation)``
packs with a given info or unpacks. The VJP of a move is the opposite move
with fill 0 (rlk_jax's own rule: the same row gather with the two index maps
swapped). On an SM90 GPU ``cuda_ffi`` runs the CUDA kernels on torch's
stream (capturable in CUDA graphs); every other implementation runs one
jitted JAX call through DLPack.
"""

from __future__ import annotations

import functools

import jax
import torch

import rlk_jax
from rlk_jax import _pack
from rlk_torch_bridge import _cuda_pack, _dlpack, _library, _packinfo
from rlk_torch_bridge._checks import platform_of

PACK_SCHEMA = ("(Tensor x, Tensor mask, int capacity, Scalar fill, "
               "bool checked, str? implementation) -> (Tensor, Tensor)")
MOVE_SCHEMA = ("(Tensor x, Tensor info, int[] mask_shape, int capacity, "
               "bool to_packed, Scalar fill, str? implementation) -> Tensor")


@functools.lru_cache(maxsize=None)
def choose(implementation: str | None, platform: str) -> str:
  return rlk_jax.selected_implementation("pack", implementation,
                                         platform=platform)


# ---------------------------------------------------------------------------
# The JAX route: one jitted call per op.

_STATIC = ("capacity", "fill", "implementation")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _jax_pack(x, mask, *, capacity, fill, implementation):
  packed, info = rlk_jax.pack(x, mask, capacity=capacity, fill_value=fill,
                              implementation=implementation)
  return packed, _packinfo.info_to_bytes(info)


@functools.partial(jax.jit, static_argnames=("to_packed", "mask_shape",
                                             *_STATIC))
def _jax_move(x, info_buffer, *, to_packed, mask_shape, capacity, fill,
              implementation):
  info = _packinfo.info_from_bytes(info_buffer, mask_shape, capacity)
  if to_packed:
    return rlk_jax.pack(x, info, fill_value=fill,
                        implementation=implementation)[0]
  return rlk_jax.unpack(x, info, fill_value=fill, implementation=implementation)


def _words(x: torch.Tensor) -> torch.Tensor:
  """8-byte rows as int32 pairs (a view): JAX without x64 would narrow them
  on import, and rows only move, so every bit is kept."""
  return x.contiguous().unsqueeze(-1).view(torch.int32)


def _from_words(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
  return out.view(dtype).squeeze(-1)


def _wide(x: torch.Tensor) -> bool:
  return x.element_size() == 8 and not jax.config.jax_enable_x64


def _filled(out, keep_rows, fill):
  """`out` with the rows where `keep_rows` is False set to `fill` (8-byte
  rows moved as words were filled with 0)."""
  if fill == 0:
    return out
  keep = keep_rows.reshape(*keep_rows.shape, *([1] * (out.ndim - keep_rows.ndim)))
  return torch.where(keep, out, torch.full((), fill, dtype=out.dtype,
                                            device=out.device))


# ---------------------------------------------------------------------------
# rlk::pack


def _pack_kernel(x, mask, capacity, fill, checked, implementation):
  impl = choose(implementation, platform_of(x))
  mask_shape = tuple(mask.shape)
  if checked and capacity < mask.numel():
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
      raise RuntimeError(
          f"rlk_torch_bridge.pack: capacity {capacity} < mask.numel() "
          f"{mask.numel()} needs the overflow check, which reads the active "
          "count back to the host and cannot run inside a CUDA graph capture;"
          " pass checked=False and read info.num_dropped.")
    _pack.check_fits("rlk_torch_bridge.pack", mask_shape,
                     int(torch.count_nonzero(mask)), capacity)
  if impl == "cuda_ffi" and x.is_cuda:
    return _cuda_pack.pack_from_mask(x, mask, capacity, fill)
  wide = _wide(x)
  src = _words(x) if wide else x
  packed, info = _dlpack.through_jax(
      "pack", impl, functools.partial(
          _jax_pack, capacity=capacity, fill=0 if wide else fill,
          implementation=impl), src, mask)
  if wide:
    valid = _packinfo.PackInfo(info, mask_shape, capacity).valid
    packed = _filled(_from_words(packed, x.dtype), valid, fill)
  return packed, info


def _pack_fake(x, mask, capacity, fill, checked, implementation):
  tail = tuple(x.shape[mask.ndim:])
  nbytes = _packinfo.layout(tuple(mask.shape), capacity)[1]
  return (x.new_empty((capacity, *tail)),
          x.new_empty((nbytes,), dtype=torch.uint8))


class Pack(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x, mask, capacity, fill, checked, implementation):
    impl = choose(implementation, platform_of(x))
    packed, info = _library.below_autograd(PACK, x, mask, capacity, fill,
                                           checked, impl)
    ctx.mark_non_differentiable(info)
    ctx.save_for_backward(info)
    ctx.move = (tuple(mask.shape), capacity, impl)
    return packed, info

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g, _):
    info, = ctx.saved_tensors
    mask_shape, capacity, impl = ctx.move
    dx = _library.below_autograd(MOVE, g, info, list(mask_shape), capacity,
                                 False, 0, impl)
    return dx, None, None, None, None, None


# ---------------------------------------------------------------------------
# rlk::move_rows


def _move_kernel(x, info, mask_shape, capacity, to_packed, fill,
                 implementation):
  impl = choose(implementation, platform_of(x))
  mask_shape = tuple(mask_shape)
  if impl == "cuda_ffi" and x.is_cuda:
    return _cuda_pack.move(x, info, mask_shape, capacity, to_packed, fill)
  wide = _wide(x)
  out, = _dlpack.through_jax(
      "pack" if to_packed else "unpack", impl, functools.partial(
          _jax_move, to_packed=to_packed, mask_shape=mask_shape,
          capacity=capacity, fill=0 if wide else fill, implementation=impl),
      _words(x) if wide else x, info)
  if not wide:
    return out
  fields = _packinfo.PackInfo(info, mask_shape, capacity)
  keep = fields.valid if to_packed else fields.scatter_map >= 0
  return _filled(_from_words(out, x.dtype), keep, fill)


def _move_fake(x, info, mask_shape, capacity, to_packed, fill, implementation):
  if to_packed:
    return x.new_empty((capacity, *x.shape[len(mask_shape):]))
  return x.new_empty((*mask_shape, *x.shape[1:]))


class MoveRows(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x, info, mask_shape, capacity, to_packed, fill,
              implementation):
    impl = choose(implementation, platform_of(x))
    ctx.save_for_backward(info)
    ctx.move = (list(mask_shape), capacity, not to_packed, impl)
    return _library.below_autograd(MOVE, x, info, mask_shape, capacity,
                                   to_packed, fill, impl)

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g):
    info, = ctx.saved_tensors
    mask_shape, capacity, opposite, impl = ctx.move
    dx = _library.below_autograd(MOVE, g, info, mask_shape, capacity,
                                 opposite, 0, impl)
    return dx, None, None, None, None, None, None


def _differentiable(x, *_):
  return _library.needs_grad(x) and x.dtype.is_floating_point


PACK = _library.define("pack", PACK_SCHEMA, _pack_kernel, _pack_fake, Pack,
                       _differentiable)
MOVE = _library.define("move_rows", MOVE_SCHEMA, _move_kernel, _move_fake,
                       MoveRows, _differentiable)

