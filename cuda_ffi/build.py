"""Builds the SM90 det_gemm library (CUTLASS headers from the `nvidia-cutlass`
wheel, the XLA FFI headers from jaxlib) into a cache keyed by everything that
goes into it.

    python -m cuda_ffi.build            # build (or find) the library, print its path
    python -m cuda_ffi.build --check    # compile every source for sm_90a, link nothing
    python -m cuda_ffi.build --objects DIR  # keep the objects in DIR (default: the cache)

Nothing is downloaded: the inputs are the `nvcc` on PATH (or $CUDA_HOME), the
installed `nvidia-cutlass` wheel ($RLK_CUTLASS_DIR overrides) and jaxlib. The
kernels compile once per (operand layout, output dtype) variant, in parallel.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

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
LIBRARY_NAME = "librlk_cuda_ffi.so"
# (transpose_a, transpose_b, f32 output): every product det_gemm's forward and
# backward can ask for.
VARIANTS = [(ta, tb, f32) for ta in (0, 1) for tb in (0, 1) for f32 in (0, 1)]


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
  h = hashlib.sha256()
  for path in sorted(CSRC.iterdir()):
    h.update(path.name.encode())
    h.update(path.read_bytes())
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


def library_path() -> pathlib.Path | None:
  """The cached library for the current sources, if it was built."""
  if os.environ.get("RLK_CUDA_FFI_LIB"):
    return pathlib.Path(os.environ["RLK_CUDA_FFI_LIB"])
  try:
    key = build_key(*_inputs())
  except BuildUnavailable:
    return None
  path = cache_dir() / key / LIBRARY_NAME
  return path if path.is_file() else None


def _compile_commands(nvcc, cutlass, ffi, out_dir: pathlib.Path,
                      variants=VARIANTS, configs=None, kernels=None):
  """nvcc command lines, one per object, writing into `out_dir`: a kernel
  object per variant and config (or per (variant, config name) pair of
  `kernels`), then the other sources once each."""
  includes = ["-I", str(CSRC), "-isystem", str(cutlass / "include"),
              "-isystem", str(cutlass / "tools" / "util" / "include")]
  commands = []
  configs = kernel_configs() if configs is None else configs
  if kernels is None:
    kernels = [(variant, name) for variant in variants for name in configs]
  extended = extended_mma_configs()
  # One object per (variant, config): ~40 s each, so the build spreads over
  # every core instead of waiting on eight long ones.
  for (ta, tb, f32), name in kernels:
    code = configs[name]
    obj = out_dir / f"det_gemm_kernels_{ta}{tb}{f32}_{code}.o"
    atoms = (["-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"]
             if name in extended else [])
    commands.append([nvcc, *NVCC_FLAGS, *includes, *atoms,
                     f"-DRLK_TA={ta}", f"-DRLK_TB={tb}",
                     f"-DRLK_OUT_F32={f32}", f"-DRLK_CONFIG={code}", "-c",
                     str(KERNEL_SOURCE), "-o", str(obj)])
  pack_kernels, pack_api = PACK_SOURCES
  commands.append([nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-c", str(pack_kernels),
                   "-o", str(out_dir / "pack_rows_kernels.o")])
  commands.append([nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-isystem", str(ffi),
                   "-c", str(LOGP_SOURCE),
                   "-o", str(out_dir / "linear_logp_kernels.o")])
  commands.append([nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-isystem", str(ffi),
                   "-c", str(ATTENTION_SOURCE),
                   "-o", str(out_dir / "attention_sm90_kernels.o")])
  commands.append([nvcc, *NVCC_FLAGS, "-c", str(ROW_REDUCE_SOURCE),
                   "-o", str(out_dir / "row_reduce_kernels.o")])
  # Host code, compiled through nvcc so CUDA's headers are found wherever
  # the toolkit lives.
  for source in (API_SOURCE, pack_api):
    commands.append([nvcc, "-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-I",
                     str(CSRC), "-isystem", str(ffi), "-c", str(source),
                     "-o", str(out_dir / (source.stem + ".o"))])
  return commands


def _output(cmd) -> pathlib.Path:
  return pathlib.Path(cmd[cmd.index("-o") + 1])


def _run_all(commands, jobs: int, log=print):
  def run(cmd):
    # Written under a partial name of this process and renamed once whole,
    # so an object directory that outlives a killed build
    # (build(objects=...)) never holds a truncated object that a later
    # build would link, and two builds sharing it never write one file.
    out = _output(cmd)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    i = cmd.index("-o") + 1
    done = subprocess.run([*cmd[:i], str(partial), *cmd[i + 1:]],
                          capture_output=True, text=True)
    if done.returncode == 0:
      os.replace(partial, out)
    return cmd, done
  failures = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    for cmd, done in pool.map(run, commands):
      name = _output(cmd).name
      log(f"  {'ok' if done.returncode == 0 else 'FAILED'}: {name}")
      if done.returncode != 0:
        failures.append(f"$ {' '.join(cmd)}\n{done.stderr[-4000:]}")
  if failures:
    raise RuntimeError("cuda_ffi build failed:\n" + "\n".join(failures))


def build(jobs: int | None = None, log=print,
          objects: str | os.PathLike | None = None) -> pathlib.Path:
  """Builds the library unless the cache already has it (or RLK_CUDA_FFI_LIB
  names a prebuilt one); returns its path.

  `objects`: the directory that keeps the compiled objects and is reused
  (default: ``objects`` beside the cached libraries): an object already
  there is not compiled again, so a build stopped part-way (a time limit,
  Ctrl-C, a preempted job) resumes where it stopped, objects compiled on
  another machine can be carried in, and a change to one source
  recompiles only its own objects (each is named by a key of its inputs:
  _kept_objects). Processes sharing it never write one file (each writes
  its own partial name and renames it whole) and never link a partial
  object."""
  if os.environ.get("RLK_CUDA_FFI_LIB"):
    return pathlib.Path(os.environ["RLK_CUDA_FFI_LIB"])
  nvcc, cutlass, ffi = _inputs()
  final = cache_dir() / build_key(nvcc, cutlass, ffi)
  lib = final / LIBRARY_NAME
  if lib.is_file():
    return lib
  final.parent.mkdir(parents=True, exist_ok=True)
  jobs = jobs or os.cpu_count() or 1
  with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
    tmp = pathlib.Path(tmp)
    commands = _compile_commands(nvcc, cutlass, ffi, tmp)
    objects = (pathlib.Path(objects) if objects is not None
               else final.parent / "objects")
    objects.mkdir(parents=True, exist_ok=True)
    commands = _kept_objects(commands, nvcc, cutlass, ffi, objects)
    todo = [c for c in commands if not _output(c).is_file()]
    log(f"rlk: building the cuda_ffi SM90 det_gemm library ({len(VARIANTS)} "
        f"layouts x {len(kernel_configs())} kernel configs, {len(todo)} of "
        f"{len(commands)} objects to compile, {jobs} jobs; a one-time cost, "
        f"cached in {final}; objects kept in {objects}, where a stopped "
        f"build resumes)")
    _run_all(todo, jobs, log)
    objs = sorted(str(_output(c)) for c in commands)
    # cudart linked statically: the library needs only the driver at run time.
    subprocess.run([nvcc, "-shared", "-cudart", "static",
                    "-gencode", "arch=compute_90a,code=sm_90a",
                    *objs, "-o", str(tmp / LIBRARY_NAME)], check=True,
                   capture_output=True, text=True)
    staged = tmp / "staged"
    staged.mkdir()
    shutil.move(str(tmp / LIBRARY_NAME), staged / LIBRARY_NAME)
    try:
      staged.rename(final)  # atomic: concurrent builders never see half a dir
    except OSError:
      if not lib.is_file():
        raise
  return lib


def check(jobs: int | None = None, variants=VARIANTS, configs=None,
          log=print, kernels=None) -> None:
  """Compiles the sources for sm_90a into a scratch directory (no link):
  every non-kernel source once, and the kernel file once per variant in
  `variants` and config in `configs` (names of kernel_configs(); default
  all), or, with `kernels`, once per (variant, config name) pair in it."""
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
  parser.add_argument("--jobs", type=int, default=None)
  parser.add_argument("--objects", default=None,
                      help="keep the objects in this directory and reuse "
                      "those already there (default: objects/ in the "
                      "cache, so a stopped build resumes)")
  args = parser.parse_args(argv)
  try:
    if args.check:
      check(args.jobs)
      print("cuda_ffi sources compile for sm_90a")
    else:
      print(build(args.jobs, objects=args.objects))
  except BuildUnavailable as e:
    print(f"cuda_ffi: cannot build: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
