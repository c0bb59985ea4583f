"""CUDA C++ kernels behind XLA FFI custom calls: the SM90 (Hopper) det_gemm,
pack's metadata and row gather, and linear_logp's row kernels.

det_gemm: CUTLASS 3.x TMA warp-specialized GEMMs that walk K in order, one
k16 MMA after another into one f32 accumulator, a persistent tile scheduler
and no split-K: batch-invariant
like every rlk det_gemm. pack: the PackInfo of a mask (tile counts, a tile
scan, the fields) and the row gather every move is made of. Each also has a
plain C entry that the torch bridge launches on torch's stream. This module
finds (or builds, once, cached: see
``cuda_ffi.build``) the shared library, registers its FFI target with JAX, and
says why when it cannot. Importing it is always safe, with or without CUDA.

Arithmetic only: the contract (checks, custom_vjp, dispatch) is rlk_jax's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import threading
import time

import numpy as np

from cuda_ffi import build as _build
from cuda_ffi.gemm_configs import CONFIGS, kernel_parts  # noqa: F401 - API

FFI_TARGET = "rlk_det_gemm_sm90"
PACK_INFO_TARGET = "rlk_pack_info"
GATHER_ROWS_TARGET = "rlk_gather_rows"
PACK_ROWS_TARGET = "rlk_pack_rows"
LOGITS_STATS_TARGET = "rlk_logits_stats"
LOGITS_FINISH_TARGET = "rlk_logits_finish"
LOGITS_GRAD_TARGET = "rlk_logits_grad"
ATTENTION_FORWARD_TARGET = "rlk_attention_forward_sm90"
ATTENTION_DKDV_TARGET = "rlk_attention_dkdv_sm90"
TRITON_LAUNCH_TARGET = "rlk_triton_launch"
# det_attention's Hopper kernels: the head dims they take, the forward's tile
# rows (the Triton forward's, whose tile map it reads) and the backward's
# keys a tile (two of the Triton dK/dV kernel's 64-key programs).
ATTENTION_HEAD_DIMS = (64, 128)
ATTENTION_TILE_ROWS = 128
ATTENTION_DKDV_TILE_KEYS = 128
# Configs the library refuses for a B stored [N, K] (transpose_b): their TMA
# box of B would pass 256 rows (det_gemm_api.cc, LaunchOne says why). The
# autotuner's timer passes over them in that layout.
B_NK_REFUSED = ("pingpong_64x320",)
# The persistent scheduler's tile order (0: the library's choice).
SWIZZLES = (0, 1, 2, 4, 8)
RASTERS = (0, 1, 2)  # along M, along N

_log = logging.getLogger("rlk.cuda_ffi")
_lock = threading.Lock()
_state: dict = {}
# Kernels this process asked the running build for (want).
_wanted: set = set()


@functools.cache  # asked on every dispatch; the process's GPUs do not change
def sm90_reason() -> str | None:
  """None on a Hopper (SM90) GPU, else why not."""
  import jax
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return "no GPU visible to JAX"
  cc = getattr(gpus[0], "compute_capability", None)
  if cc != "9.0":
    return f"needs an SM90 (Hopper) GPU, found compute capability {cc}"
  return None


# How often a process looks for kernels a running build has added (and
# whether a build it waits for has made the main library).
RECHECK_S = 1.0


def _load() -> tuple[ctypes.CDLL | None, str | None]:
  """(library, None) or (None, why not), the kernels a running build has
  added since the last look included. On first use with the toolchain
  present and no library, starts the build in the background
  (RLK_CUDA_FFI_AUTOBUILD=0: never; RLK_CUDA_FFI_BACKGROUND_BUILD=0: in
  this process, waiting for it) and says so until the main library
  exists; it looks again at most every RECHECK_S seconds."""
  with _lock:
    lib = _state.get("lib")
    if lib is not None:
      _refresh(lib)
      return lib, None
    if time.monotonic() < _state.get("retry_at", 0.0):
      return None, _state["reason"]
    reason, retry_at = None, float("inf")
    try:
      path = _build.library_path()
      if path is None:
        if os.environ.get("RLK_CUDA_FFI_AUTOBUILD", "1") == "0":
          raise _build.BuildUnavailable(
              "the library is not built (run `python -m cuda_ffi.build`)")
        if os.environ.get("RLK_CUDA_FFI_BACKGROUND_BUILD", "1") == "0":
          path = _build.build(log=_log.warning)
        else:
          log = _build.start_background()
          reason = (f"cuda_ffi library unavailable: it is building in the "
                    f"background (`python -m cuda_ffi.build --status`; "
                    f"log {log})")
          retry_at = time.monotonic() + RECHECK_S
          if not _state.get("told"):
            _state["told"] = True
            _log.warning("rlk: %s. Until it is built, det_gemm runs on its "
                         "other implementations, which give the same bits",
                         reason)
      if path is not None:
        lib = _open(path)
    except AttributeError as e:  # a library built from older sources
      reason = (f"cuda_ffi library unavailable: it lacks an entry of these "
                f"sources ({e}); rebuild it")
    except (_build.BuildUnavailable, OSError, RuntimeError) as e:
      reason = f"cuda_ffi library unavailable: {e}"
    _state.update(lib=lib, reason=reason, retry_at=retry_at)
    return lib, reason


def _open(path) -> ctypes.CDLL:
  lib = ctypes.CDLL(str(path))
  _declare(lib)
  import jax
  for target, symbol in ((FFI_TARGET, lib.RlkDetGemmSm90),
                         (PACK_INFO_TARGET, lib.RlkPackInfo),
                         (GATHER_ROWS_TARGET, lib.RlkGatherRows),
                         (PACK_ROWS_TARGET, lib.RlkPackRows),
                         (LOGITS_STATS_TARGET, lib.RlkLogitsStats),
                         (LOGITS_FINISH_TARGET, lib.RlkLogitsFinish),
                         (LOGITS_GRAD_TARGET, lib.RlkLogitsGrad),
                         (ATTENTION_FORWARD_TARGET,
                          lib.RlkAttentionForwardSm90),
                         (ATTENTION_DKDV_TARGET, lib.RlkAttentionDkdvSm90),
                         (TRITON_LAUNCH_TARGET, lib.RlkTritonLaunch)):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol),
                                platform="CUDA")
  _state.update(kernels=set(), loaded=set(), generation=1, complete=False,
                next_scan=0.0, where=pathlib.Path(path).parent)
  _refresh(lib)
  return lib


def _refresh(lib) -> None:
  """Hands the library the kernels that arrived since the last look (at
  most every RECHECK_S seconds, never once the build is whole), and
  resumes a build that stopped part-way. Under _lock."""
  if _state["complete"] or time.monotonic() < _state["next_scan"]:
    return
  _state["next_scan"] = time.monotonic() + RECHECK_S
  where = _state["where"]
  # A new set, not the old one grown: readers (kernel_built, on any
  # thread, without the lock) see the old set or the new one whole.
  kernels = set(_state["kernels"])
  for path in _build.kernel_libraries(where):
    if path in _state["loaded"]:
      continue
    try:
      plugin = ctypes.CDLL(str(path))
    except OSError:  # removed as the build folded it into the whole one
      continue
    for variant, code in _build.kernels_in(path):
      if (*variant, code) in kernels:
        continue
      try:
        entry = getattr(plugin, _build.kernel_symbol(variant, code))
      except AttributeError:
        continue
      entry.restype = ctypes.c_void_p
      if lib.rlk_det_gemm_sm90_add_kernel(*variant, code, entry()) == 0:
        kernels.add((*variant, code))
    _state["loaded"].add(path)
    _state.setdefault("plugins", []).append(plugin)  # kept loaded
  if len(kernels) > len(_state["kernels"]):
    _state["kernels"] = kernels
    _state["generation"] += 1
  if where / _build.KERNELS_NAME in _state["loaded"]:  # (not just appeared)
    _state["complete"] = True
    # Whole now: choices made on part of the kernels are made again (a
    # tuning redone, the C++ route's configs remembered).
    _state["generation"] += 1
  elif (not os.environ.get("RLK_CUDA_FFI_LIB")
        and os.environ.get("RLK_CUDA_FFI_AUTOBUILD", "1") != "0"):
    try:
      _build.start_background()  # resumes a stopped build; no-op if one runs
    except Exception as e:  # noqa: BLE001 - the loaded kernels still run
      if not _state.get("told_resume"):
        _state["told_resume"] = True
        _log.warning("rlk: the cuda_ffi build cannot resume here: %s", e)


def _declare(lib: ctypes.CDLL) -> None:
  i64, vp = ctypes.c_int64, ctypes.c_void_p
  lib.rlk_det_gemm_sm90.restype = ctypes.c_char_p
  lib.rlk_det_gemm_sm90.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    vp, vp, vp, i64, i64, i64, i64, vp,
                                    ctypes.c_size_t, vp]
  lib.rlk_det_gemm_sm90_workspace.restype = i64
  lib.rlk_det_gemm_sm90_workspace.argtypes = [
      ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, i64,
      ctypes.POINTER(ctypes.c_char_p)]
  lib.rlk_det_gemm_sm90_time_configs.restype = ctypes.c_char_p
  lib.rlk_det_gemm_sm90_time_configs.argtypes = [
      ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64,
      ctypes.POINTER(i64), ctypes.c_int, ctypes.c_int, ctypes.c_double,
      ctypes.POINTER(ctypes.c_float), ctypes.c_int, ctypes.c_int,
      ctypes.c_double, ctypes.c_double, ctypes.c_double,
      ctypes.POINTER(ctypes.c_float)]
  lib.rlk_det_gemm_sm90_choose_config.restype = ctypes.c_int
  lib.rlk_det_gemm_sm90_choose_config.argtypes = [i64, i64, i64]
  lib.rlk_det_gemm_sm90_choose_built_config.restype = ctypes.c_int
  lib.rlk_det_gemm_sm90_choose_built_config.argtypes = [ctypes.c_int] * 3 + [
      i64, i64, i64]
  lib.rlk_det_gemm_sm90_add_kernel.restype = ctypes.c_int
  lib.rlk_det_gemm_sm90_add_kernel.argtypes = [ctypes.c_int] * 3 + [i64, vp]
  lib.rlk_det_gemm_sm90_split_columns.restype = i64
  lib.rlk_det_gemm_sm90_split_columns.argtypes = [i64, i64]
  lib.rlk_pack_info_scratch_bytes.restype = i64
  lib.rlk_pack_info_scratch_bytes.argtypes = [i64]
  lib.rlk_pack_rows.restype = ctypes.c_char_p
  lib.rlk_pack_rows.argtypes = [vp, vp, vp, i64, i64, i64, i64, i64,
                                ctypes.c_uint64, vp] + [vp] * 11
  lib.rlk_gather_rows.restype = ctypes.c_char_p
  lib.rlk_gather_rows.argtypes = [vp, vp, vp, i64, i64, i64, ctypes.c_uint64,
                                  vp]
  for entry, argtypes in (
      (lib.rlk_logits_stats, [vp] * 8 + [i64, i64, ctypes.c_int]),
      (lib.rlk_logits_finish, [vp] * 6 + [i64, i64, ctypes.c_int] + [vp] * 3),
      (lib.rlk_logits_grad, [vp] * 8 + [i64, i64, ctypes.c_int, vp])):
    entry.restype, entry.argtypes = ctypes.c_char_p, argtypes
  lib.rlk_attention_forward_sm90.restype = ctypes.c_char_p
  lib.rlk_attention_forward_sm90.argtypes = ([vp] * 8 + [i64] * 13
                                             + [ctypes.c_float, i64,
                                                ctypes.c_int])
  lib.rlk_attention_dkdv_sm90.restype = ctypes.c_char_p
  lib.rlk_attention_dkdv_sm90.argtypes = ([vp] * 11 + [i64] * 17
                                          + [ctypes.c_float] * 2
                                          + [i64, ctypes.c_int])
  lib.rlk_row_reduce.restype = ctypes.c_char_p
  lib.rlk_row_reduce.argtypes = [vp, vp, vp, i64, i64, i64, ctypes.c_float,
                                 ctypes.c_int]


def unavailable_reason(platform: str, wait: bool = True) -> str | None:
  """None when the library runs on `platform`, else why not.

  While a build runs, `wait` (the default) waits for its main library (the
  first thing it makes, in well under a minute): the ops other than
  det_gemm have implementations that need not give its bits, so a process
  must not take one or the other by how far a build has come. det_gemm,
  whose implementations all give the same bits, asks with `wait` False."""
  if platform != "gpu":
    return f"needs a CUDA GPU (platform is {platform!r})"
  reason = sm90_reason()
  if reason is not None:
    return reason
  lib, reason = _load()
  if lib is None and wait:
    where = _build._library_dir()
    waited = False
    while (where is not None and not (where / _build.LIBRARY_NAME).is_file()
           and _build.builder_running(where)):
      waited = True
      time.sleep(0.5)
    if waited:
      with _lock:
        _state["retry_at"] = 0.0
      lib, reason = _load()
  return reason


def kernel_built(transpose_a: bool, transpose_b: bool, out_f32: bool,
                 config: str) -> bool:
  """Whether the loaded library has this config's kernel for this layout
  (the split: both of its kernels; "auto": some kernel of the layout)."""
  kernels = _state.get("kernels") or set()
  layout = (int(transpose_a), int(transpose_b), int(out_f32))
  if config == "auto":
    return any(k[:3] == layout for k in kernels)
  return all((*layout, CONFIGS[c]) in kernels for c in kernel_parts(config))


def wait_until_built(log=_log.warning) -> str | None:
  """Builds the library, or waits for the build that runs, and takes up
  every kernel (benchmarks: timing a half-built library would time the
  fallbacks under this implementation's name). None, or why there is no
  library here."""
  reason = sm90_reason()
  if reason is not None:
    return reason
  try:
    _build.build(log=log)
  except _build.BuildUnavailable as e:
    return str(e)
  with _lock:
    _state["retry_at"] = 0.0
    _state["next_scan"] = 0.0
  generation()
  return unavailable_reason("gpu")


def want(transpose_a: bool, transpose_b: bool, out_f32: bool,
         config: str) -> None:
  """Asks the running build to compile this config's kernels for this
  layout next (once a process: a line each in the build's wanted list)."""
  layout = (int(transpose_a), int(transpose_b), int(out_f32))
  for name in kernel_parts(config):
    key = (*layout, CONFIGS[name])
    if key not in _wanted and not kernel_built(*layout, name):
      _wanted.add(key)
      try:
        _build.want(layout, CONFIGS[name])
      except OSError:  # an unwritable folder: the build's own order then
        pass


def built_configs(transpose_a: bool, transpose_b: bool,
                  out_f32: bool) -> list[str]:
  """The configs the library can run in this layout (CONFIGS' order; the
  split where both of its kernels are built; "auto" not included). A
  library already built is loaded first (a fresh process asking before
  its first product got [] on the device, 2026-11-28); none is built for
  the asking."""
  if _state.get("lib") is None and _build.library_path() is not None:
    _load()
  return [c for c in CONFIGS if c != "auto"
          and kernel_built(transpose_a, transpose_b, out_f32, c)]


def build_complete() -> bool:
  """Whether the loaded library has every kernel of its build (False
  while none is loaded or a build still adds kernels)."""
  generation()
  return bool(_state.get("complete"))


def generation() -> int:
  """A count that grows when a running build brings the library (1) and
  each time kernels arrive in it: callers that keep a choice made on what
  was built (an implementation, a config) key it by this, so it is made
  again when the count moves. Cheap once the build is whole, or where no
  build runs."""
  if _state.get("complete"):
    return _state["generation"]
  lib = _state.get("lib")
  if lib is None:
    if _state.get("retry_at", float("inf")) == float("inf"):
      return 0  # never asked for, or nothing will come
    lib = _load()[0]  # a build runs: looks again (at most every RECHECK_S)
    if lib is None:
      return 0
  with _lock:
    _refresh(lib)
  return _state["generation"]


def library() -> ctypes.CDLL:
  lib, reason = _load()
  if lib is None:
    raise RuntimeError(reason)
  return lib


def _checked(err: bytes | None) -> None:
  """Raises a C entry's error message (None: it succeeded)."""
  if err is not None:
    raise RuntimeError(err.decode())


def operand_reason(m: int, n: int, k: int, transpose_a: bool,
                   transpose_b: bool, dtype, out_dtype) -> str | None:
  """None if the kernels take this product, else why not. Mirrors the
  library's own check (which still runs), so callers can choose early."""
  dtype, out_dtype = np.dtype(dtype), np.dtype(out_dtype)
  if dtype.name != "bfloat16":
    return f"operands must be bfloat16, got {dtype}"
  if out_dtype.name not in ("bfloat16", "float32"):
    return f"the result must be bfloat16 or float32, got {out_dtype}"
  a_pitch, b_pitch = (m if transpose_a else k), (k if transpose_b else n)
  if k == 0 or n == 0:
    return f"empty reduction or output (K={k}, N={n})"
  if a_pitch % 8 or b_pitch % 8 or n % 8:
    return (f"TMA needs rows of 16-byte multiples: A rows {a_pitch}, B rows "
            f"{b_pitch}, C rows {n} elements must be multiples of 8")
  return None


def matmul(a, b, *, transpose_a: bool, transpose_b: bool, out_dtype,
           config: str = "auto", swizzle: int = 0, raster: int = 0):
  """``op(a) @ op(b)`` on the SM90 kernels (bf16 in, f32 accumulate).

  `config` names the instantiation; `swizzle` (1, 2, 4, 8) and `raster`
  (1: along M, 2: along N) the persistent scheduler's tile order, 0 = the
  library's choice. None of them changes the bits, only the speed.
  """
  import jax
  if config not in CONFIGS or swizzle not in SWIZZLES or raster not in RASTERS:
    raise ValueError(
        f"rlk cuda_ffi det_gemm: unknown config={config!r} swizzle={swizzle!r} "
        f"raster={raster!r} (configs {sorted(CONFIGS)}, swizzle {SWIZZLES}, "
        f"raster {RASTERS})")
  library()  # registers the target (or raises with the reason)
  m = a.shape[1] if transpose_a else a.shape[0]
  k = a.shape[0] if transpose_a else a.shape[1]
  n = b.shape[0] if transpose_b else b.shape[1]
  out_f32 = np.dtype(out_dtype) == np.float32
  # The kernel's workspace is an XLA-allocated result (what lets XLA capture
  # the call into a CUDA graph; ffi_traits.h), sized when tracing.
  ws = _workspace_bytes(int(transpose_a), int(transpose_b), int(out_f32),
                        m, n, k, CONFIGS[config]) if m else 0
  call = jax.ffi.ffi_call(
      FFI_TARGET, (_sds((m, n), out_dtype), _sds((ws,), np.uint8)),
      # A vmapped det_gemm arrives already flattened to 2-D by rlk_jax; any
      # other batching runs the GEMM per batch element, which keeps each
      # row's bits.
      vmap_method="sequential")
  return call(a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b),
              config=np.int64(CONFIGS[config]), swizzle=np.int64(swizzle),
              raster=np.int64(raster))[0]


def chosen_config(m: int, n: int, k: int, *, transpose_a: bool | None = None,
                  transpose_b: bool = False, out_f32: bool = False
                  ) -> str | None:
  """The instantiation the library's rule picks for this shape on this
  GPU; given a layout, among the kernels built for it (None: none yet)."""
  lib = library()
  if transpose_a is None:
    code = lib.rlk_det_gemm_sm90_choose_config(m, n, k)
  else:
    code = lib.rlk_det_gemm_sm90_choose_built_config(
        int(transpose_a), int(transpose_b), int(out_f32), m, n, k)
    if code == 0:
      return None
  return {code_: name for name, code_ in CONFIGS.items()}[code]


def time_configs(m: int, n: int, k: int, *, transpose_a: bool,
                 transpose_b: bool, out_f32: bool, configs, rounds: int = 5,
                 min_ms: float = 0.2) -> dict[str, float | None]:
  """Median milliseconds per launch of each named config on an M x N x K
  product of this layout (None: the config cannot run it), timed in
  interleaved rounds of short samples on the library's own operands
  (random values, enough sets to leave L2 cold) and a stream of its own:
  the caller's streams are neither used nor synchronized. Raises
  RuntimeError when it cannot measure (e.g. no memory for the operands)."""
  return _time_configs(m, n, k, transpose_a, transpose_b, out_f32, configs,
                       rounds, min_ms)[0]


def sustained_times(m: int, n: int, k: int, *, transpose_a: bool,
                    transpose_b: bool, out_f32: bool, configs,
                    rounds: int = 3, min_ms: float = 0.2, finalists: int = 6,
                    sustain_rounds: int = 3, sustain_ms: float = 10.0,
                    budget_ms: float = 250.0, heat_ms: float = 300.0):
  """The autotuner's measurement: ``(screen, sustained)``. ``screen`` is
  :func:`time_configs`'s; then the `finalists` fastest of it are timed
  again as a user's step of such products runs them, on a card held at
  its power cap: the card heated first with `heat_ms` of work (unless a
  tuning ended less than a second ago), each sample about `sustain_ms`
  long, after as long of the same config untimed, `sustain_rounds`
  interleaved rounds, the stage held to about `budget_ms` of work.
  ``sustained`` has those finalists only."""
  screen, sustained = _time_configs(m, n, k, transpose_a, transpose_b,
                                    out_f32, configs, rounds, min_ms,
                                    finalists, sustain_rounds, sustain_ms,
                                    budget_ms, heat_ms)
  return screen, {c: t for c, t in sustained.items() if t is not None}


def _time_configs(m, n, k, transpose_a, transpose_b, out_f32, configs,
                  rounds, min_ms, finalists=0, sustain_rounds=0,
                  sustain_ms=0.0, budget_ms=0.0, heat_ms=0.0):
  configs = list(configs)
  codes = (ctypes.c_int64 * len(configs))(*(CONFIGS[c] for c in configs))
  out = (ctypes.c_float * len(configs))()
  hot = (ctypes.c_float * len(configs))(*([-1.0] * len(configs)))
  _checked(library().rlk_det_gemm_sm90_time_configs(
      int(transpose_a), int(transpose_b), int(out_f32), m, n, k, codes,
      len(configs), rounds, min_ms, out, finalists, sustain_rounds,
      sustain_ms, budget_ms, heat_ms, hot))
  as_dict = lambda xs: {c: (float(ms) if ms >= 0 else None)
                        for c, ms in zip(configs, xs)}
  return as_dict(out), as_dict(hot)


def build_id() -> str:
  """Identifies the loaded library's build (its cache key, or a hash of a
  prebuilt file named by RLK_CUDA_FFI_LIB): tuning results are kept per
  build, since a rebuilt kernel may run at another speed."""
  library()
  with _lock:
    if "build_id" not in _state:
      prebuilt = os.environ.get("RLK_CUDA_FFI_LIB")
      if prebuilt:
        import hashlib
        with open(prebuilt, "rb") as f:
          _state["build_id"] = hashlib.sha256(f.read()).hexdigest()[:16]
      else:
        path = _build.library_path()
        _state["build_id"] = (
            "unknown" if path is None
            else f"prebuilt-{_build._sources_digest()}"
            if path.parent == _build.PREBUILT_DIR else path.parent.name)
    return _state["build_id"]


def split_columns(m: int, n: int) -> int:
  """The output columns a ``split_256x192_128x256`` call of this shape gives
  its 256x192 kernel on this GPU (the rest go to 128x256); 0 when N <= 192."""
  return int(library().rlk_det_gemm_sm90_split_columns(m, n))


@functools.cache
def _workspace_bytes(ta, tb, f32, m, n, k, config) -> int:
  err = ctypes.c_char_p()
  size = library().rlk_det_gemm_sm90_workspace(ta, tb, f32, m, n, k, config,
                                               ctypes.byref(err))
  if size < 0:
    raise ValueError(err.value.decode())
  return size


def launcher(m: int, n: int, k: int, *, transpose_a: bool, transpose_b: bool,
             out_f32: bool, config: str = "auto"):
  """``launch(a_ptr, b_ptr, c_ptr, stream)`` for one product signature: the
  same kernels on raw device pointers and a CUDA stream (the torch bridge's
  route: torch's stream, torch's allocator, no JAX call), with everything
  that does not change between calls worked out once."""
  entry = library().rlk_det_gemm_sm90
  cfg = CONFIGS[config]
  ta, tb, f32 = int(transpose_a), int(transpose_b), int(out_f32)
  if m and _workspace_bytes(ta, tb, f32, m, n, k, cfg):
    raise RuntimeError("rlk cuda_ffi det_gemm: this problem needs a workspace;"
                       " the direct launch route supports none")

  def launch(a_ptr: int, b_ptr: int, c_ptr: int, stream: int) -> None:
    err = entry(ta, tb, f32, a_ptr, b_ptr, c_ptr, m, n, k, cfg, None, 0, stream)
    if err is not None:
      raise ValueError(err.decode())
  return launch


def launch(a_ptr: int, b_ptr: int, c_ptr: int, m: int, n: int, k: int, *,
           transpose_a: bool, transpose_b: bool, out_f32: bool, stream: int,
           config: str = "auto") -> None:
  """One launch of `launcher`'s kernels (see there)."""
  launcher(m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
           out_f32=out_f32, config=config)(a_ptr, b_ptr, c_ptr, stream)


# ----------------------------------------------------------------------------
# pack


def _sds(shape, dtype):
  import jax
  return jax.ShapeDtypeStruct(shape, dtype)


def _info_shapes(mask_shape, capacity):
  i32 = lambda *shape: _sds(shape, np.int32)
  n_seq = mask_shape[0]
  return (i32(n_seq + 1), i32(n_seq), i32(), i32(), i32(), i32(capacity),
          i32(capacity), _sds((capacity,), np.bool_), i32(capacity),
          i32(*mask_shape))


def _scratch_shape(active):
  # The metadata kernels' scratch, an XLA-allocated result (ffi_traits.h).
  return _sds((pack_info_scratch_bytes(active.size),), np.uint8)


def _mask_attrs(active, capacity):
  n_seq, size = active.shape[0], active.size
  return dict(n_seq=np.int64(n_seq),
              width=np.int64(size // n_seq if n_seq else 0),
              capacity=np.int64(capacity))


def pack_info(active, *, capacity: int):
  """The PackInfo fields of a bool mask ``active`` (``[n_seq, ...]``), in
  rlk_jax.PackInfo's order: cu_seqlens, seq_lens, total, max_seqlen,
  num_dropped, segment_ids, positions, valid, gather_map, scatter_map."""
  import jax
  library()
  call = jax.ffi.ffi_call(
      PACK_INFO_TARGET,
      (*_info_shapes(active.shape, capacity), _scratch_shape(active)),
      vmap_method="sequential")
  return call(active.reshape(-1), **_mask_attrs(active, capacity))[:-1]


def pack_rows(src, active, *, capacity: int, fill):
  """Packs the rows of ``src`` (``[active.size, D]``) where the bool mask
  ``active`` is set: ``(packed [capacity, D], *pack_info fields)``. Small
  masks take one kernel for the rows and every field."""
  import jax
  library()
  call = jax.ffi.ffi_call(
      PACK_ROWS_TARGET,
      (_sds((capacity, src.shape[1]), src.dtype),
       *_info_shapes(active.shape, capacity), _scratch_shape(active)),
      vmap_method="sequential")
  return call(src, active.reshape(-1), **_mask_attrs(active, capacity),
              fill_bits=_fill_attr(fill, src.dtype))[:-1]


def fill_bits(fill, dtype) -> int:
  """The bytes of `fill` as `dtype`, little-endian, as one integer."""
  return int.from_bytes(np.asarray(fill, dtype=dtype).tobytes(), "little")


def gather_rows(src, idx, fill):
  """``out[r] = src[idx[r]]`` (``[M, D]``), rows with ``idx < 0`` = `fill`."""
  import jax
  library()
  call = jax.ffi.ffi_call(
      GATHER_ROWS_TARGET,
      jax.ShapeDtypeStruct((idx.shape[0], src.shape[1]), src.dtype),
      vmap_method="sequential")
  return call(src, idx, fill_bits=_fill_attr(fill, src.dtype))


def _fill_attr(fill, dtype):
  # The same 64 bits as the C entry's uint64, as the int64 FFI attribute.
  return np.array(fill_bits(fill, dtype), np.uint64).view(np.int64)[()]


def launch_pack_rows(stream: int, src_ptr: int, active_ptr: int, n_seq: int,
                     width: int, capacity: int, row_bytes: int,
                     elem_bytes: int, fill: int, scratch_ptr: int, field_ptrs,
                     dst_ptr: int) -> None:
  """pack_rows's kernels on raw pointers and a stream (the torch bridge):
  the packed rows at `dst_ptr` and every field, one kernel for small masks."""
  _checked(library().rlk_pack_rows(stream, src_ptr, active_ptr, n_seq, width,
                                    capacity, row_bytes, elem_bytes, fill,
                                    scratch_ptr, *field_ptrs, dst_ptr))


def pack_info_scratch_bytes(size: int) -> int:
  return library().rlk_pack_info_scratch_bytes(size)


def launch_gather_rows(stream: int, src_ptr: int, idx_ptr: int, out_rows: int,
                       row_bytes: int, elem_bytes: int, fill: int,
                       dst_ptr: int) -> None:
  _checked(library().rlk_gather_rows(stream, src_ptr, idx_ptr, out_rows,
                                      row_bytes, elem_bytes, fill, dst_ptr))


# ----------------------------------------------------------------------------
# linear_logp's row kernels (one vocabulary chunk at a time; the chunk's
# logits come from det_gemm)


def logits_stats(logits, targets, temps, stats, *, with_entropy: bool = True):
  """Folds f32 logits ``[N, C]`` into linear_logp's running stats (four f32
  ``[N]``: max, sum of exp, target logit, sum of exp * logit; updated in
  place, the outputs alias them); `targets` int32 ``[N]`` index this chunk
  (outside ``[0, C)``: nothing picked); `temps` f32 ``[N]`` are the rows'
  temperatures. Without entropy the sum of exp * logit is not folded (it
  stays as passed). One warp per row, a fixed order: a row's bits never
  depend on the other rows."""
  import jax
  import jax.numpy as jnp
  library()
  out = jax.ShapeDtypeStruct((logits.shape[0],), jnp.float32)
  call = jax.ffi.ffi_call(LOGITS_STATS_TARGET, (out,) * 4,
                          input_output_aliases={3: 0, 4: 1, 5: 2, 6: 3},
                          vmap_method="sequential")
  return call(logits, targets, temps, *stats, entropy=bool(with_entropy))


def logits_finish(stats, targets, vocab: int, *, with_entropy: bool = True):
  """``(logp, lse, entropy)``, f32 ``[N]`` each, from the folded stats;
  `targets` int32 ``[N]`` (outside ``[0, vocab)``: log-prob 0); entropy NaN
  without `with_entropy`."""
  import jax
  import jax.numpy as jnp
  library()
  out = jax.ShapeDtypeStruct((targets.shape[0],), jnp.float32)
  call = jax.ffi.ffi_call(LOGITS_FINISH_TARGET, (out,) * 3,
                          vmap_method="sequential")
  return call(*stats, targets, vocab=np.int64(vocab),
              entropy=bool(with_entropy))


def logits_grad(logits, targets, temps, lse, entropy, g_picked, g_entropy, *,
                with_entropy: bool = True):
  """linear_logp's d loss / d logits of one chunk, bf16 ``[N, C]``, from the
  chunk's raw f32 logits ``[N, C]`` (C a multiple of 4), `targets` int32
  indexing this chunk, and each row's f32 temperature, lse, entropy,
  cotangent of the log-prob (0 where the target is outside the vocabulary)
  and of the entropy (neither entropy operand read without
  `with_entropy`)."""
  import jax
  import jax.numpy as jnp
  library()
  call = jax.ffi.ffi_call(
      LOGITS_GRAD_TARGET, jax.ShapeDtypeStruct(logits.shape, jnp.bfloat16),
      vmap_method="sequential")
  return call(logits, targets, temps, lse, entropy, g_picked, g_entropy,
              entropy=bool(with_entropy))


def launch_logits_stats(stream: int, logits_ptr: int, targets_ptr: int,
                        temps_ptr: int, stat_ptrs, n: int, c: int,
                        with_entropy: bool) -> None:
  """`logits_stats` on raw pointers and a stream (the torch bridge), the
  four stats at `stat_ptrs` updated in place."""
  _checked(library().rlk_logits_stats(stream, logits_ptr, targets_ptr,
                                      temps_ptr, *stat_ptrs, n, c,
                                      int(with_entropy)))


def launch_logits_finish(stream: int, stat_ptrs, targets_ptr: int, n: int,
                         vocab: int, with_entropy: bool, out_ptrs) -> None:
  """`logits_finish` on raw pointers: logp, lse, entropy at `out_ptrs`."""
  _checked(library().rlk_logits_finish(stream, *stat_ptrs, targets_ptr, n,
                                       vocab, int(with_entropy), *out_ptrs))


def launch_logits_grad(stream: int, logits_ptr: int, row_ptrs, n: int, c: int,
                       with_entropy: bool, out_ptr: int) -> None:
  """`logits_grad` on raw pointers; `row_ptrs` are targets, temperatures,
  lse, entropy, g_picked, g_entropy in that order."""
  _checked(library().rlk_logits_grad(stream, logits_ptr, *row_ptrs, n, c,
                                     int(with_entropy), out_ptr))


# ----------------------------------------------------------------------------
# det_attention's Hopper forward (the Triton forward's bits: its tile map,
# blocks, chunks and arithmetic; triton_kernels.attention says why a row's
# bits depend on nothing else)


def attention_forward(q, k, v, seqs, tiles, *, scale2: float,
                      window: int | None):
  """(out [Tq, Hq, D] in q's dtype, lse f32 [Tq, Hq]) of q ``[Tq, Hq, D]``
  against k, v ``[Tk, Hkv, D]`` (bf16 or f16, D 64 or 128), `seqs` int32
  ``[4, B]`` (q_start, q_len, k_start, k_len) and `tiles` int32 ``[2,
  n_tiles]`` (the Triton forward's map of 128-row tiles); `scale2` is the
  softmax scale times log2(e). Rows no tile covers are not written."""
  import jax
  import jax.numpy as jnp
  library()
  call = jax.ffi.ffi_call(
      ATTENTION_FORWARD_TARGET,
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)),
      vmap_method="sequential")
  return call(q, k, v, seqs, tiles, scale2=np.float32(scale2),
              window=np.int64(window or 0))


def launch_attention_forward(stream: int, q, k, v, seqs, tiles, out, lse, *,
                             k_rows: int, scale2: float, window: int | None,
                             half: bool) -> None:
  """`attention_forward` on torch tensors' pointers and strides (rows of
  ``[T, H, D]`` with any token and head stride, D contiguous; k and v may
  be ``[B, S, Hkv, D]`` read in place, `k_rows` rows in all)."""
  tq, hq, d = q.shape
  _checked(library().rlk_attention_forward_sm90(
      stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), seqs.data_ptr(),
      tiles.data_ptr(), out.data_ptr(), lse.data_ptr(), seqs.shape[1],
      tiles.shape[1], hq, k.shape[-2], d, tq, q.stride(-3), q.stride(-2),
      k_rows, k.stride(-3), k.stride(-2), v.stride(-3), v.stride(-2),
      scale2, window or 0, int(half)))


def attention_dkdv(q, k, v, g, lse, delta, seqs, tiles, *, scale: float,
                   scale2: float, window: int | None):
  """(dk, dv) ``[Tk, Hkv, D]`` in k's dtype: det_attention's backward for
  the keys and values with the Triton dK/dV kernel's bits. q and g ``[Tq,
  Hq, D]``, k and v ``[Tk, Hkv, D]`` (bf16 or f16, D 64 or 128), lse and
  delta f32 ``[Tq, Hq]`` (delta = sum(out * g) as the Triton delta kernel
  gives it), `seqs` int32 ``[4, B]``, `tiles` int32 ``[2, n_tiles]`` (a map
  of ATTENTION_DKDV_TILE_KEYS-key tiles). Rows no tile covers are not
  written."""
  import jax
  library()
  call = jax.ffi.ffi_call(
      ATTENTION_DKDV_TARGET,
      (jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
      vmap_method="sequential")
  return call(q, k, v, g, lse, delta, seqs, tiles, scale=np.float32(scale),
              scale2=np.float32(scale2), window=np.int64(window or 0))


def launch_attention_dkdv(stream: int, q, k, v, g, lse, delta, seqs, tiles,
                          dk, dv, *, k_rows: int, scale: float, scale2: float,
                          window: int | None, half: bool) -> None:
  """`attention_dkdv` on torch tensors' pointers and strides (q, k, v, dk,
  dv rows with any token and head stride, D contiguous; k, v, dk, dv may be
  ``[B, S, Hkv, D]`` views, `k_rows` rows in all; g, lse, delta
  contiguous)."""
  tq, hq, d = q.shape
  _checked(library().rlk_attention_dkdv_sm90(
      stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
      lse.data_ptr(), delta.data_ptr(), seqs.data_ptr(), tiles.data_ptr(),
      dk.data_ptr(), dv.data_ptr(), seqs.shape[1], tiles.shape[1], hq,
      k.shape[-2], d, tq, q.stride(-3), q.stride(-2), k_rows, k.stride(-3),
      k.stride(-2), v.stride(-3), v.stride(-2), dk.stride(-3), dk.stride(-2),
      dv.stride(-3), dv.stride(-2), scale, scale2, window or 0, int(half)))


ROW_REDUCE_DTYPES = ("float32", "bfloat16", "float16")  # the entry's codes


def launch_row_reduce(stream: int, x_ptr: int, out_ptr: int, rows: int,
                      k: int, row_stride: int, divisor: float,
                      dtype: str) -> None:
  """out[r] = sum(x[r, :k]) / divisor, float32 inside, one rounding to
  `dtype` (x's and out's; a name in ROW_REDUCE_DTYPES), on raw pointers and
  a stream (row_reduce_kernels.cu says why each row's bits are its own)."""
  _checked(library().rlk_row_reduce(stream, x_ptr, out_ptr, rows, k,
                                    row_stride, divisor,
                                    ROW_REDUCE_DTYPES.index(dtype)))


def row_reduce_entry() -> int:
  """The address of the C entry (the torch bridge's C++ route calls it)."""
  return ctypes.cast(library().rlk_row_reduce, ctypes.c_void_p).value
