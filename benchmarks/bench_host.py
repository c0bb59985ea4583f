"""Host-side packing: vectorised rlk_jax.host against its per-token loops.

    python -m benchmarks.bench_host [--nosmoke] [--csv out.csv]

A batch of 1024 samples (smoke: 128) with prompts of 64-2048 and responses
of 1-4096 tokens, given as Python lists and as per-sample NumPy arrays.
Rows: ``rlk_vectorised`` and ``loop_reference`` for collate_rl and
collate_packed; the planner for each algorithm and cost. The note gives the
speed-up over the loop. With list inputs the conversion of every Python int
and float to NumPy is part of both sides and bounds the ratio: the
``list_conversion_floor`` row times that conversion alone. CPU only.
"""

from __future__ import annotations

import itertools
import statistics
import struct
import time

import numpy as np
from absl import app

from benchmarks import harness
from benchmarks.harness import Row
from rlk_jax import host, host_reference

BENCH = "host"
MAX_TOKENS = 16384


def _median_ms(fn, repeats):
  fn()  # warm-up
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    samples.append((time.perf_counter() - start) * 1e3)
  return statistics.median(samples)


def run(smoke: bool) -> list[Row]:
  n = 128 if smoke else 1024
  rng = np.random.default_rng(0)
  p_len = rng.integers(64, 2049, n)
  r_len = rng.integers(1, 4097, n)
  prompts = [rng.integers(0, 128000, k).tolist() for k in p_len]
  responses = [rng.integers(0, 128000, k).tolist() for k in r_len]
  rewards = rng.standard_normal(n).astype(np.float32).tolist()
  loss_masks = [np.ones(k, np.float32).tolist() for k in r_len]
  logprobs = [(-rng.random(k)).astype(np.float32).tolist() for k in r_len]
  tokens = int((p_len + r_len).sum())
  case = f"{n} samples, {tokens} tokens"
  rows = []

  def compare(name, fast, slow, lists=None):
    fast_ms = _median_ms(fast, 7)
    slow_ms = _median_ms(slow, 3)
    rows.append(Row(BENCH, f"{name}: {case}", "rlk_vectorised", fast_ms,
                    note=f"{slow_ms / fast_ms:.1f}x the loop"))
    rows.append(Row(BENCH, f"{name}: {case}", "loop_reference", slow_ms))
    if lists is not None:
      floor_ms = _median_ms(lambda: _convert_lists(*lists), 7)
      rows.append(Row(
          BENCH, f"{name}: {case}", "list_conversion_floor", floor_ms,
          note=f"converting the input lists to flat NumPy arrays, nothing "
               f"else: bounds any NumPy version at {slow_ms / floor_ms:.1f}x "
               f"the loop"))

  as_arrays = lambda seqs, dtype: [np.asarray(x, dtype) for x in seqs]
  inputs = {
      "lists": (prompts, responses, rewards, loss_masks, logprobs),
      "arrays": (as_arrays(prompts, np.int64), as_arrays(responses, np.int64),
                 np.asarray(rewards, np.float32),
                 as_arrays(loss_masks, np.float32),
                 as_arrays(logprobs, np.float32)),
  }
  for kind, batch in inputs.items():
    compare(f"collate_rl ({kind})",
            lambda batch=batch: host.collate_rl(*batch, pad_id=0),
            lambda batch=batch: host_reference.collate_rl(*batch, pad_id=0),
            lists=(batch[:2], batch[3:]) if kind == "lists" else None)

  lens = p_len + r_len
  for algorithm in ("ffd", "kk"):
    for cost in ("tokens", "quadratic"):
      ms = _median_ms(lambda: host.plan_micro_batches(
          lens, MAX_TOKENS, n_bins_multiple=8, cost=cost, algorithm=algorithm), 7)
      plan = host.plan_micro_batches(lens, MAX_TOKENS, n_bins_multiple=8,
                                     cost=cost, algorithm=algorithm)
      spread = plan.bin_costs.max() / plan.bin_costs.mean()
      rows.append(Row(BENCH, f"plan_micro_batches {algorithm}/{cost}: {case}",
                      "rlk_vectorised", ms,
                      note=f"{len(plan.bins)} bins of <= {MAX_TOKENS}; "
                           f"max/mean cost {spread:.3f}"))

  plan = host.plan_micro_batches(lens, MAX_TOKENS, n_bins_multiple=8)
  kwargs = dict(max_tokens=MAX_TOKENS, pad_id=0, max_seqs_per_row=64)
  for kind, sequences in (
      ("lists", [p + r for p, r in zip(prompts, responses)]),
      ("arrays", [np.asarray(p + r, np.int64) for p, r in zip(prompts, responses)])):
    compare(f"collate_packed ({kind})",
            lambda s=sequences: host.collate_packed(s, plan.bins, **kwargs),
            lambda s=sequences: host_reference.collate_packed(s, plan.bins, **kwargs),
            lists=([sequences], []) if kind == "lists" else None)
  return rows


def _convert_lists(id_lists, value_lists):
  """The least any vectorised collator pays for Python-list inputs: every
  id list to int64 and every value list to float32, each flattened once
  (the fastest routes measured on CPython 3.11: struct for ints, fromiter
  for floats)."""
  for seqs in id_lists:
    buf = bytearray(8 * sum(map(len, seqs)))
    offset = 0
    for s in seqs:
      struct.pack_into(f"={len(s)}q", buf, offset, *s)
      offset += 8 * len(s)
  for seqs in value_lists:
    np.fromiter(itertools.chain.from_iterable(seqs), np.float32,
                sum(map(len, seqs)))


if __name__ == "__main__":
  app.run(harness.bench_main(run))
