"""Where the torch bridge's DLPack route spends its time, on a GPU: each
stage timed alone (import into JAX, the jitted op, export to torch, whole
bridge calls) and a cProfile of bridge calls, printed and written to
$OUT/profile.txt. A diagnostic for the bridge-overhead goal, not a test.

    device run (carry .whl): RLK_CUDA_FFI_LIB=... python3 scripts/profile_bridge_dlpack.py
"""
import cProfile, io, os, pstats, time
import jax, jax.numpy as jnp, torch
import rlk_jax, rlk_torch_bridge as rtb
from rlk_torch_bridge import _dlpack, functions

out = os.environ.get("OUT", "/tmp")
x = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)
mask = torch.rand(8, 512, device="cuda") < 0.5
packed, info = rtb.pack(x, mask)
jx, jmask = _dlpack.to_jax_all(x, mask)
buf = info.jax_buffer()
move = dict(direction="pack", mask_shape=info.mask_shape, capacity=info.capacity,
            fill=0, implementation="pallas")
jout = functions._move(jx, buf, **move)


def per_call(fn, n=300):
  for _ in range(20): fn()
  torch.cuda.synchronize(); jax.block_until_ready(jx)
  t = time.perf_counter()
  for _ in range(n): r = fn()
  torch.cuda.synchronize()
  if isinstance(r, jax.Array): r.block_until_ready()
  return (time.perf_counter() - t) / n * 1e6


def composite():
  a = _dlpack.to_jax(x)
  return functions._move(a, buf, **move)


jpack = jax.jit(lambda x, m: rlk_jax.pack(x, m))
jpack_info = jax.jit(lambda x, i: rlk_jax.pack(x, i)[0])
jinfo = rlk_jax.pack_info(jmask)
cur = torch.cuda.current_stream()
stages = {
  "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
  "event record + external wait": lambda: _dlpack._jax_stream_waits_for_torch(
      x.device, _dlpack._jax_device(x.device)),
  "to_jax(x)": lambda: _dlpack.to_jax(x),
  "to_jax_all(x, mask)": lambda: _dlpack.to_jax_all(x, mask),
  "jax.dlpack.from_dlpack(x) (public)": lambda: jax.dlpack.from_dlpack(x),
  "jitted _move on JAX-owned x": lambda: functions._move(jx, buf, **move),
  "to_jax(x) then jitted _move": composite,
  "to_torch(done array)": lambda: _dlpack.to_torch(jout),
  "torch.from_dlpack(done array) (public)": lambda: torch.from_dlpack(jout),
  "info.jax_buffer()": lambda: info.jax_buffer(),
  "jitted rlk_jax.pack(x, mask) on JAX arrays": lambda: jpack(jx, jmask),
  "rtb.pack(x, mask)": lambda: rtb.pack(x, mask)[0],
  "jitted rlk_jax.pack(x, info) on JAX arrays": lambda: jpack_info(jx, jinfo),
  "rtb.pack(x, info)": lambda: rtb.pack(x, info)[0],
  "rtb.unpack(packed, info)": lambda: rtb.unpack(packed, info),
}
lines = [f"{per_call(fn):9.1f} us  {name}" for name, fn in stages.items()]
xg = x.clone().requires_grad_()
lines.append(f"{per_call(lambda: rtb.pack(xg, info)[0]):9.1f} us  rtb.pack(x requires_grad, info)")
a = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
lines.append(f"{per_call(lambda: rtb.det_gemm(a, b, implementation='pallas')):9.1f} us  rtb.det_gemm pallas (DLPack route)")
lines.append(f"{per_call(lambda: rtb.det_gemm(a, b)):9.1f} us  rtb.det_gemm default")
print("\n".join(lines))
pr = cProfile.Profile(); pr.enable()
for _ in range(300): rtb.pack(x, info)
for _ in range(300): rtb.pack(x, mask)
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
open(os.path.join(out, "profile.txt"), "w").write("\n".join(lines) + "\n\n" + s.getvalue())
print(s.getvalue()[:5000])
