"""Times the det_gemm_variants.cu instantiations against cuBLAS (H100
experiment, not part of the library).

    python benchmarks/cuda/det_gemm_variants.py <dir with variant_*.so> \
        [variant indices, e.g. 0,1,12] [shapes, e.g. gate_up,lm_head]

Every variant must give the bits of the first variant named (the shipped
one, 0, unless told otherwise) on every shape before it is timed: they all
walk K in order, k16 MMA after k16 MMA, into one f32 accumulator, whatever
their K tile. Timing: CUDA events around CALLS calls that rotate over SETS
distinct A operands (one shared weight, as the library benchmark), ROUNDS
rounds in an order shuffled every round (seeded), so that no variant always
runs on a hotter card or after the same neighbour; the median round counts. The last lines are the table: TFLOP/s and the ratio to cuBLAS's per
shape, and the geometric mean over the five M=4096 projections.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import random
import statistics
import subprocess
import sys

import torch

SHAPES = {"qkv": (4096, 4096, 6144), "o": (4096, 4096, 4096),
          "gate_up": (4096, 4096, 28672), "down": (4096, 14336, 4096),
          "lm_head": (4096, 4096, 128256)}
# Decode products: each call has its own A and its own weight (a decode
# step's layers do not share weights), captured into one CUDA graph per
# implementation so launch cost stays out of the figure.
DECODE = {f"dec{n}_m{m}": (m, 4096, n) for n in (1024, 2048, 4096, 14336)
          for m in (1, 16, 64)}
DECODE_SETS = 16
REPLAYS = 5
SETS = 4
CALLS = 10
ROUNDS = int(os.environ.get("RLK_ROUNDS", "7"))
# (swizzle, raster) tile orders for the first variant: raster 1 = along M,
# 2 = along N; (0, 0) = CUTLASS's heuristic.
ORDERS = [(0, 0), (1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2),
          (8, 2)]


class Variant:
  def __init__(self, path: str):
    self.lib = ctypes.CDLL(path)
    self.lib.rlk_variant_name.restype = ctypes.c_char_p
    self.name = self.lib.rlk_variant_name().decode()
    self.transpose_b = bool(self.lib.rlk_variant_transpose_b())
    self.lib.rlk_variant_run.restype = ctypes.c_int
    self.lib.rlk_variant_run.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_char_p)]
    self.workspace = None
    self.queried = set()

  def __call__(self, a, b, c, swizzle=0, raster=0):
    m, k = a.shape
    n = c.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    need, msg = ctypes.c_size_t(0), ctypes.c_char_p()
    key = (m, n, k, swizzle, raster)
    if key not in self.queried:  # the workspace this problem needs
      rc = self.lib.rlk_variant_run(a.data_ptr(), b.data_ptr(), None, m, n, k,
                                    sms, None, 0, stream, swizzle, raster,
                                    ctypes.byref(need), ctypes.byref(msg))
      if rc:
        raise RuntimeError(f"{self.name}: {msg.value.decode()}")
      self.queried.add(key)
      if self.workspace is None or self.workspace.numel() < need.value:
        self.workspace = torch.empty(max(need.value, 1), dtype=torch.uint8,
                                     device="cuda")
    rc = self.lib.rlk_variant_run(
        a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k, sms,
        self.workspace.data_ptr(), self.workspace.numel(), stream, swizzle,
        raster, ctypes.byref(need), ctypes.byref(msg))
    if rc:
      raise RuntimeError(f"{self.name}: {msg.value.decode()}")


def round_orders(names: list[str]):
  """A shuffled order of the implementations per round (seeded)."""
  rng = random.Random(0)
  for _ in range(ROUNDS):
    order = list(names)
    rng.shuffle(order)
    yield order


def time_rounds(impls: dict, sets, c) -> dict[str, tuple]:
  """(median, min, max) ms per call of each implementation, interleaved by
  rounds."""
  names = list(impls)
  samples = {n: [] for n in names}
  for fn_name in names:  # warm up: module load, workspace, clocks
    for a, b in sets[:2]:
      impls[fn_name](a, b, c)
  torch.cuda.synchronize()
  for order in round_orders(names):
    for name in order:
      fn = impls[name]
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
          enable_timing=True)
      start.record()
      for i in range(CALLS):
        a, b = sets[i % len(sets)]
        fn(a, b, c)
      end.record()
      end.synchronize()
      samples[name].append(start.elapsed_time(end) / CALLS)
  return {n: (statistics.median(s), min(s), max(s))
          for n, s in samples.items()}


def time_graph_rounds(impls: dict, sets, outs) -> dict[str, tuple]:
  """(median, min, max) ms per call, each implementation's calls over all
  sets replayed from one CUDA graph, interleaved by rounds."""
  graphs = {}
  for name, fn in impls.items():
    for (a, b), c in zip(sets, outs):  # warm up outside the capture
      fn(a, b, c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
      for (a, b), c in zip(sets, outs):
        fn(a, b, c)
    graphs[name] = g
  names = list(impls)
  samples = {n: [] for n in names}
  for order in round_orders(names):
    for name in order:
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
          enable_timing=True)
      start.record()
      for _ in range(REPLAYS):
        graphs[name].replay()
      end.record()
      end.synchronize()
      samples[name].append(start.elapsed_time(end) / REPLAYS / len(sets))
  return {n: (statistics.median(s), min(s), max(s))
          for n, s in samples.items()}


def gpu_state() -> str:
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
         "clocks_throttle_reasons.active", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return f"nvidia-smi: {e}"


def cublas_kernels(a, b, c) -> str:
  """The kernel names cuBLAS launches for this product (CUPTI)."""
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
  return "; ".join(sorted({e.key for e in prof.key_averages()}))


def main(argv):
  """argv: directory [variant indices, comma-separated] [shapes]; with
  RLK_ORDERS=1 the first variant also runs under every tile order of
  ORDERS."""
  directory = argv[1]
  only = set(map(int, argv[2].split(","))) if len(argv) > 2 else None
  shapes = argv[3].split(",") if len(argv) > 3 else list(SHAPES)
  paths = sorted(glob.glob(os.path.join(directory, "variant_*.so")),
                 key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))
  variants = [Variant(p) for p in paths
              if only is None
              or int(p.rsplit("_", 1)[1].split(".")[0]) in only]
  print(torch.cuda.get_device_name(), torch.__version__, flush=True)
  torch.backends.cuda.matmul.allow_tf32 = False
  ratios = {}
  for shape in shapes:
    decode = shape in DECODE
    m, k, n = DECODE[shape] if decode else SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    a_sets = [torch.randn(m, k, device="cuda", generator=gen).bfloat16()
              for _ in range(DECODE_SETS if decode else SETS)]
    b_sets = [torch.randn(k, n, device="cuda", generator=gen).bfloat16()
              for _ in range(DECODE_SETS if decode else 1)]
    b = b_sets[0]
    bt = b.t().contiguous()
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    print(f"{shape}: cublas runs {cublas_kernels(a_sets[0], b, c)}",
          flush=True)
    ref = None
    impls = {"cublas": lambda a, b, c: torch.matmul(a, b, out=c)}
    for v in variants:
      c.fill_(float("nan"))
      v(a_sets[0], bt if v.transpose_b else b, c)
      torch.cuda.synchronize()
      got = c.view(torch.int16).clone()
      if ref is None:
        ref = got
        exact = a_sets[0][:256].double() @ b.double()
        err = float((c[:256].double() - exact).norm() / exact.norm())
        print(f"  {v.name}: rel err {err:.2e} (bf16 out) on 256 rows",
              flush=True)
        if not err < 1e-2:
          raise SystemExit(f"{shape}: {v.name} is wrong ({err})")
      same = torch.equal(got, ref)
      print(f"  {v.name}: bits {'= first variant' if same else 'DIFFER'}",
            flush=True)
      if not same:
        continue  # a variant with other bits cannot ship: not timed
      orders = (ORDERS if v is variants[0] and not decode
                and os.environ.get("RLK_ORDERS") == "1" else [(0, 0)])
      for swizzle, raster in orders:
        name = v.name + ("" if (swizzle, raster) == (0, 0)
                         else f" s{swizzle}r{'MN'[raster - 1]}")
        impls[name] = (lambda v, sw, ra: lambda a, b_, c: v(
            a, bt if v.transpose_b else b_, c, sw, ra))(v, swizzle, raster)
    print(f"  before: {gpu_state()}", flush=True)
    if decode:
      if any(v.transpose_b for v in variants):
        raise SystemExit("decode shapes time B [K, N] variants only")
      outs = [torch.empty_like(c) for _ in a_sets]
      times = time_graph_rounds(impls, list(zip(a_sets, b_sets)), outs)
    else:
      times = time_rounds(impls, [(a, b) for a in a_sets], c)
    print(f"  after:  {gpu_state()}", flush=True)
    flops = 2 * m * k * n
    for name, (ms, lo, hi) in times.items():
      ratio = times["cublas"][0] / ms
      ratios.setdefault(name, {})[shape] = ratio
      print(f"  {shape:8s} {name:34s} {ms:8.4f} ms [{lo:.4f}, {hi:.4f}] "
            f"{flops / ms / 1e9:7.1f} TFLOP/s {ratio:5.3f}x cublas", flush=True)
    del a_sets, b_sets, b, bt, c, ref
    torch.cuda.empty_cache()
  print("\n| variant | " + " | ".join(shapes) + " | geomean |")
  print("|---|" + "---|" * (len(shapes) + 1))
  for name, r in ratios.items():
    if name == "cublas":
      continue
    cells = [f"{r[s]:.3f}" if s in r else "-" for s in shapes]
    geo = (f"{math.exp(sum(map(math.log, r.values())) / len(r)):.3f}"
           if len(r) == len(shapes) else "-")
    print(f"| {name} | " + " | ".join(cells) + f" | {geo} |")


if __name__ == "__main__":
  main(sys.argv)
