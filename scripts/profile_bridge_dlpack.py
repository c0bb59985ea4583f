"""Where the torch bridge's DLPack route spends its time, on a GPU: each
stage timed alone (import into JAX, export to torch, the jitted op, whole
bridge calls) and a cProfile of bridge calls, printed and written to
$OUT/profile.txt. A diagnostic for the bridge-overhead goal, not a test.

    device run (carry .whl): RLK_CUDA_FFI_LIB=... python3 scripts/profile_bridge_dlpack.py
"""
import cProfile, io, os, pstats, time
import jax, jax.numpy as jnp, torch
import rlk_jax, rlk_torch_bridge as rtb
from rlk_torch_bridge import _dlpack, functions

out = os.environ.get("OUT", "/tmp")
a = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
ja, jb = _dlpack.to_jax(a), _dlpack.to_jax(b)
fwd = functions._det_gemm_forward

def per_call(fn, n=300):
  for _ in range(20): fn()
  torch.cuda.synchronize(); jax.block_until_ready(ja)
  t = time.perf_counter()
  for _ in range(n): r = fn()
  torch.cuda.synchronize()
  if isinstance(r, jax.Array): r.block_until_ready()
  return (time.perf_counter() - t) / n * 1e6

stages = {
  "to_jax(a)": lambda: _dlpack.to_jax(a),
  "to_jax(a)+to_jax(b)": lambda: (_dlpack.to_jax(a), _dlpack.to_jax(b)),
  "jax.dlpack.from_dlpack(a) raw": lambda: jax.dlpack.from_dlpack(a),
  "to_torch(jax array)": lambda: _dlpack.to_torch(fwd(ja, jb, out_dtype=None, implementation="pallas", transpose_b=False)),
  "jitted pallas fwd on jax arrays": lambda: fwd(ja, jb, out_dtype=None, implementation="pallas", transpose_b=False),
  "rtb.det_gemm pallas (no grad)": lambda: rtb.det_gemm(a, b, implementation="pallas"),
  "rtb.det_gemm cuda_ffi direct": lambda: rtb.det_gemm(a, b),
}
lines = []
for name, fn in stages.items():
  lines.append(f"{per_call(fn):9.1f} us  {name}")
with torch.no_grad():
  lines.append(f"{per_call(lambda: rtb.det_gemm(a, b, implementation='pallas')):9.1f} us  rtb.det_gemm pallas under no_grad")
ag = a.clone().requires_grad_()
lines.append(f"{per_call(lambda: rtb.det_gemm(ag, b, implementation='pallas')):9.1f} us  rtb.det_gemm pallas requires_grad (vjp)")
x = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)
mask = torch.rand(8, 512, device="cuda") < 0.5
lines.append(f"{per_call(lambda: rtb.pack(x, mask)[0], 100):9.1f} us  rtb.pack")
packed, info = rtb.pack(x, mask)
lines.append(f"{per_call(lambda: rtb.unpack(packed, info), 100):9.1f} us  rtb.unpack")
jx, jm = _dlpack.to_jax(x), _dlpack.to_jax(mask)
pj = jax.jit(lambda x, m: rlk_jax.pack(x, m))
lines.append(f"{per_call(lambda: pj(jx, jm)[0], 100):9.1f} us  jitted rlk_jax.pack on jax arrays")
print("\n".join(lines))
pr = cProfile.Profile(); pr.enable()
for _ in range(200): rtb.det_gemm(a, b, implementation="pallas")
for _ in range(100): rtb.pack(x, mask)
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
open(os.path.join(out, "profile.txt"), "w").write("\n".join(lines) + "\n\n" + s.getvalue())
print(s.getvalue()[:6000])
