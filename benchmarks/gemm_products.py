"""The products a det_gemm sweep times, shared by the sweep and the
cuBLASLt recipe's child processes: each layout's GEMM, the torch routes
that run it, and how many operand sets and calls a timed sample takes."""

from __future__ import annotations

import math

from absl import flags

BENCH = "det_gemm_sweep"

SAMPLE_MS = flags.DEFINE_float(
    "sweep_sample_ms", 10.0, "Milliseconds of work (at cuBLAS's pace) per "
    "timed batch. 10 reads one kernel alike through every route; with "
    "--sweep_kernel_times on small products, 1 is enough for the kernel "
    "time and spares the host's dispatch of ten times as many jitted "
    "programs (0.1-0.5 ms each on the H100).")


def layout_product(layout: str, m: int, k: int, n: int):
  """(transpose_a, transpose_b, rows, cols, reduction) of the GEMM a layout
  runs, and the stored operand shapes."""
  if layout == "fwd":  # A [M, K] @ W [K, N]
    return False, False, (m, k), (k, n), (m, n, k)
  if layout == "dA":  # G [M, N] @ (W [K, N])^T
    return False, True, (m, n), (k, n), (m, k, n)
  if layout == "dB":  # (A [M, K])^T @ G [M, N]
    return True, False, (m, k), (m, n), (k, n, m)
  raise ValueError(layout)


def torch_product(torch, ta, tb):
  def product(x, y):
    return torch.matmul(x.T if ta else x, y.T if tb else y)
  return product


def rlk_torch_product(torch, ta, tb):
  op = torch.ops.rlk.det_mm
  return lambda x, y: op(x, y, ta, tb, torch.bfloat16, "cuda_ffi")


def timing_plan(x_shape, y_shape, flops: int, out_elems: int = 0
                ) -> tuple[int, int]:
  """(operand sets, calls per sample) for one product: distinct sets so
  repeats do not re-read a warm L2 (50 MB on the H100: enough sets to pass
  256 MB, at most 32, so a decode row reads its weight from HBM as a
  decode step's layers do), and --sweep_sample_ms of work per sample at
  cuBLAS's pace (700 TFLOP/s, or 3 TB/s where the bytes take longer),
  never fewer than one call. 10 ms, because one SM90 kernel then timed the
  same through jitted JAX and through a torch CUDA-graph replay (1.004x
  over 8 products; with 2 ms samples the jitted route read 5% faster: the
  power-capped card runs faster after the longer pause its dispatch
  leaves; H100, 2026-11-24)."""
  bytes_per_set = 2 * (math.prod(x_shape) + math.prod(y_shape))
  n_sets = max(1, min(32, -(-(256 << 20) // max(bytes_per_set, 1))))
  call_s = max(flops / 700e12, (bytes_per_set + 2 * out_elems) / 3e12, 2e-6)
  sample_s = SAMPLE_MS.value / 1e3
  return n_sets, max(1, round(sample_s / (call_s * n_sets)))


def torch_operand_sets(torch, x_shape, y_shape, flops: int, out_elems: int,
                       gen) -> tuple[list, int]:
  """timing_plan's operand sets as bf16 torch tensors drawn from `gen`
  (normal values), and its calls per sample."""
  n_sets, iters = timing_plan(x_shape, y_shape, flops, out_elems)
  sets = [(torch.randn(x_shape, device="cuda", generator=gen).bfloat16(),
           torch.randn(y_shape, device="cuda", generator=gen).bfloat16())
          for _ in range(n_sets)]
  return sets, iters
