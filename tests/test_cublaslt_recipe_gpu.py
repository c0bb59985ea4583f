"""vLLM's batch-invariant recipe for Hopper (cuBLASLt, no workspace, no
reduced-precision reductions; `benchmarks/cublaslt_recipe.py`) against rlk's
SM90 det_gemm on a sample of the det_gemm sweep's shapes, in a child process
(cuBLAS reads the recipe's environment once): whether a vLLM rollout and an
rlk training step can share GEMM bits."""

import numpy as np
import pytest

import rlk_jax
from benchmarks import bench_det_gemm_sweep as sweep
from benchmarks import cublaslt_recipe
from conftest import ON_GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="requires a CUDA GPU"),
    pytest.mark.skipif(ON_GPU and rlk_jax.implementations("det_gemm")["cuda_ffi"]
                       is not None, reason="requires the SM90 cuda_ffi library"),
]

# (family, projection): both hidden-size ends, the MoE expert width and a
# vocabulary-sized N; each in the forward and dA layouts.
SAMPLE = (("qwen3-1.7b", "o"), ("llama3.2-3b", "qkv"),
          ("qwen2.5-7b", "down"), ("qwen3-30b-a3b-expert", "down"),
          ("qwen3-30b-a3b-expert", "gate_up"), ("llama3.1-8b", "lm_head"))


def _sample_products():
  out = []
  for family, proj in SAMPLE:
    dims = dict((p, (k, n)) for p, k, n in sweep.products(
        family, sweep.FAMILIES[family]))[proj]
    out += [[f"{family} {proj} {layout}", *dims, layout]
            for layout in ("fwd", "dA")]
  return out


def test_recipe_equals_rlk_sm90_bits_and_both_are_row_invariant(rng):
  # A ragged reference M (not a multiple of any tile) and ragged prefixes.
  job = dict(kind="rows_differ", products=_sample_products(), full=1000,
             ms=[1, 3, 7, 100, 257], rlk=True,
             seed=int(rng.integers(1 << 30)))
  done = cublaslt_recipe.run_job(job, setting=cublaslt_recipe.RECIPE)
  assert set(done) == {p[0] for p in job["products"]}
  for label, result in done.items():
    assert result["rlk_impl"] == "cuda_ffi"
    assert result["rlk"] == {str(m): 0 for m in job["ms"]}, label
    assert result["torch"] == {str(m): 0 for m in job["ms"]}, label
    assert result["torch_vs_rlk"] == 0, label


def test_default_cublas_drifts_where_the_recipe_does_not(rng):
  # The recipe's settings are what make torch invariant here: plain cuBLAS
  # picks split-K or other tiles by M, so some rows change bits.
  job = dict(kind="rows_differ", full=4096, ms=[1, 64, 257], rlk=False,
             products=[["o", 3584, 3584, "fwd"], ["down", 18944, 3584, "fwd"]],
             seed=int(rng.integers(1 << 30)))
  counts = [sum(r["torch"].values()) for r in cublaslt_recipe.run_job(
      job, setting="cublas").values()]
  assert np.sum(counts) > 0, counts
