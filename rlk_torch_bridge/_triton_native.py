"""det_gemm's Triton route from torch: the ``@triton.jit`` kernel JAX
launches through jax-triton, launched by Triton itself on torch's current
stream (one kernel source and specialization, so the same bits, and no
DLPack)."""

from __future__ import annotations

import functools

import torch

from rlk_jax import _gemm_tuning
from rlk_torch_bridge._checks import jax_dtype
from rlk_torch_bridge._torch_stream import on_device_of
from triton_kernels import det_matmul


@functools.lru_cache(maxsize=1024)
def tile_config(m: int, n: int, k: int, transpose_a: bool, transpose_b: bool,
                dtype: torch.dtype, device: str | None = None):
  """The Triton det_matmul tile config rlk_jax's tuning names for a product
  (`device`: the table's device name; None asks JAX's GPU)."""
  return _gemm_tuning.choose_pallas_config(
      m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
      dtype=jax_dtype(dtype), device=device)


def product(m: int, n: int, k: int, transpose_a: bool, transpose_b: bool,
            dtype: torch.dtype, out_dtype: torch.dtype):
  """``product(a, b) -> op(a) @ op(b)`` for one signature (a and b 2-D, on
  a's device), on the config rlk_jax's tuning names for it."""
  config = tile_config(m, n, k, transpose_a, transpose_b, dtype)

  @on_device_of
  def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    det_matmul.matmul_torch(a.contiguous(), b.contiguous(), out,
                            transpose_a=transpose_a, transpose_b=transpose_b,
                            config=config)
    return out
  return run


def chunked_product(m: int, n: int, k: int, transpose_a: bool,
                    transpose_b: bool, dtype: torch.dtype,
                    out_dtype: torch.dtype, chunks: int):
  """``run(a, b)``: the tensor-parallel mode's subtree of `chunks` equal K
  chunks of ``op(a) @ op(b)`` (``_tree_reduction``'s order) in two launches,
  every chunk's product then the tree, on the config rlk_jax's tuning names
  for the fused launch (the bits of one det_matmul per chunk)."""
  config = _gemm_tuning.choose_chunked_config(
      m, n, k // chunks, transpose_a=transpose_a, transpose_b=transpose_b,
      dtype=jax_dtype(dtype))

  launch = det_matmul.chunked_matmul_plan(
      m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
      chunks=chunks, config=config)

  @on_device_of
  def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    partials = torch.empty((chunks, m, n), dtype=torch.float32,
                           device=a.device)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    launch(a.contiguous(), b.contiguous(), partials, out)
    return out
  return run
