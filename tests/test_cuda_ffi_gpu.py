"""det_gemm's SM90 CUTLASS implementation (``cuda_ffi``) on a Hopper GPU:
invariance, cross-config and cross-implementation identity, the backward,
errors, the torch route, sanitizers. Run with ``pytest -m gpu``."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_ffi
from cuda_ffi import build
import rlk_jax
from rlk_jax import _det_gemm
from conftest import (ON_GPU, assert_bitwise_equal, assert_same_gradients,
                      dense_logp_grads, random_array, relative_error)

ON_SM90 = ON_GPU and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_SM90, reason="requires an SM90 GPU")]

PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
               "down": (14336, 4096), "lm_head": (4096, 128256)}
ROWS = (1, 2, 3, 16, 100, 128, 1000)
# The configs the build makes for JAX's forward layout (all of them with
# RLK_CUDA_FFI_CONFIGS=all), and for any layout.
CONFIGS = build.planned_configs((0, 0, 0))
planned = build.planned_configs


def product(config, ta=False, tb=False, out=jnp.bfloat16, swizzle=0, raster=0):
  return jax.jit(functools.partial(cuda_ffi.matmul, transpose_a=ta,
                                   transpose_b=tb, out_dtype=out, config=config,
                                   swizzle=swizzle, raster=raster))


def test_available_and_the_default_on_sm90():
  # On Hopper with the toolchain present this must not be a silent fallback.
  assert rlk_jax.implementations("det_gemm")["cuda_ffi"] is None
  assert rlk_jax.selected_implementation("det_gemm") == "cuda_ffi"


@pytest.mark.parametrize("k", [1024, 4096, 14336])
def test_rows_invariant_and_configs_identical(k, rng):
  n = 4096
  a = random_array(rng, (4096, k), jnp.bfloat16)
  b = random_array(rng, (k, n), jnp.bfloat16)
  full = product("auto")(a, b)
  for config in CONFIGS:  # every instantiation the library can pick
    assert_bitwise_equal(product(config)(a, b), full, f"K={k} config {config}")
  for m in ROWS:
    start = int(rng.integers(0, 4096 - m + 1))
    for config in ("auto", *CONFIGS):
      assert_bitwise_equal(product(config)(a[start:start + m], b),
                           full[start:start + m], f"K={k} M={m} {config}")
  assert_bitwise_equal(product("auto")(a, b), full, "repeat run")


def test_every_tile_order_gives_the_same_bits(rng):
  # The scheduler's order decides which CTA computes a tile and when, never
  # how: each tile is still one CTA's in-order K walk.
  m, k, n = 1000, 4096, 6152  # ragged tiles at both edges
  a = random_array(rng, (m, k), jnp.bfloat16)
  b = random_array(rng, (k, n), jnp.bfloat16)
  want = product("auto")(a, b)
  for config in CONFIGS:
    for swizzle in cuda_ffi.SWIZZLES:
      for raster in cuda_ffi.RASTERS:
        got = product(config, swizzle=swizzle, raster=raster)(a, b)
        assert_bitwise_equal(got, want, f"{config} swizzle={swizzle} raster={raster}")


def test_config_choice_by_shape():
  # The analytic rule (det_gemm_api.cc), the fallback where rlk_jax has no
  # measurement: decode rows take the swapped tile up to 32 rows, then the
  # widest ping-pong tile with 64 CTAs; beyond 64 rows the config of least
  # estimated time, waves x (tile work at the config's fitted rate + a fixed
  # per-tile cost), or a column block each of 256x192 and 128x256. 132 SMs.
  # Keys: (M, N, K).
  want = {(1, 4096, 4096): "swap_pingpong_64x32",
          (32, 14336, 4096): "swap_pingpong_64x32",
          (1, 128256, 4096): "swap_pingpong_64x32",
          (33, 4096, 4096): "pingpong_64x64", (64, 4096, 4096): "pingpong_64x64",
          (64, 14336, 4096): "pingpong_64x128",
          (64, 2048, 4096): "pingpong_64x32",
          (65, 4096, 4096): "pingpong_64x64",
          (512, 4096, 4096): "cooperative_128x128",
          # the M=1024 products (o, down): one wave of 128x256, not
          # the thin 64x128 tiles of the old rule (0.38x and 0.54x cuBLAS)
          (1024, 3584, 3584): "cooperative_128x256",
          (1024, 3584, 18944): "cooperative_128x256",
          (1024, 6144, 4096): "cooperative_256x192",  # 128 tiles: one wave
          (2600, 11008, 4096): "cooperative_128x256_cluster_1x2",
          (4096, 6144, 4096): "cooperative_256x192",
          (4096, 128256, 4096): "cooperative_256x192",
          (4096, 4096, 4096): "split_256x192_128x256",
          (4096, 28672, 4096): "split_256x192_128x256",
          (4096, 28672, 1024): "split_256x192_128x256",
          (8192, 14336, 4096): "split_256x192_128x256",
          (2048, 11008, 4096): "split_256x192_128x256",
          (4096, 6144, 2047): "cooperative_256x192",
          # ragged both ways
          (4000, 6152, 4096): "cooperative_256x192"}
  assert {shape: cuda_ffi.chosen_config(*shape) for shape in want} == want
  assert cuda_ffi.split_columns(4096, 28672) == 26880
  assert cuda_ffi.split_columns(2048, 11008) == 9408
  assert cuda_ffi.split_columns(1000, 136) == 0  # 128x256 takes all


def test_split_columns_are_whole_256x192_tiles_short_of_n(rng):
  # The split's boundary: whole 192-column tiles, and at least one column
  # left to 128x256, at any M and N the tests' products use.
  for _ in range(200):
    m, n = int(rng.integers(1, 20000)), int(rng.integers(1, 200000))
    columns = cuda_ffi.split_columns(m, n)
    assert columns % 192 == 0 and 0 <= columns < n, (m, n, columns)
    assert (columns > 0) == (n > 192), (m, n, columns)


@pytest.mark.parametrize("m", [16, 48, 256])
@pytest.mark.parametrize("config", CONFIGS)
def test_dependent_products_read_finished_inputs(m, config, rng):
  # Each kernel is launched with programmatic dependent launch: it may start
  # while the product it reads is still draining, and must wait for it
  # (griddepcontrol.wait) before its first load. A chain of dependent
  # products in one program (XLA's command buffer) and on torch's stream with
  # no sync must give the bits of the same chain run one synchronized step at
  # a time.
  n = 1024
  weights = [random_array(rng, (n, n), jnp.float32) / 32 for _ in range(12)]
  weights = [w.astype(jnp.bfloat16) for w in weights]
  x = random_array(rng, (m, n), jnp.bfloat16)
  step = product(config)
  stepwise = [x]
  for w in weights:
    stepwise.append(step(stepwise[-1], w).block_until_ready())

  @jax.jit
  def chain(x, weights):
    outs = [x]
    for w in weights:
      outs.append(step(outs[-1], w))
    return outs

  for got, want in zip(chain(x, weights)[1:], stepwise[1:]):
    assert_bitwise_equal(got, want, f"M={m} {config} jitted chain")

  import torch  # the bridge's route: torch's current stream, no sync
  as_torch = lambda v: torch.from_dlpack(v).clone()
  t_weights = [as_torch(w) for w in weights]
  t_out = [as_torch(x)]
  stream = torch.cuda.current_stream().cuda_stream
  for w in t_weights:
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cuda_ffi.launch(t_out[-1].data_ptr(), w.data_ptr(), c.data_ptr(), m, n, n,
                    transpose_a=False, transpose_b=False, out_f32=False,
                    stream=stream, config=config)
    t_out.append(c)
  torch.cuda.synchronize()
  for got, want in zip(t_out[1:], stepwise[1:]):
    assert_bitwise_equal(np.asarray(jax.dlpack.from_dlpack(got)), want,
                         f"M={m} {config} torch chain")


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_projections_invariant_accurate_and_same_bits_as_pallas(name, rng):
  k, n = PROJECTIONS[name]
  a = random_array(rng, (4096, k), jnp.bfloat16)
  b = random_array(rng, (k, n), jnp.bfloat16)
  gemm = jax.jit(functools.partial(rlk_jax.det_gemm, implementation="cuda_ffi"))
  full = gemm(a, b)
  for m in (1, 3, 16, 100):
    start = int(rng.integers(0, 4096 - m + 1))
    assert_bitwise_equal(gemm(a[start:start + m], b), full[start:start + m],
                         f"{name} M={m}")
  ref = jnp.dot(a[:64].astype(jnp.float32), b.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  err = float(jnp.linalg.norm(full[:64].astype(jnp.float32) - ref)
              / jnp.linalg.norm(ref))
  assert err < 1e-2, err
  pallas = rlk_jax.det_gemm(a, b, implementation="pallas")
  assert_bitwise_equal(full, pallas, f"{name}: cuda_ffi vs pallas")


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False),
                                   (True, True)])
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_every_layout_and_output_matches_pallas(ta, tb, out, rng):
  m, k, n = 264, 1032, 776  # ragged against every tile
  a = random_array(rng, (k, m) if ta else (m, k), jnp.bfloat16)
  b = random_array(rng, (n, k) if tb else (k, n), jnp.bfloat16)
  want = _det_gemm._matmul("pallas", ta, tb, jnp.dtype(out), a, b)
  layout = (int(ta), int(tb), int(out == jnp.float32))
  built = planned(layout)[0]
  for config in cuda_ffi.B_NK_REFUSED if tb else ():
    # Refused with the reason (built or not: the check comes first).
    with pytest.raises(ValueError, match="TMA box would be 320 rows"):
      product(config, ta, tb, out)(a, b)
    times = cuda_ffi.time_configs(  # the autotuner passes over it
        m, n, k, transpose_a=ta, transpose_b=tb, out_f32=out == jnp.float32,
        configs=[config, built], rounds=1, min_ms=0.0)
    assert times[config] is None and times[built] > 0, times
  assert set(planned(layout)) == set(cuda_ffi.built_configs(*layout))
  for config in planned(layout):
    if tb and config in cuda_ffi.B_NK_REFUSED:
      continue
    got = product(config, ta, tb, out)(a, b)
    assert_bitwise_equal(got, want, f"ta={ta} tb={tb} {config}")
  a64 = np.asarray(a, np.float64)
  b64 = np.asarray(b, np.float64)
  ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
  err = np.linalg.norm(np.asarray(want, np.float64) - ref) / np.linalg.norm(ref)
  assert err < (1e-5 if out == jnp.float32 else 1e-2), err


@pytest.mark.parametrize("m", [1, 7, 100])
def test_tiny_m_and_transpose_b_rows_match_pallas(m, rng):
  k, n = 4096, 14336
  a = random_array(rng, (m, k), jnp.bfloat16)
  w = random_array(rng, (n, k), jnp.bfloat16)  # nn.Linear layout
  got = rlk_jax.det_gemm(a, w, transpose_b=True, implementation="cuda_ffi")
  want = rlk_jax.det_gemm(a, w, transpose_b=True, implementation="pallas")
  assert_bitwise_equal(got, want, f"M={m}")


@pytest.mark.parametrize("m,n", [(3000, 1024), (2600, 11008)])
def test_backward_same_bits_as_pallas(m, n, rng):
  # Determinism, padding and row invariance of the backward:
  # test_det_gemm_gpu.py::test_weight_gradient_padding_inert_at_size.
  # Whatever config rlk_jax measured fastest for each of the three products.
  assert_same_gradients(rng, m, 4096, n, "cuda_ffi", "pallas")


def test_jit_vmap_grad(rng):
  a = random_array(rng, (3, 40, 256), jnp.bfloat16)
  b = random_array(rng, (256, 128), jnp.bfloat16)
  f = functools.partial(rlk_jax.det_gemm, implementation="cuda_ffi")
  batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(a, b)
  assert_bitwise_equal(batched, f(a, b))
  loss = lambda a, b: f(a, b, out_dtype=jnp.float32).sum()
  da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
  assert da.shape == a.shape and db.shape == b.shape
  assert bool(jnp.isfinite(da.astype(jnp.float32)).all())


def test_auto_falls_back_where_the_kernel_cannot_and_named_raises(rng):
  a = random_array(rng, (64, 1001), jnp.bfloat16)  # K not a multiple of 8
  b = random_array(rng, (1001, 256), jnp.bfloat16)
  plan = _det_gemm.plan(a, b)
  # The next kernel that takes them: jax-triton's, else Pallas's.
  triton_reason = rlk_jax.implementations("det_gemm")["triton"]
  assert plan.implementation == ("pallas" if triton_reason else "triton")
  with pytest.raises(ValueError, match=r"cuda_ffi.*cannot take these operands.*"
                                       r"multiples of 8"):
    rlk_jax.det_gemm(a, b, implementation="cuda_ffi")
  with pytest.raises(ValueError, match="operands must be bfloat16"):
    rlk_jax.det_gemm(a.astype(jnp.float16)[:, :1000],
                     b.astype(jnp.float16)[:1000], implementation="cuda_ffi")
  # The library checks again itself: a raw FFI call with bad pitches errors
  # (when its workspace is sized, at trace time).
  with pytest.raises(Exception, match="multiples of 16"):
    jax.block_until_ready(product("auto")(a, b))


def test_torch_route_same_bits_and_gradients(rng):
  torch = pytest.importorskip("torch")
  import rlk_torch_bridge as rtb
  a = random_array(rng, (300, 4096), jnp.bfloat16)
  w = random_array(rng, (1024, 4096), jnp.bfloat16)
  g = random_array(rng, (300, 1024), jnp.bfloat16)
  ta, tw, tg = (torch.from_dlpack(jnp.array(x, copy=True)) for x in (a, w, g))
  ta.requires_grad_()
  tw.requires_grad_()
  torch.cuda.set_sync_debug_mode("error")  # any host sync raises
  try:
    out = rtb.det_gemm(ta, tw, transpose_b=True)
    out.backward(tg)
  finally:
    torch.cuda.set_sync_debug_mode("default")
  f = functools.partial(rlk_jax.det_gemm, transpose_b=True,
                        implementation="cuda_ffi")
  want, vjp = jax.vjp(f, a, w)
  da, dw = vjp(g)
  as_np = lambda t: np.asarray(jax.dlpack.from_dlpack(t.detach()))
  assert_bitwise_equal(as_np(out), want)
  assert_bitwise_equal(as_np(ta.grad), da)
  assert_bitwise_equal(as_np(tw.grad), dw)


def test_c_entry_on_a_fresh_thread(rng):
  # torch's autograd worker for device 0 may reach the library before it
  # made any CUDA call, so with no current context: the entry must make
  # one current, not launch with TMA descriptors the driver refused.
  import threading
  import torch
  a = torch.from_dlpack(random_array(rng, (300, 1024), jnp.bfloat16)).clone()
  b = torch.from_dlpack(random_array(rng, (1024, 4096), jnp.bfloat16)).clone()
  c = torch.full((300, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
  stream = torch.cuda.current_stream().cuda_stream
  errors = []

  def launch():
    try:
      cuda_ffi.launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), 300, 4096,
                      1024, transpose_a=False, transpose_b=False,
                      out_f32=False, stream=stream)
    except Exception as e:  # reported below, in the test's thread
      errors.append(e)

  worker = threading.Thread(target=launch)
  worker.start()
  worker.join()
  assert not errors, errors
  torch.cuda.synchronize()
  want = product("auto")(jax.dlpack.from_dlpack(a), jax.dlpack.from_dlpack(b))
  assert_bitwise_equal(np.asarray(jax.dlpack.from_dlpack(c)), want,
                       "launched from a fresh thread")


# Small ragged problems through the library's C entries (torch owns memory
# and stream): det_gemm in every config and layout, then pack from a mask
# through the one-kernel path (16-byte rows) and the metadata kernels + gather
# (6-byte rows, a mask past the one-kernel limit).
SANITIZE_SCRIPT = textwrap.dedent("""
    import sys, torch, cuda_ffi
    timed = list(cuda_ffi.CONFIGS)[:int(sys.argv[1])]
    REFUSED = sys.argv[2].split(",")
    torch.manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    for (m, k, n) in ((8, 256, 136), (136, 264, 520)):
      for ta in (False, True):
        for tb in (False, True):
          a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=torch.bfloat16)
          b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=torch.bfloat16)
          ref = (a.double().T if ta else a.double()) @ (b.double().T if tb else b.double())
          runs = [c for c in cuda_ffi.built_configs(ta, tb, True)
                  if not (tb and c in REFUSED)]
          for config in [c for c in runs if c != "auto"]:
            c = torch.empty(m, n, device="cuda", dtype=torch.float32)
            cuda_ffi.launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k,
                            transpose_a=ta, transpose_b=tb, out_f32=True,
                            stream=stream, config=config)
            assert ((c.double() - ref).norm() / ref.norm()) < 1e-5, (m, ta, tb, config)
          # the autotuner's measurement: its own buffers, stream and events
          times = cuda_ffi.time_configs(m, n, k, transpose_a=ta, transpose_b=tb,
                                        out_f32=False,
                                        configs=[c for c in timed
                                                 if c in runs] or runs[:1],
                                        rounds=2, min_ms=0.0)
          assert all(t is not None and t > 0 for t in times.values()), times
    import rlk_torch_bridge as rtb
    for shape, tail, capacity in (((5, 300), (64,), 700), ((3, 301), (3,), 450),
                                  ((2, 40000), (8,), 34000)):
      mask = torch.rand(shape, device="cuda") < 0.4
      x = torch.randn(*shape, *tail, device="cuda").to(torch.bfloat16)
      packed, info = rtb.pack(x, mask, capacity=capacity, fill_value=-1.0,
                              implementation="cuda_ffi")
      rows = x[mask]
      n = rows.shape[0]
      assert n <= capacity and torch.equal(packed[:n], rows), shape
      assert bool((packed[n:] == -1).all()), shape
      assert int(info.total) == n, shape
    torch.cuda.synchronize()
    print("sanitized ok")
""")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool, tmp_path):
  sanitizer = "/usr/local/cuda/bin/compute-sanitizer"
  if not os.access(sanitizer, os.X_OK):
    pytest.skip("compute-sanitizer not installed on this machine")
  script = tmp_path / "sanitize.py"
  script.write_text(SANITIZE_SCRIPT)
  cuda_ffi.library()  # build before, not under, the sanitizer
  # Every config runs under both tools; the autotuner's timer times them all
  # under memcheck but four under racecheck, whose host memory grows with
  # each launch it watches: the timer's graphs over 32 operand sets of all
  # 23 configs took 130 GB and were OOM-killed (H100, 2026-11-24), while
  # the same launches outside the timer race-checked clean.
  timed = len(cuda_ffi.CONFIGS) if tool == "memcheck" else 4
  done = subprocess.run(
      [sanitizer, f"--tool={tool}", "--error-exitcode=1", sys.executable,
       str(script), str(timed), ",".join(cuda_ffi.B_NK_REFUSED)],
      capture_output=True, text=True, timeout=540,
      env={**os.environ, "RLK_CUDA_FFI_AUTOBUILD": "0"})
  log = done.stdout + done.stderr
  assert done.returncode == 0 and "sanitized ok" in done.stdout, log[-3000:]
  assert "ERROR SUMMARY: 0 errors" in log or "RACECHECK SUMMARY: 0 hazards" in log, log[-3000:]


def test_logits_stats_kernel_rows_invariant_and_accurate(rng):
  # linear_logp's online logsumexp as a CUDA kernel behind FFI. Two chunks fold into running stats; rows alone give the batch's bits;
  # the stats match float64 sums of everything folded so far.
  from pallas_kernels import linear_logp as pallas_logp
  n, c = 1000, 8192 + 136
  temps = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)  # one a row
  temperature = np.asarray(temps, np.float64)[:, None]
  fold = jax.jit(cuda_ffi.logits_stats)
  stats = pallas_logp.initial_stats(n)
  targets = jnp.asarray(rng.integers(-5, c + 5, n), jnp.int32)
  seen = []
  for step in range(2):
    logits = random_array(rng, (n, c), jnp.float32) * 4
    got = fold(logits, targets, temps, stats)
    for m in (1, 3, 100):
      start = int(rng.integers(0, n - m + 1))
      rows = slice(start, start + m)
      alone = fold(logits[rows], targets[rows], temps[rows],
                   [s[rows] for s in stats])
      for name, g, a in zip(("max", "sum", "picked", "weighted"), got, alone):
        assert_bitwise_equal(a, g[rows], f"chunk {step} {name} M={m}")
    seen.append(np.asarray(logits, np.float64) / temperature)
    x = np.concatenate(seen, axis=1)
    want_max = x.max(axis=1)
    e = np.exp(x - want_max[:, None])
    t = np.asarray(targets)
    picked = sum(np.where((t >= 0) & (t < c), chunk[np.arange(n), np.clip(t, 0, c - 1)], 0.0)
                 for chunk in seen)
    for name, g, w in (("max", got[0], want_max), ("sum", got[1], e.sum(1)),
                       ("picked", got[2], picked),
                       ("weighted", got[3], (e * x).sum(1))):
      assert relative_error(g, w) < 1e-5, (step, name)
    # Without entropy: the same max, sum and picked bits; weighted untouched.
    plain = jax.jit(functools.partial(cuda_ffi.logits_stats,
                                      with_entropy=False))(
        logits, targets, temps, stats)
    for name, g, p in zip(("max", "sum", "picked"), got[:3], plain[:3]):
      assert_bitwise_equal(p, g, f"chunk {step} {name} without entropy")
    assert_bitwise_equal(plain[3], stats[3], "weighted not folded")
    stats = got


def test_logits_finish_and_grad_kernels_rows_invariant_and_accurate(rng):
  # linear_logp's finish (stats -> logp, lse, entropy) and the backward's
  # d logits as CUDA kernels: against float64, and rows alone give the
  # batch's bits. One chunk holds the whole vocabulary here.
  from pallas_kernels import linear_logp as pallas_logp
  n, v = 777, 4096 + 264
  temps = jnp.asarray(rng.uniform(0.5, 1.0, n), jnp.float32)  # one a row
  temperature = np.asarray(temps, np.float64)[:, None]
  logits = random_array(rng, (n, v), jnp.float32) * 4
  targets = jnp.asarray(rng.integers(-3, v + 3, n), jnp.int32)
  g_logp = random_array(rng, (n,), jnp.float32)
  g_entropy = random_array(rng, (n,), jnp.float32)

  @functools.partial(jax.jit, static_argnums=0)
  def run(with_entropy, logits, targets, temps, g_logp, g_entropy):
    stats = cuda_ffi.logits_stats(logits, targets, temps,
                                  pallas_logp.initial_stats(logits.shape[0]),
                                  with_entropy=with_entropy)
    logp, lse, entropy = cuda_ffi.logits_finish(stats, targets, v,
                                                with_entropy=with_entropy)
    valid = (targets >= 0) & (targets < v)
    d = cuda_ffi.logits_grad(logits, targets, temps, lse, entropy,
                             jnp.where(valid, g_logp, 0.0), g_entropy,
                             with_entropy=with_entropy)
    return logp, lse, entropy, d

  got = run(True, logits, targets, temps, g_logp, g_entropy)
  assert got[3].dtype == jnp.bfloat16 and got[3].shape == (n, v)
  for m in (1, 3, 100):
    start = int(rng.integers(0, n - m + 1))
    rows = slice(start, start + m)
    alone = run(True, logits[rows], targets[rows], temps[rows], g_logp[rows],
                g_entropy[rows])
    for name, g, a in zip(("logp", "lse", "entropy", "dlogits"), got, alone):
      assert_bitwise_equal(a, g[rows], f"{name} M={m}")
  # Without entropy: NaN entropy, the same logp and lse bits, and the
  # gradient of a zero entropy cotangent (equal values: only a zero's sign
  # may differ once the entropy term is dropped).
  plain = run(False, logits, targets, temps, g_logp, g_entropy)
  assert np.isnan(np.asarray(plain[2])).all()
  assert_bitwise_equal(plain[0], got[0])
  assert_bitwise_equal(plain[1], got[1])
  zero_ent = run(True, logits, targets, temps, g_logp, jnp.zeros_like(g_logp))
  np.testing.assert_array_equal(np.asarray(plain[3], np.float32),
                                np.asarray(zero_ent[3], np.float32))
  t = np.asarray(targets)
  valid = (t >= 0) & (t < v)
  lse, entropy, d = dense_logp_grads(logits, targets,
                                     np.where(valid, g_logp, 0.0), g_entropy,
                                     temperature)
  x = np.asarray(logits, np.float64) / temperature
  logp = np.where(valid, x[np.arange(n), np.clip(t, 0, v - 1)] - lse, 0.0)
  assert relative_error(got[0], logp) < 1e-6
  assert np.all(np.asarray(got[0])[~valid] == 0)
  assert relative_error(got[1], lse) < 1e-6
  assert relative_error(got[2], entropy) < 1e-5
  assert relative_error(got[3], d) < 5e-3  # bf16's rounding


def test_logits_grad_rejects_chunks_off_its_vector_width():
  logits = jnp.ones((4, 10), jnp.float32)
  rows = jnp.ones((4,), jnp.float32)
  with pytest.raises(Exception, match="multiple of 4"):
    jax.block_until_ready(cuda_ffi.logits_grad(
        logits, jnp.zeros((4,), jnp.int32), rows, rows, rows, rows, rows))
