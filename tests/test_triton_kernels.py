"""triton_kernels' det_matmul and row_gather on CPU, in Triton's interpreter
(conftest sets TRITON_INTERPRET=1 without a GPU), launched the way the torch
bridge launches it: accuracy against float64 in every operand layout,
ragged and power-of-two sizes, row invariance and K zero-padding bitwise.
The GPU bits (against cuda_ffi and Pallas, JAX and torch routes) are
tests/test_triton_kernels_gpu.py's."""

import collections
import os

import numpy as np
import pytest

import rlk_jax
from conftest import ON_GPU

triton = pytest.importorskip("triton", reason="Triton wheels: Linux x86_64")
torch = pytest.importorskip("torch")
from pallas_kernels.row_gather import default_config  # noqa: E402
from triton_kernels import det_matmul, linear_logp, row_gather  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        ON_GPU or os.environ.get("TRITON_INTERPRET") != "1",
        reason="the interpreter runs on CPU machines (the GPU file covers "
               "GPUs)"),
    # triton 3.6's interpreter (see docs/triton_kernels.md); numpy < 2.4
    # only warns.
    pytest.mark.filterwarnings(
        "ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

Config = collections.namedtuple(
    "Config", "block_m block_n block_k group_m num_warps num_stages")
SMALL = Config(32, 32, 64, 2, 4, 3)
WIDE = Config(64, 128, 64, 8, 4, 3)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32}


def operands(rng, m, n, k, transpose_a, transpose_b, dtype):
  a = torch.from_numpy(rng.standard_normal((m, k), np.float32)).to(dtype)
  b = torch.from_numpy(rng.standard_normal((k, n), np.float32)).to(dtype)
  stored_a = a.T.contiguous() if transpose_a else a
  stored_b = b.T.contiguous() if transpose_b else b
  return a, b, stored_a, stored_b


def run(stored_a, stored_b, m, n, transpose_a, transpose_b, config,
        out_dtype=torch.float32):
  out = torch.empty((m, n), dtype=out_dtype)
  return det_matmul.matmul_torch(stored_a, stored_b, out,
                                 transpose_a=transpose_a,
                                 transpose_b=transpose_b, config=config)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("transpose_a,transpose_b",
                         [(False, False), (False, True), (True, False),
                          (True, True)])
@pytest.mark.parametrize("m,n,k", [(37, 50, 200), (64, 96, 256)])
def test_accurate_in_every_layout(dtype, transpose_a, transpose_b, m, n, k,
                                  rng):
  a, b, sa, sb = operands(rng, m, n, k, transpose_a, transpose_b,
                          DTYPES[dtype])
  got = run(sa, sb, m, n, transpose_a, transpose_b, SMALL)
  want = a.double() @ b.double()
  err = float((got.double() - want).norm() / want.norm())
  assert err < 1e-6, err  # f32 accumulation of exact products
  low = run(sa, sb, m, n, transpose_a, transpose_b, SMALL, DTYPES[dtype])
  err = float((low.double() - want).norm() / want.norm())
  assert err < {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-6}[dtype]


@pytest.mark.parametrize("config", [SMALL, WIDE])
def test_rows_do_not_depend_on_the_batch(config, rng):
  m, n, k = 150, 70, 192
  _, _, a, b = operands(rng, m, n, k, False, False, torch.bfloat16)
  # Offsets move each row to another place in its tile. f32 out too: a
  # bf16 result rounds most one-ulp differences of the sums away.
  for out, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
    full = run(a, b, m, n, False, False, config, out)
    for start, rows in ((0, 1), (5, 7), (13, 33), (0, 100), (37, 113)):
      part = run(a[start:start + rows].contiguous(), b, rows, n, False,
                 False, config, out)
      assert torch.equal(part.view(bits), full[start:start + rows].view(bits))


def test_zero_padding_k_changes_no_bit(rng):
  m, n, k = 40, 48, 200
  _, _, a, b = operands(rng, m, n, k, False, False, torch.bfloat16)
  padded_a = torch.nn.functional.pad(a, (0, 56))
  padded_b = torch.nn.functional.pad(b, (0, 0, 0, 56))
  got = run(a, b, m, n, False, False, SMALL)
  padded = run(padded_a, padded_b, m, n, False, False, SMALL)
  assert torch.equal(got.view(torch.int32), padded.view(torch.int32))


@pytest.mark.parametrize("chunks", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("transpose_a,transpose_b",
                         [(False, False), (False, True), (True, False),
                          (True, True)])
@pytest.mark.parametrize("k", [512, 768])
def test_chunked_product_is_the_chunks_tree_bitwise(chunks, transpose_a,
                                                    transpose_b, k, rng):
  # One launch for every chunk and one for the tree against the mode's
  # definition: each K chunk det_matmul's own f32 product, added in
  # _tree_reduction's tree. Ragged M and N; K a power of two, or chunks of
  # whole K steps plus a masked one (768 / 8 = 96: 64 + 32).
  from rlk_jax import _tree_reduction
  m, n = 37, 50
  a, b, sa, sb = operands(rng, m, n, k, transpose_a, transpose_b,
                          torch.bfloat16)
  size = k // chunks
  parts = []
  for c in range(chunks):
    a_c, b_c = a[:, c * size:(c + 1) * size], b[c * size:(c + 1) * size]
    parts.append(run(a_c.T.contiguous() if transpose_a else a_c.contiguous(),
                     b_c.T.contiguous() if transpose_b else b_c.contiguous(),
                     m, n, transpose_a, transpose_b, SMALL))
  root = _tree_reduction.tree_sum(parts)
  out = {}
  for out_dtype in (torch.float32, torch.bfloat16):
    out[out_dtype] = torch.empty((m, n), dtype=out_dtype)
    det_matmul.chunked_matmul_torch(sa, sb, out[out_dtype],
                                    transpose_a=transpose_a,
                                    transpose_b=transpose_b, chunks=chunks,
                                    config=SMALL)
  assert torch.equal(out[torch.float32].view(torch.int32),
                     root.view(torch.int32))
  # A bf16 result is the root rounded once. (The interpreter's f32 -> bf16
  # conversion is its own, not torch's round-to-nearest-even: the GPU test
  # holds the rounding to torch's.)
  rounded = torch.empty((m, n), dtype=torch.bfloat16)
  det_matmul._tree_finish_kernel[(1,)](root, rounded, m * n, CHUNKS=1,
                                       BLOCK=4096)
  assert torch.equal(out[torch.bfloat16].view(torch.int16),
                     rounded.view(torch.int16))
  if chunks > 2:  # the tree's order shows in the bits: a left fold differs
    fold = parts[0]
    for p in parts[1:]:
      fold = fold + p
    assert not torch.equal(fold, root)


def test_chunked_product_names_a_bad_split(rng):
  _, _, a, b = operands(rng, 8, 16, 96, False, False, torch.bfloat16)
  out = torch.empty((8, 16))
  for chunks in (3, 64, 32):
    with pytest.raises(ValueError, match=f"chunks={chunks}.*K=96"):
      det_matmul.chunked_matmul_torch(a, b, out, transpose_a=False,
                                      transpose_b=False, chunks=chunks,
                                      config=SMALL)


def test_the_jax_route_says_why_it_is_unavailable_here():
  why = rlk_jax.implementations("det_gemm")["triton"]
  assert why is not None and "CUDA GPUs" in why
  with pytest.raises(RuntimeError, match="'triton' is not available"):
    rlk_jax.det_gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
                     implementation="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32,
                                   torch.bool, torch.float64, torch.int8])
@pytest.mark.parametrize("n_src,n_out,width", [(50, 70, 37), (300, 129, 256)])
def test_row_gather_moves_bits_and_fills(dtype, n_src, n_out, width, rng):
  src = torch.from_numpy(rng.standard_normal((n_src, width)) * 100).to(dtype)
  idx = torch.from_numpy(rng.integers(-1, n_src, n_out).astype(np.int32))
  fill = 0 if dtype in (torch.bool, torch.int8, torch.int32) else -2.5
  out = torch.empty((n_out, width), dtype=dtype)
  row_gather.gather_rows_torch(
      src, idx, fill, out,
      config=default_config(n_out, width, src.element_size()))
  want = torch.where((idx >= 0)[:, None], src[idx.clamp(min=0).long()],
                     torch.full((), fill, dtype=dtype))
  assert torch.equal(out, want)


@pytest.mark.parametrize("before", [None, "/tmp/rlk-triton-cache"])
def test_importing_jax_triton_leaves_tritons_cache_setting(before, tmp_path,
                                                           monkeypatch):
  # jax-triton 0.3.1 sets TRITON_CACHE_DIR="" when imported, which breaks
  # every later Triton launch from torch in the process: a module that does
  # the same stands in for it (jax-triton runs on GPUs only).
  from triton_kernels import backend
  (tmp_path / "jax_triton.py").write_text(
      "import os\nos.environ['TRITON_CACHE_DIR'] = ''\nMARK = 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(__import__("sys").modules, "jax_triton", raising=False)
  if before is None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
  else:
    monkeypatch.setenv("TRITON_CACHE_DIR", before)
  assert backend.jax_triton().MARK == 1
  assert os.environ.get("TRITON_CACHE_DIR") == before


def _logp_operands(rng, n, h, v, dtype=torch.bfloat16):
  hidden = torch.from_numpy(rng.standard_normal((n, h), np.float32)).to(dtype)
  weight = torch.from_numpy(
      rng.standard_normal((h, v), np.float32) / np.sqrt(h)).to(dtype)
  targets = torch.from_numpy(rng.integers(0, v, n).astype(np.int32))
  return hidden, weight, targets


def _fused_logp(hidden, weight, targets, config, temps=None,
                with_entropy=True):
  n = hidden.shape[0]
  temps = torch.ones(n) if temps is None else temps
  outs = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
  return linear_logp.linear_logp_torch(hidden, weight, targets, temps, *outs,
                                       with_entropy=with_entropy,
                                       config=config)


LOGP = Config(16, 32, 32, 1, 4, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("n,h,v", [(37, 64, 200), (16, 96, 64)])
def test_fused_logp_accurate(n, h, v, temperature, rng):
  hidden, weight, targets = _logp_operands(rng, n, h, v)
  targets[3] = -100  # ignored: log-prob 0, lse and entropy still computed
  # Per-row temperatures around the parametrized one.
  temps = torch.from_numpy(
      temperature * rng.uniform(0.8, 1.25, n).astype(np.float32))
  logp, lse, ent = _fused_logp(hidden, weight, targets, LOGP, temps)
  logits = (hidden.double() @ weight.double()) / temps.double()[:, None]
  want_lse = torch.logsumexp(logits, dim=1)
  p = torch.softmax(logits, dim=1)
  want_ent = want_lse - (p * logits).sum(dim=1)
  valid = targets >= 0
  want = torch.where(valid, logits.gather(1, targets.clamp(min=0).long()[:, None])[:, 0]
                     - want_lse, torch.zeros((), dtype=torch.float64))
  for got, ref in ((logp, want), (lse, want_lse), (ent, want_ent)):
    assert torch.isfinite(got).all()
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-5
  assert logp[3].item() == 0.0
  # Without entropy: no entropy (NaN), the same log-probs and lse bits.
  no_ent = _fused_logp(hidden, weight, targets, LOGP, temps,
                       with_entropy=False)
  assert torch.isnan(no_ent[2]).all()
  assert torch.equal(no_ent[0], logp) and torch.equal(no_ent[1], lse)


def test_fused_logp_rows_do_not_depend_on_the_batch(rng):
  hidden, weight, targets = _logp_operands(rng, 50, 64, 150)
  temps = torch.from_numpy(rng.uniform(0.5, 1.5, 50).astype(np.float32))
  full = _fused_logp(hidden, weight, targets, LOGP, temps)
  for start, rows in ((0, 1), (5, 7), (13, 33)):
    window = slice(start, start + rows)
    part = _fused_logp(hidden[window].contiguous(), weight,
                       targets[window].contiguous(), LOGP,
                       temps[window].contiguous())
    for got, want in zip(part, full):
      assert torch.equal(got.view(torch.int32),
                         want[start:start + rows].view(torch.int32))


def test_stats_over_chunks_equal_the_fused_kernel_bitwise(rng):
  # The SM90 route's split: logits a chunk at a time (det_matmul), folded by
  # the stats kernel, chunks a multiple of BLOCK_N: the same tiles, in the
  # same order, as the fused kernel's vocabulary walk.
  n, h, v, chunk = 40, 64, 160, 64
  hidden, weight, targets = _logp_operands(rng, n, h, v)
  stats = [torch.full((n,), -float("inf")), torch.zeros(n), torch.zeros(n),
           torch.zeros(n)]
  for c0 in range(0, v, chunk):
    w_c = weight[:, c0:c0 + chunk].contiguous()
    logits = torch.empty((n, w_c.shape[1]), dtype=torch.float32)
    det_matmul.matmul_torch(hidden, w_c, logits, transpose_a=False,
                            transpose_b=False, config=Config(
                                LOGP.block_m, LOGP.block_n, LOGP.block_k, 1,
                                4, 2))
    linear_logp.update_stats_torch(logits, targets - c0, torch.full((n,), 0.9),
                                   stats, config=LOGP)
  m, s, picked, weighted = stats
  # The interpreter's tl.log is numpy's: the same function here.
  lse = m + torch.from_numpy(np.log(s.numpy()))
  logp = picked - lse
  fused_logp, fused_lse, fused_ent = _fused_logp(hidden, weight, targets,
                                                 LOGP, torch.full((n,), 0.9))
  assert torch.equal(lse.view(torch.int32), fused_lse.view(torch.int32))
  assert torch.equal(logp.view(torch.int32), fused_logp.view(torch.int32))
  assert torch.equal((lse - weighted / s).view(torch.int32),
                     fused_ent.view(torch.int32))


@pytest.mark.parametrize("k", [1, 100, 1024, 2048 + 17])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_mean_rows_alone_equal_their_batch(k, dtype, rng):
  torch = pytest.importorskip("torch")
  from triton_kernels import row_sum
  dt = getattr(torch, dtype)
  x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32)).to(dt)
  batch = row_sum.row_mean_torch(x, torch.empty(9, dtype=dt))
  for i in (0, 4, 8):
    alone = row_sum.row_mean_torch(x[i:i + 1], torch.empty(1, dtype=dt))
    assert torch.equal(alone.view(torch.int16 if dtype == "bfloat16" else
                                  torch.int32),
                       batch[i:i + 1].view(torch.int16 if dtype == "bfloat16"
                                           else torch.int32))
  ref = x.double().mean(-1)
  tol = 1e-6 if dtype == "float32" else 8e-3
  assert float((batch.double() - ref).norm() / ref.norm()) < tol


def _experts(rng, counts, k, n, transposed):
  """a [S, K] sorted by expert (`counts` rows each, then 3 rows in no
  group), b [E, K, N] (a transposed view of [E, N, K] storage if
  `transposed`, as transformers hands its experts over), offs [E]."""
  s = sum(counts) + 3
  a = torch.from_numpy(rng.standard_normal((s, k), np.float32)).bfloat16()
  w = torch.from_numpy(rng.standard_normal((len(counts), k, n), np.float32))
  b = w.transpose(1, 2).contiguous().bfloat16().transpose(1, 2) \
      if transposed else w.bfloat16()
  offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
  return a, b, offs


def _groups(offs):
  from rlk_torch_bridge import _grouped_mm_op
  return _grouped_mm_op._groups(offs)


def _device_tiles(offs, rows):
  """(tiles, starts, ends) of `offs` for the kernels at SMALL's tiles."""
  from rlk_torch_bridge import _attention_rows, _grouped_mm_op
  from triton_kernels import grouped_matmul
  starts, ends, lengths = _grouped_mm_op._device_groups(offs, rows,
                                                       offs.device)
  tiles = _attention_rows.tile_map_ops(
      lengths, SMALL.block_m,
      grouped_matmul.tile_bound(rows, offs.shape[0], SMALL.block_m))
  return tiles, starts, ends


# Ragged groups, an empty one, one longer than a tile (SMALL: 32 rows).
COUNTS = (5, 0, 41, 1, 17)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k", [128, 200])
def test_grouped_products_are_det_matmul_per_expert_bitwise(transposed, k,
                                                            rng):
  # The forward, dA (b read transposed) and dB of a mixture of experts in
  # one launch each, groups read from device tensors, against det_matmul on
  # each expert's rows alone: the same bits (f32 out, so no rounding hides
  # an ulp), and 0 in rows of no group.
  from triton_kernels import grouped_matmul
  n = 48
  a, b, offs = _experts(rng, COUNTS, k, n, transposed)
  g = torch.from_numpy(rng.standard_normal((a.shape[0], n),
                                           np.float32)).bfloat16()
  tiles, starts, ends = _device_tiles(offs, a.shape[0])
  out = torch.full((a.shape[0], n), 7.0)
  grouped_matmul.grouped_matmul_torch(a, b, out, tiles, starts, ends,
                                      transpose_b=False, config=SMALL)
  da = torch.full((a.shape[0], k), 7.0)
  grouped_matmul.grouped_matmul_torch(g, b, da, tiles, starts, ends,
                                      transpose_b=True, config=SMALL)
  db = torch.full(b.shape, 7.0)
  grouped_matmul.grouped_weight_grad_torch(a, g, db, starts, ends,
                                           config=SMALL)
  for e, start, end in _groups(offs):
    rows, g_rows, w = a[start:end], g[start:end], b[e].contiguous()
    if end == start:
      assert not db[e].any(), "an expert with no rows has a zero gradient"
      continue
    want = run(rows.contiguous(), w, end - start, n, False, False, SMALL)
    assert torch.equal(out[start:end].view(torch.int32),
                       want.view(torch.int32)), e
    want = run(g_rows.contiguous(), w, end - start, k, False, True, SMALL)
    assert torch.equal(da[start:end].view(torch.int32),
                       want.view(torch.int32)), e
    want = run(rows.contiguous(), g_rows.contiguous(), k, n, True, False,
               SMALL)
    assert torch.equal(db[e].view(torch.int32), want.view(torch.int32)), e
  # Rows past the last group are in no tile: left as they were.
  assert (out[int(offs[-1]):] == 7).all() and (da[int(offs[-1]):] == 7).all()
  want = (a[:int(offs[-1])].double().unsqueeze(1)
          @ b.double()[torch.repeat_interleave(
              torch.arange(len(COUNTS)), torch.tensor(COUNTS))]).squeeze(1)
  err = float((out[:int(offs[-1])].double() - want).norm() / want.norm())
  assert err < 1e-6, err


def test_a_rows_grouped_bits_do_not_depend_on_the_other_experts(rng):
  # A row's output is its expert's product on it alone: other experts'
  # row counts (and so the tile map) move no bit of it.
  from triton_kernels import grouped_matmul
  k, n = 96, 40
  a, b, _ = _experts(rng, (10, 30, 6), k, n, False)

  def product(counts):
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    tiles, starts, ends = _device_tiles(offs, a.shape[0])
    out = torch.zeros((a.shape[0], n))
    return grouped_matmul.grouped_matmul_torch(
        a, b, out, tiles, starts, ends, transpose_b=False, config=SMALL)

  base = product((10, 30, 6))
  # Rows 0..9 stay expert 0's; expert 1 and 2 swap sizes around them.
  for counts in ((10, 6, 30), (10, 0, 36), (10, 36, 0)):
    assert torch.equal(product(counts)[:10].view(torch.int32),
                       base[:10].view(torch.int32)), counts


@pytest.mark.parametrize("transposed", [False, True])
def test_det_grouped_mm_on_the_grouped_kernels_forward_and_gradients(
    transposed, monkeypatch, rng):
  # rlk::det_grouped_mm's route on a GPU whose det_gemm runs Triton (here
  # forced, in the interpreter): its forward and both gradients through
  # autograd equal det_matmul on each expert's rows with the configs the
  # route names, bit for bit.
  from rlk_torch_bridge import _grouped_mm_op
  monkeypatch.setattr(_grouped_mm_op, "_on_grouped_kernel",
                      lambda *_: True)
  k, n = 128, 56
  a, b, offs = _experts(rng, COUNTS, k, n, transposed)
  a.requires_grad_(True)
  b.requires_grad_(True)
  g = torch.from_numpy(rng.standard_normal((a.shape[0], n),
                                           np.float32)).bfloat16()
  out = _grouped_mm_op.det_grouped_mm(a, b, offs, torch.float32, None)
  out.backward(g.float())
  rows_each = _grouped_mm_op._rows_per_expert(a, len(COUNTS))
  config = lambda *s: _grouped_mm_op._config(*s, torch.bfloat16, a)
  fwd, d_a = config(rows_each, n, k, False), config(rows_each, k, n, False)
  d_b = config(k, n, rows_each, True)
  for e, start, end in _groups(offs):
    if end == start:
      assert not b.grad[e].any()
      continue
    rows, g_rows = a[start:end].detach(), g[start:end]
    w = b[e].detach().contiguous()
    bits = lambda t: t.contiguous().view(torch.int32 if t.dtype ==
                                         torch.float32 else torch.int16)
    assert torch.equal(bits(out[start:end].detach()),
                       bits(run(rows, w, end - start, n, False, False, fwd)))
    want = run(g_rows.contiguous(), w, end - start, k, False, True, d_a,
               torch.bfloat16)
    assert torch.equal(bits(a.grad[start:end]), bits(want)), e
    want = run(rows.contiguous(), g_rows.contiguous(), k, n, True, False,
               d_b, torch.bfloat16)
    assert torch.equal(bits(b.grad[e]), bits(want)), e
  assert not out[int(offs[-1]):].any() and not a.grad[int(offs[-1]):].any()


def test_grouped_kernels_compile_with_their_gradients(monkeypatch, rng):
  # torch.compile traces a custom op's backward formula with fake tensors:
  # the grouped kernels' backward must be an operator of its own (launched
  # there, they would be handed fake tensors, as a compiled MoE trainer
  # was on the GPU). Compiled forward and gradients equal eager's bits.
  from rlk_torch_bridge import _grouped_mm_op
  monkeypatch.setattr(_grouped_mm_op, "_on_grouped_kernel",
                      lambda *_: True)
  a, b, offs = _experts(rng, (3, 0, 7), 64, 24, True)
  g = torch.from_numpy(rng.standard_normal((a.shape[0], 24),
                                           np.float32)).bfloat16()

  def step(fn, need_b=True):
    x, w = a.clone().requires_grad_(), b.detach().clone()
    w.requires_grad_(need_b)
    out = fn(x, w)
    out.backward(g)
    return out.detach(), x.grad, w.grad

  product = lambda x, w: _grouped_mm_op.det_grouped_mm(
      x, w, offs, torch.bfloat16, None)
  torch._dynamo.reset()
  compiled = torch.compile(product, backend="aot_eager", fullgraph=True)
  for need_b in (True, False):
    want, got = step(product, need_b), step(compiled, need_b)
    for x, y in zip(want, got):
      if x is None:
        assert y is None
        continue
      assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_grouped_kernels_cut_groups_at_the_rows_there_are(monkeypatch, rng):
  # Group ends past a's rows, and a group ending before the one before it:
  # the kernels' device-side groups read offs as the per-expert loop's
  # slices do (a[start:end] stops at the last row; such a group is empty).
  from rlk_torch_bridge import _grouped_mm_op
  monkeypatch.setattr(_grouped_mm_op, "_on_grouped_kernel",
                      lambda *_: True)
  k, n, rows = 64, 40, 12
  a = torch.from_numpy(rng.standard_normal((rows, k), np.float32)).bfloat16()
  b = torch.from_numpy(rng.standard_normal((4, k, n), np.float32)).bfloat16()
  offs = torch.tensor([4, 2, 9, 30], dtype=torch.int32)
  groups = _grouped_mm_op._device_groups(offs, rows, offs.device)
  assert groups.tolist() == [[0, 4, 4, 9], [4, 4, 9, 12], [4, 0, 5, 3]]
  got = _grouped_mm_op.det_grouped_mm(a, b, offs, torch.float32, None)
  config = _grouped_mm_op._config(_grouped_mm_op._rows_per_expert(a, 4), n,
                                  k, False, torch.bfloat16, a)
  for e, (start, end) in enumerate(((0, 4), (4, 4), (4, 9), (9, 12))):
    if end > start:
      want = run(a[start:end].contiguous(), b[e].contiguous(), end - start,
                 n, False, False, config)
      assert torch.equal(got[start:end].view(torch.int32),
                         want.view(torch.int32)), e
