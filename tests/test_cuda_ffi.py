"""cuda_ffi on a machine without a Hopper GPU: it imports, says why it is
unavailable, rlk_jax never picks it, and its sources compile for sm_90a."""

import pathlib
import subprocess

import jax.numpy as jnp
import pytest

import cuda_ffi
import rlk_jax
from cuda_ffi import build
from conftest import ON_GPU


@pytest.mark.skipif(ON_GPU, reason="the CPU-machine view of cuda_ffi")
def test_unavailable_on_cpu_with_the_reason():
  reason = rlk_jax.implementations("det_gemm", platform="cpu")["cuda_ffi"]
  assert reason == "needs a CUDA GPU (platform is 'cpu')"
  assert rlk_jax.selected_implementation("det_gemm") == "xla"
  with pytest.raises(RuntimeError, match="'cuda_ffi' is not available on "
                                         "platform 'cpu': needs a CUDA GPU"):
    rlk_jax.det_gemm(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16),
                     implementation="cuda_ffi")


@pytest.mark.parametrize("args,reason", [
    ((16, 64, 64, False, False, jnp.bfloat16, jnp.bfloat16), None),
    ((3, 64, 64, True, False, jnp.bfloat16, jnp.float32), "A rows 3"),
    ((16, 64, 60, False, False, jnp.bfloat16, jnp.bfloat16), "A rows 60"),
    ((16, 64, 60, True, False, jnp.bfloat16, jnp.bfloat16), None),
    ((16, 64, 60, True, True, jnp.bfloat16, jnp.bfloat16), "B rows 60"),
    ((16, 60, 64, False, True, jnp.bfloat16, jnp.bfloat16), "C rows 60"),
    ((16, 64, 64, False, False, jnp.float16, jnp.float16), "must be bfloat16"),
    ((16, 64, 64, False, False, jnp.bfloat16, jnp.float16), "bfloat16 or float32"),
    ((16, 64, 0, False, False, jnp.bfloat16, jnp.bfloat16), "empty reduction"),
])
def test_operand_reason_mirrors_the_tma_pitch_rules(args, reason):
  got = cuda_ffi.operand_reason(*args)
  if reason is None:
    assert got is None
  else:
    assert reason in got


@pytest.mark.parametrize("kwargs", [dict(config="big"), dict(swizzle=3),
                                    dict(raster=5)])
def test_unknown_config_or_tile_order_is_refused_before_any_launch(kwargs):
  x = jnp.ones((8, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown config="):
    cuda_ffi.matmul(x, x, transpose_a=False, transpose_b=False,
                    out_dtype=jnp.bfloat16, **kwargs)


def test_build_reports_a_missing_toolchain(monkeypatch, tmp_path):
  monkeypatch.delenv("RLK_CUDA_FFI_LIB", raising=False)  # no prebuilt library
  monkeypatch.setenv("PATH", str(tmp_path))
  monkeypatch.setenv("CUDA_HOME", str(tmp_path))
  monkeypatch.setattr(build.os.path, "expanduser", lambda p: str(tmp_path))
  monkeypatch.setattr(build, "find_nvcc", build.find_nvcc)
  monkeypatch.setattr(build.shutil, "which", lambda name: None)
  real_access = build.os.access
  monkeypatch.setattr(build.os, "access", lambda p, mode: (
      False if str(p).endswith("nvcc") else real_access(p, mode)))
  assert build.main([]) == 2
  with pytest.raises(build.BuildUnavailable, match="nvcc not found"):
    build.find_nvcc()


@pytest.mark.skipif(build.toolchain_reason() is not None,
                    reason=f"no CUDA toolchain here: {build.toolchain_reason()}")
def test_sources_compile_for_sm90a():
  # Both values of every template switch (operand layouts, output dtype),
  # both schedules, cluster shapes along both modes (ping-pong in a cluster
  # too), the swapped tile, the custom epilogue subtile and the tile wider
  # than one TMA box (320 columns): 7 of the 172 objects (about 40 s of
  # nvcc each, so CI stays short). `python -m cuda_ffi.build --check`
  # compiles all; every device run builds all.
  build.check(jobs=2, variants=[(0, 0, 0)],
              configs=["kCooperative128x256", "kCooperative128x320",
                       "kPingpong64x128Cluster4x2", "kSwapPingpong64x32",
                       "kCooperative128x256Cluster1x2"], log=lambda *_: None)
  build.check(jobs=2, variants=[(1, 1, 1)],
              configs=["kSwapPingpong64x32", "kCooperative128x256Cluster1x2"],
              log=lambda *_: None)


def test_build_resumes_from_kept_objects_and_never_links_a_partial_one(
    tmp_path, monkeypatch):
  # nvcc stands in: it writes its -o file, or part of it and fails for one
  # object, as a build killed mid-compile would leave it.
  monkeypatch.delenv("RLK_CUDA_FFI_LIB", raising=False)
  monkeypatch.setenv("RLK_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(build, "_inputs", lambda: ("nvcc", tmp_path, tmp_path))
  # The kernel objects' key leaves out jaxlib's FFI headers.
  monkeypatch.setattr(build, "build_key",
                      lambda nvcc, cutlass, ffi: "kern" if ffi is None else "all")
  compiled, linked, failing = [], [], {"det_gemm_kernels_000_1.o"}

  def nvcc(cmd, capture_output=True, text=True, check=False):
    out = pathlib.Path(cmd[cmd.index("-o") + 1])
    out.write_bytes(b"part")
    final = out.name.split(".o.")[0] + ".o" if ".o." in out.name else out.name
    if "-shared" in cmd:
      linked.append(cmd[cmd.index("arch=compute_90a,code=sm_90a") + 1:
                        cmd.index("-o")])
    else:
      compiled.append(final)
    rc = 1 if final in failing else 0
    if rc and check:
      raise subprocess.CalledProcessError(rc, cmd)
    return subprocess.CompletedProcess(cmd, rc, "", "nvcc died")

  monkeypatch.setattr(build.subprocess, "run", nvcc)
  objects = tmp_path / "objects"
  commands = build._compile_commands("nvcc", tmp_path, tmp_path,
                                     objects / "kern",
                                     ffi_out_dir=objects / "all")
  expected = [str(build._output(c)) for c in commands]
  names = sorted(pathlib.Path(p).name for p in expected)
  assert (objects / "all" / "det_gemm_api.o") in map(build._output, commands)
  carried = objects / "kern" / "det_gemm_kernels_111_1.o"
  carried.parent.mkdir(parents=True)
  carried.write_bytes(b"from another machine")
  (objects / "other-sources").mkdir()  # another key's objects: not used
  (objects / "other-sources" / "det_gemm_kernels_000_2.o").write_bytes(b"x")
  with pytest.raises(RuntimeError, match="det_gemm_kernels_000_1.o"):
    build.build(jobs=4, log=lambda *_: None, objects=objects)
  assert not linked
  assert sorted(compiled) == [n for n in names if n != carried.name]
  assert not (objects / "kern" / "det_gemm_kernels_000_1.o").exists()
  assert list((objects / "kern").glob("det_gemm_kernels_000_1.o.*.partial"))
  # Another build's partial object, still being written: never linked.
  (objects / "kern" / "det_gemm_kernels_000_2.o.999.partial").write_bytes(b"")
  compiled.clear()
  failing.clear()
  lib = build.build(jobs=4, log=lambda *_: None, objects=objects)
  assert compiled == ["det_gemm_kernels_000_1.o"]  # resumed: the one missing
  assert linked == [sorted(expected)]  # every object once, no partial one
  assert lib == tmp_path / "cache" / "cuda_ffi" / "all" / build.LIBRARY_NAME


def test_every_source_is_part_of_the_build():
  sources = {p.name for p in build.CSRC.iterdir()}
  assert sources == {"det_gemm_sm90.h", "device_info.h", "ffi_traits.h",
                     build.KERNEL_SOURCE.name,
                     build.API_SOURCE.name, "pack_rows.h",
                     build.LOGP_SOURCE.name,
                     *(p.name for p in build.PACK_SOURCES)}
  assert pathlib.Path(build.KERNEL_SOURCE).is_file()
