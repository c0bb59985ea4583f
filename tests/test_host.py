"""rlk_jax.host against the per-token loop oracle (rlk_jax.host_reference)."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from rlk_jax import host, host_reference

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_same_arrays(actual: dict, expected: dict):
  assert sorted(actual) == sorted(expected)
  for key in expected:
    a, e = actual[key], expected[key]
    assert a.dtype == e.dtype, f"{key}: dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{key}: shape {a.shape} != {e.shape}"
    assert np.array_equal(a.view(np.uint8), e.view(np.uint8)), key


def random_rl_batch(rng, n, max_prompt=30, max_response=30, token_rewards=False):
  p_len = rng.integers(0, max_prompt + 1, n)
  r_len = rng.integers(0, max_response + 1, n)
  prompts = [rng.integers(0, 50000, k).tolist() for k in p_len]
  responses = [rng.integers(0, 50000, k).tolist() for k in r_len]
  if token_rewards:
    rewards = [rng.standard_normal(k).astype(np.float32).tolist() for k in r_len]
  else:
    rewards = rng.standard_normal(n).astype(np.float32).tolist()
  loss_masks = [(rng.random(k) < 0.8).astype(np.float32).tolist() for k in r_len]
  logprobs = [(-rng.random(k) * 5).astype(np.float32).tolist() for k in r_len]
  return prompts, responses, rewards, loss_masks, logprobs


# ---------------------------------------------------------------------------
# collate_rl


@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("container", ["list", "tuple", "mixed", "numpy", "torch"])
def test_collate_rl_matches_loop(token_rewards, container, rng):
  batch = random_rl_batch(rng, int(rng.integers(1, 40)), token_rewards=token_rewards)
  prompts, responses, rewards, loss_masks, logprobs = batch
  if container == "tuple":  # the fast path for Python sequences
    prompts, responses = [tuple(p) for p in prompts], [tuple(r) for r in responses]
  elif container == "mixed":  # every other sample an array: the general path
    prompts = [np.asarray(p, np.int32) if i % 2 else p for i, p in enumerate(prompts)]
    loss_masks = [np.asarray(m) if i % 2 else m for i, m in enumerate(loss_masks)]
  elif container != "list":
    convert = np.asarray
    if container == "torch":
      import torch
      convert = lambda x: torch.as_tensor(np.asarray(x))
    prompts = [convert(np.asarray(p, np.int64)) for p in prompts]
    responses = [convert(np.asarray(r, np.int64)) for r in responses]
    loss_masks = [convert(np.asarray(m, np.float32)) for m in loss_masks]
    rewards = (convert(np.asarray(rewards, np.float32)) if not token_rewards
               else [convert(np.asarray(r, np.float32)) for r in rewards])
  out = host.collate_rl(prompts, responses, rewards, loss_masks, logprobs,
                        pad_id=3)
  expected = host_reference.collate_rl(*batch, pad_id=3)
  assert_same_arrays(out, expected)
  wide = host.collate_rl(*batch, pad_id=3, max_len=out["sequences"].shape[1] + 7)
  assert_same_arrays(wide, host_reference.collate_rl(
      *batch, pad_id=3, max_len=out["sequences"].shape[1] + 7))


def test_collate_rl_layout_is_right_aligned():
  out = host.collate_rl([[5, 6], [7]], [[8], []], [1.0, 2.0], [[1], []], pad_id=0)
  assert out["sequences"].tolist() == [[5, 6, 8], [0, 0, 7]]
  assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
  assert out["response_mask"].tolist() == [[0, 0, 1], [0, 0, 0]]
  assert out["rewards"].tolist() == [[0, 0, 1.0], [0, 0, 0]]
  # The empty response keeps its reward at the sequence level.
  assert out["sequence_rewards"].tolist() == [1.0, 2.0]


def test_collate_rl_bad_input():
  ok = dict(pad_id=0)
  with pytest.raises(ValueError, match="empty batch"):
    host.collate_rl([], [], [], [], **ok)
  with pytest.raises(ValueError, match="1 responses for 2 prompts"):
    host.collate_rl([[1], [2]], [[3]], [0.0, 0.0], [[1], [1]], **ok)
  with pytest.raises(ValueError, match=r"loss_masks\[1\] has 2 values but responses\[1\] has 1"):
    host.collate_rl([[1], [2]], [[3], [4]], [0.0, 0.0], [[1], [1, 1]], **ok)
  with pytest.raises(ValueError, match=r"prompts\[1\] holds token id -5"):
    host.collate_rl([[1], [-5]], [[3], [4]], [0.0, 0.0], [[1], [1]], **ok)
  with pytest.raises(ValueError, match=r"responses\[0\] holds token id 2147483648"):
    host.collate_rl([[1]], [[2**31]], [0.0], [[1]], **ok)
  with pytest.raises(TypeError, match=r"prompts\[0\] must hold integer token ids"):
    host.collate_rl([[1.5]], [[2]], [0.0], [[1]], **ok)
  with pytest.raises(TypeError, match=r"responses\[1\] must hold integer token ids"):
    host.collate_rl([[1], [2]], [[2], [3, 2**70]], [0.0, 0.0], [[1], [1, 1]], **ok)
  with pytest.raises(ValueError, match=r"responses\[0\] must be 1-D"):
    host.collate_rl([[1]], [[[2]]], [0.0], [[1]], **ok)
  with pytest.raises(ValueError, match=r"sample 0 has 3 tokens .* > max_len=2"):
    host.collate_rl([[1, 2]], [[3]], [0.0], [[1]], pad_id=0, max_len=2)
  with pytest.raises(ValueError, match="pad_id"):
    host.collate_rl([[1]], [[2]], [0.0], [[1]], pad_id=-1)
  with pytest.raises(ValueError, match="mix scalars"):
    host.collate_rl([[1], [1]], [[2], [2]], [0.0, [1.0]], [[1], [1]], **ok)


# ---------------------------------------------------------------------------
# plan_micro_batches


def check_plan(plan, lens, max_tokens, multiple, cost):
  lens = np.asarray(lens)
  members = np.concatenate(plan.bins)
  assert sorted(members.tolist()) == list(range(len(lens)))  # none lost/duplicated
  assert len(plan.bins) % multiple == 0
  for b, tokens in zip(plan.bins, plan.bin_tokens):
    assert lens[b].sum() == tokens <= max_tokens
  values = np.arange(len(lens)) * 10 + 1
  assert np.array_equal(values[plan.order][plan.restore], values)  # round trip
  assert np.array_equal(plan.order, members)
  costs = lens if cost == "tokens" else 6 * 4096 * lens + lens.astype(np.float64) ** 2
  greedy = host_reference.greedy_max_cost(lens, costs, len(plan.bins), max_tokens)
  if greedy is not None:
    assert plan.bin_costs.max() <= greedy + 1e-9 * max(greedy, 1)


@pytest.mark.parametrize("algorithm", ["ffd", "kk"])
@pytest.mark.parametrize("cost", ["tokens", "quadratic"])
def test_plan_invariants(algorithm, cost, rng):
  lens = rng.integers(1, 3000, 300)
  for multiple in (1, 4, 8):
    plan = host.plan_micro_batches(lens, 8192, n_bins_multiple=multiple,
                                   cost=cost, algorithm=algorithm)
    check_plan(plan, lens, 8192, multiple, cost)


@pytest.mark.parametrize("n,n_bins", [(1, 3), (7, 3), (60, 8), (300, 16)])
def test_karmarkar_karp_matches_the_textbook_loop(n, n_bins, rng):
  costs = rng.random(n) * 1000
  lens = np.ones(n, np.int64)
  bin_of = host._karmarkar_karp(lens, costs, n_bins, n)
  assert bin_of.shape == (n,) and ((bin_of >= 0) & (bin_of < n_bins)).all()
  sums = np.sort(np.bincount(bin_of, weights=costs, minlength=n_bins))
  np.testing.assert_allclose(
      sums, host_reference.karmarkar_karp_bin_sums(costs, n_bins), rtol=1e-12)


def test_plan_is_balanced(rng):
  lens = rng.integers(100, 4000, 512)
  plan = host.plan_micro_batches(lens, 16384, n_bins_multiple=8, algorithm="kk")
  assert plan.bin_tokens.max() / plan.bin_tokens.mean() < 1.05


def test_plan_more_bins_than_samples():
  plan = host.plan_micro_batches([5, 0, 7], 100, n_bins_multiple=8)
  assert len(plan.bins) == 8
  check_plan(plan, [5, 0, 7], 100, 8, "tokens")


def test_plan_bad_input():
  with pytest.raises(ValueError, match=r"sample 2 has 101 tokens > max_tokens=100"):
    host.plan_micro_batches([1, 2, 101], 100)
  with pytest.raises(ValueError, match="non-empty"):
    host.plan_micro_batches([], 100)
  with pytest.raises(ValueError, match="non-negative"):
    host.plan_micro_batches([1, -2], 100)
  with pytest.raises(ValueError, match="max_tokens must be a positive int"):
    host.plan_micro_batches([1], 0)
  with pytest.raises(ValueError, match="n_bins_multiple"):
    host.plan_micro_batches([1], 10, n_bins_multiple=0)
  with pytest.raises(ValueError, match="cost must be"):
    host.plan_micro_batches([1], 10, cost="cubic")
  with pytest.raises(ValueError, match="algorithm must be"):
    host.plan_micro_batches([1], 10, algorithm="lpt")


# ---------------------------------------------------------------------------
# collate_packed


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("with_masks", [False, True])
def test_collate_packed_matches_loop(align, with_masks, rng):
  n = int(rng.integers(1, 60))
  lens = rng.integers(0, 200, n)
  seqs = [rng.integers(0, 50000, k).tolist() for k in lens]
  masks = [(rng.random(k) < 0.7).astype(np.float32).tolist() for k in lens] \
      if with_masks else None
  plan = host.plan_micro_batches(lens + (align - 1), 512, n_bins_multiple=2)
  kwargs = dict(max_tokens=512 + align, pad_id=1, align=align, loss_masks=masks,
                max_seqs_per_row=64)
  out = host.collate_packed(seqs, plan.bins, **kwargs)
  assert_same_arrays(out, host_reference.collate_packed(seqs, plan.bins, **kwargs))


def test_targets_never_cross_a_boundary():
  out = host.collate_packed([[1, 2, 3], [4, 5], [6]], [[0, 1, 2]], max_tokens=8,
                            pad_id=0, max_seqs_per_row=4)
  assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]
  # 3 must not learn 4, nor 5 learn 6.
  assert out["targets"].tolist() == [[2, 3, -100, 5, -100, -100, -100, -100]]
  assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
  assert out["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
  assert out["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2, -1, -1]]
  assert out["cu_seqlens"].tolist() == [[0, 3, 5, 6, 6]]


def test_collate_packed_reads_only_the_binned_sequences():
  # Sample 1 is in no bin: it is neither read nor checked.
  out = host.collate_packed([[1, 2], [-7], [3]], [[2, 0]], max_tokens=4, pad_id=0,
                            max_seqs_per_row=2)
  assert out["input_ids"].tolist() == [[3, 1, 2, 0]]
  assert out["sample_index"].tolist() == [[2, 0, 0, -1]]
  with pytest.raises(ValueError, match=r"sequences\[1\] holds token id -7"):
    host.collate_packed([[1, 2], [-7], [3]], [[2], [1, 0]], max_tokens=4,
                        pad_id=0)


def test_collate_packed_bad_input():
  seqs = [[1, 2, 3], [4, 5]]
  with pytest.raises(ValueError, match=r"bin 0 needs 5 tokens \(align=1\) > max_tokens=4"):
    host.collate_packed(seqs, [[0, 1]], max_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match="more than one place"):
    host.collate_packed(seqs, [[0], [0]], max_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
    host.collate_packed(seqs, [[2]], max_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match="2 sequences > max_seqs_per_row=1"):
    host.collate_packed(seqs, [[0, 1]], max_tokens=8, pad_id=0, max_seqs_per_row=1)
  with pytest.raises(ValueError, match="empty batch"):
    host.collate_packed([], [[]], max_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match=r"loss_masks\[1\] has 1 values"):
    host.collate_packed(seqs, [[0, 1]], max_tokens=8, pad_id=0,
                        loss_masks=[[1, 1, 1], [1]])


# ---------------------------------------------------------------------------
# Properties


@settings(max_examples=60, **_SETTINGS)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=80),
       max_tokens=st.integers(304, 2000), multiple=st.sampled_from([1, 2, 3, 8]),
       cost=st.sampled_from(["tokens", "quadratic"]),
       algorithm=st.sampled_from(["ffd", "kk"]), align=st.sampled_from([1, 8]),
       seed=st.integers(0, 2**32 - 1))
def test_plan_and_pack_properties(lens, max_tokens, multiple, cost, algorithm,
                                  align, seed):
  rng = np.random.default_rng(seed)
  lens = np.asarray(lens)
  footprint = -(-lens // align) * align
  plan = host.plan_micro_batches(footprint, max_tokens, n_bins_multiple=multiple,
                                 cost=cost, algorithm=algorithm)
  check_plan(plan, footprint, max_tokens, multiple, cost)
  seqs = [rng.integers(0, 1000, k) for k in lens]
  kwargs = dict(max_tokens=max_tokens, pad_id=0, align=align,
                max_seqs_per_row=len(lens))
  assert_same_arrays(host.collate_packed(seqs, plan.bins, **kwargs),
                     host_reference.collate_packed(seqs, plan.bins, **kwargs))


@settings(max_examples=40, **_SETTINGS)
@given(n=st.integers(1, 30), token_rewards=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_collate_rl_properties(n, token_rewards, seed):
  batch = random_rl_batch(np.random.default_rng(seed), n, 12, 12, token_rewards)
  assert_same_arrays(host.collate_rl(*batch, pad_id=0),
                     host_reference.collate_rl(*batch, pad_id=0))


# ---------------------------------------------------------------------------
# Packaging and end to end


def test_host_imports_without_jax_or_torch():
  code = ("import sys, rlk_jax.host; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'torch')]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_host_packed_logprobs_equal_per_sample(rng):
  """Host-packed batch -> rlk_jax log-probs, bitwise the per-sample ones.

  Embedding rows, then rlk_jax.linear_logp (det_gemm logits, a row-invariant
  logsumexp) on the packed stream, against each sample on its own.
  (XLA's own log_softmax is not batch-invariant: seen 1 ulp apart on the CPU.)
  """
  import jax
  import jax.numpy as jnp
  import rlk_jax

  vocab, width = 97, 32
  embed = jnp.asarray(rng.standard_normal((vocab, width)), jnp.bfloat16)
  head = jnp.asarray(rng.standard_normal((width, vocab)), jnp.bfloat16)
  token_logp = jax.jit(lambda ids, targets: rlk_jax.linear_logp(
      embed[ids], head, targets))

  lens = rng.integers(1, 40, 25)
  seqs = [rng.integers(0, vocab, k) for k in lens]
  plan = host.plan_micro_batches(lens, 128, n_bins_multiple=2)
  batch = host.collate_packed(seqs, plan.bins, max_tokens=128, pad_id=0,
                              max_seqs_per_row=32)
  logp = np.asarray(token_logp(batch["input_ids"], batch["targets"]))
  assert logp.shape == batch["input_ids"].shape
  assert (logp[batch["loss_mask"] == 0] == 0).all()  # ignored targets
  for s, seq in enumerate(seqs):
    alone = np.asarray(token_logp(jnp.asarray(seq[:-1]), jnp.asarray(seq[1:])))
    where = (batch["sample_index"] == s) & (batch["loss_mask"] > 0)
    assert np.array_equal(logp[where].view(np.uint32), alone.view(np.uint32)), s
