#!/usr/bin/env bash
# One device call: where the forward products that fell below 0.90x cuBLAS
# stand against every SM90 config, timed twice on one machine (is the gap
# the kernels' or the measurement's?), and the SASS of the cuBLAS kernels
# they lose to (nvjet 320x64 and 320x128 coopB: their HGMMA shapes).
#   device run (carry .whl .prebuilt): bash lab/probe_low_products.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlk-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH \
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 \
  RLK_CACHE_DIR=/tmp/rlkcache RLK_CUDA_FFI_LIB=$PWD/.prebuilt/librlk_cuda_ffi.so
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv > "$OUT/gpu.txt"
PRODUCTS="${RLK_PRODUCTS:-512,5120,14336 512,5120,4096 1024,5120,14336 1024,4608,3584 512,4608,3584 256,4608,3584 1024,5120,3072 512,5120,3072 512,10240,8192 1024,4096,2048 1024,2048,6144 1024,5120,2048 256,5120,14336}"
if [ "${RLK_SASS:-1}" = 1 ]; then
  for shape in 512x14336x5120 1024x3584x4608; do
    timeout 90 ncu --clock-control none -k regex:nvjet -c 1 --section SourceCounters \
      --page source --print-source sass python3 - "$shape" > "$OUT/sass_$shape.txt" 2>&1 <<'PY'
import sys, torch
m, k, n = map(int, sys.argv[1].split("x"))
a = torch.randn(m, k, device="cuda").bfloat16(); b = torch.randn(k, n, device="cuda").bfloat16()
torch.matmul(a, b); torch.cuda.synchronize()
PY
    grep -m3 -E "nvjet|HGMMA" "$OUT/sass_$shape.txt"; grep -oE "HGMMA\.[0-9x]+[^ ]*" "$OUT/sass_$shape.txt" | sort | uniq -c
    gzip -f "$OUT/sass_$shape.txt"
  done
fi
for pass in 1 2; do
  RLK_REPEATS=7 timeout 190 python3 lab/probe_tuner_fidelity.py \
    "$OUT/fidelity_pass$pass.csv" $PRODUCTS 2>&1 | tee "$OUT/fidelity_pass$pass.log" | grep -E "^M=|^over"
done
