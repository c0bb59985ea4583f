"""Tunix's Llama 3 (Flax NNX, built from a config, random weights, bf16)
under ``rlk_jax.batch_invariant`` against the same program plain: a jitted
training step (forward, backward, an SGD update), a jitted scoring
forward, and Tunix's own ``Sampler`` (``batch_invariant_sampler``) time
per generated token; and whether a row's log-probs alone equal its
batch's.

    python -m benchmarks.bench_models_jax [--smoke]

Competitors (stable names): ``xla`` (the function jitted as written),
``rlk`` (``jax.jit(rlk_jax.batch_invariant(fn))``; the sampler through
``rlk_jax.batch_invariant_sampler``) and, for the training step,
``rlk_in_grad`` (``jax.grad(rlk_jax.batch_invariant(loss))``: attention on
det_attention both ways). Needs flax, jaxtyping,
sentencepiece and google-tunix (the test extra; carry their wheels to a
device image without them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import rlk_jax
from benchmarks import harness, tunix_client
from benchmarks.harness import Row

BENCH = "models_jax"


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(model=dict(num_layers=1, vocab_size=256, embed_dim=64,
                           hidden_dim=128, num_heads=2, head_dim=64,
                           num_kv_heads=1),
                train=(2, 16), forward=(2, 16), generate=(2, 8, 3),
                invariance=16, iters=1)
  # Llama-3.2-1B's shapes, 8 of its 16 layers.
  return dict(model=dict(num_layers=8, vocab_size=128256, embed_dim=2048,
                         hidden_dim=8192, num_heads=32, head_dim=64,
                         num_kv_heads=8),
              train=(4, 512), forward=(8, 512), generate=(8, 128, 32),
              invariance=256, iters=2)


def _model(cfg):
  from flax import nnx
  module = tunix_client.model_module("llama3")
  config = module.ModelConfig(rope_theta=500_000, norm_eps=1e-5,
                              **cfg["model"])
  graphdef, state = nnx.split(module.Llama3(config, rngs=nnx.Rngs(0)))
  state = jax.tree.map(lambda w: w.astype(jnp.bfloat16)
                       if jnp.issubdtype(w.dtype, jnp.floating) else w, state)
  return graphdef, state


def _functions(graphdef):
  from flax import nnx

  def logp(state, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    logits, _ = nnx.merge(graphdef, state)(tokens, positions, None, mask)
    return jax.nn.log_softmax(logits.astype(jnp.float32))

  def loss(state, tokens):
    lp = logp(state, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1))

  def train_step(state, tokens, transform=lambda f: f):
    grads = jax.grad(transform(loss))(state, tokens)
    return jax.tree.map(lambda w, g: w - (1e-4 * g).astype(w.dtype), state,
                        grads)
  return logp, train_step


def _tokens(cfg, b, t, seed):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 1,
                            cfg["model"]["vocab_size"])


def _jitted_rows(case, fn, args, iters, flops=None, **more) -> list[Row]:
  comps = {"xla": lambda: harness.jax_batch(fn, [args]),
           "rlk": lambda: harness.jax_batch(rlk_jax.batch_invariant(fn),
                                            [args])}
  comps.update({name: functools.partial(harness.jax_batch, f, [args])
                for name, f in more.items()})
  return harness.interleaved_rows(BENCH, case, comps, iters=iters,
                                  flops=flops)


def _sampler_rows(cfg, graphdef, state) -> list[Row]:
  from flax import nnx
  sampler_lib = tunix_client.sampler_module()
  b, prompt, new = cfg["generate"]
  m = cfg["model"]
  cache = sampler_lib.CacheConfig(cache_size=prompt + new, num_layers=m[
      "num_layers"], num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"])
  rng = np.random.default_rng(3)
  prompts = [" ".join(map(str, rng.integers(1, m["vocab_size"],
                                            prompt - (i * 7) % (prompt // 2))))
             for i in range(b)]

  def make(transform):
    sampler = sampler_lib.Sampler(nnx.merge(graphdef, state),
                                  tunix_client.IntTokenizer(m["vocab_size"]),
                                  cache)
    if transform:
      sampler = rlk_jax.batch_invariant_sampler(sampler)

    def run(n):
      for _ in range(max(n, 1)):
        out = sampler(prompts, max_generation_steps=new,
                      max_prompt_length=prompt, return_logprobs=True)
      jax.block_until_ready(out.logprobs)
    run(1)  # compile
    if harness.tune_traced_products():
      run(1)
    return run, 1
  rows = harness.interleaved_rows(
      BENCH, f"Tunix Sampler B={b} prompt {prompt} new {new}",
      {"xla": lambda: make(False), "rlk": lambda: make(True)},
      iters=max(1, cfg["iters"] // 2))
  for r in rows:
    if r.median_ms:
      r.note = f"{r.median_ms / new:.2f} ms per token"
  return rows


def _invariance_rows(cfg, logp, state) -> list[Row]:
  tokens = _tokens(cfg, 8, cfg["invariance"], 4)
  rows = []
  for name, fn in (("xla", jax.jit(logp)),
                   ("rlk", jax.jit(rlk_jax.batch_invariant(logp)))):
    batch = np.asarray(fn(state, tokens)[3])
    alone = np.asarray(fn(state, tokens[3:4])[0])
    differ = int((batch.view(np.uint32) != alone.view(np.uint32)).any(-1)
                 .sum())
    rows.append(harness.progress(Row(
        BENCH, f"invariance S={cfg['invariance']}", name,
        note=f"batch 8 vs alone: {differ} of {cfg['invariance']} positions "
        "differ")))
  return rows


def run(smoke: bool) -> list[Row]:
  cfg = _config(smoke)
  try:
    graphdef, state = _model(cfg)
  except ImportError as e:
    return [Row(BENCH, "all", "rlk", note=f"Tunix: {e}")]
  logp, train_step = _functions(graphdef)
  params = sum(int(np.prod(w.shape)) for w in jax.tree.leaves(state))
  rows = _invariance_rows(cfg, logp, state)
  b, t = cfg["forward"]
  rows += _jitted_rows(f"forward {b}x{t}", logp,
                       (state, _tokens(cfg, b, t, 2)), cfg["iters"],
                       flops=2.0 * b * t * params)
  b, t = cfg["train"]
  # rlk: the whole step transformed (its backward traced by JAX, then
  # rewritten: attention's stays on products); rlk_in_grad: the loss
  # transformed inside grad (det_attention forward and backward).
  rows += _jitted_rows(
      f"train step {b}x{t}", train_step, (state, _tokens(cfg, b, t + 1, 1)),
      cfg["iters"], flops=6.0 * b * t * params,
      rlk_in_grad=functools.partial(train_step,
                                    transform=rlk_jax.batch_invariant))
  rows += _sampler_rows(cfg, graphdef, state)
  return rows


def main(argv):
  del argv
  print(harness.format_table(run(harness.smoke_mode()), peer="xla"))


if __name__ == "__main__":
  app.run(main)
