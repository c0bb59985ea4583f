"""Which SM90 kernel config runs a det_gemm product, chosen by measurement.

Every config walks K in the same order (k16 MMA after k16 MMA, whatever its
K tile) into one f32 accumulator, and
the device tests prove them bit-identical, so choosing one is a speed
decision only: two processes may choose differently and still agree on
every bit. The choice for a product (layout, output dtype, M bucket, N, K)
on this device comes from, in order:

1. this process's memo;
2. the on-disk cache of earlier tuning on this device and library build
   (``$RLK_CACHE_DIR`` or ``~/.cache/rlk``, ``det_gemm_tuning/``);
3. the table shipped for this device (``rlk_jax/tuned/``, built from the
   ``det_gemm_sweep`` benchmark) at this M bucket;
4. tuning now: ``cuda_ffi.sustained_times`` times every candidate on the
   library's own buffers and stream (the caller's streams are never used or
   synchronized), then its fastest few again on a card held at its power
   cap, as a user's step runs them; the fastest of those goes to the
   on-disk cache. Only where
   allowed: ``RLK_DET_GEMM_AUTOTUNE`` is not ``0``, the caller is neither
   recording a CUDA graph nor tracing a ``jax.jit`` (such a product takes
   5. or 6. and is tuned at the next call that may measure, or by
   :func:`tune_pending`), the operands fit ``RLK_DET_GEMM_TUNE_MAX_MB``
   (default 2048) and the product is at most ``RLK_DET_GEMM_TUNE_MAX_TFLOP``
   (default 1.0: the screen runs each candidate about five times, about
   0.25-0.3 s per TFLOP of the product on the H100; the sustained stage
   adds at most about 0.25 s, and 0.3 s of heating unless a tuning ended
   less than a second ago; so a new shape's forward, dA and dB products,
   tuned one after another by the torch bridge, take at most about
   0.3 + 3 x (0.3 + 0.25) = 1.95 s; larger products fill their waves with
   the big tiles the table and the rule choose well);
5. the shipped table's nearest M bucket for this (layout, N, K);
6. the library's analytic rule (waves and tile-slot waste,
   ``cuda_ffi.chosen_config``).

Ties go by a fixed order: the first candidate of :data:`CANDIDATES` within
:data:`TIE` of the fastest wins, so equal measurements give equal choices.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pathlib
import re
import tempfile
import threading

_log = logging.getLogger("rlk.det_gemm_tuning")

# Every device-tested one-kernel config and the two-kernel split, in the
# tie-break order: the configs the analytic rule has long used first.
CANDIDATES = ("cooperative_128x256", "cooperative_256x192",
              "split_256x192_128x256", "pingpong_128x128",
              "cooperative_128x128", "cooperative_256x128",
              "cooperative_128x192", "cooperative_128x256_cluster_1x2",
              "pingpong_64x256", "pingpong_64x128", "pingpong_64x64",
              "pingpong_64x32", "swap_pingpong_64x32",
              "pingpong_64x128_cluster_2x1", "pingpong_64x64_cluster_2x1",
              "pingpong_64x128_cluster_4x2", "pingpong_64x64_cluster_1x2",
              "cooperative_128x320", "pingpong_64x320_cluster_2x1",
              "pingpong_128x96_cluster_2x4", "pingpong_128x128_cluster_1x2",
              "swap_cooperative_256x192_cluster_1x2", "cooperative_128x96",
              "pingpong_64x320", "cooperative_128x128_cluster_1x1",
              "cooperative_128x320_k32", "cooperative_128x192_cluster_1x2",
              "cooperative_128x96_cluster_1x2", "cooperative_128x144",
              "cooperative_128x160", "cooperative_128x224",
              "cooperative_128x80", "cooperative_128x144_cluster_1x2",
              "pingpong_192x128_cluster_2x1", "pingpong_192x96_cluster_2x1",
              "swap_cooperative_128x192_cluster_1x2")
# Configs the library has but the autotuner does not time yet: compiled, not
# yet proven bit-identical on a device. They join CANDIDATES (at the end of
# the tie order) once the device tests have run them.
NOT_YET_DEVICE_TESTED: tuple[str, ...] = ()
# Within 1% of the fastest counts as a tie (run-to-run noise on the H100 is
# about that).
TIE = 0.01
TABLE_DIR = pathlib.Path(__file__).resolve().parent / "tuned"

_lock = threading.Lock()
_memo: dict[tuple, str] = {}
# The cuda_ffi.generation() the memo's choices were made at.
_memo_generation = [0]
# Products whose tuning failed in this process (no memory, say): not retried.
_untunable: set[tuple] = set()
# Products first met where no measuring is allowed (a jit trace, a CUDA-graph
# capture), by memo key: tuned at the next call that may measure, or by
# tune_pending().
_pending: dict[tuple, tuple] = {}


def m_bucket(m: int) -> int:
  """The M a choice is kept under: a config's speed moves with the number
  of row tiles, so buckets are a tile (or less) apart where that number is
  small, coarser where a wave holds many tiles."""
  if m <= 64:
    return -(-m // 16) * 16
  if m <= 4096:
    return -(-m // 128) * 128
  return -(-m // 1024) * 1024


def product_key(m, n, k, transpose_a, transpose_b, out_f32) -> str:
  return (f"{int(transpose_a)}{int(transpose_b)}{int(out_f32)} "
          f"{m_bucket(m)} {n} {k}")


def device_slug(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def pick(times: dict[str, float | None], candidates=None) -> str:
  """The config to keep from measured times: the first of `candidates`
  (default :data:`CANDIDATES`, read when called) within TIE of the fastest
  (a fixed order settles ties)."""
  candidates = CANDIDATES if candidates is None else candidates
  measured = {c: t for c, t in times.items() if t is not None and t > 0}
  if not measured:
    raise ValueError("no config was measured")
  fastest = min(measured.values())
  order = [c for c in candidates if c in measured] + sorted(
      c for c in measured if c not in candidates)
  return next(c for c in order if measured[c] <= fastest * (1 + TIE))


def _autotune_enabled() -> bool:
  return os.environ.get("RLK_DET_GEMM_AUTOTUNE", "1") != "0"


def _tune_max_bytes() -> int:
  return int(float(os.environ.get("RLK_DET_GEMM_TUNE_MAX_MB", "2048")) * 2**20)


def _tune_max_flops() -> float:
  return float(os.environ.get("RLK_DET_GEMM_TUNE_MAX_TFLOP", "1.0")) * 1e12


def cache_path(device: str, build: str) -> pathlib.Path:
  root = os.environ.get("RLK_CACHE_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlk")
  return (pathlib.Path(root) / "det_gemm_tuning"
          / f"{device_slug(device)}-{build}.json")


class DiskCache:
  """Tuning results of one device and library build, in one JSON file.

  Safe under concurrent processes: a writer holds an exclusive lock on a
  side file, re-reads, merges and replaces the file atomically, so readers
  see either the old or the new file and no writer's entries are lost.
  """

  def __init__(self, path: pathlib.Path):
    self.path = path
    self._entries: dict[str, dict] | None = None

  def get(self, key: str) -> str | None:
    if self._entries is None:
      self._entries = self._read()
    entry = self._entries.get(key)
    return entry["config"] if entry else None

  def entry(self, key: str) -> dict | None:
    """The whole entry as the file has it now (choice and times)."""
    return self._read().get(key)

  def put(self, key: str, entry: dict, merge: bool = False) -> None:
    """Writes `entry` under `key`; `merge` keeps the fields of the entry
    already there that `entry` does not name (read under the lock, so a
    concurrent writer's fields survive too)."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(self.path.with_suffix(".lock")):
      entries = self._read()
      entries[key] = {**entries.get(key, {}), **entry} if merge else entry
      fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump({"entries": entries}, f, indent=0, sort_keys=True)
      os.replace(tmp, self.path)
    self._entries = entries

  def _read(self) -> dict[str, dict]:
    try:
      with open(self.path) as f:
        return dict(json.load(f).get("entries", {}))
    except FileNotFoundError:
      return {}
    except (OSError, ValueError) as e:  # a damaged cache is only lost time
      _log.warning("rlk: ignoring unreadable tuning cache %s: %s", self.path, e)
      return {}


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  import fcntl
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


class Table:
  """A shipped table: {product key: config} for one device."""

  def __init__(self, entries: dict[str, str]):
    self.entries = entries
    # (layout, N, K) -> sorted [(M bucket, config)] for the nearest lookup.
    self._by_shape: dict[tuple, list] = {}
    for key, config in entries.items():
      layout, m, n, k = key.split()
      self._by_shape.setdefault((layout, n, k), []).append((int(m), config))
    for rows in self._by_shape.values():
      rows.sort()

  def exact(self, key: str) -> str | None:
    return self.entries.get(key)

  def nearest(self, key: str, within: float = float("inf")) -> str | None:
    """The entry of the nearest M (in ratio; the larger on a tie) measured
    for this layout, N and K, if that M is less than a factor 2**within
    away."""
    layout, m, n, k = key.split()
    rows = self._by_shape.get((layout, n, k))
    if not rows:
      return None
    m = int(m)
    octaves, _, config = min((abs(_log2(r[0]) - _log2(m)), -r[0], r[1])
                             for r in rows)
    return config if octaves < within else None


def _log2(x: int) -> float:
  import math
  return math.log2(max(x, 1))


@functools.cache
def _shipped(kind: str, device: str) -> Table:
  """The table `kind` ("det_gemm_sm90", "det_gemm_pallas",
  "det_gemm_mosaic_gpu") shipped for
  `device`, empty when there is none or RLK_DET_GEMM_TUNED_TABLES=0 (the
  sweep re-measuring what a table would answer)."""
  if os.environ.get("RLK_DET_GEMM_TUNED_TABLES", "1") == "0":
    return Table({})
  path = TABLE_DIR / f"{kind}-{device_slug(device)}.json"
  try:
    with open(path) as f:
      return Table(json.load(f)["entries"])
  except FileNotFoundError:
    return Table({})


def shipped_table(device: str) -> Table:
  return _shipped("det_gemm_sm90", device)


@functools.cache
def _device_name() -> str:
  import jax
  return jax.devices("gpu")[0].device_kind


@functools.cache
def _disk_cache(device: str, build: str) -> DiskCache:
  return DiskCache(cache_path(device, build))


def choose_config(m: int, n: int, k: int, *, transpose_a: bool,
                  transpose_b: bool, out_f32: bool, may_tune: bool = True,
                  device: str | None = None) -> str | None:
  """The SM90 config for this product on this device (see the module doc).
  `may_tune=False` (inside a CUDA-graph capture, say) never measures.

  While a build still adds kernels (cuda_ffi.build_complete() is False),
  only built configs are chosen: the tuner times those alone, the rule
  chooses among them, and where the cache or a table names one not built
  yet, None: the caller runs another implementation (every one gives the
  same bits) until it arrives. Choices are made again as kernels arrive,
  and a choice the tuner made among part of the kernels is tuned again
  once the build is whole."""
  import cuda_ffi
  if m == 0:
    return "auto"
  device = device or _device_name()
  key = product_key(m, n, k, transpose_a, transpose_b, out_f32)
  memo_key = (device, key)
  if may_tune and _pending:
    tune_pending()
  generation = cuda_ffi.generation()
  complete = cuda_ffi.build_complete()
  built = functools.partial(cuda_ffi.kernel_built, transpose_a, transpose_b,
                            out_f32)
  with _lock:
    if _memo_generation[0] != generation:
      _memo.clear()
      _memo_generation[0] = generation
    if memo_key in _memo:
      return _memo[memo_key]
    cache = _disk_cache(device, cuda_ffi.build_id())
    table = shipped_table(device)
    config = cache.get(key)
    if (config is not None and complete and may_tune
        and _tuned_on_part(cache.entry(key))
        and _tunable(memo_key, m, n, k, out_f32)):
      config = None  # tuned while the build ran: tuned again, on all
    config = config or table.exact(key)
    if config is None and _tunable(memo_key, m, n, k, out_f32):
      if may_tune:
        config = _tune(cache, key, memo_key, m, n, k, transpose_a,
                       transpose_b, out_f32, complete)
      else:
        _pending[memo_key] = (m, n, k, transpose_a, transpose_b, out_f32)
    if config is None:
      config = table.nearest(key) or cuda_ffi.chosen_config(
          m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
          out_f32=out_f32)
    if config is not None and not built(config):
      # What the whole build would run is not here yet: the build is asked
      # to compile it next. Once the build is whole (a config it left
      # out), the rule's choice among what it built.
      if not complete:
        cuda_ffi.want(transpose_a, transpose_b, out_f32, config)
      config = cuda_ffi.chosen_config(
          m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
          out_f32=out_f32) if complete else None
    if config is None or not may_tune:
      return config  # not kept: a later kernel, or a measurement, may move it
    _memo[memo_key] = config
    return config


def tune_pending() -> int:
  """Tunes the products first met where nothing may be measured (traced by
  `jax.jit`, recorded into a CUDA graph), which ran the shipped table's
  nearest bucket or the analytic rule meanwhile; returns how many were
  tuned. Later traces and plans take the tuned choice (the same bits: a
  speed choice only). The first call allowed to measure (an untraced
  det_gemm, the torch bridge's eager call) runs this itself; a JAX program
  that only ever runs jitted calls it between its first step and the rest
  (``rlk_jax.det_gemm_tune_pending()``), then traces again."""
  with _lock:
    pending = list(_pending.items())
    _pending.clear()
  for (device, _), (m, n, k, transpose_a, transpose_b, out_f32) in pending:
    choose_config(m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
                  out_f32=out_f32, device=device)
  return len(pending)


def _tuned_on_part(entry: dict | None) -> bool:
  """Whether a cached tuning timed only part of the configs (a build was
  still adding kernels)."""
  return bool(entry and entry.get("partial_build"))


def _tunable(memo_key, m, n, k, out_f32) -> bool:
  operand_bytes = 2 * (m * k + k * n) + (4 if out_f32 else 2) * m * n
  return (_autotune_enabled() and memo_key not in _untunable
          and operand_bytes <= _tune_max_bytes()
          and 2 * m * n * k <= _tune_max_flops())


def _tune(cache, key, memo_key, m, n, k, transpose_a, transpose_b, out_f32,
          complete=True):
  import cuda_ffi
  candidates = [c for c in CANDIDATES
                if cuda_ffi.kernel_built(transpose_a, transpose_b, out_f32, c)]
  if not candidates:
    return None
  try:
    screen, sustained = cuda_ffi.sustained_times(
        m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
        out_f32=out_f32, configs=candidates)
    config = pick(sustained)
  except (RuntimeError, ValueError) as e:
    _log.warning("rlk: det_gemm tuning of %s failed (%s); using the table or "
                 "the analytic rule", key, e)
    _untunable.add(memo_key)
    return None
  try:
    cache.put(key, {"config": config, "m": m,
                    "ms": {c: t for c, t in screen.items() if t is not None},
                    "sustained_ms": sustained,
                    **({} if complete else {"partial_build": True})})
  except OSError as e:  # a read-only home: keep the choice for this process
    _log.warning("rlk: cannot write the det_gemm tuning cache: %s", e)
  return config


def tuned_entry(m: int, n: int, k: int, *, transpose_a: bool,
                transpose_b: bool, out_f32: bool,
                device: str | None = None) -> dict | None:
  """What the on-disk cache keeps for this product on this device and
  library build (the choice and the times behind it), or None."""
  import cuda_ffi
  key = product_key(m, n, k, transpose_a, transpose_b, out_f32)
  return _disk_cache(device or _device_name(), cuda_ffi.build_id()).entry(key)


# Configs that won large products (M = 16384) timed back to back, as a
# model's forward runs them (H200, 2026-11-27; benchmarks/results/
# nvidia-h200-2026-11-27/attention_in_place_gemm_in_situ-*/): what an
# untuned product's calls try besides the table's or the rule's choice.
LARGE_M_TRIALS = ("pingpong_128x128_cluster_1x2",
                  "pingpong_192x128_cluster_2x1",
                  "split_256x192_128x256", "cooperative_256x192",
                  "swap_cooperative_256x192_cluster_1x2")


def trial_configs(m: int, n: int, k: int, *, transpose_a: bool,
                  transpose_b: bool, out_f32: bool, chosen: str,
                  limit: int = 6, device: str | None = None) -> list[str]:
  """The configs worth timing in a caller's own calls of this product,
  `chosen` first: the tuner's fastest three by each of its two timings
  (its finalists on a heated card, its screen), or, for a product it did
  not measure, :data:`LARGE_M_TRIALS`. Just `chosen` once such a trial has
  been kept (an ``in_situ_ms`` entry) or where nothing else is known.

  Why: the tuner times a config alone; inside a model's forward the same
  kernels ran up to 10% apart from that ranking (H200, 2026-11-27), and
  every config gives the same bits, so a caller may time its own calls."""
  import cuda_ffi
  entry = tuned_entry(m, n, k, transpose_a=transpose_a,
                      transpose_b=transpose_b, out_f32=out_f32,
                      device=device) or {}
  if "in_situ_ms" in entry:
    return [chosen]
  ranked = []
  for times in (entry.get("sustained_ms"), entry.get("ms")):
    if times:
      ranked += sorted(times, key=times.get)[:3]
  if not entry.get("ms"):
    ranked += list(LARGE_M_TRIALS)
  out = [chosen]
  for c in ranked:
    if (c not in out and c in cuda_ffi.CONFIGS and len(out) < limit
        and cuda_ffi.kernel_built(transpose_a, transpose_b, out_f32, c)):
      out.append(c)
  return out


def keep_choice(m: int, n: int, k: int, *, transpose_a: bool,
                transpose_b: bool, out_f32: bool, config: str,
                device: str | None = None,
                **measured: dict[str, float]) -> None:
  """Keeps `config` as this product's choice, in the on-disk cache (the
  tuner's times stay in the entry beside `measured`, each a {config: ms})
  and in this process's memo: the det_gemm_sweep's own timing choosing
  among the tuner's fastest configs for the tables it writes."""
  import cuda_ffi
  if config not in cuda_ffi.CONFIGS:
    raise ValueError(f"unknown det_gemm SM90 config {config!r}")
  device = device or _device_name()
  key = product_key(m, n, k, transpose_a, transpose_b, out_f32)
  with _lock:
    _disk_cache(device, cuda_ffi.build_id()).put(
        key, {"m": m, **measured, "config": config}, merge=True)
    _memo[(device, key)] = config


def pallas_key(m, n, k, transpose_a, transpose_b) -> str:
  # 2-byte operands only (f16 and bf16 share tiles and tensor-core rate).
  return f"{int(transpose_a)}{int(transpose_b)}2 {m_bucket(m)} {n} {k}"


def choose_pallas_config(m: int, n: int, k: int, *, transpose_a: bool,
                         transpose_b: bool, dtype, device: str | None = None):
  """The Pallas det_matmul tile config (a ``MatmulConfig``) for this product
  on this GPU: the shipped table's measurement for this shape at this M
  bucket, else at the nearest M, else det_matmul's size rule. Every config
  gives the same bits (device-tested). Not tuned on first use: JAX runs a
  device's work on one stream, so timing candidates would wait on work the
  caller queued; the sweep measures them instead
  (``--sweep_pallas_configs``)."""
  import numpy as np
  from pallas_kernels import det_matmul
  if np.dtype(dtype).itemsize != 2:
    return det_matmul.choose_config(m, n, dtype)  # f32: one config
  config = _measured_tile(det_matmul.NAMED_CONFIGS, "det_gemm_pallas",
                          device, m, n, k, transpose_a, transpose_b)
  return config or det_matmul.choose_config(m, n, dtype)


def choose_chunked_config(m: int, n: int, k_chunk: int, *, transpose_a: bool,
                          transpose_b: bool, dtype, device: str | None = None):
  """The Triton tile config for the tensor-parallel mode's fused launch, in
  which every K chunk of every tile is its own program: at decode sizes the
  chunks already fill the SMs, so the tiles need not be narrow to spread a
  weight's bytes (the rule's 64x32 there). 64x128 was the fastest or
  within 6% of it at M = 1 and 8 for Llama-3-8B's projections, C = 4 and 8,
  and within 21% at M=64 (H200, 2026-11-29, ``benchmarks/results/
  nvidia-h200-2026-11-29/tensor_parallel_fused-e5c2dc8/``);
  above, one chunk's product is tiled as any product. Every config gives the
  same bits."""
  import numpy as np
  from pallas_kernels import det_matmul
  if m <= 64 and np.dtype(dtype).itemsize == 2:
    return det_matmul.NAMED_CONFIGS["64x128"]
  return choose_pallas_config(m, n, k_chunk, transpose_a=transpose_a,
                              transpose_b=transpose_b, dtype=dtype,
                              device=device)


def choose_mosaic_config(m: int, n: int, k: int, *, transpose_a: bool,
                         transpose_b: bool, device: str | None = None,
                         num_sms: int | None = None):
  """The Mosaic GPU det_matmul config (an ``MgpuConfig``) for this product:
  the shipped table's measurement for this shape at this M bucket, else at
  the nearest M less than a factor of two away, else the kernel's waves
  rule (none ships: a table needs every config compiled per product, about
  25 s for eight on the H100). Every config gives the same
  bits (device-tested); not tuned on first use, for the reason Pallas's
  tiles are not (``--sweep_mosaic_gpu_configs`` measures them)."""
  import jax
  from pallas_kernels import det_matmul_mgpu
  # A table measured at small M says nothing of a wave-filling product
  # twice as large: the rule's full-wave efficiencies answer there.
  config = _measured_tile(det_matmul_mgpu.CONFIGS, "det_gemm_mosaic_gpu",
                          device, m, n, k, transpose_a, transpose_b,
                          within_octaves=1)
  return config or det_matmul_mgpu.choose_config(
      m, n, num_sms or jax.devices()[0].core_count)


def _measured_tile(configs: dict, kind: str, device, m, n, k, transpose_a,
                   transpose_b, within_octaves: float = float("inf")):
  """The config a shipped `kind` table measured fastest for this shape at
  this M bucket, else at the nearest M less than a factor
  2**within_octaves away; None where it has none."""
  table = _shipped(kind, device or _device_name())
  key = pallas_key(m, n, k, transpose_a, transpose_b)
  return configs.get(table.exact(key) or table.nearest(key, within_octaves))


def clear_memo() -> None:
  """Forgets this process's choices (tests; a cache edited by hand)."""
  with _lock:
    _memo.clear()
    _untunable.clear()
    _pending.clear()
    _disk_cache.cache_clear()
    _shipped.cache_clear()
