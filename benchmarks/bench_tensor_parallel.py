"""Tensor-parallel invariance: what det_gemm's reduction_chunks mode costs.

One process per GPU (``torchrun --nproc_per_node T -m
benchmarks.bench_tensor_parallel --csv out.csv``; T = 1 measures the mode
against the default order on one GPU). Per case, bf16, nn.Linear layout:

* ``cublas+all_reduce``: the ordinary row-parallel layer, torch's
  ``F.linear`` on the local K slice and NCCL's all-reduce of the bf16 output;
* ``det_gemm[impl]+all_reduce``: the same with rlk's default det_gemm (not
  invariant across T: the all-reduce adds in NCCL's order);
* ``row_parallel_mode[impl]``: ``RowParallelDetLinear`` (C = 8 chunks):
  each rank's subtree (Triton: every chunk in one launch and the tree in a
  second; other implementations: one product per chunk), the f32 roots
  all-gathered and summed in the fixed tree: the same bits at every T.

``--implementation`` picks det_gemm's implementation for both rlk rows
(named in brackets; "auto" for rlk's own choice).

Rank 0 appends rows (the harness's CSV columns) and prints a table. Times
are medians over batches of back-to-back calls, CUDA events, after warm-up:
``median_ms`` eager, ``kernel_ms`` the same call replayed from a CUDA graph
(the device's time, as a graphed decode step pays it).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rlk_torch_bridge
from benchmarks.harness import COLUMNS

# (name, M, K, N): Llama-3-8B's down and o projections, decode to training M.
CASES = [(f"{proj}_m{m}", m, k, n)
         for proj, k, n in (("down", 14336, 4096), ("o", 4096, 4096))
         for m in (8, 64, 512, 4096)]


def timed(fn, iters=20, batches=7):
  for _ in range(3):
    fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(batches):
    dist.barrier()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(iters):
      fn()
    end.record()
    end.synchronize()
    samples.append(start.elapsed_time(end) / iters)
  return statistics.median(samples)


def graphed(fn):
  """`fn` captured in a CUDA graph, replayed: the device's time for its
  kernels (and collectives) without the eager host cost a decode step pays
  per call outside a graph. None where capture fails."""
  fn()
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  try:
    with torch.cuda.graph(graph):
      fn()
  except RuntimeError:
    return None
  return graph.replay


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--csv", required=True)
  parser.add_argument("--implementation", default=None)
  args = parser.parse_args()
  device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
  torch.cuda.set_device(device)
  dist.init_process_group("nccl", device_id=device)
  rank, world = dist.get_rank(), dist.get_world_size()
  gen = torch.Generator(device="cuda").manual_seed(0)
  rows = []
  for name, m, k, n in CASES:
    kl = k // world
    x = torch.randn(m, kl, device="cuda", generator=gen).bfloat16()
    w = torch.randn(n, kl, device="cuda", generator=gen).bfloat16()
    layer = rlk_torch_bridge.RowParallelDetLinear(
        k, n, dist.group.WORLD, reduction_chunks=8, bias=False, device="cuda",
        dtype=torch.bfloat16, implementation=args.implementation)
    with torch.no_grad():
      layer.weight.copy_(w)

    def ordinary():
      y = F.linear(x, w)
      if world > 1:
        dist.all_reduce(y)
      return y

    def det_default():
      y = rlk_torch_bridge.det_gemm(x, w, transpose_b=True,
                                    implementation=args.implementation)
      if world > 1:
        dist.all_reduce(y)
      return y

    route = args.implementation or "auto"
    calls = {"cublas+all_reduce": ordinary,
             f"det_gemm[{route}]+all_reduce": det_default,
             f"row_parallel_mode[{route}]": lambda: layer(x)}
    with torch.no_grad():
      results = {name: timed(fn) for name, fn in calls.items()}
      replays = {name: graphed(fn) for name, fn in calls.items()}
      in_graph = {name: timed(replay) if replay else None
                  for name, replay in replays.items()}
    base = results["cublas+all_reduce"]
    det = results[f"det_gemm[{route}]+all_reduce"]
    for impl, ms in results.items():
      rows.append(dict(
          date=datetime.date.today().isoformat(),
          commit=os.environ.get("RLK_COMMIT", "unknown"),
          device=f"{world}x {torch.cuda.get_device_name()}",
          benchmark="tensor_parallel", case=f"{name}_k{k}_n{n}_tp{world}",
          implementation=impl, median_ms=f"{ms:.4f}", floor_ms=f"{base:.4f}",
          ratio_to_floor=f"{ms / base:.3f}",
          kernel_ms=(f"{in_graph[impl]:.4f}" if in_graph[impl] else ""),
          note=f"vs det_gemm[{route}]+all_reduce {ms / det:.3f}x"))
  if rank == 0:
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as f:
      writer = csv.DictWriter(f, COLUMNS)
      if new:
        writer.writeheader()
      writer.writerows(rows)
    for r in rows:
      print(f"{r['case']:<28} {r['implementation']:<30} {r['median_ms']:>9} ms"
            f" (graphed {r['kernel_ms'] or '-':>7})"
            f"  {r['ratio_to_floor']}x cublas  {r['note']}")
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
