"""One Llama checkpoint in both frameworks: transformers' ``LlamaForCausalLM``
(torch, under ``rlk_torch_bridge.batch_invariant_mode``) and Tunix's Llama 3
(JAX, under ``rlk_jax.batch_invariant``), loaded from the same safetensors
by Tunix's own loader. For each op of the first decoder layer, given the
same input bits on both sides: how many output elements have the same
bits; then the whole model's logits.

    python -m benchmarks.cross_framework_llama [--smoke]

Random weights from a config (nothing downloaded), bf16; the norm weights
drawn around 1 (their init, all ones, would hide a norm's weight product).
Smoke (CPU): 2 layers of width 128, head dim 64. Device: Llama-3.2-1B's
shapes, 4 of its 16 layers. Rows say which ops agree and how far apart the
others are (the largest difference over the largest magnitude).
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

import rlk_jax
from benchmarks import harness, tunix_client

BENCH = "cross_framework_llama"
# Tunix's Llama 3 attention calls `apply_rope` without its config's
# `rope_theta`, so the model always rotates with that function's default
# (1e6) whatever the config says; transformers' model is built with the
# same value so that both sides compute one model (Llama 3's own 5e5 made
# the whole-model logits differ by 83% of their largest magnitude at 256
# positions on the H200, 2026-11-28, while every op agreed).
ROPE_THETA = 1_000_000
NOISE_ROW = "logits: torch under the mode vs plain torch"


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(num_layers=2, vocab_size=512, embed_dim=128, hidden_dim=256,
                num_heads=4, head_dim=64, num_kv_heads=2, batch=2, seq=24)
  return dict(num_layers=4, vocab_size=128256, embed_dim=2048,
              hidden_dim=8192, num_heads=32, head_dim=64, num_kv_heads=8,
              batch=4, seq=256)


@dataclasses.dataclass
class Pair:
  """One checkpoint in both frameworks."""
  hf: object       # transformers LlamaForCausalLM, bf16, eval
  tunix: object    # tunix Llama3 (an nnx module), bf16
  config: dict


def build(cfg: dict, seed: int = 0) -> Pair:
  import torch
  import transformers
  torch.manual_seed(seed)
  hf_config = transformers.LlamaConfig(
      vocab_size=cfg["vocab_size"], hidden_size=cfg["embed_dim"],
      intermediate_size=cfg["hidden_dim"],
      num_hidden_layers=cfg["num_layers"],
      num_attention_heads=cfg["num_heads"], head_dim=cfg["head_dim"],
      num_key_value_heads=cfg["num_kv_heads"], rms_norm_eps=1e-5,
      rope_theta=float(ROPE_THETA), tie_word_embeddings=True,
      max_position_embeddings=4096, attn_implementation="sdpa")
  hf = transformers.LlamaForCausalLM(hf_config).eval()
  with torch.no_grad():
    # Parameters to bf16, buffers kept: `.to(torch.bfloat16)` would round
    # the rotary embedding's f32 inverse frequencies too (which
    # from_pretrained in bf16 keeps in f32), an angle error growing with
    # the position (0.5 rad at position 255).
    for name, p in hf.named_parameters():
      p.data = p.data.to(torch.bfloat16)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
  module = tunix_client.model_module("llama3")
  config = module.ModelConfig(
      num_layers=cfg["num_layers"], vocab_size=cfg["vocab_size"],
      embed_dim=cfg["embed_dim"], hidden_dim=cfg["hidden_dim"],
      num_heads=cfg["num_heads"], head_dim=cfg["head_dim"],
      num_kv_heads=cfg["num_kv_heads"], rope_theta=ROPE_THETA, norm_eps=1e-5,
      weight_tying=True)
  with tempfile.TemporaryDirectory() as where:
    hf.save_pretrained(where, safe_serialization=True)
    loader = tunix_client.params_module("llama3")
    tunix = loader.create_model_from_safe_tensors(where, config,
                                                  dtype=jnp.bfloat16)
  return Pair(hf, tunix, cfg)


def to_jax(t):
  import torch
  t = t.detach().cpu().contiguous()
  if t.dtype == torch.bfloat16:
    return jnp.asarray(t.view(torch.int16).numpy().view(jnp.bfloat16))
  return jnp.asarray(t.numpy())


def to_numpy(x) -> np.ndarray:
  import torch
  if isinstance(x, torch.Tensor):
    x = x.detach()
    if x.dtype == torch.bfloat16:
      return x.float().numpy()
    return x.numpy()
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def compare(a, b) -> dict:
  """Same-bits fraction and the largest difference over the largest
  magnitude (both read in float32, which holds a bf16 exactly)."""
  a, b = to_numpy(a), to_numpy(b)
  if a.shape != b.shape:
    raise ValueError(f"shapes differ: torch {a.shape}, JAX {b.shape}")
  same = (a.view(np.uint32) == b.view(np.uint32))
  scale = max(float(np.abs(a).max()), 1e-30)
  return dict(same=float(same.mean()), n=a.size,
              rel=float(np.abs(a - b).max()) / scale)


def _tunix_attention_core(q, k, v, scale):
  """Tunix's attention between its projections and o_proj (Llama 3's
  ``Attention.block``: GQA einsum, a boolean causal mask, an f32 softmax),
  on [B, T, heads, D] operands."""
  b, t, qh, d = q.shape
  kh = k.shape[2]
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  q = q.reshape((b, t, kh, qh // kh, d))
  s = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * scale
  s = s.reshape((b, qh, t, t))
  s = jnp.where(jnp.expand_dims(mask, -3), s, -2.3819763e38)
  p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(k.dtype)
  p = p.reshape((b, kh, qh // kh, t, t))
  return jnp.einsum("BHGTS,BSHD->BTHGD", p, v).reshape((b, t, qh, d))


def op_pairs(pair: Pair, tokens: np.ndarray):
  """(op, torch function, JAX function) for each op of the first layer and
  the whole model; the inputs are the torch model's own intermediates (so
  each op starts from the same bits on both sides)."""
  import torch
  from transformers.models.llama import modeling_llama as hf_llama
  from flax import nnx
  llama = tunix_client.model_module("llama3")
  hf, tx, cfg = pair.hf, pair.tunix, pair.config
  b, t = tokens.shape
  n, kvh, hd = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
  device = next(hf.parameters()).device
  ids = torch.from_numpy(tokens).long().to(device)
  positions = torch.arange(t, device=device)[None].expand(b, t)
  layer, tl = hf.model.layers[0], tx.layers[0]
  graphdef, state = nnx.split(tx)

  def tunix_part(fn):
    # The Tunix module is rebuilt from its state inside the traced function,
    # so the transformation sees its weights' products.
    def run(state, *args):
      return fn(nnx.merge(graphdef, state), *args)
    f = jax.jit(rlk_jax.batch_invariant(run))
    return lambda *args: f(state, *args)

  with torch.no_grad():
    h = hf.model.embed_tokens(ids)
    normed = layer.input_layernorm(h)
    q = layer.self_attn.q_proj(normed).view(b, t, n, hd)
    k = layer.self_attn.k_proj(normed).view(b, t, kvh, hd)
    v = layer.self_attn.v_proj(normed).view(b, t, kvh, hd)
    cos, sin = hf.model.rotary_emb(h, positions)
    qr, kr = hf_llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2),
                                           cos, sin)
    qr, kr = qr.transpose(1, 2), kr.transpose(1, 2)
    attn = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, enable_gqa=True).transpose(1, 2)
    gate, up = layer.mlp.gate_proj(normed), layer.mlp.up_proj(normed)
    hidden = layer.mlp.act_fn(gate) * up
  scale = hd ** -0.5
  pos = jnp.asarray(positions.cpu().numpy(), jnp.int32)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  return [
      ("embedding", lambda: hf.model.embed_tokens(ids),
       lambda: tunix_part(lambda m, x: m.embedder.encode(x))(
           jnp.asarray(tokens, jnp.int32))),
      ("rms norm (input)", lambda: layer.input_layernorm(h),
       lambda: tunix_part(lambda m, x: m.layers[0].input_layernorm(x))(
           to_jax(h))),
      ("q projection", lambda: layer.self_attn.q_proj(normed).view(
          b, t, n, hd),
       lambda: tunix_part(lambda m, x: m.layers[0].attn.q_proj(x))(
           to_jax(normed))),
      ("k projection", lambda: layer.self_attn.k_proj(normed).view(
          b, t, kvh, hd),
       lambda: tunix_part(lambda m, x: m.layers[0].attn.k_proj(x))(
           to_jax(normed))),
      ("rotary (q)", lambda: qr,
       lambda: jax.jit(lambda x: llama.apply_rope(x, pos, hd, ROPE_THETA))(
           to_jax(q))),
      ("attention core (causal, GQA)", lambda: attn,
       lambda: jax.jit(rlk_jax.batch_invariant(
           lambda a, c, d: _tunix_attention_core(a, c, d, scale)))(
               to_jax(qr), to_jax(kr), to_jax(v))),
      ("o projection", lambda: layer.self_attn.o_proj(attn.reshape(b, t, -1)),
       lambda: tunix_part(lambda m, x: m.layers[0].attn.o_proj(x))(
           to_jax(attn))),
      ("gate projection", lambda: layer.mlp.gate_proj(normed),
       lambda: tunix_part(lambda m, x: m.layers[0].mlp.gate_proj(x))(
           to_jax(normed))),
      ("silu(gate) * up (elementwise)", lambda: layer.mlp.act_fn(gate) * up,
       lambda: jax.jit(lambda g, u: nnx.silu(g) * u)(to_jax(gate),
                                                      to_jax(up))),
      ("down projection", lambda: layer.mlp.down_proj(hidden),
       lambda: tunix_part(lambda m, x: m.layers[0].mlp.down_proj(x))(
           to_jax(hidden))),
      ("mlp (gate, up, silu, down)", lambda: layer.mlp(normed),
       lambda: tunix_part(lambda m, x: m.layers[0].mlp(x))(to_jax(normed))),
      ("final norm + tied lm_head", lambda: hf.lm_head(hf.model.norm(h)),
       lambda: tunix_part(lambda m, x: m.embedder.decode(m.final_norm(x)))(
           to_jax(h))),
      ("whole model: logits", lambda: hf(ids).logits,
       lambda: tunix_part(lambda m, x, p, k: m(x, p, None, k)[0])(
           jnp.asarray(tokens, jnp.int32), pos, mask)),
  ]


def run_comparison(cfg: dict, seed: int = 0) -> list[tuple[str, dict]]:
  import torch
  import rlk_torch_bridge as rtb
  pair = build(cfg, seed)
  tokens = np.random.default_rng(seed).integers(
      1, cfg["vocab_size"], (cfg["batch"], cfg["seq"]))
  device = "cuda" if torch.cuda.is_available() else "cpu"
  pair.hf.to(device)
  ids = torch.from_numpy(tokens).long().to(device)
  with torch.no_grad():
    plain = pair.hf(ids).logits.cpu()
  out = []
  with torch.no_grad(), rtb.batch_invariant_mode():
    ops = op_pairs(pair, tokens)
    for name, torch_fn, jax_fn in ops:
      want = torch_fn().cpu()
      out.append((name, compare(want, jax_fn())))
    # The scale of rounding noise in this model: the same torch model with
    # and without the mode (other kernels, each as exact as the other).
    out.append((NOISE_ROW, compare(pair.hf(ids).logits.cpu(), plain)))
  return out


def main(argv):
  del argv
  cfg = _config(harness.smoke_mode())
  print(f"{'op (first layer; inputs: the torch model own)':48s} "
        f"{'same bits':>10s} {'max diff / max':>15s}")
  for name, r in run_comparison(cfg):
    print(f"{name:48s} {r['same']:10.4f} {r['rel']:15.3g}")


if __name__ == "__main__":
  app.run(main)
