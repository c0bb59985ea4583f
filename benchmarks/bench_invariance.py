"""Batch invariance, counted: how many of the first m rows of a GEMM change
bits when the same rows are computed with M=m instead of inside M=4096.

    python -m benchmarks.bench_invariance [--smoke] [--csv out.csv]

Two parts:

* ``K=<k> N=4096``: ``xla_dot`` (``jnp.dot``, bf16 out), each available rlk
  implementation through JAX, and torch.matmul three ways, each in a child
  process because cuBLAS reads its environment once: ``cublas`` (default
  heuristics), ``cublas_no_splitk`` (``CUBLAS_WORKSPACE_CONFIG=:0:0``: no
  workspace, so no split-K) and ``cublaslt_vllm_recipe`` (vLLM's
  batch-invariant settings for Hopper, ``benchmarks/cublaslt_recipe.py``);
* the K alignment probe (GPU): at K not a multiple of 16, the recipe's bits
  against rlk's kernel run several ways (``cublaslt_recipe._k_alignment``);
* the det_gemm sweep's shapes (every family's qkv, o, gate_up, down and
  lm_head, forward and dA layouts) at m in SWEEP_MS against M=4096, for
  ``cublas``, ``cublaslt_vllm_recipe`` and rlk's SM90 kernel
  (``rlk_cuda_ffi_kernel``, torch's ``rlk::det_mm``), plus how many of the
  M=4096 rows of each torch setting differ from rlk's bits
  (``rows_differ_from_rlk``).

The note carries ``rows_differ=<count> of <m>``: 0 everywhere is the
det_gemm promise; the peers' counts show the drift it removes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import rlk_jax
from benchmarks import bench_det_gemm_sweep as sweep
from benchmarks import cublaslt_recipe, harness
from benchmarks.harness import Row

BENCH = "invariance"


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(full=256, ms=(1, 3, 64), ks=(64, 256), n=64)
  return dict(full=4096, ms=(1, 3, 16, 64, 128, 256, 1000), ks=(4096, 14336),
              n=4096)


SWEEP_MS = (1, 2, 3, 7, 64, 100, 257, 1000)
SMOKE_SWEEP_MS = (1, 7, 100)
# torch.matmul's settings, each in its own child process.
TORCH_SETTINGS = ("cublas", "cublas_no_splitk", cublaslt_recipe.RECIPE)


def rows_differ(part: np.ndarray, full: np.ndarray) -> int:
  """Rows of `part` whose bits differ anywhere from the same rows of `full`."""
  part, full = np.asarray(part), np.asarray(full[:len(part)])
  bits = lambda x: x.view(np.dtype(f"u{x.dtype.itemsize}"))
  return int((bits(part) != bits(full)).any(axis=1).sum())


def _counts(gemm, a, b, ms):
  full = np.asarray(gemm(a, b))
  return {m: rows_differ(np.asarray(gemm(a[:m], b)), full) for m in ms}


def _torch_counts(cfg, setting: str) -> dict:
  job = dict(kind="rows_differ", ms=list(cfg["ms"]), full=cfg["full"],
             rlk=False, products=[[f"K={k}", k, cfg["n"], "fwd"]
                                  for k in cfg["ks"]])
  done = cublaslt_recipe.run_job(job, setting=setting)
  return {k: {int(m): c for m, c in done[f"K={k}"]["torch"].items()}
          for k in cfg["ks"]}


def run(smoke: bool) -> list[Row]:
  cfg = _config(smoke)
  n, full_m = cfg["n"], cfg["full"]
  competitors = {"xla_dot": jax.jit(lambda a, b: jnp.dot(a, b))}
  for name, why in rlk_jax.implementations("det_gemm").items():
    if why is None and (smoke or name != "xla"):  # the oracle: minutes here
      competitors[f"rlk_{name}"] = jax.jit(
          functools.partial(rlk_jax.det_gemm, implementation=name))
  counts = {}
  for name, gemm in competitors.items():
    counts[name] = {}
    for k in cfg["ks"]:
      keys = jax.random.split(jax.random.key(k), 2)
      a = jax.random.normal(keys[0], (full_m, k), jnp.float32).astype(jnp.bfloat16)
      b = jax.random.normal(keys[1], (k, n), jnp.float32).astype(jnp.bfloat16)
      counts[name][k] = _counts(gemm, a, b, cfg["ms"])
  rows = []
  torch_here = harness.torch_or_none() is not None
  # On a CPU the children run torch's CPU matmul: the plumbing, not cuBLAS.
  if torch_here and (harness.on_gpu() or smoke):
    for setting in TORCH_SETTINGS:
      try:
        counts[setting] = _torch_counts(cfg, setting)
      except Exception as e:  # noqa: BLE001 - reported as a row, not hidden
        rows.append(harness._failed_row(BENCH, "all", setting, e))
  for name, per_k in counts.items():
    for k, per_m in per_k.items():
      for m, differ in per_m.items():
        rows.append(harness.progress(Row(
            BENCH, f"K={k} N={n} M={m} vs M={full_m}", name,
            note=f"rows_differ={differ} of {m}")))
  if torch_here and (harness.on_gpu() or smoke):
    rows += _sweep_rows(smoke)
    if harness.on_gpu():
      rows += _k_alignment_rows()
  return rows


# K a multiple of 8 but not of 16, and K not a multiple of 8 (no TMA there).
K_ALIGNMENT_PRODUCTS = ((256, 776, 1024), (256, 1000, 1024), (256, 4104, 2048),
                        (256, 777, 1024), (256, 1001, 1024), (256, 4097, 2048))


def _k_alignment_rows() -> list[Row]:
  """The recipe at K not a multiple of 16: which way of running rlk's kernel
  (if any) gives its bits, and the kernels cuBLASLt ran."""
  try:
    done = cublaslt_recipe.run_job(
        dict(kind="k_alignment", products=K_ALIGNMENT_PRODUCTS),
        setting=cublaslt_recipe.RECIPE)
  except Exception as e:  # noqa: BLE001 - reported as a row, not hidden
    return [harness._failed_row(BENCH, "K alignment", cublaslt_recipe.RECIPE,
                                e)]
  rows = []
  for label, result in done.items():
    m = int(label.split("M=")[1].split()[0])
    kernels = result.pop("torch kernels")
    rows.append(harness.progress(Row(
        BENCH, f"K alignment {label}", cublaslt_recipe.RECIPE,
        note="kernels: " + " ".join(kernels)[:300])))
    for way, differ in result.items():
      rows.append(harness.progress(Row(
          BENCH, f"K alignment {label}", f"rlk {way}",
          note=(f"rows_differ_from_recipe={differ} of {m}"
                if isinstance(differ, int) else f"FAILED: {differ}"))))
  return rows


def _sweep_rows(smoke: bool) -> list[Row]:
  """The sweep's shapes: each torch setting and rlk's kernel, row counts
  against M=full, and each setting's M=full rows against rlk's."""
  families = sweep.SMOKE_FAMILIES if smoke else sweep.FAMILIES
  full_m = 256 if smoke else 4096
  ms = SMOKE_SWEEP_MS if smoke else SWEEP_MS
  products = [[f"{family} {proj} K={k} N={n} {layout}", k, n, layout]
              for family, dims in families.items()
              for proj, k, n in sweep.products(family, dims)
              for layout in ("fwd", "dA")]
  job = dict(kind="rows_differ", ms=list(ms), full=full_m, rlk=True,
             products=products)
  rows = []
  for setting in ("cublas", cublaslt_recipe.RECIPE):
    # rlk's rows are counted in the first child; the others compute its
    # M=full rows only, to compare torch's with.
    rlk_ms = {} if setting == "cublas" else dict(rlk_ms=[])
    try:
      done = cublaslt_recipe.run_job(dict(job, **rlk_ms), setting=setting)
    except Exception as e:  # noqa: BLE001 - reported as a row, not hidden
      rows.append(harness._failed_row(BENCH, "sweep shapes", setting, e))
      continue
    for label, result in done.items():
      impls = {"torch": setting}
      if setting == "cublas":
        rlk = result["rlk_impl"]
        impls["rlk"] = ("rlk_cuda_ffi_kernel" if rlk == "cuda_ffi"
                        else f"rlk_{rlk}")
      for key, impl in impls.items():
        for m, differ in result[key].items():
          rows.append(harness.progress(Row(
              BENCH, f"{label} M={m} vs M={full_m}", impl,
              note=f"rows_differ={differ} of {m}")))
      rows.append(harness.progress(Row(
          BENCH, f"{label} M={full_m}", setting,
          note=f"rows_differ_from_rlk={result['torch_vs_rlk']} of {full_m}")))
  return rows


def summarize(rows: list[Row]) -> str:
  """The K=/N= table as before, then the sweep's shapes in one table per
  implementation: products with any differing row, rows differing, and
  (for the torch settings) products whose bits equal rlk's."""
  in_table = lambda r: r.case.startswith(("K=", "K alignment")) or (
      r.case == "all")
  lines = [harness.format_table([r for r in rows if in_table(r)])]
  per_impl: dict[str, dict] = {}
  for r in rows:
    if in_table(r) or not r.note:
      continue
    s = per_impl.setdefault(r.implementation, dict(
        products=set(), varying=set(), rows=0, checked=0, same=0, compared=0,
        failed=r.note if r.note.startswith("FAILED") else ""))
    label = r.case.split(" M=")[0]
    if "rows_differ_from_rlk=" in r.note:
      s["compared"] += 1
      s["same"] += r.note.startswith("rows_differ_from_rlk=0 ")
    elif "rows_differ=" in r.note:
      differ, of = r.note.split("=")[1].split(" of ")
      s["products"].add(label)
      s["checked"] += int(of)
      s["rows"] += int(differ)
      if int(differ):
        s["varying"].add(label)
  if per_impl:
    lines += ["", "The det_gemm sweep's shapes (forward and dA layouts), m "
              "rows against the same rows inside the reference M:", "",
              "| implementation | products | products with a differing row "
              "| rows differing / rows checked | reference bits equal rlk's |",
              "|---|---|---|---|---|"]
    for impl, s in per_impl.items():
      same = f"{s['same']} of {s['compared']}" if s["compared"] else ""
      lines.append(f"| {impl} | {len(s['products'])} | {len(s['varying'])} "
                   f"| {s['rows']} / {s['checked']} | {same} |"
                   + (f" {s['failed']}" if s["failed"] else ""))
  return "\n".join(lines)
