"""The benchmark harness's own arithmetic, and the main job end to end in
smoke mode (what a fresh CPU machine runs with no arguments)."""

import csv
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import bench_invariance, harness
from benchmarks.harness import Row


def test_rows_differ_counts_rows_with_any_changed_bit(rng):
  full = rng.standard_normal((10, 7)).astype(np.float32)
  part = full[:6].copy()
  part[1, 3] = np.nextafter(part[1, 3], np.float32(np.inf))  # one ulp
  part[4, 0] = -part[4, 0]
  assert bench_invariance.rows_differ(part, full) == 2
  assert bench_invariance.rows_differ(full[:6], full) == 0
  zeros = np.zeros((2, 3), np.float32)
  assert bench_invariance.rows_differ(-zeros, zeros) == 2  # -0.0 is not +0.0


def test_peer_ratios_divide_by_the_same_case_only():
  rows = [Row("b", "c1", "peer", 2.0), Row("b", "c1", "rlk", 1.0),
          Row("b", "c2", "rlk", 3.0), Row("b", "c2", "other", None)]
  assert harness.peer_ratios(rows, "peer") == [1.0, 0.5, None, None]
  assert "x peer" in harness.format_table(rows, peer="peer")


def test_interleaved_timing_leaves_out_what_a_batch_costs_once():
  # A batch that costs 100 ms once (dispatch, the final wait) plus 20 ms a
  # call: timed whole, 5 calls would read 40 ms each; the figure is 20 ms.
  # (Tens of ms: a sleep's wake-up runs ms late on a loaded machine, e.g.
  # beside the other test workers.)
  def run_batch(n):
    time.sleep(0.100 + 0.020 * n)

  per_call = harness.time_interleaved({"fake": (run_batch, 1)}, iters=5,
                                      repeats=3, warmup=0)["fake"]
  assert 15 < per_call < 35


def test_interleaved_timing_falls_back_to_whole_batches_in_noise():
  # More calls taking no longer (noise larger than the work): the added
  # time is not positive, so the figure is the longer batch's per call.
  def run_batch(n):
    time.sleep(0.120 - 0.010 * n)

  per_call = harness.time_interleaved({"fake": (run_batch, 1)}, iters=2,
                                      repeats=3, warmup=0)["fake"]
  assert 15 < per_call < 35  # the 4-call batch: 80 ms over 4 calls


def test_main_job_smoke_writes_csv_report_and_plots(tmp_path):
  out = tmp_path / "out"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, "-m", "benchmarks", "--only",
                  "invariance,bridge,torch_ops,jit_steps,det_gemm_sweep",
                  "--repeats", "1",
                  "--sweep_ms", "48", "--out", str(out)],
                 cwd=root, check=True, capture_output=True, text=True,
                 timeout=600)
  with open(out / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert {r["benchmark"] for r in rows} == {"invariance", "bridge", "torch_ops",
                                            "jit_steps", "det_gemm_sweep"}
  steps = {(r["case"].split()[0], r["implementation"]) for r in rows
           if r["benchmark"] == "jit_steps" and r["median_ms"]}
  assert steps == {(c, i) for c in ("decode", "packed")
                   for i in ("rlk_jit", "xla_jit")} | {
                       ("decode", "rlk_jit_donated")}, steps
  assert any(r["case"].startswith("HF-style decoder") and r["median_ms"]
             for r in rows if r["benchmark"] == "torch_ops")
  sweep = {(r["case"].split()[1], r["case"].split()[-1]) for r in rows
           if r["benchmark"] == "det_gemm_sweep" and r["median_ms"]}
  assert sweep == {(p, l) for p in ("qkv", "o", "gate_up", "down", "lm_head")
                   for l in ("fwd", "dA", "dB")}
  assert all(r["commit"] and r["device"] for r in rows)
  # torch.matmul's settings run in child processes (torch's CPU matmul here):
  # every one answers, on the K=/N= products and on the sweep's shapes.
  invariance = [r for r in rows if r["benchmark"] == "invariance"]
  assert not [r for r in invariance if "FAILED" in r["note"]]
  by_impl = {}
  for r in invariance:
    by_impl.setdefault(r["implementation"], []).append(r)
  assert {"cublas", "cublas_no_splitk", "cublaslt_vllm_recipe",
          "rlk_xla"} <= set(by_impl), set(by_impl)
  recipe_shapes = [r for r in by_impl["cublaslt_vllm_recipe"]
                   if r["case"].startswith("tiny")]
  # 5 products x 2 layouts x (3 m + rlk)
  assert len(recipe_shapes) == 10 * 4 == 10 * (len(bench_invariance.SMOKE_SWEEP_MS) + 1)
  assert sum("rows_differ_from_rlk=" in r["note"] for r in recipe_shapes) == 10
  report = (out / "report.md").read_text()
  assert all(f"## {b}" in report for b in ("invariance", "bridge", "torch_ops",
                                           "jit_steps", "det_gemm_sweep"))
  pngs = sorted(p.name for p in out.glob("*.png"))
  assert "invariance.png" in pngs and "bridge_overhead.png" in pngs, pngs
  assert all(f"![{p}]({p})" in report for p in pngs)


def test_appending_to_a_csv_from_before_a_new_column_keeps_rows_aligned(tmp_path):
  path = str(tmp_path / "results.csv")
  with open(path, "w", newline="") as f:
    csv.writer(f).writerow(harness.COLUMNS[:-1])  # written before kernel_ms
  harness.write_csv([harness.Row("b", "c", "i", 1.5, kernel_ms=0.5)], path)
  header, row = list(csv.reader(open(path, newline="")))
  assert header == list(harness.COLUMNS[:-1]) and len(row) == len(header)
  assert row[header.index("median_ms")] == "1.5"
  fresh = str(tmp_path / "fresh.csv")
  harness.write_csv([harness.Row("b", "c", "i", 1.5, kernel_ms=0.5)], fresh)
  header, row = list(csv.reader(open(fresh, newline="")))
  assert row[header.index("kernel_ms")] == "0.5"


def test_tile_configs_are_timed_and_tabled_and_a_failing_one_is_a_row(
    tmp_path, monkeypatch):
  import json

  import jax
  import jax.numpy as jnp
  from absl import flags

  from benchmarks import bench_det_gemm_sweep as sweep
  from pallas_kernels import det_matmul
  from rlk_jax import _gemm_tuning
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  monkeypatch.setattr(flags.FLAGS, "sweep_tile_config_names",
                      ["128x128", "64x128", "64x32"])
  broken = det_matmul.NAMED_CONFIGS["64x32"]

  def tile_kernel(backend):
    def run(a, b, *, config, **layout):
      if config is broken:
        raise RuntimeError("this config does not build here")
      return det_matmul.matmul(a, b, interpret=True, config=config, **layout)
    return run

  monkeypatch.setattr(sweep, "_tile_kernel", tile_kernel)
  monkeypatch.setattr(sweep, "_TILE_TIMES", {})
  k1, k2 = jax.random.split(jax.random.key(7))
  a = jax.random.normal(k1, (96, 64)).astype(jnp.bfloat16)
  b = jax.random.normal(k2, (64, 80)).astype(jnp.bfloat16)
  sweep._time_tile_configs("pallas", "case", 96, 80, 64, False, False,
                           [(a, b), (a + 1, b)], 2)
  key = _gemm_tuning.pallas_key(96, 80, 64, False, False)
  entry = sweep._TILE_TIMES["pallas"][key]
  assert entry["bits_equal"] and entry["m"] == 96
  assert entry["ms"]["64x32"] is None
  assert entry["ms"]["128x128"] > 0 and entry["ms"]["64x128"] > 0
  # A product whose every config failed gets no table entry.
  sweep._TILE_TIMES["pallas"]["002 128 64 64"] = {
      "m": 100, "bits_equal": True, "ms": {"128x128": None}}
  sweep._write_tile_tuning(str(tmp_path), "pallas", sweep._TILE_TIMES["pallas"])
  name = f"det_gemm_pallas-{_gemm_tuning.device_slug(harness.device_name())}.json"
  table = json.load(open(tmp_path / name))["entries"]
  assert table == {key: _gemm_tuning.pick(
      entry["ms"], candidates=("128x128", "64x128", "64x32"))}
  chosen = [r for r in csv.DictReader(open(tmp_path / "det_gemm_pallas_configs.csv"))
            if r["chosen"] == "1"]
  assert [r["config"] for r in chosen] == [table[key]]


def _sweep_with_flags():
  from absl import flags

  from benchmarks import bench_det_gemm_sweep as sweep
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return sweep


def test_sweep_timing_plan_reads_every_decode_weight_from_hbm():
  _sweep_with_flags()
  from benchmarks import gemm_products
  weight = 2 * 4096 * 4096  # 32 MB: a set fits the H100's 50 MB L2
  n_sets, iters = gemm_products.timing_plan(
      (1, 4096), (4096, 4096), 2 * 4096 * 4096, 4096)
  assert n_sets * weight >= 256 << 20
  # 10 ms of weight reads at 3 TB/s per sample (11 us a call), not 10 ms
  # of FLOPs at 700 TFLOP/s (200,000 calls)
  assert 500 < iters * n_sets < 2000
  # a large product: one set, a call or a few per sample
  assert gemm_products.timing_plan((16384, 8192), (8192, 28672),
                                   2 * 16384 * 8192 * 28672,
                                   16384 * 28672) == (1, 1)


def test_sweep_summary_splits_by_cublas_bits_and_gives_decode_floors():
  sweep = _sweep_with_flags()
  Row = harness.Row
  big, small = "f q M=1 K=8192 N=8192 fwd", "f q M=1 K=2048 N=2048 fwd"
  rows = [
      Row(sweep.BENCH, big, "cublas", 0.050, floor_ms=0.045,
          note="cublas bits: 1 of 1 rows differ from rlk's"),
      Row(sweep.BENCH, big, "rlk_cuda_ffi_kernel", 0.049, floor_ms=0.045),
      Row(sweep.BENCH, small, "cublas", 0.008, floor_ms=0.003,
          note="cublas bits: 0 of 1 rows differ from rlk's"),
      Row(sweep.BENCH, small, "rlk_cuda_ffi_kernel", 0.010, floor_ms=0.003),
  ]
  text = sweep.summarize(rows)
  # only the 128 MB weight is held to the byte floor
  assert "- rlk_cuda_ffi_kernel: geomean 1.09x, worst 1.09x over 1 products" \
      in text
  assert "- cublas: geomean 1.11x, worst 1.11x over 1 products" in text
  assert "| fwd | 1 | 0.800 | 1 | 1.020 |" in text


def test_tuning_cost_benchmark_says_why_it_measured_nothing_without_sm90():
  from benchmarks import bench_det_gemm_tuning
  rows = bench_det_gemm_tuning.run(smoke=True)
  assert len(rows) == 1 and rows[0].median_ms is None
  assert "not measured" in rows[0].note


def test_tuning_cost_runs_on_an_empty_cache_with_a_users_defaults(
    monkeypatch, tmp_path):
  from benchmarks import bench_det_gemm_tuning
  monkeypatch.setenv("RLK_DET_GEMM_TUNE_MAX_TFLOP", "1e6")  # as the sweep sets
  monkeypatch.setenv("RLK_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("RLK_DET_GEMM_TUNED_TABLES", raising=False)
  with bench_det_gemm_tuning._fresh_tuner():
    assert "RLK_DET_GEMM_TUNE_MAX_TFLOP" not in os.environ
    assert os.environ["RLK_DET_GEMM_TUNED_TABLES"] == "0"
    fresh = os.environ["RLK_CACHE_DIR"]
    assert fresh != str(tmp_path) and not os.listdir(fresh)
  assert os.environ["RLK_DET_GEMM_TUNE_MAX_TFLOP"] == "1e6"
  assert os.environ["RLK_CACHE_DIR"] == str(tmp_path)
  assert "RLK_DET_GEMM_TUNED_TABLES" not in os.environ


def test_sweep_runs_a_held_out_family_with_a_users_tuning_limits(monkeypatch):
  from absl.testing import flagsaver
  sweep = _sweep_with_flags()
  for var in ("RLK_DET_GEMM_TUNE_MAX_TFLOP", "RLK_DET_GEMM_TUNE_MAX_MB"):
    monkeypatch.setenv(var, "0")  # so that monkeypatch restores it after
    monkeypatch.delenv(var)
  one_product = dict(sweep_projections=["o"], sweep_ms=["16"],
                     sweep_layouts=["fwd"], sweep_impls=["xla_dot"],
                     sweep_as_user=True)
  with flagsaver.flagsaver(sweep_families=["qwen2.5-1.5b"], **one_product):
    rows = sweep.run(smoke=True)
  assert [r.case for r in rows] == ["qwen2.5-1.5b o M=16 K=1536 N=1536 fwd"]
  assert rows[0].median_ms > 0
  # a user's defaults: the table-building run's lifted limits are not set
  assert "RLK_DET_GEMM_TUNE_MAX_TFLOP" not in os.environ
  with flagsaver.flagsaver(sweep_families=["no-such-model"], **one_product):
    with pytest.raises(ValueError, match="unknown --sweep_families"):
      sweep.run(smoke=True)


def test_sweep_extra_candidates_join_the_tuner_last_in_order(monkeypatch):
  from absl.testing import flagsaver
  from rlk_jax import _gemm_tuning
  sweep = _sweep_with_flags()
  # Two of the candidates stand in for configs not yet among them (the
  # library may have none such when this runs).
  held_back = list(_gemm_tuning.CANDIDATES[-2:])[::-1]
  monkeypatch.setattr(_gemm_tuning, "CANDIDATES",
                      _gemm_tuning.CANDIDATES[:-2])
  before = _gemm_tuning.CANDIDATES
  extra = [*held_back, before[0]]  # one already a candidate: not repeated
  one_product = dict(sweep_projections=["o"], sweep_ms=["16"],
                     sweep_layouts=["fwd"], sweep_impls=["xla_dot"])
  with flagsaver.flagsaver(sweep_extra_candidates=extra, **one_product):
    assert len(sweep.run(smoke=True)) == 1
  assert _gemm_tuning.CANDIDATES == (*before, *held_back)
  # Ties among them go by the flag's order, as they would once they join.
  assert _gemm_tuning.pick({held_back[1]: 1.0, held_back[0]: 1.0}) == (
      held_back[0])
  for bad in (["cooperative_999x1"], ["auto"]):
    with flagsaver.flagsaver(sweep_extra_candidates=bad, **one_product):
      with pytest.raises(ValueError, match="unknown --sweep_extra_candidates"):
        sweep.run(smoke=True)


def test_merge_tuned_table_replaces_only_the_runs_keys(tmp_path):
  import importlib.util
  import json
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = os.path.join(repo, "scripts", "merge_tuned_table.py")
  shipped = {"device": "NVIDIA H100 80GB HBM3", "commit": "old",
             "date": "2026-11-23", "source": "the sweep",
             "entries": {"000 512 5120 4096": "cooperative_128x192",
                         "000 512 4608 3584": "cooperative_128x96",
                         "001 512 5120 4096": "pingpong_128x128"}}
  run = {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
         "date": "2026-11-25", "source": "x",
         "entries": {"000 512 5120 4096": "cooperative_128x160",
                     "000 512 4608 3584": "cooperative_128x96",
                     "000 384 5120 4096": "cooperative_128x144"}}
  table = tmp_path / "det_gemm_sm90-nvidia-h100-80gb-hbm3.json"
  table.write_text(json.dumps(shipped))
  (tmp_path / "run.json").write_text(json.dumps(run))
  done = subprocess.run(
      [sys.executable, script, str(tmp_path / "run.json"), "--record",
       "results/r", "--note", "M=512 retuned", "--table_dir", str(tmp_path)],
      capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert "1 entries added, 1 changed, 4 in all" in done.stdout
  merged = json.loads(table.read_text())
  assert merged["entries"] == {**shipped["entries"], **run["entries"]}
  assert merged["entries"]["001 512 5120 4096"] == "pingpong_128x128"
  assert (merged["commit"], merged["date"]) == ("abc1234", "2026-11-25")
  assert merged["source"] == "the sweep; M=512 retuned (results/r)"
  # A run of another device is refused before anything is written.
  spec = importlib.util.spec_from_file_location("merge_tuned_table", script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with pytest.raises(ValueError, match="NVIDIA H200"):
    module.merge({**run, "device": "NVIDIA H200"}, shipped, record="r",
                 note="n")


def test_logp_peers_by_n_figure_draws_time_and_memory_over_n():
  pytest.importorskip("matplotlib")
  from benchmarks import plots

  def row(n, impl, ms, mb, h=4096, v=151936):
    return {"benchmark": "logp", "case": f"torch N={n} H={h} V={v} bf16 fwd+bwd",
            "implementation": impl, "median_ms": ms, "peak_mem_mb": mb,
            "date": "2026-11-27", "commit": "abc", "device": "H100"}

  rows = [row(n, impl, n / 100 * k, n / 50 * k)
          for n in (1024, 4096, 16384) for impl, k in (("rlk", 1.0),
                                                       ("verl", 1.4))]
  rows.append(row(4096, "rlk", 3.0, 10.0, h=2048, v=32768))  # one N: not drawn
  fig = plots.logp_peers_by_n_figure(rows)
  time_ax, memory_ax = fig.axes
  assert "H=4096 V=151936" in fig._suptitle.get_text()
  lines = {l.get_label(): l for l in time_ax.get_lines()}
  assert list(lines) == ["rlk", "verl"]
  assert list(lines["verl"].get_xdata()) == [1024, 4096, 16384]
  assert list(lines["rlk"].get_ydata()) == [10.24, 40.96, 163.84]
  assert [l.get_label() for l in memory_ax.get_lines()] == ["rlk", "verl"]
  assert plots.logp_peers_by_n_figure(rows[-1:]) is None


def test_det_gemm_by_m_figure_draws_each_layouts_geometric_mean(rng):
  pytest.importorskip("matplotlib")
  from benchmarks import plots
  rows, want = [], {}
  for layout in ("fwd", "dA"):
    for m in (128, 1024):
      ratios = rng.uniform(0.7, 1.3, 5)
      want[(layout, m)] = float(np.exp(np.log(ratios).mean()))
      for i, x in enumerate(ratios):
        case = f"fam p{i} M={m} K=4096 N=1024 {layout}"
        base = dict(benchmark="det_gemm_sweep", case=case, device="d",
                    commit="c", date="x")
        rows += [dict(base, implementation="cublas", median_ms=1.0),
                 dict(base, implementation="rlk_cuda_ffi_kernel",
                      median_ms=1.0 / x)]
  fig = plots.det_gemm_by_m_figure(rows)
  axes = fig.get_axes()
  assert [ax.get_title() for ax in axes] == ["fwd: 10 products",
                                             "dA: 10 products"]
  for ax, layout in zip(axes, ("fwd", "dA")):
    (mean_line,) = [l for l in ax.get_lines() if l.get_label() ==
                    "geometric mean"]
    np.testing.assert_allclose(mean_line.get_ydata(),
                               [want[(layout, 128)], want[(layout, 1024)]])
  assert plots.det_gemm_by_m_figure(rows[:0]) is None
