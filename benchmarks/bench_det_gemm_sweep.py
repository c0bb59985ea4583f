"""det_gemm on open models' projection shapes at every token count, forward
and both backward products, against cuBLAS and XLA's dot.

    python -m benchmarks --only det_gemm_sweep [--sweep_families=a,b] [--sweep_ms=...]

Shapes: the qkv, o, gate_up, down and lm_head products of FAMILIES (read from
each model's public config) at M in SWEEP_MS tokens, each three ways, in
the layouts rlk's backward uses (W stored ``[K, N]``):

* ``fwd``: ``A [M, K] @ W [K, N]``;
* ``dA``: ``G [M, N] @ W^T`` (W read in place, transposed);
* ``dB``: ``A^T @ G`` (A read in place, transposed; the reduction runs over
  the M tokens).

Competitors, timed in interleaved rounds per product: ``cublas``
(torch.matmul on the same layouts, CUDA-graph replay), ``xla_dot`` (jitted
``lax.dot_general``), ``rlk_cuda_ffi_kernel`` (the SM90 kernel on the config
rlk chooses, launched through the torch operator, CUDA-graph replay: kernel
against kernel), ``rlk_cuda_ffi``, ``rlk_pallas`` and ``rlk_triton``
(rlk's det_gemm primitive in a jitted JAX program: the route a JAX user
calls; ``rlk_triton`` is the @triton.jit kernel through jax-triton,
``rlk_mosaic_gpu`` the Pallas kernel on Mosaic GPU) and
``cublaslt_vllm_recipe`` (torch.matmul under vLLM's batch-invariant
settings for Hopper, in a child process per family because cuBLAS reads
them once, interleaved there with rlk's kernel; its ratio is to the
parent's cuBLAS time). Where rlk
tunes a product on first use, the timings of every SM90 config go to
``det_gemm_configs.csv`` and the choices to a tuned table
(``det_gemm_sm90-<device>.json``) beside the report: the data the shipped
tables in ``rlk_jax/tuned/`` come from.
"""

from __future__ import annotations

import concurrent.futures
import csv
import datetime
import functools
import json
import math
import os
import re
import sys
import time
import zlib
from statistics import geometric_mean

import jax
import jax.numpy as jnp
from absl import flags

from benchmarks import cublaslt_recipe, harness
from benchmarks.gemm_products import (BENCH, layout_product, rlk_torch_product,
                                      timing_plan, torch_operand_sets,
                                      torch_product)
from benchmarks.harness import Row

# hidden, qkv out, o in, intermediate (gate_up = 2x), vocab: from each
# model's config.json (hidden_size, num_attention_heads x head_dim plus two
# num_key_value_heads x head_dim, intermediate_size or
# moe_intermediate_size, vocab_size).
FAMILIES = {
    "qwen3-1.7b": dict(hidden=2048, qkv=4096, o_in=2048, inter=6144,
                       vocab=151936),
    "llama3.2-3b": dict(hidden=3072, qkv=5120, o_in=3072, inter=8192,
                        vocab=128256),
    "qwen2.5-7b": dict(hidden=3584, qkv=4608, o_in=3584, inter=18944,
                       vocab=152064),
    "gemma2-9b": dict(hidden=3584, qkv=8192, o_in=4096, inter=14336,
                      vocab=256000),
    "llama3.1-8b": dict(hidden=4096, qkv=6144, o_in=4096, inter=14336,
                        vocab=128256),
    "mistral-nemo-12b": dict(hidden=5120, qkv=6144, o_in=4096, inter=14336,
                             vocab=131072),
    "llama3.1-70b": dict(hidden=8192, qkv=10240, o_in=8192, inter=28672,
                         vocab=128256),
    # An MoE: the expert MLP width (moe_intermediate_size 768).
    "qwen3-30b-a3b-expert": dict(hidden=2048, qkv=5120, o_in=4096, inter=768,
                                 vocab=151936),
}
# Families no shipped table was built from (same sources, same reading of
# the configs): what a user's model meets, a shape rlk has not measured,
# tuned on first use within the tuner's limits, else the analytic rule.
# Run them with --sweep_families and --sweep_as_user.
HELD_OUT_FAMILIES = {
    "phi3-mini": dict(hidden=3072, qkv=9216, o_in=3072, inter=8192,
                      vocab=32064),
    "phi3-medium": dict(hidden=5120, qkv=7680, o_in=5120, inter=17920,
                        vocab=32064),
    "qwen2.5-1.5b": dict(hidden=1536, qkv=2048, o_in=1536, inter=8960,
                         vocab=151936),
    "qwen2.5-14b": dict(hidden=5120, qkv=7168, o_in=5120, inter=13824,
                        vocab=152064),
    "gemma2-27b": dict(hidden=4608, qkv=8192, o_in=4096, inter=36864,
                       vocab=256000),
    "mixtral-8x22b-expert": dict(hidden=6144, qkv=8192, o_in=6144,
                                 inter=16384, vocab=32768),
    "olmo2-7b": dict(hidden=4096, qkv=12288, o_in=4096, inter=11008,
                     vocab=100352),
    # An MoE's expert width (moe_intermediate_size 1536).
    "qwen3-235b-a22b-expert": dict(hidden=4096, qkv=9216, o_in=8192,
                                   inter=1536, vocab=151936),
}
SMOKE_FAMILIES = {"tiny": dict(hidden=128, qkv=192, o_in=128, inter=256,
                               vocab=320)}
SWEEP_MS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Decode rows (--sweep_ms=1,2,4,8,16,32,64 --sweep_layouts=fwd): memory-bound
# products, each with its byte floor (operand bytes over the copy bandwidth
# measured in the same run) in its rows.
DECODE_MS = (1, 2, 4, 8, 16, 32, 64)
# Decode rows with a weight this large are held to their byte floor
# (rlk's goal: within 1.2x of it); smaller ones are launch-bound.
FLOOR_WEIGHT_BYTES = 64 << 20
LAYOUTS = ("fwd", "dA", "dB")
IMPLS = ("cublas", "xla_dot", "rlk_cuda_ffi_kernel", "rlk_cuda_ffi",
         "rlk_pallas", "rlk_triton", "rlk_mosaic_gpu", "cublaslt_vllm_recipe")

FAMILIES_FLAG = flags.DEFINE_list("sweep_families", None,
                                  f"Families to run (default all: "
                                  f"{', '.join(FAMILIES)}; also "
                                  f"{', '.join(HELD_OUT_FAMILIES)}).")
AS_USER = flags.DEFINE_bool(
    "sweep_as_user", False, "Keep the autotuner's limits a user gets "
    "(RLK_DET_GEMM_TUNE_MAX_MB, RLK_DET_GEMM_TUNE_MAX_TFLOP) instead of "
    "tuning every product however large, as a table-building run does: "
    "with the held-out families, what a user's first step on a model rlk "
    "has not measured runs.")
EXTRA_CANDIDATES = flags.DEFINE_list(
    "sweep_extra_candidates", None, "SM90 configs the autotuner times in "
    "this run besides its candidates (last in its tie order): configs the "
    "library has compiled but not yet made candidates "
    "(_gemm_tuning.NOT_YET_DEVICE_TESTED), measured in the device call "
    "whose tests have just proven them bit-identical, before they ship. "
    "Products already in the tuning cache of this device and build are "
    "not timed again, and what the tuner keeps goes into that cache: run "
    "with a fresh RLK_CACHE_DIR (scripts/sweep_fwd.sh makes one).")
MS_FLAG = flags.DEFINE_list("sweep_ms", None, "Token counts M (default "
                            f"{', '.join(map(str, SWEEP_MS))}).")
IMPLS_FLAG = flags.DEFINE_list("sweep_impls", None, "Competitors (default "
                               f"all: {', '.join(IMPLS)}).")
PALLAS_MS = flags.DEFINE_list(
    "sweep_pallas_ms", ["1024", "4096"], "The M values rlk_pallas, "
    "rlk_triton and rlk_mosaic_gpu run at: each product compiles its own "
    "kernel (seconds each).")
MAX_GIB = flags.DEFINE_float(
    "sweep_max_gib", 4.0, "Products with an operand or result larger than "
    "this are left out (lm_head at M >= 8192: rlk's linear_logp runs it in "
    "row chunks anyway), so that five competitors' buffers fit at once.")
RETUNE = flags.DEFINE_bool(
    "sweep_retune", False, "Ignore the shipped tuned tables, so rlk tunes "
    "every product again and the run writes a fresh table.")
PALLAS_CONFIGS = flags.DEFINE_bool(
    "sweep_pallas_configs", False, "Also time every Pallas tile config on "
    "the products rlk_pallas runs (checking their bits agree), into "
    "det_gemm_pallas_configs.csv and a table in the shipped format "
    "(det_gemm_pallas-<device>.json).")
TRITON_CONFIGS = flags.DEFINE_bool(
    "sweep_triton_configs", False, "The same for the @triton.jit kernel "
    "through jax-triton on the same tiles (det_gemm_triton_configs.csv, "
    "det_gemm_triton-<device>.json).")
MOSAIC_CONFIGS = flags.DEFINE_bool(
    "sweep_mosaic_gpu_configs", False, "The same for the Mosaic GPU kernel's "
    "configs (det_gemm_mosaic_gpu_configs.csv, "
    "det_gemm_mosaic_gpu-<device>.json).")
PROJECTIONS_FLAG = flags.DEFINE_list(
    "sweep_projections", None, "Projections to run (default all: qkv, o, "
    "gate_up, down, lm_head).")
LAYOUTS_FLAG = flags.DEFINE_list(
    "sweep_layouts", None, f"Layouts to run (default all: "
    f"{', '.join(LAYOUTS)}).")
TILE_CONFIG_NAMES = flags.DEFINE_list(
    "sweep_tile_config_names", None, "Time only these configs under "
    "--sweep_*_configs (default: every config of the kernel).")
BUDGET_S = flags.DEFINE_float(
    "sweep_budget_s", 0, "Start no new product after this many seconds (0: "
    "no limit); the rows and tables so far are still written, so a device "
    "call with a time limit keeps what it measured.")
KERNEL_TIMES = flags.DEFINE_bool(
    "sweep_kernel_times", False, "Also profile each competitor's kernels "
    "(CUPTI) and note their time per call: kernel against kernel where a "
    "small product's jitted wall time measures the host's dispatch.")
TUNE_ONLY = flags.DEFINE_bool(
    "sweep_tune_only", False, "Only let rlk's autotuner choose each "
    "product's SM90 config (with --sweep_retune: measure every product "
    "again) and write the table, timing no competitor: a table over the "
    "whole sweep in minutes.")
REFINE_PICKS = flags.DEFINE_integer(
    "sweep_refine_picks", 0, "After rlk's autotuner measures a product, "
    "time this many of its screen's fastest configs the sweep's way "
    "(interleaved rounds over the product's operand sets, CUDA-graph "
    "replay through the torch route, --sweep_sample_ms samples) and keep "
    "the fastest of them (ties by the tuner's order) as the choice the "
    "rows run and the table ships. 0: the tuner's own pick, which took "
    "1.019x the time of the pick so chosen over the 270 forward products at "
    "M >= 256 (over 1.05x on 38; H100, 2026-11-24).")
COMPARE_BITS = flags.DEFINE_bool(
    "sweep_compare_bits", False, "Also compare cuBLAS's result with rlk's "
    "bit for bit on each product (its cublas row notes the rows that "
    "differ): a kernel that walks K in order into one f32 accumulator gives "
    "rlk's bits, so a product where cuBLAS's differ ran a split or otherwise "
    "reordered reduction, which a batch-invariant GEMM cannot use. Where the "
    "bits agree and cuBLAS ran faster, its kernel's name is noted too.")
JAX_MS = flags.DEFINE_list(
    "sweep_jax_ms", None, "The M values the jitted JAX routes (xla_dot, "
    "rlk_cuda_ffi) run at (default all): each is one XLA compile, plus "
    "XLA's own GEMM autotuning.")


def products(family: str, dims: dict) -> list[tuple[str, int, int]]:
  """(projection, K, N) of one family's layer and head."""
  h = dims["hidden"]
  return [("qkv", h, dims["qkv"]), ("o", dims["o_in"], h),
          ("gate_up", h, 2 * dims["inter"]), ("down", dims["inter"], h),
          ("lm_head", h, dims["vocab"])]


def _dims_of(ta, tb):
  return (((0,) if ta else (1,)), ((1,) if tb else (0,)))


def _xla(ta, tb):
  contract = _dims_of(ta, tb)
  return lambda x, y: jax.lax.dot_general(x, y, (contract, ((), ())))


def _rlk_jax(impl, ta, tb):
  from rlk_jax import _det_gemm
  return lambda x, y: _det_gemm._matmul(impl, ta, tb, jnp.dtype(jnp.bfloat16),
                                        x, y)





def _add_candidates(names) -> None:
  """Appends `names` to the autotuner's candidates for this process."""
  import cuda_ffi
  from rlk_jax import _gemm_tuning
  unknown = sorted(set(names) - (set(cuda_ffi.CONFIGS) - {"auto"}))
  if unknown:
    raise ValueError(f"unknown --sweep_extra_candidates {unknown}; the "
                     f"library's configs: {sorted(cuda_ffi.CONFIGS)}")
  _gemm_tuning.CANDIDATES += tuple(
      n for n in names if n not in _gemm_tuning.CANDIDATES)


def run(smoke: bool) -> list[Row]:
  families = SMOKE_FAMILIES if smoke else FAMILIES
  if FAMILIES_FLAG.value:
    known = {**FAMILIES, **HELD_OUT_FAMILIES}
    unknown = sorted(set(FAMILIES_FLAG.value) - set(known))
    if unknown:
      raise ValueError(f"unknown --sweep_families {unknown}; known: "
                       f"{sorted(known)}")
    families = {f: known[f] for f in FAMILIES_FLAG.value}
  ms = ([int(m) for m in MS_FLAG.value] if MS_FLAG.value
        else [16, 48] if smoke else list(SWEEP_MS))
  impls = IMPLS_FLAG.value or IMPLS
  torch = harness.torch_or_none()
  on_gpu = harness.on_gpu()
  if torch is not None and on_gpu:
    import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
    torch.backends.cuda.matmul.allow_tf32 = False
  rlk_ready = {i: why is None for i, why in
               __import__("rlk_jax").implementations("det_gemm").items()}
  pallas_ms = {int(m) for m in PALLAS_MS.value} if not smoke else set(ms)
  jax_ms = ({int(m) for m in JAX_MS.value} if JAX_MS.value and not smoke
            else set(ms))
  # The sweep is where rlk's tables come from: tune every product, however
  # large (a user's process tunes only up to RLK_DET_GEMM_TUNE_MAX_MB and
  # RLK_DET_GEMM_TUNE_MAX_TFLOP).
  if not AS_USER.value:
    os.environ.setdefault("RLK_DET_GEMM_TUNE_MAX_MB", "65536")
    os.environ.setdefault("RLK_DET_GEMM_TUNE_MAX_TFLOP", "1e6")
  if RETUNE.value:
    os.environ["RLK_DET_GEMM_TUNED_TABLES"] = "0"
  if EXTRA_CANDIDATES.value:
    _add_candidates(EXTRA_CANDIDATES.value)
  rows, skipped = [], 0
  deadline = time.monotonic() + (BUDGET_S.value or float("inf"))
  for family, dims in families.items():
    recipe_products = []
    for proj, k, n in products(family, dims):
      if PROJECTIONS_FLAG.value and proj not in PROJECTIONS_FLAG.value:
        continue
      for m in ms:
        if (2 * max(m * k, k * n, m * n) > MAX_GIB.value * 2**30
            or time.monotonic() > deadline):
          skipped += 3
          continue
        for layout in LAYOUTS_FLAG.value or LAYOUTS:
          case = f"{family} {proj} M={m} K={k} N={n} {layout}"
          if on_gpu and rlk_ready.get("cuda_ffi") and (
              TUNE_ONLY.value or REFINE_PICKS.value):
            _tune(case, layout, m, k, n)
            if REFINE_PICKS.value and torch is not None:
              _refine_pick(case, layout, m, k, n, torch)
          if TUNE_ONLY.value:
            continue
          rows += _product_rows(family, proj, m, k, n, layout, impls, torch,
                                on_gpu, rlk_ready, pallas_ms, jax_ms, smoke)
          # Tile tables after every product: a device call's time limit
          # may stop the sweep (a product of eight Mosaic GPU configs
          # takes about 30 s) and must not take what it measured along.
          for backend, times in _TILE_TIMES.items():
            _write_tile_tuning(harness.output_dir(), backend, times)
          recipe_products.append([case, m, k, n, layout])
    if (cublaslt_recipe.RECIPE in impls and torch is not None and on_gpu
        and recipe_products):
      rows += _recipe_rows(recipe_products, rows)
  if skipped:
    harness.progress(Row(BENCH, f"{skipped} products left out (operands "
                         f"> {MAX_GIB.value} GiB, or past the time budget)",
                         "-"))
  if on_gpu and rlk_ready.get("cuda_ffi"):
    _write_tuning(harness.output_dir())
  if torch is not None and on_gpu:
    torch.cuda.empty_cache()
  return rows


_COPY_GBPS: list[float] = []


def _copy_gbps(rows: list[Row]) -> float:
  """The run's copy bandwidth (GB/s, read + write), measured on its first
  decode product (its rows join the record)."""
  if not _COPY_GBPS:
    keys = jax.random.split(jax.random.key(0), 4)
    xs = [jax.random.normal(kk, (128 << 20,), jnp.float32).astype(jnp.bfloat16)
          for kk in keys]  # 256 MB each
    gbps, copy_rows = harness.copy_bandwidth(BENCH, xs)
    rows += [harness.progress(r) for r in copy_rows]
    _COPY_GBPS.append(gbps)
  return _COPY_GBPS[0]


def _cublas_bits_note(torch, ta, tb, x, y, cublas_ms, rlk_ms) -> str:
  """How many rows of cuBLAS's result differ from rlk's, bit for bit; and
  where none does but cuBLAS ran faster, the kernel it ran."""
  ours = rlktorch_product(torch, ta, tb)(x, y)
  theirs = torch_product(torch, ta, tb)(x, y)
  rows = int((ours.view(torch.int16) != theirs.view(torch.int16))
             .any(dim=1).sum())
  note = f"cublas bits: {rows} of {ours.shape[0]} rows differ from rlk's"
  if rows == 0 and cublas_ms and rlk_ms and cublas_ms < 0.97 * rlk_ms:
    try:
      names = harness.kernel_names(
          torch, lambda: torch_product(torch, ta, tb)(x, y))
      note += f"; cublas kernel {' '.join(names)}"
    except Exception as e:  # noqa: BLE001 - the bits stand without it
      note += f"; cublas kernel unknown ({type(e).__name__})"
  return note


def _product_rows(family, proj, m, k, n, layout, impls, torch, on_gpu,
                  rlk_ready, pallas_ms, jax_ms, smoke) -> list[Row]:
  ta, tb, x_shape, y_shape, (pm, pn, pk) = layout_product(layout, m, k, n)
  case = f"{family} {proj} M={m} K={k} N={n} {layout}"
  flops = 2 * m * n * k
  n_sets, iters = timing_plan(x_shape, y_shape, flops, pm * pn)
  copy_rows, floor_ms = [], None
  if on_gpu and m <= max(DECODE_MS):
    floor_ms = (2 * (math.prod(x_shape) + math.prod(y_shape) + pm * pn)
                / _copy_gbps(copy_rows) / 1e6)
  if smoke:
    n_sets = iters = 1
  keys = jax.random.split(jax.random.key(zlib.crc32(case.encode())),
                          2 * n_sets)
  x_sets = [jax.random.normal(kk, x_shape, jnp.float32).astype(jnp.bfloat16)
            for kk in keys[:n_sets]]
  y_sets = [jax.random.normal(kk, y_shape, jnp.float32).astype(jnp.bfloat16)
            for kk in keys[n_sets:]]
  pairs = list(zip(x_sets, y_sets))
  competitors = {}
  torch_gpu = torch is not None and on_gpu
  if torch_gpu:
    torch_pairs = [(torch.from_dlpack(x).clone(), torch.from_dlpack(y).clone())
                   for x, y in pairs]
  if "cublas" in impls and torch_gpu:
    competitors["cublas"] = lambda: harness.torch_batch(
        torch_product(torch, ta, tb), torch_pairs, graph=True)
  if "xla_dot" in impls and m in jax_ms:
    competitors["xla_dot"] = lambda: harness.jax_batch(_xla(ta, tb), pairs)
  if "rlk_cuda_ffi_kernel" in impls and torch_gpu and rlk_ready.get("cuda_ffi"):
    competitors["rlk_cuda_ffi_kernel"] = lambda: harness.torch_batch(
        rlktorch_product(torch, ta, tb), torch_pairs, graph=True)
  if "rlk_cuda_ffi" in impls and rlk_ready.get("cuda_ffi") and m in jax_ms:
    competitors["rlk_cuda_ffi"] = lambda: harness.jax_batch(
        _rlk_jax("cuda_ffi", ta, tb), pairs)
  for impl in ("pallas", "triton", "mosaic_gpu"):  # a compile per product
    if f"rlk_{impl}" in impls and rlk_ready.get(impl) and m in pallas_ms:
      competitors[f"rlk_{impl}"] = functools.partial(
          harness.jax_batch, _rlk_jax(impl, ta, tb), pairs)
  rows = harness.interleaved_rows(BENCH, case, competitors, flops=flops,
                                  iters=iters,
                                  repeats=3 if smoke else 5, warmup=1,
                                  kernel_times=KERNEL_TIMES.value and on_gpu)
  for backend, wanted in (("pallas", PALLAS_CONFIGS), ("triton", TRITON_CONFIGS),
                          ("mosaic_gpu", MOSAIC_CONFIGS)):
    if wanted.value and on_gpu and rlk_ready.get(backend) and m in pallas_ms:
      _time_tile_configs(backend, case, pm, pn, pk, ta, tb, pairs, iters)
  timed = {r.implementation: r.median_ms for r in rows}
  bits_note = ""
  if (COMPARE_BITS.value and torch_gpu and "cublas" in timed
      and "rlk_cuda_ffi_kernel" in timed):
    try:
      bits_note = _cublas_bits_note(torch, ta, tb, *torch_pairs[0],
                                    timed["cublas"],
                                    timed["rlk_cuda_ffi_kernel"])
    except Exception as e:  # noqa: BLE001 - the timings stand without it
      bits_note = f"cublas bits: not compared ({type(e).__name__}: {e})"
  del pairs, x_sets, y_sets, competitors
  if torch_gpu:
    del torch_pairs
    torch.cuda.empty_cache()  # the next product's JAX buffers need room
  peer = next((r.median_ms for r in rows if r.implementation == "cublas"),
              None)
  peer_kernel = next((r.kernel_ms for r in rows
                      if r.implementation == "cublas"), None)
  config = _chosen_config(pm, pn, pk, ta, tb) if any(
      r.implementation.startswith("rlk_cuda_ffi") for r in rows) else None
  for row in rows:
    row.floor_ms = floor_ms
    notes = [bits_note] if row.implementation == "cublas" else []
    if peer and row.median_ms and row.implementation != "cublas":
      notes.append(f"{peer / row.median_ms:.2f}x cublas")
    if peer_kernel and row.kernel_ms and row.implementation != "cublas":
      notes.append(f"kernels {peer_kernel / row.kernel_ms:.2f}x cublas's")
    if config and row.implementation.startswith("rlk_cuda_ffi"):
      notes.append(f"config {config}")
    row.note = "; ".join(filter(None, [row.note, *notes]))
  if bits_note:  # progress, as the rows' own lines were
    print(f"  {case} | {bits_note}", file=sys.stderr, flush=True)
  return copy_rows + rows


def _recipe_rows(recipe_products, rows) -> list[Row]:
  """vLLM's recipe on one family's products, timed in a child process."""
  name = cublaslt_recipe.RECIPE
  try:
    timed = cublaslt_recipe.run_job(
        {"kind": "time", "products": recipe_products}, setting=name)
  except Exception as e:  # noqa: BLE001 - reported as a row, not hidden
    return [harness._failed_row(BENCH, recipe_products[0][0], name, e)]
  peer = {r.case: r.median_ms for r in rows
          if r.implementation == "cublas" and r.median_ms}
  rlk_there = {r["case"]: r["median_ms"] for r in timed
               if r["implementation"] == "rlk_cuda_ffi_kernel"}
  out = []
  for r in (Row(**r) for r in timed if r["implementation"] == name):
    notes = [r.note]
    if r.median_ms and peer.get(r.case):
      notes.append(f"{peer[r.case] / r.median_ms:.2f}x cublas")
    if r.median_ms and rlk_there.get(r.case):
      notes.append(f"{r.median_ms / rlk_there[r.case]:.2f}x the time of "
                   "rlk_cuda_ffi_kernel in its process")
    r.note = "; ".join(filter(None, notes))
    out.append(r)
  return out


# backend ("pallas", "triton") -> key -> {config: ms} of every product whose
# tile configs were timed.
_TILE_TIMES: dict[str, dict[str, dict]] = {}


def _tile_configs(backend) -> dict:
  """{name: config} of a tiled kernel: Pallas's vocabulary (the Triton
  kernel takes the same tiles) or the Mosaic GPU kernel's own."""
  if backend == "mosaic_gpu":
    from pallas_kernels import det_matmul_mgpu
    configs = det_matmul_mgpu.CONFIGS
  else:
    from pallas_kernels import det_matmul
    configs = det_matmul.NAMED_CONFIGS
  names = TILE_CONFIG_NAMES.value
  return {n: c for n, c in configs.items() if not names or n in names}


def _tile_kernel(backend):
  if backend == "pallas":
    from pallas_kernels import det_matmul
    return det_matmul.matmul
  if backend == "mosaic_gpu":
    from pallas_kernels import det_matmul_mgpu
    return functools.partial(det_matmul_mgpu.matmul, out_dtype=jnp.bfloat16)
  from triton_kernels import det_matmul
  return functools.partial(det_matmul.matmul, out_dtype=jnp.bfloat16)


def _time_tile_configs(backend, case, m, n, k, ta, tb, pairs, iters):
  """Every tile config of `backend` on one product, with a check that their
  bits agree. The configs compile in threads side by side (eight Mosaic GPU
  configs still took 22-32 s a product on the H100: their compiles barely
  overlap). With --sweep_kernel_times the table keeps each config's kernel
  time, from one CUPTI trace of them all and no wall-time rounds: a small
  product's jitted wall time measures the host's dispatch, the same for
  every config. Otherwise the configs are timed against each other in
  interleaved rounds."""
  from rlk_jax import _gemm_tuning
  fns = {name: functools.partial(_tile_kernel(backend), transpose_a=ta,
                                 transpose_b=tb, config=cfg)
         for name, cfg in _tile_configs(backend).items()}

  def build(f):
    try:
      outs = []
      batch = harness.jax_batch(f, pairs, outputs=outs)
      return jax.lax.bitcast_convert_type(outs[0], jnp.uint16), batch
    except Exception as e:  # noqa: BLE001 - a row with the error, below
      return None, e

  started = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
    built = dict(zip(fns, pool.map(build, fns.values())))
  build_note = f"configs built in {time.monotonic() - started:.1f} s"
  outs = [bits for bits, _ in built.values() if bits is not None]
  same = all(bool(jnp.array_equal(outs[0], o)) for o in outs[1:])
  labels = {name: f"{backend} {name}" for name in fns}
  failed = [harness.progress(harness._failed_row(BENCH, case, labels[name], e))
            for name, (bits, e) in built.items() if bits is None]
  built = {name: batch for name, (bits, batch) in built.items()
           if bits is not None}
  if KERNEL_TIMES.value:
    seen, note = harness.traced_kernel_times(built, 2 * iters)
    rows = [harness.progress(Row(BENCH, case, labels[name],
                                 seen[name] and seen[name][0],
                                 note="; ".join(filter(None, [note, build_note])),
                                 kernel_ms=seen[name] and seen[name][1]))
            for name in built]
  else:
    rows = harness.interleaved_rows(
        BENCH, case, {labels[name]: (lambda b=batch: b)
                      for name, batch in built.items()},
        iters=iters, repeats=5, warmup=1)
  rows += failed
  _TILE_TIMES.setdefault(backend, {})[
      _gemm_tuning.pallas_key(m, n, k, ta, tb)] = {
          "m": m, "bits_equal": same,
          "ms": {r.implementation.split()[1]:
                 r.kernel_ms if KERNEL_TIMES.value else r.median_ms
                 for r in rows}}


def _write_tile_tuning(out_dir: str, backend: str, times: dict) -> None:
  from rlk_jax import _gemm_tuning
  device = harness.device_name()
  order = tuple(_tile_configs(backend))
  with open(os.path.join(out_dir, f"det_gemm_{backend}_configs.csv"), "w",
            newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["device", "commit", "key", "m", "config", "median_ms",
                     "chosen", "bits_equal_across_configs"])
    table = {}
    for key, entry in sorted(times.items()):
      if not any(entry["ms"].values()):  # every config failed: no entry
        chosen = None
      else:
        chosen = table[key] = _gemm_tuning.pick(entry["ms"], candidates=order)
      for config, ms in entry["ms"].items():
        writer.writerow([device, harness.commit(), key, entry["m"], config,
                         "" if ms is None else f"{ms:.6g}",
                         int(config == chosen), int(entry["bits_equal"])])
  name = f"det_gemm_{backend}-{_gemm_tuning.device_slug(device)}.json"
  with open(os.path.join(out_dir, name), "w") as f:
    json.dump({"device": device, "commit": harness.commit(),
               "date": datetime.date.today().isoformat(),
               "source": "benchmarks/bench_det_gemm_sweep.py "
                         f"--sweep_{backend}_configs", "entries": table},
              f, indent=0, sort_keys=True)


def _tune(case, layout, m, k, n) -> None:
  """rlk's choice for one product, measured now unless the cache or a
  table already has it."""
  from rlk_jax import _gemm_tuning
  ta, tb, _, _, (pm, pn, pk) = layout_product(layout, m, k, n)
  start = time.perf_counter()
  config = _gemm_tuning.choose_config(pm, pn, pk, transpose_a=ta,
                                      transpose_b=tb, out_f32=False)
  print(f"  {case} | chose {config} in {time.perf_counter() - start:.3f} s",
        file=sys.stderr, flush=True)


def _refine_pick(case, layout, m, k, n, torch) -> None:
  """--sweep_refine_picks, after _tune: the tuner's fastest few configs
  timed the sweep's way, the fastest kept (in the cache the table is
  written from)."""
  from rlk_jax import _gemm_tuning
  from rlk_torch_bridge import _sm90
  ta, tb, x_shape, y_shape, (pm, pn, pk) = layout_product(layout, m, k, n)
  signature = dict(transpose_a=ta, transpose_b=tb, out_f32=False)
  entry = _gemm_tuning.tuned_entry(pm, pn, pk, **signature)
  if not entry or "sweep_ms" in entry:  # a table's answer, or done already
    return
  screen = entry["ms"]
  finalists = sorted(screen, key=screen.get)[:REFINE_PICKS.value]
  gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.encode()))
  sets, iters = torch_operand_sets(torch, x_shape, y_shape, 2 * m * n * k,
                                   pm * pn, gen)
  batches = {c: harness.torch_batch(_sm90.product_launcher(
      pm, pn, pk, ta, tb, torch.bfloat16, c), sets, graph=True)
             for c in finalists}
  times = harness.time_interleaved(batches, iters=iters, repeats=5, warmup=1)
  del batches, sets
  torch.cuda.empty_cache()
  config = _gemm_tuning.pick(times)
  _gemm_tuning.keep_choice(pm, pn, pk, **signature, config=config,
                           sweep_ms=times)
  tuners = entry["config"]
  against = (f"{times[tuners] / times[config]:.3f}x its time" if tuners in
             times else "not among the finalists")
  print(f"  {case} | sweep-timed pick {config} (the tuner's {tuners}, "
        f"{against})", file=sys.stderr, flush=True)


def _chosen_config(m, n, k, ta, tb) -> str:
  from rlk_jax import _gemm_tuning
  return _gemm_tuning.choose_config(m, n, k, transpose_a=ta, transpose_b=tb,
                                    out_f32=False, may_tune=False)


def _write_tuning(out_dir: str) -> None:
  """Every product this process tuned: each config's time
  (det_gemm_configs.csv) and the choices as a table in the shipped format."""
  import cuda_ffi
  from rlk_jax import _gemm_tuning
  device = harness.device_name()
  cache = _gemm_tuning.DiskCache(_gemm_tuning.cache_path(device,
                                                         cuda_ffi.build_id()))
  entries = cache._read()
  if not entries:
    return
  with open(os.path.join(out_dir, "det_gemm_configs.csv"), "w",
            newline="") as f:
    writer = csv.writer(f)
    # median_ms: the tuner's screen (every config); sustained_ms: its
    # finalists timed again on a card at its power cap, which chose.
    # sweep_ms: --sweep_refine_picks's timing of the fastest few, which
    # then chose.
    writer.writerow(["device", "commit", "layout", "m", "n", "k", "config",
                     "median_ms", "chosen", "x_fastest", "sustained_ms",
                     "sweep_ms"])
    for key, entry in sorted(entries.items()):
      layout, _, n, k = key.split()
      fastest = min(entry["ms"].values())
      hot = entry.get("sustained_ms", {})
      swept = entry.get("sweep_ms", {})
      for config, ms in sorted(entry["ms"].items(), key=lambda kv: kv[1]):
        writer.writerow([device, harness.commit(), layout, entry["m"], n, k,
                         config, f"{ms:.6g}", int(config == entry["config"]),
                         f"{ms / fastest:.4f}",
                         f"{hot[config]:.6g}" if config in hot else "",
                         f"{swept[config]:.6g}" if config in swept else ""])
  table = {"device": device, "commit": harness.commit(),
           "date": datetime.date.today().isoformat(),
           "source": "benchmarks/bench_det_gemm_sweep.py (rlk's autotuner "
                     "on every product of the sweep" + (
                         f"; its {REFINE_PICKS.value} fastest timed the "
                         "sweep's way chose)" if REFINE_PICKS.value else ")"),
           "entries": {key: e["config"] for key, e in sorted(entries.items())}}
  name = f"det_gemm_sm90-{_gemm_tuning.device_slug(device)}.json"
  with open(os.path.join(out_dir, name), "w") as f:
    json.dump(table, f, indent=0, sort_keys=True)


def summarize(rows: list[Row]) -> str:
  """The report's section: geomean speed as a fraction of cuBLAS per
  competitor, layout and M (the full rows are in results.csv), and the
  slowest products of each rlk competitor."""
  peer = {r.case: r.median_ms for r in rows
          if r.implementation == "cublas" and r.median_ms}
  ratios: dict[tuple, list[float]] = {}
  worst: dict[str, list[tuple[float, str]]] = {}
  for r in rows:
    if r.implementation == "cublas" or not r.median_ms or r.case not in peer:
      continue
    layout = r.case.split()[-1]
    m = _dims(r.case)["M"]
    x = peer[r.case] / r.median_ms
    ratios.setdefault((r.implementation, layout, m), []).append(x)
    ratios.setdefault((r.implementation, "all", 0), []).append(x)
    worst.setdefault(r.implementation, []).append((x, r.case))
  if not ratios:
    return harness.format_table(rows)
  ms = sorted({m for _, _, m in ratios if m})
  lines = ["Speed as a fraction of cuBLAS's (cuBLAS time / time; geomean "
           "over the products; above 1 is faster).", "",
           "| implementation | layout | " + " | ".join(f"M={m}" for m in ms)
           + " | all M |", "|" + "---|" * (len(ms) + 3)]
  for impl in [i for i in IMPLS if any(k[0] == i for k in ratios)]:
    for layout in LAYOUTS:
      cells = [f"{geometric_mean(ratios[(impl, layout, m)]):.2f}"
               if (impl, layout, m) in ratios else "" for m in ms]
      every = [x for (i, l, m), xs in ratios.items() if i == impl
               and l == layout for x in xs]
      lines.append(f"| {impl} | {layout} | " + " | ".join(cells)
                   + (f" | {geometric_mean(every):.2f} |" if every else " | |"))
    lines.append(f"| {impl} | all | " + " | " * len(ms)
                 + f"{geometric_mean(ratios[(impl, 'all', 0)]):.2f} |")
  lines += ["", "Slowest products against cuBLAS:", ""]
  for impl, xs in worst.items():
    lines.append(f"- {impl}: " + "; ".join(
        f"{case} {x:.2f}x" for x, case in sorted(xs)[:5]))
  return "\n".join(lines + _floor_lines(rows) + _bits_lines(rows, peer))


def _dims(case: str) -> dict[str, int]:
  return {d: int(case.split(f" {d}=")[1].split()[0]) for d in "MKN"}


def _floor_lines(rows: list[Row]) -> list[str]:
  """Decode rows with a weight of FLOOR_WEIGHT_BYTES or more: time over the
  byte floor, per implementation."""
  over: dict[str, list[float]] = {}
  for r in rows:
    if r.ratio_to_floor and r.case.endswith(" fwd"):
      d = _dims(r.case)
      if 2 * d["K"] * d["N"] >= FLOOR_WEIGHT_BYTES:
        over.setdefault(r.implementation, []).append(r.ratio_to_floor)
  if not over:
    return []
  return ["", f"Decode rows with a weight of {FLOOR_WEIGHT_BYTES >> 20} MB "
          "or more, time over the byte floor (operand bytes over the copy "
          "bandwidth measured in this run):", ""] + [
              f"- {impl}: geomean {geometric_mean(xs):.2f}x, worst "
              f"{max(xs):.2f}x over {len(xs)} products"
              for impl, xs in over.items()]


def _bits_lines(rows: list[Row], peer: dict[str, float]) -> list[str]:
  """rlk's kernel against cuBLAS, split by whether cuBLAS computed rlk's
  bits (--sweep_compare_bits)."""
  differ = {}
  for r in rows:
    found = re.search(r"cublas bits: (\d+) of", r.note)
    if r.implementation == "cublas" and found:
      differ[r.case] = int(found.group(1)) > 0
  groups: dict[tuple[str, bool], list[float]] = {}
  for r in rows:
    if (r.implementation == "rlk_cuda_ffi_kernel" and r.case in differ
        and r.median_ms and peer.get(r.case)):
      groups.setdefault((r.case.split()[-1], differ[r.case]), []).append(
          peer[r.case] / r.median_ms)
  if not groups:
    return []
  lines = ["", "rlk_cuda_ffi_kernel against cuBLAS, by whether cuBLAS "
           "computed rlk's bits (a different result means a split or "
           "reordered reduction, which no batch-invariant GEMM may use):", "",
           "| layout | same bits: products | geomean | bits differ: products "
           "| geomean |", "|---|---|---|---|---|"]
  for layout in LAYOUTS:
    cells = []
    for d in (False, True):
      xs = groups.get((layout, d), [])
      cells += [str(len(xs)), f"{geometric_mean(xs):.3f}" if xs else ""]
    if any(groups.get((layout, d)) for d in (False, True)):
      lines.append(f"| {layout} | " + " | ".join(cells) + " |")
  return lines
