"""True on-policy with a transformers model: the rollout's log-probs equal
the trainer's bit for bit.

    python -m examples.on_policy_torch

A rollout samples completions with ``model.generate`` (KV cache, ragged
prompts, left padding) and keeps each sampled token's log-prob from the
logits it computed itself. A GRPO-style training step recomputes them in
one padded forward, checks them against the rollout's, and takes its
gradient step. Under ``rlk_torch_bridge.batch_invariant_mode`` the two are
equal bit for bit; without it they drift. It prints the metric verl and
SkyRL log, ``train_rollout_logprob_abs_diff`` (mean and max), for both.
The model is built from a config (random weights, nothing downloaded).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import transformers

import rlk_torch_bridge as rtb


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


def tiny_llama(device="cpu", seed=0) -> torch.nn.Module:
  config = transformers.LlamaConfig(
      vocab_size=512, hidden_size=128, intermediate_size=256,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=64, max_position_embeddings=512)
  config._attn_implementation = "sdpa"
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).to(device, torch.bfloat16)
  model.generation_config.eos_token_id = None  # every completion full length
  model.generation_config.pad_token_id = 0
  return model.eval()


def training_step(model, r: Rollout, optimizer, advantages) -> torch.Tensor:
  """Recompute the log-probs (right padding), take a policy-gradient step
  with the ratio to the rollout's log-probs; returns the recomputed ones."""
  model.train()
  logp = trainer_logp(model, r, "right")
  ratio = torch.exp(logp - r.logp)
  loss = -(ratio * advantages[:, None]).mean()
  loss.backward()
  optimizer.step()
  optimizer.zero_grad(set_to_none=True)
  model.eval()
  return logp.detach()


def main(device=None, lengths=(5, 11, 8), new_tokens=6) -> dict:
  device = device or ("cuda" if torch.cuda.is_available() else "cpu")
  out = {}
  for name, mode in (("rlk", rtb.batch_invariant_mode),
                     ("torch", contextlib.nullcontext)):
    model = tiny_llama(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prompt_list = prompts(lengths, model.config.vocab_size, device)
    with mode():
      r = rollout(model, prompt_list, new_tokens, sample_seed=0)
      advantages = torch.randn(len(lengths), device=device)
      logp = training_step(model, r, optimizer, advantages)
    mean, worst = mismatch(logp, r.logp)
    out[name] = dict(train_rollout_logprob_abs_diff=mean,
                     train_rollout_logprob_abs_diff_max=worst)
    print(f"{name:>5}: train_rollout_logprob_abs_diff {mean:.3g} "
          f"(max {worst:.3g}) over {logp.numel()} tokens")
  assert out["rlk"]["train_rollout_logprob_abs_diff_max"] == 0.0, out
  return out


if __name__ == "__main__":
  main()
