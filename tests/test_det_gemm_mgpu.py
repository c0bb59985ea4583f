"""det_gemm's Mosaic GPU kernel on the CPU: it lowers for CUDA (Mosaic GPU's
lowering runs in Python, so TMA's and wgmma's layout rules are checked here
for every config, layout and output dtype at ragged shapes), its arithmetic
runs in Mosaic GPU's interpreter (jax >= 0.11: 0.10's interpreter has no
transposed refs or out-of-bounds TMA fills and stalls on this kernel's warp
specialization), and it declines what it cannot take. The hardware's bits:
test_det_gemm_mgpu_gpu.py."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import ON_GPU, random_array, relative_error
from pallas_kernels import det_matmul_mgpu

LAYOUTS = list(itertools.product((False, True), repeat=2))
INTERPRETER = tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11)


def _operands(rng, m, n, k, ta, tb, dtype=jnp.bfloat16):
  a = random_array(rng, (k, m) if ta else (m, k), dtype)
  b = random_array(rng, (n, k) if tb else (k, n), dtype)
  return a, b


def _assert_lowers_for_cuda(config, m, n, k):
  """Every layout x output dtype of `config` lowers for CUDA (TMA's and
  wgmma's layout rules are checked in Python, no GPU needed)."""
  cfg = det_matmul_mgpu.CONFIGS[config]
  for (ta, tb), out in itertools.product(LAYOUTS, (jnp.bfloat16, jnp.float32)):
    a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), jnp.bfloat16)
    f = jax.jit(functools.partial(
        det_matmul_mgpu.matmul, transpose_a=ta, transpose_b=tb, out_dtype=out,
        config=cfg, num_sms=132))
    text = f.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, (config, ta, tb, out)


@pytest.mark.parametrize("config", sorted(det_matmul_mgpu.CONFIGS))
def test_every_config_and_layout_lowers_for_cuda(config):
  # 1001 rows, 776 / 4104 elements per row: none a whole TMA tile.
  _assert_lowers_for_cuda(config, 1001, 4104, 776)


@pytest.mark.parametrize("config", [name for name, cfg in
                                    det_matmul_mgpu.CONFIGS.items()
                                    if cfg.chain])
def test_chained_configs_lower_with_the_chained_pipeline(config):
  # K=1000 is 16 K steps: a depth that divides them exists, so the pipeline
  # runs across tiles (776 above is 13 steps: the unchained fallback).
  assert det_matmul_mgpu._stages(det_matmul_mgpu.CONFIGS[config], 2, 2, 64,
                                 32, 16) == (4, True)
  _assert_lowers_for_cuda(config, 1001, 4104, 1000)


def test_one_warpgroup_ctas_only_where_larger_tiles_leave_sms_idle():
  # 64x64 CTAs (one compute warpgroup) run at about a third of 128x256's
  # rate: the rule takes them for small products, never at full waves.
  choose, names = det_matmul_mgpu.choose_config, {
      cfg: name for name, cfg in det_matmul_mgpu.CONFIGS.items()}
  assert names[choose(128, 2048, 132)] == "64x64"  # 64 CTAs, not 16 or 32
  assert names[choose(256, 2048, 132)] == "64x64"
  for m, n in itertools.product((1024, 4096, 16384), (768, 2048, 14336)):
    assert names[choose(m, n, 132)] != "64x64", (m, n)
  cfg = det_matmul_mgpu.CONFIGS["64x64"]
  assert (cfg.cta_m, cfg.cta_n, cfg.wg_split) == (64, 64, None)


def test_pipeline_depth_fits_shared_memory_and_divides_chained_k_steps():
  stages, config = det_matmul_mgpu._stages, det_matmul_mgpu.MgpuConfig
  # 128x256 stages are 48 KiB: three fit beside a 64x64 epilogue, four
  # beside a 64x32 one.
  assert stages(config(128, 128, "n"), 2, 2, 64, 64, 64) == (3, False)
  assert stages(config(128, 128, "n", epilogue_n=32), 2, 2, 64, 32,
                64) == (4, False)
  chained = config(128, 128, "n", epilogue_n=32, chain=True)
  for k_iters, want in ((64, (4, True)), (56, (4, True)), (18, (3, True)),
                        (26, (2, True)), (13, (4, False)), (3, (3, True)),
                        (1, (1, True))):
    assert stages(chained, 2, 2, 64, 32, k_iters) == want, k_iters


@pytest.mark.skipif(not INTERPRETER, reason=(
    "Mosaic GPU's interpreter before jax 0.11 cannot run this kernel "
    "(transposed refs, TMA zero fill, warp specialization); the device "
    "tests run it on hardware"))
@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_interpreted_products_are_accurate_at_ragged_shapes(ta, tb, rng):
  for (m, n, k), out, config in ((( 200, 136, 104), jnp.float32, "128x256"),
                                 ((72, 264, 520), jnp.bfloat16, "256x128"),
                                 ((1, 64, 64), jnp.float32, "64x256"),
                                 ((130, 72, 200), jnp.float32, "64x64")):
    a, b = _operands(rng, m, n, k, ta, tb)
    got = det_matmul_mgpu.matmul(a, b, transpose_a=ta, transpose_b=tb,
                                 out_dtype=out, num_sms=3, interpret=True,
                                 config=det_matmul_mgpu.CONFIGS[config])
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
    assert got.shape == (m, n) and got.dtype == out
    assert relative_error(got, ref) < (1e-6 if out == jnp.float32 else 5e-3)


@pytest.mark.skipif(not INTERPRETER, reason=(
    "Mosaic GPU's interpreter before jax 0.11 cannot run this kernel "
    "(transposed refs, TMA zero fill, warp specialization); the device "
    "tests run it on hardware"))
@pytest.mark.parametrize("config,ta,tb", [
    (det_matmul_mgpu.MgpuConfig(128, 128, "n", chain=True), False, True),
    (det_matmul_mgpu.CONFIGS["256x128_c2m"], False, True),
    (det_matmul_mgpu.MgpuConfig(128, 128, "n", chain=True, cluster="n"),
     True, True)], ids=["chain", "256x128_c2m", "chain_c2n"])
def test_interpreted_chained_and_clustered_tiles_are_accurate(config, ta, tb,
                                                              rng):
  # 300x520 in 128x256 CTA tiles is 3x3 (256x128: 2x5); K=1000 is 16 K
  # steps, chained at depth 4. Two SMs: one runs a first, middle(s) and a
  # last tile; a cluster's second CTA lies past M or N.
  m, n, k = 300, 520, 1000
  a, b = _operands(rng, m, n, k, ta, tb)
  got = det_matmul_mgpu.matmul(a, b, transpose_a=ta, transpose_b=tb,
                               out_dtype=jnp.float32, num_sms=2,
                               interpret=True, config=config)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
  assert relative_error(got, ref) < 1e-6


def test_operand_reasons_and_cpu_availability():
  reason = det_matmul_mgpu.operand_reason
  assert reason(7, 776, 1001, True, True, jnp.bfloat16, jnp.float32) is None
  assert "bfloat16 or float16" in reason(8, 8, 8, False, False, jnp.float32,
                                         jnp.float32)
  assert "float32" in reason(8, 8, 8, False, False, jnp.bfloat16, jnp.int8)
  if not ON_GPU:
    why = rlk_jax.implementations("det_gemm")["mosaic_gpu"]
    assert why is not None and "NVIDIA GPUs" in why
    with pytest.raises(RuntimeError, match="mosaic_gpu.*not available"):
      rlk_jax.det_gemm(jnp.ones((8, 8), jnp.bfloat16),
                       jnp.ones((8, 8), jnp.bfloat16),
                       implementation="mosaic_gpu")


def test_empty_products_need_no_launch():
  for m, k in ((0, 64), (16, 0)):
    got = det_matmul_mgpu.matmul(jnp.ones((m, k), jnp.bfloat16),
                                 jnp.ones((k, 24), jnp.bfloat16),
                                 out_dtype=jnp.float32)
    assert got.shape == (m, 24) and not np.asarray(got).any()
