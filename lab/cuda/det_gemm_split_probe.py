"""Probes column splits of one product over two det_gemm variants (H100
experiment, not part of the library).

    PYTHONPATH=$PWD python lab/cuda/det_gemm_split_probe.py <dir with variant_*.so> \
        [gate_up,o,... | MxKxN,...]

RLK_ROUNDS and RLK_CALLS set the rounds and the calls a sample (41 and 20
gave repeatable ratios at M=4096; 9 and 10 did not); RLK_GRAPH=1 replays
CUDA graphs of the calls instead of a loop, which small products need: a
loop of CUTLASS launches is host-bound (a split call makes two).

A persistent grid wastes the empty slots of its last wave: gate_up's 3584
tiles of 128x256 fill 27.15 waves of 132 SMs and take 28. Computing some
column blocks with another tile (256x192, variant 34) and the rest with
128x256 (variant 0), one kernel after the other, can leave both kernels'
waves nearly full. Every output element is still computed whole by one
tile, K in order, so the split must keep the bits (checked before timing).
Each piece runs on its own packed copy of its B columns and its own output:
the same arithmetic as strided views, without needing them in the variants.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import det_gemm_variants as dv  # noqa: E402  (beside this file)

# shape -> {name: [(variant index, columns), ...]}; columns None = the rest.
SPLITS = {
    "gate_up": {
        "v34 26688 + v0 rest": [(34, 26688), (0, None)],
        "v34 26880 + v0 rest": [(34, 26880), (0, None)],
        "v0 1792 + v34 rest": [(0, 1792), (34, None)],
        "v0 8448 + v34 rest": [(0, 8448), (34, None)],
    },
    "o": {"v34 3072 + v0 rest": [(34, 3072), (0, None)],
          "v0 1024 + v34 rest": [(0, 1024), (34, None)]},
    "down": {"v34 3072 + v0 rest": [(34, 3072), (0, None)]},
    "qkv": {"v34 3072 + v0 rest": [(34, 3072), (0, None)]},
}
SMS = 132


def slots(bm, bn, m, n):
  """Tile slots of a persistent grid of one config: waves x SMs x tile area
  (M tiles paired for the 2x1 cluster)."""
  if n <= 0:
    return 0
  rows = -(-m // bm)
  rows += rows % 2
  return -(-rows * -(-n // bn) // SMS) * SMS * bm * bn


def rule_split(m, n):
  """The columns for 256x192 that leave the fewest tile slots of the two
  kernels (ties: more 256x192), and those slots over the best single
  config's: the slot part of the library's rule (SplitColumns and
  ChooseConfig, which also wants K >= 2048), whatever K is here."""
  best = None
  for groups in range(1, (n - 1) // 192 + 1):
    s = slots(256, 192, m, 192 * groups) + slots(128, 256, m, n - 192 * groups)
    if best is None or s <= best[0]:
      best = (s, 192 * groups)
  single = min(slots(128, 256, m, n), slots(256, 192, m, n))
  return best[1], best[0] / single


def main(argv):
  dv.CALLS = int(os.environ.get("RLK_CALLS", dv.CALLS))  # calls a sample
  directory = argv[1]
  shapes = argv[2].split(",") if len(argv) > 2 else list(SPLITS)
  variants = {i: dv.Variant(os.path.join(directory, f"variant_{i}.so"))
              for i in (0, 34)}
  print(torch.cuda.get_device_name(), torch.__version__, flush=True)
  ratios = {}
  for shape in shapes:
    if shape in dv.SHAPES:
      m, k, n = dv.SHAPES[shape]
      splits = SPLITS[shape]
    else:  # "MxKxN": the split the slot rule picks
      m, k, n = map(int, shape.split("x"))
      columns, ratio = rule_split(m, n)
      print(f"{shape}: rule split at {columns}, slots {ratio:.3f}x", flush=True)
      splits = {f"v34 {columns} + v0 rest": [(34, columns), (0, None)]}
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    a_sets = [torch.randn(m, k, device="cuda", generator=gen).bfloat16()
              for _ in range(dv.SETS)]
    b = torch.randn(k, n, device="cuda", generator=gen).bfloat16()
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    variants[0](a_sets[0], b, c)
    torch.cuda.synchronize()
    ref = c.view(torch.int16).clone()
    impls = {"cublas": lambda a, b_, c_: torch.matmul(a, b_, out=c_),
             "v0 (128x256)": variants[0], "v34 (256x192)": variants[34]}
    for name, pieces in splits.items():
      parts, start = [], 0
      for index, columns in pieces:
        stop = n if columns is None else start + columns
        parts.append((variants[index], b[:, start:stop].contiguous(),
                       torch.empty(m, stop - start, device="cuda",
                                   dtype=torch.bfloat16)))
        start = stop
      def run(a, b_, c_, parts=parts):
        for variant, b_part, c_part in parts:
          variant(a, b_part, c_part)
      run(a_sets[0], None, None)
      torch.cuda.synchronize()
      got = torch.cat([p[2] for p in parts], 1).view(torch.int16)
      same = torch.equal(got, ref)
      print(f"  {shape} {name}: bits {'= v0' if same else 'DIFFER'}",
            flush=True)
      if same:
        impls[name] = run
    v34_out = torch.empty_like(c)
    variants[34](a_sets[0], b, v34_out)
    torch.cuda.synchronize()
    if not torch.equal(v34_out.view(torch.int16), ref):
      raise SystemExit(f"{shape}: v34 bits differ from v0")
    print(f"  before: {dv.gpu_state()}", flush=True)
    # RLK_GRAPH=1: replays of a CUDA graph of the calls, so host launch
    # cost (two CUTLASS launches a split call) stays out of small products.
    times = dv.time_interleaved(impls, [(a, b, c) for a in a_sets],
                                graph=os.environ.get("RLK_GRAPH") == "1")
    print(f"  after:  {dv.gpu_state()}", flush=True)
    flops = 2 * m * k * n
    for name, ms in times.items():
      ratio = times["cublas"] / ms
      ratios.setdefault(shape, {})[name] = (ratio, times["v0 (128x256)"] / ms)
      print(f"  {shape:8s} {name:24s} {ms:8.4f} ms "
            f"{flops / ms / 1e9:7.1f} TFLOP/s {ratio:5.3f}x cublas "
            f"{times['v0 (128x256)'] / ms:5.3f}x v0", flush=True)
    del a_sets, b, c, ref, impls
    torch.cuda.empty_cache()
  print("\n| shape | implementation | x cublas | x v0 |\n|---|---|---|---|")
  for shape, r in ratios.items():
    for name, (x_cublas, x_v0) in r.items():
      print(f"| {shape} | {name} | {x_cublas:.3f} | {x_v0:.3f} |")


if __name__ == "__main__":
  main(sys.argv)
