"""The public det_gemm, pack and unpack for torch tensors: argument checks
and the call of the ``rlk::`` operator (see ``_gemm_op``, ``_pack_op``), so
eager code, torch.compile, torch.export and CUDA graphs run the same
kernels and get the same bits."""

from __future__ import annotations

import torch

from rlk_jax import _pack, _validate
from rlk_torch_bridge import _gemm_op, _library, _pack_op, _tree_gemm
from rlk_torch_bridge._checks import check_same_device, check_tensor, jax_dtype
from rlk_torch_bridge._packinfo import PackInfo

__all__ = ["PackInfo", "det_gemm", "pack", "unpack"]


def det_gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype=None,
             implementation: str | None = None,
             transpose_b: bool = False,
             reduction_chunks: int | None = None) -> torch.Tensor:
  """``rlk_jax.det_gemm`` for torch tensors: the same kernel, the same bits.

  ``a`` is ``[..., K]``; ``b`` is ``[K, N]``, or ``[N, K]``
  (``nn.Linear.weight``) with ``transpose_b=True``. `implementation` None
  picks, like rlk_jax, the best one for the tensors' device and operands;
  pin it to match a JAX rollout exactly. Runs as the operator
  ``torch.ops.rlk.det_mm``. `reduction_chunks`: rlk_jax's
  tensor-parallel-invariant mode (the reduction in C chunks summed in one
  fixed tree; ``RowParallelDetLinear``/``ColumnParallelDetLinear`` split it
  over a process group with the same bits).
  """
  check_tensor("det_gemm", "a", a)
  check_tensor("det_gemm", "b", b)
  check_same_device("det_gemm", a=a, b=b)
  out_dtype = a.dtype if out_dtype is None else out_dtype
  if reduction_chunks is not None:
    return _tree_gemm.tree_gemm(a, b, transpose_b=transpose_b,
                                out_dtype=out_dtype,
                                implementation=implementation,
                                chunks=reduction_chunks)
  return _gemm_op.det_mm(a, b, transpose_b, out_dtype, implementation)


def _checked_fill(op, x, fill_value):
  """rlk_jax's dtype and fill checks (the same messages). Traced by
  torch.compile the fill goes to the operator as given: these checks run
  on JAX's dtypes, which the tracer does not follow."""
  if torch.compiler.is_compiling():
    return fill_value
  dtype = _validate.check_packable_dtype(op, "x" if op == "pack" else "packed",
                                         jax_dtype(x.dtype))
  return _validate.static_fill(op, "fill_value", fill_value, dtype)


def pack(x: torch.Tensor, mask_or_info, capacity: int | None = None,
         fill_value=0, implementation: str | None = None,
         checked: bool = True):
  """``rlk_jax.pack`` for torch: ``(packed [capacity, *tail], PackInfo)``.

  `mask_or_info` is a mask tensor (on x's device) or a :class:`PackInfo`
  from an earlier call, reused as is. Gradients flow to `x` (floating
  dtypes). On SM90 GPUs (implementation ``"cuda_ffi"``, the default there)
  the CUDA kernels run on torch's stream; elsewhere one jitted JAX call
  through DLPack. With ``capacity < mask.numel()`` the overflow check reads
  the active count back to the host (one sync) and raises if rows would be
  dropped; ``checked=False`` skips it (then read ``info.num_dropped``), as
  a CUDA graph capture needs. The default capacity never syncs.
  """
  check_tensor("pack", "x", x)
  fill = _checked_fill("pack", x, fill_value)
  if isinstance(mask_or_info, PackInfo):
    info = mask_or_info
    _pack.check_reused_capacity("rlk_torch_bridge.pack", capacity, info.capacity)
    _check_prefix(x, info.mask_shape)
    return _library.call(_pack_op.MOVE, x, info.buffer, list(info.mask_shape),
                         info.capacity, True, fill, implementation), info
  mask = mask_or_info
  check_tensor("pack", "mask", mask)
  check_same_device("pack", x=x, mask=mask)
  _check_prefix(x, mask.shape)
  if torch.compiler.is_compiling():
    capacity = mask.numel() if capacity is None else capacity
  else:
    _validate.check_mask_dtype("pack", jax_dtype(mask.dtype))
    capacity = _validate.static_capacity("pack", capacity, mask.numel())
  packed, buffer = _library.call(_pack_op.PACK, x, mask, capacity, fill,
                                 checked, implementation)
  return packed, PackInfo(buffer, tuple(mask.shape), capacity)


def _check_prefix(x, mask_shape):
  if tuple(x.shape[:len(mask_shape)]) != tuple(mask_shape):
    raise ValueError(f"rlk_torch_bridge.pack: mask shape {tuple(mask_shape)} "
                     f"must be a prefix of x's shape {tuple(x.shape)}.")


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
  fill = _checked_fill("unpack", packed, fill_value)
  return _library.call(_pack_op.MOVE, packed, info.buffer, list(info.mask_shape),
                       info.capacity, False, fill, implementation)
