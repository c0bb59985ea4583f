"""Times the det_gemm_variants.cu instantiations against cuBLAS (H100
experiment, not part of the library).

    PYTHONPATH=$PWD python lab/cuda/det_gemm_variants.py <dir with variant_*.so> \
        [variant indices, e.g. 0,1,12] [shapes, e.g. gate_up,lm_head,1024x14336x5120]

A shape is a name of SHAPES or DECODE, or MxKxN.

Every variant must give the bits of the first variant named (the shipped
one, 0, unless told otherwise) on every shape before it is timed: they all
walk K in order, k16 MMA after k16 MMA, into one f32 accumulator, whatever
their K tile. Timing: the library benchmark's interleaved rounds
(benchmarks.harness.time_interleaved: ROUNDS rounds, the order rotated every
round, the median counts); a sample is CALLS calls over SETS distinct A
operands and one shared weight (M=4096), or REPLAYS replays of a CUDA graph
of DECODE_SETS calls with their own weights (decode). The last lines are the
table: TFLOP/s and the ratio to cuBLAS's per shape, and the geometric mean
over the shapes run. With RLK_COLD=1, MxKxN shapes are timed as the
det_gemm_sweep times them: as many (A, B) sets as its timing_plan gives
(enough to pass 256 MB, so no weight is re-read from L2) and samples of
about --sweep_sample_ms of work.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
import statistics
import subprocess
import sys

import torch

import cuda_ffi
from benchmarks import harness  # run with the repository root on PYTHONPATH
from benchmarks.gemm_products import timing_plan

SHAPES = {"qkv": (4096, 4096, 6144), "o": (4096, 4096, 4096),
          "gate_up": (4096, 4096, 28672), "down": (4096, 14336, 4096),
          "lm_head": (4096, 4096, 128256)}
# Decode products: each call has its own A and its own weight (a decode
# step's layers do not share weights), captured into one CUDA graph per
# implementation so launch cost stays out of the figure.
DECODE = {f"dec{n}_m{m}": (m, 4096, n)
          for n in (1024, 2048, 4096, 14336, 128256) for m in (1, 16, 32, 64)}
DECODE_SETS = 16
REPLAYS = 5
SETS = 4
CALLS = 10
ROUNDS = int(os.environ.get("RLK_ROUNDS", "7"))
# (swizzle, raster) tile orders for the first variant: raster 1 = along M,
# 2 = along N; (0, 0) = CUTLASS's heuristic.
ORDERS = [(0, 0), (1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2),
          (8, 2)]


def _orders(setting: str) -> list[tuple[int, int]]:
  """RLK_ORDERS: "1" for every order of ORDERS, a list of swizzle:raster
  pairs such as "0:0,1:1,1:2", or unset / "0" for the default order."""
  if setting == "1":
    return ORDERS
  if setting in ("", "0"):
    return [(0, 0)]
  orders = []
  for pair in setting.split(","):
    swizzle, _, raster = pair.partition(":")
    if not (swizzle.isdigit() and raster.isdigit()
            and int(swizzle) in cuda_ffi.SWIZZLES
            and int(raster) in cuda_ffi.RASTERS):
      raise SystemExit(f"RLK_ORDERS: {pair!r} is not swizzle:raster with "
                       f"swizzle in {cuda_ffi.SWIZZLES} and raster in "
                       f"{cuda_ffi.RASTERS}")
    orders.append((int(swizzle), int(raster)))
  return orders


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
    self.has_pdl_switch = hasattr(self.lib, "rlk_variant_set_pdl")

  def __call__(self, a, b, c, swizzle=0, raster=0, pdl=True):
    if self.has_pdl_switch:
      self.lib.rlk_variant_set_pdl(1 if pdl else 0)
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


def time_interleaved(impls: dict, arg_sets, *, graph: bool,
                     iters: int | None = None) -> dict:
  """Median ms per call of each implementation over `arg_sets` ((a, b, c)
  each), all timed in the same rounds by the library benchmark's
  harness.time_interleaved: CALLS calls a sample from a loop, or REPLAYS
  replays of one CUDA graph of every set (graph=True, decode)."""
  batches = {name: harness.torch_batch(fn, arg_sets, graph=graph)
             for name, fn in impls.items()}
  return harness.time_interleaved(
      batches, iters=iters or (REPLAYS if graph else CALLS), repeats=ROUNDS)


def gpu_state() -> str:
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
         "clocks_throttle_reasons.active", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return f"nvidia-smi: {e}"


def main(argv):
  """argv: directory [variant indices, comma-separated] [shapes]; with
  RLK_ORDERS=1 the first variant also runs under every tile order of
  ORDERS (or the swizzle:raster pairs RLK_ORDERS lists); with RLK_NOPDL=1
  every variant that can switch it also runs without programmatic
  dependent launch."""
  directory = argv[1]
  only = set(map(int, argv[2].split(","))) if len(argv) > 2 else None
  shapes = argv[3].split(",") if len(argv) > 3 else list(SHAPES)
  index = lambda path: int(path.rsplit("_", 1)[1].split(".")[0])
  paths = sorted(glob.glob(os.path.join(directory, "variant_*.so")), key=index)
  chosen = [p for p in paths if only is None or index(p) in only]
  variants = [Variant(p) for p in chosen]
  names = [v.name for v in variants]
  for v, path in zip(variants, chosen):  # two builds of one entry: tell apart
    if names.count(v.name) > 1:
      v.name += f" [{os.path.basename(path)}]"

  from absl import flags
  flags.FLAGS(argv[:1])  # timing_plan reads --sweep_sample_ms's default
  print(torch.cuda.get_device_name(), torch.__version__, flush=True)
  torch.backends.cuda.matmul.allow_tf32 = False
  ratios = {}
  for shape in shapes:
    decode = shape in DECODE
    m, k, n = (DECODE[shape] if decode else SHAPES[shape] if shape in SHAPES
               else map(int, shape.split("x")))
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    cold = (os.environ.get("RLK_COLD") == "1" and not decode
            and shape not in SHAPES)
    if cold:
      n_a, replays = timing_plan((m, k), (k, n), 2 * m * k * n, m * n)
      n_b = n_a
    else:
      n_a, n_b = (DECODE_SETS, DECODE_SETS) if decode else (SETS, 1)
      replays = None
    a_sets = [torch.randn(m, k, device="cuda", generator=gen).bfloat16()
              for _ in range(n_a)]
    b_sets = [torch.randn(k, n, device="cuda", generator=gen).bfloat16()
              for _ in range(n_b)]
    b = b_sets[0]
    transposed = ({x.data_ptr(): x.t().contiguous() for x in b_sets}
                  if any(v.transpose_b for v in variants) else {})
    bt = transposed.get(b.data_ptr())
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    kernels = harness.kernel_names(
        torch, lambda: torch.matmul(a_sets[0], b, out=c))
    print(f"{shape}: cublas runs {'; '.join(kernels)}",
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
        exact = a_sets[0][:256].double() @ b.double()
        err = float((c[:256].double() - exact).norm() / exact.norm())
        print(f"  {v.name}: {int((got != ref).sum())} of {ref.numel()} "
              f"outputs differ, rel err {err:.2e} on 256 rows", flush=True)
        continue  # a variant with other bits cannot ship: not timed
      orders = (_orders(os.environ.get("RLK_ORDERS", ""))
                if v is variants[0] and not decode else [(0, 0)])
      pdls = ([True, False] if v.has_pdl_switch
              and os.environ.get("RLK_NOPDL") == "1" else [True])
      for (swizzle, raster), pdl in itertools.product(orders, pdls):
        name = v.name + ("" if (swizzle, raster) == (0, 0)
                         else f" s{swizzle}r{'0MN'[raster]}") + (
                             "" if pdl else " nopdl")
        impls[name] = (lambda v, sw, ra, pdl: lambda a, b_, c: v(
            a, transposed[b_.data_ptr()] if v.transpose_b else b_, c, sw,
            ra, pdl))(
                v, swizzle, raster, pdl)
    print(f"  before: {gpu_state()}", flush=True)
    if decode:
      if any(v.transpose_b for v in variants):
        raise SystemExit("decode shapes time B [K, N] variants only")
      times = time_interleaved(
          impls, [(a, bb, torch.empty_like(c)) for a, bb in zip(a_sets, b_sets)],
          graph=True)
    else:
      # MxKxN shapes are the sweep's, of a few us to a few hundred: graph
      # replays, as the sweep times them, so the host's launch rate stays out.
      sets = ([(a, bb, c) for a, bb in zip(a_sets, b_sets)] if cold
              else [(a, b, c) for a in a_sets])
      times = time_interleaved(impls, sets, graph=shape not in SHAPES,
                               iters=replays)
    print(f"  after:  {gpu_state()}", flush=True)
    flops = 2 * m * k * n
    for name, ms in times.items():
      ratio = times["cublas"] / ms
      ratios.setdefault(name, {})[shape] = ratio
      print(f"  {shape:8s} {name:34s} {ms:8.4f} ms "
            f"{flops / ms / 1e9:7.1f} TFLOP/s {ratio:5.3f}x cublas", flush=True)
    del a_sets, b_sets, b, bt, c, ref
    torch.cuda.empty_cache()
  print("\n| variant | " + " | ".join(shapes) + " | geomean |")
  print("|---|" + "---|" * (len(shapes) + 1))
  for name, r in ratios.items():
    if name == "cublas":
      continue
    cells = [f"{r[s]:.3f}" if s in r else "-" for s in shapes]
    geo = (f"{statistics.geometric_mean(r.values()):.3f}"
           if len(r) == len(shapes) else "-")
    print(f"| {name} | " + " | ".join(cells) + f" | {geo} |")


if __name__ == "__main__":
  main(sys.argv)
