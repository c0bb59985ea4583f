"""vLLM's batch-invariant recipe for Hopper, as a peer to rlk's det_gemm.

vLLM's batch-invariant mode leaves SM90 matmuls on cuBLASLt and only
configures it:

* ``CUBLAS_WORKSPACE_CONFIG=:16:8`` and ``CUBLASLT_WORKSPACE_SIZE=1`` (KiB):
  almost no workspace, so no split-K that needs one;
* ``allow_bf16_reduced_precision_reduction = (False, False)`` (and fp16's):
  no reduced-precision or split-K reductions;
* ``preferred_blas_library("cublaslt")``.

cuBLAS and torch read the two variables once per process, so torch.matmul
runs in a child process (``run_job``) under one of SETTINGS: the recipe,
cuBLAS's defaults or no workspace at all. The child also runs rlk's SM90
kernel (torch's ``rlk::det_mm``, no cuBLAS involved) on the same operands,
so torch's and rlk's bits and times are compared inside one process.

Jobs (JSON on stdin, JSON on stdout's last line):

* ``{"kind": "rows_differ", "products": [[label, k, n, layout], ...],
  "ms": [...], "full": 4096, "rlk": bool}``: per product, how many of the
  first m rows change bits between M=m and M=full, for torch.matmul and
  (``rlk``) for rlk's kernel, and how many of the M=full rows differ
  between the two (an optional ``"rlk_ms"`` counts rlk's rows at those m
  instead of ``ms``; ``[]``: its M=full rows alone, against torch's);
* ``{"kind": "time", "products": [[case, m, k, n, layout], ...]}``: torch's
  and rlk's kernel timed in interleaved rounds (CUDA-graph replay), as rows,
  with the kernel torch ran in the note;
* ``{"kind": "k_alignment", "products": [[m, k, n], ...]}``: a probe of
  K that is not a multiple of 8 (``_k_alignment``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib

RECIPE = "cublaslt_vllm_recipe"
# torch.matmul's settings a child can run under: the environment of each.
SETTINGS = {
    "cublas": {},  # cuBLAS's default heuristics
    "cublas_no_splitk": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"},  # no workspace
    RECIPE: {"CUBLAS_WORKSPACE_CONFIG": ":16:8",
             "CUBLASLT_WORKSPACE_SIZE": "1"},
}


def configure(torch) -> None:
  """The recipe's in-process settings (the environment comes first)."""
  matmul = torch.backends.cuda.matmul
  for name in ("allow_bf16_reduced_precision_reduction",
               "allow_fp16_reduced_precision_reduction"):
    setattr(matmul, name, (False, False))
  matmul.allow_tf32 = False
  if torch.cuda.is_available():  # a CPU build has no cuBLASLt to prefer
    torch.backends.cuda.preferred_blas_library("cublaslt")


def run_job(job: dict, *, setting: str, timeout: float = 1800):
  """Runs `job` in a child process under one of SETTINGS."""
  env = {k: v for k, v in os.environ.items()
         if k not in {name for s in SETTINGS.values() for name in s}}
  env.update(SETTINGS[setting])
  # stderr passes through: the child's progress lines land in the caller's log.
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks.cublaslt_recipe", setting],
      input=json.dumps(job), stdout=subprocess.PIPE, text=True, env=env,
      timeout=timeout, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
  lines = done.stdout.strip().splitlines()
  if done.returncode != 0 or not lines:
    raise RuntimeError(f"the {setting} child exited {done.returncode}")
  return json.loads(lines[-1])


def _operands(torch, label: str, shapes, device, seed: int = 0):
  gen = torch.Generator(device=device).manual_seed(
      zlib.crc32(label.encode()) + seed)
  return [torch.randn(*s, device=device, generator=gen).to(torch.bfloat16)
          for s in shapes]


def _rows_apart(x, y) -> int:
  """Rows of two same-shape 2-D bf16 tensors whose bits differ anywhere."""
  import torch
  return int((x.view(torch.int16) != y.view(torch.int16)).any(1).sum())


def _rlk_impl(torch) -> str:
  return "cuda_ffi" if torch.cuda.is_available() else "xla"


def _rows_differ(torch, job) -> dict:
  from benchmarks.gemm_products import layout_product
  import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
  device = "cuda" if torch.cuda.is_available() else "cpu"
  full_m, out = job["full"], {}
  rlk_op, impl = torch.ops.rlk.det_mm, _rlk_impl(torch)
  for label, k, n, layout in job["products"]:
    ta, tb, x_shape, y_shape, _ = layout_product(layout, full_m, k, n)
    if ta:
      raise ValueError(f"{layout}: the M rows are a reduction there, not rows")
    x, y = _operands(torch, label, (x_shape, y_shape), device,
                     job.get("seed", 0))
    gemms = {"torch": lambda x, y=y: torch.matmul(x, y.T if tb else y)}
    if job["rlk"]:
      gemms["rlk"] = lambda x, y=y: rlk_op(x, y, False, tb, torch.bfloat16,
                                           impl)
    fulls, result = {}, {}
    for name, gemm in gemms.items():
      full = fulls[name] = gemm(x)
      ms = job["ms"] if name == "torch" else job.get("rlk_ms", job["ms"])
      result[name] = {m: _rows_apart(gemm(x[:m]), full[:m]) for m in ms}
    if "rlk" in fulls:
      result["rlk_impl"] = impl
      result["torch_vs_rlk"] = _rows_apart(fulls["torch"], fulls["rlk"])
    out[label] = result
    del x, y, fulls
  return out


def _k_alignment(torch, job) -> dict:
  """Why a K that is not a multiple of 8 gives other bits: torch.matmul
  (forward layout) against rlk on the same product computed several ways.
  rlk's order is K in 16-wide MMA steps from k=0, the tail zero-padded;
  a kernel that takes the partial step first is rlk's order on operands
  zero-padded at the front instead. Rows differing of each, and the kernels
  torch launched."""
  import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
  from benchmarks import harness
  op = torch.ops.rlk.det_mm
  out = {}
  for m, k, n in job["products"]:
    label = f"M={m} K={k} N={n}"
    x, y = _operands(torch, label, ((m, k), (k, n)), "cuda",
                     job.get("seed", 0))
    ref = torch.matmul(x, y)

    def padded(front: int, back: int, impl: str):
      xp = torch.nn.functional.pad(x, (front, back))
      yp = torch.nn.functional.pad(y, (0, 0, front, back))
      return op(xp, yp, False, False, torch.bfloat16, impl)

    ways = {"pallas": lambda: op(x, y, False, False, torch.bfloat16, "pallas")}
    for step in (8, 16, 32, 64):
      pad = -k % step
      ways[f"cuda_ffi back-padded to {step}"] = (
          lambda pad=pad: padded(0, pad, "cuda_ffi"))
      ways[f"cuda_ffi front-padded to {step}"] = (
          lambda pad=pad: padded(pad, 0, "cuda_ffi"))
    result = {}
    for name, way in ways.items():
      try:
        result[name] = _rows_apart(way(), ref)
      except Exception as e:  # noqa: BLE001 - the probe records it
        result[name] = f"{type(e).__name__}: {str(e)[:80]}"
    result["torch kernels"] = harness.kernel_names(
        torch, lambda: torch.matmul(x, y))
    out[label] = result
  return out


def _time(torch, job) -> list[dict]:
  from benchmarks import harness
  from benchmarks import gemm_products as products
  import rlk_torch_bridge  # noqa: F401 - registers torch.ops.rlk
  name = job["setting"]
  rows = []
  for case, m, k, n, layout in job["products"]:
    ta, tb, x_shape, y_shape, (pm, pn, _) = products.layout_product(
        layout, m, k, n)
    flops = 2 * m * n * k
    n_sets, iters = products.timing_plan(x_shape, y_shape, flops, pm * pn)
    pairs = [_operands(torch, f"{case} {i}", (x_shape, y_shape), "cuda")
             for i in range(n_sets)]
    product = products.torch_product(torch, ta, tb)
    timed = harness.interleaved_rows(products.BENCH, case, {
        name: lambda: harness.torch_batch(product, pairs, graph=True),
        "rlk_cuda_ffi_kernel": lambda: harness.torch_batch(
            products.rlk_torch_product(torch, ta, tb), pairs, graph=True),
    }, flops=flops, iters=iters, repeats=5, warmup=1)
    # Which kernel cuBLAS chose: where it runs faster with rlk's bits, its
    # tile and cluster shapes say what config rlk lacks.
    try:
      kernels = " ".join(harness.kernel_names(
          torch, lambda: product(*pairs[0])))
    except Exception as e:  # noqa: BLE001 - the timing stands without it
      kernels = f"unknown ({type(e).__name__})"
    timed[0].note = "; ".join(filter(None, [timed[0].note, f"kernel {kernels}"]))
    rows += timed
    del pairs
    torch.cuda.empty_cache()
  return [dataclasses.asdict(r) for r in rows]


def _child(setting: str) -> None:
  job = json.loads(sys.stdin.read())
  import torch
  from absl import flags
  flags.FLAGS(["cublaslt_recipe"])  # the benchmark modules' flags, defaults
  if setting == RECIPE:
    configure(torch)
  job["setting"] = setting
  result = {"rows_differ": _rows_differ, "time": _time,
            "k_alignment": _k_alignment}[job["kind"]](torch, job)
  print(json.dumps(result))


if __name__ == "__main__":
  _child(sys.argv[1])
