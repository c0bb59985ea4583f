"""Prints the SM90 autotuner's per-config times (cuda_ffi.time_configs over
rlk_jax._gemm_tuning.CANDIDATES) on a few products, fastest first: a quick
look at what the tuner sees, e.g. after a change to its timing.

    python lab/probe_config_times.py [M,N,K ...]   (forward layout)
"""

import sys

import cuda_ffi
from rlk_jax import _gemm_tuning

PRODUCTS = ["128,2048,768", "256,2048,768", "512,2048,768", "1,4096,4096",
            "256,3584,3584", "4096,4096,4096"]

for spec in sys.argv[1:] or PRODUCTS:
  m, n, k = map(int, spec.split(","))
  times = cuda_ffi.time_configs(m, n, k, transpose_a=False, transpose_b=False,
                                out_f32=False,
                                configs=_gemm_tuning.CANDIDATES)
  ranked = sorted((t, c) for c, t in times.items() if t)
  print(f"M={m} N={n} K={k}: pick {_gemm_tuning.pick(times)}; " + ", ".join(
      f"{c} {t * 1e3:.2f} us" for t, c in ranked))
