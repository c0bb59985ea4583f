"""det_attention against the non-invariant attentions a user would run:
time (training shapes forward and forward+backward, KV-cache decode) and
invariance counts, side by side in one process.

    python -m benchmarks.bench_attention [--smoke] [--csv out.csv]

Competitors (stable names): torch ``rlk_torch`` (the bridge: the Triton
kernels on torch's stream; ``rlk_torch_paged`` the decode rows' cache in
16-key pages), ``sdpa_flash``, ``sdpa_cudnn``,
``sdpa_efficient`` (torch's SDPA with one backend forced), ``sdpa_default``
(SDPA's own choice); JAX ``rlk_jax`` and ``jax_cudnn``
(``jax.nn.dot_product_attention(implementation="cudnn")``). Training
cases are equal-length batches (every peer takes them) and one ragged pack
(rlk only: none of the peers here takes varlen rows). The ``invariance``
rows count, per competitor, the positions of one sequence whose output
differs between a batch of 8 and alone, and the decode rows (one query
against the prefix as a cache) that differ from the prefill's rows.
"""

from __future__ import annotations

import contextlib

import numpy as np
from absl import app

from benchmarks import harness
from benchmarks.harness import Row

BENCH = "attention"
PAGE = 16  # the paged rows' block size (vLLM's default)


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(heads=(4, 2, 64), train=[(2, 64)], ragged=(128, 16, 64),
                decode=[(2, 128)], invariance_s=64, iters=2)
  return dict(heads=(32, 8, 128), train=[(8, 2048), (16, 4096)],
              ragged=(65536, 128, 8192),
              decode=[(1, 1024), (1, 32768), (16, 8192), (16, 32768),
                      (64, 8192), (256, 1024), (256, 4096)],
              invariance_s=512, iters=10)


def _sdpa_backends(torch):
  from torch.nn.attention import SDPBackend
  return {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
          "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
          "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
          "sdpa_default": None}


def _sdpa(torch, backend, causal=True):
  """SDPA on [B, S, H, D] tensors (transposed views), GQA by enable_gqa."""
  from torch.nn.attention import sdpa_kernel
  import torch.nn.functional as F

  def run(q, k, v):
    ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with ctx:
      return F.scaled_dot_product_attention(
          q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
          is_causal=causal, enable_gqa=True).transpose(1, 2)
  return run


def _torch_competitors(torch):
  import rlk_torch_bridge as rtb
  comps = {"rlk_torch": lambda q, k, v: rtb.det_attention(q, k, v)}
  for name, backend in _sdpa_backends(torch).items():
    comps[name] = _sdpa(torch, backend)
  return comps


def _flops(b, s, hq, d):
  return 4.0 * b * hq * d * s * (s + 1) / 2  # two products, causal half


def _train_rows(torch, cfg, b, s) -> list[Row]:
  hq, hkv, d = cfg["heads"]
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  gen = torch.Generator(device=dev).manual_seed(b * s)
  mk = lambda h: torch.randn((b, s, h, d), device=dev, dtype=torch.bfloat16,
                             generator=gen)
  q, k, v, g = mk(hq), mk(hkv), mk(hkv), mk(hq)
  case = f"train B={b} S={s} H={hq}/{hkv} D={d}"
  rows = []
  fwd, step = {}, {}
  for name, fn in _torch_competitors(torch).items():
    def make_fwd(fn=fn):
      return harness.torch_batch(lambda: fn(q, k, v), [()])

    def make_step(fn=fn):
      qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

      def once():
        fn(qq, kk, vv).backward(g)
      return harness.torch_batch(once, [()])
    fwd[name], step[name] = make_fwd, make_step
  flops = _flops(b, s, hq, d)
  rows += harness.interleaved_rows(BENCH, case + " fwd", fwd, flops=flops,
                                   iters=cfg["iters"])
  rows += harness.interleaved_rows(BENCH, case + " fwd+bwd", step,
                                   flops=3.5 * flops, iters=cfg["iters"])
  rows += _jax_train_rows(cfg, b, s, case, flops)
  return rows


def _jax_train_rows(cfg, b, s, case, flops) -> list[Row]:
  import jax
  import jax.numpy as jnp
  import rlk_jax
  hq, hkv, d = cfg["heads"]
  keys = jax.random.split(jax.random.key(b + s), 4)
  q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
  g = jax.random.normal(keys[3], (b, s, hq, d), jnp.bfloat16)
  comps = {"rlk_jax": rlk_jax.det_attention}
  if harness.on_gpu():
    comps["jax_cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")

  def grads(fn):
    return lambda q, k, v, g: jax.vjp(fn, q, k, v)[1](g)
  fwd = {n: (lambda fn=fn: harness.jax_batch(fn, [(q, k, v)]))
         for n, fn in comps.items()}
  step = {n: (lambda fn=fn: harness.jax_batch(grads(fn), [(q, k, v, g)]))
          for n, fn in comps.items()}
  return (harness.interleaved_rows(BENCH, case + " fwd", fwd, flops=flops,
                                   iters=cfg["iters"])
          + harness.interleaved_rows(BENCH, case + " fwd+bwd", step,
                                     flops=3.5 * flops, iters=cfg["iters"]))


def _ragged_rows(torch, cfg) -> list[Row]:
  """One pack of ragged sequences (lengths drawn in [lo, hi]): rlk only."""
  import rlk_torch_bridge as rtb
  total, lo, hi = cfg["ragged"]
  hq, hkv, d = cfg["heads"]
  rng = np.random.default_rng(0)
  lengths = []
  while sum(lengths) < total:
    lengths.append(int(min(rng.integers(lo, hi + 1), total - sum(lengths))))
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]),
                    dtype=torch.int32, device=dev)
  mk = lambda h: torch.randn((total, h, d), device=dev, dtype=torch.bfloat16)
  q, k, v, g = mk(hq), mk(hkv), mk(hkv), mk(hq)
  flops = sum(_flops(1, n, hq, d) for n in lengths)
  case = (f"packed {total} tokens, {len(lengths)} seqs of {lo}-{hi}, "
          f"H={hq}/{hkv} D={d}")
  qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

  def step():
    rtb.det_attention(qq, kk, vv, cu_seqlens=cu).backward(g)
  return (harness.interleaved_rows(
      BENCH, case + " fwd", {"rlk_torch": lambda: harness.torch_batch(
          lambda: rtb.det_attention(q, k, v, cu_seqlens=cu), [()])},
      flops=flops, iters=cfg["iters"])
      + harness.interleaved_rows(
          BENCH, case + " fwd+bwd",
          {"rlk_torch": lambda: harness.torch_batch(step, [()])},
          flops=3.5 * flops, iters=cfg["iters"]))


def _decode_rows(torch, cfg, b, ctx) -> list[Row]:
  """One new token per sequence against a full cache of `ctx` keys, every
  competitor replayed from a CUDA graph (a decode loop's launches are the
  host's cost, not the kernel's)."""
  import rlk_torch_bridge as rtb
  hq, hkv, d = cfg["heads"]
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  q = torch.randn((b, 1, hq, d), device=dev, dtype=torch.bfloat16)
  kc = torch.randn((b, ctx, hkv, d), device=dev, dtype=torch.bfloat16)
  vc = torch.randn((b, ctx, hkv, d), device=dev, dtype=torch.bfloat16)
  lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
  comps = {"rlk_torch": lambda: rtb.det_attention(q, kc, vc, kv_lens=lens)}
  if ctx % PAGE == 0:
    # The same cache in vLLM's paged layout, its blocks shuffled (the same
    # bits as the contiguous cache; what the table's indirection costs).
    blocks = ctx // PAGE
    order = torch.randperm(b * blocks, device=dev)
    kp = torch.empty_like(kc.view(b * blocks, PAGE, hkv, d))
    vp = torch.empty_like(kp)
    kp[order] = kc.view(b * blocks, PAGE, hkv, d)
    vp[order] = vc.view(b * blocks, PAGE, hkv, d)
    tables = order.view(b, blocks).to(torch.int32)
    comps["rlk_torch_paged"] = lambda: rtb.det_attention(
        q, kp, vp, kv_lens=lens, block_tables=tables)
  for name, backend in _sdpa_backends(torch).items():
    fn = _sdpa(torch, backend, causal=False)  # one query sees every key
    comps[name] = lambda fn=fn: fn(q, kc, vc)
  case = f"decode B={b} ctx={ctx} H={hq}/{hkv} D={d}"
  nbytes = 2 * b * ctx * hkv * d * 2  # the cache, read once
  rows = harness.interleaved_rows(
      BENCH, case, {n: (lambda f=f: harness.torch_batch(
          f, [()], graph=dev == "cuda")) for n, f in comps.items()},
      iters=cfg["iters"])
  for row in rows:
    if row.median_ms:
      row.gbps = nbytes / row.median_ms / 1e6
  return rows


def _differing(torch, a, b) -> int:
  """Positions (rows of [S, H, D]) where any bit differs."""
  return int((a.view(torch.int16) != b.view(torch.int16)).flatten(1).any(1)
             .sum())


def _invariance_rows(torch, cfg) -> list[Row]:
  import rlk_torch_bridge as rtb
  hq, hkv, d = cfg["heads"]
  s = cfg["invariance_s"]
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  gen = torch.Generator(device=dev).manual_seed(7)
  mk = lambda h: torch.randn((8, s, h, d), device=dev, dtype=torch.bfloat16,
                             generator=gen)
  q, k, v = mk(hq), mk(hkv), mk(hkv)
  positions = [0, s // 4 + 1, s // 2 + 3, s - 1]
  rows = []
  decoders = {"rlk_torch": lambda p: rtb.det_attention(
      q[:1, p:p + 1], k[:1], v[:1], kv_lens=torch.tensor(
          [p + 1], dtype=torch.int32, device=dev))}
  for name, backend in _sdpa_backends(torch).items():
    fn = _sdpa(torch, backend, causal=False)
    decoders[name] = lambda p, fn=fn: fn(q[:1, p:p + 1], k[:1, :p + 1],
                                         v[:1, :p + 1])
  for name, fn in _torch_competitors(torch).items():
    try:
      batch = fn(q, k, v)[0]
      alone = fn(q[:1], k[:1], v[:1])[0]
      batch_diff = _differing(torch, batch, alone)
      decode_diff = sum(_differing(torch, decoders[name](p)[0], alone[p:p + 1])
                        for p in positions)
    except Exception as e:  # noqa: BLE001 - reported in the table
      rows.append(Row(BENCH, f"invariance S={s}", name,
                      note=f"FAILED: {type(e).__name__}: {str(e)[:100]}"))
      continue
    rows.append(harness.progress(Row(
        BENCH, f"invariance S={s}", name,
        note=f"batch 8 vs alone: {batch_diff} of {s} positions differ; "
             f"decode vs prefill: {decode_diff} of {len(positions)} differ")))
  return rows


def run(smoke: bool) -> list[Row]:
  torch = harness.torch_or_none()
  if torch is None:
    return [Row(BENCH, "all", "rlk_torch", note="torch is not installed")]
  cfg = _config(smoke)
  rows = _invariance_rows(torch, cfg)
  for b, s in cfg["train"]:
    rows += _train_rows(torch, cfg, b, s)
  rows += _ragged_rows(torch, cfg)
  for b, ctx in cfg["decode"]:
    rows += _decode_rows(torch, cfg, b, ctx)
  return rows


def main(argv):
  del argv
  rows = run(harness.smoke_mode())
  print(harness.format_table(rows, peer="sdpa_flash"))


if __name__ == "__main__":
  app.run(main)
