"""det_gemm's SM90 config choice (rlk_jax/_gemm_tuning.py) on the CPU: the
order of sources, ties, the on-disk cache under concurrent writers, the
switches. The kernels' timing itself runs on the device
(tests/test_cuda_ffi_gpu.py)."""

from __future__ import annotations

import json
import multiprocessing
import re

import pytest

import cuda_ffi
from cuda_ffi import build
from rlk_jax import _gemm_tuning as tuning

DEVICE = "NVIDIA Test GPU 80GB"


@pytest.fixture
def fake_library(monkeypatch, tmp_path):
  """cuda_ffi's measurement and analytic rule replaced by recorders; the
  cache in a fresh directory; the shipped tables as the test sets them."""
  monkeypatch.setenv("RLK_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("RLK_DET_GEMM_AUTOTUNE", raising=False)
  monkeypatch.delenv("RLK_DET_GEMM_TUNE_MAX_MB", raising=False)
  monkeypatch.delenv("RLK_DET_GEMM_TUNE_MAX_TFLOP", raising=False)
  calls = {"timed": [], "rule": []}
  times = {}

  def sustained_times(m, n, k, *, transpose_a, transpose_b, out_f32,
                      configs, **_):
    calls["timed"].append((m, n, k, transpose_a, transpose_b, out_f32))
    if isinstance(times.get("raise"), Exception):
      raise times["raise"]
    screen = {c: times.get(c, 1.0 + 0.1 * i) for i, c in enumerate(configs)}
    calls.setdefault("candidates", []).append(list(configs))
    # the screen's six fastest, timed again (times["hot"] where set)
    finalists = sorted(screen, key=screen.get)[:6]
    return screen, {c: times.get("hot", {}).get(c, screen[c])
                    for c in finalists}

  # The library's kernels: all of them (a whole build), unless a test sets
  # times["built"] to the configs built so far (a build still running).
  def built(config):
    return times.get("built") is None or config in times["built"] or (
        config == "split_256x192_128x256" and {
            "cooperative_256x192", "cooperative_128x256"} <= times["built"])

  def chosen_config(m, n, k, *, transpose_a=None, **_):
    calls["rule"].append((m, n, k))
    if transpose_a is None or built("pingpong_64x128"):
      return "pingpong_64x128"
    # the rule among what is built: here, the first built candidate
    return next((c for c in tuning.CANDIDATES if built(c)), None)

  monkeypatch.setattr(cuda_ffi, "sustained_times", sustained_times)
  monkeypatch.setattr(cuda_ffi, "chosen_config", chosen_config)
  monkeypatch.setattr(cuda_ffi, "build_id", lambda: "build0")
  monkeypatch.setattr(cuda_ffi, "kernel_built",
                      lambda ta, tb, f32, config: built(config))
  monkeypatch.setattr(cuda_ffi, "build_complete",
                      lambda: times.get("built") is None)
  monkeypatch.setattr(cuda_ffi, "generation",
                      lambda: len(times.get("built") or ()))
  monkeypatch.setattr(cuda_ffi, "want", lambda ta, tb, f32, config: calls[
      "wanted"].append(config))
  calls["wanted"] = []
  table_dir = tmp_path / "tables"
  table_dir.mkdir()
  monkeypatch.setattr(tuning, "TABLE_DIR", table_dir)

  def ship(device, entries):  # a shipped table, in the shipped format
    path = table_dir / f"det_gemm_sm90-{tuning.device_slug(device)}.json"
    path.write_text(json.dumps({"device": device, "entries": entries}))
    tuning.clear_memo()

  tuning.clear_memo()
  yield calls, times, ship
  tuning.clear_memo()


def choose(m, n=4096, k=4096, ta=False, tb=False, f32=False, **kw):
  return tuning.choose_config(m, n, k, transpose_a=ta, transpose_b=tb,
                              out_f32=f32, device=DEVICE, **kw)


def test_pick_fastest_and_ties_by_fixed_order():
  first, second = tuning.CANDIDATES[0], tuning.CANDIDATES[5]
  assert tuning.pick({first: 2.0, second: 1.0}) == second
  # within TIE of the fastest: the earlier candidate wins, whatever order
  # the times arrive in
  close = 1.0 * (1 + tuning.TIE / 2)
  assert tuning.pick({second: 1.0, first: close}) == first
  assert tuning.pick({first: close, second: 1.0}) == first
  assert tuning.pick({first: None, second: 3.0}) == second
  with pytest.raises(ValueError):
    tuning.pick({first: None})


def test_the_sustained_times_choose_and_both_are_kept(fake_library):
  # The screen's fastest loses on a card held at its power cap: the choice
  # goes by the sustained times, and the cache keeps both.
  calls, times, _ = fake_library
  first, second = tuning.CANDIDATES[3], tuning.CANDIDATES[7]
  times.update({first: 0.5, second: 0.6, "hot": {first: 0.9, second: 0.7}})
  assert choose(2000) == second
  entry = json.loads(tuning.cache_path(DEVICE, "build0").read_text())[
      "entries"]["000 2048 4096 4096"]
  assert entry["config"] == second
  assert entry["ms"][first] == 0.5 and len(entry["ms"]) == len(
      tuning.CANDIDATES)
  assert entry["sustained_ms"][first] == 0.9
  assert len(entry["sustained_ms"]) == 6


def test_a_kept_choice_replaces_the_tuners_and_keeps_its_times(fake_library):
  # The sweep's own timing of the tuner's fastest configs overrides its
  # pick: in this process at once, and in the cache a table is written from.
  calls, times, _ = fake_library
  first, second = tuning.CANDIDATES[3], tuning.CANDIDATES[7]
  times.update({first: 0.5, second: 0.6})
  assert choose(700) == first
  signature = dict(transpose_a=False, transpose_b=False, out_f32=False,
                   device=DEVICE)
  tuned = tuning.tuned_entry(700, 4096, 4096, **signature)
  assert tuned["config"] == first and tuned["ms"][second] == 0.6
  tuning.keep_choice(700, 4096, 4096, config=second,
                     sweep_ms={first: 0.8, second: 0.7}, **signature)
  assert choose(700) == second
  tuning.clear_memo()
  assert choose(700) == second and len(calls["timed"]) == 1
  kept = tuning.tuned_entry(700, 4096, 4096, **signature)
  assert kept["ms"] == tuned["ms"] and kept["sweep_ms"][first] == 0.8
  assert tuning.tuned_entry(701 + 128, 4096, 4096, **signature) is None
  with pytest.raises(ValueError, match="no_such_config"):
    tuning.keep_choice(700, 4096, 4096, config="no_such_config", **signature)


def test_m_bucket_keeps_tile_counts_apart():
  assert [tuning.m_bucket(m) for m in (1, 16, 17, 64, 65, 128, 129, 1024,
                                       4096, 4097, 16384)] == [
      16, 16, 32, 64, 128, 128, 256, 1024, 4096, 5120, 16384]
  assert tuning.product_key(1000, 3584, 3584, False, True, True) == (
      "011 1024 3584 3584")


def test_tunes_once_then_reads_the_disk_cache(fake_library, tmp_path):
  calls, times, _ = fake_library
  times["pingpong_128x128"] = 0.5
  assert choose(1000) == "pingpong_128x128"
  assert choose(1010) == "pingpong_128x128"  # same bucket: memo
  assert len(calls["timed"]) == 1 and calls["rule"] == []
  path = tuning.cache_path(DEVICE, "build0")
  entry = json.loads(path.read_text())["entries"]["000 1024 4096 4096"]
  assert entry["config"] == "pingpong_128x128" and entry["m"] == 1000
  assert entry["ms"]["pingpong_128x128"] == 0.5
  # a new process (memo gone) reads the file and measures nothing
  tuning.clear_memo()
  times["raise"] = RuntimeError("must not time again")
  assert choose(1020) == "pingpong_128x128"
  assert len(calls["timed"]) == 1
  # another layout, dtype or build is another product
  times.pop("raise")
  choose(1000, ta=True)
  choose(1000, f32=True)
  assert len(calls["timed"]) == 3


def test_shipped_table_before_tuning_nearest_after(fake_library):
  calls, _, ship = fake_library
  ship(DEVICE, {"000 1024 4096 4096": "cooperative_256x128",
                "000 4096 4096 4096": "cooperative_256x192"})
  assert choose(1000) == "cooperative_256x128"  # exact bucket: no timing
  assert calls["timed"] == []
  # no exact bucket and no tuning: the nearest M measured for this shape
  assert choose(3000, may_tune=False) == "cooperative_256x192"
  assert choose(1500, may_tune=False) == "cooperative_256x128"
  # no entry for this shape at all: the analytic rule
  assert choose(3000, n=1024, may_tune=False) == "pingpong_64x128"
  assert calls["rule"] == [(3000, 1024, 4096)]
  assert calls["timed"] == []


def test_no_tuning_inside_a_capture_and_no_memo_of_the_fallback(fake_library):
  calls, _, _ = fake_library
  assert choose(1000, may_tune=False) == "pingpong_64x128"
  assert calls["timed"] == []
  # the fallback was not kept: outside the capture the product is measured
  assert choose(1000) != "pingpong_64x128" or calls["timed"]
  assert len(calls["timed"]) == 1


def test_products_met_unmeasured_are_tuned_at_the_next_call_that_may(
    fake_library):
  # A jit trace or a CUDA-graph capture never measures: its products are
  # kept, and tuned when a call outside any trace comes (or when asked).
  calls, _, _ = fake_library
  assert choose(1000, may_tune=False) == "pingpong_64x128"
  assert choose(3000, n=1024, may_tune=False) == "pingpong_64x128"
  assert calls["timed"] == []
  choose(50, n=2048)  # another product, untraced: the two are tuned first
  assert calls["timed"] == [(1000, 4096, 4096, False, False, False),
                            (3000, 1024, 4096, False, False, False),
                            (50, 2048, 4096, False, False, False)]
  # the next trace takes the tuned choice, without measuring again
  assert choose(1000, may_tune=False) == tuning.CANDIDATES[0]
  assert tuning.tune_pending() == 0 and len(calls["timed"]) == 3
  choose(5000, may_tune=False)
  assert tuning.tune_pending() == 1 and len(calls["timed"]) == 4


def test_a_jit_trace_never_measures(fake_library, monkeypatch):
  import jax
  import jax.numpy as jnp
  from rlk_jax import _det_gemm
  seen = []

  def choose_config(m, n, k, *, may_tune=True, **_):
    seen.append(may_tune)
    return "pingpong_64x128"

  monkeypatch.setattr(tuning, "choose_config", choose_config)
  monkeypatch.setattr(cuda_ffi, "matmul", lambda a, b, **_: a @ b)
  a, b = jnp.ones((3, 8), jnp.bfloat16), jnp.ones((8, 5), jnp.bfloat16)
  run = lambda a, b: _det_gemm._cuda_ffi_matmul(a, b, False, False,
                                                jnp.bfloat16)
  jax.jit(run)(a, b)
  run(a, b)
  assert seen == [False, True]


def test_switch_off_and_memory_limit(fake_library, monkeypatch):
  calls, _, _ = fake_library
  monkeypatch.setenv("RLK_DET_GEMM_AUTOTUNE", "0")
  assert choose(1000) == "pingpong_64x128"
  monkeypatch.setenv("RLK_DET_GEMM_AUTOTUNE", "1")
  tuning.clear_memo()
  monkeypatch.setenv("RLK_DET_GEMM_TUNE_MAX_MB", "1")  # 4096x4096 bf16: 32 MB
  assert choose(1000) == "pingpong_64x128"
  assert calls["timed"] == []
  tuning.clear_memo()
  monkeypatch.setenv("RLK_DET_GEMM_TUNE_MAX_MB", "2048")
  choose(1000)
  assert len(calls["timed"]) == 1


def test_time_limit_leaves_large_products_to_table_and_rule(fake_library,
                                                            monkeypatch):
  # The default 1.0 TFLOP: 8192 x 28672 x 8192 (3.8 TFLOP) is not measured,
  # 1024 x 28672 x 8192 (0.48 TFLOP) is.
  calls, _, ship = fake_library
  assert choose(8192, n=28672, k=8192) == "pingpong_64x128"
  assert calls["timed"] == []
  choose(1024, n=28672, k=8192)
  assert calls["timed"] == [(1024, 28672, 8192, False, False, False)]
  # a shipped measurement of that shape at another M answers instead
  ship(DEVICE, {"000 4096 28672 8192": "cooperative_256x192"})
  assert choose(8192, n=28672, k=8192) == "cooperative_256x192"
  monkeypatch.setenv("RLK_DET_GEMM_TUNE_MAX_TFLOP", "4")
  tuning.clear_memo()
  choose(8000, n=28672, k=8192)
  assert len(calls["timed"]) == 2


def test_failed_tuning_falls_back_and_is_not_retried(fake_library, caplog):
  calls, times, _ = fake_library
  times["raise"] = RuntimeError("cannot allocate the operands")
  assert choose(1000) == "pingpong_64x128"
  assert choose(1000) == "pingpong_64x128"
  assert len(calls["timed"]) == 1
  assert "tuning of 000 1024 4096 4096 failed" in caplog.text
  assert not tuning.cache_path(DEVICE, "build0").exists()


def test_unreadable_cache_is_ignored(fake_library, caplog):
  calls, _, _ = fake_library
  path = tuning.cache_path(DEVICE, "build0")
  path.parent.mkdir(parents=True)
  path.write_text("{not json")
  choose(1000)
  assert len(calls["timed"]) == 1
  assert "ignoring unreadable tuning cache" in caplog.text
  assert "000 1024 4096 4096" in json.loads(path.read_text())["entries"]


def _write_entries(args):
  path, start = args
  cache = tuning.DiskCache(path)
  for i in range(start, start + 25):
    cache.put(f"000 {128 * (i + 1)} 64 64", {"config": f"c{i}", "m": i,
                                            "ms": {f"c{i}": 1.0}})


def test_concurrent_writers_lose_nothing(tmp_path):
  path = tmp_path / "cache.json"
  with multiprocessing.get_context("spawn").Pool(4) as pool:
    pool.map(_write_entries, [(path, 25 * w) for w in range(4)])
  entries = json.loads(path.read_text())["entries"]
  assert len(entries) == 100
  assert {e["config"] for e in entries.values()} == {f"c{i}" for i in range(100)}


def test_candidates_are_every_library_config():
  assert set(tuning.CANDIDATES) | set(tuning.NOT_YET_DEVICE_TESTED) == (
      set(cuda_ffi.CONFIGS) - {"auto"})
  assert not set(tuning.CANDIDATES) & set(tuning.NOT_YET_DEVICE_TESTED)
  assert len(set(tuning.CANDIDATES)) == len(tuning.CANDIDATES)


def test_config_names_match_the_header_codes():
  # cuda_ffi.CONFIGS names the header's GemmConfig codes: a renumbering on
  # either side would make names launch other kernels.
  header = build.KERNEL_HEADER.read_text()
  codes = {name: int(code) for name, code in
           re.findall(r"^\s*(k\w+) = (\d+),", header, re.M)}
  camel = lambda name: "k" + "".join(p.capitalize() for p in name.split("_"))
  names = {camel(n): code for n, code in cuda_ffi.CONFIGS.items()}
  names["kSplit256x192And128x256"] = names.pop("kSplit256x192128x256")
  assert names == codes
  # and the build compiles every one-kernel config
  assert set(build.kernel_configs().values()) == (
      set(cuda_ffi.CONFIGS.values()) - {0, cuda_ffi.CONFIGS[
          "split_256x192_128x256"]})


def test_shipped_tables_name_real_configs():
  from pallas_kernels import det_matmul, det_matmul_mgpu
  paths = sorted(tuning.TABLE_DIR.glob("*.json"))
  assert any(p.name.startswith("det_gemm_sm90-nvidia-h100") for p in paths)
  for path in paths:
    table = json.loads(path.read_text())
    assert table["entries"], path
    sm90 = path.name.startswith("det_gemm_sm90-")
    names = (tuning.CANDIDATES if sm90
             else tuple(det_matmul_mgpu.CONFIGS)
             if path.name.startswith("det_gemm_mosaic_gpu-")
             else tuple(det_matmul.NAMED_CONFIGS))
    layout = r"[01]{3}" if sm90 else r"[01]{2}2"
    for key, config in table["entries"].items():
      assert re.fullmatch(layout + r" \d+ \d+ \d+", key), (path, key)
      assert config in names, (path, key, config)


def test_pallas_choice_table_then_rule(fake_library, monkeypatch):
  from pallas_kernels import det_matmul
  import jax.numpy as jnp
  table_dir = tuning.TABLE_DIR
  (table_dir / f"det_gemm_pallas-{tuning.device_slug(DEVICE)}.json").write_text(
      json.dumps({"entries": {"002 1024 4096 4096": "64x128"}}))
  tuning.clear_memo()
  pick = lambda m, n=4096, dtype=jnp.bfloat16: tuning.choose_pallas_config(
      m, n, 4096, transpose_a=False, transpose_b=False, dtype=dtype,
      device=DEVICE)
  assert pick(1000) is det_matmul.NAMED_CONFIGS["64x128"]
  assert pick(1000, dtype=jnp.float16) is det_matmul.NAMED_CONFIGS["64x128"]
  assert pick(4000) is det_matmul.NAMED_CONFIGS["64x128"]  # nearest M
  # another shape, or f32 (one config): det_matmul's rule
  assert pick(4000, n=8192) is det_matmul.choose_config(4000, 8192, jnp.bfloat16)
  assert pick(1000, dtype=jnp.float32) is det_matmul.DEFAULT_CONFIG


def test_mosaic_choice_table_then_rule(fake_library):
  from pallas_kernels import det_matmul_mgpu
  (tuning.TABLE_DIR / f"det_gemm_mosaic_gpu-{tuning.device_slug(DEVICE)}.json"
   ).write_text(json.dumps({"entries": {"012 1024 6144 4096": "64x256"}}))
  tuning.clear_memo()
  pick = lambda m, n=6144: tuning.choose_mosaic_config(
      m, n, 4096, transpose_a=False, transpose_b=True, device=DEVICE,
      num_sms=132)
  assert pick(1000) is det_matmul_mgpu.CONFIGS["64x256"]
  assert pick(1900) is det_matmul_mgpu.CONFIGS["64x256"]  # nearest M
  # a factor of two or more from every measured M: the waves rule
  assert pick(3000) is det_matmul_mgpu.choose_config(3000, 6144, 132)
  assert pick(3000) is not det_matmul_mgpu.CONFIGS["64x256"]
  assert pick(500) is det_matmul_mgpu.choose_config(500, 6144, 132)
  # another shape: the waves rule (one wave of 64 clusters of two 128x256
  # tiles; 6144 columns: one wave of 128 256x192 tiles, not two of 128x256)
  assert pick(1024, n=4096) is det_matmul_mgpu.choose_config(1024, 4096, 132)
  assert pick(1024, n=4096) is det_matmul_mgpu.CONFIGS["128x256_c2m"]
  tuning.clear_memo()
  (tuning.TABLE_DIR / f"det_gemm_mosaic_gpu-{tuning.device_slug(DEVICE)}.json"
   ).write_text(json.dumps({"entries": {}}))
  assert pick(1024) is det_matmul_mgpu.CONFIGS["256x192"]


def test_trial_configs_come_from_the_tuners_two_timings(fake_library):
  # What a caller's own calls try (rlk_torch_bridge._in_situ): the tuner's
  # choice first, then its three fastest finalists and screen entries; a
  # product it never measured tries the large-M list; once a trial was
  # kept, only its choice.
  _, times, ship = fake_library
  signature = dict(transpose_a=False, transpose_b=True, out_f32=False,
                   device=DEVICE)
  fast = tuning.CANDIDATES[5:9]
  times.update({fast[0]: 0.5, fast[1]: 0.6, fast[2]: 0.7, fast[3]: 0.65,
                "hot": {fast[0]: 0.9, fast[1]: 0.8, fast[2]: 0.85,
                        fast[3]: 0.95}})
  chosen = tuning.choose_config(700, 4096, 4096, **signature)
  assert chosen == fast[1]  # the finalists' fastest
  trials = tuning.trial_configs(700, 4096, 4096, chosen=chosen, **signature)
  assert trials == [fast[1], fast[2], fast[0], fast[3]]
  assert tuning.trial_configs(700, 4096, 4096, chosen=chosen, limit=2,
                              **signature) == [fast[1], fast[2]]
  tuning.keep_choice(700, 4096, 4096, config=fast[2],
                     in_situ_ms={fast[2]: 0.4, fast[1]: 0.5}, **signature)
  assert tuning.trial_configs(700, 4096, 4096, chosen=fast[2],
                              **signature) == [fast[2]]
  untuned = tuning.trial_configs(70000, 4096, 4096, chosen="pingpong_64x128",
                                 **signature)
  assert untuned == ["pingpong_64x128", *tuning.LARGE_M_TRIALS]
  assert set(tuning.LARGE_M_TRIALS) <= set(tuning.CANDIDATES)


def test_while_the_build_runs_only_built_kernels_are_chosen(fake_library):
  # A build still adding kernels (cuda_ffi.build): the table's config not
  # built yet -> None (det_gemm runs another implementation, the same bits)
  # until it arrives; the tuner times only what is built and is asked again
  # once the build is whole; the rule chooses among what is built.
  calls, times, ship = fake_library
  ship(DEVICE, {"000 128 4096 4096": "cooperative_128x192"})
  times["built"] = {"pingpong_128x128"}
  assert choose(128) is None
  assert not calls["timed"]
  assert calls["wanted"] == ["cooperative_128x192"]  # compiled next
  times["built"] = {"pingpong_128x128", "cooperative_128x192"}
  assert choose(128) == "cooperative_128x192"
  # No table entry: tuned among the built configs only.
  times["built"] = {"pingpong_128x128", "cooperative_256x192"}
  assert choose(512) in times["built"]
  assert set(calls["candidates"][-1]) == times["built"]
  tuned = tuning.tuned_entry(512, 4096, 4096, transpose_a=False,
                             transpose_b=False, out_f32=False, device=DEVICE)
  assert tuned["partial_build"]
  times["built"] = None  # the build is whole: tuned again, on every config
  assert choose(512) == tuning.CANDIDATES[0]
  assert set(calls["candidates"][-1]) == set(tuning.CANDIDATES)
  assert len(calls["timed"]) == 2
  # Not tunable (inside a capture): the rule among the built kernels.
  times["built"] = {"swap_pingpong_64x32"}
  assert choose(4, n=1024, may_tune=False) == "swap_pingpong_64x32"
  times["built"] = set()
  assert choose(8, n=1024, may_tune=False) is None


def test_a_table_config_the_build_left_out_takes_the_rules_choice(
    fake_library):
  calls, times, ship = fake_library
  ship(DEVICE, {"000 128 4096 4096": "pingpong_64x320"})
  times["built"] = None
  import cuda_ffi
  original = cuda_ffi.kernel_built
  try:
    cuda_ffi.kernel_built = lambda ta, tb, f32, c: c != "pingpong_64x320"
    assert choose(128) == "pingpong_64x128"
  finally:
    cuda_ffi.kernel_built = original


def test_shipped_tables_name_only_configs_the_build_makes():
  # The tables were pruned with the build (build.BUILD_CONFIGS): every entry
  # names a config compiled for its layout, so a whole build runs them all.
  for path in sorted(tuning.TABLE_DIR.glob("det_gemm_sm90-*.json")):
    for key, config in json.loads(path.read_text())["entries"].items():
      layout = tuple(int(c) for c in key.split()[0])
      names = (("cooperative_256x192", "cooperative_128x256")
               if config == "split_256x192_128x256" else (config,))
      for name in names:
        assert name in build.BUILD_CONFIGS[layout], (path.name, key, config)
