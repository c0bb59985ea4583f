"""Runs each Mosaic GPU det_gemm config once, each in its own process under
a time limit, against cuda_ffi's bits, and prints the names that passed on
the last line (comma-separated): a device call can then time only configs
that neither hang nor differ. Usage: python3 lab/mosaic_config_smoke.py
[--timeout S] [NAME ...]"""

import argparse
import subprocess
import sys

CHILD = """
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import det_matmul_mgpu
from rlk_jax import _det_gemm
rng = np.random.default_rng(0)
for ta, tb in ((False, False), (False, True), (True, False), (True, True)):
  m, k, n = 1000, 1000, 1000  # ragged tiles, whole clusters, chained K
  a = jnp.asarray(rng.standard_normal((k, m) if ta else (m, k)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((n, k) if tb else (k, n)), jnp.bfloat16)
  got = det_matmul_mgpu.matmul(a, b, transpose_a=ta, transpose_b=tb,
                               config=det_matmul_mgpu.CONFIGS[{name!r}],
                               num_sms=5)
  want = _det_gemm._matmul("cuda_ffi", ta, tb, jnp.dtype(jnp.bfloat16), a, b)
  assert np.array_equal(np.asarray(got).view(np.uint16),
                        np.asarray(want).view(np.uint16)), (ta, tb)
"""


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--timeout", type=float, default=60)
  parser.add_argument("names", nargs="*")
  args = parser.parse_args()
  from pallas_kernels import det_matmul_mgpu
  passed = []
  for name in args.names or list(det_matmul_mgpu.CONFIGS):
    try:
      run = subprocess.run([sys.executable, "-c", CHILD.format(name=name)],
                           capture_output=True, text=True,
                           timeout=args.timeout)
      verdict = "ok" if run.returncode == 0 else (
          "failed: " + (run.stderr.strip().splitlines() or ["?"])[-1])
    except subprocess.TimeoutExpired:
      verdict = f"timed out after {args.timeout:.0f} s"
    print(f"{name}: {verdict}", flush=True)
    if verdict == "ok":
      passed.append(name)
  print(",".join(passed))


if __name__ == "__main__":
  main()
