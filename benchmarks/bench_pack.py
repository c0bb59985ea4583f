"""pack / unpack against the peers, and the memory case that motivates packing.

    python -m benchmarks.bench_pack [--smoke] [--csv out.csv] [--pack_sweep]

Competitors (stable names): ``rlk_pallas`` (pack from the mask, metadata
included), ``rlk_pallas_reuse_info`` (pack with a PackInfo computed earlier),
``rlk_xla`` (the reference), ``xla_nonzero_take`` (``jnp.nonzero(size=capacity)``
+ ``take`` in jit), ``torch_boolean_index`` (``x[mask]``).

Bytes counted (the floor): pack reads the active rows and writes ``capacity``
rows; unpack reads the active packed rows and writes every dense row;
``x[mask]`` reads and writes the active rows. The floor time is those bytes
over the copy bandwidth measured in the same run (read + write).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import rlk_jax
from benchmarks import harness
from benchmarks.harness import Row
from pallas_kernels import row_gather

SWEEP = flags.DEFINE_bool(
    "pack_sweep", False, "Also time a grid of Pallas kernel configs.")

BENCH = "pack"


def _shapes(smoke: bool):
  if smoke:
    # Two densities: enough to show each row and figure is made.
    return dict(batch=4, seq=128, hidden=256, dtype=jnp.bfloat16,
                densities=(0.3, 1.0))
  return dict(batch=32, seq=1024, hidden=4096, dtype=jnp.bfloat16,
              densities=(0.05, 0.3, 0.7, 1.0))


# Each timed program runs CALLS calls over BUFFERS input buffers (several,
# so repeated calls do not re-read a warm cache). One jitted execution costs
# the GPU about 40 us of idle time beyond its kernels on the H100 (the
# CUPTI trace of lab/profile_jit_kernels.py: 4 packs of 67 us ran in a
# program of 306 us); 16 calls spread that over the calls, as an op inside a
# training step would (the CPU smoke run keeps one call a buffer). Distinct
# masks (or addends) keep XLA from merging calls that share a buffer.
BUFFERS, CALLS = 4, 16


def _to_torch(torch, x):
  if harness.on_gpu():
    return torch.from_dlpack(x)  # zero-copy on the device
  # The CPU smoke path: a host copy (torch's CPU DLPack import of bf16 is
  # not needed for a baseline).
  return torch.from_numpy(np.array(x.astype(jnp.float32))).to(
      getattr(torch, jnp.dtype(x.dtype).name))




def run(smoke: bool) -> list[Row]:
  cfg = _shapes(smoke)
  b, s, h, dtype = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["dtype"]
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), BUFFERS)
  buffers = [jax.random.normal(k, (b, s, h), jnp.float32).astype(dtype)
             for k in keys]
  xs = [buffers[i % BUFFERS] for i in range(BUFFERS if smoke else CALLS)]
  bw_gbps, rows = harness.copy_bandwidth(BENCH, xs, _to_torch)
  row_bytes = h * jnp.dtype(dtype).itemsize
  torch = harness.torch_or_none()

  for density in cfg["densities"]:
    active = int(round(density * b * s))
    # One mask per call, all with exactly `active` rows: distinct masks keep
    # XLA from merging calls.
    masks = [_mask_with(rng, (b, s), active) for _ in xs]
    for cap_name, capacity in (("cap=mask.size", b * s),
                               ("cap=active_r128", -(-active // 128) * 128)):
      case = f"[{b},{s},{h}] {jnp.dtype(dtype).name} density={density} {cap_name}"
      pack_bytes = (active + capacity) * row_bytes
      floor_ms = pack_bytes / bw_gbps / 1e6

      def add(impl, fn, args, nbytes=pack_bytes, floor=floor_ms, note=""):
        rows.append(harness.timed_row(BENCH, case, impl, fn, args,
                                      nbytes=nbytes, floor_ms=floor, note=note))

      for impl in ("cuda_ffi", "pallas", "xla"):
        if rlk_jax.implementations("pack")[impl] is None:
          add(f"rlk_{impl}", functools.partial(
              _pack_from_mask, capacity=capacity, implementation=impl),
              list(zip(xs, masks)))
      add("rlk_pack_info_only", functools.partial(rlk_jax.pack_info,
                                                  capacity=capacity),
          [(m,) for m in masks], nbytes=None, floor=None,
          note="the metadata alone (XLA ops)")
      if rlk_jax.implementations("pack")["cuda_ffi"] is None:
        add("rlk_cuda_ffi_pack_info_only", functools.partial(
            rlk_jax.pack_info, capacity=capacity, implementation="cuda_ffi"),
            [(m,) for m in masks], nbytes=None, floor=None,
            note="the metadata alone (CUDA kernels)")
      infos = [rlk_jax.pack_info(m, capacity=capacity) for m in masks]
      add(f"rlk_{rlk_jax.selected_implementation('pack')}_reuse_info",
          _pack_with_info, list(zip(xs, infos)))
      add("xla_nonzero_take", functools.partial(_nonzero_take, capacity=capacity),
          list(zip(xs, masks)))
      packed = [rlk_jax.pack(x, info)[0] for x, info in zip(xs, infos)]
      unpack_bytes = (active + b * s) * row_bytes
      add("rlk_unpack", rlk_jax.unpack, list(zip(packed, infos)),
          nbytes=unpack_bytes, floor=unpack_bytes / bw_gbps / 1e6)
      del packed
      if SWEEP.value and cap_name == "cap=active_r128":
        rows += _sweep(case, xs, infos, pack_bytes, floor_ms)

    if torch is not None:
      case = f"[{b},{s},{h}] {jnp.dtype(dtype).name} density={density} cap=active"
      nbytes = 2 * active * row_bytes
      tmask = _to_torch(torch, masks[0])
      ms = harness.time_torch(lambda t: t[tmask], [(_to_torch(torch, x),) for x in xs])
      rows.append(Row(BENCH, case, "torch_boolean_index", ms, nbytes / ms / 1e6,
                      nbytes / bw_gbps / 1e6, note="host sync inside x[mask]"))

  return rows


def _mask_with(rng, shape, active):
  flat = np.zeros(int(np.prod(shape)), bool)
  flat[rng.permutation(flat.size)[:active]] = True
  return jnp.asarray(flat.reshape(shape))


def _pack_from_mask(x, mask, *, capacity, implementation):
  return rlk_jax.pack(x, mask, capacity=capacity, implementation=implementation)[0]


def _pack_with_info(x, info):
  return rlk_jax.pack(x, info)[0]


def _nonzero_take(x, mask, *, capacity):
  idx = jnp.nonzero(mask.reshape(-1), size=capacity, fill_value=0)[0]
  return jnp.take(x.reshape(-1, x.shape[-1]), idx, axis=0)


def _sweep(case, xs, infos, nbytes, floor_ms) -> list[Row]:
  """Kernel configs side by side, to choose the default on this device."""
  rows = []
  h = xs[0].shape[-1]
  for block_rows, block_cols, warps in [(1, 4096, 4), (2, 4096, 8), (2, 4096, 4),
                                        (4, 2048, 8), (8, 1024, 4), (2, 2048, 4)]:
    config = row_gather.GatherConfig(block_rows, block_cols, warps)
    fn = lambda x, idx, c=config: row_gather.gather_rows(
        x.reshape(-1, h), idx, 0, config=c, interpret=not harness.on_gpu())
    rows.append(harness.timed_row(
        BENCH, case, f"sweep_R{block_rows}_C{block_cols}_W{warps}", fn,
        [(x, info.gather_map) for x, info in zip(xs, infos)], nbytes=nbytes,
        floor_ms=floor_ms))
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
