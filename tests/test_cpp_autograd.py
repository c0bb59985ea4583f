"""The torch bridge's C++ autograd route (``rlk::det_mm_sm90``) on a CPU
machine: its source compiles against the installed torch's headers, its
table of backward products is the one the Python route runs, and it stays
out of the way where it does not apply. The GPU tests check its bits."""

import math
import pathlib
import subprocess

import numpy as np
import pytest
import torch

import rlk_torch_bridge as rtb
from cuda_ffi import build
from rlk_torch_bridge import (_cpp_extension, _gemm_op, _gemm_routes,
                              _library, _sm90)


NO_NVCC = build.toolchain_reason(cutlass=False)


@pytest.mark.skipif(NO_NVCC is not None, reason=f"no CUDA toolchain: {NO_NVCC}")
@pytest.mark.parametrize("source", _cpp_extension.SOURCES, ids=lambda s: s.stem)
def test_the_sources_compile_against_the_installed_torch(tmp_path, source):
  include = pathlib.Path(torch.__file__).parent / "include"
  # A CPU build of torch ships c10/cuda's headers without the one header its
  # CUDA build generates; an empty stand-in is enough to check the syntax.
  macros = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
  macros.parent.mkdir(parents=True)
  macros.write_text("#pragma once\n")
  done = subprocess.run(
      [build.find_nvcc(), "-x", "c++", "-std=c++20", "-Xcompiler",
       "-fsyntax-only", "-Xcompiler", "-Wall", "-I", str(include),
       "-I", str(include / "torch" / "csrc" / "api" / "include"),
       "-I", str(tmp_path), "-c", str(source), "-o",
       str(tmp_path / "unused.o")], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "warning" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("transpose_b", [False, True])
def test_backward_products_are_the_python_routes(monkeypatch, transpose_b):
  # What the Python autograd.Function launches for dA and dB, read from its
  # calls, against the C++ route's table (whose configs are chosen for it).
  lead, k, n = (3, 7), 40, 24
  rng = np.random.default_rng(0)
  a = torch.from_numpy(rng.standard_normal((*lead, k)).astype(np.float32))
  b = torch.from_numpy(rng.standard_normal(
      (n, k) if transpose_b else (k, n)).astype(np.float32))
  calls = []
  real = _library.below_autograd

  def record(op, x, y, ta, tb, *rest):
    lead_dims, kk, nn = _gemm_routes.dims(x.shape, y.shape, ta, tb)
    calls.append((math.prod(lead_dims), nn, kk, ta, tb, False))
    return real(op, x, y, ta, tb, *rest)

  monkeypatch.setattr(_library, "below_autograd", record)
  out = rtb.det_gemm(a.requires_grad_(), b.requires_grad_(),
                     transpose_b=transpose_b)
  calls.clear()  # the forward's call: the rest are the backward's
  out.backward(torch.ones_like(out))
  want = _sm90._products(math.prod(lead), n, k, transpose_b, False)
  assert calls == list(want[1:])


def test_on_by_default_and_never_taken_on_cpu(monkeypatch):
  import os
  assert _cpp_extension.enabled() == (os.environ.get(_cpp_extension.ENV) != "0")
  monkeypatch.setattr(_cpp_extension, "_switch", [True])
  taken = []
  monkeypatch.setattr(_gemm_op, "cpp_run",
                      lambda *args: taken.append(args))
  x = torch.ones(4, 8)
  assert torch.equal(rtb.det_gemm(x, torch.ones(8, 2)), torch.full((4, 2), 8.0))
  assert not taken  # CPU tensors: the operator route
