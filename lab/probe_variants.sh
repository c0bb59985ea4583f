#!/usr/bin/env bash
# One device call of the variant probe (lab/cuda/det_gemm_variants.py)
# timed the sweep's way (RLK_COLD=1), two passes; the variants are built on
# the CPU machine into build/variants/ (build_det_gemm_variants.py).
#   device run (carry .whl build/variants):
#     VARIANTS=61,78,82 SHAPES=512x14336x5120,... [RLK_ORDERS=1:1,1:2] bash lab/probe_variants.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlk-out}"; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 RLK_COLD=1
for pass in 1 2; do
  timeout 200 python3 lab/cuda/det_gemm_variants.py build/variants \
    "${VARIANTS:-38,61,78,79,80,81,82}" \
    "${SHAPES:-512x14336x5120,512x4096x5120,512x3584x4608,512x3072x5120,512x8192x10240,1024x14336x5120,1024x4096x5120}" \
    > "$OUT/variants_pass$pass.log" 2>&1
  grep DIFFER "$OUT/variants_pass$pass.log" | head -5
  grep "^|" "$OUT/variants_pass$pass.log" | grep -v -- "---|"
done
