"""What a benchmarked jitted program runs on the GPU, kernel by kernel, with
the idle gaps between kernels: torch.profiler (CUPTI) sees XLA's kernels
too. Each case is built the way `benchmarks.harness.time_jax` times it (one
program calling the op on several distinct argument sets), so the gaps are
the ones inside the benchmark's figure.

    python lab/profile_jit_kernels.py [case ...]   (GPU machine; stdout)

Run it under different XLA_FLAGS (e.g. --xla_gpu_enable_command_buffer=) to
see what XLA's command buffers (CUDA graphs) change. Each case also says
how many of its custom calls XLA captured in command buffers.
"""
import functools
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import rlk_jax
from benchmarks import bench_jit_steps as steps
from benchmarks import harness, xla_dump

B, S, H = 32, 1024, 4096


def _pack_cases():
  rng = np.random.default_rng(0)
  active = int(0.3 * B * S)
  capacity = -(-active // 128) * 128
  keys = jax.random.split(jax.random.key(0), 4)
  xs = [jax.random.normal(k, (B, S, H), jnp.float32).astype(jnp.bfloat16)
        for k in keys]
  masks = []
  for _ in xs:
    flat = np.zeros(B * S, bool)
    flat[rng.permutation(B * S)[:active]] = True
    masks.append(jnp.asarray(flat.reshape(B, S)))
  infos = [rlk_jax.pack_info(m, capacity=capacity) for m in masks]
  pack = lambda impl: (lambda x, m: rlk_jax.pack(
      x, m, capacity=capacity, implementation=impl)[0])
  return {
      "pack cuda_ffi from mask": (pack("cuda_ffi"), list(zip(xs, masks))),
      "pack pallas from mask": (pack("pallas"), list(zip(xs, masks))),
      "pack gather with info": (lambda x, i: rlk_jax.pack(x, i)[0],
                                list(zip(xs, infos))),
      "xla copy": (lambda x: x + jnp.ones((), x.dtype), [(x,) for x in xs]),
  }


def _gemm_cases():
  cases = {}
  # Decode products, then M=256 products where the Mosaic GPU kernel reads
  # 0.25-0.7x cuBLAS (the MoE expert's down and gate_up, llama3.2-3b's o).
  for m, k, n, impls in (
      (1, 4096, 4096, ("cuda_ffi", "pallas")),
      (16, 4096, 14336, ("cuda_ffi", "pallas")),
      (256, 768, 2048, ("cuda_ffi", "mosaic_gpu", "xla")),
      (256, 2048, 1536, ("cuda_ffi", "mosaic_gpu", "xla")),
      (256, 3072, 3072, ("cuda_ffi", "mosaic_gpu", "xla"))):
    keys = jax.random.split(jax.random.key(m + n), 32)
    pairs = [(jax.random.normal(keys[i], (m, k), jnp.float32).astype(jnp.bfloat16),
              jax.random.normal(keys[16 + i], (k, n), jnp.float32).astype(jnp.bfloat16))
             for i in range(16)]
    for impl in impls:
      fn = steps._xla_gemm if impl == "xla" else functools.partial(
          rlk_jax.det_gemm, implementation=impl)
      cases[f"det_gemm {impl} M={m} {k}->{n}"] = (fn, pairs)
  return cases


def _train_step_cases():
  capacity, args = steps._train_inputs(steps._sizes(smoke=False))
  return {
      f"packed training step {impl}": (
          jax.grad(functools.partial(steps.train_loss, impl == "rlk",
                                     capacity), argnums=(3, 4)), [args])
      for impl in ("rlk", "xla")}


def profile_case(name, fn, arg_sets):
  ms = harness.time_jax(fn, arg_sets, iters=10, repeats=7)
  many = jax.jit(lambda sets: [fn(*s) for s in sets])
  sets = list(arg_sets)
  jax.block_until_ready(many(sets))
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
      out = many(sets)
    jax.block_until_ready(out)
  events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                  key=lambda e: e.time_range.start)
  # One program execution = the kernels between two host-side waits; the
  # three executions were queued back to back, so split them evenly.
  per = len(events) // 3
  last = events[-per:] if per else []
  print(f"\n== {name}: time_jax {ms * 1e3:.1f} us per call "
        f"({len(sets)} calls per program)")
  with tempfile.TemporaryDirectory() as dump:
    sequence = xla_dump.thunk_sequence(many.lower(sets), dump)
  captured, outside = xla_dump.custom_call_thunks(sequence or "")
  print(f"   custom calls: {captured} in command buffers, {outside} outside"
        + ("" if sequence else " (no command buffer formed)"))
  if not last:
    print("   no kernels seen")
    return
  span = last[-1].time_range.end - last[0].time_range.start
  busy = sum(e.time_range.end - e.time_range.start for e in last)
  gaps = [b.time_range.start - a.time_range.end for a, b in zip(last, last[1:])]
  print(f"   {len(last)} kernels per program; span {span / len(sets):.1f} us and "
        f"busy {busy / len(sets):.1f} us per call; gaps median "
        f"{statistics.median(gaps) if gaps else 0:.1f} us, max "
        f"{max(gaps) if gaps else 0:.1f} us")
  between = last[0].time_range.start - events[-per - 1].time_range.end
  print(f"   gaps sum {sum(gaps):.1f} us inside the program, "
        f"{between:.1f} us before it (after the previous program)")
  for e, gap in zip(last[:12], [0.0] + gaps):
    print(f"   +{gap:6.1f} us gap  {e.time_range.end - e.time_range.start:8.1f} us"
          f"  {e.name[:80]}")
  if len(last) > 12:
    print("   largest gaps: us, after -> before")
    for i in sorted(range(len(gaps)), key=gaps.__getitem__)[::-1][:10]:
      print(f"   {gaps[i]:6.1f}  {last[i].name[:50]} -> {last[i + 1].name[:50]}")


def main(names):
  cases = {**_pack_cases(), **_gemm_cases(), **_train_step_cases()}
  for name, (fn, args) in cases.items():
    if names and not any(n in name for n in names):
      continue
    try:
      profile_case(name, fn, args)
    except Exception as e:  # noqa: BLE001 - report and go on to the next case
      print(f"\n== {name}: FAILED {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
  main(sys.argv[1:])
