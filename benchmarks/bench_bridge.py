"""What the torch bridge adds per call over the JAX op itself.

    python -m benchmarks.bench_bridge [--smoke] [--csv out.csv]

Small inputs, so the per-call overhead shows: ``rlk_jax`` (the jitted JAX op on
JAX arrays, its default implementation), ``rlk_torch_bridge`` (the same op on
torch tensors; det_gemm's default route on SM90 launches the CUTLASS kernels
directly on torch's stream, pack/unpack go through DLPack and one JAX call),
``rlk_torch_bridge_dlpack`` (det_gemm's pallas implementation through DLPack
and a JAX call) and ``torch_native`` (torch.matmul, ``x[mask]``) for scale.
Bridge notes give the added microseconds per call over ``rlk_jax``.
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
  device = "cuda" if harness.on_gpu() and torch.cuda.is_available() else "cpu"
  return _det_gemm_rows(torch, device, smoke) + _pack_rows(torch, device, smoke)


def _jax_ms(fn, *args):
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))  # compile
  harness.tune_traced_products()
  return harness.time_batches(
      lambda it: jax.block_until_ready([jitted(*args) for _ in range(max(it, 1))]),
      iters=50)


def _added(ms, jax_ms):
  return f"+{(ms - jax_ms) * 1e3:.0f} us over rlk_jax"


def _det_gemm_rows(torch, device, smoke):
  import rlk_torch_bridge as rtb
  rows = []
  for m, k, n in ((16, 1024, 1024), (1, 4096, 4096)) if not smoke else ((16, 256, 256),):
    case = f"det_gemm M={m} K={k} N={n} bf16 ({device})"
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    ja, jb = _as_jax(a), _as_jax(b)
    jax_ms = _jax_ms(rlk_jax.det_gemm, ja, jb)
    route = rlk_jax._det_gemm.plan(
        ja, jb, platform="gpu" if device == "cuda" else "cpu").implementation
    bridge_ms = harness.time_torch(lambda x: rtb.det_gemm(x, b), [(a,)], iters=50)
    dlpack_ms = harness.time_torch(
        lambda x: rtb.det_gemm(x, b, implementation="pallas" if device == "cuda"
                               else "xla"), [(a,)], iters=50)
    native_ms = harness.time_torch(lambda x: torch.matmul(x, b), [(a,)], iters=50)
    rows += [
        Row(BENCH, case, "rlk_jax", jax_ms,
            note=f"jitted call on JAX arrays ({route})"),
        Row(BENCH, case, "rlk_torch_bridge", bridge_ms,
            note=f"{_added(bridge_ms, jax_ms)} ({route}"
                 f"{' direct launch' if route == 'cuda_ffi' else ''})"),
        Row(BENCH, case, "rlk_torch_bridge_dlpack", dlpack_ms,
            note=_added(dlpack_ms, jax_ms)),
        Row(BENCH, case, "torch_native", native_ms, note="torch.matmul"),
    ]
  return rows


def _pack_rows(torch, device, smoke):
  """pack from a mask (metadata and rows in one call), pack with a reused
  info, and unpack: the bridge's DLPack route, one JAX call each."""
  import rlk_torch_bridge as rtb
  b, t, d = (4, 64, 32) if smoke else (8, 512, 256)
  x = torch.randn(b, t, d, device=device, dtype=torch.bfloat16)
  mask = torch.rand(b, t, device=device) < 0.5
  packed, info = rtb.pack(x, mask)
  jx, jmask, jpacked = _as_jax(x), _as_jax(mask), _as_jax(packed)
  jinfo = rlk_jax.pack_info(jmask)
  shape = f"[{b},{t}] x {d} bf16 ({device})"
  dlpack = "pallas" if device == "cuda" else "xla"
  cases = (
      (f"pack from mask {shape}", lambda: _jax_ms(rlk_jax.pack, jx, jmask),
       lambda x, m, impl=None: rtb.pack(x, m, implementation=impl), (x, mask)),
      (f"pack with info {shape}",
       lambda: _jax_ms(lambda x, i: rlk_jax.pack(x, i)[0], jx, jinfo),
       lambda x, i, impl=None: rtb.pack(x, i, implementation=impl)[0], (x, info)),
      (f"unpack {shape}", lambda: _jax_ms(rlk_jax.unpack, jpacked, jinfo),
       lambda p, i, impl=None: rtb.unpack(p, i, implementation=impl),
       (packed, info)),
  )
  route = rlk_jax.selected_implementation(
      "pack", platform="gpu" if device == "cuda" else "cpu")
  rows = []
  for case, jax_time, bridge_op, args in cases:
    jax_ms = jax_time()
    bridge_ms = harness.time_torch(bridge_op, [args], iters=50)
    dlpack_ms = harness.time_torch(lambda *a: bridge_op(*a, impl=dlpack),
                                   [args], iters=50)
    direct = route == "cuda_ffi" and device == "cuda"
    rows += [Row(BENCH, case, "rlk_jax", jax_ms,
                 note=f"jitted call on JAX arrays ({route})"),
             Row(BENCH, case, "rlk_torch_bridge", bridge_ms,
                 note=f"{_added(bridge_ms, jax_ms)} ({route}"
                      f"{' direct launch' if direct else ''})"),
             Row(BENCH, case, "rlk_torch_bridge_dlpack", dlpack_ms,
                 note=f"{_added(dlpack_ms, jax_ms)} ({dlpack} through DLPack)")]
  native_ms = harness.time_torch(lambda x, m: x[m], [(x, mask)], iters=50)
  rows.append(Row(BENCH, f"pack from mask {shape}", "torch_native", native_ms,
                  note="x[mask] (syncs on the active count)"))
  return rows


def _as_jax(t):
  import torch
  if t.dtype == torch.bfloat16:
    return jnp.asarray(np.asarray(t.float().cpu())).astype(jnp.bfloat16)
  return jnp.asarray(np.asarray(t.cpu()))


if __name__ == "__main__":
  app.run(harness.bench_main(run))
