"""The on-policy check on real transformers models: a rollout through
``model.generate`` (KV cache, ragged prompts, left padding) keeps each
sampled token's log-prob; a trainer recomputes them in one forward, padded
left or right, or packed; the two must agree bit for bit.

Models are transformers' own classes built from configs in code (random
weights, nothing downloaded): tiny widths on CPU, real ones on the device.
"""

from __future__ import annotations

import torch
import transformers

from examples.on_policy_torch import (Rollout, mismatch, prompts,  # noqa: F401
                                      rollout, trainer_logp)

VOCAB = 512


def _common(width: str) -> dict:
  if width == "tiny":
    return dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64,
                max_position_embeddings=512)
  # A real layer's widths (Llama-3.2-1B's), fewer layers to keep it quick.
  return dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
              num_hidden_layers=4, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64,
              max_position_embeddings=4096)


def families(width: str = "tiny") -> dict:
  """name -> (config, model class) for every family the installed
  transformers ships. Windows are short so that they cut."""
  t = transformers
  c = _common(width)
  window = 6 if width == "tiny" else 64
  no_head_dim = {k: v for k, v in c.items() if k != "head_dim"}
  specs = {
      "llama": ("LlamaConfig", "LlamaForCausalLM", c),
      "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", c),
      "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", c),
      "mistral": ("MistralConfig", "MistralForCausalLM",
                  dict(c, sliding_window=window)),
      "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
                 dict(c, sliding_window=window, query_pre_attn_scalar=64)),
      "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                 dict(c, sliding_window=window, query_pre_attn_scalar=64)),
      # A mixture of experts (Qwen3-30B-A3B's kind), its experts on
      # transformers' default torch._grouped_mm.
      "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                    dict(c, num_experts=4 if width == "tiny" else 16,
                         num_experts_per_tok=2 if width == "tiny" else 4,
                         moe_intermediate_size=c["intermediate_size"] // 4)),
      # Phi-3's head dim is hidden / heads: 128 / 2 = 64 (tiny), 2048 / 32.
      "phi3": ("Phi3Config", "Phi3ForCausalLM",
               dict(no_head_dim, num_attention_heads=c["hidden_size"] // 64,
                    num_key_value_heads=c["hidden_size"] // 128,
                    pad_token_id=0)),
  }
  out = {}
  for name, (config_name, model_name, kwargs) in specs.items():
    if hasattr(t, config_name) and hasattr(t, model_name):
      out[name] = (getattr(t, config_name)(**kwargs), getattr(t, model_name))
  return out


def build(name: str, width: str = "tiny", attn="sdpa", device="cpu",
          seed=0) -> torch.nn.Module:
  config, cls = families(width)[name]
  config._attn_implementation = attn
  torch.manual_seed(seed)
  model = cls(config).to(device=device, dtype=torch.bfloat16).eval()
  # Never stop early: every sequence gets all its new tokens.
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model


