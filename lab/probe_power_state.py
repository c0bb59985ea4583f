"""Does the ranking of two SM90 configs change as the card heats up? Runs
two configs of one product in alternation, continuously for a few seconds
of GPU time (each call between its own CUDA events, all enqueued before
one synchronization, random operands over sets that leave L2 cold), and
prints each config's median time per 250 ms of the run: from a card at
rest to one held at its power cap.

    python lab/probe_power_state.py [M,N,K,config_a,config_b ...]
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks.gemm_products import timing_plan
from rlk_torch_bridge import _sm90

PAIRS = ["2048,4096,14336,cooperative_256x128,cooperative_128x256",
         "512,8192,3072,cooperative_256x128,pingpong_128x128",
         "1024,151936,2048,pingpong_128x128,cooperative_128x256"]
SECONDS = 3.0
BUCKET_S = 0.25


def probe(spec: str, gen) -> None:
  m, n, k, *configs = spec.split(",")
  m, n, k = int(m), int(n), int(k)
  n_sets, _ = timing_plan((m, k), (k, n), 2 * m * n * k, m * n)
  sets = [(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
           torch.randn(k, n, device="cuda", generator=gen).bfloat16())
          for _ in range(n_sets)]
  fns = [_sm90.product_launcher(m, n, k, False, False, torch.bfloat16, c)
         for c in configs]
  for f in fns:
    f(*sets[0])
  torch.cuda.synchronize()
  time.sleep(3)  # a card at rest to start from
  start = torch.cuda.Event(enable_timing=True)
  ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
  ends[1].record()
  torch.cuda.synchronize()
  # One call of each, timed, to size the run.
  ends[0].record()
  fns[0](*sets[0])
  ends[1].record()
  torch.cuda.synchronize()
  calls = int(SECONDS * 1e3 / max(ends[0].elapsed_time(ends[1]), 1e-3) / 2)
  marks = []
  prev = torch.cuda.Event(enable_timing=True)
  start.record()
  prev.record()
  for i in range(calls):
    for j, f in enumerate(fns):
      f(*sets[i % n_sets])
      e = torch.cuda.Event(enable_timing=True)
      e.record()
      marks.append((j, prev, e))
      prev = e
  torch.cuda.synchronize()
  buckets: dict[int, list[list[float]]] = {}
  for j, a, b in marks:
    t = start.elapsed_time(b) / 1e3
    buckets.setdefault(int(t / BUCKET_S), [[], []])[j].append(a.elapsed_time(b))
  print(f"M={m} N={n} K={k}, {n_sets} sets: us per call, "
        f"{configs[0]} / {configs[1]}")
  for b in sorted(buckets):
    xs, ys = (sorted(v) for v in buckets[b])
    if xs and ys:
      x, y = xs[len(xs) // 2] * 1e3, ys[len(ys) // 2] * 1e3
      print(f"  {b * BUCKET_S:4.2f}-{(b + 1) * BUCKET_S:4.2f} s: {x:8.1f} "
            f"{y:8.1f}  ratio {x / y:.3f}", flush=True)


if __name__ == "__main__":
  from absl import flags
  flags.FLAGS(sys.argv[:1])  # timing_plan reads the sweep's defaults
  gen = torch.Generator(device="cuda").manual_seed(2)
  for spec in sys.argv[1:] or PAIRS:
    probe(spec, gen)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
