"""Device-side kernel times of pack on the H100 benchmark shape, read with
torch.profiler (CUPTI sees every kernel in the process, XLA's included):
what the jitted call runs on the GPU, kernel by kernel, and the gaps.

    python scripts/profile_pack_kernels.py   (GPU machine; writes to stdout)
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import rlk_jax

B, S, H = 32, 1024, 4096


def main():
  rng = np.random.default_rng(0)
  active = int(0.3 * B * S)
  capacity = -(-active // 128) * 128
  flat = np.zeros(B * S, bool)
  flat[rng.permutation(B * S)[:active]] = True
  mask = jnp.asarray(flat.reshape(B, S))
  x = jax.random.normal(jax.random.key(0), (B, S, H), jnp.float32).astype(jnp.bfloat16)
  info = rlk_jax.pack_info(mask, capacity=capacity)
  cases = {
      "cuda_ffi pack from mask": (lambda x, m: rlk_jax.pack(
          x, m, capacity=capacity, implementation="cuda_ffi"), (x, mask)),
      "cuda_ffi pack from mask, rows only": (lambda x, m: rlk_jax.pack(
          x, m, capacity=capacity, implementation="cuda_ffi")[0], (x, mask)),
      "pallas pack from mask": (lambda x, m: rlk_jax.pack(
          x, m, capacity=capacity, implementation="pallas"), (x, mask)),
      "pallas pack from mask, rows only": (lambda x, m: rlk_jax.pack(
          x, m, capacity=capacity, implementation="pallas")[0], (x, mask)),
      "cuda_ffi gather with info": (lambda x, i: rlk_jax.pack(
          x, i, implementation="cuda_ffi")[0], (x, info)),
  }
  for name, (fn, args) in cases.items():
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      for _ in range(5):
        jax.block_until_ready(f(*args))
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    # the last call's kernels: group by call (gaps > 200 us split calls)
    calls, cur = [], []
    for e in events:
      if cur and e.time_range.start - cur[-1].time_range.end > 200:
        calls.append(cur)
        cur = []
      cur.append(e)
    calls.append(cur)
    last = calls[-1]
    span = last[-1].time_range.end - last[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in last)
    print(f"\n== {name}: {len(last)} kernels, span {span:.1f} us, busy {busy:.1f} us")
    for e in last:
      print(f"   {e.time_range.end - e.time_range.start:8.1f} us  {e.name[:90]}")


if __name__ == "__main__":
  main()
