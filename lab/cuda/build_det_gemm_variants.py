"""Builds lab/cuda/det_gemm_variants.cu, one shared library per
variant, with the library's own nvcc flags (cuda_ffi.build.NVCC_FLAGS):
the variants must compile as the shipped kernels do to be timed against
them (without -DNDEBUG, CUTLASS's asserts made ptxas serialize the wgmma
pipeline of some variants, C7510). Runs on the CPU machine; carry the
directory to the device.

    PYTHONPATH=$PWD python lab/cuda/build_det_gemm_variants.py <dir> 0,17,27
"""

from __future__ import annotations

import os
import pathlib
import sys

from cuda_ffi import build

SOURCE = pathlib.Path(__file__).with_name("det_gemm_variants.cu")


def commands(out_dir: pathlib.Path, indices) -> list[list[str]]:
  nvcc, cutlass = build.find_nvcc(), build.find_cutlass()
  includes = ["-I", str(build.CSRC), "-isystem", str(cutlass / "include"),
              "-isystem", str(cutlass / "tools" / "util" / "include")]
  return [[nvcc, *build.NVCC_FLAGS, "-shared", *includes,
           f"-DRLK_VARIANT={n}", str(SOURCE), "-o",
           str(out_dir / f"variant_{n}.so")] for n in indices]


def main(argv) -> int:
  out_dir = pathlib.Path(argv[1])
  out_dir.mkdir(parents=True, exist_ok=True)
  indices = [int(n) for n in argv[2].split(",")]
  build._run_all(commands(out_dir, indices), os.cpu_count() or 1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
