"""linear_logp (hidden @ W -> log-prob of the target, never holding [N, V])
against the dense path: time and memory, forward and forward+backward.

    python -m benchmarks.bench_logp [--smoke] [--csv out.csv]

Competitors (stable names): ``xla_dense`` (``log_softmax(h @ W)`` gathered,
in XLA), ``torch_dense`` (the same in torch), ``rlk_<impl>``
(``rlk_jax.linear_logp``); ``*_vjp`` rows add the backward (gradients for
hidden and W). Memory: for JAX the temporaries XLA plans for the compiled
call (``memory_analysis``, inputs and outputs excluded); for torch the peak
allocated beyond the inputs. The end-to-end rows pack a padded batch at a
given density and run linear_logp on the packed rows, against dense logp on
the padded batch. On a GPU with torch, ``logp_torch_peers`` adds the torch
route against Liger's and verl's fused kernels, dense and compiled torch,
each against the measured product floor, with its invariance count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import rlk_jax
from benchmarks import harness, logp_torch_peers
from benchmarks.harness import Row

BENCH = "logp"


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(n=256, h=128, vocabs=(1000,), e2e=(4, 64, 1000),
                densities=(0.25,), torch_peers=((256, 128, 1024),))
  return dict(n=16384, h=4096, vocabs=(32768, 131072, 151936),
              e2e=(16, 1024, 32768), densities=(0.05, 0.25, 0.5, 1.0),
              # (N, H, V): the grid corners and middle.
              torch_peers=((4096, 2048, 32768), (16384, 4096, 151936),
                           (65536, 8192, 262144)))


def dense_logp(hidden, weight, targets):
  logits = jnp.dot(hidden, weight, preferred_element_type=jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]


def _loss_grads(logp_fn):
  return jax.grad(lambda h, w, t: logp_fn(h, w, t).sum(), argnums=(0, 1))


def _rlk_impls(smoke: bool):
  return [n for n, why in rlk_jax.implementations("linear_logp").items()
          if why is None and (smoke or n != "xla")]  # the oracle is minutes here


def _temporaries_mb(fn, *args) -> float:
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return stats.temp_size_in_bytes / 2**20


def _row(case, name, fn, arg_sets, flops, dense: Row | None) -> Row:
  try:
    peak, note = _temporaries_mb(fn, *arg_sets[0]), ""
  except Exception as e:  # noqa: BLE001 - a missing figure, reported
    peak, note = None, f"memory_analysis failed: {type(e).__name__}"
  # Calls of 10-200 ms: a few per sample are plenty.
  row = harness.timed_row(BENCH, case, name, fn, arg_sets, flops=flops,
                          peak_mem_mb=peak, note=note, iters=2)
  if (dense is not None and dense.median_ms and row.median_ms
      and peak is not None and dense.peak_mem_mb):
    row.note = (f"{row.median_ms / dense.median_ms:.2f}x time, "
                f"{row.peak_mem_mb / dense.peak_mem_mb:.1%} memory of "
                f"{dense.implementation}").strip()
  return row


def _torch_row(case, hidden, weight, targets, flops, backward: bool) -> Row | None:
  torch = harness.torch_or_none()
  if torch is None or not harness.on_gpu():
    return None
  th, tw = (torch.from_dlpack(x) for x in (hidden, weight))
  tt = torch.from_dlpack(targets).long()
  if backward:
    th, tw = th.detach().requires_grad_(), tw.detach().requires_grad_()

  def call(h, w, t):
    logp = torch.log_softmax((h @ w).float(), dim=-1).gather(1, t[:, None])[:, 0]
    if backward:
      torch.autograd.grad(logp.sum(), (h, w))
    return logp

  name = "torch_dense_vjp" if backward else "torch_dense"
  try:
    call(th, tw, tt)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call(th, tw, tt)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = harness.time_torch(call, [(th, tw, tt)], iters=2)
  except Exception as e:  # noqa: BLE001
    return Row(BENCH, case, name, note=f"FAILED: {type(e).__name__}: {e}"[:160])
  finally:
    torch.cuda.empty_cache()
  return harness.progress(Row(BENCH, case, name, ms, tflops=flops / ms / 1e9,
                             peak_mem_mb=peak,
                             note="peak allocated beyond inputs"))


def _vocab_rows(cfg, smoke) -> list[Row]:
  rows = []
  n, h = cfg["n"], cfg["h"]
  for v in cfg["vocabs"]:
    keys = jax.random.split(jax.random.key(v), 5)
    weight = (jax.random.normal(keys[0], (h, v), jnp.float32)
              / np.sqrt(h)).astype(jnp.bfloat16)
    arg_sets = [(jax.random.normal(keys[1 + i], (n, h), jnp.float32
                                   ).astype(jnp.bfloat16), weight,
                 jax.random.randint(keys[3 + i], (n,), 0, v, jnp.int32))
                for i in range(2)]
    flops = 2 * n * h * v
    case = f"N={n} H={h} V={v} bf16"
    dense = _row(case, "xla_dense", dense_logp, arg_sets, flops, None)
    dense.note = "XLA temporaries (peak MB)"
    rows.append(dense)
    rows.append(_torch_row(case, *arg_sets[0], flops, backward=False))
    for impl in _rlk_impls(smoke):
      fn = functools.partial(rlk_jax.linear_logp, implementation=impl)
      rows.append(_row(case, f"rlk_{impl}", fn, arg_sets, flops, dense))
    bcase = case + " fwd+bwd"
    dense_bwd = _row(bcase, "xla_dense_vjp", _loss_grads(dense_logp), arg_sets,
                     3 * flops, None)
    dense_bwd.note = "XLA temporaries (peak MB)"
    rows.append(dense_bwd)
    rows.append(_torch_row(bcase, *arg_sets[0], 3 * flops, backward=True))
    for impl in _rlk_impls(smoke):
      fn = _loss_grads(functools.partial(rlk_jax.linear_logp,
                                         implementation=impl))
      rows.append(_row(bcase, f"rlk_{impl}_vjp", fn, arg_sets, 3 * flops,
                       dense_bwd))
  return [r for r in rows if r is not None]


def _e2e_rows(cfg, smoke) -> list[Row]:
  """Padded batch [B, S] -> dense logp, against pack -> linear_logp."""
  rows = []
  b, s, v = cfg["e2e"]
  h = cfg["h"]
  rng = np.random.default_rng(7)
  keys = jax.random.split(jax.random.key(11), 3)
  hidden = jax.random.normal(keys[0], (b, s, h), jnp.float32).astype(jnp.bfloat16)
  weight = (jax.random.normal(keys[1], (h, v), jnp.float32)
            / np.sqrt(h)).astype(jnp.bfloat16)
  targets = jax.random.randint(keys[2], (b, s), 0, v, jnp.int32)
  impl = rlk_jax.selected_implementation("linear_logp")  # what users get

  def dense(hidden, weight, targets, mask):
    logp = dense_logp(hidden.reshape(b * s, h), weight, targets.reshape(-1))
    return jnp.where(mask, logp.reshape(b, s), 0.0)

  # The dense path costs the same at every density: measured once.
  base = f"e2e B={b} S={s} H={h} V={v}"
  d = _row(base, "xla_dense", dense,
           [(hidden, weight, targets, jnp.ones((b, s), bool))],
           2 * b * s * h * v, None)
  d.note = "XLA temporaries (peak MB); any density"
  rows.append(d)
  for density in cfg["densities"]:
    mask = jnp.asarray(rng.random((b, s)) < density)
    active = int(mask.sum())
    capacity = max(128, -(-active // 128) * 128)
    case = f"{base} density={density}"

    def packed(hidden, weight, targets, mask):
      rows_h, info = rlk_jax.pack(hidden, mask, capacity=capacity)
      rows_t, _ = rlk_jax.pack(targets, info)
      logp = rlk_jax.linear_logp(rows_h, weight, rows_t, implementation=impl)
      return rlk_jax.unpack(logp, info)

    rows.append(_row(case, f"rlk_pack_{impl}", packed,
                     [(hidden, weight, targets, mask)], 2 * capacity * h * v, d))
    rows[-1].note += f"; capacity={capacity}"
  return rows


def run(smoke: bool) -> list[Row]:
  cfg = _config(smoke)
  return (_vocab_rows(cfg, smoke) + _e2e_rows(cfg, smoke)
          + logp_torch_peers.rows(cfg["torch_peers"]))


if __name__ == "__main__":
  app.run(harness.bench_main(run))
