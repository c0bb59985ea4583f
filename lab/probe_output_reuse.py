"""Is it the output buffer that makes the SM90 autotuner rank configs unlike
the det_gemm_sweep? The sweep's CUDA graph discards each call's result, so
torch's graph pool hands every call the same output block (L2-resident);
the tuner writes a distinct output per operand set, as a training step that
keeps its activations does. For each product: the tuner's own times, then
its fastest configs timed the sweep's way, with the outputs discarded
(``sweep``, twice for its noise) and kept (``kept``, a distinct output per
call), interleaved. Prints, per way, the relative bias of each config
against the sweep, and what each way's pick costs by the sweep's timing.

    python lab/probe_output_reuse.py [M,N,K ...]   (forward layout)
"""

from __future__ import annotations

import collections
import math
import statistics
import sys

import torch

import cuda_ffi
import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
from benchmarks import harness
from benchmarks.gemm_products import torch_operand_sets
from rlk_jax import _gemm_tuning
from rlk_torch_bridge import _sm90

PRODUCTS = ["512,5120,3072", "512,4608,3584", "1024,4096,2048",
            "512,5120,4096", "256,4096,14336", "2048,3584,3584",
            "4096,16384,3072", "512,5120,14336"]
FINALISTS = 8


def _kept(fn, outputs: list):
  """fn, its results kept alive: a distinct output block per captured call."""
  def call(a, b):
    outputs.append(fn(a, b))
    return outputs[-1]
  return call


def probe(m, n, k, gen, bias):
  screen, hot = cuda_ffi.sustained_times(
      m, n, k, transpose_a=False, transpose_b=False, out_f32=False,
      configs=_gemm_tuning.CANDIDATES)
  live = {c: t for c, t in screen.items() if t}
  configs = sorted(live, key=live.get)[:FINALISTS]
  sets, iters = torch_operand_sets(torch, (m, k), (k, n), 2 * m * n * k,
                                   m * n, gen)
  fns = {c: _sm90.product_launcher(m, n, k, False, False, torch.bfloat16, c)
         for c in configs}
  outputs: list = []
  batches = {}
  for c in configs:
    batches[("sweep", c)] = harness.torch_batch(fns[c], sets, graph=True)
    batches[("sweep_again", c)] = harness.torch_batch(fns[c], sets,
                                                      graph=True)
    batches[("kept", c)] = harness.torch_batch(_kept(fns[c], outputs), sets,
                                               graph=True)
  times = harness.time_interleaved(batches, iters=iters, repeats=7, warmup=1)
  ways = collections.defaultdict(dict)
  for (way, c), t in times.items():
    ways[way][c] = t
  ways["tuner_screen"] = {c: live[c] for c in configs}
  ways["tuner_sustained"] = {c: t for c, t in hot.items() if c in configs}
  sweep = ways["sweep"]
  best = min(sweep, key=sweep.get)
  line = [f"M={m} N={n} K={k} ({len(sets)} sets): sweep's fastest {best} "
          f"{sweep[best] * 1e3:.1f} us"]
  losses = {}
  for way, t in ways.items():
    common = [c for c in t if c in sweep]
    logs = {c: math.log(t[c] / sweep[c]) for c in common}
    mean = statistics.mean(logs.values())
    for c in common:
      bias[way][c].append(logs[c] - mean)
    pick = _gemm_tuning.pick(t)
    losses[way] = sweep[pick] / sweep[best]
    line.append(f"  {way}: picks {pick} ({losses[way]:.3f}x); " + ", ".join(
        f"{c} {t[c] * 1e3:.1f}" for c in sorted(t, key=t.get)[:4]))
  print("\n".join(line), flush=True)
  del batches, outputs, sets
  torch.cuda.empty_cache()
  return losses


def main(specs):
  torch.backends.cuda.matmul.allow_tf32 = False
  gen = torch.Generator(device="cuda").manual_seed(2)
  bias = collections.defaultdict(lambda: collections.defaultdict(list))
  all_losses = [probe(*map(int, s.split(",")), gen, bias) for s in specs]
  for way in all_losses[0]:
    xs = [l[way] for l in all_losses]
    print(f"{way}: its pick runs {statistics.geometric_mean(xs):.3f}x the "
          f"sweep's fastest (worst {max(xs):.3f}) over {len(xs)} products")
  print("relative bias against the sweep (mean log ratio less the "
        "product's mean; configs seen in 3 or more products):")
  configs = sorted({c for w in bias.values() for c in w})
  ways = [w for w in bias if w != "sweep"]
  print(f"{'config':38s}" + "".join(f"{w:>17s}" for w in ways))
  for c in configs:
    cells = []
    for w in ways:
      xs = bias[w].get(c, [])
      cells.append(f"{statistics.mean(xs):+.3f} (n={len(xs)})".rjust(17)
                   if len(xs) >= 3 else " " * 17)
    print(f"{c:38s}" + "".join(cells))


if __name__ == "__main__":
  from absl import flags
  flags.FLAGS(sys.argv[:1])
  main(sys.argv[1:] or PRODUCTS)
