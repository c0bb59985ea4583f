#!/usr/bin/env bash
# One device call: the forward sweep at the given M, rlk's SM90 kernel
# against cuBLAS (kernel against kernel, bits compared), the geomean and the
# ten lowest printed last. Extra flags go to the sweep: with
# `--sweep_retune --sweep_refine_picks=8` every product's config is chosen
# again, by rlk's autotuner and then by the sweep's own timing of the
# tuner's 8 fastest, and $OUT also gets the table
# (det_gemm_sm90-<device>.json) and det_gemm_configs.csv.
#   device run (carry .whl .prebuilt): bash scripts/sweep_fwd.sh 256,512,1024 [budget_s] [flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlk-out}"; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 \
  RLK_CACHE_DIR=$(mktemp -d) RLK_CUDA_FFI_LIB=$PWD/.prebuilt/librlk_cuda_ffi.so
work=$(mktemp -d)
ms="$1"; budget="${2:-500}"; shift; shift || true
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv > "$OUT/gpu.txt"
python3 -m benchmarks --out $work/sweep --only det_gemm_sweep --sweep_layouts=fwd \
  --sweep_ms="$ms" --sweep_impls=cublas,rlk_cuda_ffi_kernel \
  --sweep_compare_bits --sweep_budget_s="$budget" "$@" \
  > $work/sweep.log 2>&1
echo "exit $?"
gzip -c $work/sweep.log > "$OUT/sweep.log.gz"
cp $work/sweep/results.csv $work/sweep/det_gemm_configs.csv $work/sweep/det_gemm_sm90-*.json "$OUT/" 2>/dev/null
grep -c "sweep-timed pick" $work/sweep.log
python3 - "$work/sweep/results.csv" <<'PY'
import statistics, sys
from benchmarks.sweep_records import ratios
ratio = {c: x for c, (x, _) in ratios(sys.argv[1]).items()}
print(f"geomean {statistics.geometric_mean(ratio.values()):.4f} over {len(ratio)}")
for c, v in sorted(ratio.items(), key=lambda kv: kv[1])[:10]:
  print(f"  {v:.3f} {c}")
PY
