#!/usr/bin/env bash
# One device call that builds the SM90 library from the objects carried in
# build/keyed (compiling only those missing, within a time limit) and
# returns the library and every object under $OUT, so a later call carries
# them instead of compiling.
#
#   device run (carry .whl, build/keyed.tgz):  bash scripts/device_build.sh [seconds]
#
# The kernel objects (59; all 280 with RLK_CUDA_FFI_CONFIGS=all take 30 MB)
# and the tracked tree share a call's 64 MiB: carry them packed instead (tar czf build/keyed.tgz -C
# build keyed; 6 MB), and they are unpacked here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rlk-out}"
mkdir -p "$OUT" build/keyed
[ -f build/keyed.tgz ] && tar xzf build/keyed.tgz -C build
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
timeout "${1:-540}" python3 -m cuda_ffi.build --objects build/keyed \
  --jobs "$(nproc)" > "$OUT/build.log" 2>&1
rc=$?
tail -3 "$OUT/build.log"
lib=$(tail -1 "$OUT/build.log")
if [ "$rc" = 0 ] && [ -f "$lib" ]; then cp "$lib" "$OUT/"; fi
# Results come back in files of at most 16 MB.
tar czf - -C build keyed | split -b 15m - "$OUT/objects.tgz."
echo "build rc=$rc; $(ls build/keyed/*.o | wc -l) objects"
exit $rc
