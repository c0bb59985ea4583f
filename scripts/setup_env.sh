# Sourced by the README's commands: makes .venv with rlk and its test extras,
# once (again only when pyproject.toml or the constraints change).
# CPU machines: torch is pinned to the CPU build through constraints-cpu.txt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=".venv/.rlk-installed"
# CUTLASS's headers (the `cuda` extra) without its Python deps: the build
# needs only the headers, and CI compiles the SM90 sources with them.
cutlass="nvidia-cutlass==4.2.0.0"
# Tunix's model modules (batch_invariant's test client) without its trainers'
# dependencies (tensorflow_datasets, metrax, ...): tests/tunix_client.py.
tunix="google-tunix==0.1.7"
want="$( (cat pyproject.toml constraints-cpu.txt; echo "$cutlass $tunix") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -c constraints-cpu.txt -e '.[test,torch,bench]'
  .venv/bin/python -m pip install -q --no-deps "$cutlass" "$tunix"
  echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
