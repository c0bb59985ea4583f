"""One GRPO training step in PyTorch with rlk_torch_bridge: a small HF-style
decoder whose every nn.Linear runs on det_gemm, log-probs from packed hidden
states by linear_logp, a clipped-surrogate loss on group-normalized
advantages, ``loss.backward()`` and an AdamW step.

    python -m examples.grpo_step_torch

The same step as ``examples/grpo_step_jax.py``, for a torch trainer:

* ``rtb.replace_linear(model)`` swaps every ``nn.Linear`` for a ``DetLinear``
  sharing its Parameters: each projection row's bits no longer depend on the
  batch around it.
* The decoder runs on the padded batch, where plain causal attention is
  right; only its final hidden states are packed, so the LM head (with a
  large vocabulary the biggest product, and ``[N, V]`` logits the biggest
  activation) runs on real tokens only, inside ``rtb.linear_logp``, which
  never holds the logits. Packing the model's input too needs attention
  with a segment-causal mask (``examples/tiny_transformer.py`` does it in
  JAX); the attention here is not batch-invariant, so unlike the JAX
  example a token's bits here may depend on its batch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import rlk_torch_bridge as rtb
from examples import grpo_step_jax

IGNORE = -100
CLIP = 0.2
ADV_EPS = 1e-6


# ----------------------------------------------------------------------------
# An HF-style decoder (Llama layout), tiny


class RMSNorm(nn.Module):
  def __init__(self, dim: int, eps: float = 1e-6):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def forward(self, x):
    rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return x * rms * self.weight


def rotate_half(x):
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
  def __init__(self, hidden: int, n_heads: int):
    super().__init__()
    self.n_heads, self.head_dim = n_heads, hidden // n_heads
    self.q_proj = nn.Linear(hidden, hidden, bias=False)
    self.k_proj = nn.Linear(hidden, hidden, bias=False)
    self.v_proj = nn.Linear(hidden, hidden, bias=False)
    self.o_proj = nn.Linear(hidden, hidden, bias=False)

  def forward(self, x, cos, sin, attn_mask):
    b, s, _ = x.shape
    q, k, v = (proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
  def __init__(self, hidden: int, ffn: int):
    super().__init__()
    self.gate_proj = nn.Linear(hidden, ffn, bias=False)
    self.up_proj = nn.Linear(hidden, ffn, bias=False)
    self.down_proj = nn.Linear(ffn, hidden, bias=False)

  def forward(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
  def __init__(self, hidden: int, n_heads: int, ffn: int):
    super().__init__()
    self.input_layernorm = RMSNorm(hidden)
    self.self_attn = Attention(hidden, n_heads)
    self.post_attention_layernorm = RMSNorm(hidden)
    self.mlp = MLP(hidden, ffn)

  def forward(self, x, cos, sin, attn_mask):
    x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
    return x + self.mlp(self.post_attention_layernorm(x))


class TinyDecoder(nn.Module):
  def __init__(self, vocab: int, hidden: int = 32, n_heads: int = 2,
               n_layers: int = 2, ffn: int = 64, rope_base: float = 10000.0):
    super().__init__()
    self.embed_tokens = nn.Embedding(vocab, hidden)
    self.layers = nn.ModuleList(DecoderLayer(hidden, n_heads, ffn)
                                for _ in range(n_layers))
    self.norm = RMSNorm(hidden)
    self.lm_head = nn.Linear(hidden, vocab, bias=False)
    head_dim = hidden // n_heads
    inv_freq = rope_base ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    self.register_buffer("inv_freq", inv_freq, persistent=False)

  def forward(self, ids, mask):
    """Final hidden states ``[B, S, H]`` of a right-padded batch (`mask`
    bool). No logits: ``rtb.linear_logp`` applies the LM head to packed
    rows."""
    s = ids.shape[1]
    freqs = torch.arange(s, device=ids.device)[:, None] * self.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    # Causal, real keys only. Right padding: every query, pad rows too, sees
    # at least its row's first token, so no softmax row is empty (NaN).
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    attn_mask = (causal & mask[:, None, :])[:, None]  # [B, 1, S, S]
    x = self.embed_tokens(ids)
    for layer in self.layers:
      x = layer(x, cos, sin, attn_mask)
    return self.norm(x)


# ----------------------------------------------------------------------------
# GRPO


def token_logprobs(model, ids, mask, capacity: int):
  """``[B, S]`` f32: each token's log-prob given the tokens before it in its
  sequence (where a rollout engine reports it); 0 on a sequence's first
  token and on padding. Rows are right-padded."""
  hidden = model(ids, mask)
  packed, info = rtb.pack(hidden, mask, capacity=capacity)  # padding gone
  # Labels: the next token of the same row, IGNORE after a row's last one.
  # A row is one sequence, so no label crosses into another sequence.
  targets = F.pad(torch.where(mask[:, 1:], ids[:, 1:], IGNORE), (0, 1),
                  value=IGNORE)
  packed_targets, _ = rtb.pack(targets, info, fill_value=IGNORE)
  logp = rtb.linear_logp(packed, model.lm_head.weight, packed_targets)
  # Row r scores the token after it: back in [B, S], shift each value onto
  # the token it scores, where old log-probs and response masks live.
  return F.pad(rtb.unpack(logp, info)[:, :-1], (1, 0))


def group_advantages(rewards, group_size: int):
  """``(r - group mean) / (group std + eps)``; a prompt's G responses are
  adjacent rows. Population std (as ``jnp.std``), so equal rewards give 0."""
  r = rewards.float().view(-1, group_size)
  centered = r - r.mean(dim=1, keepdim=True)
  return (centered / (r.std(dim=1, correction=0, keepdim=True) + ADV_EPS)
          ).view(-1)


def clipped_surrogate_loss(logp, old_logp, advantages, response_mask,
                           clip: float = CLIP):
  """PPO's clipped objective, negated and averaged over every response
  token of the batch (a long response weighs more than a short one)."""
  m = response_mask.float()
  # Outside the response old_logp may hold anything (pad values of -inf):
  # keep exp away from it, as 0 * inf would be NaN.
  ratio = torch.exp(torch.where(m > 0, logp - old_logp, 0.0))
  adv = advantages[:, None]
  surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
  return -(surrogate * m).sum() / m.sum().clamp(min=1.0)


def grpo_step(model, optimizer, batch: dict, *, capacity: int,
              group_size: int):
  """One AdamW step. `batch`: ``ids`` (int64), ``mask``, ``response_mask``
  (bool) ``[B, S]``, ``old_logp [B, S]`` (token-aligned like
  :func:`token_logprobs`), ``rewards [B]``. The grads stay in ``.grad``."""
  advantages = group_advantages(batch["rewards"], group_size)
  logp = token_logprobs(model, batch["ids"], batch["mask"], capacity)
  loss = clipped_surrogate_loss(logp, batch["old_logp"], advantages,
                                batch["response_mask"])
  optimizer.zero_grad(set_to_none=True)
  loss.backward()
  optimizer.step()
  return loss.detach(), advantages


def random_rollouts(rng: np.random.Generator, **sizes) -> dict:
  """The JAX example's rollouts (NumPy, G rows per prompt) as tensors; ids
  int64, as torch embeddings expect."""
  rollouts = grpo_step_jax.random_rollouts(rng, **sizes)
  rollouts["ids"] = rollouts["ids"].astype(np.int64)
  return {k: torch.from_numpy(v) for k, v in rollouts.items()}


def main():
  rng = np.random.default_rng(0)
  torch.manual_seed(0)
  vocab, group_size = 97, 4
  model = rtb.replace_linear(TinyDecoder(vocab))  # same Parameters, det_gemm
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
  batch = random_rollouts(rng, n_prompts=3, group_size=group_size,
                          vocab=vocab)
  capacity = grpo_step_jax.capacity_for(batch["mask"].numpy())
  # The rollout policy is the current one: its log-probs are the old ones.
  with torch.no_grad():
    batch["old_logp"] = token_logprobs(model, batch["ids"], batch["mask"],
                                       capacity)
  print(f"{len(batch['ids'])} rollouts, {int(batch['mask'].sum())} tokens "
        f"packed into {capacity} rows (padded: {batch['mask'].numel()})")
  for i in range(4):  # PPO epochs on one batch
    loss, _ = grpo_step(model, optimizer, batch, capacity=capacity,
                        group_size=group_size)
    print(f"step {i}: loss {float(loss):+.5f}")


if __name__ == "__main__":
  main()
