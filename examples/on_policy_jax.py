"""True on-policy with a Tunix model in JAX: the rollout's log-probs equal
the trainer's bit for bit.

    python -m examples.on_policy_jax

A rollout samples completions with Tunix's own ``Sampler`` (KV cache,
ragged prompts, seeded sampling) and keeps each sampled token's log-prob as
the sampler computed it. A GRPO-style training step, jitted, recomputes
them in one padded forward and takes its gradient step. With the sampler
through ``rlk_jax.batch_invariant_sampler`` and the step through
``rlk_jax.batch_invariant`` the two are equal bit for bit; plain, they
drift. It prints the metric verl and SkyRL log,
``train_rollout_logprob_abs_diff`` (mean and max), for both. The model is
Tunix's ``Llama3`` built from a config (random weights, nothing
downloaded); Tunix, flax, jaxtyping and sentencepiece come with rlk's test
extra.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rlk_jax
from benchmarks import tunix_client

PAD = 0  # the tokenizer's pad id, which the sampler never samples


def tiny_llama(vocab=97, layers=2, seed=0):
  """Tunix's Llama 3 at a tiny width: (graphdef, state, config)."""
  from flax import nnx
  module = tunix_client.model_module("llama3")
  config = module.ModelConfig(
      num_layers=layers, vocab_size=vocab, embed_dim=64, hidden_dim=128,
      num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000,
      norm_eps=1e-5)
  graphdef, state = nnx.split(module.Llama3(config, rngs=nnx.Rngs(seed)))
  return graphdef, state, config


def rollout(sampler, prompts, new_tokens, seed):
  """Seeded sampling at temperature 1: the padded prompts, the sampled
  tokens [B, new] and the sampler's own log-probs of them [B, new]."""
  out = sampler(prompts, max_generation_steps=new_tokens,
                max_prompt_length=max(len(p.split()) for p in prompts),
                return_logprobs=True, forbidden_tokens=[PAD],
                temperature=1.0, top_p=1.0, seed=seed)
  tokens = np.stack([np.asarray(t) for t in out.tokens])
  return (np.asarray(out.padded_prompt_tokens), tokens,
          np.asarray(out.logprobs, np.float32))


def _layout(tokens):
  """Positions and causal mask of a left-padded batch [B, L]."""
  valid = jnp.asarray(tokens != PAD)
  positions = jnp.maximum(jnp.cumsum(valid, -1) - 1, 0)
  length = tokens.shape[1]
  mask = jnp.tril(jnp.ones((length, length), bool))[None] & valid[:, None, :]
  return positions, mask


def training_step_fn(graphdef, new_tokens, lr=1e-3):
  """``step(state, tokens, rollout_logp, advantages) -> (state, logp)``:
  the completions' log-probs recomputed as the sampler computes them (its
  forbidden pad id at -inf, f32), a policy-gradient step on the ratio to
  the rollout's, and the recomputed log-probs."""
  from flax import nnx

  def logp_of(state, tokens):
    positions, mask = _layout(tokens)
    logits, _ = nnx.merge(graphdef, state)(tokens, positions, None, mask)
    logits = logits.at[..., PAD].set(-jnp.inf).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)[:, -new_tokens - 1:-1]
    return jnp.take_along_axis(logp, tokens[:, -new_tokens:, None], -1)[..., 0]

  def loss(state, tokens, rollout_logp, advantages):
    logp = logp_of(state, tokens)
    ratio = jnp.exp(logp - rollout_logp)
    return -jnp.mean(ratio * advantages[:, None]), logp

  def step(state, tokens, rollout_logp, advantages):
    grads, logp = jax.grad(loss, has_aux=True)(state, tokens, rollout_logp,
                                              advantages)
    state = jax.tree.map(lambda w, g: w - lr * g, state, grads)
    return state, logp
  return step


def mismatch(a, b) -> tuple[float, float]:
  """(mean, max) |a - b|: verl's and SkyRL's
  ``train_rollout_logprob_abs_diff``."""
  d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  return float(d.mean()), float(d.max())


def main(lengths=(8, 3, 5, 7), new_tokens=6) -> dict:
  from flax import nnx
  sampler_lib = tunix_client.sampler_module()
  graphdef, state, config = tiny_llama()
  rng = np.random.default_rng(11)
  prompts = [" ".join(map(str, rng.integers(1, config.vocab_size, n)))
             for n in lengths]
  advantages = jnp.asarray(rng.normal(size=len(lengths)), jnp.float32)
  out = {}
  for name in ("rlk", "xla"):
    cache = sampler_lib.CacheConfig(
        cache_size=max(lengths) + new_tokens, num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    sampler = sampler_lib.Sampler(nnx.merge(graphdef, state),
                                  tunix_client.IntTokenizer(config.vocab_size),
                                  cache)
    step = training_step_fn(graphdef, new_tokens)
    if name == "rlk":
      sampler = rlk_jax.batch_invariant_sampler(sampler)
      step = rlk_jax.batch_invariant(step)
    padded, tokens, rollout_logp = rollout(sampler, prompts, new_tokens,
                                           seed=7)
    full = jnp.asarray(np.concatenate([padded, tokens], 1))
    _, logp = jax.jit(step)(state, full, jnp.asarray(rollout_logp),
                            advantages)
    mean, worst = mismatch(logp, rollout_logp)
    out[name] = dict(train_rollout_logprob_abs_diff=mean,
                     train_rollout_logprob_abs_diff_max=worst)
    print(f"{name:>5}: train_rollout_logprob_abs_diff {mean:.3g} "
          f"(max {worst:.3g}) over {logp.size} tokens")
  assert out["rlk"]["train_rollout_logprob_abs_diff_max"] == 0.0, out
  return out


if __name__ == "__main__":
  main()
