"""What the torch bridge adds per call over the JAX op itself.

    python -m benchmarks.bench_bridge [--smoke] [--csv out.csv]

Small inputs, so the per-call overhead shows: ``rlk_jax`` (the jitted JAX op on
JAX arrays), ``rlk_torch_bridge`` (the same op on torch tensors through
DLPack), and ``torch_native`` (torch.matmul) for scale. The bridge row's note
gives the added microseconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import rlk_jax
from benchmarks import harness
from benchmarks.harness import Row

BENCH = "bridge"


def run(smoke: bool) -> list[Row]:
  torch = harness.torch_or_none()
  if torch is None:
    return [Row(BENCH, "det_gemm", "rlk_torch_bridge", note="torch not installed")]
  import rlk_torch_bridge as rtb
  device = "cuda" if harness.on_gpu() and torch.cuda.is_available() else "cpu"
  rows = []
  for m, k, n in ((16, 1024, 1024), (1, 4096, 4096)) if not smoke else ((16, 256, 256),):
    case = f"det_gemm M={m} K={k} N={n} bf16 ({device})"
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    ja, jb = jnp.asarray(np.asarray(a.float().cpu())).astype(jnp.bfloat16), \
        jnp.asarray(np.asarray(b.float().cpu())).astype(jnp.bfloat16)
    jitted = jax.jit(rlk_jax.det_gemm)
    jax_ms = harness.time_batches(
        lambda it: jax.block_until_ready([jitted(ja, jb) for _ in range(max(it, 1))]),
        iters=50)
    bridge_ms = harness.time_torch(lambda x: rtb.det_gemm(x, b), [(a,)], iters=50)
    native_ms = harness.time_torch(lambda x: torch.matmul(x, b), [(a,)], iters=50)
    rows += [
        Row(BENCH, case, "rlk_jax", jax_ms, note="jitted call on JAX arrays"),
        Row(BENCH, case, "rlk_torch_bridge", bridge_ms,
            note=f"+{(bridge_ms - jax_ms) * 1e3:.0f} us over rlk_jax"),
        Row(BENCH, case, "torch_native", native_ms, note="torch.matmul"),
    ]
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
