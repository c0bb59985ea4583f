"""A data-parallel training step on a device mesh: pack each shard's
sequences, two det_gemm layers, linear_logp, gradients — all under one jit,
with the batch sharded over the mesh's "data" axis.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m examples.data_parallel_step

What stays local: each device packs its own sequences (``pack_sharded``),
runs the det_gemm layers and the linear_logp kernel on its own token rows
(their partitioning rules keep rows sharded and never split a reduction
dimension), so each token's log-prob is bitwise what one device would
compute for that token. What is shared: the weight gradients, whose row
reductions gather their operands (the rule's choice, to keep the unsharded
summation order), and the mean loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import rlk_jax

IGNORE = -100


def init_params(key, *, hidden: int, ffn: int, vocab: int) -> dict:
  k1, k2, k3 = jax.random.split(key, 3)
  normal = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)
  return {"up": normal(k1, (hidden, ffn), hidden),
          "down": normal(k2, (ffn, hidden), ffn),
          "lm_head": normal(k3, (hidden, vocab), hidden)}


def token_logprobs(params, x, mask, targets, *, mesh, capacity: int):
  """Per-token log-probs on the packed rows: ``(logp [n*capacity], valid)``."""
  packed, info = rlk_jax.pack_sharded(x, mask, mesh=mesh, axis="data",
                                      capacity=capacity)
  packed_targets, _ = rlk_jax.pack_sharded(targets, mask, mesh=mesh,
                                           axis="data", capacity=capacity)
  labels = jnp.where(info.valid, packed_targets, IGNORE)  # pad rows: no loss
  h = jax.nn.gelu(rlk_jax.det_gemm(packed, params["up"]))
  h = packed + rlk_jax.det_gemm(h, params["down"])
  return rlk_jax.linear_logp(h, params["lm_head"], labels), info.valid


def loss_fn(params, x, mask, targets, *, mesh, capacity: int):
  logp, valid = token_logprobs(params, x, mask, targets, mesh=mesh,
                               capacity=capacity)
  return -jnp.sum(logp) / jnp.maximum(jnp.sum(valid), 1)


def make_step(mesh, capacity: int, learning_rate: float = 1e-2):
  @jax.jit
  def step(params, x, mask, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, mask, targets,
                                              mesh=mesh, capacity=capacity)
    new = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    return new, loss
  return step


def main():
  devices = np.array(jax.devices())
  mesh = Mesh(devices, ("data",))
  batch, seq, hidden, vocab = 2 * len(devices), 24, 32, 97
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  x = jax.device_put(rng.standard_normal((batch, seq, hidden), np.float32), data)
  mask = jax.device_put(rng.random((batch, seq)) < 0.7, data)
  targets = jax.device_put(rng.integers(0, vocab, (batch, seq), np.int32), data)
  params = init_params(jax.random.key(0), hidden=hidden, ffn=64, vocab=vocab)
  step = make_step(mesh, capacity=2 * seq)
  for i in range(3):
    params, loss = step(params, x, mask, targets)
    print(f"step {i}: loss {float(loss):.4f}")


if __name__ == "__main__":
  main()
