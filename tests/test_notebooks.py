"""The benchmark figures and notebooks run headless on a CPU machine.

The notebooks run as a user opens them, on the newest committed results
(tables, figures); the smoke run they fall back to is the main job's smoke
test's (`test_benchmarks.py`), not run twice here.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from benchmarks import plots
from benchmarks.harness import COLUMNS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "benchmarks", "notebooks")
H200_GEMM = os.path.join(ROOT, "benchmarks", "results",
                         "nvidia-h200-2026-11-21", "det_gemm_results.csv")


def _synthetic_rows():
  """One small run of every plotted benchmark, named as the real CSVs are."""
  rows = [("pack", "copy", "xla_elementwise_copy", 0.2, 2700, None, None, "")]
  for density in (0.05, 0.5, 1.0):
    for cap in ("cap=mask.size", "cap=active_r128"):
      case = f"[4,128,256] bfloat16 density={density} {cap}"
      rows += [("pack", case, impl, 0.1, 1000 * density + i, None, None, "")
               for i, impl in enumerate(("rlk_pallas", "rlk_xla",
                                         "xla_nonzero_take"))]
    rows.append(("pack", f"[4,128,256] bfloat16 density={density} cap=active",
                 "torch_boolean_index", 0.3, 300 * density, None, None, ""))
  for name in ("qkv M=4096 K=4096 N=6144 bf16",
               "decode M=1 K=4096 N=4096 bf16"):
    rows += [("det_gemm", name, impl, 0.1 + i, None, 600 - 50 * i, None, "")
             for i, impl in enumerate(("cublas", "xla_dot", "rlk_pallas"))]
    rows.append(("det_gemm", name + " bwd", "rlk_pallas_vjp", 0.5, None, 500,
                 None, ""))
  for k in (4096, 14336):
    for m in (1, 16, 256):
      case = f"K={k} N=4096 M={m} vs M=4096"
      rows += [("invariance", case, impl, None, None, None, None,
                f"rows_differ={d} of {m}")
               for impl, d in (("cublas", m // 2), ("rlk_pallas", 0))]
  for v in (32768, 131072):
    rows += [("logp", f"N=16384 H=4096 V={v} bf16", impl, 5.0 * v / 32768,
              None, 500, mb, "")
             for impl, mb in (("xla_dense", v / 16), ("rlk_pallas", 0.19))]
    rows.append(("logp", f"N=16384 H=4096 V={v} bf16 fwd+bwd", "xla_dense_vjp",
                 20.0, None, 300, v / 4, ""))
  for n in (1024, 4096):  # bench_logp's torch peers over N
    rows += [("logp", f"torch N={n} H=4096 V=151936 bf16 fwd+bwd", impl,
              n / 100 * k, None, None, n / 10 * k, "")
             for impl, k in (("rlk", 1.0), ("liger_flce", 1.5))]
  bridge = (("rlk_jax", 0.04), ("rlk_torch_bridge", 0.038),
            ("torch_native", 0.014))
  rows += [("bridge", "det_gemm M=16 K=1024 N=1024 bf16 (cuda)", impl, ms,
            None, None, None, "") for impl, ms in bridge]
  for m in (128, 1024):
    for layout in ("fwd", "dA", "dB"):
      case = f"llama3.1-8b o M={m} K=4096 N=4096 {layout}"
      rows += [("det_gemm_sweep", case, impl, ms, None, None, None, "")
               for impl, ms in (("cublas", 0.05), ("rlk_cuda_ffi_kernel", 0.04),
                                ("xla_dot", 0.06))]
  for case, scale in (("train B=8 S=2048 H=32/8 D=128 fwd", 1.0),
                      ("decode B=16 ctx=8192 H=32/8 D=128", 0.2)):
    rows += [("attention", case, impl, ms * scale, None, None, None, "")
             for impl, ms in (("rlk_torch", 1.0), ("sdpa_flash", 0.9),
                              ("sdpa_cudnn", 0.5))]
  rows.append(("attention", "invariance S=512", "rlk_torch", None, None, None,
               None, "batch 8 vs alone: 0 of 512 positions differ"))
  return rows


def _write_csv(path, rows, date="2026-11-21", commit="abc1234"):
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(COLUMNS)
    for bench, case, impl, ms, gbps, tflops, mb, note in rows:
      writer.writerow([date, commit, "Test GPU", bench, case, impl,
                       ms, gbps, tflops, "", "", mb, note])


def _assert_pngs(paths, names):
  assert sorted(os.path.basename(p) for p in paths) == sorted(names)
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


def test_write_plots_synthetic(tmp_path):
  csv_path = tmp_path / "results.csv"
  _write_csv(csv_path, _synthetic_rows())
  paths = plots.write_plots(str(csv_path), str(tmp_path / "png"))
  _assert_pngs(paths, plots.FIGURES)
  assert all(os.path.getsize(p) > 1000 for p in paths)


def test_write_plots_skips_absent_figures(tmp_path):
  csv_path = tmp_path / "results.csv"
  _write_csv(csv_path, [r for r in _synthetic_rows() if r[0] == "bridge"])
  _assert_pngs(plots.write_plots(str(csv_path), str(tmp_path)),
               ["bridge_overhead.png"])


def test_titles_name_device_and_commit(tmp_path):
  csv_path = tmp_path / "results.csv"
  _write_csv(csv_path, _synthetic_rows())
  rows = plots.read_rows(str(csv_path))
  for build in plots.FIGURES.values():
    title = build(rows).get_suptitle()
    assert "Test GPU" in title and "abc1234" in title, title


def test_write_plots_h200_det_gemm(tmp_path):
  paths = plots.write_plots(H200_GEMM, str(tmp_path))
  _assert_pngs(paths, ["det_gemm_tflops.png", "det_gemm_decode.png"])
  rows = plots.read_rows(H200_GEMM)
  title = plots.det_gemm_tflops_figure(rows).get_suptitle()
  assert "NVIDIA H200" in title and "c6b0079" in title


def test_newest_results_per_benchmark(tmp_path):
  """Newest by date, per benchmark; experiment dumps and smoke folders are
  not a run's results."""
  rows = _synthetic_rows()
  gemm = [r for r in rows if r[0] == "det_gemm"]
  results = tmp_path / "benchmarks" / "results"
  for folder, name, part, date in (
      ("gpu-old", "results.csv", rows, "2026-11-20"),
      ("gpu-new", "det_gemm_results.csv", gemm, "2026-11-21"),
      ("gpu-new", "sweep_abc.csv", rows, "2026-11-22"),
      ("smoke-cpu-new", "results.csv", rows, "2026-11-22")):
    (results / folder).mkdir(parents=True, exist_ok=True)
    _write_csv(results / folder / name, part, date)
  newest = lambda benchmark: plots.newest_results(str(tmp_path), benchmark)
  assert newest("det_gemm") == str(results / "gpu-new" / "det_gemm_results.csv")
  assert newest("pack") == str(results / "gpu-old" / "results.csv")
  assert newest("host") is None
  loaded, sources = plots.load_results(str(tmp_path), ["det_gemm", "pack"],
                                       smoke=False)
  assert len(sources) == 2
  assert {r["date"] for r in loaded if r["benchmark"] == "det_gemm"} == {
      "2026-11-21"}


def test_newest_results_same_date_prefers_the_newer_commit(tmp_path):
  """Runs of one date, in nested folders: the one made from the newer commit
  wins whatever the checkout's folder mtimes say."""
  git = lambda *args: subprocess.run(
      ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
      check=True, capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  shas = []
  for when in ("2026-11-21T10:00:00", "2026-11-21T12:00:00"):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-q", "--allow-empty", "-m", when], cwd=tmp_path,
                   check=True, env=dict(os.environ, GIT_COMMITTER_DATE=when,
                                        GIT_AUTHOR_DATE=when))
    shas.append(git("rev-parse", "--short", "HEAD"))
  results = tmp_path / "benchmarks" / "results"
  newer = results / "gpu-a" / "main-job"
  older = results / "gpu-b"
  for folder, sha in ((newer, shas[1]), (older, shas[0])):
    folder.mkdir(parents=True)
    _write_csv(folder / "results.csv", _synthetic_rows(), commit=sha)
  os.utime(newer, (0, 0))  # the older run's folder looks newer on disk
  assert plots.newest_results(str(tmp_path), "pack") == str(newer / "results.csv")


def test_cli(tmp_path, capsys):
  assert plots.main([H200_GEMM, str(tmp_path)]) == 0
  assert "det_gemm_tflops.png" in capsys.readouterr().out


# ---------------------------------------------------------------- notebooks

def _notebook_client():
  """The nbclient pieces: nbformat, nbclient and ipykernel (the python3
  kernel) are test dependencies, so a missing one fails here, loudly."""
  import nbformat
  from nbclient import NotebookClient
  assert importlib.util.find_spec("ipykernel") is not None, (
      "ipykernel (the python3 kernel) is missing: pip install -e '.[test]'")
  return nbformat, NotebookClient


def _kernel_python() -> str:
  """The interpreter the python3 kernel would start: it must be this one
  (the venv with rlk and jax), not some other python on PATH."""
  from jupyter_client.manager import KernelManager
  manager = KernelManager(kernel_name="python3")
  return manager.format_kernel_cmd()[0]


def test_kernel_is_this_interpreter():
  _notebook_client()
  assert os.path.realpath(_kernel_python()) == os.path.realpath(sys.executable)


@pytest.mark.parametrize("name", ["xla_vs_cublas_vs_rlk", "pack"])
def test_notebook_runs(name, monkeypatch):
  nbformat, NotebookClient = _notebook_client()
  monkeypatch.delenv("RLK_NOTEBOOK_SMOKE", raising=False)  # the kernel inherits it
  path = os.path.join(NOTEBOOKS, f"{name}.ipynb")
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells), "commit it cleared"
  # execute() raises CellExecutionError on the first cell that fails.
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": NOTEBOOKS}}).execute()
  outputs = [o for c in nb.cells for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs)
