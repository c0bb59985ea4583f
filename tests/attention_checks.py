"""det_attention's contract as checks shared by the CPU and GPU tests: each
takes an `attend(q, k, v, **layout)` (one route: JAX or torch, one
implementation) and numpy inputs, and asserts bitwise invariance or
accuracy against float64."""

from __future__ import annotations

import numpy as np


def bits(x) -> np.ndarray:
  """The bit patterns of a bf16/f16 array (torch or JAX) as uint16."""
  if hasattr(x, "detach"):  # torch
    import torch
    return x.detach().cpu().view(torch.int16).numpy().view(np.uint16)
  return np.asarray(x).view(np.uint16)


def f32_bits(x) -> np.ndarray:
  """The bit patterns of an f32 array (torch or JAX; an lse) as uint32."""
  x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
  return x.astype(np.float32).view(np.uint32)


def same_bits(a, b) -> bool:
  """Whether two bf16/f16 arrays (torch or JAX) hold the same bits."""
  return np.array_equal(bits(a), bits(b))


def dense_f64(q, k, v, *, window=None, softcap=None, scale=None):
  """Causal attention of one sequence in float64: q [T, Hq, D], k, v [T,
  Hkv, D] (numpy)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, hq, d = q.shape
  g = hq // k.shape[1]
  k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
  s = np.einsum("thd,shd->hts", q, k) * (scale or d ** -0.5)
  if softcap:
    s = softcap * np.tanh(s / softcap)
  i = np.arange(t)
  ok = i[None, :] <= i[:, None]
  if window:
    ok &= i[None, :] > i[:, None] - window
  s = np.where(ok, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, v)


def dense_f64_torch(q, k, v, *, window=None):
  """`dense_f64` in torch (q [T, Hq, D], k, v [T, Hkv, D] float64 tensors):
  differentiable, so the gradients' float64 reference."""
  import torch
  t, hq, d = q.shape
  g = hq // k.shape[1]
  s = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1)) * d ** -0.5
  i = torch.arange(t)
  ok = i[None, :] <= i[:, None]
  if window:
    ok &= i[None, :] > i[:, None] - window
  s = s.masked_fill(~ok, -torch.inf)
  return torch.einsum("hts,shd->thd", s.softmax(-1), v.repeat_interleave(g, 1))


def rel_err(got, want) -> float:
  got = np.asarray(got, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def sequences(rng, lengths, hq, hkv, d):
  """Fresh random q, k, v per sequence, float32 numpy (callers cast)."""
  return [tuple(rng.standard_normal((n, h, d)).astype(np.float32)
                for h in (hq, hkv, hkv)) for n in lengths]


def pack_sequences(seqs, spare=0):
  """Concatenate [T, H, D] sequences, plus `spare` junk rows at the end (a
  pack's unused capacity: they prove that nothing outside a sequence leaks
  in). Returns (q, k, v, cu_seqlens, starts)."""
  cu = np.concatenate([[0], np.cumsum([s[0].shape[0] for s in seqs])])
  parts = []
  for i in range(3):
    tail = np.full((spare,) + seqs[0][i].shape[1:], 7.0, np.float32)
    parts.append(np.concatenate([s[i] for s in seqs] + [tail]))
  return (*parts, cu.astype(np.int32), [int(c) for c in cu[:-1]])


def padded_batch(seqs, s, left: bool):
  """[B, S, H, D] with each sequence left- or right-aligned, junk (not
  zeros) in the padding, and the key padding mask."""
  b = len(seqs)
  out = []
  for i in range(3):
    h = seqs[0][i].shape[1]
    x = np.full((b, s, h, seqs[0][i].shape[2]), -3.0, np.float32)
    for j, sq in enumerate(seqs):
      n = sq[i].shape[0]
      if left:
        x[j, s - n:] = sq[i]
      else:
        x[j, :n] = sq[i]
    out.append(x)
  lengths = np.array([sq[0].shape[0] for sq in seqs])
  cols = np.arange(s)[None]
  mask = (cols >= s - lengths[:, None]) if left else (cols < lengths[:, None])
  return (*out, mask)
