"""rlk_torch_bridge: the same bits as rlk_jax, torch autograd, clear errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import rlk_jax
import rlk_torch_bridge as rtb
from rlk_torch_bridge import _logp_op
from conftest import assert_bitwise_equal


def t2n(t):
  """torch -> NumPy keeping the bits (bf16 via its uint16 view)."""
  t = t.detach().cpu()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(jnp.bfloat16)
  return t.numpy()


def cpu(t):
  """The JAX CPU array of CPU tensor `t`: on a GPU machine too, the bridge
  runs CPU tensors on JAX's CPU device, with the CPU's implementation."""
  return jax.device_put(t2n(t), jax.devices("cpu")[0])


def randn(rng, shape, dtype=torch.float32):
  return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_det_gemm_same_bits_as_jax(dtype, rng):
  a, b = randn(rng, (3, 37, 200), dtype), randn(rng, (200, 70), dtype)
  c = rtb.det_gemm(a, b)
  assert c.dtype == dtype and c.shape == (3, 37, 70)
  expected = rlk_jax.det_gemm(cpu(a), cpu(b), implementation="xla")
  assert_bitwise_equal(t2n(c), np.asarray(expected))


def test_det_gemm_gradients_same_bits_as_jax(rng):
  a = randn(rng, (50, 96)).requires_grad_()
  b = randn(rng, (96, 40)).requires_grad_()
  g = randn(rng, (50, 40))
  out = rtb.det_gemm(a, b)
  with torch.no_grad():  # the inference path builds no VJP: same bits
    assert torch.equal(rtb.det_gemm(a, b).view(torch.int32), out.view(torch.int32))
  out.backward(g)
  _, vjp = jax.vjp(functools.partial(rlk_jax.det_gemm, implementation="xla"),
                   cpu(a), cpu(b))
  da, db = vjp(cpu(g))
  assert_bitwise_equal(t2n(a.grad), np.asarray(da))
  assert_bitwise_equal(t2n(b.grad), np.asarray(db))
  # Against torch's own float64 math.
  ref_da = g.double() @ b.detach().double().T
  assert torch.linalg.norm(a.grad.double() - ref_da) / torch.linalg.norm(ref_da) < 1e-6


def test_det_gemm_non_contiguous_and_out_dtype(rng):
  a = randn(rng, (64, 30)).T           # [30, 64], a transposed view
  b = randn(rng, (64, 16))
  assert not a.is_contiguous()
  c = rtb.det_gemm(a, b, out_dtype=torch.bfloat16)
  assert c.dtype == torch.bfloat16
  expected = rlk_jax.det_gemm(cpu(a.contiguous()), cpu(b), out_dtype=jnp.bfloat16,
                              implementation="xla")
  assert_bitwise_equal(t2n(c), np.asarray(expected))


def test_det_gemm_errors_match_the_jax_op(rng):
  a, b = randn(rng, (4, 8)), randn(rng, (9, 3))
  with pytest.raises(ValueError, match=r"rlk_jax.det_gemm: inner dimensions differ"):
    rtb.det_gemm(a, b)
  with pytest.raises(TypeError, match="same dtype"):
    rtb.det_gemm(a, randn(rng, (8, 3), torch.bfloat16))
  with pytest.raises(TypeError, match="must be a torch.Tensor"):
    rtb.det_gemm(np.ones((4, 8)), b)


def test_det_linear_and_replace_linear(rng):
  torch.manual_seed(int(rng.integers(2**31)))
  model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(),
                              torch.nn.Linear(48, 8, bias=False))
  x = randn(rng, (5, 7, 32))
  reference = model(x)
  weights = [p for p in model.parameters()]
  swapped = rtb.replace_linear(model)
  assert isinstance(swapped[0], rtb.DetLinear) and isinstance(swapped[2], rtb.DetLinear)
  assert [p for p in swapped.parameters()] == weights and all(
      p is q for p, q in zip(swapped.parameters(), weights))  # same Parameters
  out = swapped(x)
  assert torch.allclose(out, reference, rtol=1e-5, atol=1e-5)
  # Each row alone gives the same bits as inside the batch.
  alone = swapped(x[2:3, 4:5])
  assert torch.equal(alone.view(torch.int32), out[2:3, 4:5].view(torch.int32))
  out.square().sum().backward()
  assert all(p.grad is not None and torch.isfinite(p.grad).all()
             for p in swapped.parameters())
  fresh = rtb.DetLinear(16, 4)
  assert fresh.weight.shape == (4, 16) and fresh(randn(rng, (3, 16))).shape == (3, 4)


def test_pack_unpack_same_bits_and_gradients(rng):
  mask = torch.from_numpy(rng.random((6, 40)) < 0.4)
  x = randn(rng, (6, 40, 8)).requires_grad_()
  capacity = int(mask.sum()) + 5
  packed, info = rtb.pack(x, mask, capacity=capacity, fill_value=-1)
  j_packed, j_info = rlk_jax.pack(jnp.asarray(t2n(x)), t2n(mask), capacity=capacity,
                                  fill_value=-1)
  assert_bitwise_equal(t2n(packed), np.asarray(j_packed))
  for field in ("cu_seqlens", "segment_ids", "positions", "gather_map",
                "scatter_map", "valid", "total", "num_dropped"):
    assert_bitwise_equal(t2n(getattr(info, field)), np.asarray(getattr(j_info, field)))
  dense = rtb.unpack(packed * 3, info)
  expected = torch.where(mask[..., None], x.detach() * 3, torch.zeros(()))
  assert torch.equal(dense, expected)
  w = randn(rng, (6, 40, 8))
  (dense * w).sum().backward()
  # d(unpack(3 * pack(x))) = 3 w where active, 0 elsewhere.
  assert torch.equal(x.grad, torch.where(mask[..., None], 3 * w, torch.zeros(())))


def test_pack_reuses_info_and_keeps_int64_bits(rng):
  mask = torch.from_numpy(rng.random((4, 30)) < 0.5)
  hidden = randn(rng, (4, 30, 6), torch.bfloat16)
  ids = torch.from_numpy(rng.integers(2**40, 2**41, (4, 30)))  # beyond int32
  _, info = rtb.pack(hidden, mask)
  packed_ids, info2 = rtb.pack(ids, info)
  assert info2 is info and packed_ids.dtype == torch.int64
  n = int(mask.sum())
  assert torch.equal(packed_ids[:n], ids[mask])
  assert torch.equal(packed_ids[n:], torch.zeros_like(packed_ids[n:]))
  assert torch.equal(rtb.unpack(packed_ids, info), torch.where(mask, ids, 0))


def test_pack_errors(rng):
  x = randn(rng, (4, 5, 3))
  with pytest.raises(ValueError, match=r"\(4, 6\) must be a prefix of x's shape \(4, 5, 3\)"):
    rtb.pack(x, torch.ones(4, 6, dtype=torch.bool))
  with pytest.raises(ValueError, match="active rows but capacity is 2"):
    rtb.pack(x, torch.ones(4, 5, dtype=torch.bool), capacity=2)
  with pytest.raises(TypeError, match="must be the PackInfo"):
    rtb.unpack(x, None)
  with pytest.raises(TypeError, match="unsupported dtype torch.complex64"):
    rtb.pack(x.to(torch.complex64), torch.ones(4, 5, dtype=torch.bool))


def test_import_leaves_user_preallocation_setting_alone():
  import os
  import subprocess
  import sys
  code = ("import os, rlk_torch_bridge; "
          "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])")
  env = dict(os.environ)
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout.strip()
  assert out == "false"
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout.strip()
  assert out == "true"


def test_linear_logp_same_bits_and_gradients_as_jax(rng):
  v, h = 50, 32
  hidden = randn(rng, (2, 9, h)).requires_grad_()
  weight = (randn(rng, (v, h)) / 8).requires_grad_()  # lm_head.weight [V, H]
  targets = torch.from_numpy(rng.integers(0, v, (2, 9)))
  targets[0, 3] = targets[1, 8] = -100
  logp, entropy = rtb.linear_logp(hidden, weight, targets, temperature=0.8,
                                  return_entropy=True)
  g_logp, g_ent = randn(rng, (2, 9)), randn(rng, (2, 9))
  torch.autograd.backward((logp, entropy), (g_logp, g_ent))
  f = functools.partial(rlk_jax.linear_logp, targets=cpu(targets.to(torch.int32)),
                        temperature=0.8, return_entropy=True, implementation="xla")
  # Jitted like the bridge's calls: XLA's fusion (e.g. FMA contraction on
  # CPUs) is part of what a compiled JAX op computes, so the reference is the
  # jitted forward+VJP, not op-by-op eager JAX.
  (want_logp, want_ent), vjp = jax.jit(lambda h, w: jax.vjp(f, h, w))(
      cpu(hidden), cpu(weight.detach().T.contiguous()))
  dh, dw = jax.jit(lambda vjp, g: vjp(g))(vjp, (cpu(g_logp), cpu(g_ent)))
  assert_bitwise_equal(t2n(logp), np.asarray(want_logp))
  assert_bitwise_equal(t2n(entropy), np.asarray(want_ent))
  assert logp[0, 3] == 0 and logp[1, 8] == 0 and (logp <= 0).all()
  assert_bitwise_equal(t2n(hidden.grad), np.asarray(dh))
  assert_bitwise_equal(t2n(weight.grad), np.asarray(dw).T)
  # Returned in the weight's own [V, H] layout: accumulated without a copy.
  assert weight.grad.is_contiguous() and weight.grad.shape == (v, h)
  with torch.no_grad():  # the inference path: the same bits
    assert torch.equal(rtb.linear_logp(hidden, weight, targets, temperature=0.8), logp)


def test_linear_logp_per_sample_temperature_same_bits_as_jax(rng):
  v, h = 50, 32
  hidden = randn(rng, (3, 7, h)).requires_grad_()
  weight = (randn(rng, (v, h)) / 8).requires_grad_()
  targets = torch.from_numpy(rng.integers(0, v, (3, 7)))
  temps = torch.from_numpy(rng.uniform(0.5, 1.5, (3, 1)).astype(np.float32))
  logp = rtb.linear_logp(hidden, weight, targets, temperature=temps)
  g = randn(rng, (3, 7))
  logp.backward(g)
  f = lambda hd, w: rlk_jax.linear_logp(
      hd, w, cpu(targets.to(torch.int32)), temperature=cpu(temps),
      implementation="xla")
  want, vjp = jax.jit(lambda hd, w: jax.vjp(f, hd, w))(
      cpu(hidden), cpu(weight.detach().T.contiguous()))
  dh, dw = jax.jit(lambda vjp, g: vjp(g))(vjp, cpu(g))
  assert_bitwise_equal(t2n(logp), np.asarray(want))
  assert_bitwise_equal(t2n(hidden.grad), np.asarray(dh))
  assert_bitwise_equal(t2n(weight.grad), np.asarray(dw).T)


def test_linear_logp_weight_grad_accumulator_sums_micro_batches_in_f32(rng):
  # Two micro-batches into one f32 buffer: the f32 sum of the two f32
  # gradients (each the bf16 gradient before its rounding), weight.grad
  # untouched, the hidden gradients as without the buffer.
  v, h = 64, 32
  weight = (randn(rng, (v, h)) / 8).to(torch.bfloat16).requires_grad_()
  acc = torch.zeros(v, h, dtype=torch.float32)
  batches = [(randn(rng, (11, h)).to(torch.bfloat16).requires_grad_(),
              torch.from_numpy(rng.integers(0, v, 11))) for _ in range(2)]
  want = torch.zeros(v, h, dtype=torch.float32)
  for hidden, targets in batches:
    rtb.linear_logp(hidden, weight, targets,
                    weight_grad_accumulator=acc).sum().backward()
    assert weight.grad is None
    plain_h = hidden.detach().clone().requires_grad_()
    plain_w = weight.detach().clone().requires_grad_()
    rtb.linear_logp(plain_h, plain_w, targets).sum().backward()
    assert torch.equal(hidden.grad, plain_h.grad)
    one = torch.zeros(v, h, dtype=torch.float32)
    rtb.linear_logp(plain_h.detach().requires_grad_(), weight.detach(),
                    targets, weight_grad_accumulator=one).sum().backward()
    assert torch.equal(one.to(torch.bfloat16), plain_w.grad)  # f32, unrounded
    want += one
  assert torch.equal(acc, want)
  with pytest.raises(ValueError, match=r"weight_grad_accumulator must be f32 "
                     r"of the weight's shape \(64, 32\), got torch.bfloat16"):
    rtb.linear_logp(hidden, weight, targets,
                    weight_grad_accumulator=acc.to(torch.bfloat16))


def test_linear_logp_entropy_only_when_asked_and_compiled(rng):
  v, h = 40, 16
  hidden = randn(rng, (2, 5, h)).requires_grad_()
  weight = (randn(rng, (v, h)) / 8).requires_grad_()
  targets = torch.from_numpy(rng.integers(0, v, (2, 5)))
  temps = torch.full((2, 1), 0.7)
  _, entropy, _ = _logp_op.FORWARD(hidden.detach().reshape(10, h),
                                   weight.detach(), targets.reshape(10).int(),
                                   temps.expand(2, 5).reshape(10), 8192,
                                   False, "xla")
  assert entropy.shape == (0,)  # not computed, not returned
  logp = rtb.linear_logp(hidden, weight, targets, temperature=temps)
  with_ent, _ = rtb.linear_logp(hidden, weight, targets, temperature=temps,
                                return_entropy=True)
  assert torch.equal(logp, with_ent)
  compiled = torch.compile(rtb.linear_logp, backend="aot_eager", fullgraph=True)
  assert torch.equal(compiled(hidden, weight, targets, temperature=temps), logp)


def test_linear_logp_errors(rng):
  hidden, weight = randn(rng, (4, 8)), randn(rng, (10, 8))
  with pytest.raises(ValueError, match=r"lm_head.weight \[V, H\], got shape \(80,\)"):
    rtb.linear_logp(hidden, weight.reshape(-1), torch.zeros(4, dtype=torch.long))
  with pytest.raises(TypeError, match="targets must be integers"):
    rtb.linear_logp(hidden, weight, torch.zeros(4))
  with pytest.raises(TypeError, match=r"weight \(torch.float32\) must have "
                     r"hidden's dtype \(torch.bfloat16\)"):
    rtb.linear_logp(hidden.bfloat16(), weight, torch.zeros(4, dtype=torch.long))
  with pytest.raises(ValueError, match=r"hidden \(4, 7\) must end in H=8"):
    rtb.linear_logp(randn(rng, (4, 7)), weight, torch.zeros(4, dtype=torch.long))
  targets = torch.zeros(4, dtype=torch.long)
  with pytest.raises(ValueError, match=r"temperature of shape \(3,\) does not "
                     r"broadcast to the targets' shape \(4,\)"):
    rtb.linear_logp(hidden, weight, targets, temperature=torch.ones(3))
  with pytest.raises(ValueError, match="temperature must be > 0"):
    rtb.linear_logp(hidden, weight, targets,
                    temperature=torch.tensor([1.0, 0.0, 1.0, 1.0]))
  with pytest.raises(ValueError, match="temperature requires grad"):
    rtb.linear_logp(hidden, weight, targets,
                    temperature=torch.ones(4, requires_grad=True))


def test_linear_logp_out_of_range_targets(rng):
  hidden, weight = randn(rng, (4, 8)), randn(rng, (10, 8))
  targets = torch.tensor([1, 10, -100, -3])
  with pytest.raises(ValueError, match=r"target id 10 \(flat position 1; 2 "
                     r"such ids\) is outside the vocabulary \[0, V=10\)"):
    rtb.linear_logp(hidden, weight, targets)
  # traced (no host check): NaN where the id is out of range, 0 where ignored
  compiled = torch.compile(rtb.linear_logp, backend="aot_eager", fullgraph=True)
  logp = compiled(hidden, weight, targets)
  assert torch.isnan(logp[1]) and torch.isnan(logp[3]) and logp[2] == 0
  assert torch.isfinite(logp[0])


def test_pack_info_fields_view_one_buffer_and_convert_to_jax(rng):
  x = randn(rng, (3, 10, 4))
  mask = torch.from_numpy(rng.random((3, 10)) < 0.5)
  packed, info = rtb.pack(x, mask)
  assert info.buffer.dtype == torch.uint8 and info.buffer.ndim == 1
  for field in ("cu_seqlens", "gather_map", "scatter_map", "valid"):
    view = getattr(info, field)
    assert view.untyped_storage().data_ptr() == info.buffer.untyped_storage().data_ptr()
  j_info = info.to_jax()
  _, want = rlk_jax.pack(jnp.asarray(t2n(x)), t2n(mask))
  for field in ("cu_seqlens", "segment_ids", "positions", "scatter_map", "valid"):
    assert_bitwise_equal(np.asarray(getattr(j_info, field)),
                         np.asarray(getattr(want, field)))
  again, _ = rtb.pack(x * 2, info)
  assert torch.equal(again, packed * 2)


def test_ops_take_the_fast_dlpack_route(rng, public_dlpack_forbidden):
  mask = torch.from_numpy(rng.random((5, 12)) < 0.5)
  x = randn(rng, (5, 12, 3)).requires_grad_()
  packed, info = rtb.pack(x, mask)
  dense = rtb.unpack(packed * 2, info)
  dense.sum().backward()
  assert torch.equal(x.grad, torch.where(mask[..., None], 2.0, 0.0).expand_as(x))
  assert torch.equal(info.cu_seqlens[1:] - info.cu_seqlens[:-1],
                     mask.sum(1).to(torch.int32))
  a, b = randn(rng, (4, 8)).requires_grad_(), randn(rng, (8, 3))
  rtb.det_gemm(a, b, implementation="xla").sum().backward()
  assert a.grad.shape == (4, 8)
