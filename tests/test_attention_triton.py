"""triton_kernels.attention launched as the torch bridge launches it: on
CPU in Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU)
with small tiles, on a GPU with the device's: a row's output and gradients
alone vs in a ragged pack, decode vs prefill (one and several query heads
per program, key chunks in one program or split over several), against
float64."""

import os

import numpy as np
import pytest

from attention_checks import bits, dense_f64, pack_sequences, rel_err, sequences
from conftest import ON_GPU

triton = pytest.importorskip("triton", reason="Triton wheels: Linux x86_64")
torch = pytest.importorskip("torch")
from rlk_torch_bridge import _attention_rows  # noqa: E402
from triton_kernels import attention as kernels  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPUs run the kernels in Triton's interpreter only"),
    pytest.mark.filterwarnings(
        "ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

HQ, HKV, D = 4, 2, 64
# On a GPU the same tests run the device's own tiles (test_attention.py
# covers the routes around them).
CONFIG = kernels.config_for(D) if ON_GPU else kernels.interpreter_config(D)
DEVICE = "cuda" if ON_GPU else "cpu"


def _t(x):
  return torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE, torch.bfloat16)


def _seqs(rows):  # [(q_start, q_len, k_start, k_len)] -> int32 [4, B]
  return torch.tensor(np.asarray(rows, np.int32).T.copy(), device=DEVICE)


def forward(q, k, v, seqs, statics, heads_per_tile=1, split_chunks=0,
            config=CONFIG, page=0):
  tokens = config.tile_rows(bool(split_chunks)) // heads_per_tile
  tiles = _attention_rows.tile_map(seqs[1], tokens, kernels.tile_bound(
      q.shape[0], seqs.shape[1], tokens))
  out = torch.full_like(q, float("nan"))  # poisoned: every row is written
  lse = torch.full(q.shape[:2], float("nan"), device=q.device)
  return kernels.forward_torch(q, k, v, seqs, tiles, out, lse, statics,
                               config, heads_per_tile, split_chunks, page)


def backward(q, k, v, seqs, g, statics):
  out, lse = forward(q, k, v, seqs, statics)
  dq_rows = CONFIG.dq_tiles()[0]
  q_tiles = _attention_rows.tile_map(seqs[1], dq_rows,
                                    kernels.tile_bound(q.shape[0], seqs.shape[1],
                                                       dq_rows))
  k_tiles = _attention_rows.tile_map(seqs[3], CONFIG.bwd_block_n,
                                    kernels.tile_bound(
                                        k.numel() // k.shape[-1] // HKV,
                                        seqs.shape[1], CONFIG.bwd_block_n))
  nan = lambda x: torch.full_like(x, float("nan"))
  return kernels.backward_torch(q, k, v, out, lse, g, seqs, q_tiles, k_tiles,
                                nan(q), nan(k), nan(v), statics, CONFIG)


@pytest.mark.parametrize("window,softcap", [(None, None), (9, None),
                                            (None, 5.0)])
def test_pack_equals_alone_forward_and_backward(rng, window, softcap):
  statics = kernels.Statics(HQ // HKV, D, D ** -0.5, softcap, window)
  seqs = sequences(rng, [45, 3, 20], HQ, HKV, D)
  q, k, v, cu, starts = pack_sequences(seqs)
  g = rng.standard_normal(q.shape).astype(np.float32)
  meta = _seqs([(a, b - a, a, b - a) for a, b in zip(cu[:-1], cu[1:])])
  out, _ = forward(_t(q), _t(k), _t(v), meta, statics)
  grads = backward(_t(q), _t(k), _t(v), meta, _t(g), statics)
  for s, start in zip(seqs, starts):
    n = s[0].shape[0]
    one = _seqs([(0, n, 0, n)])
    alone, _ = forward(*map(_t, s), one, statics)
    assert np.array_equal(bits(alone), bits(out[start:start + n]))
    for a, b in zip(backward(*map(_t, s), one, _t(g[start:start + n]),
                             statics), grads):
      assert np.array_equal(bits(a), bits(b[start:start + n]))
    want = dense_f64(*(_t(x).double().cpu().numpy() for x in s),
                     window=window, softcap=softcap)
    assert rel_err(alone.double().cpu().numpy(), want) < 1e-2


# The interpreter takes seconds a launch: two of the four plans on CPUs.
@pytest.mark.parametrize("heads_per_tile,split",
                         [(1, False), (2, False), (1, True), (2, True)]
                         if ON_GPU else [(1, False), (2, True)])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("d", kernels.HEAD_DIMS if ON_GPU else (64,))
def test_decode_equals_prefill(rng, heads_per_tile, split, window, d):
  """One token against the cache, in one program or with its key chunks
  (three of them) in parallel programs folded by a second kernel: the
  prefill's bits."""
  statics = kernels.Statics(HQ // HKV, d, d ** -0.5, None, window)
  config = kernels.config_for(d) if ON_GPU else CONFIG
  fold = config.fold_keys
  n = 2 * fold + 6
  (q, k, v), = sequences(rng, [n], HQ, HKV, d)
  full, full_lse = forward(_t(q), _t(k), _t(v), _seqs([(0, n, 0, n)]),
                           statics, config=config)
  chunks = -(-n // fold) if split else 0
  for pos in (0, 15, fold - 1, fold, fold + 15, n - 1):
    out, lse = forward(_t(q[pos:pos + 1]), _t(k), _t(v),
                       _seqs([(0, 1, 0, pos + 1)]), statics, heads_per_tile,
                       chunks, config=config)
    assert np.array_equal(bits(out[0]), bits(full[pos])), pos
    assert torch.equal(lse[0], full_lse[pos])


@pytest.mark.parametrize("page,n,hpt,window,softcap", [
    (4, 1, 1, None, None), (12, 3, 2, 7, None), (16, 1, 1, None, 5.0)])
def test_paged_cache_gives_the_contiguous_caches_bits(rng, page, n, hpt,
                                                      window, softcap):
  """Sequences whose keys lie in shuffled blocks of a paged cache (page
  sizes that do and do not divide the kernels' key blocks): the bits of
  the same keys in a contiguous cache, output and lse."""
  statics = kernels.Statics(HQ // HKV, D, D ** -0.5, softcap, window)
  lens = [n, n + 2, 37, 50]                 # keys, the n new ones included
  b, blocks = len(lens), -(-max(lens) // page) + 1
  n_blocks = b * blocks + 3                 # spare blocks nobody uses
  tables = rng.permutation(n_blocks)[:b * blocks].reshape(b, blocks)
  kc, vc = (rng.standard_normal((n_blocks * page, HKV, D)) for _ in "kv")
  q = rng.standard_normal((b * n, HQ, D))
  rows = (tables[:, :, None] * page + np.arange(page)).reshape(-1)
  chunks = -(-(blocks * page) // CONFIG.fold_keys)
  contiguous = _seqs([(i * n, n, i * blocks * page, length)
                      for i, length in enumerate(lens)])
  paged = torch.cat([_seqs([(i * n, n, 0, length)
                            for i, length in enumerate(lens)]),
                     torch.tensor(tables.T.astype(np.int32), device=DEVICE)])
  want, want_lse = forward(_t(q), _t(kc[rows]), _t(vc[rows]), contiguous,
                           statics, hpt, chunks)
  got, got_lse = forward(_t(q), _t(kc), _t(vc), paged, statics, hpt, chunks,
                         page=page)
  assert np.array_equal(bits(got), bits(want))
  assert torch.equal(got_lse, want_lse)
  assert not torch.isnan(got.float()).any()


def test_paged_cache_bad_tables_and_lengths_come_back_nan(rng):
  """A table entry outside the cache, a length past the table and one
  shorter than the new tokens (what no host check sees on CUDA): the
  kernel reads inside the cache and the table, makes those sequences' rows
  and lse NaN itself, and the others keep their bits, one whose table has
  a bad entry past its length among them (an entry it never uses)."""
  statics = kernels.Statics(HQ // HKV, D, D ** -0.5, None, None)
  page, n, lens, blocks = 8, 2, [9, 20, 14, 11], 3
  kc, vc = (rng.standard_normal((12 * page, HKV, D)) for _ in "kv")
  q = rng.standard_normal((4 * n, HQ, D))
  tables = np.arange(12, dtype=np.int32).reshape(4, 3)
  chunks = -(-(blocks * page) // CONFIG.fold_keys)

  def run(tables, lens):
    seqs = torch.cat([_seqs([(i * n, n, 0, k) for i, k in enumerate(lens)]),
                      torch.tensor(tables.T.copy(), device=DEVICE)])
    return forward(_t(q), _t(kc), _t(vc), seqs, statics, 1, chunks,
                   page=page)
  good, good_lse = run(tables, lens)
  bad_tables = tables.copy()
  bad_tables[0, 1] = 10 ** 6       # used: keys 8..15 of 9
  bad_tables[2, 2] = -5            # unused: keys 16.. of 14
  bad, bad_lse = run(bad_tables, [lens[0], 10 ** 4, lens[2], 1])
  rows = lambda i: slice(i * n, (i + 1) * n)
  for i in (0, 1, 3):
    assert torch.isnan(bad[rows(i)].float()).all(), i
    assert torch.isnan(bad_lse[rows(i)]).all(), i
  assert np.array_equal(bits(bad[rows(2)]), bits(good[rows(2)]))
  assert torch.equal(bad_lse[rows(2)], good_lse[rows(2)])
  assert not torch.isnan(good.float()).any()


@pytest.mark.parametrize("n,hpt,window,softcap", [(1, 1, None, None),
                                                  (1, 2, 9, None),
                                                  (3, 1, None, 5.0)])
def test_cache_step_reads_sdpa_cache_in_place_with_the_same_bits(
    rng, n, hpt, window, softcap):
  # transformers' cache [B, Hkv, S, D] read in place (the eager decode
  # step) against the kernels on [B * S, Hkv, D] rows: the same bits.
  from rlk_torch_bridge import _cache_step
  b, s_cache = 3, 70
  statics = kernels.Statics(HQ // HKV, D, D ** -0.5, softcap, window)
  query = _t(rng.standard_normal((b, HQ, n, D)))
  key = _t(rng.standard_normal((b, HKV, s_cache, D)))
  value = _t(rng.standard_normal((b, HKV, s_cache, D)))
  kv_start = torch.tensor([0, 5, 31], dtype=torch.int32, device=DEVICE)
  kv_lens = torch.tensor([70, 40, 3 + n], dtype=torch.int32, device=DEVICE)
  chunks = -(-s_cache // CONFIG.fold_keys)
  seqs = _cache_step.sequence_table(key, n, kv_start, kv_lens)
  step = _cache_step.run(query, key, value, seqs, D ** -0.5, softcap, window,
                         config=CONFIG, plan=(hpt, chunks))
  rows = lambda x: x.transpose(1, 2).reshape(-1, *x.shape[1:2], D)
  flat = _seqs([(i * n, n, i * s_cache + int(kv_start[i]), int(kv_lens[i]))
                for i in range(b)])
  out, _ = forward(rows(query).contiguous(), rows(key).contiguous(),
                   rows(value).contiguous(), flat, statics, hpt, chunks)
  np.testing.assert_array_equal(bits(step.reshape(-1, HQ, D)), bits(out))
  assert not torch.isnan(step).any()
  # One Step serves every layer of a forward: made from this layer's
  # tensors, it gives another layer's (other values, the same shapes)
  # that layer's own bits, and this layer's again.
  made = _cache_step.Step(query, key, value, seqs, None, D ** -0.5, softcap,
                          window, config=CONFIG, plan=(hpt, chunks))
  other = [_t(rng.standard_normal(x.shape)) for x in (query, key, value)]
  want = _cache_step.run(*other, seqs, D ** -0.5, softcap, window,
                         config=CONFIG, plan=(hpt, chunks))
  np.testing.assert_array_equal(bits(made(*other)), bits(want))
  np.testing.assert_array_equal(bits(made(query, key, value)), bits(step))


def test_in_place_rows_of_a_transposed_cache_give_the_rows_bits(rng):
  # Keys and values [B, Hkv, S, D] read in place through their [B, S, Hkv,
  # D] transpose (row b * stride(0) / stride(1) + t), forward and backward,
  # against the same tokens copied into rows: the same bits, and dk, dv
  # written where k and v lie.
  b, s = 2, 21
  statics = kernels.Statics(HQ // HKV, D, D ** -0.5, None, None)
  q, g = (_t(rng.standard_normal((b * s, HQ, D))) for _ in range(2))
  k, v = (_t(rng.standard_normal((b, HKV, s, D))) for _ in range(2))
  lengths = [(0, s), (4, s - 4)]  # (first token, length): one left-padded
  rows = lambda x: x.transpose(1, 2).reshape(b * s, HKV, D).contiguous()
  flat = _seqs([(i * s + f, n, i * s + f, n) for i, (f, n) in
                enumerate(lengths)])
  in_place = _seqs([(i * s + f, n, i * HKV * s + f, n) for i, (f, n) in
                    enumerate(lengths)])
  want = backward(q, rows(k), rows(v), flat, g, statics)
  got = backward(q, k.transpose(1, 2), v.transpose(1, 2), in_place, g,
                 statics)
  assert np.array_equal(bits(got[0]), bits(want[0]))
  for i, (f, n) in enumerate(lengths):
    for a, w in zip(got[1:], want[1:]):
      assert np.array_equal(bits(a[i, f:f + n]),
                            bits(w[i * s + f:i * s + f + n]))


@pytest.mark.parametrize("n_seqs", [1, 3, 17, 300])
def test_one_kernel_tile_map_is_the_ops_one(rng, n_seqs):
  # The CUDA route's tile map (one launch) against torch's ops, which the
  # JAX map's test pins: ragged lengths with zeros, and spare tiles past
  # the last sequence (-1).
  lengths = rng.integers(0, 400, size=n_seqs).astype(np.int32)
  lengths[rng.integers(0, n_seqs)] = 0
  lengths_t = torch.tensor(lengths, device=DEVICE)
  for rows in (16, 64, 128):
    n_tiles = kernels.tile_bound(int(lengths.sum()), n_seqs, rows) + 5
    got = kernels.tile_map_torch(lengths_t, rows, n_tiles)
    want = _attention_rows.tile_map_ops(lengths_t, rows, n_tiles)
    assert torch.equal(got.cpu(), want.cpu()), rows


@pytest.mark.parametrize("n_seqs", [1, 5, 40])
def test_fill_outside_writes_only_rows_in_no_sequence(rng, n_seqs):
  # The CUDA route's fill (one launch, only the rows outside) against
  # torch's masked fill: packed rows with gaps and spare capacity, lse
  # rows, and [B, S, H, D] tokens read in place (a transposed cache).
  lengths = rng.integers(0, 30, size=n_seqs).astype(np.int32)
  gaps = rng.integers(0, 4, size=n_seqs).astype(np.int32)
  starts = (np.cumsum(lengths + gaps) - lengths).astype(np.int32)
  n_rows = int(starts[-1] + lengths[-1]) + 7
  s_t, l_t = (torch.tensor(x, device=DEVICE) for x in (starts, lengths))
  covered = _attention_rows.covered(s_t, l_t, n_rows)
  for shape, value in (((n_rows, 3, 8), 0.0), ((n_rows, 3), float("-inf"))):
    x = torch.tensor(rng.standard_normal(shape), dtype=torch.float32,
                     device=DEVICE)
    want = x.masked_fill(~covered.view((-1,) + (1,) * (x.ndim - 1)), value)
    assert torch.equal(kernels.fill_outside_torch(x, s_t, l_t, n_rows, value),
                       want)
  # In place: batch row b's token t is row b * stride(0) / stride(1) + t of
  # a [B, H, S', D] cache seen as [B, S, H, D], sequence b at `first[b]`
  # in its batch row.
  b, s, slots = 3, 12, 16
  first = np.array([0, 5, 2], np.int32)
  n = np.array([12, 7, 0], np.int32)
  cache = torch.tensor(rng.standard_normal((b, 2, slots, 8)),
                       dtype=torch.float32, device=DEVICE)
  x = cache.transpose(1, 2)[:, :s]
  per_batch_row = x.stride(0) // x.stride(1)
  seq_starts = torch.tensor(first + np.arange(b, dtype=np.int32)
                            * per_batch_row, device=DEVICE)
  lens = torch.tensor(n, device=DEVICE)
  rows = (b - 1) * per_batch_row + s
  want = x.clone()
  for i in range(b):
    want[i, :first[i]] = 0
    want[i, first[i] + n[i]:] = 0
  kernels.fill_outside_torch(x, seq_starts, lens, rows, 0.0)
  assert torch.equal(x, want)
