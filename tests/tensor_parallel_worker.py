"""One rank of a tensor-parallel check (tests/test_tensor_parallel_torch.py
starts one process per rank): a column-parallel then a row-parallel
DetLinear, split from whole nn.Linear layers every rank builds from one
seed, forward and backward with a given cotangent. Writes this rank's
output, input gradient and weight-gradient shards to OUT/rank{r}.pt.
Cases "llama" (a transformers model's logits) and "vocab" (vocab-parallel
linear_logp) likewise."""

import os
import sys

import torch
import torch.distributed as dist

import rlk_torch_bridge


def mlp_case(seed, device, dtype, m, k, hidden, n):
  """The whole layers, the input and the cotangent, drawn alike everywhere."""
  gen = torch.Generator().manual_seed(seed)
  draw = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
  up = torch.nn.Linear(k, hidden, bias=True)
  down = torch.nn.Linear(hidden, n, bias=True)
  with torch.no_grad():
    for layer in (up, down):
      layer.weight.copy_(draw(*layer.weight.shape))
      layer.bias.copy_(draw(*layer.bias.shape))
  return up.to(device, dtype), down.to(device, dtype), draw(m, k), draw(m, n)


def llama(seed, device, dtype):
  """A 2-layer transformers Llama (8 query heads over 4 KV heads), built
  from a config with one seed's random weights."""
  from transformers import LlamaConfig, LlamaForCausalLM
  config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, max_position_embeddings=64,
                       attn_implementation="sdpa")
  torch.manual_seed(seed)
  return LlamaForCausalLM(config).to(device, dtype).eval()


def llama_logits(seed, device, dtype, impl, group):
  """The model's logits with its projections split over `group` (None: not
  split), under batch_invariant_mode (attention, norms, lm_head)."""
  model = llama(seed, device, dtype)
  rlk_torch_bridge.parallelize(model, group, rlk_torch_bridge.tensor_parallel
                               .LLAMA_PLAN, implementation=impl)
  ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(
      seed)).to(device)
  with torch.no_grad(), rlk_torch_bridge.batch_invariant_mode():
    return model(ids).logits.float().cpu()


def vocab_case(seed, device, dtype, n=13, h=64, v=256):
  """Hidden states, a whole lm_head weight [V, H], targets (one ignored) and
  the log-probs' and entropy's cotangents, drawn alike everywhere."""
  gen = torch.Generator().manual_seed(seed)
  draw = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
  targets = torch.randint(0, v, (n,), generator=gen)
  targets[3] = -100
  return (draw(n, h), (draw(v, h) * 0.3).to(dtype), targets.to(device),
          draw(n).float(), draw(n).float())


def vocab_parallel_logp(seed, device, dtype, impl, group, chunks=8):
  """This rank's vocab-parallel log-probs, entropy and gradients."""
  hidden, weight, targets, g_logp, g_ent = vocab_case(seed, device, dtype)
  ranks = 1 if group is None else dist.get_world_size(group)
  rank = 0 if group is None else dist.get_rank(group)
  rows = weight.shape[0] // ranks
  shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
  hidden.requires_grad_(True)
  logp, entropy = rlk_torch_bridge.vocab_parallel_linear_logp(
      hidden, shard, targets, group, vocab_chunks=chunks, return_entropy=True,
      implementation=impl)
  (logp * g_logp + entropy * g_ent).sum().backward()
  return {"logp": logp.detach().cpu(), "entropy": entropy.detach().cpu(),
          "d_hidden": hidden.grad.cpu(), "d_weight": shard.grad.cpu()}


def main():
  out, seed, device, impl = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
  if len(sys.argv) > 5 and sys.argv[5] == "llama":
    return main_llama(out, seed, device, impl)
  if len(sys.argv) > 5 and sys.argv[5] == "vocab":
    return main_vocab(out, seed, device, impl)
  _init(device)
  rank = dist.get_rank()
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  up, down, x, g = mlp_case(seed, device, dtype, m=24, k=256, hidden=128, n=64)
  group = dist.group.WORLD
  col = rlk_torch_bridge.ColumnParallelDetLinear.from_linear(
      up, group, reduction_chunks=8, implementation=impl)
  row = rlk_torch_bridge.RowParallelDetLinear.from_linear(
      down, group, reduction_chunks=8, implementation=impl)
  x.requires_grad_(True)
  y = row(torch.relu(col(x)))
  y.backward(g)
  torch.save({"y": y.detach().cpu(), "dx": x.grad.cpu(),
              "d_up": col.weight.grad.cpu(), "d_down": row.weight.grad.cpu(),
              "d_up_bias": col.bias.grad.cpu(),
              "d_down_bias": row.bias.grad.cpu()},
             os.path.join(out, f"rank{rank}.pt"))
  dist.destroy_process_group()


def main_vocab(out, seed, device, impl):
  _init(device)
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  torch.save(vocab_parallel_logp(seed, device, dtype, impl, dist.group.WORLD),
             os.path.join(out, f"rank{dist.get_rank()}.pt"))
  dist.destroy_process_group()


def _init(device):
  device_id = None
  if device == "cuda":
    device_id = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device_id)
  dist.init_process_group("nccl" if device == "cuda" else "gloo",
                          device_id=device_id)


def main_llama(out, seed, device, impl):
  _init(device)
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  logits = llama_logits(seed, device, dtype, impl, dist.group.WORLD)
  torch.save({"logits": logits},
             os.path.join(out, f"rank{dist.get_rank()}.pt"))
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
  # The results are saved and the group destroyed. The interpreter's own
  # teardown of this process (torch, gloo and XLA's CPU client threads) now
  # and then ends in "terminate called without an active exception" (1 run
  # in ~10 on the CPU machine, 2026-11-29), which would fail a test whose
  # bits were all written: exit without it.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)
