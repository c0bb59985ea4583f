"""One call of cuBLAS and of each det_gemm_variants.cu instantiation per
product, for Nsight Compute to read their counters side by side (launch
shape, tensor-pipe and memory throughput):

    ncu --clock-control none -k 'regex:nvjet|device_kernel' --section ... \
      python lab/profile_gemm_variants.py DIR 41,56 512x14336x5120 ...

Products are MxKxN, forward layout (B stored [K, N]); variants that take B
stored [N, K] get its transpose."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..",
                                "benchmarks", "cuda"))
import det_gemm_variants  # noqa: E402


def main(argv):
  directory, indices, shapes = argv[1], argv[2].split(","), argv[3:]
  variants = [det_gemm_variants.Variant(
      os.path.join(directory, f"variant_{n}.so")) for n in indices]
  for shape in shapes:
    m, k, n = map(int, shape.split("x"))
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    print(shape, "cublas", flush=True)
    torch.matmul(a, b, out=c)
    for v in variants:
      print(shape, v.name, flush=True)
      v(a, b.t().contiguous() if v.transpose_b else b, c)
    torch.cuda.synchronize()


if __name__ == "__main__":
  main(sys.argv)
