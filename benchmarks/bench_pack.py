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
    return dict(batch=4, seq=128, hidden=256, dtype=jnp.bfloat16,
                densities=(0.05, 0.3, 0.7, 1.0), mem_hidden=64,
                mem_vocabs=(512, 2048), mem_densities=(0.05, 0.3, 1.0))
  return dict(batch=32, seq=1024, hidden=4096, dtype=jnp.bfloat16,
              densities=(0.05, 0.3, 0.7, 1.0), mem_hidden=4096,
              mem_vocabs=(32768, 131072), mem_densities=(0.05, 0.3, 0.7, 1.0))


def _copy_bandwidth(x) -> tuple[float, list[Row]]:
  """Device-to-device copy bandwidth (bytes read + written per second)."""
  rows = []
  nbytes = 2 * x.size * x.dtype.itemsize
  copy = jax.jit(lambda a: a + jnp.ones((), a.dtype))  # one read, one write
  ms = harness.time_jax(copy, [(x,)])
  rows.append(Row(BENCH, "copy", "xla_elementwise_copy", ms, nbytes / ms / 1e6))
  best = nbytes / ms / 1e6
  torch = _torch()
  if torch is not None:
    t = _to_torch(torch, x)
    dst = torch.empty_like(t)
    ms_t = harness.time_torch(lambda a: dst.copy_(a), [(t,)])
    rows.append(Row(BENCH, "copy", "torch_copy", ms_t, nbytes / ms_t / 1e6))
    best = max(best, nbytes / ms_t / 1e6)
  return best, rows


def _to_torch(torch, x):
  if harness.on_gpu():
    return torch.from_dlpack(x)  # zero-copy on the device
  # The CPU smoke path: a host copy (torch's CPU DLPack import of bf16 is
  # not needed for a baseline).
  return torch.from_numpy(np.array(x.astype(jnp.float32))).to(
      getattr(torch, jnp.dtype(x.dtype).name))


def _torch():
  try:
    import torch
  except ImportError:
    return None
  return torch


def _row_bytes(shape, dtype):
  return shape["hidden"] * jnp.dtype(dtype).itemsize


def run(smoke: bool) -> list[Row]:
  cfg = _shapes(smoke)
  b, s, h, dtype = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["dtype"]
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
  # Several buffers, so repeated calls do not just re-read a warm cache.
  xs = [jax.random.normal(k, (b, s, h), jnp.float32).astype(dtype) for k in keys]
  bw_gbps, rows = _copy_bandwidth(xs[0])
  row_bytes = h * jnp.dtype(dtype).itemsize
  torch = _torch()

  for density in cfg["densities"]:
    mask = jnp.asarray(rng.random((b, s)) < density)
    active = int(mask.sum())
    for cap_name, capacity in (("cap=mask.size", b * s),
                               ("cap=active_r128", -(-active // 128) * 128)):
      case = f"[{b},{s},{h}] {jnp.dtype(dtype).name} density={density} {cap_name}"
      pack_bytes = (active + capacity) * row_bytes
      floor_ms = pack_bytes / bw_gbps / 1e6

      def add(impl, fn, args, nbytes=pack_bytes, floor=floor_ms):
        ms = harness.time_jax(fn, args)
        rows.append(Row(BENCH, case, impl, ms, nbytes / ms / 1e6, floor))

      for impl in ("pallas", "xla"):
        if rlk_jax.implementations("pack")[impl] is not None:
          continue
        add(f"rlk_{impl}", jax.jit(functools.partial(
            _pack_from_mask, capacity=capacity, implementation=impl)),
            [(x, mask) for x in xs])
      _, info = rlk_jax.pack(xs[0], mask, capacity=capacity)
      ms = harness.time_jax(jax.jit(functools.partial(
          rlk_jax.pack_info, capacity=capacity)), [(mask,)])
      rows.append(Row(BENCH, case, "rlk_pack_info_only", ms,
                      note="metadata from the mask alone"))
      add(f"rlk_{rlk_jax.selected_implementation('pack')}_reuse_info",
          jax.jit(_pack_with_info), [(x, info) for x in xs])
      add("xla_nonzero_take", jax.jit(functools.partial(
          _nonzero_take, capacity=capacity)), [(x, mask) for x in xs])
      packed = [rlk_jax.pack(x, info)[0] for x in xs]
      unpack_bytes = (active + b * s) * row_bytes
      add("rlk_unpack", jax.jit(rlk_jax.unpack), [(p, info) for p in packed],
          nbytes=unpack_bytes, floor=unpack_bytes / bw_gbps / 1e6)
      if SWEEP.value and cap_name == "cap=active_r128":
        rows += _sweep(case, xs, info, pack_bytes, floor_ms)

    if torch is not None:
      case = f"[{b},{s},{h}] {jnp.dtype(dtype).name} density={density} cap=active"
      nbytes = 2 * active * row_bytes
      tmask = _to_torch(torch, mask)
      ms = harness.time_torch(lambda t: t[tmask], [(_to_torch(torch, x),) for x in xs])
      rows.append(Row(BENCH, case, "torch_boolean_index", ms, nbytes / ms / 1e6,
                      nbytes / bw_gbps / 1e6))

  rows += _memory_case(cfg)
  return rows


def _pack_from_mask(x, mask, *, capacity, implementation):
  return rlk_jax.pack(x, mask, capacity=capacity, implementation=implementation)[0]


def _pack_with_info(x, info):
  return rlk_jax.pack(x, info)[0]


def _nonzero_take(x, mask, *, capacity):
  idx = jnp.nonzero(mask.reshape(-1), size=capacity, fill_value=0)[0]
  return jnp.take(x.reshape(-1, x.shape[-1]), idx, axis=0)


def _sweep(case, xs, info, nbytes, floor_ms) -> list[Row]:
  """Kernel configs side by side, to choose the default on this device."""
  rows = []
  h = xs[0].shape[-1]
  for block_rows, block_cols, warps in [(1, 4096, 4), (1, 4096, 8), (2, 4096, 8),
                                        (4, 2048, 8), (4, 4096, 8), (8, 1024, 4),
                                        (8, 2048, 8), (16, 1024, 8), (2, 2048, 4)]:
    config = row_gather.GatherConfig(block_rows, block_cols, warps)
    fn = jax.jit(lambda x, idx, c=config: row_gather.gather_rows(
        x.reshape(-1, h), idx, 0, config=c))
    ms = harness.time_jax(fn, [(x, info.gather_map) for x in xs])
    rows.append(Row(BENCH, case, f"sweep_R{block_rows}_C{block_cols}_W{warps}",
                    ms, nbytes / ms / 1e6, floor_ms))
  return rows


def _memory_case(cfg) -> list[Row]:
  """Peak device memory XLA plans for hidden -> @W -> selected-token logp."""
  rows = []
  b, s, h = cfg["batch"], cfg["seq"], cfg["mem_hidden"]
  rng = np.random.default_rng(1)
  for vocab in cfg["mem_vocabs"]:
    hidden = jax.ShapeDtypeStruct((b, s, h), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((h, vocab), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((b, s), jnp.int32)
    mask_spec = jax.ShapeDtypeStruct((b, s), jnp.bool_)
    dense_mb = _peak_mb(_dense_logp, hidden, weight, targets, mask_spec)
    case = f"logp B*S={b * s} H={h} V={vocab}"
    rows.append(Row("pack_memory", case, "dense", peak_mem_mb=dense_mb,
                    note="XLA planned peak"))
    for density in cfg["mem_densities"]:
      active = int((rng.random((b, s)) < density).sum())
      capacity = max(128, -(-active // 128) * 128)
      mb = _peak_mb(functools.partial(_packed_logp, capacity=capacity),
                    hidden, weight, targets, mask_spec)
      rows.append(Row("pack_memory", f"{case} density={density}",
                      "rlk_pack_then_project", peak_mem_mb=mb,
                      note=f"capacity={capacity}; {mb / dense_mb:.2f}x dense"))
  return rows


def _selected_logp(logits, targets):
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse


def _dense_logp(hidden, weight, targets, mask):
  logp = _selected_logp(hidden @ weight, targets)
  return jnp.where(mask, logp, 0.0)


def _packed_logp(hidden, weight, targets, mask, *, capacity):
  packed, info = rlk_jax.pack(hidden, mask, capacity=capacity)
  packed_targets, _ = rlk_jax.pack(targets, info)
  return rlk_jax.unpack(_selected_logp(packed @ weight, packed_targets), info)


def _peak_mb(fn, *specs) -> float:
  stats = jax.jit(fn).lower(*specs).compile().memory_analysis()
  total = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
           + stats.output_size_in_bytes - stats.alias_size_in_bytes)
  return total / 2**20


def main(argv):
  del argv
  rows = run(harness.smoke_mode())
  print(harness.format_table(rows))
  if harness.CSV.value:
    harness.write_csv(rows, harness.CSV.value)


if __name__ == "__main__":
  app.run(main)
