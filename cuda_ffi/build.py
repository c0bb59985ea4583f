"""Builds the SM90 det_gemm library (CUTLASS headers from the `nvidia-cutlass`
wheel, the XLA FFI headers from jaxlib) into a cache keyed by everything that
goes into it.

    python -m cuda_ffi.build            # build (or find) the library, print its path
    python -m cuda_ffi.build --status   # what is built, and a running build's progress
    python -m cuda_ffi.build --check    # compile every source for sm_90a, link nothing
    python -m cuda_ffi.build --objects DIR  # keep the objects in DIR (default: the cache)

Nothing is downloaded: the inputs are the `nvcc` on PATH (or $CUDA_HOME), the
installed `nvidia-cutlass` wheel ($RLK_CUTLASS_DIR overrides) and jaxlib.

What it makes, in the cache directory of its key: the main library (the FFI
handlers, pack, linear_logp's row kernels, attention, row reductions and
det_gemm's dispatch, no GEMM kernel), and the det_gemm kernels, one object
per (operand layout, output dtype, config) of BUILD_CONFIGS. Each kernel is
linked into a small library of its own as soon as it is compiled, so a
process can load the kernels that exist while the rest compile; at the end
all of them go into one library and the small ones are removed. Every
config gives the same bits, so a process never waits for a kernel to get
the right answer, only for the fastest one.

Objects are kept (default: ``objects/`` in the cache) under a key of their
own inputs, so a build stopped part-way resumes, and processes sharing the
cache never write one file. One build runs per cache at a time (a lock);
the first use of det_gemm on a Hopper GPU starts it in the background
(``cuda_ffi._load``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCE = CSRC / "det_gemm_kernels.cu"
KERNEL_HEADER = CSRC / "det_gemm_sm90.h"
API_SOURCE = CSRC / "det_gemm_api.cc"
# The pack kernels: no CUTLASS, one object each.
PACK_SOURCES = (CSRC / "pack_rows_kernels.cu", CSRC / "pack_rows_api.cc")
# linear_logp's row kernels (stats, finish, gradient) and their entries, one file.
LOGP_SOURCE = CSRC / "linear_logp_kernels.cu"
# The row sum/mean (an RMSNorm's reduction) and its C entry, one file.
ROW_REDUCE_SOURCE = CSRC / "row_reduce_kernels.cu"
# det_attention's Hopper forward, its XLA handler and C entry, one file.
ATTENTION_SOURCE = CSRC / "attention_sm90_kernels.cu"
# The launcher of Triton-compiled kernels from XLA (command-buffer capturable).
TRITON_LAUNCH_SOURCE = CSRC / "triton_launch.cc"
# A kernel library's entry: the launch function of the kernel object it is
# linked with (compiled once per kernel, with that kernel's defines).
ENTRY_SOURCE = CSRC / "det_gemm_kernel_entry.cc"
LIBRARY_NAME = "librlk_cuda_ffi.so"
# Every kernel of the build in one library: present once the build is whole.
KERNELS_NAME = "librlk_cuda_ffi_kernels.so"
# One library per kernel while the build runs (removed at the end).
KERNEL_DIR = "kernels"
PROGRESS_NAME = "progress.json"
LOG_NAME = "build.log"
# Kernels a process is waiting for, one "ta tb f32 code" a line: compiled
# before the others.
WANTED_NAME = "wanted.txt"
# (transpose_a, transpose_b, f32 output): every product det_gemm's forward and
# backward can ask for.
VARIANTS = [(ta, tb, f32) for ta in (0, 1) for tb in (0, 1) for f32 in (0, 1)]

# The configs the build compiles in each layout, most useful first: a greedy
# cover of 3213 products timed on every config (H100 and H200 sweeps), cut
# at 18, 16 and 6 objects in the layouts a model's forward and backward use
# (000 JAX's forward and torch's dA, 010 torch's forward and JAX's dA, 100
# both dW); two large-product configs in the f32-output layouts
# (linear_logp's logits and gradient accumulators) and one generalist in
# the two rare ones (a transposed A times a transposed B). The extended-atom
# configs (128x144/160/224/80) are left out: they compiled in 88-108 s, the
# others in 41-70 s. 48 objects, three waves of 16 nvcc steps (a step takes
# 60-70 s when 16 run at once: a build of 59 run alone took 259 s, four
# waves; H100 device builds of 2026-11-28), in place of 288 (12.5 min).
# What that costs: 1.0048x (000), 1.0045x (010), 1.0061x (100) the best
# config's time in geomean over the sweeps' products, up to 1.12-1.17x on a
# few (benchmarks/results/cpu-2026-11-28/det_gemm_build_configs/). Every
# config gives the same bits, so this is speed only; the tuned tables name
# only these, and the autotuner and the rule choose among what is built.
# RLK_CUDA_FFI_CONFIGS=all builds every config in every layout.
_DATA_LAYOUT_CONFIGS = {
    (0, 0, 0): ("cooperative_256x192", "cooperative_128x256",
                "pingpong_64x128", "swap_pingpong_64x32", "pingpong_128x128",
                "cooperative_128x192", "pingpong_64x64_cluster_2x1",
                "cooperative_128x320_k32", "pingpong_64x128_cluster_4x2",
                "pingpong_64x64", "pingpong_192x128_cluster_2x1",
                "pingpong_64x128_cluster_2x1",
                "cooperative_128x128_cluster_1x1",
                "pingpong_192x96_cluster_2x1", "cooperative_128x96",
                "pingpong_64x256", "cooperative_128x256_cluster_1x2",
                "pingpong_64x32"),
    (0, 1, 0): ("cooperative_256x192", "cooperative_128x256",
                "pingpong_64x128", "swap_pingpong_64x32", "pingpong_128x128",
                "cooperative_128x192", "pingpong_64x64_cluster_2x1",
                "pingpong_64x128_cluster_4x2", "pingpong_192x96_cluster_2x1",
                "pingpong_64x64", "pingpong_128x96_cluster_2x4",
                "cooperative_128x320_k32", "pingpong_64x128_cluster_2x1",
                "cooperative_256x128", "pingpong_192x128_cluster_2x1",
                "cooperative_128x128"),
    (1, 0, 0): ("cooperative_256x192", "cooperative_128x256",
                "pingpong_128x128", "cooperative_128x192",
                "pingpong_128x128_cluster_1x2", "cooperative_128x128"),
}
_F32_CONFIGS = ("cooperative_256x192", "cooperative_128x256")
_RARE_CONFIGS = ("cooperative_128x256",)
BUILD_CONFIGS = {
    **_DATA_LAYOUT_CONFIGS,
    **{v: _F32_CONFIGS for v in ((0, 0, 1), (0, 1, 1), (1, 0, 1))},
    **{v: _RARE_CONFIGS for v in ((1, 1, 0), (1, 1, 1))},
}
# Seconds one kernel object took nvcc on the H100 machine's 16 busy cores
# (the mean over the layouts of the builds in benchmarks/results/
# nvidia-h100-80gb-hbm3-2026-11-28/first_use*/build.log): the build's order
# only, never its content.
COMPILE_SECONDS = {
    "kCooperative128x256": 61.8, "kCooperative256x192": 60.8,
    "kCooperative128x256Cluster1x2": 60.7, "kCooperative128x192": 60.3,
    "kPingpong128x96Cluster2x4": 59.9, "kCooperative128x96": 59.8,
    "kPingpong192x128Cluster2x1": 58.0, "kPingpong64x128Cluster4x2": 57.7,
    "kCooperative256x128": 56.7, "kCooperative128x128": 55.6,
    "kCooperative128x320K32": 55.4, "kPingpong64x256": 55.1,
    "kPingpong64x128Cluster2x1": 54.9, "kPingpong192x96Cluster2x1": 54.5,
    "kCooperative128x128Cluster1x1": 54.0, "kPingpong128x128": 52.9,
    "kPingpong64x32": 52.5, "kPingpong128x128Cluster1x2": 52.4,
    "kPingpong64x128": 52.4, "kPingpong64x64Cluster2x1": 51.6,
    "kPingpong64x64": 51.5, "kSwapPingpong64x32": 50.1,
    "kPingpong64x64Cluster1x2": 49.2,
}
# The order layouts take their first kernels in: the forward and backward
# layouts first.
_LAYOUT_ORDER = ((0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 1), (0, 1, 1),
                 (1, 0, 1), (1, 1, 0), (1, 1, 1))


def kernel_configs() -> dict[str, int]:
  """The one-kernel configs of det_gemm_sm90.h (RLK_KERNEL_CONFIGS) with
  their GemmConfig codes: the build compiles one object per config and
  variant, so adding a config to the header is all it takes."""
  text = KERNEL_HEADER.read_text()
  codes = dict(re.findall(r"^\s*(k\w+) = (\d+),", text, re.M))
  # RLK_KERNEL_CONFIGS ends with RLK_EXTENDED_MMA_CONFIGS(X).
  names = (_x_list(text, "RLK_KERNEL_CONFIGS")
           + _x_list(text, "RLK_EXTENDED_MMA_CONFIGS"))
  return {name: int(codes[name]) for name in names}


def extended_mma_configs() -> set[str]:
  """The configs compiled with CUTLASS's extended GMMA atoms
  (RLK_EXTENDED_MMA_CONFIGS; det_gemm_kernels.cu says why only they)."""
  return set(_x_list(KERNEL_HEADER.read_text(), "RLK_EXTENDED_MMA_CONFIGS"))


def _x_list(text: str, macro: str) -> list[str]:
  """The names an X-macro of det_gemm_sm90.h lists."""
  body = re.search(rf"#define {macro}\(X\)(.*?)\n\n", text, re.S).group(1)
  return re.findall(r"X\((k\w+)\)", body)


NVCC_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
              "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC"]


class BuildUnavailable(RuntimeError):
  """A build input is missing; the message says which and how to get it."""


def find_nvcc() -> str:
  candidates = [os.path.join(os.environ[v], "bin", "nvcc")
                for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
  candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
  for path in candidates:
    if path and os.access(path, os.X_OK):
      return path
  raise BuildUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)")


def find_cutlass() -> pathlib.Path:
  """The CUTLASS source tree shipped inside the nvidia-cutlass wheel."""
  if "RLK_CUTLASS_DIR" in os.environ:
    root = pathlib.Path(os.environ["RLK_CUTLASS_DIR"])
  else:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
      raise BuildUnavailable("CUTLASS headers not found: pip install "
                             "nvidia-cutlass (the `cuda` extra of rlk)")
    root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "source"
  if not (root / "include" / "cutlass" / "cutlass.h").is_file():
    raise BuildUnavailable(f"no CUTLASS headers under {root}/include")
  return root


def toolchain_reason(*, cutlass: bool = True) -> str | None:
  """Why this machine cannot compile rlk's CUDA sources (None: it can):
  no nvcc, or (unless `cutlass` is False) no CUTLASS headers."""
  try:
    find_nvcc()
    if cutlass:
      find_cutlass()
  except BuildUnavailable as e:
    return str(e)
  return None


def find_ffi_include() -> pathlib.Path:
  import jax  # only the build needs jax's include dir
  return pathlib.Path(jax.ffi.include_dir())


def _inputs():
  nvcc = find_nvcc()
  cutlass = find_cutlass()
  ffi = find_ffi_include()
  return nvcc, cutlass, ffi


def cache_dir() -> pathlib.Path:
  root = os.environ.get("RLK_CACHE_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlk")
  return pathlib.Path(root) / "cuda_ffi"


@functools.cache
def _tool_versions(nvcc: str, cutlass: pathlib.Path) -> bytes:
  """What identifies the compiler and CUTLASS: nvcc's release line (e.g.
  "Cuda compilation tools, release 13.0, V13.0.88"; not the whole banner,
  whose build date differs between two installs of one release), CUTLASS's
  version header. Cached: a build asks twice (the library's key, then the
  objects'), and nvcc does not change under a running process."""
  banner = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                          check=True).stdout
  release = [line for line in banner.splitlines() if "release" in line]
  version = cutlass / "include" / "cutlass" / "version.h"
  return b"\0".join([
      "\n".join(release or [banner]).encode(),
      version.read_bytes() if version.is_file() else str(cutlass).encode()])


def _ffi_header(ffi: pathlib.Path) -> bytes:
  return (ffi / "xla" / "ffi" / "api" / "c_api.h").read_bytes()


def build_key(nvcc: str, cutlass: pathlib.Path, ffi: pathlib.Path) -> str:
  """The library's cache key: a hash of every source, the flags, and the
  compiler and header versions."""
  h = hashlib.sha256(_sources_digest().encode())
  h.update(" ".join(NVCC_FLAGS).encode())
  h.update(_tool_versions(nvcc, cutlass))
  h.update(_ffi_header(ffi))
  return h.hexdigest()[:16]


def _kept_objects(commands, nvcc: str, cutlass: pathlib.Path,
                  ffi: pathlib.Path, objects: pathlib.Path):
  """The commands with each object renamed into `objects` under a key of
  what goes into that object alone: its source, every header of csrc/
  (whichever it includes), its flags with the machine's paths left out,
  nvcc, CUTLASS and, where it includes them, jaxlib's FFI headers. A change
  to one source recompiles only its objects (the API's host code, not the
  kernel objects), and objects of other sources, flags or tools are
  never reused."""
  headers = b"".join(p.name.encode() + p.read_bytes()
                     for p in sorted(CSRC.glob("*.h")))
  tools = _tool_versions(nvcc, cutlass)
  places = [(str(ffi), "<ffi>"), (str(cutlass), "<cutlass>"),
            (str(CSRC), "<csrc>")]
  keyed = []
  for cmd in commands:
    out = cmd.index("-o")
    flags = []
    for arg in cmd[1:out] + cmd[out + 2:]:
      for path, name in places:
        arg = arg.replace(path, name)
      flags.append(arg)
    h = hashlib.sha256("\0".join(flags).encode())
    h.update(pathlib.Path(cmd[cmd.index("-c") + 1]).read_bytes())
    h.update(headers)
    h.update(tools)
    if any("<ffi>" in f for f in flags):
      h.update(_ffi_header(ffi))
    name = f"{_output(cmd).stem}-{h.hexdigest()[:16]}.o"
    keyed.append([*cmd[:out + 1], str(objects / name), *cmd[out + 2:]])
  return keyed



def planned_kernels() -> list[tuple[tuple[int, int, int], str]]:
  """``(layout, header config name)`` of every kernel object the build
  makes, in the order it compiles them: each layout's most useful config
  (BUILD_CONFIGS' first), so every layout has a kernel early, then the
  rest longest to compile first (the wanted kernels go before all of
  them: _Build._next). RLK_CUDA_FFI_CONFIGS=all: every config in every
  layout."""
  from cuda_ffi.gemm_configs import CONFIGS  # the tuned tables' names
  configs = kernel_configs()
  by_code = {code: name for name, code in configs.items()}
  by_snake = {name: by_code[code] for name, code in CONFIGS.items()
              if code in by_code}
  if os.environ.get("RLK_CUDA_FFI_CONFIGS", "") == "all":
    return [(v, name) for v in VARIANTS for name in configs]
  lists = {v: [by_snake[c] for c in BUILD_CONFIGS[v]] for v in _LAYOUT_ORDER}
  first = [(v, lists[v][0]) for v in _LAYOUT_ORDER]
  rest = []
  for rank in range(1, max(map(len, lists.values()))):
    rest += [(v, lists[v][rank]) for v in _LAYOUT_ORDER
             if rank < len(lists[v])]
  # After each layout's first kernel, the longest to compile first: ~60
  # steps of 50-62 s on 16 cores end in a last, part-filled wave, and
  # leaving the short steps to it ends the build ~5 s sooner (a list
  # schedule simulated on the H100 build's own step times).
  typical = sum(COMPILE_SECONDS.values()) / len(COMPILE_SECONDS)
  rest.sort(key=lambda step: -COMPILE_SECONDS.get(step[1], typical))
  return first + rest


def planned_configs(variant) -> list[str]:
  """The config names (cuda_ffi.CONFIGS') the build makes for one layout,
  the split included where it makes both of its kernels."""
  from cuda_ffi.gemm_configs import CONFIGS, kernel_parts
  codes = {kernel_configs()[name] for v, name in planned_kernels()
           if v == tuple(variant)}
  names = [c for c, code in CONFIGS.items() if code in codes]
  split = "split_256x192_128x256"
  if set(kernel_parts(split)) <= set(names):
    names.append(split)
  return names


# Where a wheel built with RLK_WHEEL_CUDA_FFI=1 (setup.py) carries the
# whole library, with PREBUILT_RECORD saying what it was built from.
PREBUILT_DIR = pathlib.Path(__file__).resolve().parent / "prebuilt"
PREBUILT_RECORD = "build.json"


def _sources_digest() -> str:
  """What a library's contents depend on apart from the tools: the
  sources and the kernels the build makes."""
  h = hashlib.sha256()
  for path in sorted(CSRC.iterdir()):
    h.update(path.name.encode())
    h.update(path.read_bytes())
  h.update(repr(planned_kernels()).encode())
  return h.hexdigest()[:16]


def prebuilt_record(ffi: pathlib.Path) -> dict:
  """The record a wheel's prebuilt library keeps: the sources it was built
  from and the XLA FFI C API it was compiled against (jaxlib's header),
  both checked before it is used, so a wheel never runs against another
  jaxlib's FFI or other sources."""
  return {"sources": _sources_digest(),
          "ffi_api": hashlib.sha256(_ffi_header(ffi)).hexdigest()[:16]}


def _prebuilt_dir() -> pathlib.Path | None:
  """The wheel's prebuilt library, if there is one for these sources and
  the installed jaxlib (no compiler needed to tell)."""
  try:
    record = json.loads((PREBUILT_DIR / PREBUILT_RECORD).read_text())
  except (OSError, ValueError):
    return None
  mine = prebuilt_record(find_ffi_include())
  if any(record.get(k) != v for k, v in mine.items()):
    return None
  return PREBUILT_DIR if complete(PREBUILT_DIR) else None


def _library_dir() -> pathlib.Path | None:
  """Where the library for the current sources lives: RLK_CUDA_FFI_LIB's
  folder, the wheel's prebuilt one, or this machine's cache (None: no
  toolchain to key it by)."""
  if os.environ.get("RLK_CUDA_FFI_LIB"):
    return pathlib.Path(os.environ["RLK_CUDA_FFI_LIB"]).parent
  prebuilt = _prebuilt_dir()
  if prebuilt is not None:
    return prebuilt
  try:
    return cache_dir() / build_key(*_inputs())
  except BuildUnavailable:
    return None


def library_path() -> pathlib.Path | None:
  """The main library for the current sources, if it was built (its
  kernels may still be building: kernel_libraries, complete)."""
  if os.environ.get("RLK_CUDA_FFI_LIB"):
    return pathlib.Path(os.environ["RLK_CUDA_FFI_LIB"])
  where = _library_dir()
  path = where / LIBRARY_NAME if where else None
  return path if path and path.is_file() else None


def kernel_libraries(where: pathlib.Path) -> list[pathlib.Path]:
  """The kernel libraries there now: the whole build's one, or while the
  build runs one per kernel compiled so far."""
  whole = where / KERNELS_NAME
  if whole.is_file():
    return [whole]
  return sorted((where / KERNEL_DIR).glob("det_gemm_*.so"))


def kernels_in(library: pathlib.Path) -> list[tuple[tuple[int, int, int], int]]:
  """``(layout, config code)`` of the kernels a kernel library may hold:
  one kernel's, read off its name (det_gemm_<layout>_<code>.so), or any
  (the whole build's library, whatever plan built it)."""
  match = re.fullmatch(r"det_gemm_([01])([01])([01])_(\d+)\.so", library.name)
  if match:
    return [(tuple(map(int, match.groups()[:3])), int(match[4]))]
  return [(v, code) for v in VARIANTS for code in kernel_configs().values()]


def kernel_symbol(variant, code: int) -> str:
  """The entry a kernel library exports for one kernel
  (det_gemm_kernel_entry.cc)."""
  ta, tb, f32 = variant
  return f"rlk_det_gemm_sm90_kernel_{ta}{tb}{f32}_{code}"


def complete(where: pathlib.Path) -> bool:
  return (where / LIBRARY_NAME).is_file() and (where / KERNELS_NAME).is_file()


def _kernel_commands(nvcc, cutlass, ffi, out_dir: pathlib.Path, kernels,
                     configs):
  """``[(variant, name, kernel command, entry command)]``."""
  includes = ["-I", str(CSRC), "-isystem", str(cutlass / "include"),
              "-isystem", str(cutlass / "tools" / "util" / "include")]
  extended = extended_mma_configs()
  out = []
  # One object per (variant, config): ~40 s each, so the build spreads over
  # every core instead of waiting on eight long ones.
  for variant, name in kernels:
    ta, tb, f32 = variant
    code = configs[name]
    defines = [f"-DRLK_TA={ta}", f"-DRLK_TB={tb}", f"-DRLK_OUT_F32={f32}",
               f"-DRLK_CONFIG={code}"]
    atoms = (["-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"]
             if name in extended else [])
    kernel = [nvcc, *NVCC_FLAGS, *includes, *atoms, *defines, "-c",
              str(KERNEL_SOURCE), "-o",
              str(out_dir / f"det_gemm_kernels_{ta}{tb}{f32}_{code}.o")]
    entry = [nvcc, "-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-I",
             str(CSRC), *defines, "-c", str(ENTRY_SOURCE), "-o",
             str(out_dir / f"det_gemm_kernel_entry_{ta}{tb}{f32}_{code}.o")]
    out.append((variant, name, kernel, entry))
  return out


def _core_commands(nvcc, ffi, out_dir: pathlib.Path):
  """The main library's objects: every source but the GEMM kernels."""
  pack_kernels, pack_api = PACK_SOURCES
  commands = [
      [nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-c", str(pack_kernels),
       "-o", str(out_dir / "pack_rows_kernels.o")],
      [nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-isystem", str(ffi), "-c",
       str(LOGP_SOURCE), "-o", str(out_dir / "linear_logp_kernels.o")],
      [nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-isystem", str(ffi), "-c",
       str(ATTENTION_SOURCE), "-o", str(out_dir / "attention_sm90_kernels.o")],
      [nvcc, *NVCC_FLAGS, "-c", str(ROW_REDUCE_SOURCE),
       "-o", str(out_dir / "row_reduce_kernels.o")]]
  # Host code, compiled through nvcc so CUDA's headers are found wherever
  # the toolkit lives.
  for source in (API_SOURCE, pack_api, TRITON_LAUNCH_SOURCE):
    commands.append([nvcc, "-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-I",
                     str(CSRC), "-isystem", str(ffi), "-c", str(source),
                     "-o", str(out_dir / (source.stem + ".o"))])
  return commands


def _compile_commands(nvcc, cutlass, ffi, out_dir: pathlib.Path,
                      variants=VARIANTS, configs=None, kernels=None):
  """nvcc command lines, one per object, writing into `out_dir`: a kernel
  object and its entry per variant and config (or per (variant, config
  name) pair of `kernels`), then the other sources once each."""
  configs = kernel_configs() if configs is None else configs
  if kernels is None:
    kernels = [(variant, name) for variant in variants for name in configs]
  commands = []
  for *_, kernel, entry in _kernel_commands(nvcc, cutlass, ffi, out_dir,
                                            kernels, configs):
    commands += [kernel, entry]
  return commands + _core_commands(nvcc, ffi, out_dir)


def _output(cmd) -> pathlib.Path:
  return pathlib.Path(cmd[cmd.index("-o") + 1])


def _run(cmd) -> subprocess.CompletedProcess:
  """Runs one nvcc command, writing under a partial name of this process
  and renaming it once whole: an object or library directory that outlives
  a killed build never holds a truncated file that a later build would use,
  and two builds sharing it never write one file."""
  out = _output(cmd)
  partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
  i = cmd.index("-o") + 1
  done = subprocess.run([*cmd[:i], str(partial), *cmd[i + 1:]],
                        capture_output=True, text=True)
  if done.returncode == 0:
    os.replace(partial, out)
  return done


def _link_command(nvcc, objects, out: pathlib.Path):
  # cudart linked statically: the library needs only the driver at run time.
  return [nvcc, "-shared", "-cudart", "static",
          "-gencode", "arch=compute_90a,code=sm_90a",
          *map(str, objects), "-o", str(out)]


def _run_all(commands, jobs: int, log=print):
  failures = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    for cmd, done in zip(commands, pool.map(_run, commands)):
      name = _output(cmd).name
      log(f"  {'ok' if done.returncode == 0 else 'FAILED'}: {name}")
      if done.returncode != 0:
        failures.append(f"$ {' '.join(cmd)}\n{done.stderr[-4000:]}")
  if failures:
    raise RuntimeError("cuda_ffi build failed:\n" + "\n".join(failures))


# nvcc's return codes when Ctrl-C or a termination stopped it.
_STOP_SIGNALS = (-2, -15)


def _minutes(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 60}m{seconds % 60:02d}s"


class _Build:
  """One build of the library into `where`: a pool of `jobs` threads takes
  steps in priority order (the main library's objects, then the kernels a
  process waits for, then the rest in planned_kernels' order), links the
  main library once its objects exist and each kernel's own library as
  soon as it is compiled, and the whole build's kernel library at the end.
  Steps whose output exists are skipped, so a stopped build resumes."""

  def __init__(self, where, objects, jobs, log):
    self.where, self.jobs, self.log = where, jobs, log
    self.nvcc, cutlass, ffi = _inputs()
    self.core = _kept_objects(_core_commands(self.nvcc, ffi, where),
                              self.nvcc, cutlass, ffi, objects)
    self.kernels = []
    for variant, name, kernel, entry in _kernel_commands(
        self.nvcc, cutlass, ffi, where, planned_kernels(), kernel_configs()):
      kernel, entry = _kept_objects([kernel, entry], self.nvcc, cutlass, ffi,
                                    objects)
      code = kernel_configs()[name]
      self.kernels.append((variant, code, kernel, entry))
    self.lock = threading.Lock()
    self.failures: list[str] = []
    self.core_linked = False
    self.stopping = False
    self.started = time.monotonic()
    self.done = self.done_here = 0
    self.total = len(self.core) + len(self.kernels)

  def _plugin(self, variant, code) -> pathlib.Path:
    ta, tb, f32 = variant
    return self.where / KERNEL_DIR / f"det_gemm_{ta}{tb}{f32}_{code}.so"

  def _wanted(self) -> set:
    try:
      lines = (self.where / WANTED_NAME).read_text().split("\n")
    except OSError:
      return set()
    return {tuple(map(int, line.split())) for line in lines if line.strip()}

  def _next(self, pending):
    """The step to run next (under the lock): a main-library object first,
    then a wanted kernel, then the planned order."""
    if not pending:
      return None
    wanted = self._wanted()
    for i, step in enumerate(pending):
      if step[0] == "core":
        return pending.pop(i)
    for i, step in enumerate(pending):
      (ta, tb, f32), code = step[1][0], step[1][1]
      if (ta, tb, f32, code) in wanted:
        return pending.pop(i)
    return pending.pop(0)

  def _progress(self, what: str, complete: bool = False) -> None:
    elapsed = time.monotonic() - self.started
    left = self.total - self.done
    rate = self.done_here / elapsed if self.done_here and elapsed > 0 else 0
    estimate = (left / rate) if rate else None
    record = {"pid": os.getpid(), "total": self.total, "done": self.done,
              "elapsed_s": round(elapsed, 1),
              "left_s": None if estimate is None else round(estimate, 1),
              "complete": complete, "last": what,
              "failed": len(self.failures), "time": time.time()}
    tmp = self.where / f"{PROGRESS_NAME}.{os.getpid()}.partial"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, self.where / PROGRESS_NAME)
    about = "" if estimate is None else f", about {_minutes(estimate)} left"
    self.log(f"rlk cuda_ffi build: [{self.done}/{self.total}] "
             f"{_minutes(elapsed)}{about}: {what}")

  def _step(self, step) -> None:
    kind, item = step
    began = time.monotonic()
    if kind == "core":
      done = _run(item) if not _output(item).is_file() else None
      what = _output(item).name.split("-")[0]
    else:
      variant, code, kernel, entry = item
      done = None
      for cmd in (entry, kernel):
        if not _output(cmd).is_file():
          done = _run(cmd)
          if done.returncode != 0:
            break
      plugin = self._plugin(variant, code)
      if (done is None or done.returncode == 0) and not plugin.is_file():
        done = _run(_link_command(self.nvcc, [_output(kernel),
                                              _output(entry)], plugin))
      what = f"det_gemm kernel {''.join(map(str, variant))} {code}"
    what += f" ({time.monotonic() - began:.1f} s)"
    with self.lock:
      if (done is not None and done.returncode in _STOP_SIGNALS
          or self.stopping):
        # nvcc stopped by Ctrl-C (it reaches the whole process group) or a
        # termination, or the build stopping: not a failure, the step is
        # simply not done. (Killed otherwise, by the OOM killer say, it is.)
        self.stopping = True
        self.log(f"rlk cuda_ffi build: stopped ({what})")
        return
      if done is not None and done.returncode != 0:
        self.failures.append(f"$ {' '.join(done.args)}\n"
                             f"{done.stderr[-4000:]}")
        what += " FAILED"
      self.done += 1
      self.done_here += 1
      self._progress(what)
      core_left = any(not _output(c).is_file() for c in self.core)
      link_core = (kind == "core" and not core_left and not self.failures
                   and not self.core_linked
                   and not (self.where / LIBRARY_NAME).is_file())
      # (Two steps may see the last object appear at once: one links.)
      self.core_linked |= link_core
    if link_core:
      self._link(self.core, LIBRARY_NAME)

  def _link(self, objects, name) -> None:
    done = _run(_link_command(
        self.nvcc, [_output(c) for c in objects], self.where / name))
    if done.returncode != 0:
      self.failures.append(f"linking {name}")
      raise RuntimeError(f"cuda_ffi build: linking {name} failed:\n"
                         f"{done.stderr[-4000:]}")

  def run(self) -> None:
    try:
      self._run()
    except BaseException as e:
      # A build that failed is not restarted by first use over and over
      # (`python -m cuda_ffi.build` tries again); one stopped (Ctrl-C, a
      # termination) is: what failed meanwhile were steps the stop killed.
      if isinstance(e, (KeyboardInterrupt, SystemExit)):
        self.stopping = True
        self.failures.clear()
        self._progress("stopped")
      else:
        if not self.failures:  # (not a step's own failure: one of its own)
          self.failures.append(f"{type(e).__name__}: {e}")
        self._progress("failed")
      raise

  def _run(self) -> None:
    (self.where / KERNEL_DIR).mkdir(parents=True, exist_ok=True)
    pending = [("core", c) for c in self.core
               if not _output(c).is_file()]
    self.done = len(self.core) - len(pending)
    for item in self.kernels:
      variant, code, kernel, entry = item
      if (self._plugin(variant, code).is_file()
          or (self.where / KERNELS_NAME).is_file()):
        self.done += 1
      else:
        pending.append(("kernel", item))
    self.log(f"rlk: building the cuda_ffi SM90 library ({len(self.core)} "
             f"objects and {len(self.kernels)} det_gemm kernels; "
             f"{len(pending)} of {self.total} steps to do, {self.jobs} jobs; "
             f"a one-time cost, cached in {self.where}; a stopped build "
             f"resumes)")
    if (not any(kind == "core" for kind, _ in pending)
        and not (self.where / LIBRARY_NAME).is_file()):
      # Its objects are kept already (another key's build made them, or a
      # stop came between the last of them and the link): linked first.
      self.core_linked = True
      self._link(self.core, LIBRARY_NAME)

    def worker():
      # Past a failed step too: every object that compiles is kept for the
      # next build, which then has only the failed ones to do. Not past a
      # stop (Ctrl-C): no step starts after it.
      while not self.stopping:
        with self.lock:
          step = self._next(pending)
        if step is None:
          return
        self._step(step)

    with concurrent.futures.ThreadPoolExecutor(max_workers=self.jobs) as pool:
      futures = [pool.submit(worker) for _ in range(self.jobs)]
      try:
        for future in futures:
          future.result()
      except BaseException:  # KeyboardInterrupt, say: steps in flight end
        self.stopping = True
        raise
    if self.stopping:
      raise KeyboardInterrupt("cuda_ffi build stopped")
    if self.failures:
      raise RuntimeError("cuda_ffi build failed:\n" + "\n".join(self.failures))
    if not (self.where / KERNELS_NAME).is_file():
      self._link([c for _, _, kernel, entry in self.kernels
                  for c in (kernel, entry)], KERNELS_NAME)
    shutil.rmtree(self.where / KERNEL_DIR, ignore_errors=True)
    self._progress("complete", complete=True)


@contextlib.contextmanager
def _builder_lock(where: pathlib.Path, blocking: bool = False):
  """Held by the one build of `where` that runs (yields False, holding
  nothing, where another build holds it and `blocking` is False)."""
  import fcntl
  where.mkdir(parents=True, exist_ok=True)
  with open(where / ".build.lock", "a") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
      yield False
      return
    try:
      yield True
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def builder_running(where: pathlib.Path) -> bool:
  """Whether a build of `where` runs now (in any process). False where the
  folder cannot be written (no build can run there either)."""
  try:
    with _builder_lock(where) as mine:
      return not mine
  except OSError:
    return False


def build(jobs: int | None = None, log=print,
          objects: str | os.PathLike | None = None,
          wait: bool = True) -> pathlib.Path:
  """Builds the library unless the cache already has it whole (or
  RLK_CUDA_FFI_LIB names a prebuilt one); returns the main library's path.

  `objects`: the directory that keeps the compiled objects and is reused
  (default: ``objects`` beside the cached libraries): an object already
  there is not compiled again, so a build stopped part-way (a time limit,
  Ctrl-C, a preempted job) resumes where it stopped, objects compiled on
  another machine can be carried in, and a change to one source
  recompiles only its own objects (each is named by a key of its inputs:
  _kept_objects). Where another process is building, waits for it
  (printing its progress), or with `wait` False returns at once."""
  if os.environ.get("RLK_CUDA_FFI_LIB"):
    return pathlib.Path(os.environ["RLK_CUDA_FFI_LIB"])
  if _prebuilt_dir() is not None:
    return PREBUILT_DIR / LIBRARY_NAME
  nvcc, cutlass, ffi = _inputs()
  where = cache_dir() / build_key(nvcc, cutlass, ffi)
  objects = (pathlib.Path(objects) if objects is not None
             else where.parent / "objects")
  tries = 0
  while not complete(where):
    with _builder_lock(where) as mine:
      if mine:
        objects.mkdir(parents=True, exist_ok=True)
        _Build(where, objects, jobs or os.cpu_count() or 1, log).run()
        break
    tries += 1
    if not wait and tries > 10:
      break  # another build runs
    if not wait:
      # (Another process may hold the lock a moment to ask whether a
      # build runs: builder_running.)
      time.sleep(0.3)
      continue
    seen = None
    while builder_running(where):
      line = status_line(where)
      if line != seen:
        log(f"rlk: waiting for another build: {line}")
        seen = line
      time.sleep(2)
  return where / LIBRARY_NAME


def want(variant, code: int) -> None:
  """Asks a running (or the next) build to compile this kernel next."""
  where = _library_dir()
  if where is None:
    return
  where.mkdir(parents=True, exist_ok=True)
  with open(where / WANTED_NAME, "a") as f:
    f.write(" ".join(map(str, (*variant, code))) + "\n")


def write_prebuilt(into: pathlib.Path, jobs: int | None = None,
                   log=print) -> list[pathlib.Path]:
  """Builds the whole library (or finds it in the cache) and copies it,
  with its record, into `into` (a wheel's cuda_ffi/prebuilt/: setup.py).
  Returns the files written."""
  lib = build(jobs, log=log)
  into.mkdir(parents=True, exist_ok=True)
  written = []
  for name in (LIBRARY_NAME, KERNELS_NAME):
    shutil.copy2(lib.parent / name, into / name)
    written.append(into / name)
  record = into / PREBUILT_RECORD
  record.write_text(json.dumps(prebuilt_record(_inputs()[2]), indent=1))
  return written + [record]


SPAWN_BACKOFF_S = 60.0


def start_background() -> str:
  """Starts a build in a low-priority process of its own unless one runs
  or the library is whole; returns where it logs. Raises BuildUnavailable
  when this machine cannot build."""
  nvcc, cutlass, ffi = _inputs()
  where = cache_dir() / build_key(nvcc, cutlass, ffi)
  if not complete(where) and not builder_running(where):
    progress = status(where)["progress"] or {}
    if progress.get("failed"):
      raise BuildUnavailable(f"the last build of these sources failed (log "
                             f"{where / LOG_NAME}); `python -m "
                             f"cuda_ffi.build` tries again")
    where.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # The worker imports this package from where this process did.
    package_root = str(pathlib.Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    # Never one spawn after another: a worker that dies before it builds
    # (and records nothing) is not started again within SPAWN_BACKOFF_S.
    spawned = where / ".spawned"
    try:
      if time.time() - spawned.stat().st_mtime < SPAWN_BACKOFF_S:
        return str(where / LOG_NAME)
    except FileNotFoundError:
      pass
    spawned.touch()
    with open(where / LOG_NAME, "a") as out:
      worker = subprocess.Popen(
          [sys.executable, "-m", "cuda_ffi.build", "--worker"],
          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
          env=env, start_new_session=True)
    # Returns once the worker holds the build's lock (a second or two), so
    # that a caller waiting for the build (cuda_ffi.unavailable_reason)
    # never mistakes a build not yet started for no build.
    deadline = time.monotonic() + 30
    while (worker.poll() is None and not builder_running(where)
           and not complete(where) and time.monotonic() < deadline):
      time.sleep(0.1)
  return str(where / LOG_NAME)


def status(where: pathlib.Path | None = None) -> dict:
  """What is built where the current sources' library lives, and the
  progress of a build that runs there."""
  where = where or _library_dir()
  if where is None:
    return {"where": None}
  try:
    progress = json.loads((where / PROGRESS_NAME).read_text())
  except (OSError, ValueError):
    progress = None
  kernels = ("all" if (where / KERNELS_NAME).is_file()
             else len(kernel_libraries(where)))
  return {"where": str(where), "library": (where / LIBRARY_NAME).is_file(),
          "kernels": kernels, "planned": len(planned_kernels()),
          "complete": complete(where),
          "building": where.is_dir() and builder_running(where),
          "progress": progress}


def status_line(where: pathlib.Path | None = None) -> str:
  s = status(where)
  if s["where"] is None:
    return "no CUDA toolchain here: nothing to build"
  if s["complete"]:
    return f"built: {s['where']} (every one of {s['planned']} kernels)"
  p = s["progress"] or {}
  state = ("building" if s["building"]
           else "stopped part-way (the next use or build resumes it)"
           if p else "not built")
  line = (f"{state}: main library {'built' if s['library'] else 'not yet'}, "
          f"{s['kernels']} of {s['planned']} kernels ({s['where']})")
  if s["building"] and p:
    left = p.get("left_s")
    line += (f"; step {p['done']} of {p['total']}, "
             f"{_minutes(p['elapsed_s'])} in"
             + ("" if left is None else f", about {_minutes(left)} left"))
  return line


def check(jobs: int | None = None, variants=VARIANTS, configs=None,
          log=print, kernels=None) -> None:
  """Compiles the sources for sm_90a into a scratch directory (no link):
  every non-kernel source once, and the kernel file (with its entry) once
  per variant in `variants` and config in `configs` (names of
  kernel_configs(); default all), or, with `kernels`, once per (variant,
  config name) pair in it."""
  nvcc, cutlass, ffi = _inputs()
  chosen = kernel_configs()
  if configs is not None and kernels is None:
    chosen = {name: chosen[name] for name in configs}
  with tempfile.TemporaryDirectory() as tmp:
    _run_all(_compile_commands(nvcc, cutlass, ffi, pathlib.Path(tmp),
                               variants, chosen, kernels),
             jobs or os.cpu_count() or 1, log)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="compile only, into a scratch directory")
  parser.add_argument("--status", action="store_true",
                      help="say what is built and how a running build goes")
  parser.add_argument("--worker", action="store_true",
                      help="the background build (started by first use)")
  parser.add_argument("--jobs", type=int, default=None)
  parser.add_argument("--objects", default=None,
                      help="keep the objects in this directory and reuse "
                      "those already there (default: objects/ in the "
                      "cache, so a stopped build resumes)")
  args = parser.parse_args(argv)
  try:
    if args.status:
      print(status_line())
    elif args.check:
      check(args.jobs)
      print("cuda_ffi sources compile for sm_90a")
    elif args.worker:
      os.nice(19)  # the background build: the user's own work comes first
      build(args.jobs, objects=args.objects, wait=False)
      where = _library_dir()
      if where is not None and not complete(where):
        # Ended without the library and without a build's own record
        # (another build held the lock, say): said, and not a failure.
        print(f"rlk cuda_ffi build: worker ended: {status_line(where)}")
    else:
      print(build(args.jobs, objects=args.objects))
  except BuildUnavailable as e:
    print(f"cuda_ffi: cannot build: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
