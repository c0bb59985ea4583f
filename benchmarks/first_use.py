"""What a user waits for on a fresh Hopper machine: the first det_gemm result
(jitted JAX and torch), the SM90 kernels in use, the whole build, and the
time an interrupted build loses. Not part of the main job: it needs a
machine whose cache has no library (it makes its own empty caches).

    python -m benchmarks.first_use --out DIR [--interrupt_after S]

Two processes start at once, as two users' first steps would: one calls a
jitted ``rlk_jax.det_gemm``, the other ``rlk_torch_bridge.det_gemm``; the
first of them starts the build in the background. Each then polls until its
product's SM90 kernel is built, runs the product again on it, and checks
the bits equal the first result's. With ``--interrupt_after``, a second
empty cache gets ``python -m cuda_ffi.build`` stopped with Ctrl-C (SIGINT
to its process group) after S seconds, then run again to the end. Writes
``first_use.csv`` (device, date, commit on every row) and prints it.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

M, K, N = 512, 4096, 4096  # a mid-size product of a model's forward


def _child(kind: str) -> dict:
  """One user's first steps, timed from RLK_T0; a dict of seconds."""
  t0 = float(os.environ["RLK_T0"])
  now = lambda: round(time.time() - t0, 2)
  import numpy as np
  import cuda_ffi
  from rlk_jax import _gemm_tuning
  rng = np.random.default_rng(0)
  a_np = rng.standard_normal((M, K), np.float32)
  b_np = rng.standard_normal((K, N), np.float32)
  if kind == "jax":
    import jax
    import jax.numpy as jnp
    import rlk_jax
    a, b = jnp.asarray(a_np, jnp.bfloat16), jnp.asarray(b_np, jnp.bfloat16)
    run = lambda: np.asarray(jax.jit(  # a fresh trace each time
        lambda a, b: rlk_jax.det_gemm(a, b))(a, b).astype(jnp.float32))
    on_sm90 = lambda: "rlk_det_gemm_sm90" in jax.jit(
        lambda a, b: rlk_jax.det_gemm(a, b)).lower(a, b).as_text()
  else:
    import torch
    import rlk_torch_bridge
    a = torch.from_numpy(a_np).to("cuda", torch.bfloat16)
    b = torch.from_numpy(b_np).to("cuda", torch.bfloat16)
    run = lambda: rlk_torch_bridge.det_gemm(a, b).float().cpu().numpy()
    on_sm90 = lambda: cuda_ffi.unavailable_reason("gpu", wait=False) is None
  first = run()
  out = {f"{kind}: first det_gemm result": now(),
         f"{kind}: first result on the SM90 kernels": None}
  kernel = lambda: _gemm_tuning.choose_config(
      M, N, K, transpose_a=False, transpose_b=False, out_f32=False)
  deadline = time.time() + 1200  # a build that fails ends the wait
  while time.time() < deadline:
    library = cuda_ffi.unavailable_reason("gpu", wait=False) is None
    if library and kernel() is not None and on_sm90():
      again = run()
      out[f"{kind}: first result on the SM90 kernels"] = now()
      out[f"{kind}: SM90 bits equal the first result's"] = bool(
          np.array_equal(again, first))
      break
    time.sleep(0.5)
  while not cuda_ffi.build_complete() and time.time() < deadline:
    time.sleep(0.5)
  out[f"{kind}: whole library loaded"] = now()
  return out


def _build_until_done(env, interrupt_after: float | None, log) -> float:
  """Runs ``python -m cuda_ffi.build`` (stopped with SIGINT after
  `interrupt_after` seconds if given); its wall seconds."""
  start = time.time()
  with open(log, "a") as f:
    proc = subprocess.Popen([sys.executable, "-m", "cuda_ffi.build"], env=env,
                            stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            # as a terminal's Ctrl-C finds it, even where
                            # this process runs with SIGINT ignored
                            preexec_fn=lambda: signal.signal(
                                signal.SIGINT, signal.SIG_DFL))
  try:
    proc.wait(timeout=interrupt_after)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
    proc.wait()
  return time.time() - start


def main(argv) -> int:
  args = dict(zip(argv[1::2], argv[2::2]))
  if "--child" in args:
    print(json.dumps(_child(args["--child"])))
    return 0
  out = pathlib.Path(args["--out"])
  out.mkdir(parents=True, exist_ok=True)
  cache = out / "cache"
  if cache.exists():
    raise SystemExit(f"{cache} exists: first use needs an empty cache")
  env = {**os.environ, "RLK_CACHE_DIR": str(cache), "RLK_T0": str(time.time())}
  children = [subprocess.Popen(
      [sys.executable, "-m", "benchmarks.first_use", "--child", kind],
      env=env, stdout=subprocess.PIPE, stderr=open(out / f"{kind}.log", "w"),
      text=True) for kind in ("jax", "torch")]
  rows = {}
  for child in children:
    stdout, _ = child.communicate()
    rows.update(json.loads(stdout.strip().splitlines()[-1]))
  progress = next(cache.glob("cuda_ffi/*/progress.json"))
  build = json.loads(progress.read_text())
  rows["background build: whole (its own clock)"] = build["elapsed_s"]
  for log in cache.glob("cuda_ffi/*/build.log"):
    (out / "build.log").write_text(log.read_text())
  _write(out, rows)
  if "--interrupt_after" in args:
    after = float(args["--interrupt_after"])
    env = {**os.environ, "RLK_CACHE_DIR": str(out / "cache_interrupted")}
    log = out / "interrupted_build.log"
    first = _build_until_done(env, after, log)
    second = _build_until_done(env, None, log)
    rows[f"build stopped by Ctrl-C at {after:.0f} s: its run"] = round(first, 1)
    rows["then the build run again to the end"] = round(second, 1)
    rows["time lost to the interruption (both runs - whole build)"] = round(
        first + second - build["elapsed_s"], 1)
  _write(out, rows)
  for measure, value in rows.items():
    print(f"{measure:62s} {value}")
  return 0


def _write(out: pathlib.Path, rows: dict) -> None:
  device = _device()
  date = datetime.date.today().isoformat()
  commit = os.environ.get("RLK_COMMIT") or _commit()
  with open(out / "first_use.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["device", "date", "commit", "measure", "seconds"])
    for measure, value in rows.items():
      writer.writerow([device, date, commit, measure, value])


def _device() -> str:
  import torch
  return torch.cuda.get_device_name(0)


def _commit() -> str:
  done = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True)
  return done.stdout.strip() or "unknown"


if __name__ == "__main__":
  sys.exit(main(sys.argv))
