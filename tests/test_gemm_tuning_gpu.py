"""det_gemm's autotuner on the device: it measures every config, never waits
on the caller's stream, never runs inside a CUDA-graph capture, and whatever
it picks, the bits are those of every other config. Run with
``pytest -m gpu``."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

import cuda_ffi
import rlk_jax
from rlk_jax import _gemm_tuning as tuning
from conftest import ON_GPU, assert_bitwise_equal, random_array

ON_SM90 = ON_GPU and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_SM90, reason="requires an SM90 GPU")]


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
  monkeypatch.setenv("RLK_CACHE_DIR", str(tmp_path))
  monkeypatch.setenv("RLK_DET_GEMM_TUNED_TABLES", "0")  # tune, not look up
  monkeypatch.delenv("RLK_DET_GEMM_AUTOTUNE", raising=False)
  tuning.clear_memo()
  yield tmp_path
  tuning.clear_memo()


def _entries():
  path = tuning.cache_path(tuning._device_name(), cuda_ffi.build_id())
  return json.loads(path.read_text())["entries"] if path.exists() else {}


@pytest.mark.parametrize("m,n,k,ta,tb,f32", [
    (1024, 3584, 3584, False, False, False),  # o at M=1024: the case
    (3000, 1000 * 8, 776, False, True, True),  # ragged, f32 out
    (256, 4096, 1024, True, False, False)])  # a weight gradient's layout
def test_every_candidate_is_timed(m, n, k, ta, tb, f32):
  times = cuda_ffi.time_configs(m, n, k, transpose_a=ta, transpose_b=tb,
                                out_f32=f32, configs=tuning.CANDIDATES)
  assert set(times) == set(tuning.CANDIDATES)
  # A config the library refuses for this layout is passed over (None), not
  # launched with a TMA descriptor the driver would not encode.
  # So is a config this build did not make for the layout (build.py's
  # BUILD_CONFIGS): the tuner chooses among the built ones.
  refused = set(cuda_ffi.B_NK_REFUSED) if tb else set()
  refused |= set(tuning.CANDIDATES) - set(cuda_ffi.built_configs(ta, tb, f32))
  assert all(times[c] is None for c in refused), times
  assert all(t is not None and 0 < t < 100 for c, t in times.items()
             if c not in refused), times
  assert len(refused) < len(times)
  # a named config sized for a 16-row decode tile is slower than 128x256 on
  # a product of many tiles: the timer measures work, not launch noise
  if m >= 1024 and not {"pingpong_64x32", "cooperative_128x256"} & refused:
    assert times["pingpong_64x32"] > times["cooperative_128x256"], times


def test_the_screens_fastest_are_timed_again_on_a_hot_card():
  screen, sustained = cuda_ffi.sustained_times(
      1024, 3584, 3584, transpose_a=False, transpose_b=False, out_f32=False,
      configs=tuning.CANDIDATES, finalists=4)
  assert set(screen) == set(tuning.CANDIDATES)
  ranked = sorted((t, c) for c, t in screen.items() if t)
  assert set(sustained) == {c for _, c in ranked[:4]}, (screen, sustained)
  # samples of ~10 ms, after as long untimed: the same work, so within a
  # factor of the screen's time, never the screen's number copied
  for c, t in sustained.items():
    assert 0.5 * screen[c] < t < 2.0 * screen[c] and t != screen[c], (c, t)


def test_tuning_never_waits_on_the_callers_stream():
  torch = pytest.importorskip("torch")
  torch.cuda.synchronize()
  # ~2 s of GPU sleep on the caller's (torch's current) stream
  torch.cuda._sleep(int(4e9))
  t0 = time.perf_counter()
  cuda_ffi.sustained_times(512, 2048, 2048, transpose_a=False,
                           transpose_b=False, out_f32=False,
                           configs=tuning.CANDIDATES)
  elapsed = time.perf_counter() - t0
  busy = not torch.cuda.current_stream().query()
  torch.cuda.synchronize()
  assert busy, "the caller's stream finished: the sleep was too short to tell"
  assert elapsed < 1.8, f"timing took {elapsed:.2f} s: did it wait on the sleep?"


def test_first_use_tunes_caches_and_keeps_bits(fresh_cache, rng):
  m, k, n = 1000, 3584, 3584
  a = random_array(rng, (m, k), jnp.bfloat16)
  b = random_array(rng, (k, n), jnp.bfloat16)
  got = jax.jit(lambda a, b: rlk_jax.det_gemm(a, b, implementation="cuda_ffi"))(a, b)
  key = tuning.product_key(m, n, k, False, False, False)
  # never inside the jit trace: tuned once asked, outside it
  assert key not in _entries()
  assert rlk_jax.det_gemm_tune_pending() >= 1
  entry = _entries()[key]
  assert entry["config"] == tuning.pick(entry["sustained_ms"])
  assert set(entry["ms"]) == set(cuda_ffi.built_configs(False, False, False))
  # the gradient's products (untraced: eager) were tuned in their own layouts
  jax.grad(lambda a, b: rlk_jax.det_gemm(a, b, implementation="cuda_ffi")
           .astype(jnp.float32).sum(), argnums=(0, 1))(a, b)
  assert tuning.product_key(m, k, n, False, True, False) in _entries()
  assert tuning.product_key(k, n, m, True, False, False) in _entries()
  # whatever was picked, the bits are every config's
  for config in ("cooperative_128x256", "pingpong_64x128", entry["config"]):
    want = cuda_ffi.matmul(a, b, transpose_a=False, transpose_b=False,
                           out_dtype=jnp.bfloat16, config=config)
    assert_bitwise_equal(got, want, config)


def test_no_tuning_inside_a_torch_capture(fresh_cache):
  torch = pytest.importorskip("torch")
  import rlk_torch_bridge
  a = torch.randn(777 * 8, 1024, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
  want = rlk_torch_bridge.det_gemm(a[:8], b)  # another shape, tuned eagerly
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    out = rlk_torch_bridge.det_gemm(a, b)
  graph.replay()
  torch.cuda.synchronize()
  keys = _entries()
  assert tuning.product_key(8, 2048, 1024, False, False, False) in keys
  assert tuning.product_key(777 * 8, 2048, 1024, False, False, False) not in keys
  # outside the capture the same signature is measured now
  again = rlk_torch_bridge.det_gemm(a, b)
  assert tuning.product_key(777 * 8, 2048, 1024, False, False, False) in _entries()
  assert torch.equal(again.view(torch.int16), out.view(torch.int16))
  assert torch.equal(out[:8].view(torch.int16), want.view(torch.int16))
