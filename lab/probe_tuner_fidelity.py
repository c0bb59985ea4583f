"""Does the SM90 autotuner's measurement pick what runs fastest for a user?

For each product: every config's time as the autotuner measures it
(`cuda_ffi.sustained_times`: its screen, and its finalists on a hot card),
and every config's time as the det_gemm_sweep
measures a user's call (normal random operands, enough distinct operand
sets to leave L2 cold, CUDA-graph replay through the torch route, 10 ms
samples, interleaved rounds with cuBLAS). Prints, per product, the tuner's
pick, the sweep-timed fastest config and what the pick loses against it.

    python lab/probe_tuner_fidelity.py OUT_CSV [M,N,K ...]   (forward layout)

RLK_REPEATS (default 5, the sweep's) sets the interleaved rounds per product.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys

import torch

import cuda_ffi
import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
from benchmarks import harness
from benchmarks.gemm_products import timing_plan
from rlk_jax import _gemm_tuning
from rlk_torch_bridge import _sm90

# The four forward products below 0.90x cuBLAS in the 2026-11-24 sweep, then
# one product per family and M from the sweep's shapes (M x N x K).
PRODUCTS = [
    "256,28672,4096", "256,4096,14336", "512,5120,4096", "512,4608,3584",
    "256,6144,2048", "512,8192,3072", "1024,3584,3584", "1024,28672,3584",
    "2048,4096,14336", "4096,6144,4096", "8192,5120,4096", "16384,8192,8192",
    "256,10240,8192", "512,57344,8192", "1024,8192,28672", "2048,2048,768",
    "4096,3584,18944", "16384,3072,8192", "1024,151936,2048", "256,3584,3584",
]


def main(out_csv: str, specs: list[str]) -> None:
  torch.backends.cuda.matmul.allow_tf32 = False
  rows, losses, best_ratio, pick_ratio = [], [], [], []
  losses_again, agree = [], 0
  gen = torch.Generator(device="cuda").manual_seed(0)
  for spec in specs:
    m, n, k = map(int, spec.split(","))
    tune = lambda: cuda_ffi.sustained_times(
        m, n, k, transpose_a=False, transpose_b=False, out_f32=False,
        configs=_gemm_tuning.CANDIDATES)
    (tuner, hot), (_, hot_again) = tune(), tune()  # twice: a stable pick?
    live = [c for c, t in tuner.items() if t]
    n_sets, iters = timing_plan((m, k), (k, n), 2 * m * n * k, m * n)
    sets = [(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
             torch.randn(k, n, device="cuda", generator=gen).bfloat16())
            for _ in range(n_sets)]
    batches = {"cublas": harness.torch_batch(torch.matmul, sets, graph=True)}
    for c in live:
      batches[c] = harness.torch_batch(
          _sm90.product_launcher(m, n, k, False, False, torch.bfloat16, c),
          sets, graph=True)
    real = harness.time_interleaved(
        batches, iters=iters, repeats=int(os.environ.get("RLK_REPEATS", 5)),
        warmup=1)
    del batches, sets
    pick, pick_again = _gemm_tuning.pick(hot), _gemm_tuning.pick(hot_again)
    agree += pick == pick_again
    losses_again.append(real[pick_again] / min(real[c] for c in live))
    fastest = min(live, key=real.get)
    losses.append(real[pick] / real[fastest])
    best_ratio.append(real["cublas"] / real[fastest])
    pick_ratio.append(real["cublas"] / real[pick])
    print(f"M={m} N={n} K={k}: tuner picks {pick} "
          f"({real['cublas'] / real[pick]:.3f}x cuBLAS); sweep-timed fastest "
          f"{fastest} ({real['cublas'] / real[fastest]:.3f}x); the pick runs "
          f"{losses[-1]:.3f}x the fastest's time; cuBLAS "
          f"{real['cublas'] * 1e3:.1f} us", flush=True)
    ranked = sorted(live, key=real.get)[:6]
    print("   sweep-timed: " + ", ".join(
        f"{c} {real[c] * 1e3:.1f} (tuner {tuner[c] * 1e3:.1f}"
        + (f", hot {hot[c] * 1e3:.1f})" if c in hot else ")")
        for c in ranked), flush=True)
    for c in live:
      rows.append(dict(m=m, n=n, k=k, config=c, tuner_ms=tuner[c],
                       sustained_ms=hot.get(c), sweep_ms=real[c], cublas_ms=real["cublas"],
                       tuner_pick=int(c == pick),
                       sweep_fastest=int(c == fastest)))
  with open(out_csv, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  g = statistics.geometric_mean
  print(f"over {len(losses)} products: the tuner's pick runs {g(losses):.3f}x "
        f"the sweep-timed fastest config's time (worst {max(losses):.3f}); "
        f"pick {g(pick_ratio):.3f}x cuBLAS, fastest {g(best_ratio):.3f}x; "
        f"tuned again: the same pick on {agree} of {len(losses)}, "
        f"{g(losses_again):.3f}x the fastest's time "
        f"(worst {max(losses_again):.3f})")


if __name__ == "__main__":
  from absl import flags
  flags.FLAGS(sys.argv[:1])  # the sweep's and harness's defaults
  main(sys.argv[1], sys.argv[2:] or PRODUCTS)
