"""det_gemm against cuBLAS and XLA's dot, forward and backward.

    python -m benchmarks.bench_det_gemm [--smoke] [--csv out.csv] [--gemm_sweep]

Competitors (stable names): ``cublas`` (torch.matmul, bf16, TF32 off, on
torch-native copies of the operands, replayed from a CUDA graph), ``xla_dot`` (``jnp.dot``, bf16
out), ``rlk_<impl>`` for each available rlk implementation (jitted JAX
programs), ``rlk_cuda_ffi_torch`` (the cuda_ffi kernels through the torch
bridge, replayed from a CUDA graph as cuBLAS is) and, for decode rows,
``cublas_eager`` (torch.matmul in a plain loop, host-bound); backward:
``cublas_pair`` (torch's ``g @ b.T`` and ``a.T @ g``, the same way), ``xla_dot_vjp`` and
``rlk_<impl>_vjp`` (dA and dB). The competitors of a case are timed in
interleaved rounds. The note gives each rlk figure as a fraction of cuBLAS's
TFLOP/s (backward: time over the cuBLAS pair's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import app, flags

import rlk_jax
from benchmarks import harness
from benchmarks.harness import Row

SWEEP = flags.DEFINE_bool(
    "gemm_sweep", False, "Also time every SM90 instantiation and tile order "
    "(swizzle x raster) on the M=4096 shapes (implementation names "
    "`sweep <config> swizzle=S raster=R`), and the pallas tile configs of "
    "PALLAS_SWEEP on every shape (`sweep pallas <config>`, the note says "
    "whether its bits equal the default config's).")

BENCH = "det_gemm"
# Decode products take microseconds: a jitted call runs this many, each with
# its own A and its own weight (a decode step's layers do not share weights;
# one shared weight would also stay in L2 and let XLA merge the dots into
# one), so one host dispatch is spread thin and the figure is device time,
# as cuBLAS's is in the torch loop.
DECODE_SETS = 16
# The M=4096 products: each jitted program runs enough calls (each with its
# own A, one shared weight) to last about PROGRAM_MS at cuBLAS's pace, and at
# least MIN_BIG_SETS. A jitted execution leaves the GPU idle 20-70 us beyond
# its kernels on the H100 (the CUPTI trace of lab/profile_jit_kernels.py);
# cuBLAS in the torch loop pays no such cost, so with 2 calls a program, as
# once, XLA and rlk carried ~10-20 us of it per 190-290 us product.
MIN_BIG_SETS = 8
PROGRAM_MS = 4.0
CUBLAS_TFLOPS = 700.0  # the H100's, to size programs only


def _big_sets(flops: int) -> int:
  return max(MIN_BIG_SETS, -(-int(PROGRAM_MS * CUBLAS_TFLOPS * 1e9) // flops))


def _cases(smoke: bool):
  if smoke:
    return ([("qkv", 128, 256, 384), ("down", 128, 512, 256)],
            [("decode", m, 256, 256) for m in (1, 16)])
  shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
            "down": (14336, 4096), "lm_head": (4096, 128256)}
  big = [(name, 4096, k, n) for name, (k, n) in shapes.items()]
  decode = [(f"decode_{k}x{n}", m, k, n) for k, n in ((4096, 4096), (4096, 14336))
            for m in (1, 16, 64)]
  return big, decode


def _torch_copies(torch, arg_sets):
  """cuBLAS's operands as torch-native tensors, shared ones shared again.

  The strongest baseline torch offers: on the H100, torch.matmul ran 3-10%
  slower on DLPack views of JAX's buffers than on torch's own copies
  (lab/check_cublas_baseline.py), and replaying the calls from a CUDA
  graph (as XLA's command buffers replay ours) took up to another 4%
  (decode products: 20-35%, where a torch loop measures the host).
  """
  copies = {}

  def copy(x):
    if id(x) not in copies:
      copies[id(x)] = torch.from_dlpack(x).clone()
    return copies[id(x)]

  return [tuple(map(copy, args)) for args in arg_sets]


def _rlk_impls():
  return [n for n, why in rlk_jax.implementations("det_gemm").items()
          if why is None]


def run(smoke: bool) -> list[Row]:
  big, decode = _cases(smoke)
  rows = []
  torch = harness.torch_or_none()
  for name, m, k, n in big + decode:
    is_big = (name, m, k, n) in big
    sets = ((2 if smoke else _big_sets(2 * m * k * n)) if is_big
            else DECODE_SETS)
    keys = jax.random.split(jax.random.key(m * 7 + k + n), 2 * sets)
    a_sets = [jax.random.normal(kk, (m, k), jnp.float32).astype(jnp.bfloat16)
              for kk in keys[:sets]]
    # The M=4096 products share one weight (distinct A already defeats L2).
    b_sets = [jax.random.normal(kk, (k, n), jnp.float32).astype(jnp.bfloat16)
              for kk in keys[sets:sets + (1 if is_big else sets)]]
    pairs = list(zip(a_sets, b_sets * sets if is_big else b_sets))
    b = b_sets[0]
    flops = 2 * m * k * n
    case = f"{name} M={m} K={k} N={n} bf16"
    impls = [i for i in _rlk_impls() if smoke or i != "xla"]  # "xla": the
    # K-loop oracle, minutes per call at these sizes
    on_gpu = torch is not None and harness.on_gpu()
    # Every competitor of a case is timed in the same rounds
    # (harness.time_interleaved): the card is power-capped, and timing them
    # one after another favoured whichever ran first.
    competitors = {}
    if on_gpu:
      torch.backends.cuda.matmul.allow_tf32 = False
      torch_pairs = _torch_copies(torch, pairs)
      competitors["cublas"] = lambda: harness.torch_batch(
          torch.matmul, torch_pairs, graph=True)
      if "cuda_ffi" in impls:
        # The same kernels through the torch bridge, launched as cuBLAS is
        # (graph replay of torch-native operands): kernel against kernel,
        # without the per-execution idle time a jitted program adds.
        import rlk_torch_bridge
        competitors["rlk_cuda_ffi_torch"] = lambda: harness.torch_batch(
            functools.partial(rlk_torch_bridge.det_gemm,
                              implementation="cuda_ffi"),
            torch_pairs, graph=True)
      if not is_big:
        # torch.matmul in a plain loop: what the decode latencies
        # were measured with; launch-bound, so it times the host.
        competitors["cublas_eager"] = lambda: harness.torch_batch(
            torch.matmul, torch_pairs)
    competitors["xla_dot"] = lambda: harness.jax_batch(
        lambda a, b: jnp.dot(a, b), pairs)
    for impl in impls:
      competitors[f"rlk_{impl}"] = lambda impl=impl: harness.jax_batch(
          functools.partial(rlk_jax.det_gemm, implementation=impl), pairs)
    case_rows = harness.interleaved_rows(BENCH, case, competitors, flops=flops)
    peer = next((r.tflops for r in case_rows if r.implementation == "cublas"),
                None)
    eager_ms = next((r.median_ms for r in case_rows
                     if r.implementation == "cublas_eager"), None)
    for row in case_rows:
      if row.implementation.startswith("rlk_") and peer and row.tflops:
        row.note = f"{row.tflops / peer:.2f}x cublas"
        if eager_ms and row.median_ms:
          row.note += f", {row.median_ms / eager_ms:.2f}x cublas_eager time"
      if row.implementation.startswith("rlk_cuda_ffi"):
        import cuda_ffi  # only where it is available
        from rlk_jax import _gemm_tuning
        # what ran: the tuned (or table, or rule) choice of this product
        config = _gemm_tuning.choose_config(
            m, n, k, transpose_a=False, transpose_b=False, out_f32=False,
            may_tune=False)
        row.note += f" config {config}" + (
            f" ({cuda_ffi.split_columns(m, n)} columns 256x192)"
            if config and config.startswith("split") else "")
    rows += case_rows
    if is_big:
      g_sets = [a @ b for a in a_sets]  # cotangents shaped like the output
      triples = [(a, b, g) for a, g in zip(a_sets, g_sets)]
      competitors = {}
      if on_gpu:
        torch_triples = _torch_copies(torch, triples)
        competitors["cublas_pair"] = lambda: harness.torch_batch(
            lambda a, b, g: (g @ b.T, a.T @ g), torch_triples, graph=True)
      competitors["xla_dot_vjp"] = lambda: harness.jax_batch(
          lambda a, b, g: jax.vjp(jnp.dot, a, b)[1](g), triples)
      for impl in impls:
        competitors[f"rlk_{impl}_vjp"] = lambda impl=impl: harness.jax_batch(
            lambda a, b, g: jax.vjp(functools.partial(
                rlk_jax.det_gemm, implementation=impl), a, b)[1](g), triples)
      bwd_rows = harness.interleaved_rows(BENCH, case + " bwd", competitors,
                                          flops=2 * flops)
      pair = next((r.median_ms for r in bwd_rows
                   if r.implementation == "cublas_pair"), None)
      for row in bwd_rows:
        if row.implementation.startswith("rlk_") and pair and row.median_ms:
          row.note = f"{row.median_ms / pair:.2f}x cublas pair time"
      rows += bwd_rows
    if SWEEP.value and "cuda_ffi" in _rlk_impls() and is_big:
      rows += _sweep(case, pairs, flops, peer)
    if SWEEP.value and harness.on_gpu():
      rows += _pallas_sweep(case, pairs, flops, peer, is_big)
  return rows


def _pallas_config(bm, bn, warps, stages, group):
  from pallas_kernels import det_matmul
  return det_matmul.MatmulConfig(block_m=bm, block_n=bn, block_k=64,
                                 num_warps=warps, num_stages=stages,
                                 group_m=group)


# (block_m, block_n, num_warps, num_stages, group_m): candidates for the
# size-based choice; BK stays 64 (it fixes the K order).
PALLAS_SWEEP_BIG = [(128, 128, 8, 3, 1), (128, 128, 8, 3, 8),
                    (128, 128, 8, 4, 8), (128, 256, 8, 3, 8),
                    (256, 128, 8, 3, 8), (128, 128, 4, 4, 8),
                    (128, 256, 8, 4, 16)]
PALLAS_SWEEP_DECODE = [(64, 32, 4, 4, 1), (64, 64, 4, 4, 1), (64, 128, 4, 4, 1),
                       (64, 32, 4, 6, 1), (64, 32, 2, 4, 1), (32, 32, 4, 4, 1),
                       (16, 64, 4, 4, 1), (16, 32, 2, 4, 1), (64, 16, 4, 6, 1)]


def _pallas_sweep(case, pairs, flops, peer, is_big) -> list[Row]:
  """Pallas tile configs on one problem, each checked bit for bit against
  the default config (the data behind det_matmul.choose_config)."""
  from pallas_kernels import det_matmul
  rows = []
  a, b = pairs[0]
  want = jax.lax.bitcast_convert_type(
      det_matmul.matmul(a, b, config=det_matmul.DEFAULT_CONFIG), jnp.uint16)
  for cand in PALLAS_SWEEP_BIG if is_big else PALLAS_SWEEP_DECODE:
    cfg = _pallas_config(*cand)
    fn = functools.partial(det_matmul.matmul, config=cfg)
    try:
      got = jax.lax.bitcast_convert_type(fn(a, b), jnp.uint16)
      same = bool(jnp.array_equal(got, want))
      row = harness.timed_row(BENCH, case, "sweep pallas %dx%d w%d s%d g%d"
                              % cand, fn, pairs, flops=flops)
    except Exception as e:  # a config Triton cannot compile: record why
      rows.append(Row(BENCH, case, "sweep pallas %dx%d w%d s%d g%d" % cand,
                      note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
      continue
    row.note = ("bits = default" if same else "BITS DIFFER from default")
    if peer and row.tflops:
      row.note += f"; {row.tflops / peer:.2f}x cublas"
    rows.append(harness.progress(row))
  return rows


def _sweep(case, pairs, flops, peer) -> list[Row]:
  """Every instantiation and tile order on one problem: the data behind
  the library's ChooseConfig and its default tile order (none of them
  moves a bit)."""
  import cuda_ffi
  rows = []
  # The decode instantiation is left out: it exists for M <= 64.
  for config in ("cooperative_128x256", "pingpong_64x128"):
    for swizzle in cuda_ffi.SWIZZLES[1:]:  # 0 = the library's choice
      for raster in cuda_ffi.RASTERS:
        fn = functools.partial(cuda_ffi.matmul, transpose_a=False,
                               transpose_b=False, out_dtype=jnp.bfloat16,
                               config=config, swizzle=swizzle, raster=raster)
        row = harness.timed_row(
            BENCH, case, f"sweep {config} swizzle={swizzle} raster={raster}",
            fn, pairs, flops=flops)
        if peer and row.tflops:
          row.note = f"{row.tflops / peer:.2f}x cublas"
        rows.append(row)
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
