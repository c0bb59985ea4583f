"""The torch bridge on a CUDA GPU (run with `pytest -m gpu`): bits, devices,
stream order and input lifetime."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import rlk_jax
import rlk_torch_bridge as rtb
from conftest import ON_GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()),
                                 reason="requires a CUDA GPU")]


def test_cuda_same_bits_as_jax():
  a = torch.randn(100, 4096, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
  c = rtb.det_gemm(a, b)
  expected = rlk_jax.det_gemm(jnp.asarray(a.float().cpu().numpy()).astype(jnp.bfloat16),
                              jnp.asarray(b.float().cpu().numpy()).astype(jnp.bfloat16))
  got = c.view(torch.int16).cpu().numpy()
  assert np.array_equal(got, np.asarray(expected).view(np.int16))


def test_device_mismatch_is_a_clear_error():
  with pytest.raises(ValueError, match="inputs on different devices: a on cuda:0, b on cpu"):
    rtb.det_gemm(torch.ones(4, 8, device="cuda"), torch.ones(8, 3))


def _routes():
  """Each bridge route as (name, op on x, x's shape and dtype)."""
  w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
  mask = torch.rand(64, 128, device="cuda") < 0.5
  _, info = rtb.pack(torch.zeros(64, 128, 256, device="cuda"), mask)
  packed_shape = (info.capacity, 256)
  return {
      # bf16 det_gemm on SM90: the CUTLASS kernels launched on torch's stream
      "det_gemm_default": (lambda x: rtb.det_gemm(x, w), (2048, 1024), torch.bfloat16),
      # the DLPack route: JAX's stream waits for torch's, and the reverse
      "det_gemm_dlpack": (lambda x: rtb.det_gemm(x, w, implementation="pallas"),
                          (2048, 1024), torch.bfloat16),
      # pack's default on SM90: the cuda_ffi kernels on torch's stream
      "pack_from_mask": (lambda x: rtb.pack(x, mask)[0], (64, 128, 256), torch.float32),
      "pack": (lambda x: rtb.pack(x, info)[0], (64, 128, 256), torch.float32),
      "unpack": (lambda x: rtb.unpack(x, info), packed_shape, torch.float32),
      "pack_from_mask_dlpack": (lambda x: rtb.pack(x, mask, implementation="pallas")[0],
                                (64, 128, 256), torch.float32),
      "unpack_dlpack": (lambda x: rtb.unpack(x, info, implementation="pallas"),
                        packed_shape, torch.float32),
  }


@pytest.mark.parametrize("route", ["det_gemm_default", "det_gemm_dlpack",
                                   "pack_from_mask", "pack", "unpack",
                                   "pack_from_mask_dlpack", "unpack_dlpack"])
def test_stream_order_lifetime_and_no_host_sync(route, public_dlpack_forbidden):
  """200 times: a long torch kernel, then torch writes the input on its
  stream right before the call (the call must see the new values); the input
  is freed right after the call and its memory refilled with NaN by torch
  (the result must not change); any host sync inside the call raises."""
  op, shape, dtype = _routes()[route]
  values = [torch.randn(shape, device="cuda").to(dtype) for _ in range(2)]
  expected = [op(v.clone()) for v in values]
  torch.cuda.synchronize()
  for i in range(200):
    x = torch.empty(shape, device="cuda", dtype=dtype)
    torch.cuda._sleep(200_000)  # a long kernel ahead on torch's stream
    x.copy_(values[i % 2])      # the producer, queued behind it
    torch.cuda.set_sync_debug_mode("error")
    try:
      out = op(x)
    finally:
      torch.cuda.set_sync_debug_mode("default")
    del x  # the caching allocator may hand this memory out again...
    garbage = torch.full(shape, float("nan"), device="cuda", dtype=dtype)  # ...here
    assert torch.equal(out, expected[i % 2]), f"{route}: iteration {i}"
    del garbage


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_pack_routes_same_bits_and_gradients_as_jax(implementation):
  """The direct CUDA route (default on SM90) and the DLPack route: packed
  rows and every info field equal rlk_jax's; gradients of
  unpack(3 * pack(x)) equal 3 w where active."""
  mask = torch.rand(12, 777, device="cuda") < 0.4
  mask[3] = False  # an empty sequence
  x = torch.randn(12, 777, 48, device="cuda").requires_grad_()
  packed, info = rtb.pack(x, mask, capacity=int(mask.sum()) + 31, fill_value=-2,
                          implementation=implementation)
  j_packed, j_info = rlk_jax.pack(jnp.asarray(x.detach().cpu().numpy()),
                                  mask.cpu().numpy(), capacity=info.capacity,
                                  fill_value=-2)
  assert np.array_equal(packed.detach().cpu().numpy().view(np.int32),
                        np.asarray(j_packed).view(np.int32))
  for field in ("cu_seqlens", "seq_lens", "total", "max_seqlen", "num_dropped",
                "segment_ids", "positions", "valid", "gather_map", "scatter_map"):
    assert np.array_equal(getattr(info, field).cpu().numpy(),
                          np.asarray(getattr(j_info, field))), field
  w = torch.randn(12, 777, 48, device="cuda")
  (rtb.unpack(packed * 3, info, implementation=implementation) * w).sum().backward()
  assert torch.equal(x.grad, torch.where(mask[..., None], 3 * w, 0.0))
  ids = torch.randint(-2**40, 2**40, (12, 777), device="cuda")  # int64 rows
  packed_ids, _ = rtb.pack(ids, info, implementation=implementation)
  assert torch.equal(packed_ids[:int(mask.sum())], ids[mask])
  packed_ids, ids_info = rtb.pack(ids, mask, capacity=info.capacity,
                                  implementation=implementation)
  assert torch.equal(packed_ids[:int(mask.sum())], ids[mask])
  assert torch.equal(ids_info.gather_map, info.gather_map)


def test_det_linear_rows_invariant_on_cuda():
  layer = rtb.DetLinear(4096, 1024, device="cuda", dtype=torch.bfloat16)
  x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
  full = layer(x)
  for m in (1, 3, 16, 100):
    assert torch.equal(layer(x[:m]).view(torch.int16), full[:m].view(torch.int16))


def test_linear_logp_cuda_row_blocks_keep_bits(monkeypatch):
  # The SM90 routes hold f32 logits a row block at a time: blocks of 128
  # rows (two and a remainder here) give the unblocked bits, torch and JAX,
  # forward and backward.
  import jax
  from rlk_jax import _linear_logp
  n, h, v, chunk = 300, 512, 4096 + 1032, 2048
  hidden = (torch.randn(n, h, device="cuda") / 3).to(torch.bfloat16).requires_grad_()
  weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
  targets = torch.randint(0, v, (n,), device="cuda")
  g, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
  to_jax = lambda t: jax.dlpack.from_dlpack(t.detach().contiguous())

  def run():
    hidden.grad = weight.grad = None
    logp, ent = rtb.linear_logp(hidden, weight, targets, temperature=0.9,
                                chunk_size=chunk, return_entropy=True)
    torch.autograd.backward((logp, ent), (g, g_ent))
    f = lambda a, b: rlk_jax.linear_logp(
        a, b, to_jax(targets.int()), temperature=0.9, chunk_size=chunk,
        return_entropy=True, implementation="cuda_ffi")
    out, vjp = jax.vjp(f, to_jax(hidden), to_jax(weight.t()))
    grads = vjp((to_jax(g), to_jax(g_ent)))
    return [logp, ent, hidden.grad, weight.grad] + [
        torch.from_dlpack(a) for a in (*out, *grads)]

  unblocked = run()
  monkeypatch.setattr(_linear_logp, "LOGITS_BLOCK_BYTES", 1)
  monkeypatch.setattr(_linear_logp, "BACKWARD_LOGITS_BLOCK_BYTES", 1)
  assert len(_linear_logp.row_blocks(n, chunk, 1)) == 3
  for name, a, b in zip(("logp", "entropy", "dh", "dW", "jax logp",
                         "jax entropy", "jax dh", "jax dW"), run(), unblocked):
    assert torch.equal(a.contiguous().view(torch.uint8),
                       b.contiguous().view(torch.uint8)), name


def test_linear_logp_cuda_entropy_only_when_asked_and_f32_accumulator(rng):
  # The SM90 torch route without entropy: the log-probs' bits, and the
  # gradients of a zero entropy cotangent (values; a zero's sign may
  # differ); the f32 accumulator holds the bf16 gradient before rounding.
  n, h, v, chunk = 257, 512, 4096 + 1032, 2048
  hidden = (torch.randn(n, h, device="cuda") / 3).to(torch.bfloat16).requires_grad_()
  weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
  targets = torch.randint(0, v, (n,), device="cuda")
  temps = torch.rand(n, 1, device="cuda").squeeze(1) + 0.5
  g = torch.randn(n, device="cuda")
  logp = rtb.linear_logp(hidden, weight, targets, temperature=temps,
                         chunk_size=chunk)
  logp.backward(g)
  grads = hidden.grad.clone(), weight.grad.clone()
  hidden.grad = weight.grad = None
  logp_e, _ = rtb.linear_logp(hidden, weight, targets, temperature=temps,
                              chunk_size=chunk, return_entropy=True)
  logp_e.backward(g)
  assert torch.equal(logp.view(torch.int32), logp_e.view(torch.int32))
  assert torch.equal(grads[0], hidden.grad) and torch.equal(grads[1], weight.grad)
  hidden.grad = weight.grad = None
  acc = torch.zeros(v, h, device="cuda", dtype=torch.float32)
  for _ in range(2):
    rtb.linear_logp(hidden, weight, targets, temperature=temps,
                    chunk_size=chunk, weight_grad_accumulator=acc).backward(g)
  assert weight.grad is None
  assert torch.equal(hidden.grad, 2 * grads[0])  # a power of two: exact
  assert torch.equal((acc / 2).to(torch.bfloat16), grads[1])


@pytest.mark.parametrize("temperature", ["per-sample", 0.7])
@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_linear_logp_cuda_same_bits_as_jax(implementation, temperature, rng):
  # Forward and backward of both outputs, several vocabulary chunks and a
  # remainder, a temperature and ignored targets: on SM90 the default runs
  # rlk_jax's kernels from torch (_sm90_logp), "pallas" runs JAX through
  # DLPack; both must give the JAX op's bits.
  import functools
  import jax
  n, h, v, chunk = 300, 1024, 2 * 4096 + 1808, 4096
  if temperature == "per-sample":
    temperature = torch.rand(n, device="cuda") + 0.5
  hidden = (torch.randn(n, h, device="cuda") / 3).to(torch.bfloat16).requires_grad_()
  weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
  targets = torch.randint(0, v, (n,), device="cuda")
  targets[::7] = -100
  g, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
  logp, entropy = rtb.linear_logp(hidden, weight, targets, temperature=temperature,
                                  chunk_size=chunk, return_entropy=True,
                                  implementation=implementation)
  torch.autograd.backward((logp, entropy), (g, g_ent))
  to_jax = lambda t: jax.dlpack.from_dlpack(t.detach().contiguous())
  jax_temperature = (to_jax(temperature) if isinstance(temperature, torch.Tensor)
                     else temperature)
  f = functools.partial(rlk_jax.linear_logp, targets=to_jax(targets.to(torch.int32)),
                        temperature=jax_temperature, chunk_size=chunk,
                        return_entropy=True, implementation=implementation)
  (want, want_ent), vjp = jax.jit(lambda a, b: jax.vjp(f, a, b))(
      to_jax(hidden), to_jax(weight.detach().t()))
  dh, dw = jax.jit(lambda vjp, g: vjp(g))(vjp, (to_jax(g), to_jax(g_ent)))
  back = lambda a: torch.from_dlpack(a)
  assert torch.equal(logp.view(torch.int32), back(want).view(torch.int32))
  assert torch.equal(entropy.view(torch.int32), back(want_ent).view(torch.int32))
  assert torch.equal(hidden.grad.view(torch.int16), back(dh).view(torch.int16))
  assert torch.equal(weight.grad.view(torch.int16), back(dw).t().view(torch.int16))
