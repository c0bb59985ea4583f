#!/usr/bin/env bash
# One device call: the forward sweep at the given M with every product's
# config chosen again, by rlk's autotuner and then by the sweep's own timing
# of the tuner's fastest configs (--sweep_refine_picks), each product timed
# against cuBLAS right after its choice. $OUT gets results.csv, the
# table (det_gemm_sm90-<device>.json), det_gemm_configs.csv and the log.
#   device run (carry .whl .prebuilt): bash scripts/sweep_refined.sh 256,512,1024 [budget_s] [flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlk-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 \
  RLK_CACHE_DIR=/tmp/rlkcache RLK_CUDA_FFI_LIB=$PWD/.prebuilt/librlk_cuda_ffi.so
ms="$1"; budget="${2:-500}"; shift; shift || true
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv > "$OUT/gpu.txt"
python3 -m benchmarks --out /tmp/sweep --only det_gemm_sweep --sweep_layouts=fwd \
  --sweep_ms="$ms" --sweep_impls=cublas,rlk_cuda_ffi_kernel --sweep_retune \
  --sweep_refine_picks=8 --sweep_compare_bits --sweep_budget_s="$budget" "$@" \
  > /tmp/sweep.log 2>&1
echo "exit $?"
gzip -c /tmp/sweep.log > "$OUT/sweep.log.gz"
cp /tmp/sweep/results.csv /tmp/sweep/det_gemm_configs.csv /tmp/sweep/det_gemm_sm90-*.json "$OUT/" 2>/dev/null
grep -c "sweep-timed pick" /tmp/sweep.log
python3 - <<'PY'
import csv, collections, statistics
t = collections.defaultdict(dict)
for r in csv.DictReader(open("/tmp/sweep/results.csv")):
  if r["benchmark"] == "det_gemm_sweep" and r["median_ms"]:
    t[r["case"]][r["implementation"]] = float(r["median_ms"])
ratio = {c: d["cublas"] / d["rlk_cuda_ffi_kernel"] for c, d in t.items()
         if "cublas" in d and "rlk_cuda_ffi_kernel" in d}
print(f"geomean {statistics.geometric_mean(ratio.values()):.4f} over {len(ratio)}")
for c, v in sorted(ratio.items(), key=lambda kv: kv[1])[:10]:
  print(f"  {v:.3f} {c}")
PY
