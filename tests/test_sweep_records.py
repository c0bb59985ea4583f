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
C = "fam down M=512 K=14336 N=4096 fwd"


def test_ratios_and_below(tmp_path):
  run = _write_run(tmp_path / "1.csv", [(A, 0.8, 1.0, "x160"),
                                        (B, 0.5, 1.0, "x96"),
                                        (C, 0.95, 1.0, "x128")])
  r = sweep_records.ratios(run)
  assert r == {A: (pytest.approx(0.8), "x160"), B: (pytest.approx(0.5), "x96"),
               C: (pytest.approx(0.95), "x128")}
  assert sweep_records.m_of(A) == 512
  # B is below the floor too, but at M=128, under min_m; C is above it.
  assert [c for _, c, _ in sweep_records.below(r, 0.9, 256)] == [A]
  assert [c for _, c, _ in sweep_records.below(r, 0.9, 128)] == [B, A]


def test_same_config_ratios_keep_only_the_current_config(tmp_path):
  first = _write_run(tmp_path / "1.csv", [(A, 0.8, 1.0, "x160"),
                                          (B, 1.2, 1.0, "x96")])
  second = _write_run(tmp_path / "2.csv", [(A, 1.0, 1.0, "x160"),
                                           (B, 0.5, 1.0, "x96")])
  # A on another config, and a product the current run does not have.
  other = _write_run(tmp_path / "3.csv", [(A, 0.1, 1.0, "x192"),
                                          (C, 0.7, 1.0, "x128")])
  current = sweep_records.ratios(first)
  runs = sweep_records.same_config_ratios(current, [first, second, other])
  assert runs == {A: [pytest.approx(0.8), pytest.approx(1.0)],
                  B: [pytest.approx(1.2), pytest.approx(0.5)]}
