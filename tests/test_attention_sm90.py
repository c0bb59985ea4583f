"""det_attention's Hopper kernels (``cuda_ffi``): the forward and the
backward's dK/dV give the Triton kernels' bits at every head dim, dtype and
mask they take, in JAX and torch, reading transformers' transposed caches in
place; and what they do not take runs the Triton kernels under the same
name. Its part in the whole contract
(packs, padding, decode against its prefill, gradients) runs in
test_attention.py. The CPU test pins the kernel's tiles to the Triton
config's, which is what makes the bits the same."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cuda_ffi
from attention_checks import (dense_f64, dense_f64_torch, f32_bits,
                              pack_sequences, padded_batch, rel_err,
                              same_bits, sequences)
from triton_kernels import attention as kernels

torch = pytest.importorskip("torch")


def test_kernel_tiles_are_the_triton_forwards():
  # The kernel's blocks, chunks and tile rows are compile-time constants
  # of its source; the Triton config owns them (and the tile map the
  # kernel reads is built from it).
  source = (cuda_ffi._build.ATTENTION_SOURCE).read_text()
  constant = lambda name: int(re.search(
      rf"constexpr int {name} = (\d+);", source).group(1))
  for d in cuda_ffi.ATTENTION_HEAD_DIMS:
    config = kernels.config_for(d)
    assert config.block_m == constant("kBlockM") == cuda_ffi.ATTENTION_TILE_ROWS
    assert config.block_n == constant("kBlockN")
    assert config.fold_keys == constant("kFold")
    # The backward's: two of the Triton dK/dV kernel's programs a CTA, its
    # query blocks a step.
    assert 2 * config.bwd_block_n == constant("kDkdvKeys") == (
        cuda_ffi.ATTENTION_DKDV_TILE_KEYS)
    assert config.bwd_block_m == constant("kDkdvRows")


def _pair(attend, *args, **kw):
  return [attend(*args, implementation=impl, return_lse=True, **kw)
          for impl in ("cuda_ffi", "triton")]


@pytest.mark.gpu
@pytest.mark.parametrize("d", cuda_ffi.ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("window", [None, 200])
def test_torch_forward_is_the_triton_forward(rng, d, dtype, window):
  import rlk_torch_bridge as rtb
  tdtype = getattr(torch, dtype)
  # Lengths around the 64-key blocks, the 128-row tiles and the 512-key
  # chunks; 4 query heads a KV head.
  lengths = [1, 63, 64, 65, 127, 128, 129, 511, 513, 700, 1500]
  seqs = sequences(rng, lengths, 8, 2, d)
  q, k, v, cu, starts = pack_sequences(seqs, spare=3)
  args = [torch.from_numpy(x).to("cuda", tdtype) for x in (q, k, v)]
  cu_t = torch.as_tensor(cu, device="cuda")
  (out, lse), (want, want_lse) = _pair(rtb.det_attention, *args,
                                       cu_seqlens=cu_t, sliding_window=window)
  assert same_bits(out, want)
  assert np.array_equal(f32_bits(lse), f32_bits(want_lse))
  # And right: the longest sequence against float64.
  s, start = seqs[-1], starts[-1]
  ref = dense_f64(*(np.asarray(torch.from_numpy(x).to(tdtype).float())
                    for x in s), window=window)
  got = out[start:start + len(s[0])].float().cpu().numpy()
  assert rel_err(got, ref) < 1e-2


def _torch_grads(impl, q, k, v, g, **kw):
  import rlk_torch_bridge as rtb
  leaves = [x.detach().requires_grad_() for x in (q, k, v)]
  out = rtb.det_attention(*leaves, implementation=impl, **kw)
  out.backward(g)
  return [x.grad for x in leaves]


@pytest.mark.gpu
@pytest.mark.parametrize("d", cuda_ffi.ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("window", [None, 200])
def test_torch_backward_is_the_triton_backward(rng, d, dtype, window):
  """dq, dk, dv bit for bit: the Hopper dK/dV kernel walks the Triton
  program's query blocks with its arithmetic; lengths around its 64-row
  query blocks and 128-key tiles (a tile's second warpgroup past the
  sequence's end, windows whose warpgroups need other blocks)."""
  tdtype = getattr(torch, dtype)
  lengths = [1, 63, 64, 65, 127, 128, 129, 200, 257, 700, 1029]
  seqs = sequences(rng, lengths, 8, 2, d)
  q, k, v, cu, starts = pack_sequences(seqs, spare=3)
  g = rng.standard_normal(q.shape)
  args = [torch.from_numpy(x).to("cuda", tdtype) for x in (q, k, v, g)]
  kw = dict(cu_seqlens=torch.as_tensor(cu, device="cuda"),
            sliding_window=window)
  got = _torch_grads("cuda_ffi", *args, **kw)
  want = _torch_grads("triton", *args, **kw)
  for a, b in zip(got, want):
    assert same_bits(a, b)
  # And right: the longest sequence's key gradients against float64.
  s, start = seqs[-1], starts[-1]
  n = len(s[0])
  x64 = [torch.from_numpy(x).to(tdtype).double().requires_grad_()
         for x in s]
  dense_f64_torch(*x64, window=window).backward(
      args[3][start:start + n].double().cpu())
  for a, want64 in zip(got[1:], x64[1:]):
    assert rel_err(a[start:start + n].float().cpu().numpy(),
                   want64.grad.numpy()) < 2e-2


@pytest.mark.gpu
def test_jax_backward_is_the_triton_backward(rng):
  import jax
  import jax.numpy as jnp
  import rlk_jax
  seqs = sequences(rng, [5, 130, 600, 64, 129], 8, 2, 128)
  q, k, v, cu, _ = pack_sequences(seqs, spare=2)
  g = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]

  def grads(impl):
    loss = lambda q, k, v: jnp.sum(
        rlk_jax.det_attention(q, k, v, cu_seqlens=jnp.asarray(cu),
                              implementation=impl).astype(jnp.float32)
        * g.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(*args)

  for a, b in zip(grads("cuda_ffi"), grads("triton")):
    assert same_bits(a, b)


@pytest.mark.gpu
def test_jax_forward_is_the_triton_forward(rng):
  import jax.numpy as jnp
  import rlk_jax
  seqs = sequences(rng, [5, 130, 600, 64], 8, 2, 64)
  q, k, v, cu, _ = pack_sequences(seqs)
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  (out, lse), (want, want_lse) = _pair(rlk_jax.det_attention, *args,
                                       cu_seqlens=jnp.asarray(cu))
  assert same_bits(out, want)
  assert np.array_equal(f32_bits(lse), f32_bits(want_lse))


@pytest.mark.gpu
def test_reads_transposed_caches_in_place(rng):
  """A padded batch whose keys and values are transformers' [B, Hkv, S, D]
  tensors transposed: the Hopper forward reads them where they lie and
  gives the rows' bits."""
  import rlk_torch_bridge as rtb
  seqs = sequences(rng, [90, 300, 17], 8, 2, 128)
  q, k, v, mask = padded_batch(seqs, 300, left=True)
  t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to("cuda",
                                                            torch.bfloat16)
  mask_t = torch.as_tensor(mask, device="cuda")
  heads_first = [t(x.transpose(0, 2, 1, 3)).requires_grad_() for x in (k, v)]
  got = rtb.det_attention(t(q), *(x.transpose(1, 2) for x in heads_first),
                          mask=mask_t, implementation="cuda_ffi")
  want = rtb.det_attention(t(q), t(k), t(v), mask=mask_t,
                           implementation="triton")
  assert same_bits(got, want)
  # The backward writes dk and dv where the cache lies, as the Triton one.
  g = t(rng.standard_normal(q.shape))
  got.backward(g)
  want_grads = _torch_grads("triton", t(q), t(k), t(v), g, mask=mask_t)
  for a, b in zip(heads_first, want_grads[1:]):
    assert same_bits(a.grad.transpose(1, 2), b)


@pytest.mark.gpu
def test_what_it_does_not_take_runs_the_triton_kernels(rng):
  """A logit softcap and head dim 256: the same name, the Triton
  forward (so the same bits)."""
  import rlk_torch_bridge as rtb
  for d, softcap in ((128, 30.0), (256, None)):
    seqs = sequences(rng, [40, 200], 4, 2, d)
    q, k, v, cu, _ = pack_sequences(seqs)
    args = [torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q, k, v)]
    (out, _), (want, _) = _pair(rtb.det_attention, *args,
                                cu_seqlens=torch.as_tensor(cu, device="cuda"),
                                softcap=softcap)
    assert same_bits(out, want)


@pytest.mark.gpu
def test_non_finite_junk_outside_sequences_stays_out(rng):
  """NaN and inf where no sequence lives (a padded batch's padding, a
  pack's spare rows): a block that runs past a sequence's end reads them,
  and p = 0 must not meet them as 0 * inf (the kernel zeroes those key
  rows, as the Triton kernel loads them)."""
  import rlk_torch_bridge as rtb
  seqs = sequences(rng, [70, 300, 129], 8, 2, 128)
  q, k, v, mask = padded_batch(seqs, 300, left=True)
  junk = ~mask
  for x, bad in ((k, np.inf), (v, np.nan)):
    x[junk] = bad
  t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to("cuda",
                                                            torch.bfloat16)
  mask_t = torch.as_tensor(mask, device="cuda")
  (out, lse), (want, want_lse) = _pair(rtb.det_attention, t(q), t(k), t(v),
                                       mask=mask_t)
  assert torch.isfinite(out).all()
  assert same_bits(out, want)
  assert np.array_equal(f32_bits(lse), f32_bits(want_lse))
  # The backward's dK/dV reads query and gradient rows past a sequence's
  # end (the next row's padding): junk there too.
  q[junk] = np.inf
  g = rng.standard_normal(q.shape)
  g[junk] = np.nan
  got = _torch_grads("cuda_ffi", t(q), t(k), t(v), t(g), mask=mask_t)
  want_grads = _torch_grads("triton", t(q), t(k), t(v), t(g), mask=mask_t)
  for a, b in zip(got, want_grads):
    assert torch.isfinite(a[torch.as_tensor(mask)]).all()
    assert same_bits(a, b)
  q, k, v, cu, _ = pack_sequences(seqs, spare=40)
  v[cu[-1]:] = np.nan
  args = [torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q, k, v)]
  (out, _), (want, _) = _pair(rtb.det_attention, *args,
                              cu_seqlens=torch.as_tensor(cu, device="cuda"))
  assert torch.isfinite(out[:cu[-1]]).all()
  assert same_bits(out, want)
