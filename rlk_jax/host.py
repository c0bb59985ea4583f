"""Host-side packing: batches arrive at the device with static shapes and
precomputed metadata, so nothing about them is computed (or synced) there.

NumPy only: importing this module imports neither JAX nor torch (torch
tensors and JAX arrays are accepted as inputs all the same). Every function
is vectorised over tokens: Python loops run over samples or bins at most,
never over tokens. ``rlk_jax.host_reference`` holds the per-token loop
versions they are tested against.

* :func:`collate_rl` - (prompt, response) lists -> right-aligned [B, L] arrays.
* :func:`plan_micro_batches` - token-budget bins, balanced, DP-symmetric.
* :func:`collate_packed` - bins -> packed rows [n_bins, max_tokens] with
  segment ids, restarting positions, boundary-safe targets, cu_seqlens.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import numbers
import operator
import struct

import numpy as np

# Token ids travel to the device as int32 (JAX without x64): larger ids would
# wrap there, so they are rejected here.
MAX_TOKEN_ID = 2**31 - 1
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------
# Input conversion


def _to_numpy(x, dtype=None) -> np.ndarray:
  if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
    x = x.detach().cpu().numpy()
  return np.asarray(x, dtype)


def _ragged(seqs, name: str, kind: str, order=None):
  """A list of 1-D sequences -> (their values concatenated, their lengths
  int64), both in `order` (sample indices; default: the list's order).

  Lists of Python numbers take one C-level pass over all values (``struct``
  for ids: it refuses floats, which NumPy would truncate); arrays and
  tensors are converted one by one. Any refusal falls back to the one-by-one
  path, which names the offending sample.
  """
  if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__len__"):
    raise TypeError(f"rlk_jax.host: {name} must be a list of sequences, got "
                    f"{type(seqs).__name__}.")
  index = list(range(len(seqs))) if order is None else order.tolist()
  parts = [seqs[i] for i in index]
  label = lambda j: f"{name}[{index[j]}]"
  if all(type(p) in (list, tuple) for p in parts):
    lengths = np.fromiter(map(len, parts), np.int64, len(parts))
    try:
      values = _from_lists(parts, kind, int(lengths.sum()))
    except (struct.error, TypeError, ValueError):
      values = None
    if values is not None:
      if kind == "ids":
        _check_ids(values, lengths, label)
      return values, lengths
  return _from_arrays(parts, kind, label)


def _from_lists(parts, kind, total):
  if kind != "ids":  # the same conversions np.asarray(x, np.float32) makes
    return np.fromiter(itertools.chain.from_iterable(parts), np.float32, total)
  buf = bytearray(8 * total)
  offset = 0
  for p in parts:
    struct.pack_into(f"={len(p)}q", buf, offset, *p)
    offset += 8 * len(p)
  return np.frombuffer(buf, np.int64)


def _from_arrays(parts, kind, label):
  arrays = []
  # Values (masks, rewards, log-probs) convert straight to float32; ids keep
  # their inferred dtype so that a float "id" is caught, not truncated.
  dtype = None if kind == "ids" else np.float32
  for j, s in enumerate(parts):
    a = _to_numpy(s, dtype)
    if a.ndim != 1:
      raise ValueError(f"rlk_jax.host: {label(j)} must be 1-D, got shape "
                       f"{a.shape}.")
    if a.size == 0:  # np.asarray([]) is float64: it must not set the dtype
      a = np.zeros(0, np.int64 if kind == "ids" else np.float32)
    if kind == "ids" and a.dtype.kind not in "iu":
      raise TypeError(f"rlk_jax.host: {label(j)} must hold integer token ids, "
                      f"got dtype {a.dtype}.")
    arrays.append(a)
  lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
  values = np.concatenate(arrays) if arrays else np.zeros(
      0, np.int64 if kind == "ids" else np.float32)
  if kind == "ids":
    values = values.astype(np.int64, copy=False)
    _check_ids(values, lengths, label)
  return values, lengths


def _check_ids(values, lengths, label):
  bad = (values < 0) | (values > MAX_TOKEN_ID)
  if bad.any():
    flat = int(np.argmax(bad))
    j = int(np.searchsorted(np.cumsum(lengths), flat, side="right"))
    raise ValueError(
        f"rlk_jax.host: {label(j)} holds token id {int(values[flat])}; "
        f"ids must lie in [0, {MAX_TOKEN_ID}] (int32 on the device).")


def _check_pad_id(pad_id):
  if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral) \
      or not 0 <= pad_id <= MAX_TOKEN_ID:
    raise ValueError(f"rlk_jax.host: pad_id must be an int in [0, "
                     f"{MAX_TOKEN_ID}], got {pad_id!r}.")


def _check_same_lengths(lengths, expected, name, expected_name, order=None):
  if lengths.shape != expected.shape:
    raise ValueError(f"rlk_jax.host: {name} has {len(lengths)} entries but "
                     f"{expected_name} has {len(expected)}.")
  differ = np.flatnonzero(lengths != expected)
  if differ.size:
    j = int(differ[0])
    i = j if order is None else int(order[j])
    raise ValueError(f"rlk_jax.host: {name}[{i}] has {int(lengths[j])} values "
                     f"but {expected_name}[{i}] has {int(expected[j])}.")


def _place(lengths: np.ndarray, first_dest: np.ndarray) -> np.ndarray:
  """Flat destination of every element of ragged data whose segment i goes
  to ``first_dest[i], first_dest[i] + 1, ...``: one repeat, no per-element
  gathers (the hot path of every collator here)."""
  starts = np.cumsum(lengths) - lengths
  return np.arange(int(lengths.sum())) + np.repeat(first_dest - starts, lengths)


# ----------------------------------------------------------------------------
# collate_rl


def collate_rl(prompts, responses, rewards, loss_masks, logprobs=None, *,
               pad_id: int, max_len: int | None = None) -> dict[str, np.ndarray]:
  """Collates RL samples into right-aligned ``[B, L]`` arrays.

  Each row is ``prompt + response``, left-padded with `pad_id` so every
  response ends in the last column. ``L`` is `max_len` if given (a sample
  longer than it is an error, never truncated), else the longest sample.

  Args:
    prompts, responses: B token-id sequences each (lists, NumPy arrays or
      torch tensors; a response may be empty).
    rewards: one scalar per sample, or one sequence of per-token rewards per
      sample (as long as its response).
    loss_masks: per sample, one value per response token.
    logprobs: optional, per sample one value per response token.

  Returns a dict of ``sequences`` int64, ``attention_mask`` int64,
  ``response_mask`` int64, ``loss_mask`` float32, ``rewards`` float32 (scalar
  rewards sit on the last response token), ``logprobs`` float32 (if given),
  all ``[B, L]``, and ``sequence_rewards`` float32 ``[B]`` (the scalar, or the
  sum of the per-token rewards; kept also for samples with empty responses,
  which have no token to carry it).
  """
  _check_pad_id(pad_id)
  n = len(prompts)
  if n == 0:
    raise ValueError("rlk_jax.host.collate_rl: empty batch (no prompts).")
  for name, other in (("responses", responses), ("rewards", rewards),
                      ("loss_masks", loss_masks)):
    if len(other) != n:
      raise ValueError(f"rlk_jax.host.collate_rl: {len(other)} {name} for "
                       f"{n} prompts.")
  if logprobs is not None and len(logprobs) != n:
    raise ValueError(f"rlk_jax.host.collate_rl: {len(logprobs)} logprobs for "
                     f"{n} prompts.")
  p_ids, p_len = _ragged(prompts, "prompts", "ids")
  r_ids, r_len = _ragged(responses, "responses", "ids")
  total = p_len + r_len
  longest = int(total.max())
  if max_len is None:
    max_len = longest
  elif longest > max_len:
    i = int(np.argmax(total))
    raise ValueError(f"rlk_jax.host.collate_rl: sample {i} has {longest} "
                     f"tokens (prompt {int(p_len[i])} + response "
                     f"{int(r_len[i])}) > max_len={max_len}; nothing is "
                     "truncated.")

  # Right-aligned: sample i fills columns [max_len - total[i], max_len), its
  # response [max_len - r_len[i], max_len). Row-major order of those cells is
  # the order of the concatenated values, so one boolean-mask assignment
  # places each input (no per-token index arrays).
  cols = np.arange(max_len)
  in_sample = cols >= (max_len - total)[:, None]
  in_response = cols >= (max_len - r_len)[:, None]
  sequences = np.full((n, max_len), pad_id, np.int64)
  sequences[in_sample & ~in_response] = p_ids
  sequences[in_response] = r_ids
  out = dict(sequences=sequences,
             attention_mask=in_sample.astype(np.int64),
             response_mask=in_response.astype(np.int64))

  def per_token(values, name):
    vals, lens = _ragged(values, name, "values")
    _check_same_lengths(lens, r_len, name, "responses")
    dense = np.zeros((n, max_len), np.float32)
    dense[in_response] = vals
    return dense, vals

  out["loss_mask"], _ = per_token(loss_masks, "loss_masks")
  if _is_scalar_per_sample(rewards):
    scalars = np.asarray([float(_to_numpy(r)) for r in rewards], np.float32) \
        if not hasattr(rewards, "shape") else _to_numpy(rewards).astype(np.float32)
    token_rewards = np.zeros((n, max_len), np.float32)
    has_response = r_len > 0
    if has_response.any():  # max_len may be 0 (every sample empty)
      token_rewards[has_response, max_len - 1] = scalars[has_response]
    out["rewards"], out["sequence_rewards"] = token_rewards, scalars
  else:
    out["rewards"], vals = per_token(rewards, "rewards")
    out["sequence_rewards"] = np.bincount(
        np.repeat(np.arange(n), r_len), weights=vals.astype(np.float64),
        minlength=n).astype(np.float32)
  if logprobs is not None:
    out["logprobs"], _ = per_token(logprobs, "logprobs")
  return out


def _is_scalar_per_sample(rewards) -> bool:
  if hasattr(rewards, "shape"):  # an array/tensor
    shape = tuple(_to_numpy(rewards).shape)
    if len(shape) == 1:
      return True
    raise ValueError(f"rlk_jax.host.collate_rl: rewards as one array must be "
                     f"[B] scalars, got shape {shape}; give per-token rewards "
                     "as a list of sequences.")
  kinds = {np.ndim(_to_numpy(r)) for r in rewards}
  if kinds == {0}:
    return True
  if kinds == {1}:
    return False
  raise ValueError("rlk_jax.host.collate_rl: rewards mix scalars and "
                   "per-token sequences.")


# ----------------------------------------------------------------------------
# plan_micro_batches


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
  """Bins of sample indices and the permutations to and from plan order.

  ``order`` (concatenated bins) maps plan position -> sample; results computed
  in plan order return to sample order as ``results[restore]``.
  """
  bins: list[np.ndarray]
  order: np.ndarray
  restore: np.ndarray
  bin_tokens: np.ndarray
  bin_costs: np.ndarray


def plan_micro_batches(seq_lens, max_tokens: int, *, n_bins_multiple: int = 1,
                       cost: str = "tokens", algorithm: str = "ffd",
                       linear_coefficient: float = 6 * 4096) -> MicroBatchPlan:
  """Bins samples so each bin holds at most `max_tokens` tokens.

  The bin count is the smallest multiple of `n_bins_multiple` (data-parallel
  ranks get equally many micro-batches) not below ``ceil(total / max_tokens)``
  for which a balanced assignment fits the budget.
  Samples are then spread over the bins to balance `cost` per bin:
  ``"tokens"`` (L) or ``"quadratic"`` (``a·L + L²``, attention's share grows
  with L; ``a`` = `linear_coefficient`, verl's 6·hidden). ``algorithm="ffd"``
  balances greedily (longest first, to the cheapest bin with room);
  ``"kk"`` also tries Karmarkar–Karp differencing at that bin count. The
  most balanced feasible candidate wins, and an in-order greedy assignment is
  always a candidate, so the result is never less balanced than that. Bins may be empty only when
  there are fewer samples than bins.
  """
  lens = _to_numpy(seq_lens)
  if lens.ndim != 1 or lens.size == 0:
    raise ValueError(f"rlk_jax.host.plan_micro_batches: seq_lens must be a "
                     f"non-empty 1-D sequence, got shape {lens.shape}.")
  if lens.dtype.kind not in "iu" or (lens < 0).any():
    raise ValueError("rlk_jax.host.plan_micro_batches: seq_lens must be "
                     "non-negative integers.")
  lens = lens.astype(np.int64)
  if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) \
      or max_tokens <= 0:
    raise ValueError(f"rlk_jax.host.plan_micro_batches: max_tokens must be a "
                     f"positive int, got {max_tokens!r}.")
  if not isinstance(n_bins_multiple, numbers.Integral) or n_bins_multiple < 1:
    raise ValueError(f"rlk_jax.host.plan_micro_batches: n_bins_multiple must "
                     f"be an int >= 1, got {n_bins_multiple!r}.")
  too_long = np.flatnonzero(lens > max_tokens)
  if too_long.size:
    i = int(too_long[0])
    raise ValueError(f"rlk_jax.host.plan_micro_batches: sample {i} has "
                     f"{int(lens[i])} tokens > max_tokens={max_tokens}; it "
                     "cannot fit any bin (nothing is truncated).")
  if cost == "tokens":
    costs = lens.astype(np.float64)
  elif cost == "quadratic":
    costs = linear_coefficient * lens.astype(np.float64) + lens.astype(np.float64) ** 2
  else:
    raise ValueError(f"rlk_jax.host.plan_micro_batches: cost must be 'tokens' "
                     f"or 'quadratic', got {cost!r}.")
  if algorithm not in ("ffd", "kk"):
    raise ValueError(f"rlk_jax.host.plan_micro_batches: algorithm must be "
                     f"'ffd' or 'kk', got {algorithm!r}.")

  # Start at the fewest bins the tokens allow; add bins (in DP multiples)
  # only while no balanced assignment fits the budget.
  lower_bound = max(1, -(-int(lens.sum()) // max_tokens))
  n_bins = -(-lower_bound // n_bins_multiple) * n_bins_multiple
  lens_list, costs_list = lens.tolist(), costs.tolist()
  decreasing = _decreasing(costs).tolist()
  while True:
    candidates = [
        _greedy(range(len(lens)), lens_list, costs_list, n_bins, max_tokens),
        _greedy(decreasing, lens_list, costs_list, n_bins, max_tokens)]
    feasible = [np.asarray(c) for c in candidates if c is not None]
    if feasible:
      break
    n_bins += n_bins_multiple
  if algorithm == "kk":  # a balance refinement at the bin count found
    kk = _karmarkar_karp(lens, costs, n_bins, max_tokens)
    if kk is not None:
      feasible.append(kk)
  bin_of = min(feasible, key=lambda b: _max_cost(b, costs, n_bins))
  return _plan_from_assignment(bin_of, lens, costs, n_bins)


def _decreasing(values):
  return np.argsort(-values, kind="stable")


def _greedy(order, lens, costs, n_bins, max_tokens):
  """Each sample, in `order`, to the cheapest bin with room (ties: lowest
  index); None if some sample fits no bin. Plain Python on a heap: per item
  a few heap operations beat any NumPy call on n_bins-long arrays."""
  heap = [(0.0, b) for b in range(n_bins)]
  tokens = [0] * n_bins
  bin_of = [0] * len(lens)
  for i in order:
    length = lens[i]
    skipped = []
    while heap and tokens[heap[0][1]] + length > max_tokens:
      skipped.append(heapq.heappop(heap))
    if not heap:
      return None
    load, b = heapq.heappop(heap)
    bin_of[i] = b
    tokens[b] += length
    heapq.heappush(heap, (load + costs[i], b))
    for entry in skipped:
      heapq.heappush(heap, entry)
  return bin_of


def _karmarkar_karp(lens, costs, n_bins, max_tokens):
  """k-way largest differencing; None if the result breaks the budget.

  A partial solution is its non-empty subsets only, as (sum, node) pairs
  sorted ascending, where a node is a sample (< n) or an inner node of a
  merge tree. Merging pairs the largest sums of one with the smallest of the
  other (zeros standing in for empty subsets), so only the `overlap` pairs
  where both sides are non-empty make new nodes; the rest pass through.
  Early merges are of a few subsets each: plain lists beat vector ops here.
  """
  n, k = len(lens), n_bins
  left, right = [], []  # children of inner node n + i
  heap = [(-c, i, [(c, i)]) for i, c in enumerate(costs.tolist())]
  heapq.heapify(heap)
  while len(heap) > 1:
    _, key, a = heapq.heappop(heap)
    _, _, b = heapq.heappop(heap)
    if len(a) < len(b):  # the pairing is symmetric; insert into the longer
      a, b = b, a
    overlap = len(a) + len(b) - k
    fresh = []
    if overlap > 0:  # a's j-th smallest meets b's (overlap-1-j)-th smallest
      first = n + len(left)
      for j in range(overlap):
        x, y = a[j], b[overlap - 1 - j]
        left.append(x[1])
        right.append(y[1])
        fresh.append((x[0] + y[0], first + j))
      del a[:overlap]
      b = b[overlap:]
    # Most merges add a few subsets to a long partial solution: inserting
    # them keeps it sorted in O(few log k); otherwise one sort of the runs.
    if len(b) + len(fresh) <= 8:
      for entry in itertools.chain(b, fresh):
        bisect.insort(a, entry, key=_first)
      merged = a
    else:
      merged = a + b + fresh
      merged.sort(key=_first)  # floats only: CPython's fast compare; stable
    spread = merged[-1][0] - (merged[0][0] if len(merged) == k else 0.0)
    heapq.heappush(heap, (-spread, key, merged))
  left, right = np.asarray(left, np.int64), np.asarray(right, np.int64)
  nodes = np.asarray([node for _, node in heap[0][2]], np.int64)
  bins = np.arange(len(nodes))
  bin_of = np.empty(n, np.int64)
  while nodes.size:  # walk the merge tree down to the samples
    leaf = nodes < n
    bin_of[nodes[leaf]] = bins[leaf]
    inner, inner_bins = nodes[~leaf] - n, bins[~leaf]
    nodes = np.concatenate([left[inner], right[inner]])
    bins = np.concatenate([inner_bins, inner_bins])
  tokens = np.bincount(bin_of, weights=lens, minlength=n_bins)
  return bin_of if (tokens <= max_tokens).all() else None


_first = operator.itemgetter(0)


def _max_cost(bin_of, costs, n_bins):
  return np.bincount(bin_of, weights=costs, minlength=n_bins).max()


def _plan_from_assignment(bin_of, lens, costs, n_bins) -> MicroBatchPlan:
  order = np.lexsort((np.arange(len(lens)), bin_of))  # by bin, then index
  counts = np.bincount(bin_of, minlength=n_bins)
  bins = np.split(order, np.cumsum(counts)[:-1])
  restore = np.empty_like(order)
  restore[order] = np.arange(len(order))
  return MicroBatchPlan(
      bins=bins, order=order, restore=restore,
      bin_tokens=np.bincount(bin_of, weights=lens, minlength=n_bins).astype(np.int64),
      bin_costs=np.bincount(bin_of, weights=costs, minlength=n_bins))


# ----------------------------------------------------------------------------
# collate_packed


def collate_packed(sequences, bins, *, max_tokens: int, pad_id: int,
                   align: int = 1, loss_masks=None,
                   max_seqs_per_row: int | None = None,
                   ignore_index: int = IGNORE_INDEX) -> dict[str, np.ndarray]:
  """Packs each bin's sequences into one row of ``max_tokens`` tokens.

  Sequences are laid out in bin order, each starting at a multiple of
  `align` (pad tokens in between). Returns ``[n_bins, max_tokens]`` arrays:
  ``input_ids`` int64 (`pad_id` on pads); ``targets`` int64, the next token
  *of the same sequence* (`ignore_index` on each sequence's last token and
  on pads: a sequence never learns the next one's first token);
  ``loss_mask`` float32 (1 where the target counts; with `loss_masks`, the
  target token's mask value); ``segment_ids`` int32 (sequence number in the
  row, -1 on pads); ``sample_index`` int32 (-1 on pads); ``positions`` int32
  (restarting at 0, 0 on pads). Per row: ``cu_seqlens`` int32
  ``[n_bins, max_seqs_per_row + 1]`` (sequence starts, then the end of the
  last one, repeated to the static length: flash-attn's varlen layout; with
  ``align > 1`` the gap pads fall inside the previous segment's span, but
  carry segment id -1), ``seq_lens`` int32 ``[n_bins, max_seqs_per_row]``
  and ``n_seqs`` int32 ``[n_bins]``. `max_seqs_per_row` defaults to
  `max_tokens`. Sequences that no bin names are not read.
  """
  _check_pad_id(pad_id)
  if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
    raise TypeError(f"rlk_jax.host: sequences must be a list of sequences, "
                    f"got {type(sequences).__name__}.")
  n = len(sequences)
  if n == 0:
    raise ValueError("rlk_jax.host.collate_packed: empty batch.")
  for name, value in (("max_tokens", max_tokens), ("align", align)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f"rlk_jax.host.collate_packed: {name} must be an int "
                       f">= 1, got {value!r}.")
  max_seqs = max_tokens if max_seqs_per_row is None else max_seqs_per_row
  bins = [np.asarray(_to_numpy(b), np.int64).reshape(-1) for b in bins]
  n_bins = len(bins)
  if n_bins == 0:
    raise ValueError("rlk_jax.host.collate_packed: no bins.")
  counts = np.fromiter((len(b) for b in bins), np.int64, n_bins)
  order = np.concatenate(bins)
  if order.size and (order.min() < 0 or order.max() >= n):
    raise ValueError(f"rlk_jax.host.collate_packed: bins name sample indices "
                     f"outside [0, {n}).")
  if np.bincount(order, minlength=n).max(initial=0) > 1:
    raise ValueError("rlk_jax.host.collate_packed: a sample appears in more "
                     "than one place in bins.")
  if counts.max(initial=0) > max_seqs:
    b = int(np.argmax(counts))
    raise ValueError(f"rlk_jax.host.collate_packed: bin {b} has "
                     f"{int(counts[b])} sequences > max_seqs_per_row={max_seqs}.")
  # Converted straight into plan order: the row-major order of the packed
  # grid's tokens.
  ids, seq_lens = _ragged(sequences, "sequences", "ids", order)
  if loss_masks is not None:
    mask_vals, mask_lens = _ragged(loss_masks, "loss_masks", "values", order)
    _check_same_lengths(mask_lens, seq_lens, "loss_masks", "sequences", order)

  # Placement of each sequence (in plan order) inside its row.
  row_of_seq = np.repeat(np.arange(n_bins), counts)
  slot = -(-seq_lens // align) * align             # aligned footprint
  first_in_row = np.cumsum(counts) - counts
  cum = np.cumsum(slot) - slot
  start = cum - cum[first_in_row[row_of_seq]]      # offset inside its row
  end = start + seq_lens
  row_end = np.zeros(n_bins, np.int64)
  np.maximum.at(row_end, row_of_seq, end)
  if (row_end > max_tokens).any():
    b = int(np.argmax(row_end > max_tokens))
    raise ValueError(f"rlk_jax.host.collate_packed: bin {b} needs "
                     f"{int(row_end[b])} tokens (align={align}) > "
                     f"max_tokens={max_tokens}; nothing is truncated.")

  # The cells that hold tokens: each row up to its end, less the alignment
  # gaps between sequences (at most align - 1 cells per sequence). Their
  # row-major order is plan order, so each field is one mask assignment.
  shape = (n_bins, max_tokens)
  is_token = np.arange(max_tokens) < row_end[:, None]
  if align > 1:
    gap = np.zeros_like(seq_lens)
    gap[:-1] = start[1:] - end[:-1]
    gap[(first_in_row + counts - 1)[counts > 0]] = 0  # a row's last sequence
    is_token.reshape(-1)[_place(gap, row_of_seq * max_tokens + end)] = False

  # Per token, in plan order.
  rank = np.arange(len(order)) - first_in_row[row_of_seq]
  seq_first = np.cumsum(seq_lens) - seq_lens
  seq_last = (seq_first + seq_lens - 1)[seq_lens > 0]
  # The next token of the same sequence; each sequence's last token has
  # none (a sequence must never learn its neighbour's first token).
  targets = np.empty_like(ids)
  targets[:-1] = ids[1:]
  targets[seq_last] = ignore_index
  loss = np.ones(ids.size, np.float32)
  if loss_masks is not None:
    loss[:-1] = mask_vals[1:]
  loss[seq_last] = 0.0
  positions = np.arange(ids.size, dtype=np.int32) - np.repeat(
      seq_first.astype(np.int32), seq_lens)

  out = dict(
      input_ids=(np.full(shape, pad_id, np.int64), ids),
      targets=(np.full(shape, ignore_index, np.int64), targets),
      loss_mask=(np.zeros(shape, np.float32), loss),
      segment_ids=(np.full(shape, -1, np.int32),
                   np.repeat(rank.astype(np.int32), seq_lens)),
      sample_index=(np.full(shape, -1, np.int32),
                    np.repeat(order.astype(np.int32), seq_lens)),
      positions=(np.zeros(shape, np.int32), positions),
  )
  for grid, values in out.values():
    grid[is_token] = values
  out = {key: grid for key, (grid, _) in out.items()}

  cu = np.zeros((n_bins, max_seqs + 1), np.int32)
  cu[row_of_seq, rank] = start
  # Past each row's sequences: the end of its last one, repeated.
  past = np.arange(max_seqs + 1)[None, :] >= counts[:, None]
  cu = np.where(past, row_end[:, None], cu).astype(np.int32)
  lens_out = np.zeros((n_bins, max_seqs), np.int32)
  lens_out[row_of_seq, rank] = seq_lens
  out.update(cu_seqlens=cu, seq_lens=lens_out, n_seqs=counts.astype(np.int32))
  return out
