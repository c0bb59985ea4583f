"""Fits the analytic config rule of the SM90 det_gemm (``ChoosePlan`` in
cuda_ffi/csrc/det_gemm_api.cc) to measured config timings, and scores it.

    python lab/cuda/fit_config_rule.py CONFIGS.csv [CONFIGS.csv ...]

The CSVs are the ``det_gemm_configs.csv`` files the det_gemm_sweep benchmark
writes (every config's median time on every product rlk tuned; a later file
wins where two measured the same product). The model: a persistent grid of
``bm x bn`` tiles (paired along M or N where the cluster is 2x1 or 1x2)
takes ``waves x (bm * bn * K * per-MAC time + per-tile time)``; the two
constants per config come from a least-squares fit of time per wave,
weighted by its inverse (relative errors). The two-kernel split is the sum
of its two grids. Prints the C table for det_gemm_api.cc, the score (the
rule's choice over the fastest config's time, geomean and tail) and the
same score on half of the shapes with the rule fitted on the other half.
Products of up to 64 rows keep the decode rules and are left out.
"""

from __future__ import annotations

import collections
import csv
import math
import random
import sys

import numpy as np

SMS = 132
# name: (bm, bn, paired along "m", "n" or neither)
GEOMETRY = {
    "cooperative_128x256": (128, 256, "m"),
    "cooperative_256x192": (256, 192, "m"),
    "pingpong_128x128": (128, 128, ""),
    "cooperative_128x128": (128, 128, "m"),
    "cooperative_256x128": (256, 128, "m"),
    "cooperative_128x192": (128, 192, "m"),
    "cooperative_128x256_cluster_1x2": (128, 256, "n"),
    "pingpong_64x256": (64, 256, ""),
    "pingpong_64x128": (64, 128, ""),
    "pingpong_64x64": (64, 64, ""),
    "pingpong_64x32": (64, 32, ""),
}
SPLIT = "split_256x192_128x256"


def cdiv(a, b):
  return -(-a // b)


def waves(config, m, n):
  bm, bn, pair = GEOMETRY[config]
  rows, cols = cdiv(m, bm), cdiv(n, bn)
  rows += rows % 2 if pair == "m" else 0
  cols += cols % 2 if pair == "n" else 0
  return cdiv(rows * cols, SMS)


def split_columns(m, n):
  """det_gemm_api.cc's BestSplit: the 256x192 columns of least tile slots."""
  def slots(cols, bm, bn):
    if cols <= 0:
      return 0
    rows = cdiv(m, bm)
    rows += rows % 2
    return cdiv(rows * cdiv(cols, bn), SMS) * SMS * bm * bn
  best, best_slots = 0, 0
  max_blocks = (n - 1) // 192
  rows = cdiv(m, 256) + cdiv(m, 256) % 2
  for w in range(1, cdiv(rows * max_blocks, SMS) + 1 if max_blocks > 0 else 1):
    blocks = min(max_blocks, w * SMS // rows)
    if blocks < 1:
      continue
    cols = 192 * blocks
    s = slots(cols, 256, 192) + slots(n - cols, 128, 256)
    if best == 0 or s <= best_slots:
      best, best_slots = cols, s
  return best


def read(paths):
  products = {}
  for path in paths:
    runs = collections.defaultdict(dict)
    with open(path) as f:
      for r in csv.DictReader(f):
        key = (r["layout"], int(r["m"]), int(r["n"]), int(r["k"]))
        runs[key][r["config"]] = float(r["median_ms"])
    products.update(runs)
  return {k: t for k, t in products.items() if k[1] > 64}


def fit(products):
  constants = {}
  for config, (bm, bn, _) in GEOMETRY.items():
    x, y = [], []
    for (_, m, n, k), times in products.items():
      if config in times:
        per_wave = times[config] / waves(config, m, n)
        x.append([bm * bn * k / per_wave, 1 / per_wave])
        y.append(1.0)
    a, b = np.linalg.lstsq(np.array(x), np.array(y), rcond=None)[0]
    constants[config] = (a, b)  # ms per MAC, ms per tile
  return constants


def estimate(constants, config, m, n, k):
  if n <= 0:
    return 0.0
  bm, bn, _ = GEOMETRY[config]
  a, b = constants[config]
  return waves(config, m, n) * (a * bm * bn * k + b)


def choose(constants, m, n, k):
  best = min(GEOMETRY, key=lambda c: estimate(constants, c, m, n, k))
  cols = split_columns(m, n)
  if cols and (estimate(constants, "cooperative_256x192", m, cols, k)
               + estimate(constants, "cooperative_128x256", m, n - cols, k)
               < estimate(constants, best, m, n, k)):
    return SPLIT
  return best


def score(constants, products, label):
  ratios = sorted(
      (times[choose(constants, m, n, k)] / min(times.values()), key)
      for key, times in products.items() for (_, m, n, k) in [key])
  geo = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
  print(f"{label}: {len(ratios)} products, choice / fastest: geomean "
        f"{geo:.3f}, > 1.10x: {sum(r > 1.10 for r, _ in ratios)}, > 1.25x: "
        f"{sum(r > 1.25 for r, _ in ratios)}, worst {ratios[-1][0]:.2f}x "
        f"{ratios[-1][1]}")


def main(paths):
  products = read(paths)
  constants = fit(products)
  print("C table (ps per 1000 MACs of a tile, ns per tile):")
  for config, (a, b) in constants.items():
    print(f"  {config:34s} {a * 1e12:8.1f} {b * 1e6:8.0f}")
  score(constants, products, "in sample")
  shapes = sorted({(n, k) for (_, _, n, k) in products})
  random.Random(0).shuffle(shapes)
  half = set(shapes[: len(shapes) // 2])
  for name, train in (("A", lambda s: s in half), ("B", lambda s: s not in half)):
    fitted = fit({p: t for p, t in products.items() if train(p[2:])})
    score(fitted, {p: t for p, t in products.items() if not train(p[2:])},
          f"held out (fitted on half {name} of the shapes)")


if __name__ == "__main__":
  main(sys.argv[1:])
