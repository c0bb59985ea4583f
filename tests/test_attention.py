"""det_attention's contract, bitwise, through every route that runs here:
rlk_jax and rlk_torch_bridge, the ``xla`` reference on CPUs (the torch route
through DLPack), the Triton kernels on GPUs (jax-triton, and torch's own
launcher) and the Hopper forward (``cuda_ffi``, whose bits are the Triton
forward's). A row's output and gradients alone, in a ragged pack, in a padded
batch (either side) and token by token against a KV cache: the same bits.
Accuracy against float64. (The kernels themselves on CPU, in Triton's
interpreter: test_attention_triton.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rlk_jax
from attention_checks import (bits, dense_f64, dense_f64_torch, f32_bits,
                              pack_sequences, padded_batch, rel_err,
                              same_bits, sequences)
from conftest import ON_GPU

torch = pytest.importorskip("torch")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import rlk_torch_bridge as rtb  # noqa: E402

# On a GPU every route runs twice: the Triton kernels, and the Hopper
# forward (its decode steps and backward on the Triton kernels), so a decode
# step against a cache is checked against the Hopper kernel's prefill.
IMPLS = ("triton", "cuda_ffi") if ON_GPU else ("xla",)
IMPL = IMPLS[0]
TOL = 1e-2  # bf16 operands and output


class JaxRoute:
  name = "jax"

  def __init__(self, impl=IMPL):
    self.impl = impl

  def array(self, x, dtype=jnp.bfloat16):
    return jnp.asarray(x, dtype)

  def ints(self, x):
    return jnp.asarray(x, jnp.int32)

  def attend(self, q, k, v, **kw):
    return rlk_jax.det_attention(q, k, v, implementation=self.impl, **kw)

  def grads(self, q, k, v, g, **kw):
    _, vjp = jax.vjp(lambda q, k, v: self.attend(q, k, v, **kw), q, k, v)
    return vjp(g)


class TorchRoute:
  name = "torch"
  device = "cuda" if ON_GPU else "cpu"

  def __init__(self, impl=IMPL):
    self.impl = impl

  def array(self, x, dtype=torch.bfloat16):
    return torch.from_numpy(np.ascontiguousarray(x)).to(self.device, dtype)

  def ints(self, x):
    return torch.as_tensor(np.asarray(x), dtype=torch.int32,
                           device=self.device)

  def attend(self, q, k, v, **kw):
    if "mask" in kw:
      kw["mask"] = torch.as_tensor(np.asarray(kw["mask"]), device=self.device)
    return rtb.det_attention(q, k, v, implementation=self.impl, **kw)

  def grads(self, q, k, v, g, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    self.attend(q, k, v, **kw).backward(g)
    return q.grad, k.grad, v.grad


@pytest.fixture(params=[(r, impl) for r in (JaxRoute, TorchRoute)
                        for impl in IMPLS],
                ids=[f"{r}-{impl}" for r in ("jax", "torch") for impl in IMPLS])
def route(request):
  cls, impl = request.param
  return cls(impl)


# Small on CPU (the reference's explicit loops), wider on the device.
HEADS = (4, 2, 64) if not ON_GPU else (8, 2, 128)


@pytest.mark.parametrize("window,softcap", [(None, None), (13, None),
                                            (None, 20.0)])
def test_pack_rows_equal_alone_and_float64(route, rng, window, softcap):
  hq, hkv, d = HEADS
  lengths = [37, 1, 64, 70] if ON_GPU else [37, 1, 20]
  seqs = sequences(rng, lengths, hq, hkv, d)
  q, k, v, cu, starts = pack_sequences(seqs, spare=3)
  kw = dict(sliding_window=window, softcap=softcap)
  out = route.attend(route.array(q), route.array(k), route.array(v),
                     cu_seqlens=route.ints(cu), **kw)
  for s, start in zip(seqs, starts):
    n = s[0].shape[0]
    alone = route.attend(*(route.array(x) for x in s), **kw)
    assert same_bits(out[start:start + n], alone), (route.name, n)
    want = dense_f64(*(np.asarray(route.array(x).astype(jnp.float32)
                                  if route.name == "jax" else
                                  route.array(x).float().cpu())
                       for x in s), window=window, softcap=softcap)
    got = np.asarray(alone.astype(jnp.float32) if route.name == "jax"
                     else alone.float().cpu())
    assert rel_err(got, want) < TOL
  # The spare rows after the last sequence come back 0.
  assert not np.asarray(bits(out))[cu[-1]:].any()


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_padded_rows_equal_alone(route, rng, left):
  hq, hkv, d = HEADS
  lengths = [9, 24, 17]
  seqs = sequences(rng, lengths, hq, hkv, d)
  q, k, v, mask = padded_batch(seqs, 24, left)
  out = route.attend(route.array(q), route.array(k), route.array(v), mask=mask)
  for j, (s, n) in enumerate(zip(seqs, lengths)):
    alone = route.attend(*(route.array(x) for x in s))
    rows = slice(24 - n, 24) if left else slice(0, n)
    assert same_bits(out[j, rows], alone)


def test_decode_and_chunked_prefill_equal_prefill(route, rng):
  """A KV-cache rollout: prefill, then one token at a time, and a chunk of
  three, against the whole sequence computed at once, in a batch whose
  sequences have other lengths and a left-padded cache slot."""
  hq, hkv, d = HEADS
  # On the GPU the cache spans three fold chunks: the decode runs them in
  # parallel programs (rlk_jax._attention.decode_plan).
  n_total, slots = (1700, 1800) if ON_GPU else (40, 48)
  seqs = sequences(rng, [n_total, 29], hq, hkv, d)
  full, full_lse = route.attend(*(route.array(x) for x in seqs[0]),
                                return_lse=True)
  ks = np.full((2, slots, hkv, d), 5.0, np.float32)
  vs = np.full((2, slots, hkv, d), -5.0, np.float32)
  offset = 4  # sequence 0 sits left-padded in its cache slot
  ks[0, offset:offset + n_total], vs[0, offset:offset + n_total] = seqs[0][1:]
  ks[1, :29], vs[1, :29] = seqs[1][1:]
  kc, vc = route.array(ks), route.array(vs)
  for pos, n in [(0, 1), (16, 1), (31, 1), (32, 3), (n_total - 1, 1)] + (
      [(511, 1), (512, 1), (1023, 2), (1536, 1), (1600, 5)] if ON_GPU
      else []):
    qn = np.zeros((2, n, hq, d), np.float32)
    qn[0] = seqs[0][0][pos:pos + n]
    qn[1] = seqs[1][0][:n]
    out, lse = route.attend(route.array(qn), kc, vc,
                            kv_lens=route.ints([pos + n, n]),
                            kv_start=route.ints([offset, 0]), return_lse=True)
    assert same_bits(out[0], full[pos:pos + n]), (pos, n)
    # f32: an ulp here would flip a bf16 output now and then.
    assert np.array_equal(f32_bits(lse[0]), f32_bits(full_lse[pos:pos + n])), (pos, n)
  if ON_GPU:
    # Many positions in one batch, each its own cache: every block end
    # (where a decode row walks a block unmasked that the prefill's tile
    # masks) and random others.
    ends = np.arange(63, n_total, 64)
    positions = np.concatenate([ends, rng.choice(n_total, 64, replace=False)])
    b = len(positions)
    kb = np.broadcast_to(ks[:1], (b,) + ks.shape[1:])
    vb = np.broadcast_to(vs[:1], (b,) + vs.shape[1:])
    out, lse = route.attend(route.array(seqs[0][0][positions][:, None]),
                            route.array(kb), route.array(vb),
                            kv_lens=route.ints(positions + 1),
                            kv_start=route.ints(np.full(b, offset)),
                            return_lse=True)
    assert same_bits(out[:, 0], full[positions])
    assert np.array_equal(f32_bits(lse[:, 0]), f32_bits(full_lse[positions]))


def _paged(rng, page, lens, hkv, d, spare=3):
  """A paged cache holding sequences of `lens` keys in shuffled blocks, its
  block tables, and the same keys as a contiguous cache."""
  b, blocks = len(lens), -(-max(lens) // page) + 1
  n_blocks = b * blocks + spare
  tables = rng.permutation(n_blocks)[:b * blocks].reshape(b, blocks)
  kc, vc = (rng.standard_normal((n_blocks, page, hkv, d)) for _ in "kv")
  return kc, vc, tables, kc[tables].reshape(b, blocks * page, hkv, d), (
      vc[tables].reshape(b, blocks * page, hkv, d))


# Pages that do and do not divide the kernels' key blocks (one on CPU,
# where the reference reads a copy of the blocks either way).
@pytest.mark.parametrize("page", [16, 12] if ON_GPU else [12])
def test_paged_cache_gives_the_contiguous_caches_bits(route, rng, page):
  """vLLM's layout: k, v [num_blocks, page, Hkv, D] and a block table per
  sequence. A decode step (one token) and a chunk of three against it give
  the bits of the same keys in a contiguous cache (and so the prefill's)."""
  hq, hkv, d = HEADS
  lens = [40, 7, 600] if ON_GPU else [40, 7, 23]
  kc, vc, tables, kcont, vcont = _paged(rng, page, lens, hkv, d)
  for n in (1, 3):
    q = route.array(rng.standard_normal((len(lens), n, hq, d)))
    got, got_lse = route.attend(q, route.array(kc), route.array(vc),
                                kv_lens=route.ints(lens),
                                block_tables=route.ints(tables),
                                return_lse=True)
    want, want_lse = route.attend(q, route.array(kcont), route.array(vcont),
                                  kv_lens=route.ints(lens), return_lse=True)
    assert same_bits(got, want), n
    assert np.array_equal(f32_bits(got_lse), f32_bits(want_lse)), n


def test_traced_bad_paged_input_gives_nan_rows_not_stray_reads(rng):
  """Under jit nothing can raise: a sequence whose table names a block
  outside the cache, or whose length passes its table, comes back NaN;
  the others keep their bits."""
  hq, hkv, d = HEADS
  kc, vc, tables, _, _ = _paged(rng, 16, [9, 20, 30], hkv, d, spare=0)
  q = jnp.asarray(rng.standard_normal((3, 1, hq, d)), jnp.bfloat16)
  kc, vc = (jnp.asarray(x, jnp.bfloat16) for x in (kc, vc))
  f = jax.jit(lambda lens, tables: rlk_jax.det_attention(
      q, kc, vc, kv_lens=lens, block_tables=tables, implementation=IMPL))
  good = f(jnp.array([9, 20, 30]), jnp.asarray(tables))
  bad_tables = np.array(tables)
  bad_tables[0, 0] = 10 ** 6
  out = f(jnp.array([9, 10 ** 4, 30]), jnp.asarray(bad_tables))
  assert np.isnan(np.asarray(out[:2], np.float32)).all()
  assert same_bits(out[2], good[2])


def test_paged_cache_has_no_gradient(rng):
  hq, hkv, d = HEADS
  kc, vc, tables, _, _ = _paged(rng, 16, [9, 20], hkv, d)
  q = jnp.asarray(rng.standard_normal((2, 1, hq, d)), jnp.bfloat16)
  f = lambda q: rlk_jax.det_attention(
      q, jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16),
      kv_lens=jnp.array([9, 20]), block_tables=jnp.asarray(tables)).sum()
  with pytest.raises(NotImplementedError, match="paged KV cache"):
    jax.grad(f)(q)
  t = TorchRoute()
  qt = t.array(np.asarray(q, np.float32)).requires_grad_()
  out = t.attend(qt, t.array(kc), t.array(vc), kv_lens=t.ints([9, 20]),
                 block_tables=t.ints(tables))
  with pytest.raises(NotImplementedError, match="paged KV cache"):
    out.float().sum().backward()


@pytest.mark.parametrize("bad,message", [
    (dict(kv_start=[0, 0]), "kv_start is for a contiguous cache"),
    (dict(kv_lens=[9, 80]), "kv_lens <= its 3 blocks x 16 = 48 slots"),
    (dict(table=(1, 99, 0)), "outside the cache's 9"),
    (dict(table_shape=(3, 3)), "block_tables must be \\[B, blocks\\]"),
    (dict(no_lens=True), "go with \\[B, n, H, D\\] queries and kv_lens"),
])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_bad_paged_input_raises_naming_it(rng, bad, message, framework):
  hq, hkv, d = HEADS
  r = JaxRoute() if framework == "jax" else TorchRoute()
  kc = r.array(rng.standard_normal((9, 16, hkv, d)))
  tables = np.array([[0, 1, 2], [3, 4, 5]])
  if "table" in bad:
    tables[1] = bad["table"]
  if "table_shape" in bad:
    tables = np.zeros(bad["table_shape"], int)
  kw = dict(kv_lens=r.ints(bad.get("kv_lens", [9, 30])),
            block_tables=r.ints(tables))
  if "kv_start" in bad:
    kw["kv_start"] = r.ints(bad["kv_start"])
  if "no_lens" in bad:
    del kw["kv_lens"]
  q = r.array(rng.standard_normal((2, 1, hq, d)))
  if framework == "torch" and r.device == "cuda" and (
      "kv_lens" in bad or "table" in bad):
    # Values in CUDA tensors are not read on the host (no sync): the
    # offending sequence comes back NaN, the other keeps finite values.
    out = r.attend(q, kc, kc, **kw).float().cpu().numpy()
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all()
    return
  with pytest.raises(ValueError, match=message):
    r.attend(q, kc, kc, **kw)


def test_torch_reads_transposed_caches_with_the_same_bits(rng):
  """Keys and values as transformers hands them over, [B, Hkv, S, D]
  transposed (on a GPU the Triton kernels read them in place), against the
  same tokens in [B, S, H, D] rows: the same output and gradients, a
  padded batch and a KV-cache step with spare slots."""
  hq, hkv, d = HEADS
  t = TorchRoute()
  seqs = sequences(rng, [9, 24, 17], hq, hkv, d)
  q, k, v, mask = padded_batch(seqs, 24, left=True)
  g = t.array(rng.standard_normal(q.shape))
  rows = [t.array(x).requires_grad_() for x in (q, k, v)]
  # The cache layout: a [B, Hkv, S, D] leaf, given as its transpose.
  heads_first = [t.array(x.transpose(0, 2, 1, 3)).requires_grad_()
                 for x in (k, v)]
  want = t.attend(*rows, mask=mask)
  got = t.attend(rows[0], *(x.transpose(1, 2) for x in heads_first),
                 mask=mask)
  assert same_bits(got, want)
  want.backward(g)
  got.backward(g)
  for a, b in zip(heads_first, rows[1:]):
    assert same_bits(a.grad.transpose(1, 2), b.grad)
  # A step of 2 new rows against a cache of 40 slots, sequences at
  # different offsets in it.
  slots, n = 40, 2
  cache = [rng.standard_normal((3, slots, hkv, d)) for _ in range(2)]
  qn = t.array(rng.standard_normal((3, n, hq, d)))
  kw = dict(kv_lens=t.ints([30, 2, 17]), kv_start=t.ints([3, 38, 0]))
  want = t.attend(qn, *(t.array(x) for x in cache), **kw)
  got = t.attend(qn, *(t.array(x.transpose(0, 2, 1, 3)).transpose(1, 2)
                       for x in cache), **kw)
  assert same_bits(got, want)


def test_gradients_per_sequence_invariant_and_deterministic(route, rng):
  hq, hkv, d = HEADS
  lengths = [21, 1, 33] if not ON_GPU else [21, 1, 100, 67]
  seqs = sequences(rng, lengths, hq, hkv, d)
  q, k, v, cu, starts = pack_sequences(seqs, spare=2)
  g = rng.standard_normal(q.shape).astype(np.float32)
  args = [route.array(x) for x in (q, k, v, g)]
  packed = route.grads(*args, cu_seqlens=route.ints(cu))
  again = route.grads(*args, cu_seqlens=route.ints(cu))
  for a, b in zip(packed, again):
    assert same_bits(a, b)
  for s, start in zip(seqs, starts):
    n = s[0].shape[0]
    alone = route.grads(*(route.array(x) for x in s),
                        route.array(g[start:start + n]))
    for a, b in zip(packed, alone):
      assert same_bits(a[start:start + n], b)
  # Accuracy of the whole pack's gradients against float64 autodiff.
  if route.name == "torch":
    s, start = seqs[-1], starts[-1]
    n = s[0].shape[0]
    t64 = [torch.tensor(np.asarray(route.array(x).float().cpu()),
                        dtype=torch.float64, requires_grad=True) for x in s]
    g64 = torch.tensor(np.asarray(route.array(g[start:start + n])
                                  .float().cpu()), dtype=torch.float64)
    dense_f64_torch(*t64).backward(g64)
    for got, want in zip(packed, t64):
      assert rel_err(got[start:start + n].float().cpu(),
                     want.grad.numpy()) < 2 * TOL


def test_jax_equals_torch(rng):
  """And on a GPU, every implementation the same bits (the Hopper forward
  and the Triton kernels), from either framework."""
  hq, hkv, d = HEADS
  seqs = sequences(rng, [19, 300, 30] if ON_GPU else [19, 30], hq, hkv, d)
  q, k, v, cu, _ = pack_sequences(seqs)
  outs = []
  for route in [r(impl) for r in (JaxRoute, TorchRoute) for impl in IMPLS]:
    outs.append(route.attend(*(route.array(x) for x in (q, k, v)),
                             cu_seqlens=route.ints(cu), return_lse=True))
  for out, lse in outs[1:]:
    assert same_bits(out, outs[0][0])
    assert np.array_equal(f32_bits(lse), f32_bits(outs[0][1]))


def test_lse_is_the_log_normaliser(rng):
  hq, hkv, d = HEADS
  (q, k, v), = sequences(rng, [11], hq, hkv, d)
  r = JaxRoute()
  _, lse = r.attend(*(r.array(x) for x in (q, k, v)), return_lse=True)
  qf, kf = (np.asarray(r.array(x).astype(jnp.float32), np.float64)
            for x in (q, k))
  s = np.einsum("thd,shd->ths", qf, np.repeat(kf, hq // hkv, 1)) / d ** 0.5
  s = np.where(np.tril(np.ones((11, 11), bool))[:, None, :], s, -np.inf)
  want = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
  np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-5, atol=1e-5)


def test_jit_and_pack_info(rng):
  """Inside jit, from what rlk_jax.pack returns."""
  hq, hkv, d = HEADS
  b, s = 3, 16
  lengths = np.array([16, 5, 11])
  mask = np.arange(s)[None] < lengths[:, None]
  x = rng.standard_normal((b, s, hq + 2 * hkv, d)).astype(np.float32)

  @jax.jit
  def f(x, mask):
    packed, info = rlk_jax.pack(x, mask, capacity=40)
    q, k, v = (packed[:, :hq], packed[:, hq:hq + hkv], packed[:, hq + hkv:])
    return rlk_jax.det_attention(q, k, v, info=info,
                                 implementation=IMPL), info

  out, info = f(jnp.asarray(x, jnp.bfloat16), jnp.asarray(mask))
  cu = np.asarray(info.cu_seqlens)
  xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  r = JaxRoute()
  for j in range(b):
    n = lengths[j]
    alone = r.attend(r.array(xb[j, :n, :hq]), r.array(xb[j, :n, hq:hq + hkv]),
                     r.array(xb[j, :n, hq + hkv:]))
    assert same_bits(out[cu[j]:cu[j + 1]], alone)
  assert not np.asarray(bits(out))[cu[-1]:].any()


@pytest.mark.parametrize("bad,message", [
    (dict(q_dtype=jnp.float32), "bfloat16/float16"),
    (dict(d=96), "head dim 96"),
    (dict(hkv=3), "multiple of 3 KV heads"),
    (dict(causal=False), "only causal"),
    (dict(mask_gap=True), "rows \\[1\\] have gaps"),
    (dict(both=True), "at most one of"),
    (dict(kv_short=True), "n=2 <= kv_lens"),
])
def test_bad_input_raises_naming_it(bad, message):
  d = bad.get("d", 64)
  hkv = bad.get("hkv", 2)
  dtype = bad.get("q_dtype", jnp.bfloat16)
  q = jnp.ones((2, 8, 4, d), dtype)
  k = jnp.ones((2, 8, hkv, d), dtype)
  kw = {}
  if "causal" in bad:
    kw["causal"] = False
  if "mask_gap" in bad:
    m = np.ones((2, 8), bool)
    m[1, 3] = False
    kw["mask"] = jnp.asarray(m)
  if "both" in bad:
    kw.update(mask=jnp.ones((2, 8), bool), kv_lens=jnp.array([8, 8]))
  if "kv_short" in bad:
    q = jnp.ones((2, 2, 4, d), dtype)
    kw["kv_lens"] = jnp.array([1, 8])
  with pytest.raises((ValueError, TypeError, NotImplementedError),
                     match=message):
    rlk_jax.det_attention(q, k, k, **kw)


def test_torch_op_compiles_and_is_registered(rng):
  hq, hkv, d = HEADS
  (q, k, v), = sequences(rng, [24], hq, hkv, d)
  tr = TorchRoute()
  args = [tr.array(x) for x in (q, k, v)]
  eager = tr.attend(*args)
  compiled = torch.compile(lambda q, k, v: rtb.det_attention(
      q, k, v, implementation=IMPL), fullgraph=True)(*args)
  assert same_bits(eager, compiled)
  assert hasattr(torch.ops.rlk, "det_attention")


def test_float16_pack_equals_alone_and_float64(route, rng):
  hq, hkv, d = HEADS
  seqs = sequences(rng, [13, 30], hq, hkv, d)
  q, k, v, cu, starts = pack_sequences(seqs, spare=1)
  f16 = jnp.float16 if route.name == "jax" else torch.float16
  out = route.attend(*(route.array(x, f16) for x in (q, k, v)),
                     cu_seqlens=route.ints(cu))
  assert str(out.dtype).endswith("float16") and "b" not in str(out.dtype)
  for s, start in zip(seqs, starts):
    n = s[0].shape[0]
    alone = route.attend(*(route.array(x, f16) for x in s))
    assert same_bits(out[start:start + n], alone)
    exact = [np.asarray(x, np.float16).astype(np.float64) for x in s]
    got = np.asarray(alone.astype(jnp.float32) if route.name == "jax"
                     else alone.float().cpu())
    assert rel_err(got, dense_f64(*exact)) < 2e-3


@pytest.mark.parametrize("b,n,rows", [(3, 1, 64), (5, 7, 4), (2, 130, 64)])
def test_decode_tile_map_is_the_general_one(b, n, rows):
  """The torch route's shape-only tile map of a KV-cache call lists the
  tiles the general one (from the lengths) lists, in the same order."""
  from rlk_torch_bridge import _attention_rows
  from triton_kernels import attention as kernels
  lengths = torch.full((b,), n, dtype=torch.int32)
  general = _attention_rows.tile_map(lengths, rows, kernels.tile_bound(
      b * n, b, rows))
  per_seq = -(-n // rows)
  uniform, = _attention_rows.static_rows(torch.device("cpu"),
                                       (("tiles", b, per_seq, rows),))
  assert torch.equal(general[:, :b * per_seq], uniform)
  assert (general[0, b * per_seq:] == -1).all()


@pytest.mark.parametrize("b,s,rows", [(1, 300, 128), (4, 64, 64), (3, 1, 16),
                                      (2, 130, 64)])
def test_shape_only_tile_map_is_the_general_one(b, s, rows):
  """JAX: where every row lies in a sequence of one length (a padded batch
  without a mask, one packed sequence) the tile map is made from the
  shapes; it is the map the lengths give, spare tiles included."""
  from rlk_jax import _attention
  starts = jnp.arange(b, dtype=jnp.int32) * s
  lengths = jnp.full((b,), s, jnp.int32)
  seqs = jnp.stack([starts, lengths, starts, lengths])
  settings = _attention.Settings(2, 64, 0.125, None, None, 1,
                                 all_rows_in=True)
  for which in (1, 3):
    got = _attention._tiles(seqs, which, rows, b * s, settings)
    want = _attention._tiles(
        seqs, which, rows, b * s,
        dataclasses.replace(settings, all_rows_in=False))
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_torch_tables_are_shared_per_source_and_remade_when_it_changes(rng):
  """A model's layers pass every call the same mask (or cu_seqlens), so the
  torch route makes one sequence table per source tensor and keeps the
  tile maps with it: the same objects while the source is unchanged, a new
  table with the new values once it changes in place, and outputs equal to
  a fresh source's. A padded batch without a mask (or one packed sequence)
  takes a shape-only table that lists every row."""
  from rlk_torch_bridge import _attention_rows
  from rlk_torch_bridge import attention as torch_attention
  hq, hkv, d = HEADS
  t = TorchRoute()
  q, k, v, mask = padded_batch(sequences(rng, [5, 12, 9], hq, hkv, d), 12,
                               left=True)
  q, k, v = (t.array(x) for x in (q, k, v))
  table = lambda **kw: torch_attention._table(
      kw.pop("layout", "padded"), q, k, kw.get("cu"), kw.get("mask"), None,
      None, k.shape[1])[0]

  full = table()
  assert full is table() and _attention_rows.all_rows_in(full)
  b, s = q.shape[:2]
  base = torch.arange(b, dtype=torch.int32, device=q.device)
  assert torch.equal(full, torch.stack([base * s, torch.full_like(base, s),
                                        base * s, torch.full_like(base, s)]))
  assert not _attention_rows.all_rows_in(full.clone())

  m = torch.as_tensor(np.asarray(mask), device=t.device)
  first = table(mask=m)
  assert first is table(mask=m)
  assert not _attention_rows.all_rows_in(first)
  tiles = _attention_rows.sequence_tiles(first, 1, 4, q.shape[0] * s)
  assert tiles is _attention_rows.sequence_tiles(first, 1, 4, q.shape[0] * s)
  from triton_kernels import attention as kernels
  assert torch.equal(tiles, _attention_rows.tile_map(
      first[1], 4, kernels.tile_bound(q.shape[0] * s, b, 4)))
  attend = lambda mask: rtb.det_attention(q, k, v, mask=mask,
                                          implementation=t.impl)
  before = attend(m)
  m[0, -5] = False  # sequence 0 (left padded) now starts a token later
  second = table(mask=m)
  assert second is not first and not torch.equal(second, first)
  assert torch.equal(second, torch_attention._seqs(
      "padded", q, k, None, m, None, None, k.shape[1])[0])
  after = attend(m)
  fresh = attend(m.clone())
  assert same_bits(after, fresh) and not same_bits(after, before)

  # Tile maps are kept only with tables kept here: inside an operator a
  # compiled graph passes its own buffers, which Inductor reuses for other
  # values without a version bump. A kept table changed in place gets a
  # new map.
  other = second.clone()
  n_rows = q.shape[0] * s
  assert (_attention_rows.sequence_tiles(other, 1, 4, n_rows)
          is not _attention_rows.sequence_tiles(other, 1, 4, n_rows))
  tiles = _attention_rows.sequence_tiles(second, 1, 4, n_rows)
  second[1, 0] += 1
  assert _attention_rows.sequence_tiles(second, 1, 4, n_rows) is not tiles

  # Under a fake-tensor mode (memory estimates, export) nothing is kept:
  # a later real call must not meet a fake table.
  from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
  spec = (("padded", 3, 29, 31),)
  with FakeTensorMode():
    fake, = _attention_rows.static_rows(torch.device(t.device), spec)
  real, = _attention_rows.static_rows(torch.device(t.device), spec)
  assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor)
  assert real[2].tolist() == [0, 31, 62]

  rows = q.reshape(-1, hq, d)
  one = torch_attention._seqs("packed", rows, rows, None, None, None, None,
                              rows.shape[0])[0]
  assert _attention_rows.all_rows_in(one)
  cu = torch.tensor([0, 7, rows.shape[0]], dtype=torch.int32)
  packed = lambda: torch_attention._table("packed", rows, rows, cu, None,
                                          None, None, rows.shape[0])[0]
  assert packed() is packed()
  cu[1] = 8
  assert packed()[1, 0].item() == 8


def test_torch_tables_under_inference_mode_and_then_training(rng):
  """Inference tensors have no version to key a kept table by, and cannot
  be saved for a backward: a call under ``inference_mode`` keeps nothing
  of its sources, and the shape-only table it shares with training calls
  is a normal tensor, so a training call of the same shapes after it
  takes a gradient."""
  hq, hkv, d = HEADS
  t = TorchRoute()
  shapes = [(1, 11, hq, d), (1, 11, hkv, d), (1, 11, hkv, d)]
  q, k, v = (t.array(rng.standard_normal(x)) for x in shapes)
  with torch.inference_mode():
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=t.device)
    rows = [x[0] for x in (q, k, v)]
    packed = rtb.det_attention(*rows, cu_seqlens=cu, implementation=t.impl)
    padded = rtb.det_attention(q, k, v, implementation=t.impl)
  x = [y.clone().requires_grad_() for y in (q, k, v)]
  out = rtb.det_attention(*x, implementation=t.impl)
  out.backward(torch.ones_like(out))
  assert same_bits(out, padded) and all(y.grad is not None for y in x)
  assert same_bits(rtb.det_attention(*(y[0] for y in (q, k, v)),
                                     cu_seqlens=cu.clone(),
                                     implementation=t.impl), packed)
