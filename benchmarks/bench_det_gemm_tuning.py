"""What det_gemm's autotuner costs a user: the first use of a product shape
rlk has not measured (no shipped table entry, no cache), and a call once
the choice is kept.

    python -m benchmarks --only det_gemm_tuning

Every case runs on an empty tuning cache of its own with the shipped tables
off, so each shape is new. Rows (``median_ms`` is the cost):

* ``first use <family> <proj> M=.. fwd``, implementation ``rlk_autotune``:
  ``choose_config`` on a new forward product: measuring the candidates
  (``cuda_ffi.time_configs``), or, past the tuning limits, the table and
  rule fallback; the note says which and what was chosen. M covers decode
  rows to long sequences on three families' projections.
* ``first use fwd+bwd ...``, ``torch_eager``: the torch bridge's first
  forward and backward of a new shape (its C++ route chooses the forward,
  dA and dB configs together) less the same call once chosen;
  ``jax_jit``: the first call of a jitted ``value_and_grad`` over
  ``rlk_jax.det_gemm`` (trace, compile, run; since 2026-11-28 no tuning
  inside a trace: the table's or the rule's configs) less the same for a
  second function of the same shapes traced after
  ``rlk_jax.det_gemm_tune_pending()`` (whose time the note gives). Each route
  starts on an empty tuner of its own (before 2026-11-24 the JAX case ran
  after the torch one on the same tuner and so measured no tuning).
* ``cached lookup``: what a call pays for the kept choice. The torch
  bridge's plan lookup (``torch_plan_hit``) and the memo
  (``choose_config_hit``), beside an eager ``det_gemm`` call
  (``torch_eager_det_gemm``) and the operator called with its configs
  pinned (``torch_op_pinned``) for scale. A jitted JAX program chooses
  while tracing, so its calls look nothing up.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks import bench_det_gemm_sweep as sweep
from benchmarks import harness
from benchmarks.harness import Row

BENCH = "det_gemm_tuning"
FAMILIES = ("qwen3-1.7b", "llama3.1-8b", "llama3.1-70b")
# New to the tuner (its cache is empty and the tables off): decode rows,
# ragged prefill and training micro-batches.
FIRST_USE_MS = (1, 24, 200, 1500, 6000)
# (M, K, N) of the route cases: a llama3.1-8b qkv at a ragged token count.
ROUTE_SHAPE = (1500, 4096, 6144)


@contextlib.contextmanager
def _fresh_tuner():
  """An empty on-disk cache, the shipped tables off and no memo: every
  product is new to the tuner, whose switches and limits are the defaults
  a user gets (the sweep, run before in the same process, lifts them)."""
  from rlk_jax import _gemm_tuning
  saved = {v: os.environ.get(v) for v in
           ("RLK_CACHE_DIR", "RLK_DET_GEMM_TUNED_TABLES",
            "RLK_DET_GEMM_AUTOTUNE", "RLK_DET_GEMM_TUNE_MAX_MB",
            "RLK_DET_GEMM_TUNE_MAX_TFLOP")}
  with tempfile.TemporaryDirectory() as cache:
    for var in saved:
      os.environ.pop(var, None)
    os.environ["RLK_CACHE_DIR"] = cache
    os.environ["RLK_DET_GEMM_TUNED_TABLES"] = "0"
    _gemm_tuning.clear_memo()
    try:
      yield
    finally:
      for var, value in saved.items():
        if value is None:
          os.environ.pop(var, None)
        else:
          os.environ[var] = value
      _gemm_tuning.clear_memo()


def run(smoke: bool) -> list[Row]:
  import rlk_jax
  why = rlk_jax.implementations("det_gemm").get("cuda_ffi")
  if smoke or why is not None:
    why = why or "smoke run"
    return [harness.progress(Row(
        BENCH, "first use", "rlk_autotune",
        note=f"not measured: the tuner times SM90 kernels ({why})"))]
  rows = []
  with _fresh_tuner():
    rows += _first_use_rows()
  for route_case in _route_cases():  # each on a tuner new to its shape
    with _fresh_tuner():
      rows.append(route_case())
  rows += _lookup_rows()
  return rows


def _first_use_rows() -> list[Row]:
  import cuda_ffi
  from rlk_jax import _gemm_tuning
  path = _gemm_tuning.cache_path(_gemm_tuning._device_name(),
                                 cuda_ffi.build_id())
  rows = []
  for family in FAMILIES:
    for proj, k, n in sweep.products(family, sweep.FAMILIES[family]):
      for m in FIRST_USE_MS:
        start = time.perf_counter()
        config = _gemm_tuning.choose_config(m, n, k, transpose_a=False,
                                            transpose_b=False, out_f32=False)
        ms = (time.perf_counter() - start) * 1e3
        key = _gemm_tuning.product_key(m, n, k, False, False, False)
        how = ("measured" if _gemm_tuning.DiskCache(path).get(key) else
               "past the tuning limits: table and rule")
        rows.append(harness.progress(Row(
            BENCH, f"first use {family} {proj} M={m} K={k} N={n} fwd",
            "rlk_autotune", ms, note=f"{how}; config {config}; "
            f"{2 * m * n * k / 1e12:.3g} TFLOP")))
  return rows


def _route_cases():
  """The torch bridge's and jitted JAX's first use of ROUTE_SHAPE, each
  to be run on a fresh tuner: run in one, the second route would find the
  first one's choices kept and measure no tuning."""
  m, k, n = ROUTE_SHAPE
  torch = harness.torch_or_none()
  if torch is not None:
    yield lambda: _torch_first_use(torch, m, k, n)
  yield lambda: _jax_first_use(m, k, n)


def _torch_first_use(torch, m, k, n) -> Row:
  import rlk_torch_bridge
  gen = torch.Generator(device="cuda").manual_seed(m)
  warm_a = torch.randn(64, 64, device="cuda", generator=gen,
                       dtype=torch.bfloat16, requires_grad=True)
  warm_b = torch.randn(64, 64, device="cuda", generator=gen,
                       dtype=torch.bfloat16, requires_grad=True)

  def step(a, b):  # forward and backward, finished
    rlk_torch_bridge.det_gemm(a, b).float().sum().backward()
    torch.cuda.synchronize()

  step(warm_a, warm_b)  # the C++ operator built and loaded beforehand
  a = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16,
                  requires_grad=True)
  b = torch.randn(k, n, device="cuda", generator=gen, dtype=torch.bfloat16,
                  requires_grad=True)
  start = time.perf_counter()
  step(a, b)
  first = time.perf_counter() - start
  again = statistics.median(_seconds(lambda: step(a, b)) for _ in range(5))
  return harness.progress(Row(
      BENCH, f"first use fwd+bwd M={m} K={k} N={n}", "torch_eager",
      (first - again) * 1e3, note=f"first call {first * 1e3:.1f} ms, then "
      f"{again * 1e3:.2f} ms"))


def _jax_first_use(m, k, n) -> Row:
  import rlk_jax
  keys = jax.random.split(jax.random.key(m), 2)
  a = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(keys[1], (k, n), jnp.float32).astype(jnp.bfloat16)

  def loss(a, b):
    return rlk_jax.det_gemm(a, b).astype(jnp.float32).sum()

  def first_call():  # a new function object: traced and compiled afresh
    step = jax.jit(jax.value_and_grad(lambda a, b: loss(a, b), (0, 1)))
    return _seconds(lambda: jax.block_until_ready(step(a, b)))

  first = first_call()
  start = time.perf_counter()
  tuned = rlk_jax.det_gemm_tune_pending()
  tuning = time.perf_counter() - start
  kept = first_call()
  return harness.progress(Row(
      BENCH, f"first use fwd+bwd M={m} K={k} N={n}", "jax_jit",
      (first - kept) * 1e3, note=f"first call {first * 1e3:.1f} ms, a "
      f"second function of the same shapes {kept * 1e3:.1f} ms (trace and "
      f"compile, choices kept); det_gemm_tune_pending between them (outside "
      f"any trace): {tuned} products in {tuning * 1e3:.0f} ms"))


def _lookup_rows(calls: int = 2000) -> list[Row]:
  from rlk_jax import _gemm_tuning
  rows = []
  m, k, n = 1, 2048, 2048
  key = dict(transpose_a=False, transpose_b=False, out_f32=False)
  _gemm_tuning.choose_config(m, n, k, **key)
  rows.append(_per_call_row(
      "choose_config_hit",
      lambda: _gemm_tuning.choose_config(m, n, k, **key), calls))
  torch = harness.torch_or_none()
  if torch is None:
    return rows
  import rlk_torch_bridge
  from rlk_torch_bridge import _gemm_op
  a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
  rlk_torch_bridge.det_gemm(a, b)
  # The C++ route's kept plan: the operator with its configs bound.
  plan = _gemm_op.cpp_run(a, b, False, torch.bfloat16, None)
  if plan is not None:
    rows.append(_per_call_row(
        "torch_plan_hit",
        lambda: _gemm_op.cpp_run(a, b, False, torch.bfloat16, None),
        calls))
  rows.append(_per_call_row(
      "torch_eager_det_gemm", lambda: rlk_torch_bridge.det_gemm(a, b), calls,
      torch.cuda.synchronize))
  if plan is not None:
    rows.append(_per_call_row("torch_op_pinned", lambda: plan(a, b), calls,
                              torch.cuda.synchronize))
  return rows


def _per_call_row(name, fn, calls, sync=None) -> Row:
  """Host time per call of `fn` over `calls` calls (median of 5 runs)."""
  def batch():
    for _ in range(calls):
      fn()
    if sync:
      sync()
  batch()
  ms = statistics.median(_seconds(batch) for _ in range(5)) * 1e3 / calls
  return harness.progress(Row(BENCH, "cached lookup M=1 K=2048 N=2048",
                              name, ms))


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start
