"""An HF-style decoder for the batch-invariant mode's tests: the Llama layout
of ``examples/grpo_step_torch.py`` (RMSNorm, rotary embedding, gated MLP)
with its attention written out in plain torch ops (``q @ kᵀ``, a masked
softmax in float32, ``@ v``) instead of SDPA, so that every product and
reduction it runs is one the mode or torch's row kernels own."""

import math

import torch

from examples.grpo_step_torch import Attention, TinyDecoder, rotate_half


class MatmulAttention(Attention):
  def forward(self, x, cos, sin, attn_mask):
    b, s, _ = x.shape
    q, k, v = (proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
    scores = scores.float().masked_fill(~attn_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, -1))


def decoder(vocab: int, seed: int, **sizes) -> TinyDecoder:
  torch.manual_seed(seed)
  model = TinyDecoder(vocab, **sizes)
  for layer in model.layers:
    layer.self_attn.__class__ = MatmulAttention  # same weights, explicit ops
  return model


def logits(model: TinyDecoder, ids: torch.Tensor) -> torch.Tensor:
  """``[B, S, V]`` logits of full-length sequences."""
  mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
  return model.lm_head(model(ids, mask))
