"""Which part of the SM90 autotuner's timing makes it rank configs unlike the
det_gemm_sweep? Times every config of a product four ways, on the same
random operand sets (enough to leave L2 cold, as the sweep and the tuner
use), and scores each way's pick by the sweep's timing:

* ``sweep``: the sweep's way (torch CUDA graph of one call per set,
  replayed, the time a longer batch adds, 10 ms samples), and
  ``sweep_again``, its run-to-run noise;
* ``one_graph``: the tuner's way (one graph of R calls back to back, R >=
  sets and >= 0.2 ms of work, CUDA events around it, all rounds enqueued
  at once);
* ``cycles``: a graph of one call per set, replayed R / sets times between
  the events (a graph boundary, so no overlap of a call's start with the
  call before it, every cycle of sets, as in the sweep);
* ``cycles_2ms``: the same with samples of at least 2 ms;
* ``sustained``: the same with 10 ms samples, each after 10 ms of the same
  config untimed (the sweep's samples come after a batch of the same
  config too: the card's clocks settle to what the config draws).

    python lab/probe_timing_structure.py [M,N,K ...]   (forward layout)
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import torch

import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
from benchmarks import harness
from benchmarks.gemm_products import timing_plan
from rlk_jax import _gemm_tuning
from rlk_torch_bridge import _sm90

PRODUCTS = ["256,10240,8192", "1024,151936,2048", "512,8192,3072",
            "1024,3584,3584", "2048,4096,14336", "16384,8192,8192"]
ROUNDS = 5
WAYS = os.environ.get("RLK_WAYS", "one_graph,cycles,cycles_2ms,sustained")


def _event_rounds(samples: dict[str, tuple[callable, int]],
                  warm: bool = False) -> dict:
  """Median ms per call: each sample `run()` between two events, `calls`
  calls (warm: after one `run()` untimed, so the card's clocks have settled
  to what this config draws); every round enqueued before one
  synchronization, order rotated."""
  names = list(samples)
  marks = []
  for r in range(ROUNDS):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
      if warm:
        samples[name][0]()
      start.record()
      samples[name][0]()
      end.record()
      marks.append((name, start, end))
  torch.cuda.synchronize()
  times = {n: [] for n in names}
  for name, start, end in marks:
    times[name].append(start.elapsed_time(end) / samples[name][1])
  return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


def probe(m, n, k, gen):
  n_sets, iters = timing_plan((m, k), (k, n), 2 * m * n * k, m * n)
  sets = [(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
           torch.randn(k, n, device="cuda", generator=gen).bfloat16())
          for _ in range(n_sets)]
  configs = [c for c in _gemm_tuning.CANDIDATES
             if c != "swap_pingpong_64x32" or m <= 32]
  fns = {c: _sm90.product_launcher(m, n, k, False, False, torch.bfloat16, c)
         for c in configs}
  sweep = harness.time_interleaved(
      {c: harness.torch_batch(fns[c], sets, graph=True) for c in configs},
      iters=iters, repeats=ROUNDS, warmup=1)
  fastest_ms = min(sweep.values())
  # The sweep's way once more: its own run-to-run noise.
  ways = {"sweep": sweep, "sweep_again": harness.time_interleaved(
      {c: harness.torch_batch(fns[c], sets, graph=True) for c in configs},
      iters=iters, repeats=ROUNDS, warmup=1)}
  for way, sample_ms in (("one_graph", 0.2), ("cycles", 0.2),
                         ("cycles_2ms", 2.0), ("sustained", 10.0)):
    if way not in WAYS:
      continue
    reps = max(n_sets, math.ceil(sample_ms / fastest_ms))
    cycles = -(-reps // n_sets)
    samples = {}
    for c in configs:
      if way == "one_graph":
        g = harness.torch_graph(fns[c], sets, reps)
        samples[c] = (g.replay, reps)
      else:
        g = harness.torch_graph(fns[c], sets, n_sets)
        samples[c] = ((lambda g=g: [g.replay() for _ in range(cycles)]),
                      cycles * n_sets)
    ways[way] = _event_rounds(samples, warm=way == "sustained")
    del samples
  best = min(sweep, key=sweep.get)
  line = [f"M={m} N={n} K={k} ({n_sets} sets): sweep's fastest {best} "
          f"{sweep[best] * 1e3:.1f} us"]
  losses = {}
  for way, times in ways.items():
    pick = _gemm_tuning.pick(times)
    losses[way] = sweep[pick] / sweep[best]
    line.append(f"  {way}: picks {pick} ({losses[way]:.3f}x); "
                + ", ".join(f"{c} {times[c] * 1e3:.1f}" for c in
                            sorted(times, key=times.get)[:4]))
  print("\n".join(line), flush=True)
  return losses


def main(specs):
  gen = torch.Generator(device="cuda").manual_seed(1)
  all_losses = []
  for spec in specs:
    all_losses.append(probe(*map(int, spec.split(",")), gen))
    torch.cuda.empty_cache()
  for way in all_losses[0]:
    xs = [l[way] for l in all_losses]
    print(f"{way}: its pick runs {statistics.geometric_mean(xs):.3f}x "
          f"the sweep's fastest (worst {max(xs):.3f}) over {len(xs)} products")


if __name__ == "__main__":
  from absl import flags
  flags.FLAGS(sys.argv[:1])
  main(sys.argv[1:] or PRODUCTS)
