"""Per-token loop versions of rlk_jax.host: the oracle for its tests and the
baseline of benchmarks/bench_host.py. Written to be read, not to be fast;
they assume valid input (the vectorised versions own the checks)."""

from __future__ import annotations

import numpy as np

from rlk_jax.host import IGNORE_INDEX


def collate_rl(prompts, responses, rewards, loss_masks, logprobs=None, *,
               pad_id, max_len=None):
  n = len(prompts)
  total = [len(p) + len(r) for p, r in zip(prompts, responses)]
  width = max_len if max_len is not None else max(total)
  out = {name: np.zeros((n, width), dtype) for name, dtype in (
      ("sequences", np.int64), ("attention_mask", np.int64),
      ("response_mask", np.int64), ("loss_mask", np.float32),
      ("rewards", np.float32))}
  out["sequences"][:] = pad_id
  if logprobs is not None:
    out["logprobs"] = np.zeros((n, width), np.float32)
  out["sequence_rewards"] = np.zeros(n, np.float32)
  for i in range(n):
    tokens = list(prompts[i]) + list(responses[i])
    start = width - len(tokens)
    response_start = width - len(responses[i])
    for j, t in enumerate(tokens):
      out["sequences"][i, start + j] = int(t)
      out["attention_mask"][i, start + j] = 1
    for j in range(len(responses[i])):
      col = response_start + j
      out["response_mask"][i, col] = 1
      out["loss_mask"][i, col] = float(loss_masks[i][j])
      if logprobs is not None:
        out["logprobs"][i, col] = float(logprobs[i][j])
    if np.ndim(rewards[i]) == 0:
      out["sequence_rewards"][i] = float(rewards[i])
      if len(responses[i]):
        out["rewards"][i, width - 1] = float(rewards[i])
    else:
      total_reward = 0.0
      for j in range(len(responses[i])):
        out["rewards"][i, response_start + j] = float(rewards[i][j])
        total_reward += float(rewards[i][j])
      out["sequence_rewards"][i] = total_reward
  return out


def collate_packed(sequences, bins, *, max_tokens, pad_id, align=1,
                   loss_masks=None, max_seqs_per_row=None,
                   ignore_index=IGNORE_INDEX):
  n_bins = len(bins)
  max_seqs = max_tokens if max_seqs_per_row is None else max_seqs_per_row
  shape = (n_bins, max_tokens)
  out = dict(
      input_ids=np.full(shape, pad_id, np.int64),
      targets=np.full(shape, ignore_index, np.int64),
      loss_mask=np.zeros(shape, np.float32),
      segment_ids=np.full(shape, -1, np.int32),
      sample_index=np.full(shape, -1, np.int32),
      positions=np.zeros(shape, np.int32),
      cu_seqlens=np.zeros((n_bins, max_seqs + 1), np.int32),
      seq_lens=np.zeros((n_bins, max_seqs), np.int32),
      n_seqs=np.zeros(n_bins, np.int32),
  )
  for r, members in enumerate(bins):
    col = 0
    end = 0
    for k, s in enumerate(members):
      seq = sequences[s]
      out["cu_seqlens"][r, k] = col
      out["seq_lens"][r, k] = len(seq)
      for j, t in enumerate(seq):
        out["input_ids"][r, col + j] = int(t)
        out["segment_ids"][r, col + j] = k
        out["sample_index"][r, col + j] = s
        out["positions"][r, col + j] = j
        if j + 1 < len(seq):
          out["targets"][r, col + j] = int(seq[j + 1])
          out["loss_mask"][r, col + j] = (
              1.0 if loss_masks is None else float(loss_masks[s][j + 1]))
      end = col + len(seq)
      col += -(-len(seq) // align) * align
    out["n_seqs"][r] = len(members)
    for k in range(len(members), max_seqs + 1):
      out["cu_seqlens"][r, k] = end
  return out


def greedy_max_cost(seq_lens, costs, n_bins, max_tokens):
  """In-order greedy into `n_bins` bins (cheapest bin with room): the balance
  the planner must never be worse than. None if it does not fit."""
  load = [0.0] * n_bins
  tokens = [0] * n_bins
  for length, c in zip(seq_lens, costs):
    options = [b for b in range(n_bins) if tokens[b] + length <= max_tokens]
    if not options:
      return None
    b = min(options, key=lambda b: (load[b], b))
    load[b] += c
    tokens[b] += length
  return max(load)


def karmarkar_karp_bin_sums(costs, n_bins):
  """Textbook k-way largest differencing on full k-vectors: the bin sums
  (ascending) it reaches. Partial solutions are k [sum, members] pairs
  sorted by sum, largest first; ties pop in the order of their first sample."""
  import heapq
  heap = []
  for i, c in enumerate(costs):
    subsets = [[float(c), [i]]] + [[0.0, []] for _ in range(n_bins - 1)]
    heapq.heappush(heap, (-float(c), i, subsets))
  while len(heap) > 1:
    _, key, a = heapq.heappop(heap)
    _, _, b = heapq.heappop(heap)
    merged = [[a[j][0] + b[n_bins - 1 - j][0], a[j][1] + b[n_bins - 1 - j][1]]
              for j in range(n_bins)]
    merged.sort(key=lambda s: -s[0])
    heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), key, merged))
  return sorted(s[0] for s in heap[0][2])
