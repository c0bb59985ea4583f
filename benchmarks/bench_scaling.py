"""Past one device: data-parallel det_gemm and pack, D devices against one.

    python -m benchmarks.bench_scaling [--smoke] [--csv out.csv]

Weak scaling: each device gets the per-device problem (det_gemm: M=4096 rows
of the projection shapes; pack: a [16, 1024, 4096] bf16 batch), so ideal
scaling keeps the time of one device. Competitors (stable names):
``1_device`` (the problem on one device, ``rlk_jax.det_gemm`` /
``rlk_jax.pack``) and ``<D>_devices`` (D times the problem, sharded over a
``data`` mesh axis: ``det_gemm`` on row-sharded A under ``jit`` — its
partitioning rule keeps it local — and ``rlk_jax.pack_sharded``). The note
gives the efficiency, one device's time over D devices' time (goal >= 0.9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import rlk_jax
from benchmarks import harness
from benchmarks.harness import Row

BENCH = "scaling"


def _cases(smoke: bool):
  if smoke:
    return ([("qkv", 64, 128, 96)], dict(batch=2, seq=64, hidden=32, density=0.5))
  gemms = [("qkv", 4096, 4096, 6144), ("o", 4096, 4096, 4096),
           ("gate_up", 4096, 4096, 28672), ("down", 4096, 14336, 4096)]
  return gemms, dict(batch=16, seq=1024, hidden=4096, density=0.5)


def _pair(one: Row, many: Row) -> list[Row]:
  if one.median_ms and many.median_ms:
    many.note = f"efficiency {one.median_ms / many.median_ms:.3f}"
  return [one, many]


def _gemm_rows(mesh, name, m, k, n) -> list[Row]:
  devices = mesh.size
  keys = jax.random.split(jax.random.key(m + k + n), 3)
  b = jax.random.normal(keys[2], (k, n), jnp.float32).astype(jnp.bfloat16)
  a_sets = [jax.random.normal(kk, (devices * m, k), jnp.float32).astype(jnp.bfloat16)
            for kk in keys[:2]]
  case = f"det_gemm {name} M={m}/device K={k} N={n} bf16"
  flops = 2 * m * k * n
  first = jax.devices()[0]
  one = harness.timed_row(
      BENCH, case, "1_device", rlk_jax.det_gemm,
      [(jax.device_put(a[:m], first), jax.device_put(b, first)) for a in a_sets],
      flops=flops)
  rows_sharded = NamedSharding(mesh, P("data"))
  whole = NamedSharding(mesh, P())
  many = harness.timed_row(
      BENCH, case, f"{devices}_devices", rlk_jax.det_gemm,
      [(jax.device_put(a, rows_sharded), jax.device_put(b, whole)) for a in a_sets],
      flops=devices * flops)
  return _pair(one, many)


def _pack_rows(mesh, batch, seq, hidden, density) -> list[Row]:
  devices = mesh.size
  rng = np.random.default_rng(0)
  x_sets, masks = [], []
  for i in range(2):
    x_sets.append(jax.random.normal(jax.random.key(i), (devices * batch, seq, hidden),
                                    jnp.float32).astype(jnp.bfloat16))
    masks.append(jnp.asarray(rng.random((devices * batch, seq)) < density))
  capacity = batch * seq  # per device: every row could be active
  case = f"pack [{batch},{seq},{hidden}]/device bf16 density={density}"
  nbytes = capacity * hidden * 2 * (1 + density)  # active rows read, capacity written
  first = jax.devices()[0]
  one = harness.timed_row(
      BENCH, case, "1_device", lambda x, m: rlk_jax.pack(x, m, capacity=capacity)[0],
      [(jax.device_put(x[:batch], first), jax.device_put(m[:batch], first))
       for x, m in zip(x_sets, masks)], nbytes=nbytes)
  data = NamedSharding(mesh, P("data"))
  many = harness.timed_row(
      BENCH, case, f"{devices}_devices",
      lambda x, m: rlk_jax.pack_sharded(x, m, mesh=mesh, axis="data",
                                        capacity=capacity)[0],
      [(jax.device_put(x, data), jax.device_put(m, data))
       for x, m in zip(x_sets, masks)], nbytes=devices * nbytes)
  return _pair(one, many)


def run(smoke: bool) -> list[Row]:
  devices = jax.device_count()
  if devices < 2:
    return [harness.progress(Row(
        BENCH, "data-parallel weak scaling", "1_device",
        note=f"not measured: needs 2 or more devices, this machine has {devices}"))]
  mesh = Mesh(np.array(jax.devices()), ("data",))
  gemms, pack = _cases(smoke)
  rows = []
  for name, m, k, n in gemms:
    rows += _gemm_rows(mesh, name, m, k, n)
  rows += _pack_rows(mesh, **pack)
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
