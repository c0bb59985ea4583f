"""cuda_ffi on a machine without a Hopper GPU: it imports, says why it is
unavailable, rlk_jax never picks it, and its sources compile for sm_90a."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

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


def _tile(name: str) -> tuple[int, int] | None:
  """A config's tile (M, N) as its name gives it; None for "auto" and the
  split (other configs' kernels)."""
  tile = re.search(r"_(\d+)x(\d+)", name)
  return tuple(map(int, tile.groups())) if tile else None


def test_every_config_whose_tma_box_would_pass_256_rows_is_refused():
  """A TMA box holds at most 256 rows, and where the driver refuses one
  CUTLASS only prints that and launches with a descriptor it never wrote
  (f919d6d: the autotuner's timing of a new backward product never
  returned). The operand stored K-contiguous is loaded in boxes of the
  tile's rows along M or N, split between the CTAs of a cluster that
  multicasts it (B over the cluster's row tiles, A over its column tiles);
  an operand stored M- or N-contiguous goes in 64-wide boxes. So a config
  is refused for a B stored [N, K] exactly when its tile's N over its
  cluster's M passes 256 (for a swapped config, in CUTLASS's own M x N:
  its A is our B, its B our A, both K-contiguous in some layout)."""
  for name in cuda_ffi.CONFIGS:
    tile = _tile(name)
    if tile is None:
      continue
    cluster = re.search(r"cluster_(\d)x(\d)", name)
    bm, bn = tile
    # The names' convention: without a cluster in its name a cooperative
    # config pairs row tiles (2x1), a ping-pong one has no cluster.
    default = (2, 1) if "cooperative" in name else (1, 1)
    cm, cn = map(int, cluster.groups()) if cluster else default
    if name.startswith("swap_"):  # CUTLASS's A is our B, its B our A
      b_rows, a_rows = bm // cn, bn // cm
    else:
      b_rows, a_rows = bn // cm, bm // cn
    assert a_rows <= 256, name  # A stored [M, K] is every forward's
    assert (b_rows > 256) == (name in cuda_ffi.B_NK_REFUSED), (name, b_rows)


def test_only_configs_of_an_extended_gmma_width_compile_with_those_atoms(
    tmp_path):
  """CUTLASS issues one GMMA per k16 step as wide as the tile's N only for
  8, 16, 32, 64, 96, 128, 192 and 256, unless
  CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is defined; defined for every
  object it would also change the 320-wide tiles' atoms (the kernels the
  tuned tables measured). So the build defines it exactly for the configs
  whose tile N is another width up to 256, read here from the names."""
  standard = {8, 16, 32, 64, 96, 128, 192, 256}
  want = set()
  for name, code in cuda_ffi.CONFIGS.items():
    n = (_tile(name) or (0, 8))[1]
    if n <= 256 and n not in standard:
      want.add(code)
  assert want  # the 144/160/224/80 configs
  commands = build._compile_commands("nvcc", tmp_path, tmp_path, tmp_path)
  flagged = set()
  for cmd in commands:
    code = [a for a in cmd if a.startswith("-DRLK_CONFIG=")]
    if "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" in cmd:
      flagged.add(int(code[0].split("=")[1]))
  assert flagged == want


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
  # One kernel object (its template switches mixed: A transposed, B not,
  # f32 out; the cooperative schedule and a two-CTA cluster whose B tile
  # is multicast: 50-60 s of nvcc on CI's cores) and every other source
  # once, in one pool of jobs. `python -m cuda_ffi.build --check`
  # compiles all, and every device run builds all. (The extended GMMA
  # widths, 100-150 s each, are outside the default build since
  # 2026-11-28: RLK_CUDA_FFI_CONFIGS=all.)
  kernels = [((1, 0, 1), "kCooperative128x256Cluster1x2")]
  compiled = []
  build.check(jobs=2, log=compiled.append, kernels=kernels)
  codes = build.kernel_configs()
  others = ["pack_rows_kernels.o", "linear_logp_kernels.o",
            "attention_sm90_kernels.o", "row_reduce_kernels.o",
            "det_gemm_api.o", "pack_rows_api.o", "triton_launch.o"]
  assert sorted(compiled) == sorted(
      [f"  ok: det_gemm_{part}_{''.join(map(str, v))}_{codes[name]}.o"
       for v, name in kernels for part in ("kernels", "kernel_entry")]
      + [f"  ok: {name}" for name in others])


def _fake_tools(monkeypatch, tmp_path):
  monkeypatch.delenv("RLK_CUDA_FFI_LIB", raising=False)
  monkeypatch.setenv("RLK_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(build, "_inputs", lambda: ("nvcc", tmp_path, tmp_path))
  monkeypatch.setattr(build, "_tool_versions", lambda nvcc, cutlass: b"13.0")
  monkeypatch.setattr(build, "_ffi_header", lambda ffi: b"ffi api")
  monkeypatch.setattr(build, "build_key", lambda nvcc, cutlass, ffi: "all")


def _kept(objects, cutlass, ffi, **kw):
  return build._kept_objects(
      build._compile_commands("nvcc", cutlass, ffi, cutlass / "scratch", **kw),
      "nvcc", cutlass, ffi, objects)


def _planned_objects(objects, cutlass, ffi):
  """(kernel object, entry object) paths of every planned kernel, and the
  main library's objects, as the build keys them in `objects`."""
  configs = build.kernel_configs()
  kernels = []
  for _, _, kernel, entry in build._kernel_commands(
      "nvcc", cutlass, ffi, cutlass / "scratch", build.planned_kernels(),
      configs):
    kernel, entry = build._kept_objects([kernel, entry], "nvcc", cutlass, ffi,
                                        objects)
    kernels.append((str(build._output(kernel)), str(build._output(entry))))
  core = [str(build._output(c)) for c in build._kept_objects(
      build._core_commands("nvcc", ffi, cutlass / "scratch"), "nvcc", cutlass,
      ffi, objects)]
  return kernels, core


@pytest.mark.parametrize("where", ["default", "given"])
def test_build_resumes_from_kept_objects_and_never_links_a_partial_one(
    tmp_path, monkeypatch, where):
  # nvcc stands in: it writes its -o file, or part of it and fails for one
  # object, as a build killed mid-compile would leave it. By default the
  # objects are kept in the cache, so a plain `build()` resumes too.
  _fake_tools(monkeypatch, tmp_path)
  compiled, linked = [], {}
  failing = {"det_gemm_kernels_000_1"}

  def nvcc(cmd, capture_output=True, text=True, check=False):
    out = pathlib.Path(cmd[cmd.index("-o") + 1])
    out.write_bytes(b"part")
    stem = out.name.split("-")[0]
    if "-shared" in cmd:
      name = out.name.split(".so.")[0] + ".so"
      linked[name] = cmd[cmd.index("arch=compute_90a,code=sm_90a") + 1:
                         cmd.index("-o")]
    else:
      compiled.append(stem)
    rc = 1 if stem in failing else 0
    return subprocess.CompletedProcess(cmd, rc, "", "nvcc died")

  monkeypatch.setattr(build.subprocess, "run", nvcc)
  objects = (tmp_path / "cache" / "cuda_ffi" / "objects" if where == "default"
             else tmp_path / "objects")
  kept = None if where == "default" else objects
  library_dir = tmp_path / "cache" / "cuda_ffi" / "all"
  kernels, core = _planned_objects(objects, tmp_path, tmp_path)
  assert len(kernels) == len(build.planned_kernels()) == 48
  every = [o for pair in kernels for o in pair] + core
  assert len(every) == len(set(every))
  objects.mkdir(parents=True)
  carried = next(pathlib.Path(k) for k, _ in kernels
                 if "det_gemm_kernels_111_1-" in k)
  carried.write_bytes(b"from another machine")
  # Another key's object (other sources or tools): not used.
  (objects / "det_gemm_kernels_000_2-0123456789abcdef.o").write_bytes(b"x")
  with pytest.raises(RuntimeError, match="det_gemm_kernels_000_1-"):
    build.build(jobs=4, log=lambda *_: None, objects=kept)
  # No whole kernel library, no library of the failed kernel; every other
  # kernel's own library links exactly its two objects.
  assert build.KERNELS_NAME not in linked
  assert "det_gemm_000_1.so" not in linked
  for (variant, name), (kernel, entry) in zip(build.planned_kernels(),
                                              kernels):
    plugin = f"det_gemm_{''.join(map(str, variant))}_" \
             f"{build.kernel_configs()[name]}.so"
    if "det_gemm_kernels_000_1-" not in kernel:
      assert linked[plugin] == [kernel, entry]
      assert (library_dir / build.KERNEL_DIR / plugin).is_file()
  assert sorted(compiled) == sorted(
      pathlib.Path(p).name.split("-")[0] for p in every
      if "det_gemm_kernels_111_1-" not in p)
  assert not list(objects.glob("det_gemm_kernels_000_1-*.o"))
  assert list(objects.glob("det_gemm_kernels_000_1-*.o.*.partial"))
  # A failed build is reported and not restarted by first use.
  assert build.status(library_dir)["progress"]["failed"] == 1
  assert "stopped part-way" in build.status_line(library_dir)
  with pytest.raises(build.BuildUnavailable, match="failed"):
    build.start_background()
  # Another build's partial object, still being written: never linked.
  second = next(k for k, _ in kernels if "det_gemm_kernels_000_2-" in k)
  pathlib.Path(second + ".999.partial").write_bytes(b"")
  compiled.clear()
  linked.clear()
  failing.clear()
  lib = build.build(jobs=4, log=lambda *_: None, objects=kept)
  assert compiled == ["det_gemm_kernels_000_1"]  # resumed: the one missing
  whole = [o for pair in kernels for o in pair]
  assert linked[build.KERNELS_NAME] == whole  # every kernel once, no partial
  assert linked.get(build.LIBRARY_NAME, core) == core
  assert lib == library_dir / build.LIBRARY_NAME
  assert build.complete(library_dir)
  assert not (library_dir / build.KERNEL_DIR).exists()  # folded into one
  assert build.kernel_libraries(library_dir) == [
      library_dir / build.KERNELS_NAME]
  assert build.status_line(library_dir).startswith("built:")


def _compiles_recorded(monkeypatch, tmp_path) -> list:
  """The stand-in tools, and nvcc writing each -o file: the list of the
  objects it compiles (not links), in order."""
  _fake_tools(monkeypatch, tmp_path)
  compiled = []

  def nvcc(cmd, capture_output=True, text=True, check=False):
    out = pathlib.Path(cmd[cmd.index("-o") + 1])
    out.write_bytes(b"obj")
    if "-shared" not in cmd:
      compiled.append(out.name.split("-")[0])
    return subprocess.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(build.subprocess, "run", nvcc)
  return compiled


def test_a_new_key_links_its_main_library_from_kept_objects(tmp_path,
                                                            monkeypatch):
  # Another key (other kernel sources, another plan) sharing the objects:
  # the main library's objects are all kept, its kernels are not; the main
  # library is still linked (first), and the build is whole.
  compiled = _compiles_recorded(monkeypatch, tmp_path)
  build.build(jobs=2, log=lambda *_: None)
  monkeypatch.setattr(build, "build_key", lambda nvcc, cutlass, ffi: "other")
  monkeypatch.setattr(build, "_kernel_commands", lambda *a: [])  # (new plan)
  compiled.clear()
  lib = build.build(jobs=2, log=lambda *_: None)
  assert compiled == [] and lib.is_file() and build.complete(lib.parent)


def test_planned_order_first_kernel_per_layout_then_longest_first():
  plan = build.planned_kernels()
  by_code = {code: name for name, code in build.kernel_configs().items()}
  from cuda_ffi import CONFIGS
  layouts = len(build.BUILD_CONFIGS)
  assert [(v, CONFIGS[build.BUILD_CONFIGS[v][0]]) for v, _ in plan[:layouts]
          ] == [(v, build.kernel_configs()[n]) for v, n in plan[:layouts]]
  assert {v for v, _ in plan[:layouts]} == set(build.BUILD_CONFIGS)
  seconds = [build.COMPILE_SECONDS[name] for _, name in plan[layouts:]]
  assert seconds == sorted(seconds, reverse=True)
  assert sorted((v, CONFIGS[c]) for v, cs in build.BUILD_CONFIGS.items()
                for c in cs) == sorted((v, build.kernel_configs()[n])
                                       for v, n in plan)
  assert set(build.COMPILE_SECONDS) <= set(by_code.values())


def test_wanted_kernels_compile_first(tmp_path, monkeypatch):
  # A process waiting for a kernel (cuda_ffi asks through build.want) gets
  # it right after the main library's objects, whatever the planned order.
  order = _compiles_recorded(monkeypatch, tmp_path)
  last_variant, last_name = build.planned_kernels()[-1]
  code = build.kernel_configs()[last_name]
  build.want(last_variant, code)
  lines = []
  build.build(jobs=1, log=lines.append)
  stem = "det_gemm_kernels_" + "".join(map(str, last_variant)) + f"_{code}"
  core = {"pack_rows_kernels", "linear_logp_kernels", "attention_sm90_kernels",
          "row_reduce_kernels", "det_gemm_api", "pack_rows_api",
          "triton_launch"}
  assert set(order[:7]) == core
  assert order[7:9] == [stem.replace("kernels", "kernel_entry"), stem]
  # A progress line per step: done of total, elapsed, an estimate.
  assert re.search(r"\[8/55\] \d+m\d\ds, about \d+m\d\ds left",
                   "\n".join(lines))


@pytest.fixture
def stand_in_toolchain(tmp_path, monkeypatch):
  """A stand-in nvcc on PATH (it writes each -o file), CUTLASS headers in
  name only, the cache in tmp_path: real build processes, in seconds."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "nvcc"
  fake.write_text(
      "#!/usr/bin/env python3\n"
      "import sys, time\n"
      "args = sys.argv[1:]\n"
      "if '--version' in args:\n"
      "  print('Cuda compilation tools, release 13.0, V13.0.0'); sys.exit()\n"
      "import os\n"
      "time.sleep(float(os.environ.get('RLK_TEST_NVCC_SECONDS', '0.01')))\n"
      "open(args[args.index('-o') + 1], 'w').write('obj')\n")
  fake.chmod(0o755)
  cutlass = tmp_path / "cutlass"
  (cutlass / "include" / "cutlass").mkdir(parents=True)
  (cutlass / "include" / "cutlass" / "cutlass.h").write_text("")
  monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
  monkeypatch.delenv("CUDA_HOME", raising=False)
  monkeypatch.delenv("CUDA_PATH", raising=False)
  monkeypatch.delenv("RLK_CUDA_FFI_LIB", raising=False)
  monkeypatch.setenv("RLK_CUTLASS_DIR", str(cutlass))
  monkeypatch.setenv("RLK_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(build, "find_nvcc", lambda: str(fake))
  build._tool_versions.cache_clear()
  yield fake
  build._tool_versions.cache_clear()


def test_the_first_use_builds_in_a_background_process_once(
    stand_in_toolchain):
  # A real worker process (python -m cuda_ffi.build --worker): started once
  # however often it is asked, the library whole at the end, the status
  # line saying so.
  where = build._library_dir()
  log = build.start_background()
  assert build.start_background() == log  # one build: the second finds it
  deadline = time.monotonic() + 120
  while not build.complete(where) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert build.complete(where), pathlib.Path(log).read_text()[-3000:]
  text = pathlib.Path(log).read_text()
  assert text.count("rlk: building the cuda_ffi SM90 library") == 1
  assert "[55/55]" in text
  assert build.status_line(where).startswith("built:")


def test_a_build_stopped_by_ctrl_c_resumes_where_it_stopped(
    stand_in_toolchain, monkeypatch):
  # `python -m cuda_ffi.build` in a process group of its own, each compile
  # taking a second; Ctrl-C (SIGINT to the group) after four steps. The
  # build stops at once (no step starts after it), is not marked failed
  # (so first use resumes it), keeps every object it finished, and the next
  # build compiles only the rest: the time lost is the steps in flight.
  import signal
  monkeypatch.setenv("RLK_TEST_NVCC_SECONDS", "1")
  where = build._library_dir()
  command = [sys.executable, "-m", "cuda_ffi.build", "--jobs", "4"]
  # SIGINT as a terminal gives it: the pytest worker may run with SIGINT
  # ignored, which a child inherits (CI: the build and its compiles went on
  # past the signal, 2026-11-28).
  first = subprocess.Popen(
      command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True,
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  # Ctrl-C once four steps are done, read from the build's own progress lines:
  # a fixed sleep raced a loaded CI machine's interpreter start (only one step
  # had finished after 3 s there, 2026-11-29).
  seen = []
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    line = first.stdout.readline()
    if not line:
      break
    seen.append(line)
    done = re.search(r"\[(\d+)/55\]", line)
    if done and int(done.group(1)) >= 4:
      break
  os.killpg(first.pid, signal.SIGINT)
  stopped_at = time.monotonic()
  rest, _ = first.communicate(timeout=60)
  log = "".join(seen) + rest
  assert time.monotonic() - stopped_at < 5, log
  assert first.returncode != 0, log
  progress = build.status(where)["progress"]
  assert progress["failed"] == 0 and progress["last"] == "stopped", progress
  assert "stopped part-way" in build.status_line(where)
  kept = [p for p in (where.parent / "objects").glob("*.o")]
  assert 4 <= len(kept) < 55 + 48, log  # (kernels have an entry each)
  second = subprocess.run(command, capture_output=True, text=True,
                          timeout=300, env={**os.environ,
                                            "RLK_TEST_NVCC_SECONDS": "0.01"})
  assert second.returncode == 0, second.stdout[-3000:]
  assert build.complete(where)
  todo = re.search(r"(\d+) of 55 steps to do", second.stdout)
  assert todo and int(todo.group(1)) < 55, second.stdout[:2000]


def test_a_wheel_carries_the_prebuilt_library_and_checks_it_on_load(
    stand_in_toolchain, tmp_path, monkeypatch):
  # RLK_WHEEL_CUDA_FFI=1: setup.py builds the library (the stand-in
  # compiler here) into the wheel's cuda_ffi/prebuilt/ with its record; a
  # platform wheel. The record is checked against the installed jaxlib's FFI
  # header and the sources, with no compiler needed to tell.
  import shutil
  import zipfile
  root = pathlib.Path(__file__).resolve().parent.parent
  src = tmp_path / "src"  # (setuptools builds in the tree it is given)
  for name in ("pyproject.toml", "setup.py", "README.md"):
    shutil.copy2(root / name, src / name) if src.is_dir() else (
        src.mkdir(), shutil.copy2(root / name, src / name))
  for package in ("cuda_ffi", "rlk_jax", "rlk_torch_bridge", "pallas_kernels",
                  "triton_kernels", "benchmarks"):
    shutil.copytree(root / package, src / package, ignore=shutil.ignore_patterns(
        "results", "__pycache__", "prebuilt"))
  done = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps",
       "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
      capture_output=True, text=True, timeout=600,
      env={**os.environ, "RLK_WHEEL_CUDA_FFI": "1"})
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  wheel, = (tmp_path / "dist").glob("rlk-*.whl")
  assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
  names = zipfile.ZipFile(wheel).namelist()
  for name in (build.LIBRARY_NAME, build.KERNELS_NAME, build.PREBUILT_RECORD):
    assert f"cuda_ffi/prebuilt/{name}" in names, names
  record = json.loads(zipfile.ZipFile(wheel).read(
      f"cuda_ffi/prebuilt/{build.PREBUILT_RECORD}"))
  assert record == build.prebuilt_record(build.find_ffi_include())
  # Loading: taken where the record matches, passed over where it does not.
  prebuilt = tmp_path / "prebuilt"
  prebuilt.mkdir()
  for name in (build.LIBRARY_NAME, build.KERNELS_NAME):
    (prebuilt / name).write_bytes(b"lib")
  (prebuilt / build.PREBUILT_RECORD).write_text(json.dumps(record))
  monkeypatch.setattr(build, "PREBUILT_DIR", prebuilt)
  assert build.library_path() == prebuilt / build.LIBRARY_NAME
  assert build.build() == prebuilt / build.LIBRARY_NAME  # nothing to build
  (prebuilt / build.PREBUILT_RECORD).write_text(
      json.dumps({**record, "ffi_api": "another jaxlib"}))
  # The cache's (the wheel's build above made it with these sources).
  assert build._library_dir().parent == tmp_path / "cache" / "cuda_ffi"
  assert build.library_path() == build._library_dir() / build.LIBRARY_NAME


def test_kept_objects_are_keyed_by_their_own_inputs_not_the_machines_paths(
    tmp_path, monkeypatch):
  _fake_tools(monkeypatch, tmp_path)
  objects = tmp_path / "objects"
  here = _kept(objects, tmp_path / "here", tmp_path / "here" / "ffi")
  there = _kept(objects, tmp_path / "there", tmp_path / "there" / "ffi")
  names = lambda cmds: [build._output(c).name for c in cmds]
  # CUTLASS, jaxlib and the build directory elsewhere: the same objects.
  assert names(here) == names(there)
  # Another API source: only the API object changes, not the 170 kernels'.
  api = tmp_path / "det_gemm_api.cc"
  api.write_text(build.API_SOURCE.read_text() + "// changed\n")
  monkeypatch.setattr(build, "API_SOURCE", api)
  changed = _kept(objects, tmp_path / "here", tmp_path / "here" / "ffi")
  differ = [a for a, b in zip(names(here), names(changed)) if a != b]
  assert [d.split("-")[0] for d in differ] == ["det_gemm_api"]
  monkeypatch.setattr(build, "API_SOURCE", build.CSRC / "det_gemm_api.cc")
  assert names(here) == names(
      _kept(objects, tmp_path / "here", tmp_path / "here" / "ffi"))
  # Another compiler, other FFI headers: other names where they go in.
  monkeypatch.setattr(build, "_ffi_header", lambda ffi: b"jaxlib 0.12")
  ffi_changed = {d.split("-")[0] for d in set(names(here)) - set(
      names(_kept(objects, tmp_path / "here", tmp_path / "here" / "ffi")))}
  assert ffi_changed == {"det_gemm_api", "pack_rows_api", "linear_logp_kernels",
                         "attention_sm90_kernels", "triton_launch"}
  monkeypatch.setattr(build, "_tool_versions", lambda nvcc, cutlass: b"13.1")
  assert not set(names(here)) & set(
      names(_kept(objects, tmp_path / "here", tmp_path / "here" / "ffi")))
  # A different object: a different configuration's defines.
  one = _kept(objects, tmp_path, tmp_path, variants=[(0, 0, 0)],
              configs={"kA": 1, "kB": 2})
  assert len({build._output(c).name.split("-")[1] for c in one}) == len(one)


def test_every_source_is_part_of_the_build():
  sources = {p.name for p in build.CSRC.iterdir()}
  assert sources == {"det_gemm_sm90.h", "device_info.h", "ffi_traits.h",
                     build.KERNEL_SOURCE.name,
                     build.API_SOURCE.name, "pack_rows.h",
                     build.LOGP_SOURCE.name, build.ROW_REDUCE_SOURCE.name,
                     build.ATTENTION_SOURCE.name, build.ENTRY_SOURCE.name,
                     build.TRITON_LAUNCH_SOURCE.name,
                     *(p.name for p in build.PACK_SOURCES)}
  assert pathlib.Path(build.KERNEL_SOURCE).is_file()


def test_built_configs_loads_a_built_library_but_never_builds(monkeypatch):
  # Asked before any product in a fresh process, the answer is the built
  # library's, not the empty set of one not yet loaded.
  loads = []
  monkeypatch.setattr(cuda_ffi, "_state", {})
  monkeypatch.setattr(cuda_ffi, "_load", lambda: loads.append(1) or (
      cuda_ffi._state.update(lib=object(), kernels={(0, 0, 0, 1)}), None))
  monkeypatch.setattr(build, "library_path", lambda: None)
  assert cuda_ffi.built_configs(False, False, False) == [] and not loads
  monkeypatch.setattr(build, "library_path", lambda: pathlib.Path("/x.so"))
  assert cuda_ffi.built_configs(False, False, False) == [
      "cooperative_128x256"]
  assert cuda_ffi.built_configs(False, False, False) and loads == [1]


def test_kernels_are_taken_up_as_the_build_adds_them(tmp_path, monkeypatch):
  # cuda_ffi's loader on a running build's folder (stand-in libraries: the
  # real ones run on the device): each look hands the main library the
  # kernels of the small libraries there, the generation moves, and the
  # whole build's library ends it; a small library removed between the
  # listing and the load is passed over.
  where = tmp_path / "lib"
  (where / build.KERNEL_DIR).mkdir(parents=True)
  registered = []

  class Library:
    def rlk_det_gemm_sm90_add_kernel(self, ta, tb, f32, code, fn):
      registered.append((ta, tb, f32, code))
      return 0

  class Plugin:
    def __init__(self, path):
      if not pathlib.Path(path).is_file():
        raise OSError(f"{path}: cannot open shared object file")
      for key in json.loads(pathlib.Path(path).read_text()):
        symbol = build.kernel_symbol(key[:3], key[3])
        setattr(self, symbol, type("Entry", (), {
            "restype": None, "__call__": lambda self: 1234})())

  def add(name, keys):
    (where / name).write_text(json.dumps(keys))

  monkeypatch.setattr(cuda_ffi.ctypes, "CDLL", Plugin)
  monkeypatch.setattr(cuda_ffi, "_state", {})
  monkeypatch.setattr(cuda_ffi, "RECHECK_S", 0.0)
  monkeypatch.setenv("RLK_CUDA_FFI_AUTOBUILD", "0")  # nothing to resume
  lib = Library()
  cuda_ffi._state.update(lib=lib, kernels=set(), loaded=set(), generation=1,
                         complete=False, next_scan=0.0, where=where)
  add(f"{build.KERNEL_DIR}/det_gemm_000_1.so", [[0, 0, 0, 1]])
  assert cuda_ffi.generation() == 2
  assert cuda_ffi.kernel_built(False, False, False, "cooperative_128x256")
  assert not cuda_ffi.kernel_built(False, True, False, "cooperative_128x256")
  assert not cuda_ffi.kernel_built(False, False, False,
                                   "split_256x192_128x256")
  assert cuda_ffi.generation() == 2  # nothing new: the count stays
  add(f"{build.KERNEL_DIR}/det_gemm_000_6.so", [[0, 0, 0, 6]])
  assert cuda_ffi.generation() == 3 and not cuda_ffi.build_complete()
  assert cuda_ffi.kernel_built(False, False, False, "split_256x192_128x256")
  assert cuda_ffi.built_configs(False, False, False) == [
      "cooperative_128x256", "cooperative_256x192", "split_256x192_128x256"]
  # The whole library: every kernel once, the build complete.
  # The whole library: every kernel once, the build complete (the count
  # moves for the new kernel and for the completion: choices made on part
  # of the kernels are made again).
  add(build.KERNELS_NAME, [[0, 0, 0, 1], [0, 0, 0, 6], [0, 1, 0, 3]])
  assert cuda_ffi.generation() == 5 and cuda_ffi.build_complete()
  assert sorted(registered) == [(0, 0, 0, 1), (0, 0, 0, 6), (0, 1, 0, 3)]
  # A small library listed but gone: passed over, no error.
  cuda_ffi._state.update(complete=False, loaded=set())
  monkeypatch.setattr(build, "kernel_libraries",
                      lambda where: [where / "gone.so"])
  assert cuda_ffi.generation() == 5
