"""One GRPO training step in JAX, all under one jit: pack a group of rollouts,
run the policy on their real tokens only, score them with linear_logp and
take a clipped-surrogate step on group-normalized advantages.

    python -m examples.grpo_step_jax

GRPO samples G responses per prompt and uses each response's reward relative
to its group as its advantage, so no value model is needed. What rlk adds:

* ``pack``: a group's responses have very different lengths; the model runs on
  a ``[capacity]`` stream of real tokens, not on ``[B, S]`` with padding.
* det_gemm projections and ``linear_logp`` (the model of
  ``examples/tiny_transformer.py``): a token's log-prob has the same bits
  whether its sequence is packed with its group or alone. Where the rollout
  scored its tokens with the same kernels, the PPO ratio starts at exactly
  1, not at 1 plus a drift that depends on how the batch was packed.
* ``next_token_targets``: labels never cross from one packed sequence into
  the next.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import rlk_jax
from examples import tiny_transformer as tt

IGNORE = tt.IGNORE_INDEX
CLIP = 0.2
ADV_EPS = 1e-6


def token_logprobs(params, ids, mask, *, capacity: int):
  """``[B, S]`` f32: each token's log-prob given the tokens before it in its
  sequence (where a rollout engine reports it); 0 on a sequence's first token
  and on padding. Each row of `mask` must be one contiguous run."""
  packed_ids, info = rlk_jax.pack(ids, mask, capacity=capacity)
  targets = rlk_jax.next_token_targets(packed_ids, info, ignore_index=IGNORE)
  hidden = tt.forward(params, packed_ids, info.segment_ids, info.positions)
  logp = rlk_jax.linear_logp(hidden, params["lm_head"], targets,
                             ignore_index=IGNORE)
  # Row r scores the token of row r+1. Back in [B, S], shift each value onto
  # the token it scores, where old log-probs and response masks live.
  dense = rlk_jax.unpack(logp, info)
  return jnp.pad(dense[:, :-1], ((0, 0), (1, 0)))


def group_advantages(rewards, group_size: int):
  """``(r - group mean) / (group std + eps)`` per sequence; a prompt's G
  responses are adjacent rows. A group of equal rewards gets 0, not NaN."""
  r = rewards.astype(jnp.float32).reshape(-1, group_size)
  centered = r - r.mean(axis=1, keepdims=True)
  return (centered / (r.std(axis=1, keepdims=True) + ADV_EPS)).reshape(-1)


def clipped_surrogate_loss(logp, old_logp, advantages, response_mask,
                           clip: float = CLIP):
  """PPO's clipped objective, negated and averaged over every response
  token of the batch (a long response weighs more than a short one)."""
  m = response_mask.astype(jnp.float32)
  # Outside the response old_logp may hold anything (pad values of -inf):
  # keep exp away from it, as 0 * inf would be NaN.
  ratio = jnp.exp(jnp.where(m > 0, logp - old_logp, 0.0))
  adv = advantages[:, None]
  surrogate = jnp.minimum(ratio * adv,
                          jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
  return -jnp.sum(surrogate * m) / jnp.maximum(jnp.sum(m), 1.0)


@functools.partial(jax.jit, static_argnames=("capacity", "group_size"))
def grpo_step(params, batch, learning_rate, *, capacity: int,
              group_size: int):
  """One SGD step. `batch`: ``ids, mask, response_mask [B, S]``,
  ``old_logp [B, S]`` (token-aligned like :func:`token_logprobs`) and
  ``rewards [B]``. Returns ``(new params, stats)``; the stats keep the grads
  for logging or clipping."""
  advantages = group_advantages(batch["rewards"], group_size)

  def loss_fn(p):
    logp = token_logprobs(p, batch["ids"], batch["mask"], capacity=capacity)
    return clipped_surrogate_loss(logp, batch["old_logp"], advantages,
                                  batch["response_mask"])

  loss, grads = jax.value_and_grad(loss_fn)(params)
  params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
  return params, {"loss": loss, "advantages": advantages, "grads": grads}


def random_rollouts(rng: np.random.Generator, *, n_prompts: int,
                    group_size: int, vocab: int, max_prompt: int = 6,
                    max_response: int = 10) -> dict:
  """Right-padded rows of prompt + response, G rows per prompt (one prompt,
  G different responses), random rewards; ids in ``[1, vocab)``."""
  b, width = n_prompts * group_size, max_prompt + max_response
  ids = np.zeros((b, width), np.int32)
  mask = np.zeros((b, width), bool)
  response_mask = np.zeros((b, width), bool)
  for p in range(n_prompts):
    prompt = rng.integers(1, vocab, rng.integers(1, max_prompt + 1))
    for i in range(p * group_size, (p + 1) * group_size):
      response = rng.integers(1, vocab, rng.integers(1, max_response + 1))
      n = len(prompt) + len(response)
      ids[i, :n] = np.concatenate([prompt, response])
      mask[i, :n] = True
      response_mask[i, len(prompt):n] = True
  rewards = rng.standard_normal(b).astype(np.float32)
  return {"ids": ids, "mask": mask, "response_mask": response_mask,
          "rewards": rewards}


def capacity_for(mask, multiple: int = 32) -> int:
  """Real tokens rounded up: batches of similar size share one compile."""
  return -(-int(np.sum(mask)) // multiple) * multiple


def main():
  rng = np.random.default_rng(0)
  vocab, group_size = 97, 4
  params = tt.init_params(jax.random.key(0), vocab=vocab, d_model=32,
                          n_heads=2, n_layers=2, d_ff=64)
  batch = random_rollouts(rng, n_prompts=3, group_size=group_size,
                          vocab=vocab)
  capacity = capacity_for(batch["mask"])
  # The rollout policy is the current one: its log-probs, replayed packed,
  # are the old log-probs (the first step's ratio is exactly 1).
  batch["old_logp"] = jax.jit(token_logprobs, static_argnames="capacity")(
      params, batch["ids"], batch["mask"], capacity=capacity)
  print(f"{len(batch['ids'])} rollouts, {int(batch['mask'].sum())} tokens "
        f"packed into {capacity} rows (padded: {batch['mask'].size})")
  for i in range(4):  # PPO epochs on one batch
    params, stats = grpo_step(params, batch, 0.05, capacity=capacity,
                              group_size=group_size)
    print(f"step {i}: loss {float(stats['loss']):+.5f}")


if __name__ == "__main__":
  main()
