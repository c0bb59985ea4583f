"""What the torch bridge adds per call over the JAX op itself.

    python -m benchmarks.bench_bridge [--smoke] [--csv out.csv]

Small inputs, so the per-call overhead shows: ``rlk_jax`` (the jitted JAX op on
JAX arrays, its default implementation), ``rlk_torch_bridge`` (the same op on
torch tensors, default route: on SM90 the CUTLASS kernels launched directly on
torch's stream), ``rlk_torch_bridge_dlpack`` (the pallas implementation
through DLPack and a JAX call, the route every other op takes) and
``torch_native`` (torch.matmul) for scale. Bridge notes give the added
microseconds per call over ``rlk_jax``.
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
    route = rlk_jax._det_gemm.plan(
        ja, jb, platform="gpu" if device == "cuda" else "cpu").implementation
    bridge_ms = harness.time_torch(lambda x: rtb.det_gemm(x, b), [(a,)], iters=50)
    dlpack_ms = harness.time_torch(
        lambda x: rtb.det_gemm(x, b, implementation="pallas" if device == "cuda"
                               else "xla"), [(a,)], iters=50)
    native_ms = harness.time_torch(lambda x: torch.matmul(x, b), [(a,)], iters=50)
    added = lambda ms: f"+{(ms - jax_ms) * 1e3:.0f} us over rlk_jax"
    rows += [
        Row(BENCH, case, "rlk_jax", jax_ms,
            note=f"jitted call on JAX arrays ({route})"),
        Row(BENCH, case, "rlk_torch_bridge", bridge_ms,
            note=f"{added(bridge_ms)} ({route}"
                 f"{' direct launch' if route == 'cuda_ffi' else ''})"),
        Row(BENCH, case, "rlk_torch_bridge_dlpack", dlpack_ms,
            note=added(dlpack_ms)),
        Row(BENCH, case, "torch_native", native_ms, note="torch.matmul"),
    ]
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
