"""triton_kernels.det_matmul on a CUDA GPU (`pytest -m gpu`): the @triton.jit
kernel through jax-triton (rlk_jax's "triton" implementation) and launched
natively from torch (the bridge), against each other and against the
Pallas and SM90 kernels, bitwise; every tile config alike; rows invariant."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from rlk_jax import _det_gemm as det_gemm_module
from conftest import (ON_GPU, assert_bitwise_equal, assert_row_windows_match,
                      random_array, relative_error)
from pallas_kernels import det_matmul as pallas_det_matmul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU"),
    pytest.mark.skipif(ON_GPU and rlk_jax.implementations("det_gemm")["triton"]
                       is not None, reason="requires triton and jax-triton"),
]

# (M, K, N, transpose_a, transpose_b): ragged M/N/K, power-of-two K, and the
# backward's stored-transposed layouts.
CASES = [(1, 4096, 4096, False, False), (3, 1000, 264, False, False),
         (17, 1024, 1000, False, True), (300, 512, 2000, True, False),
         (264, 776, 1032, True, True), (1000, 4096, 4096, False, False)]


def _operands(rng, case, dtype):
  m, k, n, ta, tb = case
  return (random_array(rng, (k, m) if ta else (m, k), dtype),
          random_array(rng, (n, k) if tb else (k, n), dtype))


def _det_gemm(impl, ta, tb, out_dtype):
  return jax.jit(functools.partial(det_gemm_module._matmul, impl, ta, tb,
                                   jnp.dtype(out_dtype)))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_equals_pallas_and_cuda_ffi_bits(case, out_dtype, rng):
  m, k, n, ta, tb = case
  a, b = _operands(rng, case, jnp.bfloat16)
  got = _det_gemm("triton", ta, tb, out_dtype)(a, b)
  assert_bitwise_equal(got, _det_gemm("pallas", ta, tb, out_dtype)(a, b),
                       "triton vs pallas")
  sm90 = det_gemm_module.TABLE.implementations["cuda_ffi"]
  if (rlk_jax.implementations("det_gemm")["cuda_ffi"] is None
      and sm90.operand_reason(det_gemm_module.product_operands(
          a.shape, b.shape, ta, tb, a.dtype, jnp.dtype(out_dtype))) is None):
    assert_bitwise_equal(got, _det_gemm("cuda_ffi", ta, tb, out_dtype)(a, b),
                         "triton vs cuda_ffi")
  ref = (np.asarray(a, np.float64).T if ta else np.asarray(a, np.float64)) @ (
      np.asarray(b, np.float64).T if tb else np.asarray(b, np.float64))
  err = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
  assert err < (1e-5 if out_dtype == jnp.float32 else 8e-3), err


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_every_tile_config_gives_the_same_bits(case, rng):
  from triton_kernels import det_matmul
  m, k, n, ta, tb = case
  a, b = _operands(rng, case, jnp.bfloat16)
  outs = {name: jax.jit(functools.partial(
      det_matmul.matmul, transpose_a=ta, transpose_b=tb,
      out_dtype=jnp.bfloat16, config=cfg))(a, b)
          for name, cfg in pallas_det_matmul.NAMED_CONFIGS.items()}
  first = next(iter(outs))
  for name, out in outs.items():
    assert_bitwise_equal(out, outs[first], f"{name} vs {first}")


def test_rows_are_batch_invariant(rng):
  a = random_array(rng, (2048, 4096), jnp.bfloat16)
  b = random_array(rng, (4096, 3584), jnp.bfloat16)
  gemm = jax.jit(lambda a, b: rlk_jax.det_gemm(a, b, implementation="triton"))
  full = gemm(a, b)
  assert_row_windows_match(gemm, a, b, full, (1, 7, 100, 257), rng)


def test_torch_launches_the_same_kernel_with_jax_bits(rng):
  torch = pytest.importorskip("torch")
  import rlk_torch_bridge as rtb
  a, b = _operands(rng, (300, 1000, 776, False, False), jnp.bfloat16)
  ta = torch.from_dlpack(a).clone().requires_grad_(True)
  tb = torch.from_dlpack(b).clone().requires_grad_(True)
  out = rtb.det_gemm(ta, tb, implementation="triton")
  want = rlk_jax.det_gemm(a, b, implementation="triton")
  assert_bitwise_equal(out.detach().view(torch.int16).cpu().numpy(),
                       np.asarray(want).view(np.int16))
  g = torch.randn_like(out)
  out.backward(g)
  _, vjp = jax.vjp(lambda a, b: rlk_jax.det_gemm(a, b, implementation="triton"),
                   a, b)
  da, db = vjp(jnp.asarray(g.cpu().float().numpy()).astype(jnp.bfloat16))
  for name, got, exp in (("da", ta.grad, da), ("db", tb.grad, db)):
    assert_bitwise_equal(got.view(torch.int16).cpu().numpy(),
                         np.asarray(exp).view(np.int16), name)
  # Captured in a CUDA graph, replayed on new inputs: eager's bits.
  x, w = ta.detach().clone(), tb.detach().clone()
  rtb.det_gemm(x, w, implementation="triton")  # compile outside the capture
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    captured = rtb.det_gemm(x, w, implementation="triton")
  x.copy_(torch.randn_like(x))
  graph.replay()
  torch.cuda.synchronize()
  assert torch.equal(captured.view(torch.int16),
                     rtb.det_gemm(x, w, implementation="triton")
                     .view(torch.int16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32, jnp.bool_])
def test_pack_and_unpack_with_the_triton_gather_move_the_same_bits(dtype,
                                                                    rng):
  x = random_array(rng, (8, 300, 136), jnp.float32)
  x = (x > 0) if dtype == jnp.bool_ else (x * 100).astype(dtype)
  mask = jnp.asarray(rng.random((8, 300)) < 0.4)
  want, want_info = jax.jit(functools.partial(
      rlk_jax.pack, capacity=1024, implementation="xla"))(x, mask)
  got, info = jax.jit(functools.partial(
      rlk_jax.pack, capacity=1024, implementation="triton"))(x, mask)
  assert_bitwise_equal(got, want, "packed rows")
  back = jax.jit(functools.partial(rlk_jax.unpack, implementation="triton"))(
      got, info)
  assert_bitwise_equal(back, jax.jit(functools.partial(
      rlk_jax.unpack, implementation="xla"))(want, want_info), "unpacked")


def test_pack_gradient_through_the_triton_gather(rng):
  x = random_array(rng, (4, 200, 64), jnp.float32)
  mask = jnp.asarray(rng.random((4, 200)) < 0.5)
  w = random_array(rng, (1024, 64), jnp.float32)
  grads = [jax.jit(jax.grad(lambda x, impl=impl: (rlk_jax.pack(
      x, mask, capacity=1024, implementation=impl)[0] * w).sum()))(x)
           for impl in ("xla", "triton")]
  assert_bitwise_equal(grads[1], grads[0])


@pytest.mark.parametrize("n,h,v", [(1000, 4096, 32000), (37, 1024, 1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logp_jax_and_torch_launches_share_bits(n, h, v, temperature,
                                                       rng):
  # Ragged N and V. The same @triton.jit kernel from jax-triton and from
  # torch: equal bits. Against the Pallas kernel (the same arithmetic through
  # XLA's own Triton, whose reduction layouts differ): ulps, so by norm.
  torch = pytest.importorskip("torch")
  from pallas_kernels import linear_logp as pallas_logp
  from triton_kernels import linear_logp as triton_logp
  hidden = random_array(rng, (n, h), jnp.bfloat16) / 3
  weight = (random_array(rng, (h, v), jnp.float32) * 0.02).astype(jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
  temps = jnp.asarray(temperature * rng.uniform(0.8, 1.25, n), jnp.float32)
  cfg = pallas_logp.DEFAULT_CONFIG
  got = jax.jit(functools.partial(triton_logp.linear_logp, config=cfg))(
      hidden, weight, targets, temps)
  outs = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(3)]
  triton_logp.linear_logp_torch(
      *(torch.from_dlpack(x).contiguous()
        for x in (hidden, weight, targets, temps)), *outs, config=cfg)
  torch.cuda.synchronize()
  want = jax.jit(functools.partial(pallas_logp.linear_logp, config=cfg))(
      hidden, weight, targets, temps)
  for name, g, t, w in zip(("logp", "lse", "entropy"), got, outs, want):
    assert_bitwise_equal(t.cpu().numpy(), g, f"{name}: torch vs jax-triton")
    assert relative_error(g, w) < 1e-6, f"{name} against the Pallas kernel"


def test_stats_kernel_jax_and_torch_launches_share_bits(rng):
  torch = pytest.importorskip("torch")
  from pallas_kernels import linear_logp as pallas_logp
  from triton_kernels import linear_logp as triton_logp
  n, c = 1000, 8192 + 136
  cfg = pallas_logp.DEFAULT_CONFIG
  stats = pallas_logp.initial_stats(n)
  targets = jnp.asarray(rng.integers(-5, c + 5, n), jnp.int32)
  temps = jnp.asarray(rng.uniform(0.6, 1.2, n), jnp.float32)
  for step in range(2):  # a second chunk folds into non-initial stats
    logits = random_array(rng, (n, c), jnp.float32) * 4
    got = jax.jit(functools.partial(triton_logp.update_stats, config=cfg))(
        logits, targets, temps, stats)
    in_place = [torch.from_dlpack(s).clone() for s in stats]
    triton_logp.update_stats_torch(
        torch.from_dlpack(logits).contiguous(),
        torch.from_dlpack(targets).contiguous(),
        torch.from_dlpack(temps).contiguous(), in_place, config=cfg)
    torch.cuda.synchronize()
    want = jax.jit(functools.partial(pallas_logp.update_stats, config=cfg))(
        logits, targets, temps, stats)
    for name, g, t, w in zip(("max", "sum", "picked", "weighted"), got,
                             in_place, want):
      assert_bitwise_equal(t.cpu().numpy(), g, f"chunk {step} {name}: torch")
      assert relative_error(g, w) < 1e-6, f"chunk {step} {name} vs Pallas"
    stats = got


def test_default_routes_take_no_deprecated_pallas_lowering(rng):
  # JAX 0.11 deprecated Pallas's Triton lowering (a DeprecationWarning at
  # lowering time). With jax-triton present, no default route lowers through
  # it: det_gemm where the SM90 kernel declines (K=1001) and its backward,
  # pack and unpack, linear_logp and its gradient. Fresh shapes: compiled here.
  import warnings
  a = random_array(rng, (72, 1001), jnp.bfloat16)
  b = random_array(rng, (1001, 136), jnp.bfloat16)
  x = random_array(rng, (3, 40, 24), jnp.bfloat16)
  mask = jnp.asarray(rng.random((3, 40)) < 0.6)
  hidden = random_array(rng, (40, 256), jnp.bfloat16)
  weight = random_array(rng, (256, 1000), jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, 1000, 40), jnp.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    jax.block_until_ready(jax.jit(jax.grad(
        lambda a, b: rlk_jax.det_gemm(a, b).astype(jnp.float32).sum(),
        argnums=(0, 1)))(a, b))
    packed, info = jax.jit(functools.partial(rlk_jax.pack, capacity=96))(
        x, mask)
    jax.block_until_ready(jax.jit(rlk_jax.unpack)(packed, info))
    jax.block_until_ready(jax.jit(jax.grad(
        lambda h, w: rlk_jax.linear_logp(h, w, targets).sum(),
        argnums=(0, 1)))(hidden, weight))


def test_launcher_fast_path_gives_tritons_own_launch_bits():
  # triton_kernels.backend.Launcher: after its first launch of a key it
  # calls the compiled kernel directly (and so does a launch prepared for
  # its scalars); the bits are Triton's own launch's, and an argument
  # Triton specialises otherwise (a misaligned view) gets its own compiled
  # kernel.
  torch = pytest.importorskip("torch")
  from triton_kernels import row_sum
  from triton_kernels.backend import Launcher
  k = 4096 + 17
  flat = torch.randn(40 * k, device="cuda").to(torch.bfloat16)
  launcher = Launcher(row_sum._row_mean_kernel)
  for offset, rows in ((0, 37), (1, 36)):
    x = flat[offset:offset + rows * k].view(rows, k)
    want = torch.empty(rows, dtype=torch.bfloat16, device="cuda")
    row_sum._row_mean_kernel[(rows,)](
        x, want, k, x.stride(0), float(k), BLOCK=row_sum.block_for(k),
        num_warps=4)
    for _ in range(3):
      got = torch.full_like(want, float("nan"))
      launcher((rows,), ("mean",), x, got, k, x.stride(0), float(k),
               BLOCK=row_sum.block_for(k), num_warps=4)
      assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # A prepared launch (scalars, grid and constexprs fixed; the tensors
    # passed per call): the same kernel, the same bits.
    prepared = launcher.prepared((rows,), ("mean",), (k, x.stride(0),
                                                      float(k)),
                                 BLOCK=row_sum.block_for(k), num_warps=4)
    for _ in range(2):
      got = torch.full_like(want, float("nan"))
      prepared(x, got)
      assert torch.equal(got.view(torch.int16), want.view(torch.int16))
  assert len(launcher._compiled) == 2
