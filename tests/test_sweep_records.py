"""benchmarks/sweep_records.py: reading sweep runs back for the records'
summaries (CPU)."""

import csv

import pytest

from benchmarks import sweep_records

FIELDS = ("benchmark", "case", "implementation", "median_ms", "note")


def _write_run(path, rows):
  """A results.csv of (case, cuBLAS ms, rlk ms, rlk's config) rows."""
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, FIELDS)
    w.writeheader()
    for case, cublas_ms, rlk_ms, config in rows:
      w.writerow(dict(benchmark="det_gemm_sweep", case=case,
                      implementation="cublas", median_ms=cublas_ms, note=""))
      w.writerow(dict(benchmark="det_gemm_sweep", case=case,
                      implementation="rlk_cuda_ffi_kernel", median_ms=rlk_ms,
                      note=f"0.9x cublas; config {config}"))
  return path


A = "fam o M=512 K=4096 N=5120 fwd"
B = "fam qkv M=128 K=4096 N=6144 fwd"


def test_ratios_below_and_same_config_medians(tmp_path):
  first = _write_run(tmp_path / "1.csv", [(A, 0.8, 1.0, "x160"),
                                          (B, 1.2, 1.0, "x96")])
  second = _write_run(tmp_path / "2.csv", [(A, 1.0, 1.0, "x160"),
                                           (B, 0.5, 1.0, "x96")])
  other = _write_run(tmp_path / "3.csv", [(A, 0.1, 1.0, "x192")])
  r = sweep_records.ratios(first)
  assert r == {A: (pytest.approx(0.8), "x160"), B: (pytest.approx(1.2), "x96")}
  assert sweep_records.m_of(A) == 512
  # B is below the floor but under min_m, so only A counts.
  assert [c for _, c, _ in sweep_records.below(r, 0.9, 256)] == [A]
  runs = sweep_records.same_config_ratios(r, [first, second, other])
  # The run on another config (x192) is not one of A's measurements.
  assert runs[A] == [pytest.approx(0.8), pytest.approx(1.0)]
  assert runs[B] == [pytest.approx(1.2), pytest.approx(0.5)]
