#!/usr/bin/env bash
# One device call: environment check, the cuda_ffi build, the whole test
# suite on the GPU (its "pallas" cases through the Triton lowering, plus the
# `gpu`-marked tests), then the benchmarks. $OUT gets report.md, results.csv,
# pytest.log, bench.log and run.tgz (plots, env/build logs, junit XML, a
# fresh build of the library); a short table is printed last.
#
#   device run (carry .whl):  bash scripts/gpu_suite.sh [extra benchmark flags]
#
# Optional: RLK_PYTEST_ARGS (default "tests"), RLK_TEST_TIMEOUT and
# RLK_BENCH_TIMEOUT (seconds; a phase past its limit is stopped and reported).
#
# The GPU image has jax, torch, triton and nvcc but no package registry:
# pytest, hypothesis, absl-py and nvidia-cutlass travel as wheels in .whl/
# (see docs/benchmarks.md); RLK_CUDA_FFI_LIB may name a library built by an earlier call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlk-out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site \
    && export PATH="/tmp/site/bin:$PATH"  # ninja, for torch's cpp_extension
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# JAX would otherwise take 75% of the GPU and starve torch's baselines.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export RLK_COMMIT="${RLK_COMMIT:-unknown}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, jaxlib, torch, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, 'triton', triton.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/env.log"

# The SM90 library: built here from the sources (nvcc + the nvidia-cutlass
# wheel from .whl/), or the one named by RLK_CUDA_FFI_LIB; a fresh build is
# kept in run.tgz so a later call can carry it instead of building again.
# A carried library built elsewhere (another jaxlib's FFI headers, say) must
# run one product here, or it is dropped and the sources are built.
if [ -n "${RLK_CUDA_FFI_LIB:-}" ]; then
  python3 -c "
import jax.numpy as jnp, numpy as np, cuda_ffi
a = jnp.asarray(np.random.default_rng(0).standard_normal((128, 64)), jnp.bfloat16)
c = cuda_ffi.matmul(a, a, transpose_a=False, transpose_b=True, out_dtype=jnp.float32)
ref = np.asarray(a, np.float64) @ np.asarray(a, np.float64).T
assert np.linalg.norm(np.asarray(c) - ref) / np.linalg.norm(ref) < 1e-5
print('carried library ok:', cuda_ffi.build_id())" > "$OUT/prebuilt.log" 2>&1 \
    || { echo "carried library unusable (prebuilt.log); building"; unset RLK_CUDA_FFI_LIB; }
fi
start=$(date +%s)
python3 -m cuda_ffi.build > "$OUT/build.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - start ))
lib=$(tail -n 1 "$OUT/build.log")
[ "$build_rc" = 0 ] && [ -z "${RLK_CUDA_FFI_LIB:-}" ] && mkdir -p "$OUT/bench" \
  && cp "$lib" "$OUT/bench/" 2>/dev/null

start=$(date +%s)
# RLK_PYTEST_ARGS is parsed like a command line, so a quoted expression
# stays one argument: RLK_PYTEST_ARGS="-m gpu tests -k 'tile_order or sanitizer'"
eval "pytest_args=(${RLK_PYTEST_ARGS:-tests})"
timeout "${RLK_TEST_TIMEOUT:-0}" python3 -m pytest -q -m "gpu or not gpu" \
  -p no:cacheprovider --junitxml="$OUT/pytest.xml" "${pytest_args[@]}" \
  > "$OUT/pytest.log" 2>&1
test_rc=$?
test_s=$(( $(date +%s) - start ))

timeout "${RLK_BENCH_TIMEOUT:-0}" python3 -m benchmarks --out "$OUT/bench" "$@" \
  > "$OUT/bench.log" 2>&1
bench_rc=$?
cp "$OUT/bench/results.csv" "$OUT/results.csv" 2>/dev/null
cp "$OUT/bench/report.md" "$OUT/report.md" 2>/dev/null
# The device tool returns only a few files: everything else (plots, the
# built library, env/build logs, junit XML) travels in one archive.
mkdir -p "$OUT/bench"
mv "$OUT/env.log" "$OUT/build.log" "$OUT/pytest.xml" "$OUT/prebuilt.log" \
  "$OUT/bench/" 2>/dev/null
tar czf "$OUT/run.tgz" -C "$OUT/bench" . && rm -rf "$OUT/bench"

echo "== cuda_ffi build (rc=$build_rc, ${build_s}s): $lib"
echo "== pytest (rc=$test_rc, ${test_s}s): $(tail -n 1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
echo "== benchmarks (rc=$bench_rc)"
tail -n 5 "$OUT/bench.log" | grep -v "^wrote" || true
sed -n '/^## /,$p' "$OUT/report.md" 2>/dev/null | cut -c1-200
exit $(( test_rc != 0 || bench_rc != 0 ))
