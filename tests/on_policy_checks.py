"""The on-policy check on real transformers models: a rollout through
``model.generate`` (KV cache, ragged prompts, left padding) keeps each
sampled token's log-prob; a trainer recomputes them in one forward, padded
left or right, or packed; the two must agree bit for bit.

Models are transformers' own classes built from configs in code (random
weights, nothing downloaded): tiny widths on CPU, real ones on the device.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers

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


@dataclasses.dataclass
class Rollout:
  prompts: list            # each a 1-D LongTensor
  completions: torch.Tensor  # [B, new]
  logp: torch.Tensor       # [B, new] float32: the rollout's own log-probs


def prompts(lengths, vocab, device, seed=1) -> list:
  g = torch.Generator().manual_seed(seed)
  return [torch.randint(1, vocab, (n,), generator=g).to(device)
          for n in lengths]


def _left_padded(seqs):
  width = max(len(s) for s in seqs)
  ids = torch.zeros(len(seqs), width, dtype=torch.long, device=seqs[0].device)
  mask = torch.zeros_like(ids)
  for i, s in enumerate(seqs):
    ids[i, width - len(s):] = s
    mask[i, width - len(s):] = 1
  return ids, mask


def _token_logp(logits, tokens):
  return torch.log_softmax(logits.float(), -1).gather(
      -1, tokens[..., None])[..., 0]


def rollout(model, prompt_list, new_tokens: int, sample_seed=None) -> Rollout:
  """generate with a KV cache on a left-padded batch; each sampled token's
  log-prob from the logits the rollout itself computed (temperature 1)."""
  ids, mask = _left_padded(prompt_list)
  kwargs = dict(do_sample=False)
  if sample_seed is not None:
    torch.manual_seed(sample_seed)
    kwargs = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
  out = model.generate(
      ids, attention_mask=mask, max_new_tokens=new_tokens,
      min_new_tokens=new_tokens, return_dict_in_generate=True,
      output_logits=True,
      # A full cache: a sliding-window cache drops a sequence's first keys,
      # where det_attention anchors its key blocks (README, limitations).
      past_key_values=transformers.DynamicCache(), **kwargs)
  completions = out.sequences[:, ids.shape[1]:]
  logits = torch.stack(out.logits, 1)
  return Rollout(prompt_list, completions, _token_logp(logits, completions))


def trainer_logp(model, r: Rollout, layout: str) -> torch.Tensor:
  """The completions' log-probs recomputed in one forward: ``"left"`` or
  ``"right"`` padding, or ``"packed"`` (one row, position ids restarting,
  transformers' ``cu_seq_lens`` kwargs)."""
  seqs = [torch.cat([p, c]) for p, c in zip(r.prompts, r.completions)]
  new = r.completions.shape[1]
  dev = seqs[0].device
  if layout == "packed":
    ids = torch.cat(seqs)[None]
    lens = torch.tensor([len(s) for s in seqs], device=dev)
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    pos = torch.cat([torch.arange(len(s), device=dev) for s in seqs])[None]
    logits = model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=int(lens.max()),
                   max_length_k=int(lens.max())).logits[0]
    rows = [logits[int(e) - new - 1:int(e) - 1] for e in cu[1:]]
    return _token_logp(torch.stack(rows), r.completions)
  if layout == "left":
    ids, mask = _left_padded(seqs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=pos).logits
    return _token_logp(logits[:, -new - 1:-1], r.completions)
  width = max(len(s) for s in seqs)
  ids = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
  mask = torch.zeros_like(ids)
  for i, s in enumerate(seqs):
    ids[i, :len(s)] = s
    mask[i, :len(s)] = 1
  logits = model(ids, attention_mask=mask).logits
  rows = [logits[i, len(s) - new - 1:len(s) - 1] for i, s in enumerate(seqs)]
  return _token_logp(torch.stack(rows), r.completions)


def mismatch(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
  """(mean, max) |a - b|: verl's and SkyRL's
  ``train_rollout_logprob_abs_diff``."""
  d = (a.float() - b.float()).abs()
  return float(d.mean()), float(d.max())
