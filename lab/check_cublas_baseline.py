"""Is bench_det_gemm's cuBLAS baseline (torch.matmul on DLPack views of the
JAX operands, a fresh output each call) as fast as cuBLAS can be driven from
torch? Times, in the same interleaved rounds as the benchmark
(harness.time_interleaved), torch.matmul on DLPack views and on torch-native
copies, with a fresh output and with `out=`, from a plain loop and replayed
from a CUDA graph, beside XLA's dot and rlk's cuda_ffi det_gemm.

    python lab/check_cublas_baseline.py [qkv o ...]   (GPU machine)
"""
import functools
import sys

import jax
import jax.numpy as jnp
import torch
from absl import flags

import rlk_jax
from benchmarks import harness
from benchmarks.bench_det_gemm import _big_sets

SHAPES = {"qkv": (4096, 4096, 6144), "o": (4096, 4096, 4096),
          "gate_up": (4096, 4096, 28672)}


def main(names):
  flags.FLAGS(["check_cublas_baseline"])
  torch.backends.cuda.matmul.allow_tf32 = False
  for name in names or list(SHAPES):
    m, k, n = SHAPES[name]
    flops = 2 * m * k * n
    sets = _big_sets(flops)
    keys = jax.random.split(jax.random.key(m + n), sets + 1)
    b = jax.random.normal(keys[-1], (k, n), jnp.float32).astype(jnp.bfloat16)
    pairs = [(jax.random.normal(kk, (m, k), jnp.float32).astype(jnp.bfloat16),
              b) for kk in keys[:sets]]
    views = [(torch.from_dlpack(a), torch.from_dlpack(bb)) for a, bb in pairs]
    tb = views[0][1].clone()
    native = [(a.clone(), tb) for a, _ in views]
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    matmul_out = lambda a, b: torch.matmul(a, b, out=out)
    competitors = {
        "torch dlpack views": lambda: harness.torch_batch(torch.matmul, views),
        "torch native": lambda: harness.torch_batch(torch.matmul, native),
        "torch native out=": lambda: harness.torch_batch(matmul_out, native),
        "torch native graph": lambda: harness.torch_batch(
            torch.matmul, native, graph=True),
        "xla_dot": lambda: harness.jax_batch(lambda a, b: jnp.dot(a, b), pairs),
        "rlk_cuda_ffi": lambda: harness.jax_batch(functools.partial(
            rlk_jax.det_gemm, implementation="cuda_ffi"), pairs),
    }
    rows = harness.interleaved_rows("check", f"{name} M={m} K={k} N={n}",
                                    competitors, flops=flops)
    print(f"\n{name} ({sets} calls a program or loop)")
    for r in rows:
      print(f"  {r.implementation:22s} " + (
          f"{r.median_ms:.4f} ms {r.tflops:6.1f} TFLOP/s" if r.median_ms
          else r.note))


if __name__ == "__main__":
  main(sys.argv[1:])
