"""Batch invariance, counted: how many of the first m rows of a GEMM change
bits when the same rows are computed with M=m instead of inside M=4096.

    python -m benchmarks.bench_invariance [--smoke] [--csv out.csv]

Competitors: ``cublas`` (torch.matmul, bf16, its default heuristics),
``cublas_no_splitk`` (the same with ``CUBLAS_WORKSPACE_CONFIG=:0:0``: no
workspace, so no split-K; measured in a child process because cuBLAS reads
it once), ``xla_dot`` (``jnp.dot``, bf16 out) and each available rlk
implementation. The note carries ``rows_differ=<count> of <m>``: 0 everywhere
is the det_gemm promise; the peers' counts show the drift it removes.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import rlk_jax
from benchmarks import harness
from benchmarks.harness import Row

BENCH = "invariance"


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(full=256, ms=(1, 3, 16, 64, 128), ks=(64, 256), n=64)
  return dict(full=4096, ms=(1, 3, 16, 64, 128, 256, 1000), ks=(4096, 14336),
              n=4096)


def rows_differ(part: np.ndarray, full: np.ndarray) -> int:
  """Rows of `part` whose bits differ anywhere from the same rows of `full`."""
  part, full = np.asarray(part), np.asarray(full[:len(part)])
  bits = lambda x: x.view(np.dtype(f"u{x.dtype.itemsize}"))
  return int((bits(part) != bits(full)).any(axis=1).sum())


def _counts(gemm, a, b, ms):
  full = np.asarray(gemm(a, b))
  return {m: rows_differ(np.asarray(gemm(a[:m], b)), full) for m in ms}


# Runs in a child process (cuBLAS reads CUBLAS_WORKSPACE_CONFIG once): the
# same operands rebuilt from a seed, bf16 bit patterns compared there.
_CHILD = """
import json, sys, numpy as np, torch
cfg = json.loads(sys.argv[1])
out = {}
for k in cfg["ks"]:
  g = torch.Generator(device="cuda").manual_seed(k)
  a = torch.randn(cfg["full"], k, device="cuda", generator=g).to(torch.bfloat16)
  b = torch.randn(k, cfg["n"], device="cuda", generator=g).to(torch.bfloat16)
  full = (a @ b).view(torch.int16)
  out[k] = {m: int(((a[:m] @ b).view(torch.int16) != full[:m]).any(1).sum())
            for m in cfg["ms"]}
print(json.dumps(out))
"""


def _cublas_counts(cfg, no_splitk: bool):
  env = dict(os.environ)
  if no_splitk:
    env["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
  done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)],
                        capture_output=True, text=True, env=env, timeout=300)
  if done.returncode != 0:
    raise RuntimeError(done.stderr.strip().splitlines()[-1])
  return {int(k): {int(m): c for m, c in v.items()}
          for k, v in json.loads(done.stdout).items()}


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
  notes = {}
  if harness.torch_or_none() is not None and harness.on_gpu():
    for name, no_splitk in (("cublas", False), ("cublas_no_splitk", True)):
      try:
        counts[name] = _cublas_counts(cfg, no_splitk)
      except Exception as e:  # noqa: BLE001 - reported as a row, not hidden
        notes[name] = f"FAILED: {type(e).__name__}: {e}"[:160]
  rows = [Row(BENCH, "all", name, note=note) for name, note in notes.items()]
  for name, per_k in counts.items():
    for k, per_m in per_k.items():
      for m, differ in per_m.items():
        rows.append(harness.progress(Row(
            BENCH, f"K={k} N={n} M={m} vs M={full_m}", name,
            note=f"rows_differ={differ} of {m}")))
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
